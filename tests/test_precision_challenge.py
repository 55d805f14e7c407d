"""On a card with bf16 and fp16 tensor cores, a model with convolutions has its eager winner
timed in fp16 too, side by side with bf16 (cuDNN's fp16 convolutions ran ResNet-50 1.29x its
bf16 ones on an NVIDIA H200), and fp16 is kept only when clearly faster. Planning on the CPU
with the search's answer and every probe faked (:func:`tightfit.planner.gpu.plan_on_gpu`)."""

import math
from types import SimpleNamespace

import pytest
import torch

from tightfit.devices import get_profile

MiB = 2**20
E = 64


def _plan(monkeypatch, model, fp16_speed, precision="auto"):
    import tightfit.planner.gpu as gpu
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate, SearchResult

    a = Candidate("bf16", 32, (0,), 2, 900, 900, {}, 300.0, "fastest predicted")
    result = SearchResult(a, [], 10**9, E, 4, 0.1)
    timed = []  # (precision, micro-batch, checkpointed blocks) of each probe

    state = SimpleNamespace(blocks=())

    def fake_probe(workload, mb, prec, budget, timed_steps=2, optimizer="adamw"):
        timed.append((prec, mb, state.blocks))
        sps = {"bf16": 240.0, "fp16": fp16_speed}[prec]
        return ProbeResult(mb, True, 500 * MiB, 500 * MiB, E / (sps * math.ceil(E / mb)), 1)

    monkeypatch.setattr(gpu, "search_optimizers", lambda *a, **k: result)
    monkeypatch.setattr(gpu, "estimator_for", lambda *a, **k: None)
    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    monkeypatch.setattr(gpu, "set_activation_checkpointing",
                        lambda m, on, blocks=(), policies=None: setattr(state, "blocks", tuple(blocks or ())))
    w = SimpleNamespace(effective_batch=E, model=model, train=None)
    return gpu.plan_on_gpu(w, get_profile("h200"), 10**9, 16, precision=precision, compile="off"), timed


def test_fp16_is_kept_for_a_convolutional_model_when_it_times_clearly_faster(monkeypatch):
    plan, timed = _plan(monkeypatch, torch.nn.Conv2d(3, 4, 3), fp16_speed=312.0)
    assert plan.precision == "fp16" and plan.micro_batch == 32 and plan.checkpoint_blocks == (0,)
    assert ("fp16", 32, (0,)) in timed  # the winner's own micro-batch and blocks
    line, = [r for r in plan.reasons if r.startswith("precision:")]
    assert "fp16 312 vs bf16 240 samples/s (1.30x)" in line and "dynamic loss scaling kept" in line, line
    decided, = [r for r in plan.reasons if r.startswith("decided by:")]
    assert "chose fp16" in decided and "(bf16" in decided, decided


def test_bf16_stays_when_fp16_is_not_clearly_faster(monkeypatch):
    plan, timed = _plan(monkeypatch, torch.nn.Conv2d(3, 4, 3), fp16_speed=245.0)
    assert plan.precision == "bf16"
    line, = [r for r in plan.reasons if r.startswith("precision:")]
    assert line.endswith("bf16 kept") and "1.05x" in line, line


@pytest.mark.parametrize("model, precision", [(torch.nn.Linear(3, 4), "auto"), (torch.nn.Conv2d(3, 4, 3), "bf16")])
def test_fp16_is_not_timed_without_convolutions_or_against_an_explicit_precision(monkeypatch, model, precision):
    plan, timed = _plan(monkeypatch, model, fp16_speed=999.0, precision=precision)
    assert plan.precision == "bf16" and not any(p == "fp16" for p, _, _ in timed), timed
    assert not any(r.startswith("precision:") for r in plan.reasons)
