"""Faults a careful user found (review helpers, 2026-12-07, left from the last session): each
reproduced, then fixed."""

from conftest import tiny_cpu_job


def _train_args(job, out):
    return ["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "1",
            "--seq-len", "16", "--out", str(out), "--no-progress"]


def test_a_cpu_run_says_its_budget_is_not_applied_rather_than_checked(tmp_path, caplog):
    """On the CPU a --budget of 1e23 GiB was taken with the note that --gpu/--budget 'are
    checked': without --gpu there is no card to check it against, and it caps nothing."""
    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    with caplog.at_level("INFO", logger="tightfit"):
        assert main(_train_args(job, tmp_path / "a") + ["--budget", "1e23GiB"]) == 0
    notes = [r.getMessage() for r in caplog.records if "no CUDA GPU in use" in r.getMessage()]
    assert notes and "--budget caps a GPU's memory and is not applied" in notes[0] and "checked" not in notes[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="tightfit"):
        assert main(_train_args(job, tmp_path / "b") + ["--gpu", "gtx-1650-ti", "--budget", "3GiB"]) == 0
    notes = [r.getMessage() for r in caplog.records if "no CUDA GPU in use" in r.getMessage()]
    assert notes and "--gpu/--budget are checked against the NVIDIA GeForce GTX 1650 Ti's memory" in notes[0]
