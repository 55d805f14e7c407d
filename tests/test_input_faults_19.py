"""Checkpoint, resume and interrupt faults a review found: a metrics.jsonl line that is JSON but not
an object, a state file calling a blocked module, a stop at once mid-step recorded nowhere."""

import json
import shutil

import pytest


def _short_run(tmp_path, steps=6, every=2, keep=5, extra=()):
    from conftest import tiny_cpu_job

    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", str(steps),
                 "--checkpoint-every", str(every), "--keep-last", str(keep), "--seq-len", "16", "--device", "cpu",
                 "--out", str(run), "--no-progress", *extra]) == 0
    return run, run / "checkpoints"


def test_a_metrics_line_that_is_json_but_not_an_object_does_not_crash_the_resumed_finish(tmp_path, capsys):
    """A metrics.jsonl line that is JSON but not an object (``[1]``, ``5``: edited by hand) was
    kept by the resume's cut-back and then crashed the finish in plot_run with an AttributeError
    traceback (exit 1) after training, before summary.json: every later resume crashed the same
    way, so the run could never finish."""
    from tightfit.cli import main

    run, ckpts = _short_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:
        f.write("[1]\n5\n")
    code = main(["train", "--resume", str(ckpts / "ckpt-4"), "--no-progress"])
    assert code == 0, capsys.readouterr().err[-2000:]
    assert (run / "summary.json").is_file()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        assert isinstance(json.loads(line), dict), line


class _RunsAShellCommand:
    def __reduce__(self):
        import os

        return (os.system, ("true",))


def test_a_state_file_calling_a_blocked_module_says_what_was_refused_not_to_load_unsafely(tmp_path):
    """A state.pt (its manifest rewritten to match) that pickles os.system -- the attack
    weights_only guards against -- is refused by torch with a message of another shape ("Trying to
    load unsupported GLOBAL posix.system whose module posix is blocked", no "WeightsUnpickler
    error:"), so the one line shown was torch's first: "Weights only load failed. In PyTorch 2.6
    ... Re-running `torch.load` with `weights_only` set to `Fal...", advising the unsafe load and
    not naming what was refused."""
    import torch

    from tightfit.errors import TightfitError
    from tightfit.runtime.checkpoint import read_state

    (tmp_path / "ckpt-2").mkdir()
    torch.save({"step": 2, "evil": _RunsAShellCommand()}, tmp_path / "ckpt-2" / "state.pt")
    with pytest.raises(TightfitError) as info:
        read_state(tmp_path / "ckpt-2")
    message = str(info.value)
    assert "\n" not in message and "weights_only` set to `False" not in message, message
    assert "refuses to run" in message and "system" in message, message


def test_a_stop_at_once_mid_training_is_an_event_of_the_run(tmp_path, monkeypatch):
    """Ctrl-C twice in a step stops at once: the session's end was recorded nowhere (no event in
    metrics.jsonl, unlike every other stop), so the resumed run's report did not show that a
    session was interrupted."""
    from tightfit.cli import main
    from tightfit.runtime import trainer as trainer_module

    run, ckpts = _short_run(tmp_path)
    (run / "summary.json").unlink()
    shutil.rmtree(ckpts / "ckpt-6")
    settle = trainer_module.Trainer._settle

    def second_ctrl_c(self, launched):
        if self.step == 4:  # resumed at 4: step 5 is cut short
            raise KeyboardInterrupt
        return settle(self, launched)

    monkeypatch.setattr(trainer_module.Trainer, "_settle", second_ctrl_c)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 130
    monkeypatch.setattr(trainer_module.Trainer, "_settle", settle)
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("type") == "event" and "interrupted" in r.get("message", "") for r in events), events
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "interrupted at once after step 4" in (run / "report.md").read_text()


def test_a_metrics_line_of_json_that_python_refuses_to_read_is_skipped_not_a_crash(tmp_path):
    """A line of valid JSON that json.loads refuses with a ValueError that is not a JSONDecodeError
    (an integer of more than 4,300 digits) or a RecursionError (arrays nested 100,000 deep) crashed
    read_metrics and the resume's cut-back, as a line of ``[1]`` did before it was skipped."""
    from tightfit.report.metrics import keep_metrics_until, read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"type": "event", "message": "x"}\n' + "9" * 5000 + "\n" + "[" * 100000 + "]" * 100000 + "\n"
                    + '{"type": "checkpoint", "step": 2}\n')
    assert [r["type"] for r in read_metrics(path)] == ["event", "checkpoint"]
    keep_metrics_until(path, 2)
    assert [r["type"] for r in read_metrics(path)] == ["event", "checkpoint"]
