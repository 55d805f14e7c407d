"""Where a `tightfit train` run's time goes, on a CUDA GPU.

    python3 bench/speed_profile.py run NAME OUTDIR -- [tightfit train options]
    python3 bench/speed_profile.py report OUTDIR

``run`` trains in this process through the Python API (the same recipe as the command line) and
instruments the training step from outside: every step's GPU time (CUDA events) and host time,
the host syncs inside the step on a few steady-state steps (``torch.cuda.set_sync_debug_mode``
warns at each synchronising call; they are counted), the PyTorch profiler over a few steps (its
top operators by CUDA and by CPU time), and the time to collate one window of the data. It
writes ``OUTDIR/NAME.json`` (the run's ``summary.json`` speed block, the instrumentation and the
time breakdown) and ``OUTDIR/NAME-profile.txt``. ``report`` writes ``OUTDIR/speed.md``: the
predicted / probed / delivered table and the time breakdown of every run in OUTDIR.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings
from pathlib import Path

SYNC_STEPS = range(40, 45)  # steps whose host syncs are counted
PROFILED_STEPS = range(50, 56)  # steps under the PyTorch profiler


def run(name: str, outdir: Path, argv: list[str]) -> None:
    import torch

    from tightfit import api
    from tightfit.cli import _parser
    from tightfit.config import TrainRequest
    from tightfit.runtime.prefetch import Prefetcher
    from tightfit.runtime.trainer import Trainer

    req = TrainRequest.from_args(_parser().parse_args(["train", *argv]))
    steps, syncs, prof, collate = [], {}, {}, []
    original, prepare = Trainer._launch, Prefetcher._prepare  # one step run on the GPU (maybe queued ahead)

    def timed_prepare(self, window, micro_batch):  # collation + pinning of one window (background thread)
        t0 = time.perf_counter()
        try:
            return prepare(self, window, micro_batch)
        finally:
            collate.append(time.perf_counter() - t0)

    def instrumented(self, window, index):
        i = index
        if i == PROFILED_STEPS.start:
            prof["p"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                           torch.profiler.ProfilerActivity.CUDA])
            prof["p"].__enter__()
            prof["t0"] = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        if i in SYNC_STEPS:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = original(self, window, index)
            torch.cuda.set_sync_debug_mode(0)
            syncs[i] = [str(w.message).splitlines()[0][:120] for w in caught if "synchron" in str(w.message)]
        else:
            out = original(self, window, index)
        host = time.perf_counter() - t0
        end.record()
        steps.append((i, start, end, host, len(window)))
        if i == PROFILED_STEPS.stop - 1 and "p" in prof:
            torch.cuda.synchronize()
            prof["wall"] = time.perf_counter() - prof["t0"]
            prof["p"].__exit__(None, None, None)
        return out

    Trainer._launch, Prefetcher._prepare = instrumented, timed_prepare
    t_all = time.perf_counter()
    summary = api.train(req)
    wall = time.perf_counter() - t_all
    torch.cuda.synchronize()
    gpu_ms = [s.elapsed_time(e) for _, s, e, _, _ in steps]
    host_s = [h for *_, h, _ in steps]
    collate_ms = 1e3 * statistics.median(collate) if collate else None
    out = {"name": name, "argv": argv, "wall_seconds": wall, "summary_speed": summary.speed,
           "planning_seconds": summary.planning_seconds, "train_seconds": summary.train_seconds,
           "steps": summary.steps, "samples": summary.train_samples, "plan": summary.plan.to_dict(),
           "collate_ms_per_window": collate_ms,
           "step_gpu_ms_median": statistics.median(gpu_ms[10:] or gpu_ms) if gpu_ms else None,
           "step_host_ms_median": 1e3 * statistics.median(host_s[10:] or host_s) if host_s else None,
           "first_10_steps_seconds": sum(host_s[:10]),
           "syncs_per_step": {str(k): len(v) for k, v in syncs.items()},
           "sync_calls": sorted({m for v in syncs.values() for m in v}),
           "peak_reserved_bytes": summary.peak_reserved_bytes}
    if "p" in prof:
        p = prof["p"]
        events = p.key_averages()
        cuda_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
        out["profiled_steps"] = list(PROFILED_STEPS)
        out["profiled_wall_seconds"] = prof["wall"]
        out["profiled_gpu_busy_fraction"] = cuda_us / 1e6 / prof["wall"] if prof["wall"] else None
        text = [f"{name}: steps {PROFILED_STEPS.start}-{PROFILED_STEPS.stop - 1}, wall {prof['wall']:.3f} s, "
                f"GPU kernels {cuda_us / 1e6:.3f} s", "",
                events.table(sort_by="self_device_time_total", row_limit=25), "",
                events.table(sort_by="self_cpu_time_total", row_limit=25)]
        (outdir / f"{name}-profile.txt").write_text("\n".join(text))
    (outdir / f"{name}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(json.dumps({k: out[k] for k in ("name", "summary_speed", "syncs_per_step", "first_10_steps_seconds")},
                     default=str))


def _f(v, fmt="{:.0f}"):
    return "-" if v is None else fmt.format(v)


def report(outdir: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted(outdir.glob("*.json"))]
    rows = [r for r in rows if "summary_speed" in r]  # other benchmarks may write beside them
    lines = ["# Delivered against predicted", "",
             "| run | predicted | probed | delivered steady | delivered whole | steady/probed | plan | "
             "planning s | compile s | first 10 steps s | eval s | ckpt held s | ckpt write s | train s | "
             "syncs/step |", "|" + "---|" * 15]
    for r in rows:
        s = r["summary_speed"] or {}
        plan = r["plan"]
        what = (f"{plan['precision']} {plan['micro_batch']}x{plan['accumulation_steps']}"
                + (" compiled" if plan["compile"] else "") + (" (cached)" if s.get("plan_cached") else ""))
        syncs = sorted(set(r["syncs_per_step"].values()))
        lines.append(f"| {r['name']} | {_f(s.get('predicted_samples_per_s'))} | {_f(s.get('probed_samples_per_s'))} | "
                     f"{_f(s.get('steady_samples_per_s'))} | {_f(s.get('whole_run_samples_per_s'))} | "
                     f"{_f(s.get('steady_vs_probed'), '{:.2f}')} | {what} | {_f(s.get('planning_seconds'), '{:.1f}')} | "
                     f"{_f(s.get('compile_seconds'), '{:.1f}')} | {_f(r.get('first_10_steps_seconds'), '{:.2f}')} | "
                     f"{_f(s.get('eval_seconds'), '{:.1f}')} | {_f(s.get('checkpoint_seconds'), '{:.2f}')} | "
                     f"{_f(s.get('checkpoint_write_seconds'), '{:.2f}')} | {_f(r.get('train_seconds'), '{:.1f}')} | "
                     f"{','.join(map(str, syncs)) or '-'} |")
    lines += ["", "Per-step medians (steps after the first 10): GPU time from CUDA events, host time of the step call;",
              "host syncs counted with torch.cuda.set_sync_debug_mode on steps "
              f"{SYNC_STEPS.start}-{SYNC_STEPS.stop - 1}:", ""]
    for r in rows:
        lines.append(f"- {r['name']}: GPU {_f(r.get('step_gpu_ms_median'), '{:.2f}')} ms, host "
                     f"{_f(r.get('step_host_ms_median'), '{:.2f}')} ms per step; collating a window "
                     f"{_f(r.get('collate_ms_per_window'), '{:.2f}')} ms (background thread); profiled GPU busy "
                     f"{_f(r.get('profiled_gpu_busy_fraction'), '{:.2f}')}; sync calls: "
                     f"{'; '.join(r.get('sync_calls') or []) or 'none'}")
    (outdir / "speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        sep = sys.argv.index("--")
        outdir = Path(sys.argv[3])
        outdir.mkdir(parents=True, exist_ok=True)
        run(sys.argv[2], outdir, sys.argv[sep + 1:])
    else:
        report(Path(sys.argv[2]))
