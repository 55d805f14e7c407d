"""Eager vs ``torch.compile`` training steps of one benchmark workload, under its budget.

For each setting (compile on/off, precision, micro-batch, checkpointed blocks) this trains
``--steps`` optimizer steps of the workload's effective batch with tightfit's runtime and
prints one JSON line: samples/s after the warm-up, the first step's seconds (compilation
included), peak allocated / reserved bytes and OOM recoveries.

Usage (on a CUDA machine, from the repository root):
    PYTHONPATH=. python bench/compile_probe.py --workload bert-base-128@4GiB \
        --setting eager,bf16,64,0 --setting compile,bf16,64,0 --setting compile,bf16,256,12
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tightfit.bench.settings import cap_memory, clean, timed_run
from tightfit.bench.workloads import get_workload, make_workload
from tightfit.plan import Plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--setting", action="append", required=True,
                    help="MODE,PRECISION,MICRO_BATCH,BLOCKS[,nobudget]: MODE eager|compile|compile-F (F: "
                         "torch._functorch.config.activation_memory_budget, selective recomputation chosen by "
                         "the compiler's partitioner), BLOCKS checkpointed from 0")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    args = ap.parse_args()
    w = get_workload(args.workload)
    for s in args.setting:
        mode, prec, mb, blocks, *rest = s.split(",")
        mb, blocks = int(mb), int(blocks)
        budget = None if rest and rest[0] == "nobudget" else w.budget_bytes
        cap_memory(budget)
        wl = make_workload(w, w.effective_batch, w.effective_batch * args.steps)
        if mode.startswith("compile"):  # the runtime compiles (Plan.compile); this is read at compilation
            torch._functorch.config.activation_memory_budget = float(mode[8:]) if mode != "compile" else 1.0
        plan = Plan(prec, mb, w.effective_batch, blocks > 0, device="cuda",
                    checkpoint_blocks=tuple(range(blocks)) if blocks else None, compile=mode.startswith("compile"))
        t0 = time.perf_counter()
        try:
            row = timed_run(wl, plan, args.steps, args.warmup)
        except Exception as e:  # report and go on with the next setting
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row.update(setting=s, wall_s=time.perf_counter() - t0)
        print(json.dumps(row), flush=True)
        del wl
        torch._dynamo.reset()
        clean()


if __name__ == "__main__":
    main()
