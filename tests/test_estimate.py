"""The memory estimator against GPU measurements (tests/fixtures/memory/h200.json: NVIDIA H200,
torch 2.11, made by bench/measure_memory.py), and its parts against known values.

The fixture rows are estimated on the CPU with the CPU build of torch; no GPU is needed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tightfit.devices import get_profile
from tightfit.errors import TightfitError
from tightfit.memory.allocator import CachingAllocatorModel, round_size, segment_size
from tightfit.memory.blocks import find_blocks, parse_checkpointing
from tightfit.memory.estimate import estimate
from tightfit.memory.zoo import build_model
from tightfit.plan import Plan

MiB = 2**20
FIXTURE = Path(__file__).parent / "fixtures" / "memory" / "h200.json"


# ---------------------------------------------------------------- allocator model
def test_rounding_and_segments():
    assert round_size(1) == 512 and round_size(512) == 512 and round_size(513) == 1024
    assert segment_size(512) == 2 * MiB and segment_size(1 * MiB) == 2 * MiB
    assert segment_size(1 * MiB + 512) == 20 * MiB and segment_size(10 * MiB - 512) == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB and segment_size(11 * MiB + 1) == 12 * MiB


def test_small_blocks_share_a_segment_and_large_blocks_split():
    a = CachingAllocatorModel()
    blocks = [a.malloc(1000) for _ in range(4)]  # 4 x 1024 B in one 2 MiB segment
    assert a.reserved == 2 * MiB and a.allocated == 4 * 1024
    big = a.malloc(3 * MiB)  # opens a 20 MiB segment, split: 17 MiB stay free in it
    assert a.reserved == 22 * MiB and big.size == 3 * MiB
    again = a.malloc(5 * MiB)  # served from the 17 MiB rest: no new segment
    assert a.reserved == 22 * MiB
    a.free(big), a.free(again)
    whole = a.malloc(20 * MiB)  # the freed pieces merged back into one 20 MiB block
    assert a.reserved == 22 * MiB and whole.size == 20 * MiB
    for b in blocks:
        a.free(b)
    assert a.allocated == 20 * MiB and a.peak_allocated == 20 * MiB + 4096


def test_large_remainder_of_one_mib_or_less_is_not_split():
    a = CachingAllocatorModel()
    b = a.malloc(12 * MiB)
    a.free(b)
    c = a.malloc(11 * MiB + 512)  # rest < 1 MiB: the whole 12 MiB block is taken
    assert c.size == 12 * MiB and a.allocated == 12 * MiB


# ---------------------------------------------------------------- model states
def _estimate(name, size, mb, precision="fp32", ckpt="none", optimizer="adamw"):
    model, make_batch = build_model(name)
    return model, estimate(model, make_batch(1, size), Plan(precision, mb, mb, optimizer=optimizer),
                           get_profile("h200"), checkpoint_blocks=ckpt)


def test_breakdown_sums_to_reserved_and_states_are_exact():
    model, e = _estimate("minilm", 128, 8)
    assert sum(e.breakdown.values()) == e.peak_reserved_bytes
    params = list(model.parameters())
    # fp32 weights; AdamW: two fp32 moments per parameter plus a 0-d step, each a 512-B-rounded block
    # (a large block whose unused rest is <= 1 MiB is not split and counts whole: + at most 1 MiB each)
    exact = sum(2 * round_size(4 * p.numel()) + 512 for p in params)
    assert exact <= e.breakdown["optimizer_state"] <= exact + 4 * MiB
    n = sum(p.numel() for p in params)
    assert 4 * n <= e.breakdown["parameters"] < 1.01 * 4 * n
    d = e.to_dict()
    assert set(d) >= {"peak_allocated_bytes", "peak_reserved_bytes", "breakdown", "plan"}
    json.dumps(d)


def test_frozen_parameters_get_no_gradient_or_state():
    model, make_batch = build_model("minilm")
    emb = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n)
    full = estimate(model, make_batch(1, 64), Plan("fp32", 4, 4))
    for n, p in model.named_parameters():
        p.requires_grad_("embeddings" not in n)
    frozen = estimate(model, make_batch(1, 64), Plan("fp32", 4, 4))
    saved = full.peak_allocated_bytes - frozen.peak_allocated_bytes
    assert saved >= 8 * emb  # at least the two AdamW moments of the embeddings


def test_checkpointing_and_low_precision_save_activation_memory():
    _, none = _estimate("bert-base", 256, 8)
    _, some = _estimate("bert-base", 256, 8, ckpt="0,1,2,3,4,5")
    _, full = _estimate("bert-base", 256, 8, ckpt="all")
    _, half = _estimate("bert-base", 256, 8, precision="bf16")
    assert none.peak_allocated_bytes > some.peak_allocated_bytes > full.peak_allocated_bytes
    assert half.peak_allocated_bytes < none.peak_allocated_bytes
    assert some.plan["checkpoint_blocks"] == [0, 1, 2, 3, 4, 5]


def test_blocks_of_the_zoo():
    for name, n in (("bert-base", 12), ("gpt2", 12), ("vit-b16", 12), ("resnet50", 16)):
        assert len(find_blocks(build_model(name)[0])) == n
    assert parse_checkpointing("all", 3) == (0, 1, 2) and parse_checkpointing("2,0", 3) == (0, 2)
    for bad in ("3", "x", "-1"):
        with pytest.raises(TightfitError):
            parse_checkpointing(bad, 3)


def test_bad_input_raises_tightfit_error():
    model, make_batch = build_model("minilm")
    with pytest.raises(TightfitError):
        estimate(model, {"input_ids": [1, 2]}, Plan("fp32", 1, 1))
    with pytest.raises(TightfitError):
        estimate(model, make_batch(1, 8), Plan("fp32", 1, 1, optimizer="lion"))
    with pytest.raises(TightfitError):
        build_model("no-such-model")


# ---------------------------------------------------------------- against the GPU fixtures
@pytest.fixture(scope="module")
def fixture_errors():
    data = json.loads(FIXTURE.read_text())
    assert data["header"]["gpu"] == "NVIDIA H200" and data["header"]["torch"]
    models, rows = {}, []
    for r in data["rows"]:
        key = (r["arch"], r.get("attn", "sdpa"))
        if key not in models:
            models[key] = build_model(r["arch"], attn_implementation=key[1])
        model, make_batch = models[key]
        for name, p in model.named_parameters():
            p.requires_grad_(not (r.get("freeze") and r["freeze"] in name))
        e = estimate(model, make_batch(1, r["size"]), Plan(r["precision"], r["micro_batch"], r["micro_batch"]),
                     get_profile("h200"), checkpoint_blocks=r["checkpointing"])
        rows.append((r, e.peak_allocated_bytes / r["peak_allocated_bytes"] - 1,
                     e.peak_reserved_bytes / r["peak_reserved_bytes"] - 1))
    return rows


def test_every_fixture_row_is_estimated(fixture_errors):
    assert len(fixture_errors) >= 6 * 3 * 2 * 3


def test_peak_allocated_within_8_percent_on_every_row(fixture_errors):
    worst = max(fixture_errors, key=lambda t: abs(t[1]))
    assert abs(worst[1]) <= 0.08, worst


def test_peak_reserved_median_error_and_over_prediction(fixture_errors):
    errs = [t[2] for t in fixture_errors]
    assert statistics.median(abs(e) for e in errs) <= 0.04
    assert max(errs) <= 0.06  # never over-predicts by more than 6%


@pytest.mark.xfail(reason="known gap (docs/memory-estimator.md): the real allocator fragments more than the "
                          "model on ~30% of rows; reserved is under-predicted by up to 16%", strict=False)
def test_peak_reserved_target(fixture_errors):
    errs = [t[2] for t in fixture_errors]
    assert sum(abs(e) <= 0.05 for e in errs) >= 0.9 * len(errs)
    assert min(errs) >= -0.05
