"""Why the planner chose an optimizer (no GPU, no trace: the search per optimizer is stubbed):
fp32 AdamW stands only where its plan pays nothing for memory (no accumulation, no block
recomputed or offloaded), the reason names what it pays, and the planning time counts every
optimizer searched."""

from dataclasses import replace

import pytest
import torch

import tightfit.planner.optimizers as po
from tightfit.devices import get_profile
from tightfit.planner.search import Candidate, SearchResult

H200 = get_profile("h200")
E = 8


def model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 2))


def result(samples_per_s, policies=None, blocks=(), accumulation=1):
    best = Candidate("bf16", E // accumulation, blocks, accumulation, 100 << 20, 90 << 20, {"parameters": 1 << 20},
                     samples_per_s, "fits; per step: host transfers 5 ms" if policies else "fits",
                     block_policies=policies)
    return SearchResult(best, [], 1 << 30, E, 2, 0.1)


@pytest.fixture(autouse=True)
def no_ceiling(monkeypatch):
    """No lever is skipped for its time-model ceiling here (that needs a real model's forward)."""
    monkeypatch.setattr(po, "forward_cost", lambda *a: None)
    monkeypatch.setattr(po, "unconstrained_samples_per_s", lambda *a: float("inf"))


@pytest.fixture(autouse=True)
def bound_from_the_stub(monkeypatch):
    """Each lever's bound (which orders the searches) is its stubbed search's speed: no trace here."""
    from tightfit.planner.search import NothingFitsError

    def bound(*a, optimizer="adamw", **k):
        try:
            r = po.search(*a, optimizer=optimizer, **k)
        except NothingFitsError:
            return 0.0, False
        return r.best.samples_per_s, not po._constrained(r)
    monkeypatch.setattr(po, "predicted_bound", bound)


def search_stub(monkeypatch, per_kind):
    def fake_search(*a, optimizer="adamw", **k):
        if optimizer not in per_kind:  # a lever the test leaves out fits nothing
            from tightfit.planner.search import NothingFitsError
            raise NothingFitsError(f"nothing fits with {optimizer}")
        return per_kind[optimizer]
    monkeypatch.setattr(po, "search", fake_search)


def plan(m):
    return po.search_optimizers(m, None, 16, E, H200, 1 << 30, lambda kind: None, levers=True, host_bytes=64 << 30)


def test_fp32_adamw_with_offloaded_activations_is_weighed_against_the_levers(monkeypatch):
    """Offloading a block's activations costs time, so a lever that needs none may be faster."""
    search_stub(monkeypatch, {"adamw": result(100, ("offload", "none")), "adamw8bit": result(150),
                              "adamw-offload": result(50)})
    r = plan(model())
    assert r.best.optimizer == "adamw8bit"
    assert "fp32 AdamW state needs 1 offloaded block;" in r.best.why
    assert "no optimizer lever is needed" not in r.best.why


def test_the_reason_names_selective_and_full_blocks_and_accumulation(monkeypatch):
    search_stub(monkeypatch, {"adamw": result(100, ("selective", "selective", "full"), blocks=(2,), accumulation=2),
                              "adamw8bit": result(150), "adamw-offload": result(50)})
    assert ("fp32 AdamW state needs 2 accumulation steps, 2 selectively recomputed blocks and 1 checkpointed block;"
            in plan(model()).best.why)


def test_fp32_adamw_that_pays_but_is_fastest_says_what_it_pays_once(monkeypatch):
    """It read "optimizer adamw, fp32 AdamW state: fp32 AdamW state needs 23 checkpointed blocks",
    compared its state with itself and counted "1 accumulation steps"."""
    search_stub(monkeypatch, {"adamw": result(200, ("full", "none")), "adamw8bit": result(150),
                              "adamw-offload": result(50)})
    why = plan(model()).best.why
    assert "optimizer adamw, fp32 AdamW state: needs 1 checkpointed block; predicted fastest" in why, why
    assert why.count("fp32 AdamW state") == 1 and "(fp32 AdamW: " not in why, why  # not against itself
    assert "1 accumulation step)" in why, why


def test_fp32_adamw_that_pays_nothing_for_memory_stands(monkeypatch):
    search_stub(monkeypatch, {"adamw": result(100, ("none", "none")), "adamw8bit": result(150),
                              "adamw-offload": result(50)})
    r = plan(model())
    assert r.best.optimizer == "adamw" and "no optimizer lever is needed" in r.best.why


def test_bf16_weights_are_searched_where_8bit_state_fits_the_whole_batch(monkeypatch):
    """8-bit state fitting without accumulation or recomputation rules out offload, not bf16 weights:
    stopping there planned ResNet-50 at 32 pixels slower at 400 MiB (8-bit state, whole batch) than at
    300 MiB (bf16 weights)."""
    searched = []
    per_kind = {"adamw": result(100, accumulation=2), "adamw8bit": result(150), "adamw-offload": result(140),
                "adamw8bit-bf16": result(200)}

    def fake_search(*a, optimizer="adamw", **k):
        searched.append(optimizer)
        return per_kind[optimizer]

    monkeypatch.setattr(po, "search", fake_search)
    ceilings = {"adamw-offload": 140.0, "adamw8bit-bf16": 250.0}
    monkeypatch.setattr(po, "unconstrained_samples_per_s", lambda cost, profile, kind, *a: ceilings.get(kind, 1e9))
    r = plan(model())
    assert r.best.optimizer == "adamw8bit-bf16" and "adamw8bit-bf16" in searched


def test_offload_is_searched_where_8bit_state_fits_the_whole_batch_if_its_ceiling_is_above(monkeypatch):
    """ResNet-50 at 32 pixels, --precision fp16 (no bf16 weights), H200 rates: offload at 300-350 MiB
    planned 1,018 samples/s; at 400 MiB 8-bit state fitted the whole batch (1,010) and offload, whose
    ceiling is above that, was skipped as "cannot be faster": the larger budget planned slower."""
    search_stub(monkeypatch, {"adamw": result(100, accumulation=2), "adamw8bit": result(1010),
                              "adamw-offload": result(1018)})
    monkeypatch.setattr(po, "unconstrained_samples_per_s",
                        lambda cost, profile, kind, *a: {"adamw-offload": 1018.0}.get(kind, 1010.0))
    r = po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True,
                             host_bytes=64 << 30, precision="fp16")
    assert r.best.optimizer == "adamw-offload" and r.best.samples_per_s == 1018


def test_the_planning_time_counts_every_optimizer_searched(monkeypatch):
    """`tightfit plan` prints "planned in" the result's seconds: every search, not the winner's alone."""
    clock = [0.0]
    per_kind = {"adamw": result(100, ("offload", "none")), "adamw8bit": result(150), "adamw-offload": result(50),
                "adamw8bit-bf16": result(120)}

    def fake_search(*a, optimizer="adamw", **k):
        clock[0] += 10.0  # each search takes 10 s
        return per_kind[optimizer]

    monkeypatch.setattr(po, "search", fake_search)
    monkeypatch.setattr(po, "predicted_bound", lambda *a, optimizer, **k: (per_kind[optimizer].best.samples_per_s,
                                                                           optimizer == "adamw8bit"))
    monkeypatch.setattr(po.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(po, "unconstrained_samples_per_s",  # offload's ceiling below 8-bit's plan: not searched
                        lambda cost, profile, kind, *a: 100.0 if kind == "adamw-offload" else float("inf"))
    r = plan(model())
    # fp32, 8-bit and bf16 weights (which may still be faster); offload's ceiling rules it out
    assert r.best.optimizer == "adamw8bit" and r.seconds == 30.0


def test_the_reason_says_which_levers_fit_nothing_or_were_not_searched(monkeypatch):
    """"predicted fastest" of one lever: the others fit nothing, lacked host memory or their library."""
    from tightfit.planner.search import NothingFitsError

    def fake_search(*a, optimizer="adamw", **k):
        if optimizer == "adamw-offload":
            return result(50)
        raise NothingFitsError("nothing fits 1 GiB\n  levers: --optimizer adamw-offload (4 GiB of pinned host memory)")

    monkeypatch.setattr(po, "search", fake_search)
    r = plan(model())
    assert r.best.optimizer == "adamw-offload" and "(against adamw8bit: fits nothing; adamw8bit-bf16: fits nothing)" \
        in r.best.why
    monkeypatch.setattr(po, "levers_installed", lambda kind=None: kind != "adamw8bit")
    r = po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=None, host_bytes=64 << 30)
    assert "(against adamw8bit-bf16: fits nothing; adamw8bit: not searched (bitsandbytes is not installed))" in r.best.why
    with pytest.raises(NothingFitsError, match="adamw-offload"):  # no host memory for offload, 8-bit fits nothing
        po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True, host_bytes=1)
    search_stub(monkeypatch, {"adamw": result(100, accumulation=2), "adamw8bit": result(150, accumulation=2)})
    r = po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True, host_bytes=1)
    assert r.best.optimizer == "adamw8bit" and "adamw-offload: needs" in r.best.why and "pinned host memory" in r.best.why


def test_the_plan_found_reads_the_same_beside_every_levers_ceiling():
    from tightfit.planner.optimizers import _apart

    found = 20.6713
    assert {_apart(c, found)[1] for c in (3.1, 15.0, 20.6, 20.7)} == {"20.7"}  # one text for one number
    assert _apart(909.7, 910.3) == ("909.7", "910") and _apart(333.8, 910.3) == ("334", "910")
    assert _apart(20.671, 20.6713) == ("20.67", "20.7") and _apart(910.3, 910.2) == ("910", "910")
    assert _apart(1233.6, 1834.4) == ("1234", "1834")
    assert _apart(0.61, 0.642) == ("0.61", "0.642")  # as the headline writes 0.642 samples/s (a fresh user)
    assert _apart(13.149, 13.151) == ("13.1", "13.2")
    from tightfit.units import format_rate

    assert _apart(3.1, found)[1] == format_rate(found)


def test_blocks_checkpointed_because_asked_are_not_what_fp32_adamw_pays(monkeypatch):
    """`tightfit plan --checkpointing on` read "fp32 AdamW state: needs 6 checkpointed blocks" for
    a job that fits without any: the blocks were the user's choice, not the memory's."""
    search_stub(monkeypatch, {"adamw": result(100, blocks=(0, 1)), "adamw8bit": result(150),
                              "adamw-offload": result(50)})
    forced = po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True,
                                  host_bytes=64 << 30, checkpointing="on")
    assert forced.best.optimizer == "adamw" and "checkpointed block" not in forced.best.why.split(";")[0]
    assert "fits without accumulation (every block checkpointed, as --checkpointing on asks)" in forced.best.why
    # every block frozen (--trainable frozen-2 of 2 blocks): none keeps activations, none is checkpointed
    # (the plan read "checkpointing 0 of 2 blocks" beside "every block checkpointed")
    frozen = result(100, blocks=(0, 1))
    search_stub(monkeypatch, {"adamw": replace(frozen, best=replace(frozen.best, free_blocks=2))})
    forced = po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True,
                                  host_bytes=64 << 30, checkpointing="on")
    assert "the plan fits without accumulation, so no optimizer lever" in forced.best.why, forced.best.why
    search_stub(monkeypatch, {"adamw": result(100, blocks=(0, 1), accumulation=2), "adamw8bit": result(150),
                              "adamw-offload": result(50)})
    forced = po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True,
                                  host_bytes=64 << 30, checkpointing="on")
    assert "fp32 AdamW state needs 2 accumulation steps;" in forced.best.why, forced.best.why
    # under auto the same blocks are paid for memory, and said so
    assert "needs 2 accumulation steps and 2 checkpointed blocks;" in plan(model()).best.why


def test_the_lever_with_the_highest_bound_is_searched_first_and_sets_the_bar_for_the_others(monkeypatch):
    """BERT-large at 4 GiB traced 28 estimates for 8-bit state, searched first, that lost to bf16
    weights: the levers are now searched in the order of their bounds (the fastest plan their
    memory lines say fits; here from fp32 AdamW's traces, shifted), each later one with the best
    found so far to beat, and one whose bound is :data:`po.STAND_IN_ERROR` times below it not at all."""
    calls = []
    per_kind = {"adamw": result(100, accumulation=2), "adamw8bit": result(199, accumulation=2),
                "adamw-offload": result(150, accumulation=2), "adamw8bit-bf16": result(480, accumulation=2)}

    def fake_search(*a, optimizer="adamw", beat=0.0, **k):
        calls.append((optimizer, beat))
        return per_kind[optimizer]

    bounds = {"adamw8bit": 310.0, "adamw-offload": 400.0, "adamw8bit-bf16": 520.0}  # x 1.6 above 480
    monkeypatch.setattr(po, "search", fake_search)
    monkeypatch.setattr(po, "predicted_bound", lambda *a, optimizer, **k: (bounds[optimizer], False))
    r = plan(model())
    assert r.best.optimizer == "adamw8bit-bf16"
    assert calls == [("adamw", 0.0), ("adamw8bit-bf16", 100.0), ("adamw-offload", 480.0), ("adamw8bit", 480.0)]
    calls.clear()
    bounds["adamw-offload"] = 480 / po.STAND_IN_ERROR  # as far below as the rule allows
    r = plan(model())
    assert calls == [("adamw", 0.0), ("adamw8bit-bf16", 100.0), ("adamw8bit", 480.0)]
    assert "adamw-offload: not traced: bounded from adamw's traces at 300 samples/s, below the 480 already found" \
        in r.best.why, r.best.why


def test_nothing_fits_names_the_levers_in_their_order_however_they_were_searched(monkeypatch):
    """bf16 weights ruled out by --precision fp32 before any search came first in the message."""
    from tightfit.planner.search import NothingFitsError

    search_stub(monkeypatch, {})  # every optimizer fits nothing
    monkeypatch.setattr(po, "lora_line", lambda *a: None, raising=False)
    with pytest.raises(NothingFitsError) as e:
        po.search_optimizers(model(), None, 16, E, H200, 1 << 30, lambda kind: None, levers=True,
                             host_bytes=64 << 30, precision="fp32")
    text = str(e.value)
    named = [text.index(f"(--optimizer {k})") for k in ("adamw8bit", "adamw-offload", "adamw8bit-bf16")]
    assert named == sorted(named), text
