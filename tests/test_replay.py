"""Estimates replayed from earlier traces (tightfit.memory.replay) against traced ones: equal
where replayed, traced where the events of a micro-batch are not proven (another program, a
count off the line, outside the traced micro-batches)."""

from __future__ import annotations

import pytest
import torch

from tightfit.memory.allocator import make_allocator
from tightfit.memory.estimate import estimate, from_ledger
from tightfit.memory.ledger import Ledger, replay
from tightfit.memory.replay import Replayer, interpolated, join, split
from tightfit.plan import Plan

from conftest import tiny_bert

TRACED = (2, 8, 20)  # traced first: the evidence
ASKED = (3, 5, 13, 17)  # strictly between them: replayed


def _batch(seq_len=12):
    return {"input_ids": torch.ones(1, seq_len, dtype=torch.long),
            "attention_mask": torch.ones(1, seq_len, dtype=torch.long),
            "labels": torch.zeros(1, dtype=torch.long)}


def _plan(micro_batch, precision="bf16", optimizer="adamw", effective=64):
    return Plan(precision, micro_batch, max(micro_batch, effective), optimizer=optimizer, device="cuda")


def test_a_ledger_replaying_a_trace_gives_its_estimate():
    model, batch = tiny_bert(), _batch()
    for policies in [None, ("selective", "full")]:
        log = []
        est = estimate(model, batch, _plan(6), block_policies=policies, log=log)
        ledger = replay(log, Ledger(make_allocator("expandable"), [make_allocator("default")]))
        assert from_ledger(ledger, _plan(6), policies or ("none", "none")) == est
        assert join(*split(log)) == log


@pytest.mark.parametrize("precision,optimizer,choice", [
    ("bf16", "adamw", {"checkpoint_blocks": ()}),
    ("bf16", "adamw8bit", {"checkpoint_blocks": (0, 1)}),
    ("fp32", "adamw", {"block_policies": ("selective", "none")}),
    ("bf16", "sgd", {"block_policies": ("full", "selective")}),
])
def test_replayed_estimates_equal_traced_ones(precision, optimizer, choice):
    model, batch = tiny_bert(), _batch()
    r = Replayer(model, batch)
    for b in TRACED:
        r.estimate(_plan(b, precision, optimizer), **choice)
    assert r.traced == len(TRACED) and r.replayed == 0
    for b in ASKED:
        got = r.estimate(_plan(b, precision, optimizer), **choice)
        assert got == estimate(model, batch, _plan(b, precision, optimizer), **choice), b
    assert r.replayed == len(ASKED) and r.traced == len(TRACED)


def test_only_between_traced_micro_batches_of_the_same_combination():
    model, batch = tiny_bert(), _batch()
    r = Replayer(model, batch)
    for b in TRACED:
        r.estimate(_plan(b))
    for b in (1, 21, 40):  # micro-batch 1 is another program; beyond the traced ones: not proven
        assert r.estimate(_plan(b)) == estimate(model, batch, _plan(b))
    r.estimate(_plan(5), checkpoint_blocks=(0,))  # other blocks: no evidence yet
    r.estimate(_plan(5, effective=5))  # no accumulation: another program
    assert r.replayed == 0
    r.estimate(_plan(9))
    assert r.replayed == 1


def test_a_structure_that_changes_with_the_micro_batch_is_traced(monkeypatch):
    """Offload keeps saved tensors under its threshold on the device: with the threshold at an
    fp32 ``[12, 12, 32]``, micro-batches 6 to 11 offload some tensors and 12 to 20 more (other
    events). Between 6 and 10 the events are replayed; from 10 to 20 every estimate is traced."""
    import tightfit.levers.offload as offload

    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 12 * 12 * 32 * 4)
    model, batch = tiny_bert(), _batch()
    policies = {"block_policies": ("offload", "offload")}
    r = Replayer(model, batch)
    for b in (6, 8, 10, 20):
        r.estimate(_plan(b, "fp32"), **policies)
    for b in (7, 9, 11, 14):
        assert r.estimate(_plan(b, "fp32"), **policies) == estimate(model, batch, _plan(b, "fp32"), **policies), b
    assert (r.traced, r.replayed) == (6, 2)


def _points(f, bs=(2, 4, 8)):
    return [(b, (("m", "activations"),) * 2, [f(b), 1000]) for b in bs]


def test_interpolation_needs_three_points_on_one_integer_line():
    assert interpolated(_points(lambda b: 100 + 7 * b), 5) == [("m", 135, "activations"), ("m", 1000, "activations")]
    assert interpolated(_points(lambda b: 100 + 7 * b), 3) is not None
    assert interpolated(_points(lambda b: 100 + 7 * b, (2, 8)), 5) is None  # two points: no check
    assert interpolated(_points(lambda b: 100 + 7 * b), 9) is None  # beyond the traced ones
    assert interpolated(_points(lambda b: 100 + 7 * b), 4) is None  # traced already
    assert interpolated(_points(lambda b: b * b), 5) is None  # 4, 16, 64: off the line of 2 and 8
    assert interpolated(_points(lambda b: 3 * b // 2 + 1), 5) is None  # slope 3/2 bytes per sample
    other = _points(lambda b: 7 * b)
    other[2] = (8, (("m", "gradients"),) * 2, [56, 1000])  # another program at 8
    assert interpolated(other, 5) is None
