"""Where a run's time goes before its steady state (issue 12: whole run against steady).

    python3 bench/warmup_timeline.py OUTDIR [tightfit train options]

Trains through the Python API (the command line's recipe) and records, without adding any sync:
each step's end on the loop's clock (``TrainResult.step_ends``), the host time of each step's
launch and what it was under CUDA graphs (an eager step, a capture then its replay, or a replay),
the loop's time outside the launches, and checkpoint holds. Writes ``OUTDIR/warmup-timeline.json``
and prints the breakdown: the first steps one by one, then what the whole run spent beyond
its steady rate.
"""

from __future__ import annotations

import json
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

    def timed_launch(self, window, index):
        t0 = time.perf_counter()
        try:
            return launch(self, window, index)
        finally:
            launches.append((index, time.perf_counter() - t0, kinds.pop("now", "replay" if self._graphs else "eager")))

    def timed_eager(self, *a, **k):
        kinds["now"] = "eager"
        return eager(self, *a, **k)

    def timed_capture(self, *a, **k):
        kinds["now"] = "capture"
        return capture(self, *a, **k)

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
            result["step_ends"] = list(self.result.step_ends)

    Trainer._launch, Trainer.fit, Trainer.save_checkpoint = timed_launch, kept_fit, timed_save
    graphs.StepGraphs._eager, graphs.StepGraphs._capture = timed_eager, timed_capture
    summary = api.train(req)
    ends = result["step_ends"]
    times = [t for t, _ in ends]
    per_step = [b - a for a, b in zip([0.0, *times], times)]
    steady = statistics.median(per_step[len(per_step) // 2:])
    by_kind: dict[str, list[float]] = {}
    for _, seconds, kind in launches:
        by_kind.setdefault(kind, []).append(seconds)
    out = {"argv": argv, "train_seconds": summary.train_seconds, "steps": len(per_step),
           "steady_step_seconds": steady, "excess_seconds": sum(per_step) - steady * len(per_step),
           "first_steps": [{"step": i + 1, "seconds": per_step[i], "launch_seconds": launches[i][1],
                            "kind": launches[i][2]} for i in range(min(40, len(per_step), len(launches)))],
           "excess_by_step_range": {f"{a + 1}-{b}": sum(per_step[a:b]) - steady * len(per_step[a:b])
                                    for a, b in ((0, 1), (1, 10), (10, 40), (40, 200), (200, len(per_step)))},
           "launch_seconds_by_kind": {k: [len(v), sum(v)] for k, v in by_kind.items()},
           "checkpoint_holds": holds, "summary_speed": summary.speed}
    (outdir / "warmup-timeline.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("train_seconds", "steady_step_seconds", "excess_seconds",
                                          "excess_by_step_range", "launch_seconds_by_kind", "checkpoint_holds")},
                     indent=1))
    for s in out["first_steps"][:20]:
        print(f"step {s['step']:3d}  {1e3 * s['seconds']:8.2f} ms  launch {1e3 * s['launch_seconds']:8.2f} ms  {s['kind']}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
