"""PNG plots of a run (matplotlib, optional): the memory timeline against the budget, and the loss."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from .metrics import read_metrics

log = logging.getLogger(__name__)


def plot_run(run_dir: str | Path, memory_timeline: list[tuple[int, int, int]], budget_bytes: int | None) -> list[Path]:
    """Write ``memory.png`` (peak allocated/reserved of each step with the budget line; GPU runs only;
    on resume the earlier sessions' logged steps too, from ``metrics.jsonl``) and ``loss.png``
    (training loss per logged step, held-out loss) into ``run_dir``.

    Returns:
        The files written; none if matplotlib is not installed (a note is logged).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # optional (the plots extra): said, as tightfit bench report says it
        log.info("note: memory.png and loss.png not drawn: matplotlib is not installed (pip install 'tightfit[plots]')")
        return []
    from ..fileio import atomic_write_bytes
    import io

    run_dir = Path(run_dir)
    written = []

    def save(fig, name):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        atomic_write_bytes(run_dir / name, buf.getvalue())
        written.append(run_dir / name)

    gib = 2**30
    records = read_metrics(run_dir / "metrics.jsonl")  # objects only: a line edited by hand is no record
    if memory_timeline:
        # the timeline is this process's steps: a resumed run's earlier ones are in metrics.jsonl (logged steps)
        first = memory_timeline[0][0]
        memory_timeline = [(r["step"], r["step_peak_allocated_bytes"], r["step_peak_reserved_bytes"]) for r in records
                           if r.get("type") == "train" and isinstance(r.get("step"), int) and r["step"] < first
                           and _finite(r.get("step_peak_allocated_bytes")) and _finite(r.get("step_peak_reserved_bytes"))
                           ] + list(memory_timeline)
        steps = [s for s, _, _ in memory_timeline]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot(steps, [a / gib for _, a, _ in memory_timeline], label="peak allocated")
        ax.plot(steps, [r / gib for _, _, r in memory_timeline], label="peak reserved")
        if budget_bytes:
            ax.axhline(budget_bytes / gib, color="red", linestyle="--", label="budget")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("GiB")
        ax.set_title("GPU memory")
        ax.legend()
        save(fig, "memory.png")
    # a non-finite loss is written as a string ("nan"): matplotlib would make the axis categorical;
    # a record without a step number (edited by hand, another tool's) has no place on the step axis
    train = [r for r in records if r.get("type") == "train" and _finite(r.get("loss")) and _step(r)]
    if train:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="training loss")
        evals = [r for r in records if r.get("type") == "eval" and _finite(r.get("loss")) and _step(r)]
        if evals:
            ax.scatter([r["step"] for r in evals], [r["loss"] for r in evals], color="black", label="held-out loss")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss")
        ax.legend()
        save(fig, "loss.png")
    return written


def _step(record: dict) -> bool:
    """Whether a record has a step number (an int, not a bool) to plot it at."""
    return isinstance(record.get("step"), int) and not isinstance(record.get("step"), bool)


def _finite(value) -> bool:
    """Whether a record's value is a finite number (not None, a string or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
