"""``--deterministic``: the run's planning, training and evaluation under deterministic kernels
(why: :mod:`tightfit.runtime.determinism`; the bit-for-bit GPU check is tests/test_gpu.py's
resumed CUDA-graph run), and the process's settings as they were afterwards."""

import os
from types import SimpleNamespace

import pytest
import torch

from tightfit.config import TrainRequest
from tightfit.runtime.determinism import CUBLAS_ENV, NO_DETERMINISTIC_KERNEL, deterministic_kernels


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
            # not warn_only: with it some kernels stay nondeterministic and only warn
            assert _settings() == (True, False, False, True, False)
            assert os.environ[CUBLAS_ENV] == ":4096:8"
        assert _settings() == before
        with deterministic_kernels(False):
            assert _settings() == before
    finally:
        torch.backends.cudnn.benchmark = False


def test_a_users_cublas_setting_is_kept(monkeypatch):
    monkeypatch.setenv(CUBLAS_ENV, ":16:8")
    with deterministic_kernels(True):
        assert os.environ[CUBLAS_ENV] == ":16:8"


def test_train_plans_trains_and_evaluates_deterministically_when_asked(tmp_path, monkeypatch):
    """``tightfit train --deterministic``: the run (``api._train``) is inside; without it, not."""
    import tightfit.api as api
    import tightfit.image_train as image_train
    from tightfit.cli import main

    seen = []
    monkeypatch.setattr(image_train, "recipe_class", lambda req: lambda req, world: SimpleNamespace(VARYING_SHAPES=True))
    monkeypatch.setattr(api, "_train", lambda recipe, world: seen.append(torch.are_deterministic_algorithms_enabled()))
    main(["train", "--deterministic", "--out", str(tmp_path / "a")])
    main(["train", "--out", str(tmp_path / "b")])
    assert seen == [True, False] and not torch.are_deterministic_algorithms_enabled()


def test_an_operation_without_a_deterministic_kernel_stops_with_one_line_naming_the_option(tmp_path, monkeypatch,
                                                                                          capsys):
    """PyTorch raises for such an operation (on the GPU, e.g. some scatter-reduce kernels): the
    command stops with exit code 2 and one line; another error passes through unchanged."""
    import tightfit.api as api
    import tightfit.image_train as image_train
    from tightfit.cli import main
    from tightfit.errors import TightfitError

    def fails(recipe, world):
        raise RuntimeError(f"index_reduce_cuda {NO_DETERMINISTIC_KERNEL}, but you set "
                           "'torch.use_deterministic_algorithms(True)'. You can turn off determinism ...")

    monkeypatch.setattr(image_train, "recipe_class", lambda req: lambda req, world: SimpleNamespace(VARYING_SHAPES=True))
    monkeypatch.setattr(api, "_train", fails)
    assert main(["train", "--deterministic", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--deterministic: index_reduce_cuda has no deterministic" in err, err
    with pytest.raises(TightfitError, match=r"^deterministic: index_reduce_cuda has no deterministic implementation "
                                            r"in PyTorch \(torch.use_deterministic_algorithms\); run without deterministic$"):
        api.train(TrainRequest(deterministic=True))
    with pytest.raises(RuntimeError, match="other"), deterministic_kernels(True):
        raise RuntimeError("other")
    assert not torch.are_deterministic_algorithms_enabled()
