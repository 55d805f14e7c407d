"""Exact estimates per plan: how many traces `tightfit plan` makes for each bench workload, and
the plan it prints (`--json`), in one process, so that two code versions can be compared plan for
plan (the count is the search's cost; seconds depend on the host and are kept only as a hint).
Estimates answered by replaying earlier traces (:mod:`tightfit.memory.replay`, where the code has
it) are counted apart as ``replayed``.

Usage (repository root, any machine): ``python bench/plan_traces.py OUT.json [WORKLOAD ...]``
(default: every bench and lever workload, as ``bench/plan_time.py``). Run it at two commits with
``PYTHONPATH`` set to each checkout and compare the JSON files.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

estimate_module = importlib.import_module("tightfit.memory.estimate")  # the package's name is the function
from plan_time import workloads  # noqa: E402

_calls = [0]
_estimate = estimate_module.estimate


def _counted(*args, **kwargs):
    _calls[0] += 1
    return _estimate(*args, **kwargs)


def _replayed() -> int | None:
    """Estimates replayed so far in this process (None: code without replays)."""
    try:
        from tightfit.memory.replay import stats
    except ImportError:
        return None
    return stats["replayed"]


def main(out_path: str, only: list[str]) -> None:
    from tightfit.cli import main as cli

    estimate_module.estimate = _counted  # the search reaches it through this module
    out = {}
    with tempfile.TemporaryDirectory() as root:
        for name, model, size, budget, batch in workloads(Path(root)):
            if only and name not in only:
                continue
            image = model in ("vit-b16", "resnet50")
            argv = ["plan", "--model", model, "--image-size" if image else "--seq-len", str(size),
                    "--batch-size", str(batch), "--budget", budget, "--json"]
            _calls[0], buf, t = 0, io.StringIO(), time.perf_counter()
            replayed = _replayed()
            with contextlib.redirect_stdout(buf):
                code = cli(argv)
            plan = json.loads(buf.getvalue()) if code == 0 else None
            if plan:
                plan.pop("planning_seconds", None)
            out[name] = {"exit": code, "traces": _calls[0], "seconds": round(time.perf_counter() - t, 1), "plan": plan}
            if replayed is not None:
                out[name]["replayed"] = _replayed() - replayed
            print(name, code, _calls[0], out[name].get("replayed", ""), flush=True)
    Path(out_path).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plan-traces.json", sys.argv[2:])
