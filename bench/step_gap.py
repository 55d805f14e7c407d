"""Why a run's steady state is slower than the plan's probe, on a CUDA GPU.

    python3 bench/step_gap.py OUTDIR -- [tightfit train options]

Trains once through the Python API (the command line's recipe) with the given options, then,
on the same trainer (model, optimizer, data and plan), times the training step in the ways that
separate the probe's measurement from the run's:

- ``probe``: the planner's probe loop (:func:`tightfit.step.training_step` on worst-case
  batches padded to the full length, a throw-away optimizer at lr 0, synchronised after each
  step), 30 timed steps: the fastest (what the probe reported until it took the median) and the median;
- ``probe, run's windows``: the same loop on the run's own windows, collated on this thread;
- ``probe, run's windows, no sync``: the same without the per-step synchronisation (the time
  of 30 steps / 30);
- ``Trainer.train_step``: the runtime's step (prefetch on, next window scheduled) on the same
  windows, synchronised after each step, and without it.

Then it trains again (plan from the cache), and once more without checkpoints, and reports each
run's steady samples/s (the median of its 10-step windows). (Commit a8b0520's version also timed
the step with Python's garbage collector paused, as torchtitan does; no gain showed.) Writes ``OUTDIR/step-gap.md`` and ``OUTDIR/step-gap.json``.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")

TIMED = 30


def _times(fn, steps: int, sync_each: bool) -> list[float]:
    out = []
    torch.cuda.synchronize()
    if not sync_each:
        t0 = time.perf_counter()
        for i in range(steps):
            fn(i)
        torch.cuda.synchronize()
        return [(time.perf_counter() - t0) / steps]
    for i in range(steps):
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def experiments(tr) -> dict:
    from tightfit.levers.precision import autocast, make_grad_scaler
    from tightfit.runtime.prefetch import Prefetcher
    from tightfit.step import make_optimizer, module_mode, training_step

    w, plan, dev = tr.w, tr.plan, tr.device
    mb = tr.micro_batch
    windows = [tr.window_at(s) for s in range(TIMED + 1)]
    opt = make_optimizer(w.model.parameters(), plan.optimizer, dev.type, lr=0.0,
                         accumulating=mb < w.effective_batch)
    scaler = make_grad_scaler(plan.precision, dev.type, init_scale=1.0)
    worst = w.train.worst_case(mb)
    norm_worst = w.count(worst)
    rows = {}
    threads = sorted(t.name for t in threading.enumerate())

    def probe_worst(i):
        batch = {k: v.to(dev) for k, v in w.train.worst_case(mb).items()}
        training_step(w.model, iter([batch]), w.loss_sum, norm_worst, opt, scaler,
                      lambda: autocast(plan.precision, dev.type))

    def probe_real(i):
        batch = {k: v.to(dev) for k, v in w.train.collate(windows[i][:mb]).items()}
        training_step(w.model, iter([batch]), w.loss_sum, w.count(batch), opt, scaler,
                      lambda: autocast(plan.precision, dev.type))

    with module_mode(w.model, True):
        probe_worst(0)  # the state exists, as after the probe's first step
        for name, fn, sync in (("probe (worst-case batches)", probe_worst, True),
                               ("probe, run's windows", probe_real, True),
                               ("probe, run's windows, no sync", probe_real, False)):
            t = _times(fn, TIMED, sync)
            rows[name] = {"min_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t)}
    opt.zero_grad(set_to_none=True)
    del opt
    tr.loader = Prefetcher(w.train.collate, dev, enabled=True)

    def trainer_step(i):
        tr.step = i
        tr.loader.schedule(i + 1, windows[i + 1], tr.micro_batch)
        tr.train_step(windows[i])

    for name, sync in (("Trainer.train_step", True), ("Trainer.train_step, no sync", False)):
        t = _times(trainer_step, TIMED, sync)
        rows[name] = {"min_ms": 1e3 * min(t), "median_ms": 1e3 * statistics.median(t)}
    tr.loader.close()
    return {"micro_batch": mb, "rows": rows, "threads_after_fit": threads}


def main(outdir: Path, argv: list[str]) -> None:
    from tightfit import api
    from tightfit.cli import _parser
    from tightfit.config import TrainRequest
    from tightfit.runtime.trainer import Trainer

    results = {"argv": argv, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    orig_fit, orig_init = Trainer.fit, Trainer.__init__
    overrides: dict = {}
    captured: dict = {}

    def init(self, workload, plan, config, *a, **k):
        orig_init(self, workload, plan, dataclasses.replace(config, **overrides), *a, **k)

    def fit(self):
        result = orig_fit(self)
        if "experiments" not in captured:
            captured["experiments"] = experiments(self)
        return result

    Trainer.__init__, Trainer.fit = init, fit
    runs = []
    variants = [("default", {}, []), ("default again (plan from the cache)", {}, []),
                ("no checkpoints", {"checkpoint_dir": None}, [])]
    for i, (name, over, extra) in enumerate(variants):
        overrides.clear()
        overrides.update(over)
        req = TrainRequest.from_args(_parser().parse_args(["train", *argv, *extra, "--out", f"/tmp/step-gap-{i}"]))
        t0 = time.perf_counter()
        s = api.train(req)
        runs.append({"run": name, "wall_s": time.perf_counter() - t0, "speed": s.speed,
                     "plan": f"{s.plan.precision} {s.plan.micro_batch}x{s.plan.accumulation_steps}"
                             + (" compiled" if s.plan.compile else "")})
        print(json.dumps(runs[-1], default=str), flush=True)
    results["runs"] = runs
    results.update(captured.get("experiments", {}))
    (outdir / "step-gap.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    lines = [f"# Probe against run, {results['gpu']}, torch {results['torch']}", "",
             f"`python3 bench/step_gap.py OUT -- {' '.join(argv)}`", "",
             "| step timed as | fastest ms | median ms | mean ms | samples/s at the median |", "|---|---|---|---|---|"]
    mb = results.get("micro_batch", 1)
    for name, r in results.get("rows", {}).items():
        mean = f"{r['mean_ms']:.2f}" if "mean_ms" in r else "-"
        lines.append(f"| {name} | {r['min_ms']:.2f} | {r['median_ms']:.2f} | {mean} | {1e3 * mb / r['median_ms']:.0f} |")
    lines += ["", "| run | plan | probed | steady | steady/probed | whole |", "|---|---|---|---|---|---|"]
    for r in runs:
        sp = r["speed"] or {}
        lines.append(f"| {r['run']} | {r['plan']} | {sp.get('probed_samples_per_s') or 0:.0f} | "
                     f"{sp.get('steady_samples_per_s') or 0:.0f} | {sp.get('steady_vs_probed') or 0:.2f} | "
                     f"{sp.get('whole_run_samples_per_s') or 0:.0f} |")
    lines += ["", f"threads after the first fit: {results.get('threads_after_fit')}"]
    (outdir / "step-gap.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sep = sys.argv.index("--")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    main(out, sys.argv[sep + 1:])
