"""The GPU memory an optimizer's update holds above its state while it runs, per tensor size.

For each optimizer kind and each 2-D tensor shape: one parameter on CUDA (bf16 for
``adamw8bit-bf16``, fp32 for the others) with a gradient, the optimizer made by
``tightfit.step.make_optimizer``; a first step (state allocated, the update compiled), then a
second step measured: bytes allocated before it, the peak during it (``max_memory_allocated``
after ``reset_peak_memory_stats``), so ``peak - before`` is what the update holds above the
weights, gradients and state. Also the first step's peak above ``before + state``. The ratio to
the element count gives the bytes per element that the estimator's stand-in
(``tightfit.step.MetaOptimizer``) should allocate while the update runs.

    OUT=folder python3 bench/optimizer_temporaries.py [kind ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
SHAPES = [(1024, 1024), (4096, 1024), (4096, 4096), (30522, 1024), (8192, 8192), (16384, 256), (256, 512)]


def measure(kind: str, shape: tuple[int, int]) -> dict:
    from tightfit.step import make_optimizer

    dtype = torch.bfloat16 if kind == "adamw8bit-bf16" else torch.float32
    p = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=dtype) * 0.02)
    p.grad = torch.randn(shape, device="cuda", dtype=dtype) * 1e-3
    opt = make_optimizer([p], kind, "cuda", lr=1e-4)
    torch.cuda.synchronize()
    before_first = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() - before_first
    first_peak = torch.cuda.max_memory_allocated() - before_first
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    held = torch.cuda.max_memory_allocated() - before
    n = p.numel()
    del opt, p
    torch.cuda.empty_cache()
    return {"kind": kind, "shape": list(shape), "numel": n, "state_bytes": state,
            "first_step_above_state_bytes": first_peak - state, "step_above_state_bytes": held,
            "step_bytes_per_element": round(held / n, 3)}


def main() -> None:
    kinds = sys.argv[1:] or ["adamw8bit-bf16", "adamw8bit", "adamw"]
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for kind in kinds:
        for shape in SHAPES:
            try:
                row = measure(kind, shape)
            except Exception as e:  # a library missing: say so, go on
                row = {"kind": kind, "shape": list(shape), "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"command": "OUT=... python3 bench/optimizer_temporaries.py " + " ".join(sys.argv[1:]),
              "code": rev, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    (OUT / "optimizer_temporaries.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
