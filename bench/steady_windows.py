"""Issue 12: does a compiled BERT-base run at 4 GiB deliver its probe's speed, and if not, is it
the loop or the GPU's clocks? The planner's 4 GiB plan for BERT-base seq 128 (8-bit AdamW with
bf16 weights, 256 x 1, the first 10 of 12 blocks checkpointed, blocks compiled one by one) is
built directly (no planning), probed (``probe_step``, 1 + 5 timed steps, the median), run for
STEPS steps by the Trainer (as ``tightfit bench`` times it: each step's end as the loop read it),
and probed again; the run's rate is given per window of 25 steps, with the GPU's SM clock and
power sampled every 0.1 s by NVML meanwhile.

Usage (repository root, CUDA machine): PYTHONPATH=.:$PYTHONPATH python bench/steady_windows.py OUT [STEPS]
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch

from tightfit.bench.settings import cap_memory
from tightfit.bench.workloads import get_workload, make_workload
from tightfit.levers.checkpointing import set_activation_checkpointing
from tightfit.levers.compile import compile_model
from tightfit.plan import Plan
from tightfit.planner.probe import probe_step
from tightfit.runtime.trainer import TrainConfig, Trainer


def clocks(stop: threading.Event, samples: list) -> None:
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    t0 = time.perf_counter()
    while not stop.is_set():
        samples.append((time.perf_counter() - t0, pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                        pynvml.nvmlDeviceGetPowerUsage(h) / 1000, pynvml.nvmlDeviceGetTemperature(h, 0)))
        time.sleep(0.1)


def main(out: str, steps: int) -> None:
    os.makedirs(out, exist_ok=True)
    w = get_workload("bert-base-128@4GiB")
    cap_memory(w.budget_bytes)
    wl = make_workload(w, w.effective_batch, w.effective_batch * steps)
    blocks = tuple(range(10))
    opt = "adamw8bit-bf16"
    compile_model(wl.model)

    def probe(tag):
        set_activation_checkpointing(wl.model, True, blocks)
        pr = probe_step(wl, 256, "bf16", w.budget_bytes, timed_steps=5, optimizer=opt)
        set_activation_checkpointing(wl.model, False, ())
        rate = 256 / pr.step_seconds if pr.step_seconds else None
        print(f"probe {tag}: {rate:.0f} samples/s, peak reserved {pr.peak_reserved_bytes / 2**30:.2f} GiB", flush=True)
        return rate

    before = probe("before")
    plan = Plan("bf16", 256, 256, True, optimizer=opt, device="cuda", budget_bytes=w.budget_bytes,
                checkpoint_blocks=blocks, compile=True)
    stop, samples = threading.Event(), []
    watcher = threading.Thread(target=clocks, args=(stop, samples), daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    res = Trainer(wl, plan, TrainConfig(epochs=1, max_steps=steps, lr=1e-5, checkpoint_dir=None, warmup_ratio=0.0),
                  progress=False).fit()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    ends = [e for e, _ in res.step_ends]
    windows = [(i, 256 * 25 / (ends[i + 25] - ends[i])) for i in range(3, len(ends) - 25, 25)]
    for i, r in windows:
        print(f"steps {i + 1}-{i + 25}: {r:.0f} samples/s", flush=True)
    after = probe("after")
    run_rate = 256 * (len(ends) - 3) / (ends[-1] - ends[2])
    sm = [s[1] for s in samples]
    summary = dict(probe_before=before, probe_after=after, run_after_3=run_rate, wall_s=wall, windows=windows,
                   sm_clock_mhz=dict(min=min(sm), max=max(sm), median=sorted(sm)[len(sm) // 2]) if sm else None,
                   power_w_max=max((s[2] for s in samples), default=None),
                   temp_c_max=max((s[3] for s in samples), default=None), clock_samples=samples[::5])
    print(json.dumps({k: v for k, v in summary.items() if k not in ("windows", "clock_samples")}), flush=True)
    with open(f"{out}/steady_windows.json", "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 300)
