"""Metrics as JSON Lines: one record per logged step, evaluation and event."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per line to ``path``; each line is written with a single
    ``write`` and flushed, so a killed run leaves whole lines only.

    Args:
        path: the ``metrics.jsonl`` file (created, or appended to on resume).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "a", encoding="utf-8")

    def __call__(self, record: dict) -> None:
        rec = {"time": round(time.time(), 3), **{k: _clean(v) for k, v in record.items()}}
        self._f.write(json.dumps(rec) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/NaN
    return v


def keep_metrics_until(path: str | Path, step: int) -> list[int]:
    """Rewrite ``metrics.jsonl`` atomically without the records of steps after ``step`` (those a
    stopped run wrote after its last checkpoint, which the resumed run writes again) and without
    an evaluation at ``step`` (it followed the checkpoint). Records without a step are kept.
    Events are kept up to the checkpoint's own record (``{"type": "checkpoint", "step": step}``;
    without one, those of steps up to ``step``); after it only the session events (``"session":
    true``: how a session started and ended, e.g. a signal at step 45 when the resume goes back to
    a checkpoint of step 40), which stay in the run's history. The others (an out-of-memory
    back-off at step 43) happen again in the resumed run, and kept they were counted twice. A line
    that is not JSON is dropped (the last line: cut by a kill).

    Returns:
        The numbers (from 1) of the lines dropped as not JSON before the last line: damaged, not
        cut by a kill, for the resume to say so.
    """
    from ..fileio import atomic_write_text

    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    records, damaged = [], []
    for n, line in enumerate(lines, 1):
        record = _record(line)
        if record is None:  # damaged
            if n < len(lines):
                damaged.append(n)
            continue
        records.append((line, record))
    mark = max((i for i, (_, r) in enumerate(records) if r.get("type") == "checkpoint" and r.get("step") == step),
               default=None)  # the last record of that checkpoint
    kept = []
    for i, (line, record) in enumerate(records):
        at = record.get("step")
        if record.get("type") == "event":
            keep = _session_event(record) or (i < mark if mark is not None else isinstance(at, int) and at <= step)
        else:  # an evaluation at the checkpoint's step came after it: the resumed run evaluates again
            keep = not isinstance(at, int) or at < step or (at == step and record.get("type") != "eval")
        if keep:
            kept.append(line)
    if len(kept) != len(lines):
        atomic_write_text(path, "".join(line + "\n" for line in kept))
    return damaged


def _session_event(record: dict) -> bool:
    """Whether an event says how a session started or ended: flagged ``"session"`` (the trainer
    and the resume's notes), or, in files written before the flag, worded as a resume or a stop."""
    message = record.get("message")
    return bool(record.get("session")) or isinstance(message, str) and (
        message.startswith("resumed from ") or "stopped" in message or "stopping after" in message)


def earlier_events(path: str | Path) -> list[str]:
    """The event messages of the sessions before a resume: the ``event`` records of
    ``metrics.jsonl``, in order, as :func:`keep_metrics_until` left them (how a stopped session
    ended is kept, also past the checkpoint resumed from). Empty when the file is missing;
    unreadable lines are skipped."""
    return [r["message"] for r in read_metrics(path) if r.get("type") == "event"
            and isinstance(r.get("message"), str)]


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file that read as JSON objects ([] when it is missing):
    what a resume and the plots read back, skipping a line a kill cut short or one edited into
    something else ([1], 5)."""
    path = Path(path)
    if not path.is_file():
        return []
    records = (_record(line) for line in path.read_text(encoding="utf-8", errors="replace").splitlines())
    return [r for r in records if r is not None]


def _record(line: str) -> dict | None:
    """One ``metrics.jsonl`` line's record, or None where it is none: not JSON (cut by a kill), JSON
    that ``json.loads`` refuses (a 5,000-digit integer), or JSON but not an object ([1], 5: edited)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def session_commands(path: str | Path, first: str) -> list[str]:
    """The command line of each session before a resume, in order: the ``command`` of each
    session's plan record in ``metrics.jsonl``, as :func:`keep_metrics_until` left them. The first
    session's is ``first`` (the run's own, from ``request.json``) where its record has none
    (written before commands were recorded) or the file is missing; a later session's record
    without one is left out. Unreadable lines are skipped."""
    plans = [r for r in read_metrics(path) if r.get("type") == "plan"]
    if not plans or plans[0].get("resumed_from"):  # the first session's record is gone (metrics.jsonl was lost)
        plans.insert(0, {})
    commands = []
    for record in plans:
        if isinstance(record.get("command"), str):
            commands.append(record["command"])
        elif not record.get("resumed_from"):
            commands.append(first)
    return commands


# the planner's speeds, written into the plan record (its "planned_speeds") so that a resumed
# run can report against them
PLANNED_SPEEDS = ("predicted_samples_per_s", "probed_samples_per_s")


def planned_speeds(path: str | Path) -> dict:
    """The planner's speeds (:data:`PLANNED_SPEEDS`, samples/s) from the ``planned_speeds`` of the
    first run's plan record in ``metrics.jsonl`` (the record without ``resumed_from``), and its
    ``planning_seconds`` as ``first_planning_s``, for a resumed run's summary: its
    plan comes from the checkpoint and is not timed again. Empty when the file, the record or the
    figures are missing (an older run, or a CPU run); unreadable lines are skipped."""
    for record in read_metrics(path):
        if record.get("type") == "plan" and not record.get("resumed_from"):
            speeds = record.get("planned_speeds")
            speeds = speeds if isinstance(speeds, dict) else {}
            found = {k: speeds[k] for k in PLANNED_SPEEDS if isinstance(speeds.get(k), (int, float))}
            if isinstance(record.get("planning_seconds"), (int, float)):
                found["first_planning_s"] = record["planning_seconds"]
            return found
    return {}
