"""The memory estimator against GPU measurements, and its parts against known values.

Fixtures (NVIDIA H200, torch 2.11, made by bench/measure_memory.py): tests/fixtures/memory/
h200-expandable.json (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, what tightfit's
runtime sets) and h200.json (the default allocator), the same 120 rows. Each row is traced once
on the CPU with the CPU build of torch (no GPU needed); the trace is replayed through both
allocator models.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from tightfit.devices import get_profile
from tightfit.errors import TightfitError
from tightfit.memory.allocator import (CachingAllocatorModel, ExpandableSegmentsModel, make_allocator, page_size,
                                       round_size, segment_size)
from tightfit.levers.blocks import find_blocks, parse_checkpointing
from tightfit.memory.estimate import estimate
from tightfit.models import build_model
from tightfit.plan import Plan

MiB = 2**20
FIXTURES = {"expandable": Path(__file__).parent / "fixtures" / "memory" / "h200-expandable.json",
            "default": Path(__file__).parent / "fixtures" / "memory" / "h200.json"}


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


def test_expandable_segments_map_whole_pages_per_pool():
    assert page_size(1 * MiB) == 2 * MiB and page_size(1 * MiB + 512) == 20 * MiB
    a = ExpandableSegmentsModel()
    small = [a.malloc(1000) for _ in range(4)]  # small pool: one 2 MiB page
    assert a.reserved == 2 * MiB and a.allocated == 4 * 1024
    big = a.malloc(3 * MiB)  # large pool: one 20 MiB page, 17 MiB of it free at the segment's end
    assert a.reserved == 22 * MiB and big.addr == 0 and big.size == 3 * MiB
    mid = a.malloc(5 * MiB)  # fits in the free end: no new page
    assert a.reserved == 22 * MiB and mid.addr == 3 * MiB
    grown = a.malloc(30 * MiB)  # the 12 MiB free end + 20 MiB mapped after it (18 MiB lacking -> one page)
    assert grown.addr == 8 * MiB and a.reserved == 42 * MiB and a.allocated == 38 * MiB + 4096
    for b in small + [big, mid, grown]:
        a.free(b)
    assert a.allocated == 0 and a.reserved == 42 * MiB and a.peak_reserved == 42 * MiB  # nothing unmapped
    assert a.malloc(40 * MiB).addr == 0  # the merged free range is reused from its start


def test_expandable_segments_split_every_block_and_prefer_blocks_that_cannot_grow():
    a = ExpandableSegmentsModel()
    b = a.malloc(12 * MiB)
    a.free(b)
    assert a.malloc(11 * MiB + 512).size == 11 * MiB + 512  # split even with < 1 MiB left (default: not)
    a = ExpandableSegmentsModel()
    hole = a.malloc(12 * MiB)  # [0, 12)
    a.malloc(2 * MiB)  # [12, 14); free end [14, 20) can grow into unmapped pages
    a.free(hole)
    # best fit by size would be the 6 MiB end block, but it counts as unbounded: the 12 MiB hole is used
    assert a.malloc(5 * MiB).addr == 0
    # now the end block (6 MiB) and the rest of the hole (7 MiB) both fit 6 MiB: the hole again
    assert a.malloc(6 * MiB).addr == 5 * MiB
    assert a.malloc(6 * MiB).addr == 14 * MiB  # only the end block fits
    assert a.reserved == 20 * MiB


def test_unknown_allocator_raises():
    with pytest.raises(ValueError):
        make_allocator("cuda-malloc-async")
    model, make_batch = build_model("minilm")
    with pytest.raises(TightfitError):
        estimate(model, make_batch(1, 8), Plan("fp32", 1, 1), allocator="cuda-malloc-async")


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


def test_an_accumulating_step_is_traced_with_the_windows_gradients_held():
    """With accumulation, every micro-batch after a window's first runs forward and backward
    holding all the window's gradients: the estimate traces one (a single micro-batch frees
    nothing before its own gradients exist, and peaks with only part of them)."""
    model, make_batch = build_model("minilm")
    grads = sum(round_size(4 * p.numel()) for p in model.parameters())
    one = estimate(model, make_batch(1, 128), Plan("bf16", 8, 8), get_profile("h200"), checkpoint_blocks="all")
    window = estimate(model, make_batch(1, 128), Plan("bf16", 8, 32), get_profile("h200"), checkpoint_blocks="all")
    assert one.breakdown["gradients"] < grads
    assert window.breakdown["gradients"] >= grads
    assert window.peak_allocated_bytes > one.peak_allocated_bytes


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
    """Per allocator: ``[(row, allocated error, reserved error)]``, errors as estimate / measured - 1."""
    data = {k: json.loads(p.read_text()) for k, p in FIXTURES.items()}
    for d in data.values():
        assert d["header"]["gpu"] == "NVIDIA H200" and d["header"]["torch"]
    assert data["expandable"]["header"]["allocator"] == "expandable_segments:True"
    assert "allocator" not in data["default"]["header"]
    keys = ("arch", "attn", "size", "micro_batch", "precision", "checkpointing", "freeze")
    same = [tuple(r.get(k) for k in keys) for r in data["default"]["rows"]]
    assert same == [tuple(r.get(k) for k in keys) for r in data["expandable"]["rows"]]
    models, errors = {}, {k: [] for k in FIXTURES}
    for i, r in enumerate(data["default"]["rows"]):
        key = (r["arch"], r.get("attn", "sdpa"))
        if key not in models:
            models[key] = build_model(r["arch"], attn_implementation=key[1])
        model, make_batch = models[key]
        for name, p in model.named_parameters():
            p.requires_grad_(not (r.get("freeze") and r["freeze"] in name))
        e = estimate(model, make_batch(1, r["size"]), Plan(r["precision"], r["micro_batch"], r["micro_batch"]),
                     get_profile("h200"), checkpoint_blocks=r["checkpointing"])
        assert e.allocator == "expandable"
        for kind, d in data.items():
            m, est = d["rows"][i], e.extra["by_allocator"][kind]
            errors[kind].append((m, est["peak_allocated_bytes"] / m["peak_allocated_bytes"] - 1,
                                 est["peak_reserved_bytes"] / m["peak_reserved_bytes"] - 1))
    return errors


def _within(errs, tol=0.05):
    return sum(abs(e) <= tol for e in errs) / len(errs)


def test_every_fixture_row_is_estimated(fixture_errors):
    for rows in fixture_errors.values():
        assert len(rows) == 120 >= 6 * 3 * 2 * 3


@pytest.mark.parametrize("kind", ["expandable", "default"])
def test_peak_allocated_within_5_percent_on_every_row(fixture_errors, kind):
    # measured: median |error| 0.02% (expandable) / 0.06% (default), worst -4.0% / -3.9%
    errs = [t[1] for t in fixture_errors[kind]]
    worst = max(fixture_errors[kind], key=lambda t: abs(t[1]))
    assert abs(worst[1]) <= 0.05, worst
    assert statistics.median(abs(e) for e in errs) <= 0.01


def test_peak_reserved_expandable_segments(fixture_errors):
    """The issue's target, with expandable segments (what tightfit's runtime sets): peak reserved
    within 5% on >= 90% of rows and never more than 5% under (measured: 97.5% of rows, median
    0.10%, worst -4.9%; the over-predictions above 5% are GPT-2 with every block checkpointed)."""
    errs = [t[2] for t in fixture_errors["expandable"]]
    assert statistics.median(abs(e) for e in errs) <= 0.01
    assert _within(errs) >= 0.90
    worst = min(fixture_errors["expandable"], key=lambda t: t[2])
    assert worst[2] >= -0.05, worst
    assert max(errs) <= 0.13


def test_peak_reserved_default_allocator(fixture_errors):
    # PyTorch's default allocator (not what tightfit runs): measured median 0.38%, 85.0% within 5%,
    # -21.6% (ResNet-50, all blocks checkpointed: segment fragmentation) .. +5.1%
    errs = [t[2] for t in fixture_errors["default"]]
    assert statistics.median(abs(e) for e in errs) <= 0.01
    assert _within(errs) >= 0.85
    assert min(errs) >= -0.22
    assert max(errs) <= 0.06  # never over-predicts by more than 6%


def test_reduction_staging_buffers_match_the_h200():
    """A bias gradient's sum over the tokens takes a staging buffer and semaphores from the caching
    allocator; sizes measured on an NVIDIA H200 (132 SMs) in ViT-B/16's backward, micro-batch 32."""
    from tightfit.memory.tracker import reduction_staging_bytes
    s = torch.ops.aten.sum.dim_IntList

    def grad(*shape):
        return torch.empty(*shape, dtype=torch.float16, device="meta")

    assert reduction_staging_bytes(s, (grad(6304, 768), [0], True), 132, 2048) == [38_928_384, 24]
    assert reduction_staging_bytes(s, (grad(6304, 3072), [0], True), 132, 2048) == [138_412_032, 96]
    # the same tokens as [32, 197, 768], reduced over both leading dimensions
    assert reduction_staging_bytes(s, (grad(32, 197, 768), [0, 1], True), 132, 2048) == [38_928_384, 24]
    # fewer SMs, fewer blocks per output: a smaller buffer (GTX 1650 Ti: 16 SMs, 1024 threads each)
    small = reduction_staging_bytes(s, (grad(6304, 3072), [0], True), 16, 1024)
    assert 0 < small[0] < 138_412_032
    assert reduction_staging_bytes(s, (grad(6304, 768), [1], True), 132, 2048) == []  # over the last dim
    assert reduction_staging_bytes(s, (grad(8, 768), [0], True), 132, 2048) == []  # one block per output


# ---------------------------------------------------------------- the planner's memory-growth model
def test_memory_lines_against_full_estimates():
    """The planner's one memory-growth model (tightfit.memory.fast): peak reserved bytes on lines
    through exact estimates at micro-batches 4 and 16, with no and all blocks checkpointed, blended
    for k blocks in between. Exact at the traced points; measured on MiniLM (seq 128, fp32): -1.4%
    to +7.2% between 4 and 16, -10.3% to +10.7% outside (micro-batch 1 and 32) -- why the search
    traces every plan it returns exactly."""
    from tightfit.memory.fast import BlockLines, MemoryLine

    model, make_batch = build_model("minilm")
    batch = make_batch(1, 128)

    def fn(precision, mb, blocks):
        return estimate(model, batch, Plan(precision, mb, mb), checkpoint_blocks=tuple(blocks))

    lines = BlockLines.traced(fn, "fp32", 0, 6)
    assert lines(3) == lines(0).blend(lines(6), 0.5)
    for mb in (1, 4, 10, 16, 32):
        for k in (0, 3, 6):
            full = fn("fp32", mb, tuple(range(k))).peak_reserved_bytes
            error = lines(k).reserved(mb) / full - 1
            if mb in (4, 16) and k in (0, 6):
                assert abs(lines(k).reserved(mb) - full) <= 1
            elif 4 <= mb <= 16:
                assert -0.02 <= error <= 0.10, (mb, k, error)
            else:
                assert abs(error) <= 0.12, (mb, k, error)
    # more checkpointed blocks never predict more memory
    assert lines(0).reserved(16) >= lines(3).reserved(16) >= lines(6).reserved(16)
    line = MemoryLine(100.0, 10.0)
    assert (line.largest_fitting(200, 50), line.largest_fitting(200, 7), line.largest_fitting(50, 50)) == (10, 7, 0)
    assert MemoryLine(100.0, 0.0).largest_fitting(200, 7) == 7


def test_convolution_workspace_is_the_larger_activation():
    from tightfit.memory.tracker import kernel_workspace_bytes

    x = torch.empty(2, 3, 8, 8, device="meta")
    w = torch.empty(4, 3, 3, 3, device="meta")
    out = torch.ops.aten.convolution.default(x, w, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
    assert tuple(out.shape) == (2, 4, 3, 3)
    # forward: input 2*3*8*8 fp32 = 1536 B > output 2*4*3*3*4 = 288 B
    assert kernel_workspace_bytes(torch.ops.aten.convolution.default, (x, w), out) == 1536
    g = torch.empty(2, 4, 30, 30, device="meta", dtype=torch.float16)  # incoming gradient, 14400 B
    assert kernel_workspace_bytes(torch.ops.aten.convolution_backward.default, (g, x.half(), w), None) == 14400
    assert kernel_workspace_bytes(torch.ops.aten.mm.default, (x, w), out) == 0


def test_foreach_adamw_adds_one_fp32_copy_of_the_parameters_at_its_step():
    model, make_batch = build_model("minilm")
    est = {opt: estimate(model, make_batch(1, 32), Plan("fp32", 4, 4, optimizer=opt), get_profile("h200"))
           for opt in ("adamw", "adamw-foreach")}
    # torch._foreach_sqrt(exp_avg_sqs): one fp32 tensor per parameter, each rounded to 512-byte blocks
    temporaries = sum(-(-p.numel() * 4 // 512) * 512 for p in model.parameters())
    a, b = (est[k].extra["optimizer_step_peak_bytes"] for k in ("adamw", "adamw-foreach"))
    assert b - a == temporaries
    assert est["adamw-foreach"].breakdown["optimizer_state"] == est["adamw"].breakdown["optimizer_state"]
    with pytest.raises(TightfitError):
        estimate(model, make_batch(1, 32), Plan("fp32", 4, 4, optimizer="lion"), get_profile("h200"))


def test_the_estimate_sets_train_mode_without_calling_the_models_own_train(monkeypatch):
    """transformers' train() kernelizes the model when the `kernels` package is installed, and that
    refuses the meta device: every CPU run of a loaded Hugging Face model failed to estimate its
    host memory ("Unsupported device type 'meta'"). The estimate sets the modules' flags itself."""
    model, make_batch = build_model("minilm")
    model.eval()

    def refuses_meta(self, mode=True):
        if any(p.device.type == "meta" for p in self.parameters()):
            raise ValueError("Unsupported device type 'meta'")
        return torch.nn.Module.train(self, mode)

    monkeypatch.setattr(type(model), "train", refuses_meta)
    e = estimate(model, make_batch(1, 16), Plan("fp32", 4, 4), get_profile("h200"))
    assert e.peak_reserved_bytes > 0 and not model.training  # the model itself is left as it was


def test_the_estimates_header_names_the_card_whose_rules_it_used(capsys):
    """Without --gpu it printed no card, and the step's temporaries differ by card (cuBLAS
    workspaces: a T4's 43.5 MiB against the default's 91 MiB for the same MiniLM step)."""
    from tightfit.cli import main

    assert main(["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "2"]) == 0
    assert "for a Hopper GPU such as the H200 (the default; --gpu NAME for another card)" in capsys.readouterr().out
    assert main(["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "2", "--gpu", "t4"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith("for NVIDIA Tesla T4")


def test_a_ctrl_c_landing_in_the_trackers_storage_callback_is_not_lost(monkeypatch):
    """Found by a fresh user: a Ctrl-C that arrived while a traced storage died was raised in the
    tracker's weakref callback, which Python prints and drops: `tightfit plan` went on and exited 0."""
    import signal
    import time

    from tightfit.memory.tracker import AllocationTracker

    tracker = AllocationTracker()
    free = tracker.free

    def interrupted(*a):  # the signal arrives while the callback runs
        signal.raise_signal(signal.SIGINT)
        return free(*a)
    with pytest.raises(KeyboardInterrupt):
        with tracker:
            t = torch.empty(1024, device="meta")
            monkeypatch.setattr(tracker, "free", interrupted)
            del t
            assert not tracker._storages  # the callback did its accounting
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # raised again just after it
                time.sleep(0.001)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
