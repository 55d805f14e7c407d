"""What a run reports: ``summary.json`` (:class:`tightfit.report.summary.RunSummary`) and the
summary's rows, from a trainer's result stood in for (no training needed)."""

import json
import math
from types import SimpleNamespace

from tightfit.plan import Plan
from tightfit.report.speed import speed_record
from tightfit.report.summary import RunInfo, RunSummary


def _result(**changes):
    """A trainer's result (the fields the summary reads) of a short CPU run."""
    fields = dict(eval={"accuracy": 0.625, "loss": 0.69, "samples": 8}, steps=6, samples=48, train_seconds=0.9,
                  samples_per_s=48 / 0.9, final_loss=0.7, peak_allocated_bytes=None, peak_reserved_bytes=None,
                  skipped_steps=0, oom_recoveries=0, plan=Plan("fp32", 8, 8, device="cpu"),
                  step_ends=[(0.15 * i, 8 * i) for i in range(1, 7)], eval_seconds=0.1, checkpoint_seconds=0.0,
                  checkpoint_write_seconds=0.02, events=[])
    return SimpleNamespace(**(fields | changes))


INFO = RunInfo("m", "d", 72, 8, ["neg", "pos"], 0.625, "CPU", None, "2", "0", "tightfit train")


def test_summary_json_is_valid_json_when_the_held_out_loss_is_not_finite():
    """A run whose weights went non-finite (--lr 1e30: 5 of 6 steps skipped) evaluated to a NaN
    held-out loss, and summary.json held ``"eval_loss": NaN``: not JSON (json.loads(strict),
    jq and JavaScript refuse it). Now written as metrics.jsonl writes a non-finite number, the
    string "nan", and read back as the float."""
    result = _result(eval={"accuracy": 0.625, "loss": math.nan, "samples": 8}, final_loss=math.nan, skipped_steps=5)
    summary = RunSummary.of_run(result, INFO, 0.0, 2.0, None, speed_record(result, 0.0, {}))
    text = json.dumps(summary.to_dict(), allow_nan=False)  # raises on NaN/Infinity
    assert json.loads(text)["eval_loss"] == "nan"
    back = RunSummary.from_dict(json.loads(text))
    assert math.isnan(back.eval_loss) and back.accuracy == 0.625
    inf = RunSummary.of_run(_result(eval={"accuracy": 0.5, "loss": math.inf, "samples": 8}), INFO, 0.0, 2.0, None)
    assert RunSummary.from_dict(json.loads(json.dumps(inf.to_dict(), allow_nan=False))).eval_loss == math.inf


def test_a_resumed_runs_memory_plot_covers_the_earlier_sessions_steps(tmp_path, monkeypatch):
    """memory.png was drawn from this process's per-step timeline only: a GPU run resumed at step
    20 showed steps 21-30, with nothing to say the earlier steps (whose peaks the summary counts)
    were left out, while loss.png beside it covers the whole run from metrics.jsonl. Now the
    earlier sessions' logged steps come from metrics.jsonl's step peaks, before this session's."""
    import matplotlib.axes

    from tightfit.report.plots import plot_run

    gib = 2**30
    earlier = [{"type": "train", "step": s, "loss": 0.7, "step_peak_allocated_bytes": gib,
                "step_peak_reserved_bytes": 2 * gib} for s in (10, 20)]
    # this session's own records of the steps it trained, as it logged them (every 10th)
    records = [{"type": "plan", "step": 0}, *earlier, {"type": "plan", "step": 20, "resumed_from": "ckpt-20"},
               {"type": "train", "step": 30, "loss": 0.6, "step_peak_allocated_bytes": gib,
                "step_peak_reserved_bytes": 3 * gib}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    timeline = [(s, gib, 3 * gib) for s in range(21, 31)]
    lines = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, **k: lines.append((k.get("label"), list(x),
                                                                                            list(y))) or plot(self, x, y, **k))
    assert [p.name for p in plot_run(tmp_path, timeline, 4 * gib)] == ["memory.png", "loss.png"]
    reserved = next(line for line in lines if line[0] == "peak reserved")
    assert reserved[1] == [10, 20, *range(21, 31)] and reserved[2] == [2.0, 2.0, *[3.0] * 10], reserved


def test_one_held_out_sample_is_said_in_the_singular():
    """``--eval-samples 1``: the summary said "1.0000 on 1 samples" and the export's table "held-out
    accuracy (1 samples)", where the note before it says "1 held-out sample" (count_of)."""
    from tightfit.export import report_markdown
    from tightfit.report.summary import summary_rows

    rows = dict(summary_rows(_result(eval={"accuracy": 1.0, "loss": 0.68, "samples": 1}), INFO))
    assert rows["held-out accuracy"].startswith("1.0000 on 1 sample (majority"), rows
    assert dict(summary_rows(_result(), INFO))["held-out accuracy"].startswith("0.6250 on 8 samples (")
    side = {"size_bytes": 1000, "accuracy": 1.0, "latency_s": {1: 0.001, 32: 0.002}}
    r = {"source": "run", "kind": "text", "torch": "x", "quantized_engine": "x86", "threads": 2, "held_out_samples": 1,
         "fp32": side, "int8": side}
    assert "| held-out accuracy (1 sample) | 1.0000 | 1.0000 |" in report_markdown(r)


def test_a_run_without_matplotlib_says_its_plots_are_not_drawn(tmp_path, monkeypatch, caplog):
    """matplotlib is optional (the plots extra): a run without it wrote report.md and summary.json and
    left memory.png and loss.png out without a word, where tightfit bench report says so."""
    import logging
    import sys

    from tightfit.report.plots import plot_run

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert plot_run(tmp_path, [], None) == []
    assert "not drawn: matplotlib is not installed" in caplog.text and "tightfit[plots]" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_report_md_holds_the_runs_notes(tmp_path, caplog):
    """The notes that qualify a run's figures (held-out samples that also appear among the training
    samples, a CPU run trained on part of the data) went to the terminal only: report.md, the
    document that gives the accuracy, lists each note the run printed."""
    import logging

    from conftest import tiny_cpu_job

    from tightfit import api

    with caplog.at_level(logging.WARNING, logger="tightfit"):
        api.train(api.TrainRequest(**tiny_cpu_job(tmp_path), out=str(tmp_path / "run"), max_steps=2))
    printed = [r.getMessage().removeprefix("note: ") for r in caplog.records if r.getMessage().startswith("note: ")]
    assert any("held-out" in n for n in printed), printed  # the job's 60 short texts repeat across the split
    report = (tmp_path / "run" / "report.md").read_text()
    assert "## Notes" in report and all(f"- {n}" in report for n in printed), report


def test_a_run_without_notes_has_no_notes_section():
    from tightfit.report.summary import report_markdown

    assert "## Notes" not in report_markdown(Plan("fp32", 8, 8, device="cpu"), _result(), INFO)
