"""Guards for DESIGN invariants that a mutation review found unguarded: each test below failed with a
small, realistic break of the runtime (named in its docstring) and passes without it. CPU only, fast,
with dropout active wherever a test compares what dropout draws."""

import pytest
import torch

import tightfit
from test_loop import _ce, _mlp, _xy  # the same small model, data and loss
from tightfit.plan import Plan


class _OOMOnce:
    """A forward pre-hook raising a CUDA-style OOM once, on the first input of ``rows`` samples."""

    def __init__(self, rows):
        self.rows, self.fired = rows, 0

    def __call__(self, module, args):
        if not self.fired and args[0].shape[0] == self.rows:
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")


def test_an_oom_redo_in_train_step_leaves_the_step_count_and_its_state_as_an_uninterrupted_loop():
    """Invariant 2: an OOM redoes the window with the global step unchanged (and invariant 5: TrainStep's
    state, which a resume takes back, holds the same counts).

    Mutation that survived the suite: TrainStep's OOM back-off counted a step per failed attempt
    (``self.steps += 1`` in ``_on_oom``): the losses and weights were the ones of a loop at the smaller
    micro-batch, but ``steps`` -- the number in its events, its stop messages and its saved state -- ran ahead."""
    def run(micro_batch, oom):
        model = _mlp(dropout=0.3)
        if oom:
            model[3].register_forward_pre_hook(_OOMOnce(8))
        step = tightfit.TrainStep(Plan("fp32", micro_batch, 8, device="cpu"), model,
                                  torch.optim.AdamW(model.parameters(), lr=1e-2), loss=_ce, grow_back_after=0)
        torch.manual_seed(5)
        outs = [step(_xy(8, s)) for s in range(3)]
        return outs, model, step

    ref_outs, ref, ref_step = run(4, False)
    outs, model, step = run(8, True)
    assert outs[0].oom_recoveries == 1 and step.micro_batch == 4
    assert [o.loss for o in outs] == [o.loss for o in ref_outs]  # dropout (p=0.3) drew the same masks
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    assert step.steps == ref_step.steps == 3
    mine, theirs = step.state_dict(), ref_step.state_dict()
    assert {k: mine[k] for k in ("steps", "skipped_steps", "micro_batch")} == \
        {k: theirs[k] for k in ("steps", "skipped_steps", "micro_batch")}
    other = _mlp(dropout=0.3)
    torch.manual_seed(6)  # another seed: other dropout masks, another loss
    out = tightfit.TrainStep(Plan("fp32", 4, 8, device="cpu"), other, torch.optim.AdamW(other.parameters(), lr=1e-2),
                             loss=_ce)(_xy(8, 0))
    assert out.loss != ref_outs[0].loss, "dropout is not active"


def test_automatic_precision_takes_bf16_only_where_the_profile_says_it_runs_natively():
    """Invariant 7: automatic precision uses bf16 only where it runs natively (the profile's ``bf16``), not
    on the compute capability alone.

    Mutation that survived the suite: ``preferred_precision`` chose bf16 on ``compute_capability >= (8, 0)``
    without asking ``profile.bf16`` -- a card profile of yours that says bf16 does not run natively (e.g. a
    card whose bf16 torch only emulates) got bf16 autocast; every built-in sm_80+ card has native bf16, so
    only such a profile tells the two apart."""
    from dataclasses import replace

    from tightfit.devices import get_profile
    from tightfit.levers.precision import preferred_precision

    ampere = get_profile("rtx-3090")
    assert preferred_precision(ampere)[0] == "bf16"
    no_native_bf16 = replace(ampere, bf16=False, bf16_tflops=0.0)
    assert no_native_bf16.compute_capability >= (8, 0)
    assert preferred_precision(no_native_bf16)[0] == "fp16"  # its tensor cores run fp16


def test_the_optimizer_train_step_makes_holds_no_frozen_parameter_and_no_state_for_one():
    """Invariant 6: frozen parameters receive no optimizer state and stay bit-identical.

    Mutation that survived the suite: ``make_optimizer`` kept every parameter it was given (its
    ``requires_grad`` filter dropped), so the optimizer TrainStep makes held the frozen ones too. With no
    gradient torch's AdamW happens to skip them, so no state appears yet -- the state stays empty only by
    that accident of the optimizer, and the saved optimizer state lists parameters that never train."""
    model = _mlp(dropout=0.3)
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = {id(p) for p in model[0].parameters()}
    before = [p.detach().clone() for p in model[0].parameters()]
    step = tightfit.TrainStep(Plan("fp32", 4, 8, device="cpu"), model, loss=_ce)
    torch.manual_seed(5)
    outs = [step(_xy(8, s)) for s in range(3)]
    assert all(o.stepped for o in outs)
    held = [p for g in step.optimizer.param_groups for p in g["params"]]
    assert held and not any(id(p) in frozen for p in held)
    assert not any(id(p) in frozen for p in step.optimizer.state)
    assert all(torch.equal(p, b) for p, b in zip(model[0].parameters(), before))
    assert len(step.state_dict()["optimizer"]["state"]) == len(held) == 2  # the last layer's weight and bias


def test_an_oom_part_way_through_your_non_fused_optimizers_step_is_not_redone_by_train_step(monkeypatch):
    """Invariant 10: an optimizer step is all or nothing: an error part-way through never leaves a
    half-applied update that a retry applies again.

    Mutation that survived the suite: TrainStep stopped comparing the optimizer's in-place versions
    before redoing an OOM (``written = ran`` only): an OOM inside foreach AdamW's step, after it had
    advanced every ``step`` counter and written the moments, was redone at half the micro-batch, applying
    that part of the update twice (the runtime's own Trainer is guarded, TrainStep was not)."""
    from tightfit.runtime.trainer import PartialUpdateError

    model = _mlp(dropout=0.3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    step = tightfit.TrainStep(Plan("fp32", 8, 8, device="cpu"), model, opt, loss=_ce)
    torch.manual_seed(5)
    assert step(_xy(8, 0)).stepped  # the state exists: the next step's failure comes after its writes
    real, calls = torch._foreach_sqrt, []

    def sqrt(*args, **kwargs):  # after step, exp_avg and exp_avg_sq are written
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_sqrt", sqrt)
    with pytest.raises(PartialUpdateError, match="part"):
        step(_xy(8, 1))
    assert calls == [1] and step.oom_recoveries == 0
    assert max(float(s["step"]) for s in opt.state.values()) == 2.0  # advanced once, by the failed step, not twice


def test_an_unknown_pascal_card_is_expected_to_run_fp16_slowly_and_an_explicit_fp16_is_warned(monkeypatch):
    """Invariant 7: fp16 speed-up is expected only where tensor cores exist, and on Pascal fp16 is for memory.

    Mutation that survived the suite: ``detect`` gave an unknown sm_61 card (one with no built-in profile)
    the fp32 rate for fp16 (``1.0`` in place of Pascal's 1/64): its time model then priced fp16 as fast as
    fp32, and ``--precision fp16`` on it lost its warning. The suite checked 1/64 only for the built-in
    GTX 1080 Ti, which takes its rates from its profile."""
    from types import SimpleNamespace

    from tightfit.devices import detect
    from tightfit.levers.precision import check_precision, preferred_precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name="Quadro P4000", major=6, minor=1, total_memory=8 * 2**30, multi_processor_count=14))
    p = detect()
    assert p.key == "local" and not p.fp16_tensor_cores and not p.bf16
    assert p.fp16_tflops / p.fp32_tflops == pytest.approx(1 / 64)
    assert preferred_precision(p)[0] == "fp32"
    warnings = check_precision("fp16", p)
    assert len(warnings) == 1 and "1/64 of its fp32 rate" in warnings[0]
