"""The runner-up optimizer timed with the compiled plan (:func:`tightfit.planner.gpu.compile_and_retime`,
:func:`~tightfit.planner.gpu.challenge_compiled_optimizer`): an optimizer that keeps the weights in
another dtype than the compiled graph's is not timed, and a runner-up that fails leaves the
compiled plan that won its retiming. On an NVIDIA H200 BERT-large at 4 GiB compiled with bf16
weights (752 samples/s against 396 eager); the fp32-weight runner-up failed in the graph's matmul
and the whole compiled plan was thrown away for the eager one. Stages faked on the CPU."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

MiB = 2**20
E = 128


def _outcome(monkeypatch, mine, other, other_raises=False):
    import tightfit.planner.gpu as gpu
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    best = Candidate("bf16", 64, (0,), 2, 900, 900, {}, 400.0, "fastest", optimizer=mine)
    pr = ProbeResult(64, True, 500 * MiB, 500 * MiB, E / (750.0 * 2), 1)
    variant = gpu.CompiledVariant(750.0, 64, (0,), pr)
    timed = []

    def fake_probe(workload, mb, prec, budget, timed_steps=2, optimizer="adamw"):
        timed.append(optimizer)
        if optimizer == other and other_raises:
            raise RuntimeError("mat1 and mat2 must have the same dtype, but got BFloat16 and Float")
        return ProbeResult(mb, True, 500 * MiB, 500 * MiB, E / ({mine: 750.0}.get(optimizer, 700.0) * 2), 1)

    monkeypatch.setattr(gpu, "compiled_variant", lambda *a, **k: gpu.CompileSearch(variant, ["compiled"]))
    monkeypatch.setattr(gpu, "warm_other_lengths", lambda *a, **k: [])
    monkeypatch.setattr(gpu, "any_length", lambda data: contextlib.nullcontext())
    monkeypatch.setattr(gpu, "retime", lambda *a, **k: gpu.Retiming(752.0, 396.0, "retimed: compiled kept"))
    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    monkeypatch.setattr(gpu, "set_activation_checkpointing", lambda *a, **k: None)
    monkeypatch.setattr(gpu, "uncompile_model", lambda m: pytest.fail("the compiled plan was thrown away"))
    w = SimpleNamespace(effective_batch=E, model=torch.nn.Linear(3, 4), train=None)
    return gpu.compile_and_retime(w, best, 10**9, 24, "auto", None, other_optimizer=other), timed


def test_an_optimizer_with_weights_of_another_dtype_is_not_timed_with_the_compiled_graph(monkeypatch):
    outcome, timed = _outcome(monkeypatch, "adamw8bit-bf16", "adamw-offload")
    assert outcome.variant is not None and outcome.variant.samples_per_s == 752.0
    assert "adamw-offload" not in timed, timed
    line = outcome.notes[-1]
    assert "not timed (adamw-offload keeps the weights in another dtype" in line and line.endswith("adamw8bit-bf16 kept"), line


def test_a_runner_up_that_fails_compiled_keeps_the_compiled_plan(monkeypatch):
    outcome, timed = _outcome(monkeypatch, "adamw8bit", "adamw", other_raises=True)
    assert outcome.variant is not None and outcome.variant.optimizer is None
    assert math.isclose(outcome.variant.samples_per_s, 750.0)  # its own optimizer's timing beside the failure
    line = outcome.notes[-1]
    assert "the runner-up optimizer adamw timed with the compiled plan: failed (RuntimeError: mat1 and mat2" in line \
        and line.endswith("adamw8bit kept"), line
    assert not any("torch.compile failed" in n for n in outcome.notes), outcome.notes


def test_a_runner_up_of_the_same_weights_is_timed_side_by_side(monkeypatch):
    outcome, timed = _outcome(monkeypatch, "adamw8bit", "adamw-foreach")
    assert timed == ["adamw8bit", "adamw-foreach"]
    assert outcome.variant.optimizer is None and outcome.notes[-1].endswith("adamw8bit kept")
