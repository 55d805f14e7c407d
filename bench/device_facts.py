"""Measure the machine facts the levers past the card are costed with (run on the GPU machine).

Writes JSON to ``$OUT/device-facts.json`` (or stdout): pinned host<->device copy bandwidth
(bytes/s), the CPU's fused AdamW throughput (parameters/s, all cores), the GPU's AdamW and
torchao AdamW8bit step times for a 100M-parameter set, and whether torchao's
CPUOffloadOptimizer runs. Usage: ``python bench/device_facts.py``.
"""

import json
import os
import sys
import time

import torch


def timed(fn, repeat=5, cuda=True):
    fn()
    if cuda:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat


def main():
    facts = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
    n = 256 * 1024 * 1024  # bytes
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    facts["h2d_pinned_bytes_per_s"] = n / timed(lambda: dev.copy_(host, non_blocking=True))
    facts["d2h_pinned_bytes_per_s"] = n / timed(lambda: host.copy_(dev, non_blocking=True))
    pageable = torch.empty(n, dtype=torch.uint8)
    facts["h2d_pageable_bytes_per_s"] = n / timed(lambda: dev.copy_(pageable))
    del host, dev, pageable

    numel = 100_000_000
    for device in ("cpu", "cuda"):
        p = torch.nn.Parameter(torch.zeros(numel, device=device))
        p.grad = torch.randn(numel, device=device)
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        s = timed(opt.step, repeat=3, cuda=device == "cuda")
        facts[f"fused_adamw_{device}_params_per_s"] = numel / s
    try:
        import torchao
        from torchao.optim import AdamW8bit, CPUOffloadOptimizer
        facts["torchao"] = torchao.__version__
        p = torch.nn.Parameter(torch.zeros(numel // 4096, 4096, device="cuda"))
        p.grad = torch.randn_like(p)
        opt = AdamW8bit([p], lr=1e-4)
        facts["adamw8bit_cuda_params_per_s"] = numel / timed(opt.step, repeat=3)
        m = torch.nn.Linear(4096, 4096, device="cuda")
        off = CPUOffloadOptimizer(m.parameters(), torch.optim.AdamW, fused=True, offload_gradients=False)
        def off_step():
            m(torch.randn(8, 4096, device="cuda")).sum().backward()
            off.step()
            off.zero_grad()
        facts["cpu_offload_step_s_16.8M_params"] = timed(off_step, repeat=3)
    except Exception as e:  # noqa: BLE001 -- a fact too
        facts["torchao_error"] = f"{type(e).__name__}: {e}"[:500]
    text = json.dumps(facts, indent=2)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "device-facts.json"), "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
