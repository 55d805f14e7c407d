"""Time of one optimizer step over BERT-large's parameters on the GPU, per 8-bit / offload engine,
with the memory each step adds on top of the weights and gradients: the numbers that decide which
library backs tightfit's ``adamw8bit`` and ``adamw-offload`` levers (issue 14).

Rows: torch fused AdamW (fp32 state, the reference), torchao ``AdamW8bit``, tightfit's
``adamw8bit`` (bitsandbytes' class with its state allocated before any update), bitsandbytes
``AdamW8bit`` as shipped (if importable), torchao ``CPUOffloadOptimizer`` as shipped (one fused CPU
AdamW per parameter), tightfit's ``adamw-offload`` (torchao's class with one fused CPU AdamW step
over all host copies, gradients freed once copied). Each: a real bf16 forward/backward at
micro-batch 32 x 128 tokens (so that offload's gradient hooks run), then ``step()`` timed with a
device sync, median of 10. Also the host's fused AdamW alone, over one tensor of BERT-large's
size and over its 393 tensors (``info``).

    OUT=folder python bench/optimizer_step_time.py

Writes ``$OUT/optimizer_step_time.json`` and prints a Markdown table.
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

from tightfit.bench.workloads import BenchWorkload, make_workload  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
GiB = 2**30


def engines():
    from tightfit.levers import optimizers as lv

    yield "torch fused AdamW (fp32 state)", lambda ps: torch.optim.AdamW(ps, lr=1e-5, weight_decay=0.01, fused=True)
    yield "torchao AdamW8bit", lambda ps: __import__("torchao.optim", fromlist=["AdamW8bit"]).AdamW8bit(
        ps, lr=1e-5, weight_decay=0.01)
    yield "tightfit adamw8bit (bitsandbytes AdamW8bit, all state before any update)", lambda ps: lv.adamw_8bit(
        ps, 1e-5, 0.01)
    try:
        import bitsandbytes as bnb

        yield "bitsandbytes AdamW8bit", lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-5, weight_decay=0.01)
    except Exception as e:  # noqa: BLE001 - report what failed
        print("bitsandbytes not usable:", repr(e)[:300])
    yield "torchao CPUOffloadOptimizer (fused CPU AdamW per parameter)", lambda ps: __import__(
        "torchao.optim", fromlist=["CPUOffloadOptimizer"]).CPUOffloadOptimizer(
        ps, torch.optim.AdamW, offload_gradients=True, lr=1e-5, weight_decay=0.01)
    yield "tightfit adamw-offload (one fused CPU AdamW step over all host copies)", lambda ps: lv.adamw_offload(
        ps, 1e-5, 0.01)


def cpu_adamw_params_per_s(shapes) -> float:
    """The host's fused AdamW over fp32 tensors of ``shapes`` (all stepped), parameters/s: median
    of 3 steps after a first one."""
    ps = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    for p in ps:
        p.grad = torch.ones_like(p)
    cpu = torch.optim.AdamW(ps, lr=1e-5, fused=True)
    cpu.step()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        cpu.step()
        times.append(time.perf_counter() - t)
    return sum(p.numel() for p in ps) / statistics.median(times)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads()}
    print(info)
    w = BenchWorkload("bert-large-128", "bert-large", 128, "4GiB", 128)
    shapes = []
    for name, build in engines():
        wl = make_workload(w, 32, 64)
        model = wl.model.train()
        batch = {k: v.cuda() for k, v in wl.train.collate(range(32)).items()}
        shapes = shapes or [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        opt = build([p for p in model.parameters() if p.requires_grad])
        times, extra = [], []
        try:
            for i in range(13):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = wl.loss_sum(model, batch) / 32
                loss.backward()
                if hasattr(opt, "wait_for_gradients"):
                    opt.wait_for_gradients()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                t = time.perf_counter()
                opt.step()
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
                extra.append(torch.cuda.max_memory_allocated() - before)
                opt.zero_grad(set_to_none=True)
                if i >= 3:
                    times.append(dt)
            states = getattr(opt, "state", None)  # torchao's CPUOffloadOptimizer has none: its on-device one
            if states is None:
                states = opt.d_opt.state if getattr(opt, "d_opt", None) is not None else {}
            state = sum(t.numel() * t.element_size() for s in states.values() for t in s.values()
                        if isinstance(t, torch.Tensor) and t.is_cuda)
            row = {"engine": name, "step_s": statistics.median(times), "step_extra_peak_GiB": max(extra) / GiB,
                   "gpu_state_GiB": state / GiB, "params": sum(p.numel() for p in model.parameters()),
                   "tensors": sum(1 for _ in model.parameters())}
        except Exception as e:  # noqa: BLE001
            row = {"engine": name, "error": repr(e)[:400]}
        print(row, flush=True)
        rows.append(row)
        if hasattr(opt, "close"):
            opt.close()
        del opt, model, wl, batch
        torch.cuda.empty_cache()
    # The host's fused AdamW over all of BERT-large at once (memory-bound rate) and over its
    # tensors as the offload holds them (one fused step over a list), params/s.
    n = rows[0].get("params", 335_000_000)
    info["cpu_fused_adamw_one_tensor_params_per_s"] = cpu_adamw_params_per_s([(n,)])
    info["cpu_fused_adamw_model_tensors_params_per_s"] = cpu_adamw_params_per_s(shapes)
    print(info)
    (OUT / "optimizer_step_time.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print("| engine | step ms | extra peak GiB | GPU state GiB |\n|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | error: {r['error'][:80]} | | |")
        else:
            print(f"| {r['engine']} | {r['step_s'] * 1e3:.1f} | {r['step_extra_peak_GiB']:.2f} | {r['gpu_state_GiB']:.2f} |")


if __name__ == "__main__":
    main()
