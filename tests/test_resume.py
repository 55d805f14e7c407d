"""Exact resume: a run killed with SIGKILL mid-training and resumed with ``--resume`` gives the
same losses, step for step, and the same final weights as the uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

WORDS = "film plot actor scene great dull awful superb boring moving script music".split()


@pytest.fixture(scope="module")
def tiny_run_inputs(tmp_path_factory):
    """A small BERT folder (with dropout) and a CSV of 240 labelled texts."""
    from conftest import tiny_text_model_folder

    root = tmp_path_factory.mktemp("tiny")
    model_dir = tiny_text_model_folder(root, WORDS, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       intermediate_size=128, max_position_embeddings=64)
    rng = random.Random(0)
    rows = ["text,label"]
    for _ in range(240):
        words = rng.choices(WORDS, k=rng.randint(3, 20))
        rows.append(f"{' '.join(words)},{'pos' if 'great' in words or 'superb' in words else 'neg'}")
    data = root / "data.csv"
    data.write_text("\n".join(rows) + "\n")
    return model_dir, data


def _cmd(model_dir, data, out):
    return [sys.executable, "-m", "tightfit", "train", "--model", str(model_dir), "--data", str(data),
            "--batch-size", "8", "--epochs", "2", "--lr", "1e-3", "--seq-len", "32", "--log-every", "1",
            "--checkpoint-every", "3", "--out", str(out), "--no-progress", "--device", "cpu"]


def _losses(run):
    """``{step: loss}`` of the train records; a step logged twice fails (a resumed run must not repeat).
    A last line without its newline is a record still being written by the run polled: left out."""
    text = (run / "metrics.jsonl").read_text()
    steps = [json.loads(line) for line in text.splitlines()[:None if text.endswith("\n") else -1]]
    steps = [(r["step"], r["loss"]) for r in steps if r["type"] == "train"]
    assert len({s for s, _ in steps}) == len(steps), "a step is logged twice"
    return dict(steps)


@pytest.fixture(scope="module")
def full_run(tiny_run_inputs, tmp_path_factory):
    """The uninterrupted run that killed and stopped runs must reproduce."""
    model_dir, data = tiny_run_inputs
    full = tmp_path_factory.mktemp("full") / "run"
    subprocess.run(_cmd(model_dir, data, full), check=True, capture_output=True)
    return full


def _assert_same_run(a, b):
    la, lb = _losses(a), _losses(b)
    assert sorted(la) == sorted(lb) == list(range(1, max(la) + 1))
    assert la == lb  # bit-identical losses, step for step
    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (a, b))
    assert sa["accuracy"] == sb["accuracy"]


def test_sigkill_then_resume_reproduces_the_uninterrupted_run(tiny_run_inputs, full_run, tmp_path):
    model_dir, data = tiny_run_inputs
    full, killed = full_run, tmp_path / "killed"
    total = max(_losses(full))
    assert total == 2 * 216 // 8  # 216 training samples (10% held out), 27 steps an epoch

    kill_at = random.Random(os.getpid()).randint(5, total - 5)
    proc = subprocess.Popen(_cmd(model_dir, data, killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (killed / "metrics.jsonl").exists() and max(_losses(killed) or [0]) >= kill_at:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    steps_before = max(_losses(killed))
    assert steps_before < total
    assert not (killed / "model").exists()

    subprocess.run([sys.executable, "-m", "tightfit", "train", "--resume", str(killed), "--no-progress"],
                   check=True, capture_output=True)
    _assert_same_run(full, killed)

    # resuming a finished run changes nothing in its folder
    before = {p: p.read_bytes() for p in killed.rglob("*") if p.is_file()}
    done = subprocess.run([sys.executable, "-m", "tightfit", "train", "--resume", str(killed), "--no-progress"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "already finished" in done.stdout
    assert {p: p.read_bytes() for p in killed.rglob("*") if p.is_file()} == before


def test_ctrl_c_stops_with_a_checkpoint_and_says_how_to_resume(tiny_run_inputs, full_run, tmp_path):
    model_dir, data = tiny_run_inputs
    stopped = tmp_path / "stopped"
    cmd = _cmd(model_dir, data, stopped)
    cmd[cmd.index("--checkpoint-every") + 1] = "100"  # no periodic checkpoint: the stop must write one
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if (stopped / "metrics.jsonl").exists() and max(_losses(stopped) or [0]) >= 4:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.005)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    (line,) = err.strip().splitlines()  # one line, no traceback
    assert (out + err).count("stopped after step") == 1  # said once, with the command that resumes
    assert "SIGINT: stopped after step" in line and f"tightfit train --resume {stopped}" in line
    assert (stopped / "checkpoints").is_dir() and not (stopped / "model").exists()
    subprocess.run([sys.executable, "-m", "tightfit", "train", "--resume", str(stopped), "--no-progress"],
                   check=True, capture_output=True)
    _assert_same_run(full_run, stopped)


def test_training_steps_run_with_dropout_on(tiny_run_inputs, tmp_path, monkeypatch):
    """The whole `tightfit train` path: from_pretrained gives an eval-mode model; training must not."""
    from tightfit.api import TrainRequest, train

    model_dir, data = tiny_run_inputs
    seen = []
    forward = torch.nn.Dropout.forward

    def spy(self, x):
        seen.append((torch.is_grad_enabled(), self.training))
        return forward(self, x)

    monkeypatch.setattr(torch.nn.Dropout, "forward", spy)
    train(TrainRequest(model=str(model_dir), data=str(data), batch_size=8, epochs=1, max_steps=3, seq_len=32,
                       device="cpu", out=str(tmp_path / "run"), progress=False))
    assert any(g for g, _ in seen) and all(t for g, t in seen if g)  # every training forward: dropout on
    assert not any(t for g, t in seen if not g)  # evaluation: dropout off


def test_resume_errors(tmp_path, capsys):
    from tightfit.cli import main

    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a tightfit run folder" in capsys.readouterr().err
    (tmp_path / "request.json").write_text("{}")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_no_checkpoint_with_non_finite_weights(tmp_path):
    from tightfit.runtime.checkpoint import NonFiniteCheckpointError, list_checkpoints, save_checkpoint

    model = torch.nn.Linear(3, 2)
    save_checkpoint(tmp_path, 1, model, {"step": 1})
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteCheckpointError, match="weight"):
        save_checkpoint(tmp_path, 2, model, {"step": 2})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-1"]


def test_a_huge_finite_weight_is_checkpointed_and_an_inf_one_named(tmp_path):
    """The finite check takes one total norm of every weight: a finite weight whose square
    overflows (3e38) makes that norm inf, and the per-tensor walk then finds nothing wrong, so the
    checkpoint is written; an inf is refused and named."""
    from tightfit.runtime.checkpoint import NonFiniteCheckpointError, list_checkpoints, load_checkpoint, save_checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        model[0].weight[0, 0] = 3e38
    save_checkpoint(tmp_path, 1, model, {"step": 1})
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))
    load_checkpoint(list_checkpoints(tmp_path)[0], other)
    assert other[0].weight[0, 0] == torch.tensor(3e38)
    with torch.no_grad():
        model[1].bias[1] = float("-inf")
    with pytest.raises(NonFiniteCheckpointError, match="parameter '1.bias' holds inf/NaN"):
        save_checkpoint(tmp_path, 2, model, {"step": 2})


def test_checkpoints_keep_last_and_load_weights_only(tmp_path):
    from tightfit.runtime.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    for step in (2, 4, 6, 8):
        save_checkpoint(tmp_path, step, model, {"step": step, "t": torch.arange(3)}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-6", "ckpt-8"]
    other = torch.nn.Linear(3, 2)
    state = load_checkpoint(tmp_path / "ckpt-8", other)
    assert state["step"] == 8 and torch.equal(state["t"], torch.arange(3))
    assert torch.equal(other.weight, model.weight)


def test_atomic_folders_get_the_modes_of_a_plain_mkdir(tmp_path):
    import os
    import stat
    from tightfit.fileio import atomic_write_dir
    mask = os.umask(0)
    os.umask(mask)
    atomic_write_dir(tmp_path / "model", lambda d: (d / "w.bin").write_bytes(b"x") and os.chmod(d / "w.bin", 0o600))
    assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o777 & ~mask
    assert stat.S_IMODE((tmp_path / "model" / "w.bin").stat().st_mode) == 0o666 & ~mask


def _short_run(model_dir, data, out, *extra):
    from tightfit.cli import main
    return main(["train", "--model", str(model_dir), "--data", str(data), "--batch-size", "8", "--max-steps", "2",
                 "--lr", "1e-3", "--seq-len", "32", "--checkpoint-every", "1", "--out", str(out), "--no-progress",
                 "--device", "cpu", *extra])


def test_resume_takes_options_written_anew_even_at_their_default(tiny_run_inputs, tmp_path):
    from tightfit.api import TrainRequest, _resume_request
    from tightfit.cli import _given_options, _parser

    model_dir, data = tiny_run_inputs
    assert _short_run(model_dir, data, tmp_path / "run", "--max-skipped-steps", "5") == 0
    parser = _parser()
    argv = ["train", "--resume", str(tmp_path / "run"), "--lr", "5e-5", "--max-skipped-steps", "20"]
    args = parser.parse_args(argv)
    args.given_options = _given_options(parser.train_parser, argv)
    req, _, changed, _, _ = _resume_request(TrainRequest.from_args(args))
    assert changed == {"lr": [1e-3, 5e-5], "max_skipped_steps": [5, 20]}  # both are the defaults
    assert req.training.lr == 5e-5 and req.training.max_skipped_steps == 20


def test_resume_refuses_data_that_changed(tiny_run_inputs, tmp_path, capsys):
    from tightfit.cli import main

    model_dir, data = tiny_run_inputs
    mine = tmp_path / "data.csv"
    mine.write_text(data.read_text())
    run = tmp_path / "run"
    assert _short_run(model_dir, mine, run) == 0
    (run / "summary.json").unlink()  # as if stopped before the end
    lines = mine.read_text().splitlines()
    mine.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # one row fewer: every later sample moves
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    assert "data differ" in capsys.readouterr().err
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resume_finds_relative_model_and_data_from_another_working_directory(tiny_run_inputs, tmp_path,
                                                                             monkeypatch, capsys):
    import shutil

    from tightfit.cli import main

    model_dir, data = tiny_run_inputs
    shutil.copytree(model_dir, tmp_path / "model")
    shutil.copy(data, tmp_path / "data.csv")
    monkeypatch.chdir(tmp_path)
    assert _short_run("model", "data.csv", "run") == 0  # paths relative to the working directory
    (tmp_path / "run" / "summary.json").unlink()  # as if stopped before the end
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress"]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "summary.json").is_file()


def test_a_saved_classifier_trains_on_another_number_of_classes(tiny_run_inputs, tmp_path):
    model_dir, data = tiny_run_inputs
    assert _short_run(model_dir, data, tmp_path / "two") == 0  # model/ holds a 2-class head
    rows = data.read_text().splitlines()
    three = tmp_path / "three.csv"
    three.write_text("\n".join(rows[:1] + [f"{r.rsplit(',', 1)[0]},{'abc'[i % 3]}" for i, r in enumerate(rows[1:])]))
    assert _short_run(tmp_path / "two" / "model", three, tmp_path / "run3") == 0
    summary = json.loads((tmp_path / "run3" / "summary.json").read_text())
    assert summary["steps"] == 2


def test_an_interrupt_before_the_first_checkpoint_leaves_the_folder_reusable(tiny_run_inputs, tmp_path, monkeypatch,
                                                                              capsys):
    from tightfit.runtime.trainer import Trainer

    model_dir, data = tiny_run_inputs

    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "fit", interrupted)
    assert _short_run(model_dir, data, tmp_path / "run") == 130
    assert not (tmp_path / "run").exists()
    assert f"stopped before its first checkpoint: removed {tmp_path / 'run'} (nothing" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()  # a folder the user made stays, empty
    assert _short_run(model_dir, data, tmp_path / "empty") == 130
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    assert f"removed what it had written in {tmp_path / 'empty'}" in capsys.readouterr().out
    monkeypatch.undo()
    assert _short_run(model_dir, data, tmp_path / "run") == 0  # the same --out works again


@pytest.mark.skipif(__import__("importlib").util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_resuming_a_lever_run_without_its_library_names_the_runs_optimizer(tiny_run_inputs, tmp_path, capsys,
                                                                           monkeypatch):
    """The user resuming never typed --optimizer: the refusal names the resumed run's optimizer."""
    import tightfit.planner.optimizers as optimizers
    from tightfit.cli import main

    model_dir, data = tiny_run_inputs
    run = tmp_path / "run"
    assert _short_run(model_dir, data, run, "--optimizer", "adamw8bit") == 0
    (run / "summary.json").unlink()  # as if stopped before the end
    monkeypatch.setattr(optimizers, "levers_installed", lambda kind=None: False)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "the resumed run's optimizer adamw8bit needs bitsandbytes" in err and "--optimizer" not in err


def test_a_run_piped_into_a_reader_that_stops_trains_to_the_end(tiny_run_inputs, full_run, tmp_path):
    """``tightfit train ... | head -2``: once the reader has gone the output is discarded and the
    run trains on (it exited 0 having trained nothing, and a closed pipe mid-run would lose the
    steps since the last checkpoint); it ends as the uninterrupted run does."""
    model_dir, data = tiny_run_inputs
    out = tmp_path / "piped"
    proc = subprocess.Popen(_cmd(model_dir, data, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line, as `head -1` does
    _, err = proc.communicate(timeout=300)
    assert first.startswith("tightfit") and proc.returncode == 0, err
    assert (out / "summary.json").is_file() and _losses(out) == _losses(full_run)


def test_a_run_whose_progress_bar_reader_stops_trains_to_the_end(tiny_run_inputs, full_run, tmp_path):
    """``tightfit train ... 2>&1 | head -c 10``: the progress bar (stderr) met the closed pipe and the
    run stopped with nothing trained, exit 0. Its output is discarded now and the run trains on."""
    model_dir, data = tiny_run_inputs
    out = tmp_path / "piped"
    cmd = [a for a in _cmd(model_dir, data, out) if a != "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdout.read(10)
    proc.stdout.close()
    proc.wait(timeout=300)
    assert proc.returncode == 0 and (out / "summary.json").is_file() and _losses(out) == _losses(full_run)


def test_resume_refuses_a_new_value_it_cannot_apply_and_takes_a_repeated_one(tiny_run_inputs, tmp_path, capsys):
    """A resumed run keeps its options: a new --epochs (or --batch-size, --out) would be ignored, so it
    is refused in one line before anything is read or written; the run's own values may be repeated."""
    from tightfit.cli import main

    model_dir, data = tiny_run_inputs
    run = tmp_path / "run"
    assert _short_run(model_dir, data, run) == 0
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    capsys.readouterr()
    for extra, named in ((["--epochs", "5"], "--epochs"), (["--batch-size", "2"], "--batch-size"),
                         (["--out", str(tmp_path / "elsewhere")], "--out")):
        assert main(["train", "--resume", str(run), "--no-progress", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"cannot change {named}" in err, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before and not (tmp_path / "elsewhere").exists()
    assert main(["train", "--resume", str(run), "--no-progress", "--model", str(model_dir), "--data", str(data)]) == 0


def test_resume_takes_the_runs_own_command_however_its_values_are_spelled(tiny_run_inputs, tmp_path, monkeypatch):
    """The original command again with --resume: relative paths (request.json holds absolute ones),
    a trailing slash, a GPU profile in capitals, a budget in other units are the run's own values."""
    from tightfit.api import _same_option
    from tightfit.cli import main

    model_dir, data = tiny_run_inputs
    monkeypatch.chdir(model_dir.parent)
    rel_model, rel_data = f"./{model_dir.name}/", data.name
    run = tmp_path / "run"
    assert _short_run(rel_model, rel_data, run) == 0
    assert main(["train", "--model", rel_model, "--data", rel_data, "--batch-size", "8", "--max-steps", "2",
                 "--lr", "1e-3", "--seq-len", "32", "--checkpoint-every", "1", "--out", str(run), "--no-progress",
                 "--device", "cpu", "--resume", str(run)]) == 0
    assert _same_option("budget", "4GiB", "4096MiB") and _same_option("gpu", "h200", "H200")
    assert _same_option("model", None, "minilm") and not _same_option("model", None, "bert-base")
    assert not _same_option("budget", "4GiB", "5GiB")


def _main_stopped_at(monkeypatch, step, argv):
    """``tightfit.cli.main(argv)`` with a SIGTERM sent while step ``step``'s record is logged (as
    a supervisor's would arrive mid-run); returns its exit code."""
    from tightfit.cli import main
    from tightfit.report.metrics import MetricsWriter

    log = MetricsWriter.__call__

    def logged(self, record):
        log(self, record)
        if record.get("type") == "train" and record.get("step") == step:
            os.kill(os.getpid(), signal.SIGTERM)
    with monkeypatch.context() as m:
        m.setattr(MetricsWriter, "__call__", logged)
        return main(argv)


def test_a_resumed_runs_report_lists_every_sessions_command(tiny_run_inputs, tmp_path, monkeypatch):
    """report.md named only the first session's command (request.json's, which a resume keeps):
    a run stopped twice and resumed lists the three commands, in order, one line each."""
    from tightfit.cli import main

    model_dir, data = tiny_run_inputs
    run = tmp_path / "run"
    first = ["train", "--model", str(model_dir), "--data", str(data), "--batch-size", "8", "--max-steps", "8",
             "--lr", "1e-3", "--seq-len", "32", "--checkpoint-every", "2", "--log-every", "1", "--out", str(run),
             "--no-progress", "--device", "cpu"]
    second = ["train", "--resume", str(run), "--no-progress"]
    third = ["train", "--resume", str(run), "--no-progress", "--log-every", "2"]  # an option given anew too
    assert _main_stopped_at(monkeypatch, 3, first) == 143  # SIGTERM: 128 + 15
    assert _main_stopped_at(monkeypatch, 5, second) == 143
    assert main(third) == 0
    commands = [" ".join(["tightfit", *argv]) for argv in (first, second, third)]
    report = (run / "report.md").read_text()
    assert "- commands (one per session):\n" + "".join(f"  - `{c}`\n" for c in commands) in report, report
    summary = json.loads((run / "summary.json").read_text())
    assert summary["commands"] == commands and summary["command"].startswith(commands[0])
    # a run of one session says its one command as before
    assert _short_run(model_dir, data, tmp_path / "one") == 0
    assert "- command: `tightfit train --model" in (tmp_path / "one" / "report.md").read_text()
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["commands"] == [
        json.loads((tmp_path / "one" / "summary.json").read_text())["command"]]


def test_the_commands_of_sessions_that_recorded_none_fall_back_to_the_runs_own(tmp_path):
    """Plan records written before commands were recorded: the first session's is request.json's,
    a later one's is left out; without metrics.jsonl the run's own command comes first."""
    from tightfit.report.metrics import session_commands

    path = tmp_path / "metrics.jsonl"
    records = [{"type": "plan", "step": 0, "resumed_from": None}, {"type": "train", "step": 1},
               {"type": "plan", "step": 3, "resumed_from": "run/checkpoints/ckpt-3"},
               {"type": "plan", "step": 5, "resumed_from": "run/checkpoints/ckpt-5", "command": "tightfit train -r"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert session_commands(path, "tightfit train --model m") == ["tightfit train --model m", "tightfit train -r"]
    assert session_commands(tmp_path / "missing.jsonl", "tightfit train --model m") == ["tightfit train --model m"]


def test_a_resumed_run_counts_the_write_of_the_checkpoint_it_resumed_from(tiny_run_inputs, tmp_path, monkeypatch):
    """A checkpoint carries the run's checkpoint times so far, taken before its own write: a resumed
    run's summary lost the time spent writing the last checkpoint of each earlier session. Each
    write is made to take 100 s more on the writer's clock: the summary counts every one."""
    from types import SimpleNamespace

    import tightfit.runtime.async_checkpoint as writer
    from tightfit.cli import main

    later, writes, write = [0.0], [], writer.write_snapshot

    def slow(folder, step, *a, **k):  # 100 s on the writer's clock (test time: none)
        later[0] += 100.0
        writes.append(step)
        return write(folder, step, *a, **k)
    monkeypatch.setattr(writer, "write_snapshot", slow)
    monkeypatch.setattr(writer, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + later[0]))
    model_dir, data = tiny_run_inputs
    run = tmp_path / "run"
    assert _main_stopped_at(monkeypatch, 3, ["train", "--model", str(model_dir), "--data", str(data), "--batch-size",
                                             "8", "--max-steps", "8", "--lr", "1e-3", "--seq-len", "32",
                                             "--checkpoint-every", "2", "--log-every", "1", "--out", str(run),
                                             "--no-progress", "--device", "cpu"]) == 143  # SIGTERM
    assert writes == [2, 3]
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert writes == [2, 3, 4, 6, 8]
    got = json.loads((run / "summary.json").read_text())["speed"]["checkpoint_write_seconds"]
    assert 100 * len(writes) <= got < 100 * len(writes) + 50, got  # the stop's ckpt-3 too

    from tightfit.runtime.checkpoint import TIMES, checkpoint_times, verify_checkpoint

    newest = run / "checkpoints" / "ckpt-8"
    assert (newest / TIMES).is_file() and verify_checkpoint(newest)  # beside the manifest's files, not in them
    (newest / TIMES).write_text("{")  # damaged, or absent (an older tightfit's): the state's counters stand
    assert checkpoint_times(newest) is None
    (newest / TIMES).unlink()
    assert checkpoint_times(newest) is None and verify_checkpoint(newest)


def test_an_interrupt_during_the_final_evaluation_says_the_run_is_trained_and_is_an_event(tiny_run_inputs, tmp_path,
                                                                                           monkeypatch, capsys, caplog):
    """It said only "continue with: tightfit train --resume RUN" (to a user of the Python API too)
    and "tightfit: interrupted", and the resumed run's report had no word of how the first
    session ended."""
    import logging

    import tightfit.api as api
    from tightfit.runtime.trainer import Trainer

    model_dir, data = tiny_run_inputs
    evaluate = Trainer.evaluate

    def interrupted(self):
        raise KeyboardInterrupt
    monkeypatch.setattr(Trainer, "evaluate", interrupted)
    run = tmp_path / "run"
    assert _short_run(model_dir, data, run) == 130
    assert (f"note: interrupted during the final evaluation: the run is trained; continue with: "
            f"tightfit train --resume {run} (it finishes the run)") in capsys.readouterr().out
    events = [r["message"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
              if r["type"] == "event"]
    assert any(m.startswith("interrupted during the final evaluation") for m in events)
    with caplog.at_level(logging.WARNING, logger="tightfit.api"), pytest.raises(KeyboardInterrupt):
        api.train(api.TrainRequest(resume=str(run)))  # the Python API: its own resume call
    assert f"continue with: tightfit.api.train(TrainRequest(resume={str(run)!r})) (it finishes" in caplog.text
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    assert main_resume(run) == 0
    assert "interrupted during the final evaluation" in (run / "report.md").read_text()


def main_resume(run, *extra):
    from tightfit.cli import main
    return main(["train", "--resume", str(run), "--no-progress", *extra])


def test_resuming_a_finished_run_with_an_option_given_anew_says_it_was_not_applied(tiny_run_inputs, tmp_path, capsys):
    """The notes of the resume ("--resume with --lr ...", "resumed from ...") came before "had
    already finished ... (nothing written)", which did not say the new --lr was not applied."""
    model_dir, data = tiny_run_inputs
    run = tmp_path / "run"
    assert _short_run(model_dir, data, run) == 0
    capsys.readouterr()
    assert main_resume(run, "--lr", "1e-4") == 0
    assert "already finished at step 2: nothing left to train (nothing written; --lr not applied)" in \
        capsys.readouterr().out
