"""Where a run's time goes before its steady state (issue 12: whole run against steady).

    python3 bench/warmup_timeline.py OUTDIR [tightfit train options]

Trains through the Python API (the command line's recipe) and records, without adding any sync:
each step's end on the loop's clock (``TrainResult.step_ends``), the host time of each step's
launch and what it was under CUDA graphs (an eager step, a capture then its replay, or a replay),
the loop's time outside the launches, and checkpoint holds. Writes ``OUTDIR/warmup-timeline.json``
and prints the breakdown: the first steps one by one, then what the whole run spent beyond
its steady rate. With ``TIMELINE_PROFILE_STEPS=N`` the loop's first N steps run under cProfile
(its cumulative and own-time tables printed; the timeline then holds the profiler's cost); with
``TIMELINE_PROFILE_SLOW=S`` every eager step and capture of the step graphs runs under cProfile and
those over S seconds print their table. Each eager step and capture also names the allocator's
device mallocs and frees it made. With ``TIMELINE_PROFILE_PLAN=1`` the GPU planner
(``plan_on_gpu``) runs under cProfile too, its tables printed with the others. With
``TIMELINE_NO_CUDNN_SDPA=1`` the run's attention takes no cuDNN kernel (an A/B of that backend's
per-shape set-up at shapes the run meets first; what a text run does since ``tightfit.levers.attention``),
with ``TIMELINE_CUDNN_SDPA=1`` it keeps PyTorch's choice (cuDNN's kernels first on sm90).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(outdir: Path, argv: list[str]) -> None:
    from tightfit import api
    from tightfit.cli import _parser
    from tightfit.config import TrainRequest
    from tightfit.runtime import graphs
    from tightfit.runtime.trainer import Trainer

    req = TrainRequest.from_args(_parser().parse_args(["train", *argv]))
    launches, kinds, holds, result = [], {}, [], {}
    launch, eager, capture, fit, save = (Trainer._launch, graphs.StepGraphs._eager, graphs.StepGraphs._capture,
                                         Trainer.fit, Trainer.save_checkpoint)

    profile_steps = int(os.environ.get("TIMELINE_PROFILE_STEPS") or 0)  # cProfile the loop's first N steps
    profiler = cProfile.Profile() if profile_steps else None

    step_profiling = [False]  # one profiler at a time (a second one's enable ends the first's, or raises)
    tables: list[str] = []  # printed after training: printing inside a launch would add to its time

    def table(prof, order, lines, title):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
        tables.append(f"--- {title}\n{text.getvalue()}")

    def timed_launch(self, window, index):
        if profiler is not None and index == 0:
            profiler.enable()
            step_profiling[0] = True
        elif profiler is not None and index == profile_steps:  # launched ahead: inside step N-1's turn
            profiler.disable()
            step_profiling[0] = False
            for order in ("cumulative", "tottime"):
                table(profiler, order, 35, f"the first {profile_steps} steps, by {order}")
        t0 = time.perf_counter()
        try:
            return launch(self, window, index)
        finally:
            launches.append((index, time.perf_counter() - t0, kinds.pop("now", "replay" if self._graphs else "eager")))

    def shapes(key):  # the batch's shapes and the loss normaliser of a step graph's key
        return " ".join(f"{name}{list(shape)}" for name, shape, _ in key[0]) + f" / {key[1]:g}"

    slow_s = float(os.environ.get("TIMELINE_PROFILE_SLOW", "0") or 0)  # cProfile tables of eager steps/captures slower

    def watched(what, call, self, key, *a, **k):
        """An eager step or a capture, with the allocator's device mallocs and frees it made
        (in the kind's text) and, with TIMELINE_PROFILE_SLOW, its cProfile table when slow."""
        import torch
        before = torch.cuda.memory_stats(self.device) if torch.cuda.is_available() else {}
        prof = cProfile.Profile() if slow_s and not step_profiling[0] else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        try:
            return call(self, key, *a, **k)
        finally:
            if prof is not None:
                prof.disable()
            seconds = time.perf_counter() - t0
            after = torch.cuda.memory_stats(self.device) if torch.cuda.is_available() else {}
            delta = {n: after.get(n, 0) - before.get(n, 0) for n in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
            kinds["now"] = (f"{what} {shapes(key)} [cudaMalloc {delta['num_device_alloc']}, cudaFree "
                            f"{delta['num_device_free']}, retries {delta['num_alloc_retries']}]")
            if prof is not None and seconds >= slow_s:
                table(prof, "cumulative", 25, f"{what} of {shapes(key)} took {1e3 * seconds:.1f} ms (step {self.seen})")

    def timed_eager(self, key, *a, **k):
        return watched("eager", eager, self, key, *a, **k)

    def timed_capture(self, key, *a, **k):
        return watched("capture", capture, self, key, *a, **k)

    def timed_save(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return save(self, *a, **k)
        finally:
            holds.append((self.step, time.perf_counter() - t0))

    def kept_fit(self):
        try:
            return fit(self)
        finally:
            result["step_ends"], result["steps_per_epoch"] = list(self.result.step_ends), self.steps_per_epoch

    Trainer._launch, Trainer.fit, Trainer.save_checkpoint = timed_launch, kept_fit, timed_save
    if os.environ.get("TIMELINE_PROFILE_PLAN"):  # where planning's seconds go (the probe steps' set-up)
        from tightfit.planner import gpu as planner_gpu
        plan_on_gpu = planner_gpu.plan_on_gpu

        def profiled_plan(*a, **k):
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            try:
                return plan_on_gpu(*a, **k)
            finally:
                prof.disable()
                for order in ("cumulative", "tottime"):
                    table(prof, order, 40, f"planning ({time.perf_counter() - t0:.2f} s), by {order}")

        planner_gpu.plan_on_gpu = profiled_plan  # api imports it at the call
    if os.environ.get("TIMELINE_NO_EMPTY_CACHE"):  # an A/B of the allocator flush before each capture
        graphs.torch.cuda.empty_cache = lambda: None  # noqa: E731 - this process only
        print("torch.cuda.empty_cache made a no-op", file=sys.stderr)
    if os.environ.get("TIMELINE_NO_CUDNN_SDPA"):  # an A/B of cuDNN attention's per-shape set-up at first-met shapes
        import torch
        torch.backends.cuda.enable_cudnn_sdp(False)
        print("cuDNN scaled_dot_product_attention disabled", file=sys.stderr)
    if os.environ.get("TIMELINE_CUDNN_SDPA"):  # the other side: a text run with PyTorch's own attention kernels
        api.TrainRecipe.VARYING_SHAPES = False
        print("the text run keeps PyTorch's attention kernels (cuDNN's first on sm90)", file=sys.stderr)
    graphs.StepGraphs._eager, graphs.StepGraphs._capture = timed_eager, timed_capture
    summary = api.train(req)
    print("\n".join(tables))
    ends, per_epoch = result["step_ends"], result["steps_per_epoch"]
    times = [t for t, _ in ends]
    per_step = [b - a for a, b in zip([0.0, *times], times)]
    steady = statistics.median(per_step[len(per_step) // 2:])
    by_kind: dict[str, list[float]] = {}
    for _, seconds, kind in launches:
        by_kind.setdefault(kind.split()[0], []).append(seconds)
    out = {"argv": argv, "train_seconds": summary.train_seconds, "steps": len(per_step),
           "steady_step_seconds": steady, "excess_seconds": sum(per_step) - steady * len(per_step),
           "first_steps": [{"step": i + 1, "seconds": per_step[i], "launch_seconds": launches[i][1],
                            "kind": launches[i][2]} for i in range(min(40, len(per_step), len(launches)))],
           "excess_by_step_range": {f"{a + 1}-{b}": sum(per_step[a:b]) - steady * len(per_step[a:b])
                                    for a, b in ((0, 1), (1, 10), (10, 40), (40, 200), (200, len(per_step)))},
           "launch_seconds_by_kind": {k: [len(v), sum(v)] for k, v in by_kind.items()},
           "checkpoint_holds": holds, "summary_speed": summary.speed,
           # the slowest steps with where they fall in their epoch (its first and last windows are
           # where the order, the prefetch and a short last micro-batch change)
           "slowest_steps": [{"step": i + 1, "seconds": per_step[i], "epoch_position": i % per_epoch,
                              "steps_per_epoch": per_epoch,
                              "launch_seconds": launches[i][1] if i < len(launches) else None,
                              "kind": launches[i][2] if i < len(launches) else None}
                             for i in sorted(range(len(per_step)), key=per_step.__getitem__, reverse=True)[:15]]}
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "warmup-timeline.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("train_seconds", "steady_step_seconds", "excess_seconds",
                                          "excess_by_step_range", "launch_seconds_by_kind", "checkpoint_holds")},
                     indent=1))
    sp = summary.speed or {}
    whole, steady_rate = sp.get("whole_run_samples_per_s"), sp.get("steady_samples_per_s")
    print(f"speed: whole run {whole or 0:.0f} samples/s, steady {steady_rate or 0:.0f}, whole / steady "
          f"{(whole or 0) / (steady_rate or 1):.3f}; planning {sp.get('planning_seconds') or 0:.2f} s, training "
          f"{summary.train_seconds:.2f} s, evaluation {sp.get('eval_seconds') or 0:.2f} s; probed "
          f"{sp.get('probed_samples_per_s') or 0:.0f} samples/s")
    for s in out["slowest_steps"]:
        print(f"slow step {s['step']:5d} ({s['epoch_position']:4d} of {s['steps_per_epoch']} in its epoch)  "
              f"{1e3 * s['seconds']:8.2f} ms  launch {1e3 * (s['launch_seconds'] or 0):8.2f} ms  {s['kind']}")
    for s in out["first_steps"][:20]:
        print(f"step {s['step']:3d}  {1e3 * s['seconds']:8.2f} ms  launch {1e3 * s['launch_seconds']:8.2f} ms  {s['kind']}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
