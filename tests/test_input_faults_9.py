"""Faults a fresh user found (session 33): a budget over the --gpu card's memory, a bad budget
in the Python API, the label column given as the text column, an image size of 0 in `estimate`."""

import json
import shutil

import pytest

from tightfit.cli import main
from tightfit.errors import TightfitError


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_train_refuses_a_budget_over_the_gpu_cards_memory_as_plan_does(tmp_path, capsys):
    """`plan --gpu t4 --budget 100GiB` was refused; `train` with the same options trained on the CPU."""
    out = tmp_path / "run"
    assert main(["train", "--gpu", "t4", "--budget", "100GiB", "--max-steps", "1", "--out", str(out),
                 "--no-progress"]) == 2
    assert _error(capsys) == "tightfit: error: budget 100.00 GiB is more than the 15.00 GiB of the NVIDIA Tesla T4"
    assert not out.exists()


@pytest.mark.parametrize("budget, message", [
    ("4XB", "budget='4XB': cannot read memory size '4XB'"),
    (-5, "budget=-5: memory size must be positive"),
])
def test_the_python_api_refuses_a_bad_budget_when_the_request_is_made(budget, message):
    from tightfit.api import TrainRequest

    with pytest.raises(TightfitError, match=message.replace("(", r"\(")):
        TrainRequest(budget=budget)
    TrainRequest(budget="4GiB")  # a good one passes


def test_the_command_line_names_the_budget_it_cannot_read(capsys):
    assert main(["train", "--budget", "4XB", "--no-progress"]) == 2
    assert _error(capsys).startswith("tightfit: error: --budget 4XB: cannot read memory size '4XB'")


@pytest.mark.parametrize("flags", [["--text-column", "label"], ["--text-column", "y", "--label-column", "y"]])
def test_the_label_column_cannot_also_be_the_text_column(tmp_path, capsys, flags):
    """The label trained as its own text: a complete leak, with no note."""
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"word {i},{i % 2}\n" for i in range(40)))
    assert main(["train", "--data", str(data), *flags, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    col = flags[-1]
    assert _error(capsys) == (f"tightfit: error: --text-column and --label-column name the same column {col!r}: "
                              "the label would be the input; name the column that holds the text")
    assert not (tmp_path / "run").exists()


def test_estimate_refuses_an_image_size_of_0_as_train_does(capsys):
    """`estimate --image-size 0` said "use a multiple of 16, e.g. 16" (0 is one)."""
    assert main(["estimate", "--model", "vit-b16", "--image-size", "0", "--micro-batch", "2"]) == 2
    assert "--image-size" in (line := _error(capsys)) and "multiple" not in line, line


def test_an_option_given_anew_on_resume_is_in_the_reports_events(tmp_path):
    """A new --lr on resume was used, but report.md and summary.json showed only the first
    command (lr 5e-5) and request.json was overwritten: nothing said step 1 ran at another rate."""
    from conftest import tiny_cpu_job

    job = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8",
                 "--max-steps", "4", "--checkpoint-every", "2", "--seq-len", "16", "--device", "cpu",
                 "--out", str(run), "--no-progress"]) == 0
    (run / "summary.json").unlink()  # as if stopped after step 2's checkpoint
    shutil.rmtree(run / "checkpoints" / "ckpt-4")
    assert main(["train", "--resume", str(run), "--lr", "0.001", "--no-progress"]) == 0
    line = "options given anew: --lr 0.001 (was 5e-05)"
    assert f"- {line}" in (run / "report.md").read_text()
    events = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r["type"] == "event" and r["message"] == line for r in events)


@pytest.mark.parametrize("command", [["plan", "--batch-size", "8"], ["estimate", "--micro-batch", "8"]])
@pytest.mark.parametrize("flags, message", [
    (["--budget", "0"], "--budget 0: memory size must be positive, got '0'"),
    (["--budget", "4XB"], "--budget 4XB: cannot read memory size '4XB': write a number and a unit, e.g. 4GiB, 11GB, "
                          "512MiB"),
    (["--budget", ""], "--budget is empty: give a value, or leave --budget out"),
    (["--gpu", ""], "--gpu is empty: give a value, or leave --gpu out"),
])
def test_plan_and_estimate_name_the_budget_and_card_they_refuse_as_train_does(command, flags, message, capsys):
    """`plan --budget 0` said "memory size must be positive" without naming --budget; an empty
    --budget or --gpu was taken as not given (the H200's, silently)."""
    assert main([command[0], "--model", "minilm", "--seq-len", "32", *command[1:], *flags]) == 2
    assert _error(capsys) == f"tightfit: error: {message}"


def test_tightfit_plan_names_the_budget_it_cannot_read():
    import torch

    import tightfit

    with pytest.raises(TightfitError, match=r"^budget='0': memory size must be positive"):
        tightfit.plan(torch.nn.Linear(4, 2), (torch.zeros(2, 4), torch.zeros(2, dtype=torch.long)), budget="0",
                      loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
