"""tightfit in a user's own loop (:mod:`tightfit.loop`): ``tightfit.plan`` and ``tightfit.TrainStep``."""

import contextlib
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

import tightfit
from conftest import SyntheticBatches, tiny_bert
from tightfit import Plan, TightfitError
from tightfit.runtime.trainer import NonFiniteTrainingError, PartialUpdateError


def _mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 3))


def _xy(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _ce(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def test_package_root_exports_the_own_loop_api():
    assert callable(tightfit.plan) and tightfit.TrainStep.__module__ == "tightfit.loop"
    from tightfit.plan import Plan as PlanClass  # the module stays importable under the function's name
    assert PlanClass is tightfit.Plan


def test_cpu_plan_is_the_whole_batch_in_fp32_and_notes_the_budget():
    model = _mlp()
    plan = tightfit.plan(model, _xy(8), effective_batch=32, budget="4GiB", loss=_ce, device="cpu")
    assert (plan.device, plan.precision, plan.micro_batch, plan.effective_batch) == ("cpu", "fp32", 32, 32)
    assert any("no CUDA GPU in use" in r for r in plan.reasons)
    assert any(r.startswith("budget 4.00 GiB: checked against") for r in plan.reasons), plan.reasons  # its value
    np = pytest.importorskip("numpy")
    assert tightfit.plan(model, _xy(8), effective_batch=np.int64(16), loss=_ce, device="cpu").effective_batch == 16


def _plain_loop(loss_fn, steps, clip=None, opt=torch.optim.AdamW, lr=1e-2):
    """Losses and model of the loop without tightfit: backward, (clip), step, zero_grad on the whole batch."""
    x, y = _xy(8)
    ref = _mlp()
    o = opt(ref.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = loss_fn(ref, (x, y))
        losses.append(float(loss.detach()))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        o.step()
        o.zero_grad()
    return losses, ref


@pytest.mark.parametrize("clip", [None, 1.0])
def test_micro_batched_step_equals_one_full_batch_step(clip):
    # micro-batches 3+3+2 with accumulation give the update of the whole batch of 8 (AdamW; clipped if asked)
    x, y = _xy(8)
    ref_losses, ref = _plain_loop(_ce, 3, clip)
    model = _mlp()
    step = tightfit.TrainStep(Plan("fp32", 3, 8), model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss=_ce,
                              max_grad_norm=clip)
    outs = [step((x, y)) for _ in range(3)]
    assert outs[-1].stepped and outs[-1].micro_batch == 3 and outs[-1].accumulation_steps == 3
    for o, r in zip(outs, ref_losses):
        assert math.isclose(o.loss, r, rel_tol=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _OOMOnce:
    """A hook raising a CUDA-style OOM once, on the first call whose tensor (input or gradient) has ``rows``
    samples; for an optimizer's step pre-hook (``rows`` None), on the first step."""

    def __init__(self, rows=None):
        self.rows, self.fired = rows, 0

    def __call__(self, module, args, *rest):
        tensor = args[0] if isinstance(args, tuple) and args and isinstance(args[0], torch.Tensor) else None
        if not self.fired and (self.rows is None or (tensor is not None and tensor.shape[0] == self.rows)):
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _run_with_oom(device: str, where: str = "forward", steps=4, dropout=0.2):
    """Losses, weights and step of a loop planned at micro-batch 8 that runs out of memory once in its first
    step (``where``: the forward after dropout, the backward, or the optimizer step, all gradients held),
    and of a loop at micro-batch 4 from the start. Dropout on; SGD without clipping, so gradients left
    over from the failed attempt would show in the weights."""
    data = [_xy(8, seed=s) for s in range(steps)]
    runs = []
    for micro_batch, inject in ((4, False), (8, True)):
        model = _mlp(dropout=dropout).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = tightfit.TrainStep(Plan("fp32", micro_batch, 8, device=device), model, opt, loss=_ce,
                                  max_grad_norm=None)
        if inject:
            hook = _OOMOnce(None if where == "optimizer" else 8)
            if where == "forward":
                model[3].register_forward_pre_hook(hook)  # after dropout has drawn its mask
            elif where == "backward":
                model[1].register_full_backward_pre_hook(hook)  # mid-backward: the last layer's gradients written
            else:
                opt.register_step_pre_hook(hook)
        torch.manual_seed(1)
        outs = [step(batch) for batch in data]
        runs.append((outs, [p.detach().clone() for p in model.parameters()], step))
    assert hook.fired == 1
    return runs


@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_oom_inside_the_users_loop_is_redone_at_half_the_micro_batch_with_the_same_losses(where):
    (ref, ref_w, _), (got, got_w, step) = _run_with_oom("cpu", where)
    assert got[0].oom_recoveries == 1 and step.oom_recoveries == 1 and step.micro_batch == 4
    assert [o.micro_batch for o in got] == [4, 4, 4, 4] and got[0].accumulation_steps == 2
    assert [o.loss for o in got] == [o.loss for o in ref]  # same dropout masks: RNG restored for the redo
    for a, b in zip(got_w, ref_w):
        assert torch.equal(a, b)
    assert "out of memory (OutOfMemoryError) at micro-batch 8" in step.events[0]


def _ddp_loop_rank(rank, port, out):
    """One rank of a user's DDP loop through TrainStep on gloo; rank 0 runs out of memory once,
    in its first forward. Saves what the rank's loop raised."""
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    model = _mlp()
    if rank == 0:
        model[3].register_forward_pre_hook(_OOMOnce(8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    step = tightfit.TrainStep(Plan("fp32", 8, 16), ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), loss=_ce)
    try:
        for s in range(2):
            step(_xy(16, seed=10 * rank + s))
        error = None
    except Exception as e:  # noqa: BLE001 - what the rank's loop would see
        error = f"{type(e).__name__}: {e}"
    torch.save({"error": error, "recoveries": step.oom_recoveries}, os.path.join(out, f"rank{rank}.pt"))
    os._exit(0)  # no barrier, no teardown: the other rank may be waiting in a collective


def test_an_oom_on_one_ddp_rank_is_not_redone_by_that_rank_alone(tmp_path):
    """DESIGN invariant 12 in a user's loop: under DDP every backward all-reduces with the other
    ranks, so a rank that redid an out-of-memory step alone at half the micro-batch ran more
    backwards than the others; its all-reduces paired with their next step's (gradients of other
    batches mixed in) until both waited in a collective for the process group's timeout. The rank
    that ran out of memory now stops at once with an error that says why (torchrun then stops the
    others), and redoes nothing."""
    import torch.multiprocessing as mp

    from distributed_worker import free_port

    ctx = mp.spawn(_ddp_loop_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(90)
        if p.is_alive():
            p.kill()
    rank0 = torch.load(tmp_path / "rank0.pt")
    assert rank0["recoveries"] == 0 and rank0["error"].startswith("TightfitError: out of memory (OutOfMemoryError) "
                                                                 "at micro-batch 8 on rank 0 of 2"), rank0
    assert "cannot redo the step with a smaller micro-batch alone" in rank0["error"]


def _resumable_run(tmp_path, cut_at=None):
    """5 steps of a dropout MLP through TrainStep, an OOM at step 1 (micro-batch 8 -> 4, grown back
    after 3 clean steps); with ``cut_at``, the loop saves its state after that step (the model's,
    the optimizer's and TrainStep's, with torch.save) and a new process's loop would load them
    into fresh objects and go on."""
    def fresh():
        model = _mlp(dropout=0.3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, opt, tightfit.TrainStep(Plan("fp32", 8, 8), model, opt, loss=_ce, grow_back_after=3)

    model, opt, step = fresh()
    hook = model[2].register_forward_pre_hook(_OOMOnce(8))
    torch.manual_seed(123)
    outs = []
    for s in range(5):
        if s == cut_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step.state_dict()},
                       tmp_path / "ckpt.pt")
            torch.manual_seed(999)  # what the interrupted process drew afterwards is lost
            model, opt, step = fresh()
            saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            step.load_state_dict(saved["step"])
        outs.append(step(_xy(8, s)))
    hook.remove()
    return [(o.loss, o.micro_batch) for o in outs], [p.detach().clone() for p in model.parameters()], step


def test_a_loop_resumed_from_train_steps_state_reproduces_the_uninterrupted_run(tmp_path):
    """DESIGN invariant 5 in a user's own loop: TrainStep.state_dict holds the micro-batch after an
    OOM recovery, the clean steps towards growing it back and the RNG states (dropout on), so a
    loop resumed from it loses nothing."""
    ref, ref_w, ref_step = _resumable_run(tmp_path)
    assert [mb for _, mb in ref] == [4, 4, 4, 8, 8]  # the OOM's micro-batch, grown back after 3 clean steps
    got, got_w, step = _resumable_run(tmp_path, cut_at=2)
    assert got == ref
    for a, b in zip(got_w, ref_w):
        assert torch.equal(a, b)
    assert step.summary() == ref_step.summary()


def test_train_step_refuses_another_plans_state_and_leaves_itself_as_it_was():
    step = tightfit.TrainStep(Plan("fp32", 8, 8), _mlp(), loss=_ce)
    other = tightfit.TrainStep(Plan("fp32", 4, 8), _mlp(), loss=_ce)
    with pytest.raises(TightfitError, match="saved under a plan of"):
        step.load_state_dict(other.state_dict())
    with pytest.raises(TightfitError, match="not a TrainStep's state"):
        step.load_state_dict({"micro_batch": 4})
    good = step.state_dict()
    rng_before = torch.get_rng_state()
    for broken in (dict(good, micro_batch=4, steps=7, rng={"python": good["rng"]["python"]}),  # RNG cut short
                   dict(good, micro_batch=4, steps="7"), dict(good, micro_batch=True)):
        with pytest.raises(TightfitError, match="not a TrainStep's state"):
            step.load_state_dict(broken)
        assert step.micro_batch == 8 and step.steps == 0  # nothing changed
        assert torch.equal(torch.get_rng_state(), rng_before)


def test_micro_batch_grows_back_after_clean_steps():
    model = _mlp()
    hook = _OOMOnce(8)
    model[2].register_forward_pre_hook(hook)
    step = tightfit.TrainStep(Plan("fp32", 8, 8), model, loss=_ce, grow_back_after=2)
    micro = [step(_xy(8, s)).micro_batch for s in range(4)]
    assert micro == [4, 4, 8, 8] and any("growing micro-batch back 4 -> 8" in e for e in step.events)


def test_oom_at_micro_batch_one_stops_with_advice():
    model = _mlp()
    model[0].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
    step = tightfit.TrainStep(Plan("fp32", 2, 2), model, loss=_ce)
    with pytest.raises(TightfitError, match="micro-batch of 1.*checkpointing"):
        step(_xy(2))


def test_non_finite_step_is_skipped_and_a_run_of_them_stops():
    model = _mlp()
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, max_skipped_steps=2,
                              loss=lambda m, b: _ce(m, b) * float("inf"))
    before = [p.detach().clone() for p in model.parameters()]
    out = step(_xy(8))
    assert not out.stepped and step.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # nothing applied
    with pytest.raises(NonFiniteTrainingError, match="2 steps in a row"):
        step(_xy(8))


@pytest.mark.parametrize("where", ["output", "gradient"])
def test_a_stop_on_non_finite_steps_names_where_they_first_appear(where):
    """DESIGN invariant 3: the stop names the first module producing non-finite values, as
    `tightfit train` does; the own loop said only "2 steps in a row". The diagnosis leaves the RNG
    states as it found them (dropout on)."""
    model = _mlp(dropout=0.1)
    if where == "output":
        model[2].register_forward_hook(lambda m, a, out: out * float("inf"))
    else:
        model[3].weight.register_hook(lambda g: g * float("nan"))
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, max_skipped_steps=2, loss=_ce)
    step(_xy(8))
    with pytest.raises(NonFiniteTrainingError) as e:
        step(_xy(8, seed=1))
    expected = "the output of module '2'" if where == "output" else "the gradient of '3.weight'"
    assert f"2 steps in a row had non-finite gradients; first non-finite values in {expected}" in str(e.value)
    assert all(p.grad is None for p in model.parameters())
    if where == "gradient":  # its train-mode pass draws dropout masks, and puts the RNG state back
        from tightfit.runtime.diagnose import first_nonfinite

        before = torch.random.get_rng_state()
        first_nonfinite(model, lambda: _ce(model, _xy(4)), contextlib.nullcontext, contextlib.nullcontext, False)
        assert torch.equal(torch.random.get_rng_state(), before)
        # ranks with batches of their own (DDP) run no backward that other ranks may not join
        backwards = []
        model[3].weight.register_hook(lambda g: backwards.append(1))
        where = first_nonfinite(model, lambda: _ce(model, _xy(4)), contextlib.nullcontext, contextlib.nullcontext,
                                False, backward=False)
        assert where == "the gradients (this rank's forward is finite)" and backwards == []


def test_a_stop_on_non_finite_steps_says_what_the_batch_itself_holds():
    """One NaN in the inputs was blamed on the first module's output with "try a lower learning
    rate" alone, though no update had been applied: the batch's own tensors are named beside the
    diagnosis (never in its place: a loss may mask missing values by design)."""
    x, y = _xy(8)
    x[3, 2] = float("nan")
    step = tightfit.TrainStep(Plan("fp32", 8, 8), _mlp(), max_skipped_steps=2, loss=_ce)
    step((x, y))
    with pytest.raises(NonFiniteTrainingError) as e:
        step((x, y))
    assert ("first non-finite values in the output of module '0'; the batch's tensor at position 0 holds NaN (sample 3 of the "
            "batch). If such values are not meant to be in the data, repair or drop those samples; otherwise: ") \
        in str(e.value)


def test_non_finite_data_named_by_its_own_row_and_only_in_tensors_of_one_row_per_sample():
    from tightfit.runtime.diagnose import nonfinite_input

    x = torch.zeros(4, 3)
    x[1, 0], x[2, 2] = float("inf"), float("nan")
    assert nonfinite_input({"x": x}, 4) == "the batch's 'x' holds inf (sample 1 of the batch)"
    assert nonfinite_input({"x": x}, 4, [10, 11, 12, 13]) == "the batch's 'x' holds inf (sample 11 of the data set)"
    bias = torch.zeros(9)
    bias[7] = float("-inf")  # a tensor shared by the samples (not one row each) is not read
    assert nonfinite_input({"bias": bias, "x": torch.zeros(4, 3)}, 4) is None


def test_data_a_loss_masks_by_design_does_not_hide_where_the_step_went_non_finite():
    """NaN targets a regression loss leaves out ("missing") were blamed for a stop whose cause was
    a weight gone to inf."""
    x = torch.randn(8, 6)
    target = torch.randn(8, 3)
    target[3, 1] = float("nan")

    def masked_mse(model, batch):
        out, t = model(batch[0]), batch[1]
        keep = torch.isfinite(t)
        return ((out - torch.nan_to_num(t)) ** 2)[keep].mean()

    model = _mlp()
    step = tightfit.TrainStep(Plan("fp32", 8, 8), model, max_skipped_steps=2, loss=masked_mse)
    for _ in range(3):
        assert step((x, target)).stepped
    with torch.no_grad():
        model[3].weight[0, 0] = float("inf")
    step((x, target))
    with pytest.raises(NonFiniteTrainingError) as e:
        step((x, target))
    assert "first non-finite values in the output of module '3'; the batch's tensor at position 1 holds NaN" in str(e.value)
    assert "otherwise: try a lower learning rate" in str(e.value)


class _AuxHead(torch.nn.Module):
    """Two heads in train mode, one in eval mode, as torchvision's Inception and GoogLeNet."""

    def __init__(self):
        super().__init__()
        self.body, self.main, self.aux = _mlp()[:2], torch.nn.Linear(16, 3), torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.body(x)
        return (self.main(h), self.aux(h)) if self.training else self.main(h)


def _aux_loss(model, batch):
    main, aux = model(batch[0])
    return torch.nn.functional.cross_entropy(main, batch[1]) + 0.4 * torch.nn.functional.cross_entropy(aux, batch[1])


def _penalty_loss(model, batch):  # a gradient penalty: the loss itself calls autograd
    x = batch[0].clone().requires_grad_(True)
    out = model(x)
    g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    return torch.nn.functional.cross_entropy(out, batch[1]) + ((g.norm(dim=1) - 1) ** 2).mean()


@pytest.mark.parametrize("case", ["aux-head", "gradient-penalty"])
def test_a_stop_on_non_finite_steps_diagnoses_the_step_as_it_trained(case):
    """The diagnosis ran an eval-mode forward without gradients: a model whose output differs in
    eval mode, or a loss that calls autograd, raised its own error there (a ValueError from
    unpacking one head), hiding the NonFiniteTrainingError a loop is told to catch."""
    model, loss = (_AuxHead(), _aux_loss) if case == "aux-head" else (_mlp(), _penalty_loss)
    layer = model.aux if case == "aux-head" else model[3]
    layer.register_forward_hook(lambda m, a, out: out * float("inf"))
    step = tightfit.TrainStep(Plan("fp32", 8, 8), model, max_skipped_steps=2, loss=loss)
    step(_xy(8))
    with pytest.raises(NonFiniteTrainingError) as e:
        step(_xy(8))
    name = "aux" if case == "aux-head" else "3"
    assert f"first non-finite values in the output of module {name!r}" in str(e.value)
    assert all(p.grad is None for p in model.parameters())


class _SqrtBlock(torch.nn.Module):
    """Finite forward, NaN gradient (d sqrt at 0), dropout on."""

    def __init__(self):
        super().__init__()
        self.lin, self.drop = torch.nn.Linear(6, 6), torch.nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(torch.relu(self.lin(x)))
        return x + h + torch.sqrt(h - h)


def test_the_diagnosis_recomputes_checkpointed_blocks_in_train_mode_too():
    """The diagnosis's backward ran after its train-mode context had ended: a model in eval mode
    (as from_pretrained returns it) with checkpointed blocks recomputed them in eval mode, and the
    stop said "a place not found (CheckpointError ...)" instead of the gradient."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([_SqrtBlock(), _SqrtBlock()])
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net().eval()
    step = tightfit.TrainStep(Plan("fp32", 8, 8, True), model, max_skipped_steps=1, loss=_ce)
    with pytest.raises(NonFiniteTrainingError, match=r"first non-finite values in the gradient of 'layers\.\d\.lin\."):
        step(_xy(8))


def test_a_diagnosis_that_fails_itself_still_raises_the_stop():
    """The stop's error is the one raised, whatever the forward run to locate it does."""
    calls = []

    def loss(model, batch):
        calls.append(1)
        if len(calls) > 2:  # the diagnosis's own forward
            raise ValueError("only in the diagnosis")
        return _ce(model, batch) * float("nan")

    step = tightfit.TrainStep(Plan("fp32", 8, 8), _mlp(), max_skipped_steps=2, loss=loss)
    step(_xy(8))
    with pytest.raises(NonFiniteTrainingError, match=r"in a place not found \(the forward and backward run to find "
                                                     r"it failed: ValueError: only in the diagnosis\)"):
        step(_xy(8))


def test_a_stop_on_a_loss_that_alone_is_not_finite_names_the_loss():
    """A loss of the user's own that is NaN while every module's output is finite was named as
    "the gradient of '0.weight' (backward overflow)", which points at the wrong cause."""
    step = tightfit.TrainStep(Plan("fp32", 4, 8), _mlp(), max_skipped_steps=1, loss=lambda m, b: _ce(m, b) * float("nan"))
    with pytest.raises(NonFiniteTrainingError, match=r"first non-finite values in the loss \(every module's output"):
        step(_xy(8))


def test_hugging_face_model_loss_by_default_dropout_on_and_mode_given_back():
    model = tiny_bert(dropout=0.1)
    model.eval()
    batch = SyntheticBatches(16).collate(list(range(16)))
    plan = tightfit.plan(model, batch, effective_batch=16)
    seen = []
    model.bert.encoder.layer[0].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    step = tightfit.TrainStep(Plan("fp32", 8, 16), model, lr=1e-3)
    out = step(batch)
    assert plan.micro_batch == 16 and out.accumulation_steps == 2 and math.isfinite(out.loss)
    assert seen == [True, True] and not model.training  # dropout on during the step; eval mode after


@pytest.mark.parametrize("batch, message", [
    ({"x": torch.zeros(4, 2), "labels": torch.zeros(3)}, "disagree on the number of samples"),
    ("text", "must be a dict or a tuple"),
    ((torch.zeros(4, 6), [1, 2, 3, 4]), "must be a tensor"),
])
def test_malformed_batches_are_refused_in_one_line(batch, message):
    with pytest.raises(TightfitError, match=message):
        tightfit.plan(_mlp(), batch, loss=_ce)


def test_bad_effective_batch_and_loss_are_refused():
    with pytest.raises(TightfitError, match="effective_batch"):
        tightfit.plan(_mlp(), _xy(4), effective_batch=0, loss=_ce)
    step = tightfit.TrainStep(Plan("fp32", 4, 4), _mlp(), loss=lambda m, b: m(b[0]))  # not one number
    with pytest.raises(TightfitError, match="one number"):
        step(_xy(4))
    with pytest.raises(TightfitError, match="tuple batch needs loss="):
        tightfit.TrainStep(Plan("fp32", 4, 4), _mlp())(_xy(4))


@pytest.mark.gpu
def test_gpu_planned_loop_recovers_an_injected_oom_with_the_same_losses():
    # the plan's probes on the GPU, then the user's loop: an OOM inside it is redone at half the micro-batch
    try:
        plan = tightfit.plan(_mlp(), _xy(8), effective_batch=8, budget="2GiB", loss=_ce)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the plan capped this process; the other tests run uncapped
    assert plan.device == "cuda" and plan.micro_batch == 8 and plan.probe_peak_reserved_bytes
    (ref, ref_w, _), (got, got_w, step) = _run_with_oom("cuda", "backward")
    assert got[0].oom_recoveries == 1 and step.micro_batch == 4
    torch.testing.assert_close([o.loss for o in got], [o.loss for o in ref], rtol=1e-6, atol=0)
    for a, b in zip(got_w, ref_w):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert got[0].peak_reserved_bytes and len(step.memory_timeline) == 4


# ---------------------------------------------------------------- what a new user of the own-loop API ran into
def _big_loss(model, batch):  # gradients far above norm 1, so clipping would show in the weights
    return _ce(model, batch) * 100


def test_gradients_are_not_clipped_unless_asked():
    ref_losses, ref = _plain_loop(_big_loss, 3, clip=None, opt=torch.optim.SGD, lr=1e-3)
    model = _mlp()
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, torch.optim.SGD(model.parameters(), lr=1e-3), loss=_big_loss)
    outs = [step(_xy(8)) for _ in range(3)]
    assert outs[0].grad_norm > 1.0
    torch.testing.assert_close([o.loss for o in outs], ref_losses, rtol=1e-5, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_max_grad_norm_clips_the_accumulated_gradient_before_the_step():
    # The mirror of the test above: with max_grad_norm, the optimizer steps on the whole batch's
    # gradient clipped to that norm (SGD, which unlike AdamW is not invariant to the gradient's
    # scale, so a missing clip moves the weights), and the norm reported is the one before clipping.
    ref_losses, ref = _plain_loop(_big_loss, 3, clip=0.5, opt=torch.optim.SGD, lr=1e-3)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = []  # the gradient norm the optimizer steps on
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(float(torch.nn.utils.get_total_norm(
        [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]))))
    step = tightfit.TrainStep(Plan("fp32", 3, 8), model, opt, loss=_big_loss, max_grad_norm=0.5)
    outs = [step(_xy(8)) for _ in range(3)]
    assert all(o.stepped and o.accumulation_steps == 3 for o in outs)
    assert all(o.grad_norm > 5 for o in outs)  # the norm before clipping, far above the limit
    assert seen == [pytest.approx(0.5, rel=1e-4)] * 3
    torch.testing.assert_close([o.loss for o in outs], ref_losses, rtol=1e-5, atol=0)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradients_left_between_two_calls_do_not_leak_into_the_next_step():
    """TrainStep zeroed the gradients when it was made and after each update, but not at a call's
    start: a backward of the caller's between two calls (a gradient-based metric) was added to the
    next step's gradient. Every window now starts from zero gradients, as in a run without it."""
    def run(stray):
        model = _mlp(dropout=0.2)
        step = tightfit.TrainStep(Plan("fp32", 4, 8), model, torch.optim.SGD(model.parameters(), lr=0.1), loss=_ce)
        outs = [step(_xy(8, seed=1))]
        if stray:
            rng = torch.get_rng_state()
            (model(_xy(8, seed=2)[0]).sum() * 100).backward()
            torch.set_rng_state(rng)  # the same dropout masks after it
        outs.append(step(_xy(8, seed=3)))
        return [o.grad_norm for o in outs], model

    ref_norms, ref = run(False)
    norms, model = run(True)
    assert norms == ref_norms
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def test_skipped_step_is_a_warning_on_the_tightfit_logger(caplog):
    # WARNING on "tightfit" (no handler of tightfit's own): Python's logging.lastResort shows it with no set-up
    # (an in-process command-line test earlier in the session may have added the command line's
    # own handler: what matters is that the library adds none)
    handlers = list(logging.getLogger("tightfit").handlers)
    step = tightfit.TrainStep(Plan("fp32", 4, 8), _mlp(), loss=lambda m, b: _ce(m, b) * float("inf"))
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        step(_xy(8))
    [record] = [r for r in caplog.records if "non-finite gradients" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.name == "tightfit"
    assert logging.getLogger("tightfit").handlers == handlers


def test_train_step_refuses_a_plan_for_another_device_before_any_work():
    with pytest.raises(TightfitError, match=r"^precision='bf16' needs a CUDA GPU"):
        tightfit.TrainStep(Plan("bf16", 4, 8), _mlp(), loss=_ce)
    with pytest.raises(TightfitError, match="the model's parameters are on meta"):
        tightfit.TrainStep(Plan("fp32", 4, 8), _mlp().to("meta"), loss=_ce)
    if not torch.cuda.is_available():
        with pytest.raises(TightfitError, match="no CUDA GPU is visible"):
            tightfit.TrainStep(Plan("fp32", 4, 8, device="cuda"), _mlp(), loss=_ce)


class _Noisy(torch.nn.Module):
    """Adds Gaussian noise in every forward, in train and eval mode alike (draws from torch's RNG)."""

    def forward(self, x):
        return x + 0.01 * torch.randn_like(x)


def test_cpu_plan_leaves_the_random_numbers_as_they_were():
    # the plan's loss check runs a forward that draws random numbers: the run after it must draw what it would have
    model, batch = torch.nn.Sequential(_Noisy(), _mlp()), _xy(8)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    tightfit.plan(model, batch, loss=_ce, device="cpu")
    assert torch.equal(torch.get_rng_state(), before)


def test_batch_larger_than_the_effective_batch_is_refused_a_smaller_last_one_runs():
    step = tightfit.TrainStep(Plan("fp32", 4, 8), _mlp(), loss=_ce)
    with pytest.raises(TightfitError, match="a batch of 12 samples is more than the plan's effective batch of 8"):
        step(_xy(12))
    assert step((_xy(5))).stepped and step.steps == 1
    with pytest.raises(TightfitError, match="empty"):
        step((torch.zeros(0, 6), torch.zeros(0, dtype=torch.long)))


def test_a_short_last_batch_is_divided_by_what_it_holds_not_the_planned_batch():
    # DESIGN invariant 1: a last batch of 5 under a plan of 8 (micro-batches 2 + 2 + 1) gives the mean
    # loss over its 5 samples and that loss's gradient (SGD: a gradient scaled by 5/8 would show in the
    # weights, where AdamW's update would hide it).
    x, y = _xy(5, seed=2)
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = _ce(ref, (x, y))
    loss.backward()
    opt.step()
    want = loss.item()
    model = _mlp()
    step = tightfit.TrainStep(Plan("fp32", 2, 8), model, torch.optim.SGD(model.parameters(), lr=0.1), loss=_ce)
    out = step((x, y))
    assert out.stepped and out.accumulation_steps == 3
    assert math.isclose(out.loss, want, rel_tol=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs, message", [
    ({"loss": lambda m, b: m(b[0])}, "one number"),
    ({"loss": _ce, "budget": "1KiB"}, r"budget 1.00 KiB is under the smallest budget of 1 MiB"),
    ({"loss": _ce, "budget": "64GiB", "gpu": "gtx-1650-ti"}, "more than the"),
    ({"loss": _ce, "budget": -1}, "must be positive"),
    ({"loss": _ce, "budget": "-1"}, "must be positive"),
    ({"loss": _ce, "budget": 4.5}, "fraction of a byte"),
    ({"loss": _ce, "precision": "fp8"}, r"^unknown precision='fp8'; use auto"),
    ({"loss": _ce, "precision": "bf16"}, r"^precision='bf16' needs a CUDA GPU"),
])
def test_cpu_plan_finds_at_plan_time_what_the_first_step_would(kwargs, message):
    with pytest.raises(TightfitError, match=message) as e:
        tightfit.plan(_mlp(), _xy(4), **kwargs, device="cpu")
    assert "--" not in str(e.value)  # the API's arguments, not the command line's flags


def test_errors_a_loop_catches_are_at_the_package_root_and_name_arguments():
    assert tightfit.NonFiniteTrainingError is NonFiniteTrainingError and tightfit.PartialUpdateError is PartialUpdateError
    step = tightfit.TrainStep(Plan("fp32", 4, 8), _mlp(), max_skipped_steps=1, loss=lambda m, b: _ce(m, b) * float("nan"))
    with pytest.raises(tightfit.NonFiniteTrainingError) as e:
        step(_xy(8))
    assert "--" not in str(e.value) and "learning rate" in str(e.value)
    light = subprocess.run([sys.executable, "-c", "import sys, tightfit; print('torch' in sys.modules)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert light.stdout.strip() == "False", light.stderr


class _DictOut(torch.nn.Module):
    """A model returning a plain dict with a "loss" key (as many non-Hugging Face models do)."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


def test_a_model_output_dict_with_a_loss_key_is_the_default_loss():
    x, y = _xy(8)
    model = _DictOut()
    plan = tightfit.plan(model, {"x": x, "labels": y}, device="cpu")
    out = tightfit.TrainStep(plan, model)({"x": x, "labels": y})
    assert out.stepped and math.isclose(out.loss, float(_ce(_mlp(), (x, y)).detach()), rel_tol=1e-5)


def test_cpu_plans_loss_check_leaves_batch_norm_statistics_as_they_were():
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tightfit.plan(model, _xy(8), loss=_ce, device="cpu")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and model.training


@pytest.mark.parametrize("case", ["aux-head", "gradient-penalty"])
def test_cpu_plan_checks_the_loss_as_a_training_step_runs_it(case):
    """The check ran the loss in eval mode without gradients: a model with auxiliary heads in train
    mode (unpacking one head raised) or a loss that calls autograd was refused, though TrainStep
    trains both. The check leaves the RNG states and the modules' modes as they were."""
    model, loss = (_AuxHead(), _aux_loss) if case == "aux-head" else (torch.nn.Sequential(_mlp(dropout=0.2)),
                                                                      _penalty_loss)
    model.eval()
    torch.manual_seed(5)
    before = torch.get_rng_state()
    plan = tightfit.plan(model, _xy(8), loss=loss, device="cpu")
    assert torch.equal(torch.get_rng_state(), before) and not any(m.training for m in model.modules())
    assert tightfit.TrainStep(plan, model, loss=loss)(_xy(8)).stepped


def test_cpu_plans_check_names_what_it_ran_under_the_losss_own_error():
    """A loss over groups of 4 samples cannot take the micro-batches a step may split a batch into;
    its own error is raised, with a note saying what the check ran."""
    def grouped(model, batch):
        return model(batch[0]).view(-1, 4, 3).mean(1).sum()

    with pytest.raises(RuntimeError, match="invalid") as e:
        tightfit.plan(_mlp(), _xy(8), loss=grouped, device="cpu")
    if sys.version_info >= (3, 11):
        assert "micro-batches of any size" in "".join(e.value.__notes__)


def test_a_plan_that_leaves_batch_norm_one_sample_is_refused_at_plan_time():
    """A BatchNorm model planned at an effective batch of 1 got a plan whose every step failed;
    one in eval mode trains on one sample and is planned."""
    x, y = _xy(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    with pytest.raises(TightfitError, match=r"effective_batch=1, split as 1 x 1, gives the model's BatchNorm layers a "
                                            r"micro-batch of 1 sample"):
        tightfit.plan(model, (x, y), loss=_ce, device="cpu")
    with pytest.raises(TightfitError, match="micro-batch of 1 sample"):  # in eval mode, as from_pretrained gives it
        tightfit.plan(model.eval(), (x, y), loss=_ce, device="cpu")  # its step trains every module
    model.train()
    model[1].eval()  # frozen statistics, inside a model in train mode: kept so by the step
    plan = tightfit.plan(model, (x, y), loss=_ce, device="cpu")
    assert tightfit.TrainStep(plan, model, loss=_ce)((x, y)).stepped
    # BatchNorm2d normalises an image's many values per channel: one sample trains
    cnn = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(3))
    images = (torch.randn(1, 3, 8, 8), torch.zeros(1, dtype=torch.long))
    plan = tightfit.plan(cnn, images, loss=_ce, device="cpu")
    assert plan.micro_batch == 1 and tightfit.TrainStep(plan, cnn, loss=_ce)(images).stepped


def test_a_lazy_models_budget_is_checked_after_the_forward_that_sizes_it():
    model = torch.nn.Sequential(torch.nn.LazyLinear(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    plan = tightfit.plan(model, _xy(8), loss=_ce, budget="4GiB", device="cpu")
    assert plan.trainable_params == 6 * 16 + 16 + 16 * 3 + 3


@pytest.mark.parametrize("micro_batch", [4, 2])
def test_a_token_mean_loss_split_into_micro_batches_keeps_the_whole_batch_gradient(micro_batch):
    """A causal LM's own loss (``model(**batch).loss``) is a mean over its target tokens; micro-batches
    with different padding hold different token counts, so weighting them by samples would change
    the objective (DESIGN invariant 1: normalised by the whole batch's target tokens)."""
    from conftest import tiny_gpt2

    torch.manual_seed(0)
    ids = torch.randint(0, 50, (8, 32))
    mask = torch.ones(8, 32, dtype=torch.long)
    mask[:4, 4:] = 0  # the first half padded after 4 tokens: their micro-batches hold fewer targets
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    results = {}
    for mb in (8, micro_batch):
        model = tiny_gpt2(dropout=0.0)
        step = tightfit.TrainStep(Plan("fp32", mb, 8), model, torch.optim.SGD(model.parameters(), lr=0.1))
        out = step(batch)
        results[mb] = (out.loss, out.grad_norm, [p.detach().clone() for p in model.parameters()])
    (loss, norm, weights), (loss_m, norm_m, weights_m) = results[8], results[micro_batch]
    assert loss_m == pytest.approx(loss, rel=1e-5) and norm_m == pytest.approx(norm, rel=1e-4)
    for a, b in zip(weights, weights_m):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_second_plan_without_checkpointing_turns_the_first_plans_off():
    # one model, two plans in turn (e.g. after a budget change): the step runs the plan it is given
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.checkpointing import hf_hook_active

    model, batch = tiny_bert(), SyntheticBatches(8).worst_case(8)
    tightfit.TrainStep(tightfit.plan(model, batch, checkpointing="on"), model)
    assert hf_hook_active(model)
    off = tightfit.plan(model, batch, checkpointing="off")
    assert not off.activation_checkpointing
    step = tightfit.TrainStep(off, model)
    assert not hf_hook_active(model) and not any(hasattr(b, "_tightfit_forward") for b in find_blocks(model))
    assert math.isfinite(step(batch).loss)


def test_a_later_plan_without_checkpointing_gives_back_the_models_kv_cache():
    """A plan with activation checkpointing turns a Hugging Face model's KV cache off
    (``config.use_cache``); a later plan without it turned checkpointing off and left the cache
    off for good, so ``generate()`` afterwards ran without it. The user's setting now comes back."""
    from conftest import LMBatches, tiny_gpt2

    model, batch = tiny_gpt2(dropout=0.0), LMBatches(8).worst_case(8)
    assert model.config.use_cache is True
    tightfit.TrainStep(tightfit.plan(model, batch, checkpointing="on"), model)
    assert model.config.use_cache is False  # off while the plan recomputes
    tightfit.TrainStep(tightfit.plan(model, batch, checkpointing="off"), model)
    assert model.config.use_cache is True
    model.config.use_cache = False  # yours: kept through checkpointing on and off
    tightfit.TrainStep(tightfit.plan(model, batch, checkpointing="on"), model)
    tightfit.TrainStep(tightfit.plan(model, batch, checkpointing="off"), model)
    assert model.config.use_cache is False


def test_your_own_checkpointing_turned_off_by_a_plan_without_it_is_said(caplog):
    """A model whose checkpointing you turned on yourself, planned with checkpointing="auto": the
    plan has none, and TrainStep turned the model's hook off without a word (more memory per step
    than the model ran with). It still runs the plan, and now says so, naming how to keep it."""
    from tightfit.levers.checkpointing import hf_hook_active

    model, batch = tiny_bert(), SyntheticBatches(8).worst_case(8)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plan = tightfit.plan(model, batch)
    assert not plan.activation_checkpointing
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        step = tightfit.TrainStep(plan, model)
    assert not hf_hook_active(model)
    assert len(step.events) == 1 and "activation checkpointing" in step.events[0], step.events
    assert "checkpointing='on'" in step.events[0] and step.events[0] in caplog.text
    assert tightfit.TrainStep(plan, model).events == []  # nothing to say when it is off already


def test_the_gpu_planners_probes_leave_your_checkpointing_as_it_was(monkeypatch):
    """On a GPU the planner's probes try plans without and with activation checkpointing on the
    model itself, and then turned it off whatever the model had: a model that came to
    tightfit.plan with your gradient_checkpointing_enable() came back without it, whether the plan
    checkpoints (until a TrainStep applies it) or nothing fit at all. The probes (stood in for here:
    a micro-batch fits with checkpointing only) now leave it as it was: the same checkpoint function
    (here reentrant) in every layer, and the KV cache setting as you had it. TrainStep applies the
    plan's, and says so where that turns yours off (as on the CPU, where no probe runs:
    test_your_own_checkpointing_turned_off_by_a_plan_without_it_is_said)."""
    import tightfit.planner.probe as probe
    from conftest import LMBatches, tiny_gpt2
    from tightfit.devices import get_profile
    from tightfit.levers.checkpointing import checkpointing_active, hf_hook_active
    from tightfit.planner.search import NothingFitsError
    from tightfit.workload import Workload

    seen = []

    def largest(workload, precision, budget_bytes, upper, optimizer="adamw"):
        seen.append(checkpointing_active(workload.model))
        return probe.ProbeResult(upper, True, 1 << 20, 1 << 20) if seen[-1] else None

    model = tiny_gpt2(dropout=0.0)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})

    def checkpoint_functions():
        return {n: m._gradient_checkpointing_func for n, m in model.named_modules()
                if getattr(m, "gradient_checkpointing", 0)}

    yours = checkpoint_functions()
    assert yours and model.config.use_cache is True
    w = Workload(model, LMBatches(8), None, 8)
    monkeypatch.setattr(probe, "largest_micro_batch", largest)
    plan = probe.plan_first(w, "cuda", get_profile("h100"), 1 << 30)
    assert plan.activation_checkpointing and seen[:2] == [False, True]
    assert hf_hook_active(model) and checkpoint_functions() == yours and model.config.use_cache is True
    monkeypatch.setattr(probe, "largest_micro_batch", lambda *a, **k: None)
    with pytest.raises(NothingFitsError):
        probe.plan_first(w, "cuda", get_profile("h100"), 1 << 30)
    assert hf_hook_active(model) and checkpoint_functions() == yours and model.config.use_cache is True


@pytest.mark.parametrize("micro_batch", [4, 1])
def test_class_labels_of_minus_100_are_left_out_of_the_mean_at_every_split(micro_batch):
    """A classifier's own loss (``BertForSequenceClassification``: cross-entropy skipping label -100)
    is the mean over the labelled samples; weighted by all of a micro-batch's samples, a micro-batch
    of 4 with one labelled sample counted it 4 times (weights off by 0.22 after one SGD step) and a
    micro-batch with none made the loss NaN. Each split now gives the whole batch's step (DESIGN
    invariant 1), the model's own loss on the whole batch."""
    from transformers import BertConfig, BertForSequenceClassification

    def model():
        torch.manual_seed(0)
        return BertForSequenceClassification(BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))

    torch.manual_seed(1)
    ids = torch.randint(0, 100, (8, 6))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.tensor([0, 1, 2, 1, -100, -100, -100, 2])}  # the second half: 1 labelled of 4
    reference = model()
    whole = reference(**batch).loss
    whole.backward()
    with torch.no_grad():
        expected = [p - p.grad for p in reference.parameters()]
    m = model()
    out = tightfit.TrainStep(Plan("fp32", micro_batch, 8), m, torch.optim.SGD(m.parameters(), lr=1.0))(batch)
    assert out.loss == pytest.approx(float(whole), rel=1e-5)
    for a, b in zip(m.parameters(), expected):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)


def test_a_batch_without_any_target_leaves_the_model_and_the_optimizer_as_they_were():
    """A causal LM's batch whose every label is -100 (prompts only) has nothing to learn from: its
    update of zero gradients still moved 15 of a tiny GPT-2's 28 tensors (AdamW's weight decay)
    and counted a step in AdamW's bias correction. It is now no update, said so."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32))
    ids = torch.randint(0, 100, (4, 8))
    step = tightfit.TrainStep(Plan("fp32", 4, 4), model, lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    out = step({"input_ids": ids, "labels": torch.full_like(ids, -100)})
    assert not out.stepped and out.loss == 0.0 and "nothing to learn" in step.events[-1]
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not step.optimizer.state
    assert step(({"input_ids": ids, "labels": ids})).stepped  # a batch with targets steps as before


def test_train_steps_state_carries_the_fp16_loss_scale_back(monkeypatch):
    # DESIGN invariant 5 for the loss scaler of TrainStep's own state: a skipped fp16 step backs the
    # scale off (65536 -> 32768), and a TrainStep given that state goes on from 32768. fp16 is CUDA-only
    # for TrainStep; the device check is lifted so that the CPU's GradScaler (which the runtime's fp16
    # tests use) runs the same code.
    import tightfit.loop as loop

    monkeypatch.setattr(loop, "_check_device", lambda plan, model: torch.device("cpu"))

    def fresh():
        model = _mlp(dropout=0.3)
        return model, tightfit.TrainStep(Plan("fp16", 4, 8, device="cpu"), model,
                                         torch.optim.AdamW(model.parameters(), lr=1e-2), loss=_ce)

    model, step = fresh()
    assert step.scaler.is_enabled() and step.scaler.get_scale() == 65536.0
    hook = model[0].weight.register_hook(lambda g: g * math.inf)
    assert not step(_xy(8)).stepped  # non-finite: skipped, the scale halved
    hook.remove()
    assert step(_xy(8, 1)).stepped
    state = step.state_dict()
    assert step.scaler.get_scale() == 32768.0
    _, resumed = fresh()
    resumed.load_state_dict(state)
    assert resumed.scaler.get_scale() == 32768.0
    assert resumed.scaler.state_dict() == step.scaler.state_dict()


def test_an_fp16_oom_inside_the_optimizer_step_is_redone_as_at_half_the_micro_batch(monkeypatch):
    # As tests/test_runtime.py's test of the runtime: the failed attempt had called the scaler's unscale_
    # when the OOM came inside the optimizer step; the redo must unscale again (the scaler's per-step
    # record reset) and end as a loop at micro-batch 4 from the start. fp16 is CUDA-only for TrainStep: the
    # device check is lifted so that the CPU's GradScaler runs the same code.
    import tightfit.loop as loop

    monkeypatch.setattr(loop, "_check_device", lambda plan, model: torch.device("cpu"))

    def run(micro_batch, oom):
        model = _mlp(dropout=0.3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = tightfit.TrainStep(Plan("fp16", micro_batch, 8, device="cpu"), model, opt, loss=_ce, grow_back_after=0)
        if oom:
            opt.register_step_pre_hook(_OOMOnce())
        torch.manual_seed(5)
        outs = [step(_xy(8, s)) for s in range(3)]
        return outs, model, step

    ref_outs, ref, ref_step = run(4, False)
    outs, model, step = run(8, True)
    assert outs[0].oom_recoveries == 1 and [o.micro_batch for o in outs] == [4, 4, 4]
    assert [o.loss for o in outs] == [o.loss for o in ref_outs] and all(o.stepped for o in outs)
    assert step.scaler.state_dict() == ref_step.scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_a_batch_with_label_and_no_labels_is_told_to_rename_the_key():
    """A Hugging Face model computes its loss from ``labels``; a batch holding a dataset's ``label``
    column (which the Trainer's collator renames, a batch of yours does not) has no loss, and the
    message said only "give loss=": it now names the key."""
    model = tiny_bert()
    batch = SyntheticBatches(8).worst_case(8)
    batch["label"] = batch.pop("labels")
    with pytest.raises(TightfitError, match="it has 'label' and no 'labels'.*rename 'label' to 'labels', or give loss="):
        tightfit.plan(model, batch, effective_batch=8, device="cpu")
    with pytest.raises(TightfitError) as e:  # without a label key, nothing to point at
        tightfit.TrainStep(Plan("fp32", 8, 8), model, lr=1e-3)({k: v for k, v in batch.items() if k != "label"})
    assert "no .loss" in str(e.value) and "rename" not in str(e.value)


def test_a_loop_with_the_optimizer_train_step_made_resumes_exactly_from_its_state(tmp_path):
    """DESIGN invariant 5 for ``TrainStep(plan, model)`` without an optimizer of yours: the loop has
    no optimizer whose state dict it could save, so TrainStep's state holds that of the AdamW it
    made. It held none: the resumed run started AdamW's moments and step count again and its
    weights differed by ~1e-2 from the uninterrupted run's; now they are identical. A state of the
    one kind is refused by a TrainStep of the other, nothing changed."""
    batches = [_xy(8, s) for s in range(4)]

    def fresh():
        model = _mlp(dropout=0.3)
        return model, tightfit.TrainStep(Plan("fp32", 4, 8), model, loss=_ce, lr=1e-2)

    model, step = fresh()
    torch.manual_seed(7)
    ref = [step(b).loss for b in batches]
    ref_w = [p.detach().clone() for p in model.parameters()]
    model, step = fresh()
    torch.manual_seed(7)
    got = [step(b).loss for b in batches[:2]]
    torch.save({"model": model.state_dict(), "step": step.state_dict()}, tmp_path / "ckpt.pt")
    torch.manual_seed(999)
    model, step = fresh()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model.load_state_dict(saved["model"])
    step.load_state_dict(saved["step"])
    got += [step(b).loss for b in batches[2:]]
    assert got == ref
    assert all(torch.equal(a, p) for a, p in zip(ref_w, model.parameters()))

    mine = _mlp()
    yours = tightfit.TrainStep(Plan("fp32", 4, 8), mine, torch.optim.AdamW(mine.parameters()), loss=_ce)
    rng = torch.get_rng_state()
    with pytest.raises(TightfitError, match="the optimizer TrainStep made"):
        yours.load_state_dict(saved["step"])
    with pytest.raises(TightfitError, match="holds no optimizer state"):
        fresh()[1].load_state_dict(yours.state_dict())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_tokenizers_batch_encoding_with_labels_takes_the_models_own_loss():
    """A tokenizer's output is a ``BatchEncoding`` (a ``UserDict``, not a ``dict``): given with
    ``labels`` and no ``loss=``, ``plan`` and ``TrainStep`` refused it as "a tuple batch needs
    loss=". It now trains as the same batch given as a dict does (dropout on)."""
    from transformers import BatchEncoding

    batch = SyntheticBatches(8).worst_case(8)
    tightfit.plan(tiny_bert(), BatchEncoding(batch), effective_batch=8, device="cpu")
    outs, weights = [], []
    for given in (batch, BatchEncoding(batch)):
        model = tiny_bert(dropout=0.1)
        step = tightfit.TrainStep(Plan("fp32", 3, 8), model, lr=1e-3)
        torch.manual_seed(0)
        outs.append(step(given).loss)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert outs[0] == outs[1]
    assert all(torch.equal(a, b) for a, b in zip(*weights))


def test_a_train_step_refused_for_its_optimizer_leaves_the_models_checkpointing_as_it_was():
    """``TrainStep`` turned the plan's activation checkpointing on (the KV cache off) before it made
    the plan's optimizer, so one refused there (``adamw-offload`` without CUDA) left the model
    checkpointing: half done. The optimizer is now made first."""
    from tightfit.levers.checkpointing import checkpointing_active

    model = tiny_bert()
    with pytest.raises(TightfitError, match="adamw-offload needs a CUDA GPU"):
        tightfit.TrainStep(Plan("fp32", 4, 8, optimizer="adamw-offload", activation_checkpointing=True), model)
    assert not checkpointing_active(model)


def test_a_plan_for_half_precision_weights_says_they_stay_so(caplog):
    """A model loaded in fp16 got an "fp32" plan without a word and trained its fp16 weights,
    whose small updates are lost; the plan now says so (and logs it)."""
    model = _mlp().to(torch.bfloat16)
    x, y = _xy(8)
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        plan = tightfit.plan(model, (x.bfloat16(), y), loss=_ce, device="cpu")
    assert any("trainable weights are bfloat16: the plan leaves them so" in r for r in plan.reasons)
    assert "load the model in fp32" in caplog.text
    assert not any("trainable weights" in r for r in tightfit.plan(_mlp(), (x, y), loss=_ce, device="cpu").reasons)


def test_a_stop_after_a_blown_up_update_names_that_update():
    """After a learning rate that blew the weights up (step 2 applied, every step after it
    non-finite), the stop said only "try a lower learning rate", and last_update was None: the
    weights at the stop are that update's, and a lower rate alone will not bring them back."""
    model = _mlp()
    step = tightfit.TrainStep(Plan("fp32", 8, 8), model, torch.optim.SGD(model.parameters(), lr=0.1),
                              max_skipped_steps=2, loss=_ce)
    assert step(_xy(8)).stepped
    assert step(_xy(8)).stepped
    with torch.no_grad():
        model[3].weight.fill_(float("inf"))  # as a blown-up update leaves them
    step(_xy(8))
    with pytest.raises(NonFiniteTrainingError) as e:
        step(_xy(8))
    assert e.value.last_update == 2
    assert "The last update applied was step 2's (the weights are its weights): if it spoiled them, a lower " \
           "learning rate alone will not help; restore the weights from before it." in str(e.value)


def test_batches_smaller_than_the_effective_batch_in_a_row_are_said_once():
    """A loader whose batch_size is the micro-batch makes every step's effective batch that size,
    silently (a fresh user's loop of 16-sample batches under a plan of 64 took 8 steps of 16).
    Only an epoch's last batch may be short: one short batch between full ones says nothing."""
    step = tightfit.TrainStep(Plan("fp32", 16, 64), _mlp(), loss=_ce)
    sizes = [64, 40, 64, 16, 16, 16]
    said = []
    for i, n in enumerate(sizes):
        out = step(_xy(n, i))
        said.append(sum("a second batch in a row of fewer samples" in e for e in step.events))
        assert out.micro_batch == min(16, n)
    assert said == [0, 0, 0, 0, 1, 1]
    assert "give each step 64 samples" in [e for e in step.events if "in a row" in e][0]
    # a data set smaller than the effective batch: every step is short, and the advice names the plan too
    assert "or plan for the batch you give" in [e for e in step.events if "in a row" in e][0]


def test_a_step_on_a_batch_under_the_micro_batch_says_the_pass_it_ran():
    """StepOutcome.micro_batch is the samples per forward pass: a 16-sample batch under a plan of
    64 runs one pass of 16 (it said 64)."""
    passes = []
    model = _mlp()
    model[0].register_forward_pre_hook(lambda m, a: passes.append(a[0].shape[0]))
    out = tightfit.TrainStep(Plan("fp32", 64, 64), model, loss=_ce)(_xy(16))
    assert (out.micro_batch, out.accumulation_steps, passes) == (16, 1, [16])


def test_a_loss_of_ones_own_over_token_labels_with_ignored_targets_is_said_once():
    """loss= is weighed by samples across micro-batches: a token-mean loss with -100 labels then
    differs from one batch (a fresh user's GPT-2 run moved its weights by 0.02, unsaid). Without
    -100, or without accumulation, nothing is said."""
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)

        def forward(self, input_ids):
            return self.emb(input_ids)

    def token_mean(m, b):
        return torch.nn.functional.cross_entropy(m(b["input_ids"]).flatten(0, 1), b["labels"].flatten(), ignore_index=-100)

    def batch(ignored):
        labels = torch.arange(32).reshape(8, 4) % 4
        if ignored:
            labels[:3, 2:] = -100
        return {"input_ids": torch.arange(32).reshape(8, 4) % 10, "labels": labels}

    torch.manual_seed(0)
    for plan, ignored, said in ((Plan("fp32", 4, 8), False, 0), (Plan("fp32", 8, 8), True, 0), (Plan("fp32", 4, 8), True, 1)):
        step = tightfit.TrainStep(plan, Tokens(), loss=token_mean)
        step(batch(ignored))
        step(batch(ignored))
        assert sum("weighed across the micro-batches by their samples" in e for e in step.events) == said, plan
