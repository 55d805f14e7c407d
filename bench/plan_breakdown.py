"""Where the GPU planner's time goes: :func:`tightfit.planner.gpu.plan_on_gpu` run on bench workloads
with its stages and every probe step timed (wall clock, nested), for issue 12's "planning in
seconds".

Usage (repository root, CUDA; carried wheels on ``PYTHONPATH`` for the optimizer levers):
``python bench/plan_breakdown.py OUT_DIR [WORKLOAD ...]`` (default: ``bert-large-128@4GiB
bert-base-128@4GiB``), each planned as issue 14's and issue 17's benches plan it (``compile="auto"``,
a 300-step run). Writes ``OUT_DIR/plan-breakdown.json`` (every timed call: name, depth, start and
wall seconds, what it probed) and ``OUT_DIR/plan-breakdown.md`` (per workload: the stages, and
each probe step with its micro-batch, checkpointed blocks, optimizer, fit and wall time).

The stages are timed by wrapping the planner's functions in their modules for this process only;
nothing of tightfit's behaviour changes.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tightfit.runtime.allocator import configure_allocator  # noqa: E402

configure_allocator()  # expandable segments, as tightfit's command line runs

import torch  # noqa: E402

from tightfit.bench import settings as st  # noqa: E402
from tightfit.bench.workloads import WORKLOADS, BenchWorkload, make_workload  # noqa: E402
from tightfit.devices import detect  # noqa: E402
from tightfit.planner import gpu, probe, warmup  # noqa: E402

STEPS = 300  # the run length the benches plan for (run_samples = STEPS x effective batch)
EXTRA = {"bert-large-128@4GiB": BenchWorkload("bert-large-128@4GiB", "bert-large", 128, "4GiB", 128)}

# (module, function) pairs timed; probe_step's arguments are recorded too
STAGES = {gpu: ("search_optimizers", "_verified", "verify_on_gpu", "calibrate", "challenge_optimizer",
                "challenge_precision", "compile_and_retime", "compiled_variant", "whole_model_variant",
                "warm_other_lengths", "retime", "challenge_compiled_optimizer", "steady_timing", "probe_step",
                "compile_model", "uncompile_model"),
          warmup: ("probe_step",),
          probe: ("run_probe_steps", "make_optimizer")}

events: list[dict] = []
_depth = [0]
_blocks = [0]


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        event = {"name": name, "depth": _depth[0], "start_s": time.perf_counter()}
        if name == "probe_step":
            event.update(micro_batch=args[1], precision=args[2], optimizer=kwargs.get("optimizer", "adamw"),
                         timed_steps=kwargs.get("timed_steps", 2), checkpointed_blocks=_blocks[0])
        events.append(event)
        _depth[0] += 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _depth[0] -= 1
            event["wall_s"] = time.perf_counter() - event["start_s"]
        if name == "probe_step":
            event.update(fits=out.fits, step_s=out.step_seconds)
        return out
    return wrapper


def _instrument() -> None:
    for module, names in STAGES.items():
        for name in names:
            setattr(module, name, _timed(name, getattr(module, name)))
    real = gpu.set_activation_checkpointing

    def remember(model, on, blocks=None, *args, **kwargs):
        _blocks[0] = (len(blocks) if blocks is not None else -1) if on else 0  # -1: every block (the model's hook)
        return real(model, on, blocks, *args, **kwargs)
    gpu.set_activation_checkpointing = remember


def plan_one(w: BenchWorkload) -> dict:
    st.cap_memory(w.budget_bytes)
    wl = make_workload(w, w.effective_batch, w.effective_batch * STEPS)
    events.clear()
    t0 = time.perf_counter()
    plan = gpu.plan_on_gpu(wl, detect(), w.budget_bytes, w.size, compile="auto", run_samples=w.effective_batch * STEPS)
    total = time.perf_counter() - t0
    for e in events:
        e["start_s"] -= t0
    row = {"workload": w.name, "planning_s": total, "reasons": list(plan.reasons), "events": list(events),
           "plan": {"precision": plan.precision, "micro_batch": plan.micro_batch, "optimizer": plan.optimizer,
                    "compile": plan.compile, "checkpoint_blocks": len(plan.checkpoint_blocks or ())}}
    del wl
    st.clean()
    return row


def markdown(rows: list[dict], commit: str) -> str:
    out = [f"# Where the GPU planner's time goes\n\n{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'}, torch {torch.__version__}, "
           f"code {commit}. `python bench/plan_breakdown.py OUT {' '.join(r['workload'] for r in rows)}`: "
           f"`plan_on_gpu(compile='auto')` for a {STEPS}-step run, its functions wrapped with wall clocks.\n"]
    for r in rows:
        out.append(f"## {r['workload']}: {r['planning_s']:.1f} s\n\nplan: {r['plan']}\n\n| stage | calls | wall s | probe steps |")
        out.append("|---|---|---|---|")
        top = [e for e in r["events"] if e["depth"] == 0]
        for name in dict.fromkeys(e["name"] for e in top):
            mine = [e for e in top if e["name"] == name]
            inside = sum(1 for e in r["events"] if e["name"] == "probe_step" and any(
                m["start_s"] <= e["start_s"] <= m["start_s"] + m["wall_s"] for m in mine))
            out.append(f"| {name} | {len(mine)} | {sum(e['wall_s'] for e in mine):.1f} | {inside} |")
        out.append(f"| (outside these) | | {r['planning_s'] - sum(e['wall_s'] for e in top):.1f} | |\n")
        out.append("| at s | probe step of | micro-batch | blocks | optimizer | timed steps | fits | step s | wall s |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for i, e in enumerate(r["events"]):
            if e["name"] != "probe_step":
                continue
            parent = next((p["name"] for p in reversed(r["events"][:i]) if p["depth"] < e["depth"]
                           and p["name"] != "probe_step"), "plan_on_gpu")
            out.append(f"| {e['start_s']:.1f} | {parent} | {e['micro_batch']} | {e['checkpointed_blocks']} | "
                       f"{e['optimizer']} | {e['timed_steps']} | {e.get('fits')} | "
                       f"{(e.get('step_s') or 0):.3f} | {e['wall_s']:.1f} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    names = sys.argv[2:] or ["bert-large-128@4GiB", "bert-base-128@4GiB"]
    _instrument()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    rows = []
    for name in names:
        rows.append(plan_one(EXTRA.get(name) or WORKLOADS[name]))
        (out / "plan-breakdown.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))
        (out / "plan-breakdown.md").write_text(markdown(rows, commit))
        print(f"{name}: {rows[-1]['planning_s']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
