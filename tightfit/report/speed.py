"""Delivered against predicted: the run's samples/s next to the planner's, and where the time went.

Three figures of one plan's speed, side by side:

- **predicted**: the search's time model (:mod:`tightfit.planner.cost`) for the eager winner
  (None where there was none, e.g. the probe planner);
- **probed**: the planner's timing that decided the plan (real steps on worst-case batches, the
  fastest of a few);
- **delivered**: the run itself, from the time after each step: in the steady state (the median
  of the samples/s of consecutive :data:`WINDOW`-step windows, which leaves out warm-up,
  checkpoints and evaluation stalls) and over the whole run (all samples over the loop's time).

The time breakdown names planning (and whether the plan came from the cache), compilation (a
stage of a fresh plan's planning; after a plan read back from the cache or a checkpoint, before
training), evaluation, and checkpoints (time the loop was held, and the background
writer's time).
"""

from __future__ import annotations

import statistics

WINDOW = 10  # steps per window of the steady-state figure


# Under this many windows the first one, warm-up and all, weighs on the median
FEW_WINDOWS = 3


def steady_samples_per_s(step_ends: list[tuple[float, int]], window: int = WINDOW) -> float | None:
    """Median samples/s over consecutive ``window``-step windows.

    Args:
        step_ends: ``(seconds since the loop began, samples so far)`` after each step, in order.

    Returns:
        The median, or None with fewer than ``window`` steps.
    """
    points = [(0.0, 0)] + list(step_ends)
    rates = []
    for i in range(window, len(points), window):
        (t0, s0), (t1, s1) = points[i - window], points[i]
        if t1 > t0:
            rates.append((s1 - s0) / (t1 - t0))
    return statistics.median(rates) if rates else None


def speed_record(result, planning_seconds: float, timings: dict) -> dict:
    """The run's speed and time breakdown, JSON-ready (``summary.json``'s ``speed``).

    Args:
        result: the trainer's :class:`~tightfit.runtime.trainer.TrainResult`.
        planning_seconds: wall time of the planning of the run's plan (seconds; on resume the first
            run's, where its metrics.jsonl has it).
        timings: the planner's record (:func:`tightfit.planner.gpu.plan_on_gpu`'s ``timings``,
            or the plan cache's: ``cached``, ``predicted_samples_per_s``, ``probed_samples_per_s``,
            ``compile_s``, ...).

    Returns:
        ``{"predicted_samples_per_s", "probed_samples_per_s", "steady_samples_per_s", "steady_windows"
        (the windows that median is of), "whole_run_samples_per_s", "steady_vs_probed", "planning_seconds", "plan_cached", "plan_from_checkpoint",
        "planning_of_first_run" (on resume: planning_seconds is the first run's, from its metrics.jsonl),
        "compile_seconds", "eval_seconds", "checkpoint_seconds", "checkpoint_write_seconds", "checkpoint_share"
        (the loop's hold by checkpoints over the training time), "graphed_steps" (steps this session replayed as CUDA graphs), "graphs_off" (why none were, or why they
        stopped; None: replayed to the end)}``
        (figures not known are None; samples/s, seconds).
    """
    steady = steady_samples_per_s(result.step_ends)
    probed = timings.get("probed_samples_per_s")
    return {
        "predicted_samples_per_s": timings.get("predicted_samples_per_s"),
        "probed_samples_per_s": probed,
        "steady_samples_per_s": steady,
        "steady_windows": len(result.step_ends) // WINDOW,
        "whole_run_samples_per_s": result.samples_per_s,
        "steady_vs_probed": steady / probed if steady and probed else None,
        "planning_seconds": planning_seconds,
        "plan_cached": bool(timings.get("cached")),
        "plan_from_checkpoint": bool(timings.get("from_checkpoint")),
        "planning_of_first_run": "first_planning_s" in timings,
        "compile_seconds": timings.get("compile_s"),
        "eval_seconds": result.eval_seconds,
        "checkpoint_seconds": result.checkpoint_seconds,
        "checkpoint_write_seconds": result.checkpoint_write_seconds,
        # the share issue 12 bounds (2%) and the default checkpoint schedule keeps to
        "checkpoint_share": (result.checkpoint_seconds / train if (train := getattr(result, "train_seconds", 0))
                             else None),
        "graphed_steps": getattr(result, "graphed_steps", 0),
        "graphs_off": getattr(result, "graphs_off", None),
    }


def _rate(v) -> str:
    """samples/s for display as the summary and the plan's lines show them (:func:`format_rate`:
    the same figure reads the same in each); "-" where not known."""
    from ..units import format_rate

    return "-" if not v else format_rate(v)


def speed_rows(speed: dict) -> list[tuple[str, str]]:
    """(label, value) rows: the three speeds side by side, then the time breakdown."""
    # "; " between the three, not " | ": report.md puts this value in a Markdown table cell
    # "speed", not "samples/s": the summary's own "samples/s" row is the whole run's figure alone
    rows = [("speed, samples/s", f"predicted {_rate(speed['predicted_samples_per_s'])}; probed "
                          f"{_rate(speed['probed_samples_per_s'])}; delivered {_rate(speed['steady_samples_per_s'])} "
                          f"steady (median of {WINDOW}-step windows"
                          + ("" if speed["steady_samples_per_s"] else f"; none: this session ran under {WINDOW} steps")
                          + (f"; only {windows}, the first steps' warm-up included: not yet a steady state"
                             if speed["steady_samples_per_s"] and (windows := speed.get("steady_windows")) is not None
                             and windows < FEW_WINDOWS else "")
                          + f"), {_rate(speed['whole_run_samples_per_s'])} whole run")]
    if speed.get("steady_vs_probed"):
        # the planner times eager steps: a run that replayed CUDA graphs is measured against them
        graphed = " (the probe timed eager steps; this run replayed CUDA graphs)" if speed.get("graphed_steps") else ""
        rows.append(("steady / probed", f"{speed['steady_vs_probed']:.2f}{graphed}"))
    plan = f"{speed['planning_seconds']:.1f} s" + (
        " (plan from the cache)" if speed["plan_cached"] else
        " (the first run's; this run took its plan from the checkpoint)" if speed.get("planning_of_first_run") else
        " (this run read its plan from the checkpoint; the first run's planning time is not in metrics.jsonl)"
        if speed.get("plan_from_checkpoint") else "")
    if speed.get("compile_seconds"):
        # a fresh plan's compilation is a stage of its planning; a plan read back (cache, checkpoint)
        # compiled after it, before training: said apart, so that neither figure is counted twice
        read_back = speed["plan_cached"] or speed.get("plan_from_checkpoint")
        plan += (f"; compilation before training {speed['compile_seconds']:.1f} s" if read_back
                 else f", of which compilation {speed['compile_seconds']:.1f} s")
    rows.append(("time: planning", plan))
    rows.append(("time: evaluation", f"{speed['eval_seconds']:.1f} s"))
    share = speed.get("checkpoint_share")
    held = f"{speed['checkpoint_seconds']:.2f} s holding the loop" + (
        f" ({100 * share:.1f}% of the training time)" if share is not None else "")
    rows.append(("time: checkpoints", f"{held}, {speed['checkpoint_write_seconds']:.2f} s writing in the background"))
    return rows
