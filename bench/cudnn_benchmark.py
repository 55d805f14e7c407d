"""Does cuDNN's autotuner (``torch.backends.cudnn.benchmark``) change a convolutional step's
speed or memory at the micro-batches a 4 GiB plan runs? ResNet-50 (HF
``ResNetForImageClassification``, random weights, channels-last) eager on CUDA, bf16 and fp16
autocast, fused AdamW, at micro-batch 86 (the 4 GiB plan's) and 256 (the no-budget batch),
with the autotuner off (tightfit's default so far) and on; optionally under a memory cap.

Each row: median of 10 timed steps after 3 warm-ups (the autotuner benchmarks each new shape in
the first step), peak allocated and reserved memory over all 13 steps.

Usage: ``python3 bench/cudnn_benchmark.py [--cap-gib 4] [--batches 86,256]`` (prints a Markdown table).
"""
import argparse
import statistics
import time

import torch
from transformers import ResNetConfig, ResNetForImageClassification


def run(precision: str, benchmark: bool, mb: int) -> str:
    torch.backends.cudnn.benchmark = benchmark
    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048],
                                                      layer_type="bottleneck", num_labels=1000)).cuda().train()
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    x = torch.randn(mb, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (mb,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for i in range(13):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=dtype):
                loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits.float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t)
        s = statistics.median(times)
        row = (f"| {precision} | {'on' if benchmark else 'off'} | {mb} | {mb / s:,.0f} | "
               f"{torch.cuda.max_memory_allocated() / 2**30:.2f} | {torch.cuda.max_memory_reserved() / 2**30:.2f} |")
    except torch.OutOfMemoryError:
        row = f"| {precision} | {'on' if benchmark else 'off'} | {mb} | out of memory | | |"
    del model, opt, x
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap-gib", type=float, default=None)
    ap.add_argument("--batches", default="86,256")
    args = ap.parse_args()
    if args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * 2**30 / total)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"cap {args.cap_gib or 'none'} GiB")
    print("| precision | cudnn.benchmark | micro-batch | samples/s | peak allocated GiB | peak reserved GiB |")
    print("|---|---|---|---|---|---|")
    for mb in (int(b) for b in args.batches.split(",")):
        for precision in ("bf16", "fp16"):
            for benchmark in (False, True):
                print(run(precision, benchmark, mb), flush=True)


if __name__ == "__main__":
    main()
