"""Faults a careful user found in run folders, checkpoints and the plan cache: a resume from an
earlier checkpoint that dies, an --out inside another run, a checkpoint that cannot be written,
damaged files of a run, leftovers of a write cut short."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tightfit.api as api
from conftest import tiny_cpu_job
from tightfit.errors import TightfitError


@pytest.fixture
def finished(tmp_path):
    """A finished 8-step run with a checkpoint every 2 steps, all kept; and the job's fields."""
    common = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    api.train(api.TrainRequest(**common, max_steps=8, checkpoint_every=2, keep_last=10, out=str(run)))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-2", "ckpt-4", "ckpt-6", "ckpt-8"]
    return run, common


def _weights(run):
    return load_file(run / "model" / "model.safetensors")


def _forked_cleanly(run, common, tmp_path):
    """The weights and summary of the same run resumed from ckpt-4 at another learning rate, uninterrupted."""
    clean = tmp_path / "clean"
    shutil.copytree(run, clean)
    summary = api.train(api.TrainRequest(**common, lr=3e-4, resume=str(clean / "checkpoints" / "ckpt-4")))
    return _weights(clean), summary


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_from_an_earlier_checkpoint_that_dies_before_writing_one_is_resumed_from_there(
        finished, tmp_path, monkeypatch):
    """The resume from ckpt-4 had cut the records to step 4 and recorded the new learning rate; killed
    before its first checkpoint, a resume of the run took the abandoned ckpt-8 (steps 5-8 at the old
    rate) under the new records and options."""
    run, common = finished
    clean, clean_summary = _forked_cleanly(run, common, tmp_path)

    def killed(self):
        raise KeyboardInterrupt  # as a kill right after the run folder was opened

    with monkeypatch.context() as m:
        m.setattr(api.TrainRecipe, "train", killed)
        with pytest.raises(KeyboardInterrupt):
            api.train(api.TrainRequest(**common, lr=3e-4, resume=str(run / "checkpoints" / "ckpt-4")))
    assert not (run / "summary.json").exists()  # the finish at step 8 was the abandoned stretch's
    summary = api.train(api.TrainRequest(**common, resume=str(run)))
    assert _same(_weights(run), clean)
    assert summary.eval_loss == clean_summary.eval_loss
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 8


def test_a_resume_from_an_earlier_checkpoint_killed_in_its_final_evaluation_finishes_with_its_own_results(
        finished, tmp_path, monkeypatch):
    """It had written its own ckpt-8; the run's summary.json of the first finish made a resume of
    the run say "already finished" with the first finish's model."""
    run, common = finished
    clean, clean_summary = _forked_cleanly(run, common, tmp_path)

    def killed(self, result):
        raise KeyboardInterrupt  # during the final evaluation and writes

    with monkeypatch.context() as m:
        m.setattr(api.TrainRecipe, "finish", killed)
        with pytest.raises(KeyboardInterrupt):
            api.train(api.TrainRequest(**common, lr=3e-4, resume=str(run / "checkpoints" / "ckpt-4")))
    summary = api.train(api.TrainRequest(**common, resume=str(run)))
    assert _same(_weights(run), clean)
    assert summary.eval_loss == clean_summary.eval_loss
    assert json.loads((run / "summary.json").read_text())["eval_loss"] == clean_summary.eval_loss


def test_an_out_inside_another_runs_folder_is_refused(finished):
    run, common = finished
    for inside in (run / "model", run / "checkpoints" / "ckpt-99", run / "sub" / "deeper"):
        with pytest.raises(TightfitError, match=f"is inside the run folder {run}"):
            api.train(api.TrainRequest(**common, max_steps=2, out=str(inside)))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt-2", "ckpt-4", "ckpt-6", "ckpt-8"]


def test_a_checkpoint_that_cannot_be_written_stops_the_run_in_one_line_and_it_resumes(tmp_path, monkeypatch, capsys):
    import tightfit.runtime.async_checkpoint as writer
    from tightfit.cli import main

    common = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    real = writer.write_snapshot

    def full_disk(folder, step, *a, **k):
        if step == 4:
            raise OSError(28, "No space left on device")
        return real(folder, step, *a, **k)

    monkeypatch.setattr(writer, "write_snapshot", full_disk)
    argv = ["train", "--model", common["model"], "--data", common["data"], "--batch-size", "8", "--seq-len", "16",
            "--device", "cpu", "--no-progress", "--max-steps", "6", "--checkpoint-every", "2", "--out", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint ckpt-4 could not be written: No space left on device" in err[0], err
    assert "tightfit train --resume" in err[0] and "Traceback" not in err[0]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["ckpt-2"]  # what was in place stays
    monkeypatch.undo()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert (run / "summary.json").is_file()
    # the stop is one of the run's events: the resumed run's report shows it
    report = (run / "report.md").read_text()
    assert "checkpoint ckpt-4 could not be written" in report, report


class _FullDisk:
    """A text file on a disk that has just filled up: writes are buffered, every flush (and the
    flush of close) fails with ENOSPC, as a full disk's do."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        return len(text)

    def flush(self):
        raise OSError(28, "No space left on device")

    def fileno(self):
        return self.f.fileno()

    @property
    def closed(self):
        return self.f.closed

    def close(self):
        self.f.close()
        self.flush()


@pytest.mark.parametrize("where", ["metrics", "finish", "finish-safetensors"])
def test_a_full_disk_outside_a_checkpoint_stops_the_run_in_one_line_and_it_resumes(tmp_path, monkeypatch, capsys,
                                                                                    where):
    """The disk filled up between two checkpoints: the next line of metrics.jsonl (or the model and
    report at the finish) could not be written, and the run ended in two tracebacks (exit 1), the
    second from closing metrics.jsonl, with nothing saying how to go on."""
    from tightfit.cli import main
    from tightfit.report.metrics import MetricsWriter

    common = tiny_cpu_job(tmp_path)
    capsys.readouterr()  # the model folder's making
    run = tmp_path / "run"
    real = MetricsWriter.__call__

    def filling(self, record):
        if where == "metrics" and record.get("type") == "train" and record["step"] == 3:
            self._f = _FullDisk(self._f)
        return real(self, record)

    def full_disk(self, folder):
        if where == "finish-safetensors":  # the model's writer says it so, with no errno
            from safetensors import SafetensorError

            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(MetricsWriter, "__call__", filling)
    if where.startswith("finish"):
        monkeypatch.setattr(api.TrainRecipe, "_save_model", full_disk)
    argv = ["train", "--model", common["model"], "--data", common["data"], "--batch-size", "8", "--seq-len", "16",
            "--device", "cpu", "--no-progress", "--max-steps", "6", "--checkpoint-every", "2", "--log-every", "1",
            "--out", str(run)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "Traceback" not in err[0], err
    assert f"at step {3 if where == 'metrics' else 6}" in err[0]
    assert f"tightfit train --resume {run}" in err[0]
    monkeypatch.undo()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert (run / "summary.json").is_file()
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == 6


def test_a_full_disk_elsewhere_is_not_called_the_run_folders(tmp_path, monkeypatch):
    """An ENOSPC naming a file outside the run folder (the compiler's cache, the image being read)
    was reported as "the run folder ... could not be written" with a resume command; it goes
    through as it is."""
    from tightfit.report.metrics import MetricsWriter

    common = tiny_cpu_job(tmp_path)
    real = MetricsWriter.__call__

    def elsewhere(self, record):
        if record.get("type") == "train" and record["step"] == 3:
            raise OSError(28, "No space left on device", str(tmp_path / "cache" / "kernel.so"))
        return real(self, record)

    monkeypatch.setattr(MetricsWriter, "__call__", elsewhere)
    with pytest.raises(OSError, match="kernel.so") as e:
        api.train(api.TrainRequest(model=common["model"], data=common["data"], batch_size=8, seq_len=16,
                                   device="cpu", progress=False, max_steps=6, checkpoint_every=2, log_every=1,
                                   out=str(tmp_path / "run")))
    assert not isinstance(e.value, TightfitError)


def test_an_interrupt_while_the_run_finishes_says_how_to_finish_it(tmp_path, monkeypatch, capsys):
    """Ctrl-C or SIGTERM while the model, report and plots were written (after the last checkpoint
    and the evaluation) ended with "tightfit: interrupted" alone, not the command that finishes the
    run, as an interrupt in the evaluation before it says."""
    from tightfit.cli import main

    common = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"

    def interrupted(self, result):
        raise KeyboardInterrupt  # what SIGTERM (or Ctrl-C) raises outside the training loop

    monkeypatch.setattr(api.TrainRecipe, "finish", interrupted)
    argv = ["train", "--model", common["model"], "--data", common["data"], "--batch-size", "8", "--seq-len", "16",
            "--device", "cpu", "--no-progress", "--max-steps", "4", "--out", str(run)]
    capsys.readouterr()
    assert main(argv) == 130
    assert f"continue with: tightfit train --resume {run}" in capsys.readouterr().out
    monkeypatch.undo()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert (run / "summary.json").is_file()


@pytest.mark.parametrize("change", ["not a dict", "no counters", "no rng", "micro-batch 0", "step a string",
                                    "no optimizer", "no scaler"])
def test_a_state_that_is_not_a_runs_is_refused_in_one_line_before_anything_is_written(finished, change):
    """A state.pt whose manifest matches it (rewritten by hand, or another program's) but that is not
    a tightfit run's state: a KeyError, TypeError or AttributeError traceback, or, with micro-batch
    0, a one-line error only after the resume had removed the finished run's summary and report."""
    import hashlib

    from tightfit.runtime.checkpoint import read_state

    run, common = finished
    ckpt = run / "checkpoints" / "ckpt-8"
    state = read_state(ckpt)  # written back whole: a state.pt holding its tensors, without state.safetensors
    if change == "not a dict":
        state = [1, 2]
    elif change == "no counters":
        del state["counters"]
    elif change == "no rng":
        del state["rng"]
    elif change == "micro-batch 0":
        state["micro_batch"] = 0
    elif change in ("no optimizer", "no scaler"):  # read after the weights were loaded
        del state[change.split()[1]]
    else:
        state["step"] = "8"
    torch.save(state, ckpt / "state.pt")
    (ckpt / "state.safetensors").unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    del manifest["files"]["state.safetensors"]
    data = (ckpt / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (run / "summary.json").unlink()  # as if killed in its finish: the resume would finish it
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(TightfitError, match=r"ckpt-8 is corrupt \(state\.pt: not the state of a tightfit run"):
        api.train(api.TrainRequest(**common, resume=str(run)))
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_a_damaged_summary_is_written_again_and_a_damaged_request_refused_in_one_line(finished, caplog):
    run, common = finished
    (run / "summary.json").write_text('{"accuracy": 0.5')  # cut short
    summary = api.train(api.TrainRequest(**common, resume=str(run)))
    assert "cannot be read" in caplog.text
    assert json.loads((run / "summary.json").read_text())["eval_loss"] == summary.eval_loss
    (run / "request.json").write_text("[]")
    with pytest.raises(TightfitError, match="unreadable request.json"):
        api.train(api.TrainRequest(**common, resume=str(run)))


def test_leftovers_of_writes_cut_short_in_the_run_folder_are_removed_on_resume(finished, caplog):
    run, common = finished
    (run / "summary.json").unlink()  # as a kill in the final writes leaves it
    (run / ".report.md.x1.tmp").write_text("half")
    (run / ".model.x2.tmp").mkdir()
    (run / ".model.x2.tmp" / "model.safetensors").write_bytes(b"half")
    api.train(api.TrainRequest(**common, resume=str(run)))
    assert not list(run.glob(".*.tmp"))
    assert "removed .report.md.x1.tmp, left by a write that was cut short" in caplog.text


def test_a_plan_cache_folder_that_cannot_be_searched_is_no_cache(tmp_path):
    from tightfit.planner.cache import load_plan

    assert load_plan("k" * 300, tmp_path / ("a" * 300)) is None  # a name too long: an OSError from is_file()


def test_a_run_folder_another_process_writes_is_refused_in_one_line(finished):
    """Two resumes of one folder at once: the second removed the first's checkpoint write in flight
    as a leftover, and both appended records."""
    import fcntl
    import os

    run, common = finished
    (run / "summary.json").unlink()
    (run / "checkpoints" / ".ckpt-10.x3.tmp").mkdir()  # the other process's checkpoint write in flight
    fd = os.open(run, os.O_RDONLY)  # as another process holding it (a lock of another open file)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        before = sorted(p.name for p in run.rglob("*"))
        with pytest.raises(TightfitError, match="is being written by another tightfit run"):
            api.train(api.TrainRequest(**common, resume=str(run)))
        assert sorted(p.name for p in run.rglob("*")) == before
    finally:
        os.close(fd)
    api.train(api.TrainRequest(**common, resume=str(run)))  # released: it finishes
    assert (run / "summary.json").is_file()


def test_a_new_run_into_a_folder_another_process_is_starting_is_refused(tmp_path):
    import fcntl
    import os

    common = tiny_cpu_job(tmp_path)
    out = tmp_path / "new"
    out.mkdir()  # another new run's, made a moment ago: empty yet, so --out passes its checks
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(TightfitError, match="is being written by another tightfit run"):
            api.train(api.TrainRequest(**common, max_steps=2, out=str(out)))
        assert not any(out.iterdir())
    finally:
        os.close(fd)


def test_a_second_run_started_at_once_into_the_same_out_is_refused_before_it_plans(tmp_path, monkeypatch):
    """Two `tightfit train` started at once into one new --out: the folder was made and locked only
    once planned, so the second (another process) planned too, printed its plan lines and was
    refused only then -- or, first to open the folder, trained while the first was refused. The
    first now holds the folder from its check of --out on: the second gets one line and exit code 2
    before it plans, and the first trains there."""
    import subprocess
    import sys

    common = tiny_cpu_job(tmp_path)
    out = tmp_path / "new"  # neither run has made it when both check --out
    second = [sys.executable, "-m", "tightfit", "train", "--model", common["model"], "--data", common["data"],
              "--batch-size", "8", "--seq-len", "16", "--device", "cpu", "--max-steps", "2", "--no-progress",
              "--out", str(out)]
    plan, done = api.TrainRecipe._plan, []

    def second_starts_while_the_first_plans(self):
        if not done:
            done.append(subprocess.run(second, capture_output=True, text=True, timeout=300))
        plan(self)

    monkeypatch.setattr(api.TrainRecipe, "_plan", second_starts_while_the_first_plans)
    api.train(api.TrainRequest(**common, max_steps=2, out=str(out)))
    refused = done[0]
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    assert refused.stderr.strip().splitlines() == [
        f"tightfit: error: run folder {out} is being written by another tightfit run (a run folder has one "
        "writer): wait for it to end, or stop it"]
    assert "plan:" not in refused.stdout, refused.stdout  # refused before it planned
    assert (out / "summary.json").is_file()  # the first trained there


def test_a_new_run_into_a_folder_another_run_is_training_in_says_so(tmp_path):
    """A run training in --out before its first checkpoint: a second run into it was told the
    folder "holds a run that stopped before its first checkpoint ... delete it". It is being
    written: the second is told so, and the folder is left as it was."""
    common = tiny_cpu_job(tmp_path)
    out = tmp_path / "live"
    out.mkdir()
    (out / "request.json").write_text("{}")
    first = object()  # the run training there, holding its folder
    api._hold_run_folder(out, first)
    try:
        with pytest.raises(TightfitError, match="is being written by another tightfit run"):
            api.train(api.TrainRequest(**common, max_steps=2, out=str(out)))
    finally:
        api._release_run_folders(first)
    assert [p.name for p in out.iterdir()] == ["request.json"]


def test_a_new_runs_folder_made_at_its_check_is_removed_when_a_later_check_refuses(tmp_path):
    """The folder made (and held) once --out is checked is removed again when the setup refuses
    the run after that (here its data): bad input leaves nothing, and the --out stays free."""
    common = tiny_cpu_job(tmp_path)
    out = tmp_path / "new"
    with pytest.raises(TightfitError):
        api.train(api.TrainRequest(**{**common, "data": str(tmp_path / "missing.csv")}, max_steps=2, out=str(out)))
    assert not out.exists()
    assert str(out.resolve()) not in api._HELD  # and released


def test_the_parents_a_new_runs_folder_needed_are_removed_with_it_when_the_setup_refuses(tmp_path, monkeypatch):
    """Bad input leaves nothing: the folder made at the check of --out is removed, and so are the
    parents made for it -- runs/ for the default runs/<date-time>, which a refused run left behind
    empty (before that folder was made at the check, nothing at all was written) -- but never a
    parent that was there, nor one another run has put something in meanwhile."""
    common = tiny_cpu_job(tmp_path)
    bad = {**common, "data": str(tmp_path / "missing.csv")}
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(TightfitError, match="not found"):
        api.train(api.TrainRequest(**bad, max_steps=2))  # --out left out: runs/<date-time>
    assert list(work.iterdir()) == []
    (work / "a").mkdir()
    with pytest.raises(TightfitError, match="not found"):
        api.train(api.TrainRequest(**bad, max_steps=2, out=str(work / "a" / "b" / "c" / "run")))
    assert [p.name for p in work.iterdir()] == ["a"] and list((work / "a").iterdir()) == []

    def another_run_writes_beside_it(self):  # into a parent this run made
        (work / "a" / "b" / "other").mkdir()
        raise TightfitError("refused after planning")

    monkeypatch.setattr(api.TrainRecipe, "_plan", another_run_writes_beside_it)
    with pytest.raises(TightfitError, match="refused after planning"):
        api.train(api.TrainRequest(**common, max_steps=2, out=str(work / "a" / "b" / "c" / "run")))
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*")) == ["a", "a/b", "a/b/other"]


def test_runs_started_in_the_same_second_without_out_get_folders_of_their_own(tmp_path, monkeypatch):
    """The default runs/<date-time> is tightfit's choice, so it must not collide: a second run
    started in the same second (a sweep launched with ``&``), while the first writes its folder or
    after it ended, gets runs/<date-time>-2, -3; a name another run takes between the choice and
    the folder's creation is skipped too."""
    common = tiny_cpu_job(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(api.time, "strftime", lambda fmt, *a: "20261207-090615")
    first = object()
    held = api._claim_run_folder(api._default_run_folder(), first, api._default_run_folder)
    assert held == (Path("runs/20261207-090615"), [Path("runs/20261207-090615"), Path("runs")])
    try:  # the first run is writing it: the next run gets -2, and ends
        api.train(api.TrainRequest(**common, max_steps=1))
        assert (work / "runs" / "20261207-090615-2" / "summary.json").is_file()
        assert list((work / "runs" / "20261207-090615").iterdir()) == []
    finally:
        api._release_run_folders(first)
    (work / "runs" / "20261207-090615-3").mkdir()  # taken between the choice and the creation
    assert api._claim_run_folder(Path("runs/20261207-090615-3"), first, api._default_run_folder)[0] == \
        Path("runs/20261207-090615-4")
    api._release_run_folders(first)


def test_the_lock_is_each_train_calls_own_and_a_filesystem_without_locks_is_no_refusal(tmp_path, monkeypatch):
    """One process, two train calls (threads, a notebook): the second writer of a folder is refused,
    and the first's end releases only its own folders. ENOLCK (Lustre, some NFS) means no lock."""
    import errno
    import fcntl
    import os

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    first, second = object(), object()
    api._hold_run_folder(a, first)
    api._hold_run_folder(a, first)  # again for the same call: held already
    try:
        with pytest.raises(TightfitError, match="is being written by another tightfit run"):
            api._hold_run_folder(a, second)
        api._hold_run_folder(b, second)
        api._release_run_folders(second)
        fd = os.open(a, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # still the first call's
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        api._release_run_folders(first)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    api._hold_run_folder(a, second)  # no refusal, no lock
    assert str(a.resolve()) not in api._HELD


def test_only_tightfits_own_leftovers_are_removed_and_its_markers_too(finished):
    from tightfit.runtime.checkpoint import remove_stale_temporaries

    run, common = finished
    (run / "summary.json").unlink()
    (run / ".my-notes.tmp").write_text("mine")
    (run / ".scratch.tmp").mkdir()
    (run / ".plan.json.q1.tmp").write_text("half")
    (run / "checkpoints" / ".abandoned.json.q2.tmp").write_text("half")
    api.train(api.TrainRequest(**common, resume=str(run)))
    assert (run / ".my-notes.tmp").is_file() and (run / ".scratch.tmp").is_dir()
    assert not (run / ".plan.json.q1.tmp").exists() and not (run / "checkpoints" / ".abandoned.json.q2.tmp").exists()
    assert remove_stale_temporaries(run / "checkpoints") == []


def test_a_times_json_write_cut_short_inside_a_checkpoint_is_removed_on_resume(finished, caplog):
    """A kill while a checkpoint's times.json was written (after the folder's rename, so inside
    ckpt-<step>/) left .times.json.<random>.tmp there, which nothing removed: the resume's cleanup
    looked only at the checkpoints folder itself. It is removed with a note, as the others are."""
    import logging

    run, common = finished
    (run / "summary.json").unlink()
    (run / "checkpoints" / "ckpt-8" / ".times.json.k9x2.tmp").write_text('{"checkpoint_sec')
    (run / "checkpoints" / "ckpt-8" / ".my-notes.tmp").write_text("mine")  # not tightfit's: left alone
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        api.train(api.TrainRequest(**common, resume=str(run)))
    assert not (run / "checkpoints" / "ckpt-8" / ".times.json.k9x2.tmp").exists()
    assert (run / "checkpoints" / "ckpt-8" / ".my-notes.tmp").is_file()
    assert any("removed ckpt-8/.times.json.k9x2.tmp" in r.getMessage() and "cut short" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_old_checkpoints_without_a_manifest_stay_abandoned_in_a_copy_of_the_run(finished, tmp_path):
    import os

    from tightfit.runtime.checkpoint import abandoned_checkpoints, latest_intact_checkpoint, mark_abandoned

    run, _ = finished
    for name in ("ckpt-6", "ckpt-8"):
        (run / "checkpoints" / name / "manifest.json").unlink()  # as an older tightfit wrote them
    mark_abandoned(run / "checkpoints", 4)
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for name in ("ckpt-6", "ckpt-8"):  # as `cp -r` leaves them: new modification times
        os.utime(copy / "checkpoints" / name, ns=(10**18, 10**18))
    assert abandoned_checkpoints(copy / "checkpoints")[0] == {"ckpt-6", "ckpt-8"}
    assert latest_intact_checkpoint(copy / "checkpoints").path.name == "ckpt-4"


def test_a_new_runs_folder_filled_by_another_run_after_its_checks_is_refused_under_the_lock(tmp_path, monkeypatch):
    common = tiny_cpu_job(tmp_path)
    out = tmp_path / "new"
    out.mkdir()
    setup = api.TrainRecipe.setup

    def another_run_starts_meanwhile(self):
        setup(self)  # --out checked: empty
        (out / "request.json").write_text("{}")  # another run made its folder there while this one planned

    monkeypatch.setattr(api.TrainRecipe, "setup", another_run_starts_meanwhile)
    with pytest.raises(TightfitError, match="choose another out"):
        api.train(api.TrainRequest(**common, max_steps=2, out=str(out)))
    assert [p.name for p in out.iterdir()] == ["request.json"]


def test_a_resume_from_a_checkpoint_written_at_another_learning_rate_says_which_applies(finished, caplog):
    """Resumed from ckpt-4 at --lr 3e-4 to the end, then from ckpt-4 again without --lr: the run's
    options (request.json) say 3e-4, the checkpoint was written at the first rate, and the second
    resume applied 3e-4 without a word. It still applies the run's options (as `--resume` promises),
    and now says so, naming the flag that keeps the checkpoint's rate."""
    import logging

    run, common = finished
    first = torch.load(run / "checkpoints" / "ckpt-4" / "state.pt", weights_only=True)["scheduler"]["base_lrs"][0]
    api.train(api.TrainRequest(**common, lr=3e-4, resume=str(run / "checkpoints" / "ckpt-4")))
    with caplog.at_level(logging.INFO, logger="tightfit"):
        api.train(api.TrainRequest(**common, resume=str(run / "checkpoints" / "ckpt-4")))
    said = [r.getMessage() for r in caplog.records if "was written at" in r.getMessage()]
    assert said == [f"tightfit: ckpt-4 was written at lr={first:g}; the run's options since say lr=0.0003, which "
                    f"applies from here (give lr={first:g} to keep the checkpoint's)"], said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):  # resumed at its own rate: nothing to say
        api.train(api.TrainRequest(**common, lr=first, resume=str(run / "checkpoints" / "ckpt-4")))
    assert not [r for r in caplog.records if "was written at" in r.getMessage()]


def test_an_interrupt_while_the_finished_runs_summary_is_printed_says_the_run_is_complete(tmp_path, monkeypatch,
                                                                                          caplog):
    """A fresh user's Ctrl-C as the summary lines were printed: every file was written, yet the note
    said "interrupted during writing the model and the report ... continue with --resume (it
    finishes the run)". It now says the run had finished and where its results are."""
    import logging

    common = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    info = api.log.info

    def interrupted_at_the_summary(message, *a, **k):
        if message == "summary:":  # right after summary.json was written
            raise KeyboardInterrupt
        return info(message, *a, **k)

    monkeypatch.setattr(api.log, "info", interrupted_at_the_summary)
    with caplog.at_level(logging.WARNING, logger="tightfit"), pytest.raises(KeyboardInterrupt):
        api.train(api.TrainRequest(**common, max_steps=2, out=str(run)))
    assert (run / "summary.json").is_file()
    assert f"interrupted after the run had finished: its model, report and summary are in {run}" in caplog.text
    assert "--resume" not in caplog.text


def test_a_run_whose_data_moved_resumes_from_the_new_place_with_the_same_data(tmp_path, capsys):
    """A fresh user moved the data folder of a stopped run: --resume said "data not found" and
    --data at the new place was refused as a changed option. The run's recorded data gone, its new
    place may be given; other data are still refused by the data check."""
    import shutil

    from tightfit.cli import main

    common = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    api.train(api.TrainRequest(**common, max_steps=4, checkpoint_every=2, out=str(run)))
    (run / "summary.json").unlink()  # as if stopped before its end
    moved = tmp_path / "moved.csv"
    shutil.move(common["data"], moved)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"the run's data {common['data']} is gone (moved or deleted)" in err and "--data" in err, err
    other = tmp_path / "other.csv"
    other.write_text(moved.read_text().replace("pos", "neg", 3))
    assert main(["train", "--resume", str(run), "--data", str(other), "--no-progress"]) == 2
    assert "the data differ from those the run started with" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--data", str(moved), "--no-progress"]) == 0
    assert (run / "summary.json").is_file()
    assert json.loads((run / "request.json").read_text())["data"] == str(moved)
    # a run that recorded no fingerprint (before fingerprints were kept) cannot check new data: refused
    record = json.loads((run / "request.json").read_text())
    record.pop("data_fingerprint", None)
    (run / "request.json").write_text(json.dumps(record))
    (run / "summary.json").unlink()
    shutil.move(moved, tmp_path / "moved-again.csv")
    assert main(["train", "--resume", str(run), "--data", str(other), "--no-progress"]) == 2
    assert "recorded no fingerprint" in capsys.readouterr().err
