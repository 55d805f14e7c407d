"""Where a planned step's time goes, on a CUDA GPU: BERT-large seq 128 at 4 GiB (issue 14) with the
plan tightfit chose there (bf16 weights, ``adamw8bit-bf16``, micro-batch 86 x 3, every block
checkpointed), beside the same model with no budget, and the padding mask handed in 4-D or 2-D
(tightfit.masks) on batches without padding.

    OUT=folder python3 bench/step_breakdown.py [--no-profile | --profile-all] [row names...]

Each row trains ``STEPS`` optimizer steps through tightfit's ``Trainer`` with a fixed plan (no
planning) on the bench's random full-length samples, and reads: the median step time of the
last steps (the trainer's own step ends), the optimizer step's GPU time (CUDA events around
``optimizer.step``), the rest of the step (forward, backward, recompute, clipping), peak
allocated / reserved memory; the first row (every row with ``--profile-all``) also gets the
PyTorch profiler's top operators over two steps and its kernels' GPU time per step. Writes ``$OUT/step_breakdown.json`` and prints a Markdown table.
"""

from __future__ import annotations

import gc
import json
import os
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tightfit.bench.workloads import BenchWorkload, make_workload  # noqa: E402
from tightfit.plan import Plan  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
ALL_ENCODERS = __import__("tightfit.masks", fromlist=["ENCODERS"]).ENCODERS
SCOPE = __import__("tightfit.levers.compile", fromlist=["compile_scope"]).compile_scope
SKIPS_ON_DEVICE = __import__("tightfit.step", fromlist=["skips_on_device"]).skips_on_device
GiB = 2**30
STEPS = int(os.environ.get("STEPS", "8"))

# name: (arch, seq, budget GiB or None, precision, micro-batch, effective batch, checkpointing, optimizer, mask 4-D,
#        compiled: True for blocks, "model" for the whole model)
ROWS = {
    "large-plan-4GiB": ("bert-large", 128, 4, "bf16", 86, 256, True, "adamw8bit-bf16", True, False),
    "large-plan-4GiB-mask2d": ("bert-large", 128, 4, "bf16", 86, 256, True, "adamw8bit-bf16", False, False),
    "large-plan-4GiB-compiled": ("bert-large", 128, 4, "bf16", 86, 256, True, "adamw8bit-bf16", True, True),
    # the plan of bench/results/past-the-card call 3 (128 x 1; all 24 blocks here, 23 there), and as one graph
    "large-plan-4GiB-128-compiled": ("bert-large", 128, 4, "bf16", 128, 128, True, "adamw8bit-bf16", True, True),
    "large-plan-4GiB-128-model-compiled": ("bert-large", 128, 4, "bf16", 128, 128, True, "adamw8bit-bf16", True,
                                           "model"),
    # issue 14's reference: the effective batch in one micro-batch, no budget, fp32 AdamW state
    "large-nobudget-128-adamw": ("bert-large", 128, None, "bf16", 128, 128, False, "adamw", True, False),
    "large-nobudget-128-adamw-compiled": ("bert-large", 128, None, "bf16", 128, 128, False, "adamw", True, True),
    # the whole model compiled as one graph (tightfit.levers.compile.compile_scope forced to "model"),
    # checkpointing inside it: one compiled call per micro-batch instead of 24 blocks x 3
    "large-plan-4GiB-model-compiled": ("bert-large", 128, 4, "bf16", 86, 256, True, "adamw8bit-bf16", True, "model"),
    "large-nobudget-adamw-compiled": ("bert-large", 128, None, "bf16", 86, 256, False, "adamw", True, True),
    "large-nobudget-adamw-mb256-model-compiled": ("bert-large", 128, None, "bf16", 256, 256, False, "adamw", True,
                                                  "model"),
    "large-nobudget-ckpt-adamw": ("bert-large", 128, None, "bf16", 86, 256, True, "adamw", True, False),
    "large-nobudget-ckpt-adamw-compiled": ("bert-large", 128, None, "bf16", 86, 256, True, "adamw", True, True),
    "large-nobudget-adamw": ("bert-large", 128, None, "bf16", 86, 256, False, "adamw", True, False),
    "large-nobudget-adamw-mb128": ("bert-large", 128, None, "bf16", 128, 256, False, "adamw", True, False),
    "large-nobudget-8bitbf16": ("bert-large", 128, None, "bf16", 128, 256, False, "adamw8bit-bf16", True, False),
    "base512-mask4d": ("bert-base", 512, None, "bf16", 32, 64, False, "adamw", True, False),
    "base512-mask2d": ("bert-base", 512, None, "bf16", 32, 64, False, "adamw", False, False),
}
# the two 128 x 1 plans with every step's values read on the host before its update (as before the
# 8-bit bf16 update took its verdict on the device): the host waits for the GPU at every step
ROWS.update({f"{name}-sync": ROWS[name]
             for name in ("large-plan-4GiB-128-compiled", "large-plan-4GiB-128-model-compiled")})
# adamw8bit-bf16's update with every 8-bit tensor alone (CHUNK_ELEMENTS 0), not in chunks
ROWS.update({f"{name}-per-tensor": ROWS[name]
             for name in ("large-plan-4GiB-128-compiled", "large-plan-4GiB-128-model-compiled")})
# issue 17: BERT-base seq 128 at 4 GiB (effective batch 256, bitsandbytes' 8-bit AdamW): the planned
# 256 x 1 with every block recomputed, one graph, against more micro-batches recomputing nothing
ROWS.update({f"base-4GiB-{mb}{'-ckpt' if mb == 256 else ''}-{scope}": (
    "bert-base", 128, 4, "bf16", mb, 256, mb == 256, "adamw8bit", True, "model" if scope == "model" else True)
    for mb in (256, 64, 52, 43, 37, 32) for scope in ("model", "blocks")})
ROWS.update({"base-nobudget-256-adamw-model": ("bert-base", 128, None, "bf16", 256, 256, False, "adamw", True, "model"),
             "base-nobudget-256-adamw": ("bert-base", 128, None, "bf16", 256, 256, False, "adamw", True, False)})
CHUNK_ELEMENTS = __import__("tightfit.levers.optimizers", fromlist=["CHUNK_ELEMENTS"]).CHUNK_ELEMENTS


def run_row(name: str, profile: bool) -> dict:
    import tightfit.masks as masks

    arch, seq, budget, precision, mb, eff, ckpt, opt, mask4d, compiled = ROWS[name]
    masks.ENCODERS = ALL_ENCODERS if mask4d else frozenset()  # each row sets its own (2-D: none)
    import tightfit.levers.compile as compile_lever
    import tightfit.step as step_module
    compile_lever.compile_scope = (lambda model: "model") if compiled == "model" else SCOPE
    step_module.skips_on_device = (lambda optimizer: False) if name.endswith("-sync") else SKIPS_ON_DEVICE
    import tightfit.levers.optimizers as optimizers
    optimizers.CHUNK_ELEMENTS = 0 if name.endswith("-per-tensor") else CHUNK_ELEMENTS  # 0: every 8-bit tensor alone
    gc.collect()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget * GiB / total if budget else 1.0)
    w = make_workload(BenchWorkload(name, arch, seq, f"{budget}GiB" if budget else "139GiB", eff), eff, eff * STEPS)
    plan = Plan(precision, mb, eff, activation_checkpointing=ckpt, optimizer=opt, device="cuda",
                budget_bytes=budget * GiB if budget else None, compile=bool(compiled))
    t = Trainer(w, plan, TrainConfig(epochs=1, lr=1e-5, log_every=1000, checkpoint_every=10**6), progress=False)
    events = []
    step = t.optimizer.step

    def timed_step(*a, **k):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return step(*a, **k)
        finally:
            end.record()
            events.append((start, end))

    t.optimizer.step = timed_step
    torch.cuda.reset_peak_memory_stats()
    prof = None
    if profile:
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA],
                                      schedule=torch.profiler.schedule(wait=4, warmup=1, active=2, repeat=1))
        prof.__enter__()
        original = t._launch

        def launch(window, index):
            try:
                return original(window, index)
            finally:
                prof.step()

        t._launch = launch
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    res = t.fit()
    torch.cuda.synchronize()
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0
    if prof is not None:
        prof.__exit__(None, None, None)
    ends = [e for e, _ in res.step_ends]
    steps = [b - a for a, b in zip(ends, ends[1:])][2:]  # the first steps warm up
    step_s = statistics.median(steps)
    opt_s = statistics.median([s.elapsed_time(e) / 1e3 for s, e in events[3:]])
    row = {"row": name, "arch": arch, "seq": seq, "budget_GiB": budget, "precision": precision, "micro_batch": mb,
           "effective_batch": eff, "checkpointing": ckpt, "optimizer": opt, "mask_4d": mask4d, "compiled": compiled,
           "step_s": step_s, "optimizer_step_s": opt_s, "rest_s": step_s - opt_s,
           "samples_per_s": eff / step_s, "peak_allocated_GiB": torch.cuda.max_memory_allocated() / GiB,
           "peak_reserved_GiB": torch.cuda.max_memory_reserved() / GiB, "steps": res.steps,
           "oom_recoveries": res.oom_recoveries, "final_micro_batch": res.plan.micro_batch,
           # the allocator's cache flushes (freeing cached blocks and retrying a cudaMalloc: a device
           # sync each) during the run, and every step's seconds: a steady or a spiky step
           "alloc_retries": retries, "step_seconds": steps}
    deciles = statistics.quantiles(steps, n=10) if len(steps) > 1 else [step_s]
    row["step_p10_s"], row["step_p90_s"] = deciles[0], deciles[-1]
    if prof is not None:
        ka = prof.key_averages()
        row["top_cuda"] = ka.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
        row["top_cpu"] = ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
        # the kernels' GPU time of the 2 profiled steps, per step (the table's total leaves out
        # the profiler's step ranges): against step_s, how busy the GPU was
        total = re.search(r"Self CUDA time total: ([\d.]+)(us|ms|s)\b", row["top_cuda"])
        if total:
            row["gpu_busy_s_per_step"] = float(total.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[total.group(2)] / 2
    del t, w
    return row


def main(names, profile_first: bool = True) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(names):
        try:
            row = run_row(name, profile=(i == 0 and profile_first) or "--profile-all" in sys.argv)
        except Exception as e:  # noqa: BLE001 - report the failure, go on with the next row
            row = {"row": name, "error": repr(e)[:500]}
        rows.append(row)
        print({k: v for k, v in row.items() if not k.startswith("top_")}, flush=True)
        (OUT / "step_breakdown.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    print("| row | step ms | optimizer ms | rest ms | GPU busy ms | samples/s | peak alloc / reserved GiB |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['row']} | error: {r['error'][:100]} | | | | | |")
        else:
            print(f"| {r['row']} | {r['step_s'] * 1e3:.1f} | {r['optimizer_step_s'] * 1e3:.1f} | "
                  f"{r['rest_s'] * 1e3:.1f} | {r.get('gpu_busy_s_per_step', float('nan')) * 1e3:.1f} | "
                  f"{r['samples_per_s']:.0f} | "
                  f"{r['peak_allocated_GiB']:.2f} / {r['peak_reserved_GiB']:.2f} |")
    for r in rows:
        if "top_cuda" in r:
            print(f"\n## {r['row']}: top operators by CUDA time (2 steps)\n{r['top_cuda']}\n\n## by CPU time\n{r['top_cpu']}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a not in ("--no-profile", "--profile-all")]
    main(args or list(ROWS), profile_first="--no-profile" not in sys.argv)
