"""DESIGN invariant 13: there is one training step. The runtime, the planner's GPU probe and the
memory estimator's trace all run :func:`tightfit.step.training_step`, with the plan's optimizer
(built by :func:`tightfit.step.make_optimizer`) and the plan's precision."""

from __future__ import annotations

import copy
import importlib
import inspect
import subprocess
import sys

import pytest
import torch

import tightfit.step
from tightfit.levers.optimizers import weights_dtype
from tightfit.memory.estimate import estimate
from tightfit.planner import probe as probe_module
from tightfit.plan import Plan
from tightfit.runtime import trainer as trainer_module
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.step import OPTIMIZERS, MetaOptimizer, make_optimizer

estimate_module = importlib.import_module("tightfit.memory.estimate")  # the package's name is the function
CALLERS = {"runtime": trainer_module, "probe": probe_module, "estimator": estimate_module}


def _spy(monkeypatch, module) -> list[dict]:
    """Replace ``module.training_step`` by a wrapper of the real one that records the arguments
    of every call (and how many micro-batches it drew)."""
    real, calls = module.training_step, []
    signature = inspect.signature(real)

    def spy(*args, **kwargs):
        call = dict(signature.bind(*args, **kwargs).arguments)
        call["micro_batch_count"] = 0

        def counted(batches):
            for b in batches:
                call["micro_batch_count"] += 1
                yield b

        call["micro_batches"] = counted(call["micro_batches"])
        calls.append(call)
        return real(**{k: v for k, v in call.items() if k != "micro_batch_count"})

    monkeypatch.setattr(module, "training_step", spy)
    return calls


def _kind(optimizer) -> tuple:
    """What distinguishes the optimizers of :data:`OPTIMIZERS`: class, fused, foreach."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # the estimator's labelling wrapper
    if isinstance(optimizer, MetaOptimizer):
        return ("meta", optimizer.kind)
    d = optimizer.defaults
    return type(optimizer).__name__, bool(d.get("fused")), bool(d.get("foreach"))


def _no_cuda_stats(monkeypatch):
    """Let the GPU probe run on the CPU: its CUDA synchronisation and peak statistics become no-ops."""
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("max_memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: 0)


def test_the_three_callers_share_one_step_function():
    for name, module in CALLERS.items():
        assert module.training_step is tightfit.step.training_step, name
        assert module.make_optimizer is tightfit.step.make_optimizer, name


@pytest.mark.parametrize("kind", ["adamw", "adamw-foreach"])
def test_runtime_probe_and_estimator_run_the_step_with_the_plans_optimizer(make_workload, monkeypatch, kind):
    calls = {name: _spy(monkeypatch, module) for name, module in CALLERS.items()}
    _no_cuda_stats(monkeypatch)
    expected = _kind(make_optimizer(torch.nn.Linear(2, 2).parameters(), kind, "cpu"))

    w = make_workload(n=16, effective_batch=8)
    t = Trainer(w, Plan("fp32", 4, 8, optimizer=kind), TrainConfig(epochs=1), progress=False)
    t.fit()
    assert len(calls["runtime"]) == 2  # 16 samples, 8 per step
    for c in calls["runtime"]:
        assert c["optimizer"] is t.optimizer and _kind(c["optimizer"]) == expected
        assert c["micro_batch_count"] == 2 and c["normaliser"] == 8 and c["loss_sum"] is w.loss_sum

    probe_module.probe_step(w, 4, "fp32", 1 << 40, timed_steps=2, optimizer=kind)
    assert [c["micro_batch_count"] for c in calls["probe"]] == [1, 2, 2]  # accumulating: the plan's 2 when timed
    calls["probe"].clear()  # 8 micro-batches of 1: timed with the most a probe step runs, not 2
    probe_module.probe_step(w, 1, "fp32", 1 << 40, timed_steps=1, optimizer=kind)
    timed = probe_module.TIMED_MICRO_BATCHES
    assert 2 < timed < 8 and [c["micro_batch_count"] for c in calls["probe"]] == [1, timed]
    calls["probe"].clear()  # 3 micro-batches (3, 3, 2): a whole step, so the update is counted once
    probe_module.probe_step(w, 3, "fp32", 1 << 40, timed_steps=1, optimizer=kind)
    assert [c["micro_batch_count"] for c in calls["probe"]] == [1, 3]
    assert {_kind(c["optimizer"]) for c in calls["probe"]} == {expected}
    assert all(c["loss_sum"] is w.loss_sum for c in calls["probe"])

    example = w.train.collate([0, 1])
    estimate(w.model, example, Plan("fp32", 2, 2, optimizer=kind))
    assert len(calls["estimator"]) == estimate_module.STEPS
    assert {_kind(c["optimizer"]) for c in calls["estimator"]} == {("meta", kind)}


@pytest.mark.parametrize("kind", [k for k in OPTIMIZERS if k != "adamw-offload"])  # offload: CUDA only
def test_probe_builds_the_plans_optimizer_and_leaves_the_weights_alone(make_workload, monkeypatch, kind):
    calls = _spy(monkeypatch, probe_module)
    _no_cuda_stats(monkeypatch)
    w = make_workload(n=16, effective_batch=8, dropout=0.1)
    w.model.eval()
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    bf16 = weights_dtype(kind) is not None  # adamw8bit-bf16: the probe steps bf16 weights under bf16 autocast
    result = probe_module.probe_step(w, 8, "bf16" if bf16 else "fp32", 1 << 40, timed_steps=1, optimizer=kind)
    assert result.fits and result.micro_batches == 1  # not accumulating: one micro-batch per step
    expected = _kind(make_optimizer(copy.deepcopy(w.model).to(torch.bfloat16 if bf16 else torch.float32).parameters(),
                                    kind, "cpu"))
    assert [_kind(c["optimizer"]) for c in calls] == [expected, expected]
    assert all(c["optimizer"].param_groups[0]["lr"] == 0.0 for c in calls)
    # the run's weight decay: an optimizer compiled per tensor (torchao's) is not compiled again for the run
    from tightfit.runtime.trainer import TrainConfig
    wd = TrainConfig(epochs=1).weight_decay if kind != "sgd" else 0
    assert all(float(c["optimizer"].param_groups[0].get("weight_decay", 0)) == wd for c in calls), kind
    for n, p in w.model.named_parameters():
        assert p.dtype == before[n].dtype and torch.equal(p, before[n]), n  # lr 0 (weight decay scaled by it): bit-identical
        assert p.grad is None
    assert not w.model.training  # the probe ran in train mode and gave the mode back


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_probe_and_runtime_run_the_plans_precision(make_workload, monkeypatch, precision):
    """Same autocast dtype and loss scaling (on for fp16 only) in the runtime and the probe."""
    calls = {name: _spy(monkeypatch, CALLERS[name]) for name in ("runtime", "probe")}
    _no_cuda_stats(monkeypatch)
    w = make_workload(n=8, effective_batch=8)
    Trainer(w, Plan(precision, 8, 8), TrainConfig(epochs=1), progress=False).fit()
    probe_module.probe_step(w, 8, precision, 1 << 40, timed_steps=1)

    def seen(call):
        with call["autocast_ctx"]():
            amp = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
        return amp, call["scaler"] is not None and call["scaler"].is_enabled()

    want = (torch.float16 if precision == "fp16" else False, precision == "fp16")
    assert {seen(c) for cs in calls.values() for c in cs} == {want}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_forward_runs_under_the_plans_autocast(make_workload, monkeypatch, precision):
    """The context handed to the step is entered around the forward and loss themselves (the test
    above checks only which context the callers hand over): every training forward of a run sees
    the plan's autocast, and the backward sees none."""
    _no_cuda_stats(monkeypatch)
    w = make_workload(n=8, effective_batch=8)
    seen = []
    w.model.register_forward_pre_hook(lambda m, a: seen.append(
        (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))))
    Trainer(w, Plan(precision, 4, 8), TrainConfig(epochs=1), progress=False).fit()
    want = torch.bfloat16 if precision == "bf16" else False
    assert [amp for grad, amp in seen if grad] == [want, want]


def test_the_documented_estimator_names_are_the_function_and_its_result():
    """docs/memory-estimator.md: ``tightfit.memory.estimate(model, example_batch, plan, ...)``; the
    lazy package attribute had recursed (its submodule has the same name)."""
    first = "from tightfit.memory.estimate import estimate as fn; "  # the library's own modules import it so
    for code in ["import tightfit.memory as m; from tightfit.memory import estimate, MemoryEstimate; "
                 "import tightfit.memory.estimate as again; "
                 "assert callable(estimate) and estimate is m.estimate is again and isinstance(MemoryEstimate, type); "
                 "assert estimate.__module__ == 'tightfit.memory.estimate'",
                 first + "import tightfit.memory as m; assert m.estimate is fn, m.estimate",
                 first + "import tightfit.memory as m; m.MemoryEstimate; import tightfit.memory.estimate; "
                         "assert m.estimate is fn, m.estimate"]:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, (code, done.stderr[-2000:])
