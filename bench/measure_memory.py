"""Measure the peak GPU memory of training steps over the zoo, for the estimator's fixtures.

For every row: build the architecture (random fp32 weights) on the GPU, apply the
checkpointing, run three full training steps (:func:`tightfit.step.training_step`:
forward under autocast, backward, clipping, the optimizer step, zero_grad) and record the
caching allocator's peak allocated / reserved bytes (``torch.cuda.max_memory_*``) of the first
step and of all three, with a breakdown: parameter, gradient, optimizer-state and
saved-for-backward bytes (unique storages, rounded to the allocator's 512-byte blocks).

Each row runs in a fresh process (``--jobs`` of them at a time on the one GPU; peaks are per
process), so that no row inherits the allocator state of another: the estimator predicts a
fresh process.

Usage (from the repository root, on a CUDA machine):
    PYTHONPATH=. python bench/measure_memory.py --out tests/fixtures/memory/h200.json [--quick] [--jobs 6]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from tightfit.levers.precision import autocast
from tightfit.levers.blocks import apply_checkpointing
from tightfit.step import make_optimizer, training_loss, training_step
from tightfit.models import build_model

# (architecture, size: sequence length or image size, micro-batches)
ZOO = [
    ("minilm", 128, (8, 32, 64)),
    ("bert-base", 128, (32,)),
    ("bert-base", 512, (2, 8, 16)),
    ("bert-large", 128, (4, 16, 32)),
    ("gpt2", 512, (2, 4, 8)),
    ("vit-b16", 224, (8, 32, 64)),
    ("resnet50", 224, (8, 32, 64)),
]
# Extra rows: eager attention, frozen embeddings, a subset of checkpointed blocks.
EXTRA = [
    dict(arch="bert-base", size=128, micro_batch=16, precision=p, checkpointing="none", attn="eager")
    for p in ("fp32", "fp16", "bf16")
] + [
    dict(arch="bert-base", size=128, micro_batch=16, precision="fp16", checkpointing="none", freeze="embeddings"),
    dict(arch="bert-base", size=512, micro_batch=8, precision="bf16", checkpointing="0,2,4,6,8,10"),
    dict(arch="gpt2", size=512, micro_batch=4, precision="bf16", checkpointing="0,1,2,3,4,5"),
]

MIN_BLOCK = 512


def _rounded(n: int) -> int:
    return max(MIN_BLOCK, -(-n // MIN_BLOCK) * MIN_BLOCK)


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += _rounded(st.nbytes())
    return total


def workspace_bytes() -> int:
    """Bytes the cuBLAS/cuDNN handles keep allocated after a forward and backward of a linear
    layer and a convolution in each precision (allocated once per thread and stream)."""
    before = torch.cuda.memory_allocated()
    lin = torch.nn.Linear(256, 256, device="cuda")
    conv = torch.nn.Conv2d(8, 8, 3, device="cuda")
    for prec in ("fp32", "fp16", "bf16"):
        with autocast(prec, "cuda"):
            y = lin(torch.randn(64, 256, device="cuda")).sum() + conv(torch.randn(2, 8, 16, 16, device="cuda")).sum()
        y.backward()
    del lin, conv, y
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def run_step(model, batch: dict, optimizer, scaler, row: dict) -> None:
    """One training step of ``row`` on ``batch`` (one micro-batch, its mean loss)."""
    training_step(model, [batch], training_loss, 1, optimizer, scaler, lambda: autocast(row["precision"], "cuda"))


def measure(model, make_batch, row: dict) -> dict:
    """Three training steps of ``row``; returns the row with measured bytes."""
    apply_checkpointing(model, row["checkpointing"])
    for name, p in model.named_parameters():
        p.requires_grad_(not (row.get("freeze") and row["freeze"] in name))
    gc.collect()
    torch.cuda.empty_cache()
    batch = make_batch(row["micro_batch"], row["size"], device="cuda")
    optimizer = make_optimizer(model.parameters(), row.get("optimizer", "adamw"), "cuda")
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0) if row["precision"] == "fp16" else None
    saved: dict = {}
    grads: dict = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # records sizes only: holding the tensors would change the peak
        if t.device.type == "cuda" and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def on_grad(p):
        grads[p.grad.untyped_storage().data_ptr()] = p.grad.untyped_storage().nbytes()

    torch.cuda.synchronize()
    start_alloc, start_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    peaks = []
    for step in range(3):
        torch.cuda.reset_peak_memory_stats()
        if step == 0:
            hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in model.parameters() if p.requires_grad]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                run_step(model, batch, optimizer, scaler, row)
            for h in hooks:
                h.remove()
            del hooks
            saved_bytes = sum(_rounded(n) for n in saved.values())
            grad_bytes = sum(_rounded(n) for n in grads.values())
        else:
            run_step(model, batch, optimizer, scaler, row)
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.is_cuda]
    out = dict(row)
    out.update(
        peak_allocated_bytes=max(a for a, _ in peaks), peak_reserved_bytes=max(r for _, r in peaks),
        step1_peak_allocated_bytes=peaks[0][0], step1_peak_reserved_bytes=peaks[0][1],
        start_allocated_bytes=start_alloc, start_reserved_bytes=start_reserved,
        breakdown=dict(parameters=_storage_bytes(list(model.parameters()) + list(model.buffers())),
                       gradients=grad_bytes, optimizer_state=_storage_bytes(state), activations=saved_bytes,
                       batch=_storage_bytes(batch.values())),
        optimizer_params_with_state=len(optimizer.state),
        steps_peak_allocated_bytes=[a for a, _ in peaks], steps_peak_reserved_bytes=[r for _, r in peaks])
    del optimizer, batch, state, scaler
    for p in model.parameters():
        p.grad = None
        p.requires_grad_(True)
    return out


def rows(quick: bool):
    for arch, size, batches in ZOO:
        for prec in ("fp32", "fp16", "bf16"):
            for ckpt in ("none", "all"):
                for mb in (batches[:1] if quick else batches):
                    yield dict(arch=arch, size=size, micro_batch=mb, precision=prec, checkpointing=ckpt)
    if not quick:
        yield from EXTRA


def measure_row(row: dict) -> dict:
    """Build ``row``'s architecture (seed 0, fp32 weights on the GPU) and measure it."""
    torch.manual_seed(0)
    model, make_batch = build_model(row["arch"], device="cpu", attn_implementation=row.get("attn", "sdpa"))
    try:
        return measure(model.to("cuda"), make_batch, row)
    except torch.OutOfMemoryError as e:
        return dict(row, error=f"out of memory: {str(e).splitlines()[0]}")


def run_fresh(row: dict) -> dict:
    """``row`` measured in a new Python process (``--row``)."""
    cmd = [sys.executable, __file__, "--row", json.dumps(row)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH="."))
    if p.returncode != 0:
        return dict(row, error=p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"exit {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="one micro-batch per architecture")
    ap.add_argument("--jobs", type=int, default=6, help="rows measured at a time (one process each)")
    ap.add_argument("--row", help=argparse.SUPPRESS)  # internal: measure this JSON row, print it
    ap.add_argument("--snapshot", help="with --row: also write the allocator's event history (torch.cuda.memory "
                    "snapshot, Python stacks) to this pickle, to see what is live at the peak")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("measure_memory: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.row:
        if args.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        print(json.dumps(measure_row(json.loads(args.row))))
        if args.snapshot:
            torch.cuda.memory._dump_snapshot(args.snapshot)
        return 0
    if not args.out:
        ap.error("--out is required")
    import transformers

    t0 = time.time()
    header = dict(command="PYTHONPATH=. python " + " ".join(sys.argv), torch=torch.__version__,
                  transformers=transformers.__version__, python=platform.python_version(),
                  gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                  cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                  workspace_bytes=workspace_bytes(), steps=3, optimizer="AdamW(fused=True, weight_decay=0.01)",
                  grad_scaler="GradScaler(init_scale=1024) for fp16", max_grad_norm=1.0,
                  process="one fresh process per row")
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        header["allocator"] = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    todo = list(rows(args.quick))
    results = []
    with ThreadPoolExecutor(args.jobs) as pool:
        for res in pool.map(run_fresh, todo):  # in row order; written after each, so a cut-short run keeps a prefix
            results.append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "breakdown"}), flush=True)
            tmp = args.out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(dict(header=header, rows=results, seconds=round(time.time() - t0, 1)), f, indent=1)
            os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
