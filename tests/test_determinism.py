"""``--deterministic``: the run's planning, training and evaluation under deterministic kernels
(why: :mod:`tightfit.runtime.determinism`; the bit-for-bit GPU check is tests/test_gpu.py's
resumed CUDA-graph run), and the process's settings as they were afterwards."""

import os

import torch

from tightfit.runtime.determinism import CUBLAS_ENV, deterministic_kernels


def _settings():
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory, torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark)


def test_inside_the_kernels_are_deterministic_and_after_it_the_settings_are_as_found(monkeypatch):
    monkeypatch.delenv(CUBLAS_ENV, raising=False)
    torch.backends.cudnn.benchmark = True  # as a user may have set it
    try:
        before = _settings()
        with deterministic_kernels(True):
            # warn_only: an operation without a deterministic kernel warns, it does not stop the run
            assert _settings() == (True, True, False, True, False)
            assert os.environ[CUBLAS_ENV] == ":4096:8"
        assert _settings() == before and CUBLAS_ENV not in os.environ  # found unset: left unset
        with deterministic_kernels(False):
            assert _settings() == before
    finally:
        torch.backends.cudnn.benchmark = False


def test_a_users_cublas_setting_is_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS_ENV, ":16:8")
    with deterministic_kernels(True):
        assert os.environ[CUBLAS_ENV] == ":16:8"


def _record_at_planning(monkeypatch) -> list:
    """What ``torch.are_deterministic_algorithms_enabled()`` is when each run plans."""
    from tightfit.api import TrainRecipe

    seen, plan = [], TrainRecipe._plan
    monkeypatch.setattr(TrainRecipe, "_plan", lambda self: (seen.append(torch.are_deterministic_algorithms_enabled()),
                                                            plan(self))[1])
    return seen


def test_train_plans_trains_and_evaluates_deterministically_when_asked(tmp_path, monkeypatch):
    """``tightfit train --deterministic``: planning (and what follows) runs inside; without it,
    not; after the command, the process's settings as they were."""
    from conftest import tiny_cpu_job

    from tightfit.cli import main

    import tightfit.api as api

    job = tiny_cpu_job(tmp_path)
    seen, recipes, train = _record_at_planning(monkeypatch), [], api._train
    # the recipes kept alive: the settings are put back when train returns, not when the recipe is collected
    monkeypatch.setattr(api, "_train", lambda recipe, world: (recipes.append(recipe), train(recipe, world))[1])
    for name, flags in (("a", ["--deterministic"]), ("b", [])):
        assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "2",
                     "--seq-len", "16", "--out", str(tmp_path / name), "--no-progress", *flags]) == 0
        assert not torch.are_deterministic_algorithms_enabled()
    assert seen == [True, False]
    # the plan does not show it: the run's notes do, in the header and report.md
    said = "--deterministic: planned, trained and evaluated with PyTorch's deterministic kernels"
    assert said in (tmp_path / "a" / "report.md").read_text()
    assert "deterministic" not in (tmp_path / "b" / "report.md").read_text()


def test_a_resumed_run_keeps_the_setting_it_was_started_with(tmp_path, capsys, monkeypatch):
    """Bit for bit needs the same kernels before and after the checkpoint: ``--deterministic``
    cannot be added on ``--resume``, and a run started with it resumes with it."""
    from conftest import tiny_cpu_job

    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    for name, flags in (("plain", []), ("deterministic", ["--deterministic"])):
        assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "4",
                     "--checkpoint-every", "2", "--seq-len", "16", "--out", str(tmp_path / name), "--no-progress",
                     *flags]) == 0
        (tmp_path / name / "summary.json").unlink()  # as if stopped after its last checkpoint
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "plain"), "--deterministic", "--no-progress"]) == 2
    assert "it cannot change --deterministic" in capsys.readouterr().err
    seen = _record_at_planning(monkeypatch)
    assert main(["train", "--resume", str(tmp_path / "deterministic"), "--no-progress"]) == 0
    assert seen == [True]
