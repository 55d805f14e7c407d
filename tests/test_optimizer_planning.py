"""The optimizer levers in the estimator, the time model and the planner (no GPU): 8-bit and
CPU-offloaded AdamW state are predicted per tensor as bitsandbytes and torchao lay them out, the
planner searches
them only where fp32 AdamW state fits nothing (or accumulates/checkpoints), and the advice names
them when nothing fits."""

import importlib.util
import re

import pytest
import torch

from tightfit.devices import get_profile
from tightfit.memory.estimate import estimate
from tightfit.plan import Plan
from tightfit.planner.cost import ForwardCost, TimeModel
from tightfit.planner.optimizers import least_state_bytes, search_optimizers, state_bytes
from tightfit.planner.search import NothingFitsError, estimator_for
from tightfit.units import MiB, format_rate

SEQ, E = 16, 8
H200 = get_profile("h200")


def model():
    """2 layers, width 256, vocabulary 1,000: 1.9M parameters, most in tensors that are quantized/offloaded."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=64, num_labels=2))


def make_batch(micro_batch, size):
    return {"input_ids": torch.ones(micro_batch, size, dtype=torch.long),
            "attention_mask": torch.ones(micro_batch, size, dtype=torch.long),
            "labels": torch.zeros(micro_batch, dtype=torch.long)}


@pytest.fixture(scope="module")
def m():
    return model()


def least_peak(m, kind, E=E):
    """Peak reserved bytes of the smallest step (micro-batch 1, no block or every block checkpointed:
    a checkpointed step carries the estimator's margin, so either may be smaller)."""
    fn = estimator_for(m, make_batch, SEQ, H200, E, optimizer=kind)
    return min(fn("bf16", 1, blocks).peak_reserved_bytes for blocks in ((), (0, 1)))


def counting(m, traced: dict, effective=E):
    """``kind -> estimate_fn`` of :func:`estimator_for` that counts in ``traced`` the estimates each
    optimizer is asked for."""
    def estimator(kind):
        fn = estimator_for(m, make_batch, SEQ, H200, effective, optimizer=kind)

        def f(*a):
            traced[kind] = traced.get(kind, 0) + 1
            return fn(*a)
        return f
    return estimator


def plan(m, budget, optimizer="auto", E=E, levers=True, **kw):
    return search_optimizers(m, make_batch, SEQ, E, H200, budget,
                             lambda kind: estimator_for(m, make_batch, SEQ, H200, E, optimizer=kind),
                             optimizer=optimizer, levers=levers, precision="bf16", **kw)


def test_the_estimator_holds_8bit_state_as_bitsandbytes_lays_it_out(m):
    est = estimate(m, make_batch(1, SEQ), Plan("bf16", 4, 4, optimizer="adamw8bit", device="cuda"))
    want = state_bytes(m, "adamw8bit")  # codes, block scales and the shared maps; fp32 for small tensors
    assert want < state_bytes(m, "adamw") / 3.5
    assert abs(est.breakdown["optimizer_state"] - want) <= 512 * 4 * len(list(m.parameters()))  # block rounding


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
def test_the_meta_8bit_state_is_bitsandbytes_state_to_the_byte():
    """The estimator's stand-in (meta) and the planner's count hold exactly the bytes bitsandbytes'
    AdamW8bit allocates: a tensor of 6,565 elements (quantized, its last block partial), one of
    4,096 (the smallest quantized), small ones in fp32, and the maps once."""
    import copy

    from tightfit.step import make_optimizer

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(65, 101), torch.nn.Linear(101, 3), torch.nn.Linear(64, 64, bias=False),
                              torch.nn.Linear(63, 65, bias=False))
    meta = copy.deepcopy(net).to("meta")
    for model in (net, meta):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    real = make_optimizer(net.parameters(), "adamw8bit", "cpu", lr=1e-3)
    real.step()
    tensors = {t.data_ptr(): t for s in real.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
    real_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    stand_in = make_optimizer(meta.parameters(), "adamw8bit", "meta")
    stand_in.step()
    assert sum(t.numel() * t.element_size() for t in stand_in.state_tensors()) == real_bytes
    assert state_bytes(net, "adamw8bit") == real_bytes


def test_the_estimator_holds_no_offloaded_state_and_frees_gradients_without_accumulation(m):
    est = estimate(m, make_batch(1, SEQ), Plan("bf16", 4, 4, optimizer="adamw-offload", device="cuda"))
    small = sum(p.numel() * 8 for p in m.parameters() if p.numel() < 4096)
    assert est.breakdown["optimizer_state"] < small + 512 * 3 * len(list(m.parameters()))
    assert est.breakdown["optimizer_state"] < state_bytes(m, "adamw") / 20
    held = estimate(m, make_batch(1, SEQ), Plan("bf16", 4, 8, optimizer="adamw-offload", device="cuda"))
    # the same trace but for the gradients of offloaded parameters, freed as backward makes them
    assert est.extra["forward_backward_peak_bytes"] < held.extra["forward_backward_peak_bytes"] - MiB


def test_the_time_model_prices_each_optimizer():
    cost = ForwardCost(1e9, 1000, 300_000_000, 24, trainable_tensors=390, offloaded_params=299_000_000)
    t = {k: TimeModel(H200, cost, optimizer=k) for k in ("adamw", "adamw8bit", "adamw-offload")}
    assert t["adamw8bit"].optimizer_seconds() > 390 * 50e-6  # one kernel and one device sync per tensor
    # CPU AdamW over 299M parameters: no faster than the host's fused AdamW over one tensor (4.8e9
    # parameters/s on the H200 host, bench/results/optimizer-levers/optimizer_step_time.json)
    assert t["adamw-offload"].optimizer_seconds() > 299_000_000 / 4.8e9
    # with accumulation the accumulated gradients cross the host link again after each micro-batch
    assert t["adamw-offload"].optimizer_seconds(4) > t["adamw-offload"].optimizer_seconds(1)
    assert t["adamw"].optimizer_seconds(4) == t["adamw"].optimizer_seconds(1)


def test_the_8bit_state_of_bert_large_is_the_measured_one():
    """bitsandbytes' AdamW8bit state over BERT-large on the H200 (0.6356 GiB,
    bench/results/optimizer-levers/optimizer_step_time.json), to the byte: that bench summed the
    state tensors per parameter, the two shared maps once per quantized tensor."""
    import json
    from pathlib import Path

    from transformers import BertConfig, BertForSequenceClassification

    from tightfit.levers.optimizers import QMAP_BYTES, is_quantized

    rows = json.loads((Path(__file__).parents[1] / "bench/results/optimizer-levers/optimizer_step_time.json")
                      .read_text())["rows"]
    measured = next(r for r in rows if r["engine"] == "bitsandbytes AdamW8bit")["gpu_state_GiB"] * 2**30
    with torch.device("meta"):
        bert = BertForSequenceClassification(BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                                        intermediate_size=4096))
    quantized = sum(is_quantized(p.numel()) for p in bert.parameters())
    assert state_bytes(bert, "adamw8bit") + (quantized - 1) * QMAP_BYTES == round(measured)


def test_the_8bit_step_time_is_the_measured_one():
    """BERT-large's 335.1M parameters in 393 tensors, one bitsandbytes AdamW8bit step on the H200
    (bench/results/optimizer-levers/optimizer_step_time.json): predicted within 5%."""
    import json
    from pathlib import Path

    rows = json.loads((Path(__file__).parents[1] / "bench/results/optimizer-levers/optimizer_step_time.json")
                      .read_text())["rows"]
    row = next(r for r in rows if r["engine"] == "bitsandbytes AdamW8bit")
    cost = ForwardCost(1e9, 1000, row["params"], 24, trainable_tensors=row["tensors"])
    predicted = TimeModel(H200, cost, optimizer="adamw8bit").optimizer_seconds()
    assert abs(predicted / row["step_s"] - 1) < 0.05


def test_a_plan_that_fits_unconstrained_keeps_fp32_adamw(m):
    r = plan(m, 4 << 30)
    assert r.best.optimizer == "adamw" and r.best.accumulation_steps == 1
    assert "no optimizer lever is needed" in r.best.why
    assert r.to_plan().optimizer == "adamw"


def test_8bit_state_is_chosen_where_fp32_state_fits_nothing_and_says_why(m):
    fp32, eight = least_peak(m, "adamw"), least_peak(m, "adamw8bit")
    assert eight < fp32 - 4 * MiB
    budget = int((eight + fp32) / 2 / 0.95)  # between the two, with the planner's headroom
    r = plan(m, budget, host_bytes=0)  # no host memory for offload (predicted faster here: 910 against 753)
    assert r.best.optimizer == "adamw8bit" and r.to_plan().optimizer == "adamw8bit"
    assert "fp32 AdamW state fits nothing" in r.best.why and "optimizer state on the GPU" in r.best.why
    assert all(c.optimizer == "adamw8bit" for c in r.runners_up)
    with pytest.raises(NothingFitsError, match=r"--optimizer adamw8bit.*would fit"):
        plan(m, budget, optimizer="adamw")  # forced: the advice names the lever


def test_auto_traces_no_optimizer_whose_model_state_alone_is_over_the_limit():
    """fp32 AdamW's weights, gradients and state over the planned limit: not one trace of it
    (for BERT-large at 4 GiB that search cost half the planning); the lever is chosen as before."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    big = BertForSequenceClassification(BertConfig(  # 51M of its 52M parameters in the embeddings
        vocab_size=200000, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, intermediate_size=512,
        max_position_embeddings=64, num_labels=2))
    traced = []

    def estimator(kind):
        fn = estimator_for(big, make_batch, SEQ, H200, E, optimizer=kind)
        return lambda *a: traced.append(kind) or fn(*a)

    # one layer is no repeated block (find_blocks): nothing to checkpoint
    eight = estimator_for(big, make_batch, SEQ, H200, E, optimizer="adamw8bit")("bf16", 1, ()).peak_reserved_bytes
    budget = int(eight / 0.95) + 4 * MiB  # 8-bit's smallest step fits ...
    assert least_state_bytes(big, "adamw")[0] > 0.95 * budget  # ... fp32 AdamW's state alone does not
    r = search_optimizers(big, make_batch, SEQ, E, H200, budget, estimator, levers=True, precision="bf16")
    # 8-bit state fits the whole batch; bf16 weights, searched after it, are predicted faster still
    assert r.best.optimizer in ("adamw8bit", "adamw8bit-bf16") and "fp32 AdamW state fits nothing" in r.best.why
    assert "adamw" not in traced and "adamw8bit" in traced


def test_auto_searches_only_the_levers_whose_library_is_installed(m, monkeypatch):
    """Without bitsandbytes, 8-bit state is not chosen (its step could not be built); torchao's
    offload still is."""
    import tightfit.planner.optimizers as po

    fp32, eight = least_peak(m, "adamw"), least_peak(m, "adamw8bit")
    budget = int((eight + fp32) / 2 / 0.95)
    monkeypatch.setattr(po, "levers_installed", lambda kind=None: kind != "adamw8bit")
    r = plan(m, budget, levers=None, host_bytes=64 << 30)
    assert r.best.optimizer == "adamw-offload"


def test_offload_is_chosen_where_only_it_fits_and_only_with_the_host_memory(m):
    # effective batch 1: no accumulation, so the offloaded gradients are freed as they are copied
    eight, off = least_peak(m, "adamw8bit", E=1), least_peak(m, "adamw-offload", E=1)
    assert off < eight - 4 * MiB
    budget = int((eight + off) / 2 / 0.95)
    r = plan(m, budget, host_bytes=64 << 30, E=1)
    assert r.best.optimizer == "adamw-offload" and "pinned host memory" in r.best.why
    r = plan(m, budget, host_bytes=1 << 20, E=1)  # no host memory for offload: bf16 weights fit instead
    assert r.best.optimizer == "adamw8bit-bf16" and "adamw-offload: needs" in r.best.why
    assert "pinned host memory, 1.00 MiB available" in r.best.why


def test_too_little_host_memory_for_offload_is_said_against_what_may_be_pinned(m):
    """Offload is refused where its pinned state exceeds 90% of the available host memory; the
    reason said "needs 29 MiB of pinned host memory, 30 MiB available", which reads as if it fit.
    It now names the share that may be pinned, which the state exceeds."""
    from tightfit.levers.optimizers import PINNED_HOST_SHARE, check_host_memory, offload_host_bytes
    from tightfit.errors import TightfitError
    from tightfit.units import format_bytes

    numels = [p.numel() for p in m.parameters()]
    need = offload_host_bytes(numels)
    have = int(need / 0.95)  # more than the state, less than it over the pinned share
    assert need <= have and need > PINNED_HOST_SHARE * have
    eight, off = least_peak(m, "adamw8bit", E=1), least_peak(m, "adamw-offload", E=1)
    r = plan(m, int((eight + off) / 2 / 0.95), host_bytes=have, E=1)
    assert r.best.optimizer != "adamw-offload"
    why = r.best.why.split("adamw-offload: ", 1)[1]
    assert f"at most 90% may be pinned ({format_bytes(PINNED_HOST_SHARE * have)})" in why, why
    with pytest.raises(TightfitError, match=r"at most 90% may be pinned \(" + re.escape(format_bytes(PINNED_HOST_SHARE * have))):
        check_host_memory(numels, available=have)


def test_least_state_counts_what_each_optimizer_keeps_on_the_gpu(m):
    n = sum(p.numel() for p in m.parameters())
    assert least_state_bytes(m, "adamw") == (16 * n, "adamw")
    need, kind = least_state_bytes(m, "auto")
    assert kind == "adamw-offload" and need < 5 * n
    assert least_state_bytes(m, "auto", levers=False)[1] == "adamw"


def test_hf_trainer_arguments_name_bitsandbytes_8bit_adamw_and_refuse_offload():
    from tightfit.errors import TightfitError
    from tightfit.integrations.hf import training_arguments

    assert training_arguments(Plan("bf16", 4, 8, optimizer="adamw8bit", device="cuda"))["optim"] == "adamw_bnb_8bit"
    with pytest.raises(TightfitError, match="adamw-offload"):
        training_arguments(Plan("bf16", 4, 8, optimizer="adamw-offload", device="cuda"))


def test_nothing_fits_with_8bit_state_counts_8bit_state_and_offers_only_the_levers_left(m):
    """Asked for 8-bit state, the message must not price fp32 AdamW moments nor offer 8-bit state again."""
    with pytest.raises(NothingFitsError) as e:
        plan(m, 12 * MiB, optimizer="adamw8bit")
    text = str(e.value)
    assert "x 10 B (fp32 weights 4 B, gradients 4 B, 8-bit AdamW moments 2 B)" in text
    assert not re.search(r"--optimizer adamw8bit\b(?!-bf16)", text) and "--optimizer adamw-offload" in text


def test_a_lever_that_cannot_beat_the_plan_found_is_not_traced(m, monkeypatch):
    """A lever whose time-model ceiling (whole effective batch in one micro-batch, nothing
    recomputed) is below the best plan already found gets no trace, and the plan is the one a
    search of every lever gives."""
    import tightfit.planner.optimizers as po
    from tightfit.levers.blocks import find_blocks
    from tightfit.planner.cost import forward_cost

    traced = {}

    def planned():
        return search_optimizers(m, make_batch, SEQ, E, H200, 105 * MiB, counting(m, traced), levers=True,
                                 precision="bf16", host_bytes=64 << 30)

    pruned = planned()
    # at 105 MiB fp32 AdamW fits nothing, offload's plan predicts 910 samples/s, bf16 weights at most
    # ~350 (the host time of its update's calls, cost.TORCHAO_CHUNK_CALL_S and TORCHAO_FLAT_CALL_S)
    assert pruned.best.optimizer == "adamw-offload" and "adamw8bit-bf16" not in traced
    below = re.search(r"adamw8bit-bf16: at most (\d+) samples/s even without accumulation or recomputation",
                      pruned.best.why)
    assert below and 0 < int(below.group(1)) < pruned.best.samples_per_s, pruned.best.why
    # a ceiling just below the plan found, the same whole number: read as below it, not as equal to it
    found, r = pruned.best.samples_per_s, round(pruned.best.samples_per_s)
    ceiling = (found + r - 0.49) / 2 if found <= r else (found + r) / 2
    assert ceiling < found and f"{ceiling:.0f}" == f"{found:.0f}"
    monkeypatch.setattr(po, "unconstrained_samples_per_s",
                        lambda cost, profile, kind, *a: ceiling if kind == "adamw8bit-bf16" else float("inf"))
    why = planned().best.why
    # the plan found reads as the headline gives it (a fresh user saw "13.15", "13" and "13.2" for one
    # rate); the ceiling reads as below it where its decimals can, else as about the same
    close = re.search(r"adamw8bit-bf16: at most ([\d.]+) samples/s even without accumulation or recomputation, "
                      r"(below|about the same as) the ([\d.]+) already found", why)
    assert close and close.group(3) == format_rate(found), why
    assert (float(close.group(1)) < float(close.group(3))) == (close.group(2) == "below"), why
    assert close.group(2) == "below" or close.group(1) == close.group(3), why
    monkeypatch.undo()
    traced.clear()
    monkeypatch.setattr(po, "unconstrained_samples_per_s", lambda *a: float("inf"))
    import tightfit.planner.search as ps

    monkeypatch.setattr(ps, "ceiling", lambda space: float("inf"))  # nor the search's own bound: every lever traced
    monkeypatch.setattr(po, "STAND_IN_ERROR", float("inf"))  # nor another's traces standing in
    full = planned()
    assert traced.get("adamw8bit-bf16", 0) > 0
    assert (full.best.optimizer, full.best.label(), full.best.samples_per_s) == \
        (pruned.best.optimizer, pruned.best.label(), pruned.best.samples_per_s)
    # the ceiling bounds every plan of its optimizer
    monkeypatch.undo()
    cost = forward_cost(m, make_batch, SEQ, len(find_blocks(m)))
    for kind in ("adamw", "adamw8bit", "adamw-offload", "adamw8bit-bf16"):
        r = plan(m, 160 * MiB, optimizer=kind)
        ceiling = po.unconstrained_samples_per_s(cost, H200, kind, E, "bf16")
        assert all(c.samples_per_s <= ceiling * (1 + 1e-9) for c in [r.best, *r.runners_up]), kind


@pytest.mark.parametrize("budget, effective", [(160 * MiB, E), (130 * MiB, 64)])  # the whole batch fits; not
def test_a_search_traces_only_candidates_predicted_faster_than_a_plan_found_elsewhere(m, budget, effective):
    """``beat`` (another optimizer's best, samples/s) bounds the exact traces: the lines'
    predictions bound every exact one from above, so a candidate predicted at or below it cannot
    win. Just below the unbounded search's best, the same plan comes out; above every prediction
    (the space's ceiling), nothing is traced and the search says it cannot beat the plan found."""
    from tightfit.planner.search import CannotBeatError, search

    calls = []
    fn = estimator_for(m, make_batch, SEQ, H200, effective, optimizer="adamw")

    def recording(*a):
        calls.append(a)
        return fn(*a)

    def searched(beat):
        calls.clear()
        return search(m, make_batch, SEQ, effective, H200, budget, recording, precision="bf16", beat=beat)

    free = searched(0.0)
    unbounded = len(calls)
    assert (unbounded == 1) == (budget == 160 * MiB)  # stage 0 ends the search, or lines and candidates run
    same = searched(free.best.samples_per_s * 0.999)
    assert (same.best.label(), same.best.samples_per_s) == (free.best.label(), free.best.samples_per_s)
    assert len(calls) <= unbounded
    with pytest.raises(CannotBeatError, match="no plan predicted faster than"):
        searched(1e12)
    assert calls == []


def test_auto_returns_the_other_optimizers_that_fit_fastest_predicted_first(m):
    """The GPU planner times the runner-up optimizer too (:func:`tightfit.planner.gpu.challenge_optimizer`):
    the search hands it every other optimizer whose plan fits, fastest predicted first."""
    r = plan(m, 132 * MiB, host_bytes=64 << 30, E=64)  # fp32 AdamW fits, but only by paying; a lever wins
    assert r.best.optimizer != "adamw" and "adamw" in [o.best.optimizer for o in r.other_optimizers]
    assert r.other_optimizers, r.best.why
    kinds = [o.best.optimizer for o in r.other_optimizers]
    assert r.best.optimizer not in kinds and len(set(kinds)) == len(kinds)
    speeds = [o.best.samples_per_s for o in r.other_optimizers]
    assert speeds == sorted(speeds, reverse=True) and all(0 < s <= r.best.samples_per_s for s in speeds)
    for o in r.other_optimizers:
        assert all(c.optimizer == o.best.optimizer for c in o.runners_up)
        assert f"optimizer {o.best.optimizer}, " in o.best.why and "the runner-up optimizer" in o.best.why
    assert not plan(m, 4 << 30).other_optimizers  # fp32 AdamW unconstrained: nothing else searched


# -- the nothing-fits advice on a card below compute capability 8.0 (a GTX 1650 Ti) ------------

GTX = get_profile("gtx-1650-ti")  # compute capability 7.5: no bf16


def gtx_estimator(m):
    return lambda kind: estimator_for(m, make_batch, SEQ, GTX, E, optimizer=kind)


def gtx_advice(m, budget):
    """The advice a GTX 1650 Ti user is given at ``budget``: the refusal below the model state
    (as `tightfit plan` checks it, with the planner's estimator), else the nothing-fits error of
    fp32 AdamW."""
    from tightfit.errors import TightfitError
    from tightfit.planner.advice import check_model_state

    with pytest.raises(TightfitError) as e:
        check_model_state(m, budget, "adamw", True, GTX.host_link_bytes_per_s, profile=GTX,
                          estimator=gtx_estimator(m))
        search_optimizers(m, make_batch, SEQ, E, GTX, budget, gtx_estimator(m), optimizer="adamw", levers=True)
    return str(e.value)


def lever_verdicts(text):
    """``{--optimizer value: "would fit" | shortfall bytes}`` of the advice's lever lines."""
    from tightfit.units import parse_size

    out = {}
    for line in text.splitlines():
        kind = re.search(r"\(--optimizer ([\w-]+)[:,]", line)
        verdict = re.search(r": saves [\d.]+ \w+(?: in its traced step \([^)]*\)| of model state(?: \([^)]*\))?)?, (would fit|still ([\d.]+ \w+) over)",
                            line)
        if kind and verdict:
            out[kind.group(1)] = "would fit" if verdict.group(2) is None else parse_size(verdict.group(2))
    return out


# 30 MiB: below fp32 AdamW's 29.3 MiB of model state once the 5% headroom is kept (refused before
# any search), and the 8-bit state (18.4 MiB) alone was said to "fit" the whole budget, although its
# smallest step needs 42 MiB; 43.7 MiB: fp32 AdamW's state fits, its smallest step (54 MiB) does not,
# offload's (38 MiB) does, 8-bit's (42 MiB) does not.
@pytest.mark.parametrize("budget, fits", [(30 * MiB, set()), (int(43.7 * MiB), {"adamw-offload"})])
def test_a_lever_the_advice_says_fits_plans_and_one_it_says_does_not_is_short_by_what_it_says(m, budget, fits):
    text = gtx_advice(m, budget)
    verdicts = lever_verdicts(text)
    assert set(verdicts) == {"adamw8bit", "adamw-offload"}, verdicts
    assert text.count("would fit") == len(fits), text  # nor does a lever tightfit lacks "fit" unestimated
    assert {k for k, v in verdicts.items() if v == "would fit"} == fits, verdicts
    for kind, verdict in verdicts.items():  # the planner, asked for that lever, agrees
        if verdict == "would fit":
            search_optimizers(m, make_batch, SEQ, E, GTX, budget, gtx_estimator(m), optimizer=kind)
            continue
        with pytest.raises(NothingFitsError) as e:
            search_optimizers(m, make_batch, SEQ, E, GTX, budget, gtx_estimator(m), optimizer=kind)
        from tightfit.units import parse_size
        over = parse_size(re.search(r"needs [\d.]+ \w+, ([\d.]+ \w+) over", str(e.value)).group(1))
        assert abs(over - verdict) <= 0.01 * MiB, (kind, over, verdict)


@pytest.mark.parametrize("budget", [30 * MiB, int(43.7 * MiB)])
def test_the_advice_on_a_card_without_bf16_does_not_offer_bf16_weights_and_says_why(m, budget):
    text = gtx_advice(m, budget)
    assert "bf16 weights and gradients" not in text and "(--optimizer adamw8bit-bf16" not in text, text
    assert re.search(r"--optimizer adamw8bit-bf16 is not offered: .*compute capability >= 8\.0; "
                     r"NVIDIA GeForce GTX 1650 Ti is 7\.5", text), text


def test_offloaded_activations_get_the_hosts_memory_less_offloaded_optimizer_state(m, monkeypatch):
    """Each optimizer's search is told the pinned host memory its offloaded activations may hold:
    90% of what the host has, less ``adamw-offload``'s own pinned state; not limited where the
    host is another machine's (``tightfit plan``)."""
    from tightfit.levers.optimizers import offload_host_bytes
    from tightfit.planner import optimizers as po

    told = {}
    real = po.search

    def spy(*a, optimizer="adamw", host_bytes=None, **kw):
        told[optimizer] = host_bytes
        return real(*a, optimizer=optimizer, host_bytes=host_bytes, **kw)

    monkeypatch.setattr(po, "search", spy)
    state = offload_host_bytes(p.numel() for p in m.parameters() if p.requires_grad)
    plan(m, 512 * MiB, optimizer="adamw-offload", host_bytes=1000 * MiB)
    plan(m, 512 * MiB, optimizer="adamw", host_bytes=1000 * MiB)
    assert told == {"adamw-offload": pytest.approx(900 * MiB - state), "adamw": pytest.approx(900 * MiB)}
    plan(m, 512 * MiB, optimizer="adamw", host_bytes=po.UNKNOWN_HOST_BYTES)
    assert told["adamw"] is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this host each pin their own
    plan(m, 512 * MiB, optimizer="adamw", host_bytes=1000 * MiB)
    assert told["adamw"] == pytest.approx(225 * MiB)


def test_a_levers_bound_that_cannot_beat_the_plan_found_traces_nothing(m):
    """With --checkpointing on the levers' bounds traced the plan none can beat and the memory lines
    of a lever whose every plan was slower than the one found, where its search traced nothing."""
    from tightfit.planner.search import predicted_bound

    def never(*a):
        raise AssertionError(f"traced {a}")

    bound, whole = predicted_bound(m, make_batch, SEQ, E, H200, 105 * MiB, never, optimizer="adamw8bit",
                                   checkpointing="on", beat=1e12)
    assert not whole and 0 < bound < 1e12


def test_shifted_estimates_move_known_peaks_trace_a_whole_batch_and_take_micro_batch_1_to_fit():
    from tightfit.memory.estimate import MemoryEstimate
    from tightfit.planner.search import NotTraced, remembering, shifted

    calls = []

    def fake(precision, micro_batch, blocks):
        calls.append((micro_batch, tuple(blocks)))
        return MemoryEstimate(0, 1000 * micro_batch, {"activations": 1000 * micro_batch}, {})

    fn = remembering(fake)
    with pytest.raises(NotTraced):  # nothing known: a stand-in for micro-batch 1 has no estimate to copy
        shifted(fn, 5)("bf16", 1, ())
    fn("bf16", 4, ())
    stand_in = shifted(fn, -300)
    assert stand_in("bf16", 4, ()).peak_reserved_bytes == 3700 and calls == [(4, ())]
    assert stand_in("bf16", 1, (0,)).peak_reserved_bytes == 0 and calls == [(4, ())]  # taken to fit, untraced
    assert stand_in("bf16", 8, (0,)).peak_reserved_bytes == 7700 and calls[-1] == (8, (0,))  # traced once
    assert fn.known(("bf16", 8, (0,))).peak_reserved_bytes == 8000  # for the reference's own search too


def test_a_lever_whose_bound_from_another_optimizers_traces_cannot_beat_the_plan_found_is_not_traced(m, monkeypatch):
    """At 105 MiB fp32 AdamW's traces, shifted by the model-state difference, bound each lever
    with no trace of its own: CPU offload, bound highest, is searched first, and 8-bit state,
    whose ceiling is below the plan it finds, gets no trace (with its own bound traced first, it
    got 11); the plan is the one the levers' own traces give."""
    import tightfit.planner.optimizers as po
    from tightfit.planner.search import NotTraced

    traced = {}

    def planned():
        traced.clear()
        r = search_optimizers(m, make_batch, SEQ, E, H200, 105 * MiB, counting(m, traced), levers=True,
                              precision="bf16", host_bytes=64 << 30)
        return r, dict(traced)

    stood_in, stood_traces = planned()
    assert "adamw8bit" not in stood_traces, stood_traces
    assert "adamw8bit: at most" in stood_in.best.why

    def no_stand_in(*a):
        def f(*b):
            raise NotTraced(b)
        return f

    monkeypatch.setattr(po, "shifted", no_stand_in)
    own, own_traces = planned()
    assert own_traces.get("adamw8bit", 0) > 0
    assert (own.best.optimizer, own.best.label(), own.best.samples_per_s) == \
        (stood_in.best.optimizer, stood_in.best.label(), stood_in.best.samples_per_s)


def test_a_lever_left_untraced_by_its_stand_in_bound_says_so(m, monkeypatch):
    """The rule itself, made to fire (a stand-in bound trusted to within 100x): the levers after the
    first searched whose stand-in bound fits something are left untraced, each with the reason its
    search would give."""
    import tightfit.planner.optimizers as po

    traced = {}
    monkeypatch.setattr(po, "STAND_IN_ERROR", 0.01)
    r = search_optimizers(m, make_batch, SEQ, 64, H200, 110 * MiB, counting(m, traced, 64), levers=True,
                          precision="bf16", host_bytes=64 << 30)
    untraced = {"adamw8bit", "adamw-offload", "adamw8bit-bf16"} - set(traced)
    assert untraced, traced
    for kind in untraced:
        assert re.search(kind + r": not traced: bounded from adamw's traces at [\d.]+ samples/s, below the [\d.]+ "
                                r"already found", r.best.why), r.best.why


def test_with_two_levers_pending_the_one_with_the_higher_ceiling_is_searched_first():
    """fp32 AdamW's and 8-bit AdamW's state over the limit leave bf16 weights and CPU offload. The
    offload lever, whose traces make the closest stand-ins, went first, though with two levers its
    traces bound only the other one, searched anyway: a trace for a lever that could not win (the
    1.3B decoder at 11 GiB: 8 of 25). The higher ceiling goes first, and offload's ceiling, below
    the plan found, rules it out with no trace; the plan is the same."""
    from transformers import BertConfig, BertForSequenceClassification

    with torch.device("meta"):  # 4 x 2048: 200M parameters, fp32 AdamW state 3.1 GiB
        big = BertForSequenceClassification(BertConfig(
            vocab_size=1000, hidden_size=2048, num_hidden_layers=4, num_attention_heads=16,
            intermediate_size=8192, max_position_embeddings=64, num_labels=2))
    traced = {}
    r = search_optimizers(big, make_batch, SEQ, E, H200, 1700 * MiB, counting(big, traced), levers=True,
                          precision="bf16", host_bytes=64 << 30)
    assert r.best.optimizer == "adamw8bit-bf16" and "adamw8bit: fits nothing" in r.best.why
    assert traced == {"adamw8bit-bf16": 1}, traced
    assert re.search(r"adamw-offload: at most [\d.]+ samples/s even without accumulation or recomputation, below "
                     r"the [\d.]+ already found", r.best.why), r.best.why
