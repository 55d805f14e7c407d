"""The compiler's activation memory budget as a lever: peak memory and step time of a compiled
step at several ``torch._functorch.config.activation_memory_budget`` values, beside whole-block
checkpointing of the compiled blocks (what tightfit's compiled stage chooses among today).

The budget is the min-cut partitioner's knob (1.0: its default choice of saved tensors; lower:
it recomputes the cheapest ops in backward until the saved activations are at most that share of
the default). Each budget is a new compilation (dynamo reset, compile caches off).

Rows: (workload, micro-batch, budget, checkpointed blocks) -> peak reserved / allocated bytes and
the median of 5 timed steps (``tightfit.planner.probe.probe_step``, uncapped; the fit against the
budget's 95% is computed from the peak).

Usage (repository root, CUDA machine):
    TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 PYTHONPATH=.:$PYTHONPATH python bench/compiled_budget.py OUT
Env: BUDGET_OPTIMIZER (default adamw; e.g. adamw8bit-bf16, whose bf16 weights and 8-bit state leave
more of 4 GiB to activations) picks the probes' optimizer and its row set (:data:`ROWS_8BIT`).
"""

from __future__ import annotations

import json
import sys
import time

import torch

from tightfit.bench.workloads import get_workload, make_workload
from tightfit.levers.blocks import find_blocks
from tightfit.levers.checkpointing import set_activation_checkpointing
from tightfit.levers.compile import compile_model, uncompile_model
from tightfit.planner.probe import probe_step

ROWS = {  # workload -> [(micro-batch, budget, checkpointed blocks)]
    "bert-base-128@4GiB": [(256, 1.0, 0), (256, 1.0, 11), (256, 1.0, 12), (256, 0.5, 0), (256, 0.3, 0),
                           (256, 0.15, 0), (256, 0.05, 0), (256, 0.15, 4), (256, 0.3, 6)],
}
ROWS_8BIT = {  # adamw8bit-bf16: the planner's 4 GiB choice is 256 x 1 with 10 blocks checkpointed
    "bert-base-128@4GiB": [(256, 1.0, 10), (64, 1.0, 0), (256, 0.5, 0), (256, 0.3, 0), (256, 0.2, 0), (256, 0.15, 0),
                           (256, 0.1, 0), (256, 0.05, 0), (256, 0.1, 2), (256, 0.05, 2)],
}


def main(out: str) -> None:
    import os
    os.makedirs(out, exist_ok=True)
    optimizer = os.environ.get("BUDGET_OPTIMIZER", "adamw")
    rows = []
    for name, settings in (ROWS if optimizer == "adamw" else ROWS_8BIT).items():
        w = get_workload(name)
        wl = make_workload(w, w.effective_batch, 4 * w.effective_batch)
        n = len(find_blocks(wl.model))
        current = None
        for mb, budget, k in settings:
            if budget != current:
                uncompile_model(wl.model)
                torch._dynamo.reset()
                torch._functorch.config.activation_memory_budget = budget
                compile_model(wl.model)
                current = budget
            set_activation_checkpointing(wl.model, bool(k), tuple(range(k)) if k else None)
            t0 = time.perf_counter()
            pr = probe_step(wl, mb, "bf16", 1 << 50, timed_steps=5, optimizer=optimizer)
            row = dict(workload=name, optimizer=optimizer, micro_batch=mb, budget=budget, checkpointed=k, blocks=n,
                       peak_reserved=pr.peak_reserved_bytes, peak_allocated=pr.peak_allocated_bytes,
                       step_s=pr.step_seconds, samples_per_s=mb * pr.micro_batches / pr.step_seconds if pr.step_seconds else None,
                       fits=bool(pr.peak_reserved_bytes and pr.peak_reserved_bytes <= 0.95 * w.budget_bytes),
                       wall_s=time.perf_counter() - t0)
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
        with open(f"{out}/compiled_budget.json", "w") as f:
            json.dump(rows, f, indent=1)
    print("| workload | micro-batch | budget | ckpt blocks | peak reserved GiB | samples/s | fits |")
    for r in rows:
        print(f"| {r['workload']} | {r['micro_batch']} | {r['budget']} | {r['checkpointed']} | "
              f"{(r['peak_reserved'] or 0) / 2**30:.2f} | {r['samples_per_s'] or 0:.0f} | {r['fits']} |")


if __name__ == "__main__":
    main(sys.argv[1])
