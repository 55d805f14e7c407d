"""tightfit's probe step (``tightfit.planner.probe.probe_step``: the runtime's ``training_step``
with the plan's optimizer, autocast and loss scaler) for ResNet-50 at 224, bf16 against fp16 at
the same micro-batch and checkpointed blocks, under a memory cap, beside the same model in a plain
PyTorch loop (autocast, ``GradScaler``, fused AdamW, one micro-batch per step). Asks why the GPU
planner's fp16 challenge timed fp16 slower than bf16 at micro-batch 86 x 3 with 3 blocks
(bench/results/recompute-2), where a plain loop runs fp16 faster (bench/results/session-2026-12-05d).

Usage: ``python3 bench/precision_probe.py [--cap-gib 4] [--micro-batch 86] [--blocks 3]``
(prints a Markdown table: each row's median step, samples/s and peak reserved memory).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tightfit.bench.workloads import BenchWorkload, make_workload  # noqa: E402
from tightfit.levers.blocks import find_blocks  # noqa: E402
from tightfit.levers.checkpointing import set_activation_checkpointing  # noqa: E402
from tightfit.planner.probe import probe_step  # noqa: E402


def plain(model, batch, precision: str, steps: int = 8) -> float:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0, fused=True)
    scaler = torch.amp.GradScaler(enabled=precision == "fp16", init_scale=1.0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    times = []
    for i in range(steps + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(pixel_values=batch["pixel_values"]).logits.float(),
                                                     batch["labels"])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cap-gib", type=float, default=4.0)
    ap.add_argument("--micro-batch", type=int, default=86)
    ap.add_argument("--blocks", type=int, default=3)
    args = ap.parse_args()
    budget = int(args.cap_gib * 2**30)
    torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory)
    mb = args.micro_batch
    wl = make_workload(BenchWorkload("resnet50-224@4GiB", "resnet50", 224, f"{args.cap_gib}GiB", 3 * mb), 3 * mb,
                       6 * mb)
    n = len(find_blocks(wl.model))
    blocks = tuple(range(args.blocks))
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, cap {args.cap_gib} GiB, ResNet-50 224, "
          f"{args.blocks} of {n} blocks checkpointed")
    print("| how | precision | micro-batch x steps | step ms | samples/s | peak reserved GiB |")
    print("|---|---|---|---|---|---|")
    for rep in range(2):  # twice, alternating, so that a drift in the host's speed shows
        for precision in ("bf16", "fp16"):
            set_activation_checkpointing(wl.model, True, blocks)
            r = probe_step(wl, mb, precision, budget, timed_steps=5, optimizer="adamw")
            set_activation_checkpointing(wl.model, False, ())
            if not r.fits or r.step_seconds is None:
                print(f"| tightfit probe | {precision} | {mb} x 3 | did not fit | | |", flush=True)
                continue
            samples = mb * r.micro_batches
            print(f"| tightfit probe | {precision} | {mb} x {r.micro_batches} (timed) | {1000 * r.step_seconds:.1f} | "
                  f"{samples / r.step_seconds:,.0f} | {r.peak_reserved_bytes / 2**30:.2f} |", flush=True)
    batch = {k: v.cuda() for k, v in wl.train.worst_case(mb).items()}
    set_activation_checkpointing(wl.model, True, blocks)
    for rep in range(2):
        for precision in ("bf16", "fp16"):
            torch.cuda.reset_peak_memory_stats()
            try:
                s = plain(wl.model.train(), batch, precision)
                print(f"| plain loop | {precision} | {mb} x 1 | {1000 * s:.1f} | {mb / s:,.0f} | "
                      f"{torch.cuda.max_memory_reserved() / 2**30:.2f} |", flush=True)
            except torch.OutOfMemoryError:
                print(f"| plain loop | {precision} | {mb} x 1 | out of memory | | |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
