"""Issue 17: a compiled step without recomputation at a smaller micro-batch (more accumulation
steps), blocks compiled one by one against one whole-model graph, with the 4 GiB cap and
without it. BERT-base seq 128, effective batch 256, bf16 autocast, 8-bit AdamW with bf16
weights (the planner's optimizer at 4 GiB).

Why: the planner's compiled stage probed 64 x 4 with no block checkpointed at 1,648 samples/s
(fits, 3.53 GiB) against 3,246 for 256 x 1 with 10 blocks recomputed (NVIDIA H100,
bench/results/recompute-4); uncapped, the same 64 x 4 per-block step ran 2,782. A step of four
micro-batches of 64 launches each block's compiled forward and backward four times: it may be
bound by the host that launches them, which one graph per pass would relieve.

Rows: (scope, micro-batch, checkpointing, capped) -> peak reserved, samples/s (``probe_step``,
1 + 5 timed steps, the median). Scope ``eager`` runs the rows uncompiled; ``model-ro``
compiles the whole model with ``mode="reduce-overhead"`` (CUDA graphs, static shapes); ``model-graphs``
is tightfit's lever of the same (compile scope ``GRAPHED``: the batch dimension dynamic, gradients
outside the graphs' pool). Env (another workload's
sweep): ``SWEEP_WORKLOAD`` (a bench workload, default bert-base-128@4GiB), ``SWEEP_PRECISION``
(bf16), ``SWEEP_OPTIMIZER`` (adamw8bit-bf16), ``SWEEP_ROWS`` (a JSON list of the rows' 4-lists).
Usage (repository root, CUDA machine):
    PYTHONPATH=.:$PYTHONPATH python bench/whole_graph_accumulation.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from tightfit.bench.workloads import get_workload, make_workload
from tightfit.levers.blocks import find_blocks
from tightfit.levers.checkpointing import set_activation_checkpointing
from tightfit.levers.compile import GRAPHED, WHOLE_MODEL, compile_model, compiled_call, set_compiled_call, uncompile_model
from tightfit.planner.probe import probe_step

# (scope, micro-batch, checkpointing: None none / "model" the model's own hook on every block /
# int: the first n blocks around their compiled call / a string: policies per block, "2xoffload+10xfull",
# capped)
ROWS = [("blocks", 256, 10, True), ("blocks", 64, None, True), ("blocks", 64, None, False),
        ("model", 64, None, True), ("model", 64, None, False), ("model", 86, None, True),
        ("model", 128, "model", True), ("model", 256, "model", True)]


def _policies(spec: str, n: int) -> tuple[str, ...]:
    """``"2xoffload+10xfull"`` -> the first 2 blocks offloaded, the next 10 fully recomputed, the
    rest of the ``n`` blocks ``none``."""
    out = []
    for part in spec.split("+"):
        k, policy = part.split("x")
        out += [policy] * int(k)
    return tuple(out + ["none"] * (n - len(out)))


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    rows_asked = json.loads(os.environ["SWEEP_ROWS"]) if os.environ.get("SWEEP_ROWS") else ROWS
    precision = os.environ.get("SWEEP_PRECISION", "bf16")
    optimizer = os.environ.get("SWEEP_OPTIMIZER", "adamw8bit-bf16")
    w = get_workload(os.environ.get("SWEEP_WORKLOAD", "bert-base-128@4GiB"))
    wl = make_workload(w, w.effective_batch, 4 * w.effective_batch)
    total = torch.cuda.get_device_properties(0).total_memory
    rows, scope_now = [], None
    for scope, mb, ckpt, capped in rows_asked:
        if scope != scope_now:
            uncompile_model(wl.model)
            set_compiled_call(wl.model, None)
            torch._dynamo.reset()
            if scope == "model-ro":  # CUDA graphs (cudagraph trees) inside the cap, shapes static
                wl.model.compile(mode="reduce-overhead")
                ro = compiled_call(wl.model)

                def fresh(*args, ro=ro, **kwargs):  # each micro-batch a new step of the trees
                    torch.compiler.cudagraph_mark_step_begin()
                    return ro(*args, **kwargs)
                set_compiled_call(wl.model, fresh)
            elif scope == "model-graphs":  # tightfit's lever: reduce-overhead, batch dimension dynamic, StableGrads
                compile_model(wl.model, GRAPHED)
            elif scope != "eager":
                compile_model(wl.model, WHOLE_MODEL if scope == "model" else None)
            scope_now = scope
        if ckpt == "model":
            set_activation_checkpointing(wl.model, True, None)
        elif isinstance(ckpt, str):  # policies per block, e.g. "2xoffload+10xfull" (the rest: none)
            set_activation_checkpointing(wl.model, True, None, policies=_policies(ckpt, len(find_blocks(wl.model))))
        else:
            set_activation_checkpointing(wl.model, bool(ckpt), tuple(range(ckpt)) if ckpt else None)
        torch.cuda.set_per_process_memory_fraction(w.budget_bytes / total if capped else 1.0)
        t0 = time.perf_counter()
        try:
            pr = probe_step(wl, mb, precision, w.budget_bytes, timed_steps=5, optimizer=optimizer)
            rate = mb * pr.micro_batches / pr.step_seconds if pr.step_seconds else None
            row = dict(scope=scope, micro_batch=mb, checkpointing=ckpt, capped=capped,
                       peak_reserved=pr.peak_reserved_bytes, samples_per_s=rate, fits=pr.fits,
                       micro_batches=pr.micro_batches)
        except Exception as e:  # noqa: BLE001 - a row's failure is its result
            row = dict(scope=scope, micro_batch=mb, checkpointing=ckpt, capped=capped, error=str(e)[:300])
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    name = os.environ.get("SWEEP_WORKLOAD", "").replace("@", "-at-") or "whole_graph_accumulation"
    with open(f"{out}/{name}.json", "w") as f:
        json.dump({"workload": w.name, "precision": precision, "optimizer": optimizer, "rows": rows}, f, indent=1)
    for r in rows:
        print(f"| {r['scope']} | {r['micro_batch']} | {r['checkpointing']} | {r['capped']} | "
              f"{(r.get('peak_reserved') or 0) / 2**30:.2f} | {r.get('samples_per_s') or 0:.0f} | {r.get('fits')} |")


if __name__ == "__main__":
    main(sys.argv[1])
