"""Faults a review of the run's outputs and the auxiliary commands found (round 21)."""

import json

import pytest


def test_a_metrics_record_without_a_step_does_not_crash_the_loss_plot(tmp_path):
    """A train or eval record without a step number (edited by hand, written by another tool) was
    plotted as ``r["step"]``: a KeyError at the run's finish, after report.md and before
    summary.json, and again at every resume (keep_metrics_until keeps records without a step)."""
    pytest.importorskip("matplotlib")
    from tightfit.report.plots import plot_run

    records = [{"type": "train", "step": 1, "loss": 0.7}, {"type": "train", "loss": 0.6},
               {"type": "train", "step": "3", "loss": 0.5}, {"type": "train", "step": 4, "loss": 0.4},
               {"type": "eval", "loss": 0.65}, {"type": "eval", "step": 4, "loss": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_run(tmp_path, [], None)
    assert [p.name for p in written] == ["loss.png"]
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_train_help_says_the_compiled_graphs_plan_needs_its_environment_variable():
    """The README (and the planner, tightfit.planner.gpu.graphs_planned) has the GPU planner try a
    compiled plan replayed as CUDA graphs only with TIGHTFIT_PLAN_CUDA_GRAPHS=1; ``--help`` said
    ``--cuda-graphs auto`` chose one wherever the planner found it faster."""
    from tightfit.cli import _parser
    from tightfit.planner.gpu import GRAPHS_ENV

    train = _parser().train_parser
    action = next(a for a in train._actions if "--cuda-graphs" in a.option_strings)
    assert f"{GRAPHS_ENV}=1" in action.help


def test_an_unknown_train_request_keyword_names_the_one_meant():
    """A fresh user wrote TrainRequest(no_progress=True), as the flag reads, and got a bare TypeError
    with no hint that --no-progress is progress=False."""
    from tightfit.config import TrainRequest

    with pytest.raises(TypeError, match=r"'no_progress': --no-progress is progress=False$"):
        TrainRequest(no_progress=True)
    with pytest.raises(TypeError, match=r"'batchsize' \(did you mean batch_size\?\)$"):
        TrainRequest(batchsize=8)
