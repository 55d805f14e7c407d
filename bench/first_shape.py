"""Why an eager training step at a batch shape met for the first time is slow (issue 12).

    python3 bench/first_shape.py OUTDIR            # every variant, each in a fresh process
    python3 bench/first_shape.py OUTDIR VARIANT    # one variant, in this process

The main job's whole run lost ~0.1 s at each of four eager steps of a shape met for the first
time (115-130 ms against ~15 ms; bench/results/checkpoint-schedule), with cProfile putting ~8 ms
in every one of the step's 6 ``scaled_dot_product_attention`` calls and ~60 ms in the backward.
This script trains the shipped MiniLM (``TIGHTFIT_DEFAULT_MODEL``) eagerly as a tightfit text run
does (bf16 autocast, fused AdamW, the prepared 4-D boolean mask of ``tightfit.masks``), warm at
32 x 64 tokens, then steps shapes met for the first time, each twice (cold, then warm), the
host synchronised around every step so that no queued work is counted. It does the same for the
attention op alone (MiniLM's q/k/v shapes, forward and backward). The first cold shape runs
under ``torch.profiler``; its CPU-side table (CUDA runtime calls included) is printed.

Variants: ``default`` (cuDNN's attention off, as a tightfit text run), ``cudnn`` (PyTorch's
choice), ``efficient`` / ``math`` (SDPA forced to that backend), ``mask-2d`` (the model's own
2-D mask path), ``eager-loading`` (``CUDA_MODULE_LOADING=EAGER``: is the cost lazy kernel
loading?). Writes ``OUTDIR/first-shape-VARIANT.json`` and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("default", "cudnn", "efficient", "math", "mask-2d", "eager-loading")
WARM = (32, 64)
SHAPES = ((32, 40), (7, 56), (7, 64), (7, 40), (16, 64), (32, 48))


def run(outdir: Path, variant: str) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForSequenceClassification

    from tightfit.masks import model_inputs

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    torch.zeros(1, device=dev)
    init_s = time.perf_counter() - t0
    model = AutoModelForSequenceClassification.from_pretrained(
        os.environ["TIGHTFIT_DEFAULT_MODEL"], num_labels=2, attn_implementation="sdpa",
        torch_dtype=torch.float32).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if variant != "cudnn":
        torch.backends.cuda.enable_cudnn_sdp(False)
    backend = {"efficient": [SDPBackend.EFFICIENT_ATTENTION], "math": [SDPBackend.MATH]}.get(variant)
    g = torch.Generator(device=dev).manual_seed(0)

    def batch(b, t):
        mask = torch.ones(b, t, dtype=torch.long, device=dev)
        mask[0, t - 3:] = 0
        return {"input_ids": torch.randint(1000, 20000, (b, t), device=dev, generator=g),
                "attention_mask": mask, "token_type_ids": torch.zeros(b, t, dtype=torch.long, device=dev),
                "labels": torch.randint(0, 2, (b,), device=dev, generator=g)}

    def step(b, t):
        data = batch(b, t)
        inputs = dict(data) if variant == "mask-2d" else model_inputs(model, data)
        inputs.pop("labels", None)
        with torch.autocast("cuda", torch.bfloat16), (sdpa_kernel(backend) if backend else _null()):
            logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float(), data["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn, *a):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*a)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    result = {"variant": variant, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING"), "cuda_init_s": round(init_s, 3),
              "first_steps_ms": [], "shapes": []}
    for _ in range(10):
        result["first_steps_ms"].append(round(timed(step, *WARM), 2))
    for i, (b, t) in enumerate(SHAPES):
        if i == 0:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                cold = timed(step, b, t)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (outdir / f"first-shape-{variant}-profile.txt").write_text(table)
        else:
            cold = timed(step, b, t)
        warm = timed(step, b, t)
        result["shapes"].append({"shape": [b, t], "cold_ms": round(cold, 2), "warm_ms": round(warm, 2)})

    # the attention op alone: q/k/v [B, 12, T, 32] bf16, the prepared mask, forward and backward
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads

    def attention(b, t):
        q, k, v = (torch.randn(b, heads, t, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        mask = torch.ones(b, t, dtype=torch.bool, device=dev)
        mask[0, t - 3:] = False
        mask = mask[:, None, None, :].expand(-1, 1, t, -1)
        with sdpa_kernel(backend) if backend else _null():
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
        out.sum().backward()

    result["attention"] = []
    for b, t in ((12, 24), (5, 72), (3, 40)):  # shapes the model steps above never met
        cold = timed(attention, b, t)
        result["attention"].append({"shape": [b, t], "cold_ms": round(cold, 2),
                                    "warm_ms": round(timed(attention, b, t), 2)})
    (outdir / f"first-shape-{variant}.json").write_text(json.dumps(result, indent=1))
    return result


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main() -> None:
    outdir = Path(sys.argv[1])
    outdir.mkdir(parents=True, exist_ok=True)
    if len(sys.argv) > 2:
        run(outdir, sys.argv[2])
        return
    rows = []
    for variant in VARIANTS:
        env = dict(os.environ, **({"CUDA_MODULE_LOADING": "EAGER"} if variant == "eager-loading" else {}))
        try:
            proc = subprocess.run([sys.executable, __file__, str(outdir), variant], env=env, capture_output=True,
                                  text=True, timeout=60)
        except subprocess.TimeoutExpired:
            rows.append(f"| {variant} | timed out (60 s) |")
            continue
        (outdir / f"first-shape-{variant}.log").write_text(proc.stdout + proc.stderr)
        path = outdir / f"first-shape-{variant}.json"
        if proc.returncode or not path.exists():
            rows.append(f"| {variant} | failed (exit {proc.returncode}) |")
            continue
        r = json.loads(path.read_text())
        shapes = ", ".join(f"{s['shape'][0]}x{s['shape'][1]} {s['cold_ms']:.0f}/{s['warm_ms']:.0f}"
                           for s in r["shapes"])
        attn = ", ".join(f"{s['shape'][0]}x{s['shape'][1]} {s['cold_ms']:.1f}/{s['warm_ms']:.1f}"
                         for s in r["attention"])
        steps = r["first_steps_ms"]
        rows.append(f"| {variant} | {r['cuda_init_s']:.2f} | {steps[0]:.0f}, then {min(steps[1:]):.1f} | "
                    f"{shapes} | {attn} |")
    print("| variant | CUDA init (s) | steps at 32x64 (ms): first, then best | new shapes, cold/warm ms "
          "| attention alone, cold/warm ms |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
