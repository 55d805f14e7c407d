"""Summarise bench/multi_gpu.sh's runs: python3 bench/multi_gpu_report.py WORK OUT
(writes OUT/multi_gpu.json and OUT/multi_gpu.md)."""

import json
import statistics
import sys
from pathlib import Path

work, out = Path(sys.argv[1]), Path(sys.argv[2])
codes = dict(line.split() for line in (work / "exit-codes.txt").read_text().splitlines()) \
    if (work / "exit-codes.txt").exists() else {}


def records(run):
    f = work / run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def train_records(run):
    return [r for r in records(run) if r["type"] == "train"]


def steady_rate(run, skip=5, window=10):
    """samples/s of the steady state: the median over consecutive ``window``-step windows after the
    first ``skip`` steps (warm-up, compilation), the last step left out (it holds the epoch's
    partial window and the wait for the final checkpoint); the trainer's "steady" is the same."""
    tr = train_records(run)[skip - 1:-1]
    rates = [(b["samples"] - a["samples"]) / (b["time"] - a["time"])
             for a, b in zip(tr[::window], tr[window::window])]
    return statistics.median(rates) if rates else None


def load(run, name):
    f = work / run / name
    return json.loads(f.read_text()) if f.exists() else None


def run_info(run):
    plan, summ = load(run, "plan.json"), load(run, "summary.json")
    last_error = next((line for line in reversed((work / f"{run}.log").read_text().splitlines())
                       if "error" in line.lower()), None) if (work / f"{run}.log").exists() else None
    return {"exit": codes.get(run), "steady_samples_per_s": steady_rate(run),
            "plan": None if plan is None else {k: plan.get(k) for k in (
                "precision", "micro_batch", "accumulation_steps", "effective_batch", "activation_checkpointing",
                "world_size", "sharding", "optimizer", "compile", "reasons", "predicted_peak_reserved_bytes", "probe_peak_reserved_bytes")},
            "summary": summ, "error": last_error if codes.get(run) not in (None, "0") else None,
            "gpus_health_last": next((r.get("gpus") for r in reversed(train_records(run)) if r.get("gpus")), None)}


RUNS = ("base-1gpu", "base-2gpu", "base-1gpu-eager", "base-2gpu-eager", "large-2gpu", "large-1gpu")
res = {name: run_info(name) for name in RUNS}
for suffix in ("", "-eager"):
    b1, b2 = res[f"base-1gpu{suffix}"]["steady_samples_per_s"], res[f"base-2gpu{suffix}"]["steady_samples_per_s"]
    res[f"base_speedup_2_over_1{suffix}"] = b2 / b1 if b1 and b2 else None
l1, l2 = res["large-1gpu"]["steady_samples_per_s"], res["large-2gpu"]["steady_samples_per_s"]
res["large_speedup_2_over_1"] = l2 / l1 if l1 and l2 else None
ref = {r["step"]: r["loss"] for r in train_records("base-2gpu-eager")}
resumed = {}
for run, exact in (("killed", True), ("killed-1gpu", False)):
    # Only what the resumed run itself wrote: the train records after its "resumed from ... at step N"
    # event (the killed run's own records up to its kill are not evidence of a resume).
    recs, code = records(run), codes.get("resume-2gpu" if run == "killed" else "resume-1gpu")
    marks = [i for i, r in enumerate(recs) if r["type"] == "event" and r["message"].startswith("resumed from")]
    at = int(recs[marks[-1]]["message"].split(" at step ")[1].split()[0]) if marks else None
    losses = {r["step"]: r["loss"] for r in recs[marks[-1] + 1:] if r["type"] == "train"} if marks else {}
    after = sorted(s for s in losses if s in ref)
    equal = sum(losses[s] == ref[s] for s in after)
    diff = max((abs(losses[s] - ref[s]) for s in after), default=None)
    complete = bool(ref) and after == [s for s in sorted(ref) if at is not None and s > at]
    ok = code == "0" and bool(after) and complete and (equal == len(after) if exact else diff < 0.05)
    resumed[run] = {"ok": ok, "exit": code, "resumed_at_step": at, "steps_written_by_resume": len(losses),
                    "steps_compared": len(after), "reached_last_step": complete,
                    "exact_equal": equal, "max_abs_loss_diff": diff,
                    "events": [r["message"] for r in recs if r["type"] == "event"][-3:]}
res["resume"] = resumed
oom = out / "oom.json"
res["oom"] = {k: v for k, v in json.loads(oom.read_text()).items() if k not in ("inject", "switch")} \
    if oom.exists() else {"exit": codes.get("oom")}
(out / "multi_gpu.json").write_text(json.dumps(res, indent=1, default=str))


def fmt(x, f="{:.1f}"):
    return "n/a" if x is None else f.format(x)


md = ["# Several GPUs (2 x H200, budget 4 GiB per GPU emulated)", "",
      "| run | exit | plan | steady samples/s |", "|---|---|---|---|"]
for name in RUNS:
    r = res[name]
    p = r["plan"]
    plan = "none" if p is None else (f"{p['precision']}, {p['micro_batch']} x {p['accumulation_steps']} x "
                                     f"{p['world_size']} ({p['sharding']}), ckpt {p['activation_checkpointing']}, "
                                     f"{p.get('optimizer')}, compiled {p.get('compile')}")
    md.append(f"| {name} | {r['exit']} | {plan} | {fmt(r['steady_samples_per_s'])} |")
md += ["", f"BERT-base 2 GPUs / 1 GPU: compiled **{fmt(res['base_speedup_2_over_1'], '{:.2f}')}x**, eager "
       f"**{fmt(res['base_speedup_2_over_1-eager'], '{:.2f}')}x** (target >= 1.8x)", "",
       f"BERT-large 2 GPUs (sharded) / best 1-GPU plan: **{fmt(res['large_speedup_2_over_1'], '{:.2f}')}x** "
       "(target > 1)", ""]
if res["large-1gpu"]["error"]:
    md.append(f"BERT-large on 1 GPU: `{res['large-1gpu']['error'][:300]}`")
md += ["", "## OOM on rank 1 mid-run", "```", json.dumps(res["oom"], indent=1), "```", "",
       "## Kill + resume (losses the resumed run wrote vs the uninterrupted 2-GPU run)", "",
       *[f"- {k}: **{'PASS' if v['ok'] else 'FAIL'}** (exit {v['exit']}, {v['steps_compared']} steps compared, "
         f"{v['exact_equal']} bit-equal)" for k, v in resumed.items()], "", "```",
       json.dumps(resumed, indent=1), "```"]
(out / "multi_gpu.md").write_text("\n".join(md) + "\n")
print("\n".join(md))
