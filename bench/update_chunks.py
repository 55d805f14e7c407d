"""``adamw8bit-bf16``'s update over BERT-large's bf16 parameters, one variant per process.

For the variant named on the command line, in a process of its own (so that none reuses another's
compiled kernels; run with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1`` for cold compilation, as a first
plan on a fresh machine has): the first step's wall time (compilation included), then over 10
steps the median of the host time of ``step()`` (until it returns, the GPU's work queued) and of
the wall time with the GPU synchronised, and the memory the step allocated above what was
allocated before it (its temporaries: the peak of ``max_memory_allocated`` less the allocated
bytes at its start).

    OUT=folder python3 bench/update_chunks.py chunked|lone|per-tensor -> OUT/update_chunks-<variant>.json
    DEVICE=cpu LAYERS=4 ...   # a CPU's cold compilation as a proxy (the graphs are the same; host times meaningless)

``chunked``: tightfit's update (the small tensors in one flat call, the 8-bit ones in chunks of up
to ``CHUNK_ELEMENTS`` elements, ``tightfit.levers.optimizers._compiled_chunk_update``); ``lone``:
every 8-bit tensor alone through the same graph (``CHUNK_ELEMENTS = 0``); ``per-tensor``: one
compiled call per tensor, the small ones included (``_compiled_update``, the update before the
flat and chunked calls). Each row also gives checksums of the 8-bit moments (codes and block
scales) and of the weights after the 11 steps, to compare variants' results (the moments must
agree; the weights' stochastic rounding may draw otherwise).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu: the first step's compilation as a proxy (host times meaningless)
LAYERS = int(os.environ.get("LAYERS", "0"))  # 0: all of BERT-large's 24


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main(variant: str) -> None:
    from tightfit.levers import optimizers
    from tightfit.models import build_model

    if variant == "per-tensor":
        optimizers.FLAT_SMALL_TENSORS = False
        optimizers._bf16_class()._chunkable = lambda self, p: False
    elif variant == "lone":
        optimizers.CHUNK_ELEMENTS = 0
    elif variant != "chunked":
        raise SystemExit(f"unknown variant {variant!r}")
    torch.manual_seed(0)
    model, _ = build_model("bert-large", device="cpu")
    if LAYERS:  # the first LAYERS layers only (a CPU's compilation proxy: the graphs are the same)
        del model.bert.encoder.layer[LAYERS:]
    ps = [torch.nn.Parameter(p.detach().to(DEVICE, torch.bfloat16)) for p in model.parameters()]
    del model
    g = torch.Generator(device=DEVICE).manual_seed(1)
    grads = [torch.randn(p.shape, device=DEVICE, generator=g).mul_(1e-3).bfloat16() for p in ps]
    opt = optimizers.adamw_8bit_bf16(ps, 1e-4, 0.01)
    for p, gr in zip(ps, grads):
        p.grad = gr
    sync()
    t = time.perf_counter()
    opt.step()
    sync()
    first = time.perf_counter() - t
    calls = len(optimizers.bf16_update_calls([p.shape for p in ps]))
    host, wall, extra = [], [], []
    for _ in range(10 if DEVICE == "cuda" else 2):
        sync()
        before = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        opt.step()
        host.append(time.perf_counter() - t)
        sync()
        wall.append(time.perf_counter() - t)
        extra.append(torch.cuda.max_memory_allocated() - before if DEVICE == "cuda" else 0)
    row = {"variant": variant, "device": DEVICE, "layers": LAYERS or 24, "tensors": len(ps), "compiled_calls_per_step": calls, "first_step_s": first,
           "host_ms": statistics.median(host) * 1e3, "step_ms": statistics.median(wall) * 1e3,
           "temporaries_MiB": max(extra) / 2**20 if DEVICE == "cuda" else None,  # not measured on a CPU
           "flat_small_tensors": optimizers.FLAT_SMALL_TENSORS, **checksums(opt, ps), "torch": torch.__version__,
           "inductor_caches": "off" if os.environ.get("TORCHINDUCTOR_FORCE_DISABLE_CACHES") == "1" else "on"}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"update_chunks-{variant}.json").write_text(json.dumps(row, indent=1))
    print(row, flush=True)


def checksums(opt, ps) -> dict:
    """Sums over every 8-bit moment's codes (as integers) and block scales, and over the weights (fp64)."""
    codes, scales = 0, 0.0
    for p in ps:
        for key in ("exp_avg", "exp_avg_sq"):
            m = opt.state[p][key]
            if hasattr(m, "codes"):
                codes += int(m.codes.to(torch.int64).sum())
                scales += float(m.scale.double().sum())
            else:
                scales += float(m.double().sum())
    return {"moment_codes_sum": codes, "moment_scales_sum": scales,
            "weights_sum": sum(float(p.detach().double().sum()) for p in ps)}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chunked")
