"""The optimizer levers (torchao 8-bit AdamW, CPU-offloaded AdamW) keep the step's guards:
unscale once and clip before the step, skip on inf/NaN, all-or-nothing rollback after an OOM,
exact resume. torchao's AdamW8bit runs on the CPU (its step is compiled by torch.compile: the
first test in a process compiles it once per parameter shape); CPUOffloadOptimizer needs CUDA.
"""

import math

import pytest
import torch

from conftest import SyntheticBatches
from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.runtime.trainer import PartialUpdateError, TrainConfig, Trainer
from tightfit.step import apply_update, make_optimizer
from tightfit.workload import Workload

torchao = pytest.importorskip("torchao")


def bert_with_large_tensors(seed=0, dropout=0.1):
    """A 2-layer BERT whose embeddings and linear weights have >= 4,096 elements (8-bit in torchao)."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=32, num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))


def workload(n=24, effective_batch=8, seed=0):
    return Workload(bert_with_large_tensors(seed), SyntheticBatches(n), SyntheticBatches(8, seed=1), effective_batch)


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_adamw8bit_keeps_large_tensors_in_8_bits_and_small_ones_in_fp32():
    from torchao.optim.subclass_8bit import OptimState8bit
    model = bert_with_large_tensors()
    opt = make_optimizer(model.parameters(), "adamw8bit", "cpu", lr=1e-3)
    model(input_ids=torch.randint(1, 50, (2, 8)), labels=torch.tensor([0, 1])).loss.backward()
    opt.step()
    for p in model.parameters():
        kind = type(opt.state[p]["exp_avg"])
        assert (kind is OptimState8bit) == (p.numel() >= 4096 and p.numel() % 256 == 0), p.shape


def test_a_missing_torchao_is_one_line_naming_the_extra(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_torchao(name, *a, **k):
        if name.startswith("torchao"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(TightfitError, match=r"tightfit\[levers\]"):
        make_optimizer([torch.nn.Parameter(torch.zeros(3))], "adamw8bit", "cpu")


def _grads(model, value=None, scaler=None, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=torch.randint(1, 50, (2, 8)), labels=torch.tensor([0, 1])).loss
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if value is not None:
        next(model.parameters()).grad.fill_(value)


def test_apply_update_unscales_once_and_clips_before_the_8bit_step():
    model = bert_with_large_tensors(dropout=0.0)
    opt = make_optimizer(model.parameters(), "adamw8bit", "cpu", lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _grads(model)
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    _grads(model, scaler=scaler)  # the same gradients, scaled by 1024
    seen = []
    real_step = opt.step
    opt.step = lambda *a, **k: (seen.append(float(torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters()]))), real_step(*a, **k))[1]
    norm, finite = apply_update(opt, scaler, max_grad_norm=true_norm / 4)
    assert finite and math.isclose(norm, true_norm, rel_tol=1e-4)  # unscaled exactly once
    assert seen and math.isclose(seen[0], true_norm / 4, rel_tol=1e-3)  # clipped before the step


@pytest.mark.parametrize("scaling", [False, True])
def test_a_non_finite_window_leaves_8bit_state_and_weights_untouched(scaling):
    model = bert_with_large_tensors(dropout=0.0)
    opt = make_optimizer(model.parameters(), "adamw8bit", "cpu", lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaling)
    _grads(model, scaler=scaler)
    apply_update(opt, scaler, 1.0)  # state exists
    before = params(model)
    state = {id(p): {k: (v.dequantize() if hasattr(v, "dequantize") else v).clone() for k, v in s.items()}
             for p, s in opt.state.items()}
    _grads(model, math.inf, scaler=scaler)
    norm, finite = apply_update(opt, scaler, 1.0)
    assert not finite
    assert_same(params(model), before)
    for p, s in opt.state.items():
        for k, v in s.items():
            assert torch.equal(v.dequantize() if hasattr(v, "dequantize") else v, state[id(p)][k]), k
    if scaling:
        assert scaler.get_scale() == 512.0  # the loss scale backed off after the skip


def _oom_in_new_buffer(trainer, n):
    """Raise a CUDA-style OOM at the ``n``-th state tensor torchao creates in the first step."""
    opt, calls = trainer.optimizer, []
    real = opt._new_buffer

    def new_buffer(p, signed):
        calls.append(1)
        if len(calls) == n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return real(p, signed)

    opt._new_buffer = new_buffer
    return calls


def test_oom_while_8bit_state_is_allocated_redoes_the_step_exactly():
    cfg = dict(epochs=1, lr=1e-3, seed=3, grow_back_after=0)
    ref = workload()
    t_ref = Trainer(ref, Plan("fp32", 4, 8, optimizer="adamw8bit"), TrainConfig(**cfg), progress=False)
    torch.manual_seed(11)
    t_ref.fit()

    w = workload()
    t = Trainer(w, Plan("fp32", 8, 8, optimizer="adamw8bit"), TrainConfig(**cfg), progress=False)
    _oom_in_new_buffer(t, 2)  # the first parameter's second moment: nothing written yet
    torch.manual_seed(11)
    res = t.fit()
    assert res.oom_recoveries == 1 and t.micro_batch == 4
    assert {float(s["step"]) for s in t.optimizer.state.values()} == {3.0}  # no parameter stepped twice
    assert_same(params(w.model), params(ref.model))


def test_oom_after_the_8bit_step_wrote_a_parameter_stops_rather_than_apply_it_twice():
    t = Trainer(workload(), Plan("fp32", 8, 8, optimizer="adamw8bit"), TrainConfig(epochs=1, lr=1e-3),
                progress=False)
    _oom_in_new_buffer(t, 3)  # the second parameter's state: the first one is updated already
    with pytest.raises(PartialUpdateError, match="part"):
        t.train_step(list(range(8)))


def test_resume_with_8bit_state_reproduces_the_uninterrupted_run(tmp_path):
    from tightfit.runtime.checkpoint import list_checkpoints

    cfg = dict(epochs=2, lr=1e-3, seed=5)  # 24 samples / 8 = 3 steps per epoch, 6 in all
    full = workload(seed=1)
    torch.manual_seed(0)
    Trainer(full, Plan("fp32", 4, 8, optimizer="adamw8bit"),
            TrainConfig(**cfg, checkpoint_every=2, keep_last=3, checkpoint_dir=str(tmp_path)), progress=False).fit()
    resumed = workload(seed=2)  # other initial weights: all come from the checkpoint
    t = Trainer(resumed, Plan("fp32", 4, 8, optimizer="adamw8bit"), TrainConfig(**cfg), progress=False)
    t.resume([c for c in list_checkpoints(tmp_path) if c.name == "ckpt-2"][0])  # written mid-run
    t.fit()
    assert_same(params(resumed.model), params(full.model))


def test_resume_with_a_new_lr_sets_torchaos_tensor_lr_in_place(tmp_path):
    from tightfit.runtime.checkpoint import list_checkpoints

    Trainer(workload(), Plan("fp32", 8, 8, optimizer="adamw8bit"),
            TrainConfig(epochs=1, lr=1e-3, max_steps=1, checkpoint_dir=str(tmp_path)), progress=False).fit()
    t = Trainer(workload(), Plan("fp32", 8, 8, optimizer="adamw8bit"), TrainConfig(epochs=1, lr=5e-4),
                progress=False)
    t.resume(list_checkpoints(tmp_path)[-1])
    assert all(isinstance(g["lr"], torch.Tensor) for g in t.optimizer.param_groups)
    t.fit()  # torchao refuses a float lr at its step


# ---------------------------------------------------------------- CPU offload (CUDA)

@pytest.mark.gpu
@pytest.mark.parametrize("micro_batch", [8, 4])
def test_offloaded_adamw_trains_like_fused_adamw(micro_batch):
    """One micro-batch (gradients freed on the GPU once copied) and accumulation (held): the
    host step gives the weights fused AdamW gives, up to the CPU's rounding."""
    got = {}
    for kind in ("adamw", "adamw-offload"):
        w = workload(seed=4)
        torch.manual_seed(0)
        Trainer(w, Plan("fp32", micro_batch, 8, optimizer=kind, device="cuda"), TrainConfig(epochs=1, lr=1e-3),
                progress=False).fit()
        got[kind] = params(w.model)
    for k in got["adamw"]:
        torch.testing.assert_close(got["adamw-offload"][k], got["adamw"][k], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_offloaded_adamw_clips_the_complete_host_gradients():
    model = bert_with_large_tensors(dropout=0.0).cuda()
    opt = make_optimizer(model.parameters(), "adamw-offload", "cuda", lr=1e-3)
    batch = dict(input_ids=torch.randint(1, 50, (2, 8), device="cuda"), labels=torch.tensor([0, 1], device="cuda"))
    ref = bert_with_large_tensors(dropout=0.0).cuda()
    ref(**batch).loss.backward()
    true_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    model(**batch).loss.backward()
    norm, finite = apply_update(opt, None, max_grad_norm=1.0)
    assert finite and math.isclose(norm, true_norm, rel_tol=1e-4)


@pytest.mark.gpu
def test_resume_refreshes_the_offloaded_master_weights(tmp_path):
    """torchao copies the master weights to the host only when the optimizer is built, before
    the checkpoint's weights are loaded: a stale host copy would undo the resume."""
    from tightfit.runtime.checkpoint import list_checkpoints

    cfg = dict(epochs=2, lr=1e-3, seed=5)
    full = workload(seed=1)
    torch.manual_seed(0)
    Trainer(full, Plan("fp32", 8, 8, optimizer="adamw-offload", device="cuda"),
            TrainConfig(**cfg, checkpoint_every=3, keep_last=2, checkpoint_dir=str(tmp_path)), progress=False).fit()
    resumed = workload(seed=2)
    t = Trainer(resumed, Plan("fp32", 8, 8, optimizer="adamw-offload", device="cuda"), TrainConfig(**cfg),
                progress=False)
    t.resume(list_checkpoints(tmp_path)[0])  # ckpt-3, written mid-run
    t.fit()
    assert_same(params(resumed.model), params(full.model))


@pytest.mark.gpu
def test_a_released_offloaded_optimizer_leaves_no_hook_on_the_model():
    from tightfit.levers.optimizers import release

    model = bert_with_large_tensors(dropout=0.0).cuda()
    opt = make_optimizer(model.parameters(), "adamw-offload", "cuda", lr=1e-3)
    batch = dict(input_ids=torch.randint(1, 50, (2, 8), device="cuda"), labels=torch.tensor([0, 1], device="cuda"))
    release(opt)
    model(**batch).loss.backward()
    assert not opt.queue  # no gradient was copied to its host buffers
    assert all(p.grad is not None for p in model.parameters())  # nor freed on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw-offload"])
def test_the_gpu_planner_verifies_and_trains_with_the_optimizer_asked_for(optimizer):
    from tightfit.devices import detect
    from tightfit.planner.gpu import plan_on_gpu

    w = workload(n=32, effective_batch=16)
    w.model.cuda()
    plan = plan_on_gpu(w, detect(), 2 << 30, 12, compile="off", optimizer=optimizer)
    assert plan.optimizer == optimizer and any(r.startswith(f"optimizer {optimizer}") for r in plan.reasons)
    res = Trainer(w, plan, TrainConfig(epochs=1, lr=1e-3), progress=False).fit()
    assert res.oom_recoveries == 0 and math.isfinite(res.final_loss)


@pytest.mark.gpu
def test_resume_with_8bit_state_on_the_gpu_reproduces_the_uninterrupted_run(tmp_path):
    """The checkpoint's host snapshot keeps torchao's 8-bit tensors as they are (a copy into a
    plain fp32 buffer would dequantize them, and the resumed run would step fp32 moments)."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from tightfit.runtime.checkpoint import list_checkpoints, read_state

    cfg = dict(epochs=2, lr=1e-3, seed=5)
    full = workload(seed=1)
    torch.manual_seed(0)
    Trainer(full, Plan("fp32", 4, 8, optimizer="adamw8bit", device="cuda"),
            TrainConfig(**cfg, checkpoint_every=2, keep_last=3, checkpoint_dir=str(tmp_path)), progress=False).fit()
    ckpt = [c for c in list_checkpoints(tmp_path) if c.name == "ckpt-2"][0]
    saved = read_state(ckpt)["optimizer"]["state"]
    assert any(isinstance(v, OptimState8bit) for s in saved.values() for v in s.values())
    resumed = workload(seed=2)
    t = Trainer(resumed, Plan("fp32", 4, 8, optimizer="adamw8bit", device="cuda"), TrainConfig(**cfg), progress=False)
    t.resume(ckpt)
    t.fit()
    assert_same(params(resumed.model), params(full.model))
