"""ResNet-50 training step (HF ResNetForImageClassification, random weights) eager on CUDA:
bf16 and fp16 autocast, NCHW and channels-last, at micro-batch 64 and 256; median of 10 timed
steps after 3 warm-ups, fused AdamW, peak allocated memory. Usage: python3 bench/conv_layout.py
"""
import statistics
import time

import torch
from transformers import ResNetConfig, ResNetForImageClassification

torch.backends.cudnn.benchmark = True


def run(precision, channels_last, mb):
    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048],
                                                      layer_type="bottleneck", num_labels=1000)).cuda().train()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler(enabled=precision == "fp16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    x = torch.randn(mb, 3, 224, 224, device="cuda").contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (mb,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(13):
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.autocast("cuda", dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(pixel_values=x).logits.float(), y)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t)
    s = statistics.median(times)
    print(f"| {precision} | {'channels-last' if channels_last else 'NCHW'} | {mb} | {mb / s:,.0f} | "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} |", flush=True)
    del model, opt, x
    torch.cuda.empty_cache()


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
print("| precision | layout | micro-batch | samples/s | peak allocated GiB |\n|---|---|---|---|---|")
for mb in (64, 256):
    for prec in ("bf16", "fp16"):
        for cl in (False, True):
            run(prec, cl, mb)
