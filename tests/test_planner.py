"""The planner's card-aware choices and search, with a memory model of known shape."""

import json
from dataclasses import dataclass

import pytest
import torch

from conftest import tiny_bert
from tightfit.cli import main
from tightfit.devices import get_profile
from tightfit.planner.search import candidate_precisions, search

MiB = 2**20


@pytest.mark.parametrize("card,expected", [
    ("gtx-1080-ti", ["fp32", "fp16"]), ("gtx-1650-ti", ["fp32", "fp16"]), ("t4", ["fp16", "fp32"]),
    ("rtx-2060", ["fp16", "fp32"]), ("rtx-3060", ["bf16"]), ("h100", ["bf16"]),
])
def test_candidate_precisions_never_bf16_below_ampere(card, expected):
    assert candidate_precisions(get_profile(card)) == expected


def test_candidates_are_the_fewest_blocks_per_number_of_micro_batches():
    # 300 MiB for activations; 2 blocks saving 5% each: 0 blocks fit 30 samples per micro-batch,
    # 1 block 31, 2 blocks 33
    fn = memory(100 * MiB, 10 * MiB, saving_per_block=0.05, fp16_factor=1.0)
    r = _search("gtx-1080-ti", int(400 * MiB / 0.95), fn, E=64, precision="fp32")
    cands = [r.best] + [c for c in r.runners_up if c.samples_per_s > 0]
    got = sorted((c.accumulation_steps, len(c.checkpoint_blocks), c.micro_batch) for c in cands)
    # 64 samples: 3 x 22 with no block; 2 x 32 needs 2 blocks (1 block fits only 31)
    assert got == [(2, 2, 32), (3, 0, 22)]


@dataclass
class Est:
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    breakdown: dict


def memory(fixed, per_sample, saving_per_block=0.0, fp16_factor=0.5):
    """Peak = fixed + micro_batch x per-sample bytes, shrunk by fp16 and by checkpointed blocks."""
    def fn(precision, micro_batch, blocks):
        s = per_sample * (fp16_factor if precision != "fp32" else 1.0) * (1 - saving_per_block * len(blocks))
        peak = int(fixed + micro_batch * s)
        return Est(peak, peak, {"activations": int(micro_batch * s)})
    return fn


def one_block_needs_more(line, extra, above):
    """``line``'s estimates, but with exactly one block checkpointed a micro-batch larger than
    ``above`` needs ``extra`` bytes more (what the memory lines cannot see)."""
    def fn(precision, micro_batch, blocks):
        est = line(precision, micro_batch, blocks)
        more = extra if len(blocks) == 1 and micro_batch > above else 0
        return Est(est.peak_reserved_bytes + more, est.peak_allocated_bytes + more, est.breakdown)
    return fn


def _make_batch(micro_batch, size):
    return {"input_ids": torch.zeros(micro_batch, size, dtype=torch.long),
            "attention_mask": torch.ones(micro_batch, size, dtype=torch.long),
            "labels": torch.zeros(micro_batch, dtype=torch.long)}


def _search(card, budget, fn, E=32, **kw):
    kw.setdefault("per_block", False)  # these memory models know whole blocks only
    return search(tiny_bert(), _make_batch, 16, E, get_profile(card), budget, fn, **kw)


def test_pascal_keeps_fp32_when_it_fits():
    r = _search("gtx-1080-ti", 1000 * MiB, memory(100 * MiB, 10 * MiB))
    assert r.best.precision == "fp32" and r.best.micro_batch == 32 and r.best.checkpoint_blocks == ()
    # fp16 runs at 1/64 of fp32 there: not even traced once fp32 fits
    assert [c.why for c in r.runners_up if c.precision == "fp16"] == [
        "not searched: 0.0156x the fp32 rate on this card, and fp32 fits"]


def test_pascal_uses_fp16_only_when_memory_needs_it():
    # fp32 needs 100 + 40 MiB at micro-batch 1 > 130 MiB budget x 0.95; fp16 halves activations
    r = _search("gtx-1080-ti", 130 * MiB, memory(100 * MiB, 40 * MiB))
    assert r.best.precision == "fp16"
    assert any(c.precision == "fp32" and "does not fit" in c.why for c in r.runners_up)


def test_gtx_1650_ti_fp16_only_where_it_pays():
    # Both fit the whole batch: fp16 brings nothing (no tensor cores) -> fp32.
    assert _search("gtx-1650-ti", 2000 * MiB, memory(100 * MiB, 10 * MiB)).best.precision == "fp32"
    # fp32 needs 4 micro-batches, fp16 fits 2 with the same per-sample rate: fewer launches pay.
    r = _search("gtx-1650-ti", 300 * MiB, memory(100 * MiB, 20 * MiB), E=32)
    assert r.best.precision == "fp16" and r.best.accumulation_steps < 4
    # and says why it is not the card's fp32 (a fresh user read "not on a GTX 1650 Ti" in the README)
    why = r.best.why.split("; precision ", 1)[1]
    assert why.startswith("fp16: predicted faster here than fp32, this card's first choice, whose activations take "
                          "twice the memory") and "(its fastest plan: " in why, why


def test_checkpoints_only_as_many_blocks_as_needed():
    # Without checkpointing nothing fits; checkpointing half the 2 blocks (1 block) suffices.
    fn = memory(100 * MiB, 100 * MiB, saving_per_block=0.4)
    r = _search("h100", 180 * MiB, fn, E=1, precision="fp32")
    assert r.best.checkpoint_blocks == (0,)
    assert r.best.peak_reserved_bytes <= 180 * MiB * 0.95
    no_ckpt = [c for c in r.runners_up if c.checkpoint_blocks == ()]
    assert no_ckpt and "does not fit" in no_ckpt[0].why


def test_plan_command_json_bert_base(capsys):
    assert main(["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "64",
                 "--gpu", "gtx-1080-ti", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("plan", "budget_bytes", "predicted_peak_bytes", "breakdown", "predicted_samples_per_s", "runners_up"):
        assert key in out
    assert out["plan"]["precision"] == "fp32"  # fits in fp32 on 11 GB: Pascal stays fp32
    assert out["predicted_peak_bytes"] <= out["budget_bytes"]
    assert out["plan"]["micro_batch"] * out["plan"]["accumulation_steps"] >= 64


def test_plan_command_bad_input(capsys):
    assert main(["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "64"]) == 2
    assert "--gpu PROFILE or --budget" in capsys.readouterr().err
    assert main(["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "64", "--budget", "1GiB",
                 "--optimizer", "adamw"]) == 2
    assert "below the" in capsys.readouterr().err


def test_verification_shrinks_the_micro_batch_until_the_exact_trace_fits():
    # Memory grows faster than linearly: the two-point curve (4, 16) under-predicts at 32, so
    # the exact trace of the winner must take smaller micro-batches until it fits.
    def fn(precision, micro_batch, blocks):
        peak = int(100 * MiB + micro_batch * MiB + micro_batch ** 2 * 0.05 * MiB)
        return Est(peak, peak, {})
    limit = 150 * MiB * 0.95
    r = _search("gtx-1080-ti", 150 * MiB, fn, E=32, precision="fp32", checkpointing="off")
    assert fn("fp32", r.best.micro_batch, ()).peak_reserved_bytes <= limit
    # one accumulation step fewer (the next balanced micro-batch up) would not fit
    fewer = -(-32 // (r.best.accumulation_steps - 1))
    assert fn("fp32", fewer, ()).peak_reserved_bytes > limit


def test_nothing_fits_ends_with_an_error_not_a_loop():
    from tightfit.errors import TightfitError

    def fn(precision, micro_batch, blocks):  # exact only at the curve's points 4 and 16
        peak = int(100 * MiB + micro_batch * MiB) + (0 if micro_batch in (4, 16) else 50 * MiB)
        return Est(peak, peak, {})
    # the curve says micro-batch 3 fits 109 MiB x 0.95; no exact trace below 4 does
    with pytest.raises(TightfitError, match="nothing fits"):
        _search("gtx-1080-ti", 109 * MiB, fn, E=32, precision="fp32", checkpointing="off")


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", "bert-base", "--seq-len", "abc", "--micro-batch", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tightfit: error:") and len(err.splitlines()) == 1


def test_a_candidate_that_shrinks_when_traced_exactly_does_not_hide_a_faster_one():
    # The lines (traced at micro-batch 4 and 16) say 1 block fits 2 x 32; the exact trace needs
    # 50 MiB more above 16 samples, so it shrinks to 3 x 22 -- slower than no checkpointing at 3 x 22.
    exact = one_block_needs_more(memory(100 * MiB, 10 * MiB, saving_per_block=0.1, fp16_factor=1.0),
                                 50 * MiB, above=16)

    r = _search("gtx-1080-ti", int(400 * MiB / 0.95), exact, E=64, precision="fp32")
    assert (r.best.checkpoint_blocks, r.best.micro_batch, r.best.accumulation_steps) == ((), 22, 3)
    shrunk = [c for c in r.runners_up if c.checkpoint_blocks == (0,)]
    assert shrunk[0].micro_batch == 22 and shrunk[0].why.startswith("slower")


def test_more_blocks_at_the_same_number_of_micro_batches_beat_shrinking():
    # The lines say 1 block fits 1 x 64; the exact trace of 1 block needs 60 MiB more, 2 blocks
    # fit exactly. Checkpointing both blocks at 1 x 64 must be found (not only 1 block shrunk to 2 x 32).
    exact = one_block_needs_more(memory(100 * MiB, 10 * MiB, saving_per_block=0.2, fp16_factor=1.0),
                                 60 * MiB, above=32)

    limit = 100 * MiB + 64 * 10 * MiB * 0.8 + 8 * MiB  # the line: 1 block fits 64 with 8 MiB to spare
    r = _search("gtx-1080-ti", int(limit / 0.95), exact, E=64, precision="fp32")
    on = _search("gtx-1080-ti", int(limit / 0.95), exact, E=64, precision="fp32", checkpointing="on")
    assert (r.best.micro_batch, len(r.best.checkpoint_blocks)) == (64, 2)
    assert r.best.samples_per_s >= on.best.samples_per_s


def test_fewer_blocks_are_traced_where_the_line_over_states_the_winner():
    # Peaks grow slower than the lines (traced at micro-batch 4 and 16) above 16 samples: 96 MiB
    # less at 64. The lines say 1 x 64 needs both blocks; traced, one block fits too and wins
    # (one block's recomputation less). Red when the exact trace that fits ends the search
    # (ResNet-50 at 4 GiB was planned with 11 of 16 blocks where 7 fit).
    line = memory(100 * MiB, 10 * MiB, saving_per_block=0.2, fp16_factor=1.0)

    def exact(precision, micro_batch, blocks):
        est = line(precision, micro_batch, blocks)
        less = 2 * MiB * max(0, micro_batch - 16)
        return Est(est.peak_reserved_bytes - less, est.peak_allocated_bytes - less, est.breakdown)

    r = _search("gtx-1080-ti", int(600 * MiB / 0.95), exact, E=64, precision="fp32")
    assert (r.best.micro_batch, r.best.checkpoint_blocks) == (64, (0,))
    assert r.best.peak_reserved_bytes == exact("fp32", 64, (0,)).peak_reserved_bytes <= 600 * MiB
    # the count traced first stays a runner-up: the verification falls back to it if one block misses for real
    assert any((c.micro_batch, c.checkpoint_blocks) == (64, (0, 1)) and "not traced" not in c.why for c in r.runners_up)
    # the runners-up that only the lines say fit are not called plain "fits" in --json
    line_only = [c for c in r.runners_up if "not traced exactly" in c.why]
    assert line_only and all(c.to_dict()["status"] == "fits by the memory line, not traced" for c in line_only)
    assert all(c.to_dict()["status"] in ("fits", "does not fit") for c in r.runners_up if c not in line_only)


@pytest.mark.parametrize("args", [["--model", "vit-b16", "--image-size", "224", "--budget", "10GiB", "--batch-size", "128"],
                                  ["--model", "bert-base", "--seq-len", "128", "--budget", "4GiB", "--batch-size", "256"]])
def test_searching_blocks_is_never_slower_than_all_or_none(capsys, args):
    """``--checkpointing auto`` searches a superset of ``on`` and ``off``: its predicted speed is at
    least theirs (a fresh-user trial once found ViT-B/16 at 128 samples 1.5x slower than ``on``)."""
    speeds = {}
    for ck in ("auto", "on", "off"):
        code = main(["plan", *args, "--checkpointing", ck, "--json"])
        out = capsys.readouterr().out
        speeds[ck] = json.loads(out)["predicted_samples_per_s"] if code == 0 else 0.0
    assert speeds["auto"] >= max(speeds["on"], speeds["off"]) * 0.999, speeds


def _blocks_compiled_offline(monkeypatch, gpu, w, fake_probe):
    """The compiled stage without a GPU: ``fake_probe(w, mb, ...)`` answers the probes, blocks are
    compiled one by one (nothing compiles), and checkpointing sets ``w.blocks``."""
    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    monkeypatch.setattr(gpu, "compile_model", lambda m, scope=None: None)
    monkeypatch.setattr(gpu, "uncompile_model", lambda m: None)
    monkeypatch.setattr(gpu, "compile_scope", lambda m: "blocks")
    monkeypatch.setattr(gpu, "set_activation_checkpointing",
                        lambda m, on, blocks, policies=None: setattr(w, "blocks", tuple(blocks)))


def test_compiled_stage_finds_the_fewest_micro_batches_then_the_fewest_blocks(monkeypatch):
    """The compiled stage's search (no GPU: probes answered by a memory model that is linear in the
    micro-batch and falls with each checkpointed block): the smallest micro-batch count that fits
    with every block checkpointed, then the fewest blocks at that count and at the next one."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    n, E, limit = 12, 256, 1000.0
    probed = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        blocks = workload.blocks
        probed.append((mb, len(blocks)))
        peak = 200 + mb * (1.0 + 0.5 * (n - len(blocks)))  # bytes: fixed + per sample per unsaved block
        return ProbeResult(mb, peak <= limit, int(peak), int(peak), 0.001 * mb + 0.01, 1)

    w = SimpleNamespace(effective_batch=E, model=torch.nn.Linear(1, 1), blocks=())
    _blocks_compiled_offline(monkeypatch, gpu, w, fake_probe)
    eager = Candidate("bf16", 8, tuple(range(n)), E // 8, None, None)  # 32 micro-batches of 8
    result = gpu.compiled_variant(w, eager, 10**9, n).variant
    # all blocks: 200 + mb <= 1000 fits at k = 1 (micro-batch 256); the fewest blocks there:
    # 256 * (7 - c / 2) <= 800 -> c >= 7.75 -> 8. It needed blocks, so k = 2 (128) is tried too:
    # 128 * (7 - c / 2) <= 800 -> c >= 1.5 -> 2. Time per sample is lower at 256: it wins.
    assert (256, 8) in probed and (256, 7) in probed and (128, 2) in probed and (128, 1) in probed
    assert result.micro_batch == 256 and result.checkpoint_blocks == tuple(range(8))
    # the walk ended at 128 with blocks still recomputed: the step that recomputes none is probed
    # at the largest micro-batch it fits (200 + 7 mb <= 1000: 114), counts doubled then bisected:
    # 64 (k = 4) fits, 86 (k = 3) fits; slower per sample than 256 with 8 blocks here
    assert [p for p in probed if p[0] not in (256, 128)] == [(64, 0), (86, 0)], probed
    # the stage's line gives each probe's speed beside its peak: why the one kept won is readable
    line = gpu.compiled_variant(w, eager, 10**9, n).notes
    assert any("256 x 1, 8 blocks: " in x and "samples/s" in x.split("256 x 1, 8 blocks: ")[1].split(";")[0]
               for x in line), line

    # a tight budget: only the eager plan's 32 micro-batches of 8 fit, with every block checkpointed
    probed.clear()
    limit = 200 + 8 * 1.0
    result = gpu.compiled_variant(w, eager, 10**9, n).variant
    assert result.micro_batch == 8 and len(result.checkpoint_blocks) == n
    assert len({mb for mb, c in probed if c}) <= 7  # bisection over the 29 distinct counts, not a scan
    assert [p for p in probed if not p[1]] == [(4, 0), (2, 0)], probed  # no step without recomputation fits

    # the eager plan's micro-batch: its block count first (fits), then one fewer (does not): two probes
    probed.clear()
    limit = 200 + E * (1.0 + 0.5 * 1)  # fits with 11 of 12 blocks at micro-batch 256, not with 10
    result = gpu.compiled_variant(w, Candidate("bf16", E, tuple(range(11)), 1, None, None), 10**9, n).variant
    assert probed[:2] == [(E, 11), (E, 10)] and result.checkpoint_blocks == tuple(range(11))
    # it needed blocks, so one micro-batch more is tried too (past the eager plan's one), its blocks
    # stepped down from the 11 found at 256: 128 * (7 - c / 2) <= 384 -> c >= 8; slower per sample, so the walk ends
    assert [c for mb, c in probed[2:8]] == [11, 10, 8, 4, 6, 7] and {mb for mb, _ in probed[2:8]} == {128}
    # then the step without recomputation (200 + 7 mb <= 584: 54): 64 no, 32 yes, then 43, 52
    assert probed[8:] == [(64, 0), (32, 0), (43, 0), (52, 0)], probed
    probed.clear()  # compiled keeps less: fewer blocks than the eager 11 fit, stepped down to below 11
    limit = 200 + E * (1.0 + 0.5 * 5)  # (4 fewer: one probe more than a bisection; BERT-large's 1 fewer: 3 less)
    result = gpu.compiled_variant(w, Candidate("bf16", E, tuple(range(11)), 1, None, None), 10**9, n).variant
    at_e = [p for p in probed if p[0] == E]  # (then 128 x 2, slower per sample here)
    assert result.checkpoint_blocks == tuple(range(7)) and len(at_e) <= 7 and (E, n) not in probed

    # the fewest blocks one short of the most (BERT-large at 4 GiB: 23 of 24): stepped down to from
    # the most, 12 -> 11 -> 9 -> 10, not bisected from the middle (12 -> 6 -> 9 -> 11 -> 10)
    probed.clear()
    limit = 200 + 256 * 1.5  # micro-batch 256 fits with 11 of 12 blocks, not with 10
    result = gpu.compiled_variant(w, eager, 10**9, n).variant
    assert [c for mb, c in probed if mb == 256] == [12, 11, 9, 10], probed
    assert result.micro_batch == 256 and result.checkpoint_blocks == tuple(range(11))

    # an eager plan with nothing checkpointed and one micro-batch: its compiled variant is probed once
    probed.clear()
    limit = 200 + E * 7.0
    result = gpu.compiled_variant(w, Candidate("bf16", E, (), 1, None, None), 10**9, n).variant
    assert probed == [(E, 0)] and result.micro_batch == E and result.checkpoint_blocks == ()


def test_compiled_stage_walks_past_the_eager_micro_batch_while_fewer_blocks_pay(monkeypatch):
    """An eager plan of one micro-batch with most blocks recomputed (BERT-base seq 128 at 4 GiB:
    256 x 1, 10 of 12 blocks compiled): the compiled stage tries one micro-batch more per step
    while each is faster than the one before (the recomputation saved outweighs the smaller
    micro-batch), each count's blocks searched down from the previous count's, and keeps the
    fastest. No GPU: probes answered by a memory model linear in the micro-batch and a time
    model where each recomputed block adds a third of its forward and backward."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    n, E = 12, 256
    limit = 200 + E * (1.0 + 0.5 * 2)  # 256 fits with 10 of 12 blocks checkpointed, not with 9
    probed = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        c = len(workload.blocks)
        probed.append((mb, c))
        peak = 200 + mb * (1.0 + 0.5 * (n - c))
        per_micro_batch = 0.002 + 0.001 * mb * (1 + c / (3 * n))  # fixed launch cost + recomputation
        micro_batches = 2 if mb < E else 1
        return ProbeResult(mb, peak <= limit, int(peak), int(peak), per_micro_batch * micro_batches, micro_batches)

    w = SimpleNamespace(effective_batch=E, model=torch.nn.Linear(1, 1), blocks=())
    _blocks_compiled_offline(monkeypatch, gpu, w, fake_probe)
    found = gpu.compiled_variant(w, Candidate("bf16", E, tuple(range(10)), 1, None, None), 10**9, n)
    # fewest blocks: 256 -> 10, 128 -> 6 (128 * (7 - c / 2) <= 512), 86 -> 3, 64 -> 0 (64 * 7 <= 512)
    fewest = {mb: min(c for m, c in probed if m == mb and 200 + m * (1.0 + 0.5 * (n - c)) <= limit)
              for mb in {m for m, _ in probed}}
    assert fewest == {256: 10, 128: 6, 86: 3, 64: 0}, probed
    v = found.variant
    assert (v.micro_batch, v.checkpoint_blocks) == (64, ()), v  # nothing left to recompute: the walk ends
    assert not any(mb < 64 for mb, _ in probed)
    assert all(c <= 10 for mb, c in probed if mb < E)  # each count searched from the previous count's fewest
    speeds = [E / (k * (0.002 + 0.001 * mb * (1 + c / 36))) for k, mb, c in ((1, 256, 10), (2, 128, 6), (3, 86, 3))]
    assert speeds == sorted(speeds) and v.samples_per_s > speeds[-1]  # each count faster than the one before


def test_a_walk_that_ends_on_a_slower_count_still_probes_the_step_that_recomputes_nothing(monkeypatch):
    """BERT-base seq 128 at 4 GiB (NVIDIA H100, bench/results/recompute-3): 128 x 2 with 7 blocks
    timed slower than 256 x 1 with 10 and the walk ended there, though the step with no block
    checkpointed (two compiled calls per block, not three; no recomputation) fits at a smaller
    micro-batch. That step is probed at the largest micro-batch it fits and kept when fastest.
    No GPU: a step takes the longer of the host's launches (a checkpointed block's wrapper costs
    the host more than a compiled call) and the GPU's work (a recomputed block adds a third)."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.plan import accumulation_steps
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    n, E = 12, 256
    limit = 200 + E * (1.0 + 0.5 * 2)  # 256 fits with 10 blocks, 128 with 6, 64 with none, 86 not
    probed = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        c = len(workload.blocks)
        probed.append((mb, c))
        peak = 200 + mb * (1.0 + 0.5 * (n - c))
        host, gpu_s = 0.0003 * 2 * n + 0.005 * c, 0.0002 * mb * (1 + c / (3 * n))
        m = min(accumulation_steps(E, mb), 4)
        return ProbeResult(mb, peak <= limit, int(peak), int(peak), max(host, gpu_s) * m, m)

    w = SimpleNamespace(effective_batch=E, model=torch.nn.Linear(1, 1), blocks=())
    _blocks_compiled_offline(monkeypatch, gpu, w, fake_probe)
    v = gpu.compiled_variant(w, Candidate("bf16", E, tuple(range(10)), 1, None, None), 10**9, n).variant
    assert (128, 6) in probed and not any(mb == 86 and c for mb, c in probed)  # the walk ended at 128
    assert [p for p in probed if not p[1]][-2:] == [(64, 0), (86, 0)], probed  # 64 fits, 86 does not
    assert (v.micro_batch, v.checkpoint_blocks) == (64, ()), v


def test_the_largest_micro_batch_without_recomputation_is_found_below_one_that_needs_blocks():
    """Counts doubled from the largest count of the micro-batch that needs blocks, then bisected:
    no count of a micro-batch known not to fit is probed (E = 256 after 16: 17 micro-batches of 16
    are a known miss, not probed again; a review found 16 probed), nor micro-batch 1; and a count
    whose micro-batch rounds below that micro-batch (E = 4: 3 and 2 both take 2) is probed."""
    from tightfit.planner.gpu import _largest_unrecomputed

    def fits_below(limit, log):
        return lambda mb: log.append(mb) or mb <= limit

    log = []
    assert _largest_unrecomputed(256, 256, fits_below(70, log)) == 64 and log == [128, 64, 86], log
    log = []
    assert _largest_unrecomputed(4, 3, fits_below(2, log)) == 2 and log == [2]
    log = []
    assert _largest_unrecomputed(256, 4, fits_below(1, log)) is None and log == [2]
    log = []
    assert _largest_unrecomputed(256, 16, fits_below(15, log)) == 15 and 16 not in log, log


def _table_probe(E, n, limit, log, fixed=0.0001, per_sample_pass=0.001):
    """A probe for ``_compiled_candidates``: peak ``mb * (1 + unsaved blocks)``, a time per
    micro-batch that grows with each recomputed block, timed steps of min(k, 4) micro-batches."""
    from tightfit.plan import accumulation_steps
    from tightfit.planner.probe import ProbeResult
    cache = {}

    def probe(mb, blocks):
        if (mb, blocks) not in cache:
            c = len(blocks)
            log.append((mb, c))
            peak = mb * (1 + (n - c))
            m = min(accumulation_steps(E, mb), 4)
            cache[mb, blocks] = ProbeResult(mb, peak <= limit, peak, peak,
                                            (fixed + per_sample_pass * mb * (1 + c)) * m, m)
        return cache[mb, blocks]
    return probe


def test_the_compiled_walk_steps_to_the_next_smaller_micro_batch_and_not_back_up_the_blocks():
    """Found by a review: above sqrt(E) one micro-batch more per step may give the same
    micro-batch (256 / 17 rounds up to 16), which ended the walk on a duplicate; and a walk
    that reached the eager plan's micro-batch searched its blocks again from the eager count,
    above the fewest already found at the larger micro-batch before it (wasted probes)."""
    from tightfit.planner.gpu import _compiled_candidates

    E, n, log = 20, 50, []  # fine-grained blocks: each smaller micro-batch saves some
    found = _compiled_candidates(E, 2, n, tuple(range(n)), True, _table_probe(E, n, 100, log), eager_blocks=n)
    walked = [f.micro_batch for f in found]
    assert walked[:6] == [20, 10, 7, 5, 4, 3], walked  # after 4 x 5: 3 x 7, not 4 again (20 / 6 rounds up to 4)

    E, n, log = 256, 12, []
    found = _compiled_candidates(E, 64, n, tuple(range(n)), True,
                                 _table_probe(E, n, 512, log, per_sample_pass=0.00001), eager_blocks=10)
    prev = min(len(f.checkpoint_blocks) for f in found if f.micro_batch == 86)
    assert all(c <= prev for mb, c in log if mb == 64), log


def test_one_micro_batch_of_the_whole_batch_is_traced_exactly():
    """With accumulation the window's gradients are held between micro-batches; one micro-batch of
    the whole effective batch holds none. The memory line (traced at micro-batches 4 and 16, both
    accumulating) over-predicts that plan, so the search traces it exactly and finds it fits."""
    E = 32
    grads = sum(p.numel() * 4 for p in tiny_bert().parameters())

    def fn(precision, micro_batch, blocks):
        peak = 100 * MiB + micro_batch * MiB + (grads if micro_batch < E else 0)
        return Est(peak, peak, {})
    r = _search("gtx-1080-ti", int((132 * MiB + grads // 2) / 0.95), fn, E=E, precision="fp32", checkpointing="off")
    assert (r.best.micro_batch, r.best.accumulation_steps) == (32, 1)


def test_micro_batch_1_is_traced_exactly_before_nothing_fits():
    """Below the traced micro-batches the line extrapolates; where it says even micro-batch 1
    does not fit, the exact trace decides."""
    def fn(precision, micro_batch, blocks):  # flatter below 4 samples than the line through 4 and 16
        peak = 100 * MiB + (10 if micro_batch >= 4 else 5) * micro_batch * MiB
        return Est(peak, peak, {})
    r = _search("gtx-1080-ti", int(107 * MiB / 0.95), fn, E=8, precision="fp32", checkpointing="off")
    assert (r.best.micro_batch, r.best.accumulation_steps) == (1, 8)


def test_what_fits_instead_is_searched_in_every_precision_the_planner_plans_in():
    """Found by a fresh user: the advice after "nothing fits" re-estimated a shorter --seq-len and
    a smaller batch in the smallest step's precision alone (bf16), so it said "does not fit
    either" of sizes the planner then planned in fp32 (GPT-2 medium at 6 GiB: --seq-len 104 plans,
    the advice said even 6 does not fit). Here bf16 keeps 1 KiB more than fp32 at every size."""
    from types import SimpleNamespace

    from tightfit.planner.advice import nothing_fits_lines

    def estimator_at(size, effective_batch):
        return lambda precision, micro_batch, blocks: SimpleNamespace(
            peak_reserved_bytes=1024 * (size * micro_batch + (40 if precision == "bf16" else 39)))

    step = SimpleNamespace(peak_reserved_bytes=1024 * (64 + 40), breakdown={})
    limit = 1024 * (24 + 39)  # fp32 fits --seq-len 24 (and batch 1 at 24? no: 64 + 39 > limit)

    def lines(precisions):
        return [x for x in nothing_fits_lines(torch.nn.Linear(4, 4), step, limit, "bf16", [()], 64, 4, "--seq-len",
                                              12e9, estimator_at=estimator_at, precisions=precisions)
                if x.startswith(("fits", "does not fit"))]

    assert lines(None) == ["does not fit either: effective batch 1 (no accumulation) needs 104.00 KiB",
                           "fits: --seq-len 16 at effective batch 4 (micro-batch 1 x 4 accumulation steps; bf16, "
                           "checkpointing searched as for the plan)"]
    assert lines(["bf16", "fp32"]) == [
        "does not fit either: effective batch 1 (no accumulation) needs 103.00 KiB",
        "fits: --seq-len 24 at effective batch 4 (micro-batch 1 x 4 accumulation steps; bf16 or fp32, "
        "checkpointing searched as for the plan)"]


def test_the_seq_len_ladder_suggests_no_length_too_short_to_train_on():
    """With the activations of a step growing 1 KiB per token and a limit near 3.5 KiB, the advice
    said "fits: --seq-len 3": tightfit train refuses lengths that leave no text after the
    special tokens (models.MIN_TEXT_TOKENS)."""
    from types import SimpleNamespace

    from tightfit.models import MIN_TEXT_TOKENS
    from tightfit.planner.advice import nothing_fits_lines

    def estimator_at(size, effective_batch):
        return lambda precision, micro_batch, blocks: SimpleNamespace(peak_reserved_bytes=1024 * size)

    def lines(limit, size=64):
        step = SimpleNamespace(peak_reserved_bytes=1024 * size, breakdown={})
        return [x for x in nothing_fits_lines(torch.nn.Linear(4, 4), step, limit, "fp32", [()], size, 1, "--seq-len",
                                              12e9, estimator_at=estimator_at) if "--seq-len" in x]

    assert lines(3.5 * 1024) == [f"does not fit either: a shorter --seq-len at effective batch 1 (--seq-len "
                                 f"{MIN_TEXT_TOKENS} needs {MIN_TEXT_TOKENS}.00 KiB)"]
    assert lines(24.5 * 1024) == ["fits: --seq-len 24 at effective batch 1 (micro-batch 1 x 1 accumulation steps; "
                                  "fp32, checkpointing searched as for the plan)"]
    assert lines(3.5 * 1024, size=MIN_TEXT_TOKENS) == []  # nothing shorter to train on: no line


@pytest.mark.parametrize("whole", ["faster", "slower", "fails"])
def test_every_block_checkpointed_compiled_is_tried_as_one_whole_model_graph(monkeypatch, whole):
    """When the compiled stage needs every block checkpointed, it times the same micro-batch once
    more with the whole model as one graph and the model's own checkpointing inside (no GPU:
    probes answered by a fake that fits only with every block checkpointed): kept only if faster,
    the model left compiled as the variant says; a compiler error keeps the blocks."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.levers.checkpointing import hf_hook_active
    from tightfit.levers.compile import compiled_call
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    model, E = tiny_bert(), 16
    blocks = find_blocks(model)
    probed = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        one_graph = compiled_call(model) is not None
        probed.append("whole" if one_graph else "blocks")
        if one_graph and whole == "fails":
            raise RuntimeError("inductor lowering failed\ntraceback ...")
        every = hf_hook_active(model) or all(block_policy(b) == "full" for b in blocks)
        seconds = {"faster": 0.01, "slower": 0.03}.get(whole, 0.02) if one_graph else 0.02
        return ProbeResult(mb, every, 100, 100, seconds, 1)

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    w = SimpleNamespace(effective_batch=E, model=model)
    found = gpu.compiled_variant(w, Candidate("bf16", E, tuple(range(len(blocks))), 1, None, None), 10**9,
                                 len(blocks))
    v, note = found.variant, found.notes[-1]
    assert probed.count("whole") == 1 and "whole-model graph" in note
    if whole == "faster":
        assert v.scope == "model" and v.samples_per_s == E / 0.01 and note.endswith("kept")
        assert compiled_call(model) is not None and hf_hook_active(model)
        plan = gpu._gpu_plan(SimpleNamespace(candidate=Candidate("bf16", E, (), 1, None, None)), v, E, 10**9,
                             len(blocks), [])
        assert plan.compile and plan.compile_scope == "model" and plan.activation_checkpointing
    else:
        assert v.scope is None and v.samples_per_s == E / 0.02 and note.endswith("each block kept")
        assert compiled_call(model) is None and all(compiled_call(b) is not None for b in blocks)
        assert ("failed (RuntimeError: inductor lowering failed)" in note) == (whole == "fails")


@pytest.mark.parametrize("run_seconds", [None, 100.0, 400.0])
def test_a_whole_model_graph_is_tried_only_for_a_run_long_enough_to_repay_its_compilation(monkeypatch,
                                                                                         run_seconds):
    """One whole-model graph compiled in 50-80 s on an NVIDIA H200 for ~25% more speed: a run
    predicted shorter than WHOLE_MODEL_MIN_RUN_S at the compiled blocks' speed keeps the blocks,
    and the reasons say why; a longer one, or one of unknown length, tries the whole graph."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.levers.checkpointing import hf_hook_active
    from tightfit.levers.compile import compiled_call
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    model, E = tiny_bert(), 16
    blocks = find_blocks(model)
    probed = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        one_graph = compiled_call(model) is not None
        probed.append("whole" if one_graph else "blocks")
        every = hf_hook_active(model) or all(block_policy(b) == "full" for b in blocks)
        return ProbeResult(mb, every, 100, 100, 0.01 if one_graph else 0.02, 1)  # blocks: 800 samples/s

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    run_samples = None if run_seconds is None else int(run_seconds * E / 0.02)
    found = gpu.compiled_variant(SimpleNamespace(effective_batch=E, model=model),
                                 Candidate("bf16", E, tuple(range(len(blocks))), 1, None, None), 10**9,
                                 len(blocks), run_samples)
    if run_seconds is not None and run_seconds < gpu.WHOLE_MODEL_MIN_RUN_S:
        assert "whole" not in probed and found.variant.scope is None
        assert found.notes[-1] == ("one whole-model graph not tried: the run is predicted to take 100 s at the "
                                   "compiled blocks' speed, less than the 300 s that its compilation needs to "
                                   "repay it")
        assert all(compiled_call(b) is not None for b in blocks)
    else:
        assert probed.count("whole") == 1 and found.variant.scope == "model"


def test_a_compiled_plan_one_block_short_of_all_of_eight_is_tried_whole_with_every_block(monkeypatch):
    """At most an eighth of the blocks left out: the whole-model graph is timed with every block
    checkpointed, and kept with all of them when faster."""
    from types import SimpleNamespace

    from transformers import BertConfig, BertForSequenceClassification

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.levers.checkpointing import hf_hook_active
    from tightfit.levers.compile import compiled_call
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=8,
                                                     num_attention_heads=2, intermediate_size=32,
                                                     max_position_embeddings=32))
    blocks, E = find_blocks(model), 16

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        one_graph = compiled_call(model) is not None
        checkpointed = len(blocks) if hf_hook_active(model) else sum(block_policy(b) == "full" for b in blocks)
        return ProbeResult(mb, checkpointed >= 7, 100, 100, 0.01 if one_graph else 0.02, 1)

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    found = gpu.compiled_variant(SimpleNamespace(effective_batch=E, model=model),
                                 Candidate("bf16", E, tuple(range(8)), 1, None, None), 10**9, 8)
    assert found.variant.scope == "model" and found.variant.checkpoint_blocks == tuple(range(8))
    assert "whole-model graph" in found.notes[-1] and "with every block checkpointed, kept" in found.notes[-1]


def test_a_whole_model_graph_over_the_budget_is_probed_at_one_more_micro_batch(monkeypatch):
    """The whole-model graph misses the budget at the blocks' micro-batch (16 x 1): it is probed
    at 8 x 2 with the same graph (nothing recompiled) and kept there when faster than the blocks."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.levers.compile import compiled_call
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    model, E = tiny_bert(), 16
    blocks, probed = find_blocks(model), []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        one_graph = compiled_call(model) is not None
        probed.append((one_graph, mb))
        if one_graph:  # the whole graph: over the budget at 16, at 8 x 2 faster than the blocks' 16 x 1
            return ProbeResult(mb, mb < E, 100 if mb < E else None, 100 if mb < E else None,
                               0.015 if mb < E else None, 2 if mb < E else 1)
        every = all(block_policy(b) == "full" for b in blocks)  # the blocks fit only all checkpointed
        return ProbeResult(mb, every, 100 if every else None, 100 if every else None, 0.02 if every else None, 1)

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    found = gpu.compiled_variant(SimpleNamespace(effective_batch=E, model=model),
                                 Candidate("bf16", E, tuple(range(len(blocks))), 1, None, None), 10**9,
                                 len(blocks))
    v, note = found.variant, found.notes[-1]
    assert [p for p in probed if p[0]] == [(True, 16), (True, 8)]
    assert v.scope == "model" and v.micro_batch == 8 and v.samples_per_s == E / 0.015
    assert "16 x 1: out of memory; 8 x 2: " in note and note.endswith("kept"), note


@pytest.mark.parametrize("graphs", ["faster", "slower", "fails", "short run", "--cuda-graphs off"])
def test_a_recomputing_compiled_plan_is_tried_replayed_as_cuda_graphs_at_its_largest_micro_batch_without(
        monkeypatch, graphs):
    """The compiled blocks fit 16 x 1 only with a block recomputed, and 8 x 2 with none: 8 x 2 is
    timed once more compiled whole and replayed as CUDA graphs (no GPU: a fake answers the probes),
    kept only if faster, the model then compiled so and recomputing nothing; slower or failing,
    the blocks are compiled and checkpointed as before; a run too short to repay a whole-model
    compilation does not try it."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.levers.checkpointing import hf_hook_active
    from tightfit.levers.compile import compiled_call, is_graphed
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    model, E = tiny_bert(), 16
    blocks, probed = find_blocks(model), []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        recomputed = sum(block_policy(b) == "full" for b in blocks) + 99 * hf_hook_active(model)
        probed.append(("graphs" if is_graphed(model) else "blocks", mb, recomputed))
        steps = E // mb
        if is_graphed(model):
            if graphs == "fails":
                raise RuntimeError("cudagraph trees failed\ntraceback ...")
            return ProbeResult(mb, True, 100, 100, {"slower": 0.1}.get(graphs, 0.01), steps)
        fits = recomputed >= 1 if mb == E else True
        return ProbeResult(mb, fits, 100, 100, 0.02 if mb == E else 0.05, steps)  # 800 and 320 samples/s

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    run_samples = int(100 * 800) if graphs == "short run" else None  # 100 s at the blocks' speed
    found = gpu.compiled_variant(SimpleNamespace(effective_batch=E, model=model),
                                 Candidate("bf16", E, tuple(range(len(blocks))), 1, None, None), 10**9,
                                 len(blocks), run_samples, cuda_graphs=graphs != "--cuda-graphs off")
    v, note = found.variant, found.notes[-1]
    tried = [p for p in probed if p[0] == "graphs"]
    if graphs in ("short run", "--cuda-graphs off"):
        assert not tried and v.scope is None and "one whole-model graph not tried" not in " ".join(found.notes)
        return
    assert tried == [("graphs", 8, 0)] and "replayed as CUDA graphs" in note and "8 x 2" in note
    if graphs == "faster":
        assert v.scope == "model-graphs" and v.micro_batch == 8 and v.checkpoint_blocks == () and note.endswith("kept")
        assert is_graphed(model) and not any(block_policy(b) != "none" for b in blocks) and not hf_hook_active(model)
        plan = gpu._gpu_plan(SimpleNamespace(candidate=Candidate("bf16", E, (), 1, None, None)), v, E, 10**9,
                             len(blocks), [])
        assert plan.compile_scope == "model-graphs" and not plan.activation_checkpointing
        return
    assert v.scope is None and (v.micro_batch, len(v.checkpoint_blocks)) == (16, 1)
    assert note.endswith("the variant before kept") and ("failed (RuntimeError: cudagraph trees" in note) == (graphs == "fails")
    assert not is_graphed(model) and compiled_call(model) is None and all(compiled_call(b) is not None for b in blocks)
    assert [block_policy(b) for b in blocks] == ["full", "none"]


def test_the_planner_tries_cuda_graphs_only_where_asked_and_not_under_cuda_graphs_off(monkeypatch):
    import tightfit.planner.gpu as gpu

    monkeypatch.delenv(gpu.GRAPHS_ENV, raising=False)
    assert not gpu.graphs_planned()
    monkeypatch.setenv(gpu.GRAPHS_ENV, "1")
    assert gpu.graphs_planned() and not gpu.graphs_planned(allowed=False)


@pytest.mark.parametrize("predicted", [8, None])
def test_a_model_compiled_whole_is_tried_replayed_at_the_micro_batch_the_search_predicts_without_recomputation(
        monkeypatch, predicted):
    """A model compiled whole (blocks not identical: ResNet-50) keeps the eager plan's blocks in its
    probes, so no micro-batch without recomputation is probed: the search's largest that fits so
    (here 8 x 2) is the one replayed as CUDA graphs; with none predicted, nothing is tried."""
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.levers.compile import is_graphed
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate, SearchResult

    model, E = tiny_bert(), 16
    blocks, probed = find_blocks(model), []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        probed.append(("graphs" if is_graphed(model) else "whole", mb, sum(block_policy(b) == "full" for b in blocks)))
        return ProbeResult(mb, True, 100, 100, 0.01 if is_graphed(model) else 0.02, E // mb)

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    monkeypatch.setattr(gpu, "compile_scope", lambda m: "model")
    best = Candidate("bf16", E, (0, 1), 1, None, None, samples_per_s=700.0)
    found = gpu.compiled_variant(SimpleNamespace(effective_batch=E, model=model), best, 10**9, len(blocks),
                                 cuda_graphs=True, unrecomputed_micro_batch=predicted)
    if predicted is None:
        assert [p[0] for p in probed] == ["whole"] and found.variant.checkpoint_blocks == (0, 1)
        return
    assert probed == [("whole", 16, 2), ("graphs", 8, 0)] and found.variant.scope == "model-graphs"
    # the search's prediction: the largest micro-batch under the effective batch that fits with
    # nothing recomputed, in the winner's precision and optimizer
    others = [Candidate("bf16", 8, (), 2, 1, 1, samples_per_s=500.0), Candidate("bf16", 12, (), 2, 1, 1),
              Candidate("fp32", 12, (), 2, 1, 1, samples_per_s=400.0), Candidate("bf16", 4, (), 4, 1, 1, samples_per_s=1.0),
              Candidate("bf16", 12, (1,), 2, 1, 1, samples_per_s=600.0),
              Candidate("bf16", 10, (), 2, 1, 1, samples_per_s=400.0, optimizer="adamw8bit")]
    result = SearchResult(best, others, 10**9, E, 2, 0.0)
    assert gpu._unrecomputed_micro_batch(result, best) == 8
    # frozen first blocks, counted among the checkpointed for the search, recompute nothing (a review)
    frozen = Candidate("bf16", 16, (0, 1), 1, None, None, samples_per_s=700.0, free_blocks=1)
    kept = Candidate("bf16", 8, (0,), 2, 1, 1, samples_per_s=500.0, free_blocks=1)
    assert gpu._unrecomputed_micro_batch(SearchResult(frozen, [kept], 10**9, E, 2, 0.0), frozen) == 8


def test_a_compiled_plan_that_checkpoints_some_blocks_is_not_tried_whole(monkeypatch):
    from types import SimpleNamespace

    import tightfit.planner.gpu as gpu
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.compile import compiled_call
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate

    model, E = tiny_bert(), 16
    wholes = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        wholes.append(compiled_call(model) is not None)
        return ProbeResult(mb, True, 100, 100, 0.02, 1)  # fits with any blocks

    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    n = len(find_blocks(model))
    found = gpu.compiled_variant(SimpleNamespace(effective_batch=E, model=model),
                                 Candidate("bf16", E, tuple(range(n)), 1, None, None), 10**9, n)
    assert len(found.variant.checkpoint_blocks) < n and not any(wholes) and found.variant.scope is None


def test_gallop_finds_what_bisection_finds_stepping_from_the_known_fit():
    from tightfit.planner.bisection import bisect, gallop

    for good, bad in ((24, -1), (0, 30), (5, 4), (7, 9)):
        for boundary in range(min(good, bad) + 1, max(good, bad)):
            ok = (lambda x, b=boundary: x >= b) if bad < good else (lambda x, b=boundary: x <= b)
            seen = []
            got = gallop(good, bad, lambda x: (seen.append(x), ok(x))[1])
            assert got == bisect(good, bad, ok) and all(min(good, bad) < x < max(good, bad) for x in seen)
    seen = []
    assert gallop(24, -1, lambda x: (seen.append(x), x >= 23)[1]) == 23 and seen == [23, 21, 22]


def test_plan_without_a_model_or_batch_plans_the_main_jobs(capsys):
    """tightfit train has defaults for both (the shipped MiniLM, effective batch 32); tightfit plan
    required them, so `tightfit plan --gpu gtx-1650-ti` (the main job on that card) was refused."""
    assert main(["plan", "--gpu", "gtx-1650-ti", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["plan"]["effective_batch"] == 32, got


def test_fewer_blocks_go_straight_to_the_fewest_the_shifted_line_says_fit():
    """The line over-states micro-batch 64 by 96 MiB (as above), on a model of 12 blocks: the
    shifted line says 6 blocks fit where the lines said 9. The fewest it says fit is traced at
    once, where a block at a time traced every count in between (the 1.3B decoder at 11 GiB:
    19 -> 14 blocks in 5 traces); the plan is the same."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=12, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2))
    line = memory(100 * MiB, 10 * MiB, saving_per_block=0.05, fp16_factor=1.0)
    at_64 = []

    def exact(precision, micro_batch, blocks):
        if micro_batch == 64:
            at_64.append(len(blocks))
        est = line(precision, micro_batch, blocks)
        less = 2 * MiB * max(0, micro_batch - 16)
        return Est(est.peak_reserved_bytes - less, est.peak_allocated_bytes - less, est.breakdown)

    limit = 100 * MiB + 640 * MiB * (1 - 0.05 * 9) + 4 * MiB  # the line: 9 blocks fit 64 with 4 MiB to spare
    r = search(model, _make_batch, 16, 64, get_profile("gtx-1080-ti"), int(limit / 0.95), exact,
               precision="fp32", per_block=False)
    seen = list(at_64)
    fewest = min(k for k in range(13) if exact("fp32", 64, tuple(range(k))).peak_reserved_bytes <= limit)
    assert (r.best.micro_batch, len(r.best.checkpoint_blocks)) == (64, fewest) and fewest == 6
    assert seen.count(9) == 1 and not set(seen) & {7, 8}, seen  # 9, then 6: none of the counts between


def test_the_image_size_ladder_passes_over_sizes_too_small_to_trace():
    """A fresh user: ResNet-50 at 4096 px on a 4 GB card was told no smaller --image-size fits
    ("the sizes down to where the model can still be traced were tried"), where 2048 planned: the
    search began at 1 px, which BatchNorm cannot trace, and gave up there. It now starts from the
    smallest size that traces (by bisection) and names the largest that fits."""
    from types import SimpleNamespace

    from tightfit.planner.advice import largest_size, nothing_fits_lines

    traced = []

    def estimator_at(size, effective_batch):
        def fn(precision, micro_batch, blocks):
            traced.append(size)
            if size < 32:
                raise ValueError("Expected more than 1 value per channel when training")
            return SimpleNamespace(peak_reserved_bytes=size * size)
        return fn

    limit = 2100 ** 2
    assert largest_size(estimator_at, 4096, 1, ["fp32"], [()], limit) == (2096, 32 * 32, 32)
    assert len(set(traced)) < 30  # bisections, not a scan of 500 sizes
    step = SimpleNamespace(peak_reserved_bytes=4096 ** 2, breakdown={})
    lines = [x for x in nothing_fits_lines(torch.nn.Linear(4, 4), step, limit, "fp32", [()], 4096, 32,
                                           "--image-size", 12e9, estimator_at=estimator_at) if "--image-size" in x]
    assert lines == ["fits: --image-size 2096 at effective batch 32 (micro-batch 1 x 32 accumulation steps; fp32, "
                     "checkpointing searched as for the plan)"], lines
    # nothing fits even at the smallest size that traces: that size is named, not 1
    lines = [x for x in nothing_fits_lines(torch.nn.Linear(4, 4), step, 500, "fp32", [()], 4096, 32,
                                           "--image-size", 12e9, estimator_at=estimator_at) if "--image-size" in x]
    assert lines == ["does not fit either: a shorter --image-size at effective batch 32 (--image-size 32 needs "
                     "1.00 KiB)"], lines
