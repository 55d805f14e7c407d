"""Runtime invariants on the CPU with a tiny BERT: accumulation equals one big batch, the last
short window is normalised by what it holds, OOM recovery keeps the run identical to one that
used the smaller micro-batch from the start, and non-finite steps are skipped and diagnosed."""

import math
import types

import pytest
import torch
import torch.nn.functional as F

from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.runtime.trainer import NonFiniteTrainingError, TrainConfig, Trainer, windows_of


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _reference_grads(workload, window):
    """Gradient of the mean loss of one batch made of the window's samples."""
    model = workload.model
    model.zero_grad(set_to_none=True)
    batch = workload.train.collate(window)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    F.cross_entropy(logits, batch["labels"]).backward()
    g = _grads(model)
    model.zero_grad(set_to_none=True)
    return g


@pytest.mark.parametrize("window_size,micro_batch", [(10, 3), (10, 10), (4, 3), (7, 1)])
def test_accumulated_gradient_equals_one_big_batch(make_workload, window_size, micro_batch):
    w = make_workload(effective_batch=10)
    window = list(range(5, 5 + window_size))  # window_size < 10: a last, short window
    ref = _reference_grads(w, window)
    t = Trainer(w, Plan("fp32", micro_batch, 10), TrainConfig(max_grad_norm=None), progress=False)
    t._forward_backward(window)
    got = _grads(w.model)
    assert got.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_windows_cover_every_sample_once():
    order = list(range(20))
    ws = windows_of(order, 8)
    assert [len(x) for x in ws] == [8, 8, 4]
    assert sorted(i for x in ws for i in x) == order


def _train(workload, micro_batch, cfg=None, setup=None):
    t = Trainer(workload, Plan("fp32", micro_batch, workload.effective_batch),
                cfg or TrainConfig(epochs=1, lr=1e-3, seed=3, grow_back_after=0), progress=False)
    if setup:
        setup(t)
    torch.manual_seed(11)
    res = t.fit()
    return t, res


def test_last_short_window_is_stepped(make_workload):
    w = make_workload(n=20, effective_batch=8)
    t, res = _train(w, 3)
    assert res.steps == 3 and res.samples == 20


class _InjectOOM:
    """Raise a CUDA-style OOM the first time ``when(t)`` holds."""

    def __init__(self, trainer, when):
        self.trainer, self.when, self.fired = trainer, when, 0

    def __call__(self, *args, **kwargs):
        if not self.fired and self.when(self.trainer):
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_oom_recovery_equals_smaller_micro_batch_from_start(make_workload, where):
    # Dropout on: the redo must draw the same masks as a run that used micro-batch 4 throughout.
    ref_t, ref = _train(make_workload(n=24, effective_batch=8, dropout=0.1), 4)

    def setup(t):
        inject = _InjectOOM(t, lambda tr: tr.step == 0 and (where == "optimizer" or tr.micro_batch == 8))
        layer = t.model.bert.encoder.layer[1]
        if where == "forward":
            layer.register_forward_pre_hook(inject)
        elif where == "backward":
            layer.register_full_backward_hook(inject)
        else:
            t.optimizer.register_step_pre_hook(inject)
        t._inject = inject

    t, res = _train(make_workload(n=24, effective_batch=8, dropout=0.1), 8, setup=setup)
    assert t._inject.fired == 1 and res.oom_recoveries == 1
    assert t.micro_batch == 4 and res.steps == ref.steps == 3 and res.samples == 24
    assert t.scheduler.last_epoch == ref_t.scheduler.last_epoch
    for (n, a), (_, b) in zip(t.model.named_parameters(), ref_t.model.named_parameters()):
        assert torch.equal(a, b), n


def test_an_fp16_oom_inside_the_optimizer_step_is_redone_after_the_scaler_forgets_its_unscale(make_workload):
    # DESIGN invariants 2 and 3 together: with fp16 the failed attempt had already called the scaler's
    # unscale_ when the OOM came (inside the optimizer step); the redo unscales its own gradients once
    # more, which torch refuses unless the scaler's per-step record was reset, and must end as a run that
    # used micro-batch 4 from the start (dropout on: same masks).
    def run(micro_batch, inject):
        w = make_workload(n=24, effective_batch=8, dropout=0.1)
        t = Trainer(w, Plan("fp16", micro_batch, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, grow_back_after=0),
                    progress=False)
        if inject:
            t._inject = _InjectOOM(t, lambda tr: tr.step == 0)
            t.optimizer.register_step_pre_hook(t._inject)
        torch.manual_seed(11)
        return t, t.fit()

    ref_t, ref = run(4, False)
    t, res = run(8, True)
    assert t._inject.fired == 1 and res.oom_recoveries == 1 and t.micro_batch == 4
    assert res.steps == ref.steps == 3 and res.skipped_steps == ref.skipped_steps == 0
    assert t.scaler.state_dict() == ref_t.scaler.state_dict()
    for (n, a), (_, b) in zip(t.model.named_parameters(), ref_t.model.named_parameters()):
        assert torch.equal(a, b), n


def test_non_oom_error_propagates_unchanged(make_workload):
    w = make_workload()
    boom = ValueError("not a memory problem")

    def setup(t):
        def hook(*a):
            raise boom
        t.model.bert.encoder.layer[0].register_forward_pre_hook(hook)

    with pytest.raises(ValueError) as e:
        _train(w, 4, setup=setup)
    assert e.value is boom


@pytest.mark.parametrize("boom", [RuntimeError("CUDA error: an illegal memory access was encountered"),
                                  RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x32 and 16x2)")],
                         ids=["memory-access", "shapes"])
def test_a_runtime_error_that_is_no_oom_propagates_at_once_and_is_not_redone(make_workload, boom):
    # The test above raises a ValueError, which no handler of RuntimeErrors would take; out-of-memory
    # errors are RuntimeErrors too, so the guard must tell them apart by type and message (DESIGN
    # invariant 2), not redo every RuntimeError with a smaller micro-batch.
    w = make_workload()
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False)
    calls = []

    def hook(*a):
        calls.append(a[1][0].shape[0])
        raise boom
    t.model.bert.encoder.layer[0].register_forward_pre_hook(hook)
    with pytest.raises(RuntimeError) as e:
        t.train_step(list(range(8)))
    assert e.value is boom
    assert calls == [4] and t.micro_batch == 4 and t.result.oom_recoveries == 0 and not t.result.events


def test_oom_at_micro_batch_one_stops_with_advice(make_workload):
    def setup(t):
        def hook(*a):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        t.model.bert.encoder.layer[0].register_forward_pre_hook(hook)

    with pytest.raises(TightfitError, match="micro-batch of 1.*checkpointing"):
        _train(make_workload(), 2, setup=setup)


def test_grow_back_after_clean_steps(make_workload):
    w = make_workload(n=48, effective_batch=8)
    cfg = TrainConfig(epochs=1, lr=1e-3, grow_back_after=2)

    def setup(t):
        t._inject = _InjectOOM(t, lambda tr: tr.step == 0 and tr.micro_batch == 8)
        t.model.bert.encoder.layer[1].register_forward_pre_hook(t._inject)

    t, res = _train(w, 8, cfg=cfg, setup=setup)
    assert res.oom_recoveries == 1 and t.micro_batch == 8
    assert any("growing micro-batch back 4 -> 8" in e for e in res.events)


def test_nonfinite_gradient_is_skipped_and_weights_unchanged(make_workload):
    w = make_workload(n=16, effective_batch=8)

    calls = []

    def setup(t):
        def poison(grad):  # only the first window's gradient is non-finite
            calls.append(1)
            return grad * math.inf if len(calls) == 1 else grad
        t.model.classifier.weight.register_hook(poison)

    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)
    setup(t)
    window = list(range(8))
    loss, stepped = t.train_step(window)
    assert not stepped and t.result.skipped_steps == 1
    # which step was skipped is in the report's events (it was in the count alone)
    assert t.result.events == ["step 1: non-finite gradients, update skipped"]
    for n, p in w.model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(p.grad is None for p in w.model.parameters())  # zeroed for the next window
    loss, stepped = t.train_step(window)
    assert stepped and t.result.skipped_steps == 1


def test_run_of_nonfinite_steps_names_the_module(make_workload):
    w = make_workload(n=32, effective_batch=8)

    def blow_up(module, inputs, output):
        return output * math.inf

    w.model.bert.encoder.layer[1].output.dense.register_forward_hook(blow_up)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=2, lr=1e-3, max_skipped_steps=3), progress=False)
    with pytest.raises(NonFiniteTrainingError, match=r"bert\.encoder\.layer\.1\.output\.dense"):
        t.fit()
    assert t.result.skipped_steps == 3


def test_frozen_parameters_get_no_state_and_stay_identical(make_workload):
    w = make_workload(n=16, effective_batch=8)
    emb = w.model.bert.embeddings
    for p in emb.parameters():
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in emb.named_parameters()}
    t, _ = _train(w, 4)
    state_params = set(t.optimizer.state.keys())
    assert not any(p in state_params for p in emb.parameters())
    for n, p in emb.named_parameters():
        assert torch.equal(p, before[n]), n


def test_evaluate_returns_accuracy(make_workload):
    w = make_workload()
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(), progress=False)
    r = t.evaluate()
    batch = w.eval.collate(list(range(len(w.eval))))
    with torch.no_grad():
        pred = w.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(-1)
    assert r["accuracy"] == pytest.approx((pred == batch["labels"]).float().mean().item())
    assert r["samples"] == 8


def test_evaluation_batch_halves_on_oom(make_workload):
    w = make_workload()
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(), progress=False)
    ref = t.evaluate()
    calls = []

    def hook(module, args):
        calls.append(args[0].shape[0])
        if args[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    h = w.model.bert.embeddings.word_embeddings.register_forward_pre_hook(hook)
    r = t.evaluate()
    h.remove()
    assert r["eval_batch"] == 2 and calls[:2] == [8, 4]  # 2 x micro-batch 4, then halved twice
    assert r["accuracy"] == ref["accuracy"] and r["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert t.micro_batch == 4  # the training micro-batch is independent


def test_fp16_unscales_once_before_clipping_and_skipped_step_updates_the_scale(make_workload):
    """fp16 autocast + GradScaler (on the CPU): the optimizer sees unscaled, clipped gradients;
    an inf gradient skips the step, keeps the weights and halves the loss scale."""
    w = make_workload(n=16, effective_batch=8)
    t = Trainer(w, Plan("fp16", 4, 8), TrainConfig(epochs=1, lr=1e-3, max_grad_norm=0.1), progress=False)
    assert t.scaler.is_enabled() and t.scaler.get_scale() == 65536.0
    seen = []
    t.optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(float(torch.nn.utils.get_total_norm(
            [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]))))
    loss, stepped = t.train_step(list(range(8)))
    assert stepped and float(t._grad_norm) > 0.1  # the true norm, measured after unscaling
    assert float(t._grad_norm) < 100  # a scaled norm would be ~65536 times larger
    assert seen == [pytest.approx(0.1, rel=1e-3)]  # clipped after unscaling, before the step

    calls = []

    def poison(grad):  # the next window's gradient is non-finite
        calls.append(1)
        return grad * math.inf if len(calls) == 1 else grad

    h = w.model.classifier.weight.register_hook(poison)
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    steps_before = [float(s["step"]) for s in t.optimizer.state.values()]
    loss, stepped = t.train_step(list(range(8, 16)))
    h.remove()
    assert not stepped and t.result.skipped_steps == 1
    # fused AdamW gets the scaler's found-inf flag and skips inside its kernel: no step counted
    assert [float(s["step"]) for s in t.optimizer.state.values()] == steps_before == [1.0] * len(steps_before)
    assert t.scaler.get_scale() == 32768.0  # the update ran: backed off by 0.5
    for n, p in w.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_fp16_finite_gradients_whose_norm_overflows_skip_the_step_they_are_reported_as(make_workload):
    """Finite gradients of ~1e20 (fp32) have an inf norm: the guard reported the step skipped,
    but the scaler, whose unscale_ found nothing non-finite, applied it (clipped to zero
    gradients: AdamW's weight decay and moments moved the weights, its step counted)."""
    w = make_workload(n=16, effective_batch=8)
    t = Trainer(w, Plan("fp16", 4, 8), TrainConfig(epochs=1, lr=1e-3, max_grad_norm=1.0), progress=False)
    t.train_step(list(range(8)))
    steps_before = [float(s["step"]) for s in t.optimizer.state.values()]
    scale = t.scaler.get_scale()
    # finite in fp32 after unscaling, and squares that overflow: a norm of inf
    h = w.model.classifier.weight.register_hook(lambda g: torch.full_like(g, 1e20 * scale))
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    loss, stepped = t.train_step(list(range(8, 16)))
    h.remove()
    assert not stepped and t.result.skipped_steps == 1 and math.isinf(float(t._grad_norm))
    assert [float(s["step"]) for s in t.optimizer.state.values()] == steps_before
    assert t.scaler.get_scale() == scale / 2
    for n, p in w.model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_run_of_nonfinite_steps_on_nonfinite_data_names_the_batch():
    """A sample holding NaN was blamed on a module and a learning rate too high alone; the batch's
    own non-finite values are named (by the sample's index in the data set) and come first in the advice."""
    from tightfit.workload import Workload

    torch.manual_seed(0)
    data = [{"x": torch.randn(4) if i != 2 else torch.tensor([0.0, math.nan, 0.0, 0.0]), "labels": i % 2}
            for i in range(8)]
    class Net(torch.nn.Module):  # a classifier's output: the workload's loss is cross-entropy on .logits
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Linear(4, 2)

        def forward(self, x):
            return types.SimpleNamespace(logits=self.body(x))

    t = Trainer(Workload(Net(), data, None, 8), Plan("fp32", 8, 8), TrainConfig(epochs=3, lr=1e-3, max_skipped_steps=2),
                progress=False)
    with pytest.raises(NonFiniteTrainingError) as e:
        t.fit()
    assert ("first non-finite values in the output of module 'body'; the batch's 'x' holds NaN (sample 2 of the data "
            "set). If such values are not meant to be in the data, repair or drop those samples; otherwise: try a "
            "lower --lr") in str(e.value)
