"""BatchNorm's running statistics see each training sample once, as in a plain PyTorch loop.

Recomputed blocks update them once per forward, as blocks that are not checkpointed do: a checkpointed block's forward runs twice in train mode (forward, then the
recomputation in backward), and without :class:`tightfit.buffers.KeptBuffers` the same
batch was folded into the statistics twice (its momentum applied twice, ``num_batches_tracked``
counted twice), so evaluation after a checkpointed run differed from the same run without it.
The planner's probe steps (worst-case batches, weights kept bit-identical at lr 0) leave them as
they were. (Padding micro-batches on several ranks: tests/test_distributed.py.)"""

import types

import pytest
import torch

from tightfit.levers.blocks import find_blocks
from tightfit.levers.checkpointing import set_activation_checkpointing
from tightfit.levers.compile import compile_model


class _Net(torch.nn.Module):
    """Linear, BatchNorm1d, Linear over ``x`` ``[B, 4]``; a classifier's output (``.logits``)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))

    def forward(self, x):
        return types.SimpleNamespace(logits=self.body(x))


def _resnet():
    """A tiny Hugging Face ResNet whose six repeated blocks hold BatchNorm layers."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[3], layer_type="basic", num_labels=3)
    return ResNetForImageClassification(config).train()


def _two_steps(policies=None, compile_scope=None):
    """BatchNorm statistics and gradients after two forward/backward passes on fixed batches."""
    model = _resnet()
    if compile_scope:
        compile_model(model, None if compile_scope == "blocks" else compile_scope)
    if policies is not None:
        set_activation_checkpointing(model, True, policies=policies)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(4, 3, 16, 16, generator=generator)
        model(pixel_values=x).logits.square().sum().backward()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    stats = {f"{i}.{name}": getattr(m, name).clone() for i, m in enumerate(norms)
             for name in ("running_mean", "running_var", "num_batches_tracked")}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return stats, grads


def _same(ref, got, rtol=1e-5, atol=1e-6):
    for part in (0, 1):
        assert ref[part].keys() == got[part].keys()
        for name in ref[part]:
            torch.testing.assert_close(got[part][name], ref[part][name], rtol=rtol, atol=atol, msg=name)


def test_the_model_has_blocks_with_batchnorm():
    blocks = find_blocks(_resnet())
    assert len(blocks) == 6
    assert all(any(isinstance(m, torch.nn.BatchNorm2d) for m in b.modules()) for b in blocks)


@pytest.mark.parametrize("policies", [("full",) * 6, ("selective",) * 6,
                                      ("full", "selective", "offload", "none", "full", "selective")])
def test_recomputed_blocks_update_batchnorm_statistics_once(policies):
    ref = _two_steps()
    assert int(ref[0]["1.num_batches_tracked"]) == 2
    _same(ref, _two_steps(policies))


def test_checkpointing_the_whole_model_through_the_plan_switch_keeps_the_statistics():
    ref = _two_steps()
    model = _resnet()
    set_activation_checkpointing(model, True)  # every block, as a plan that checkpoints them all
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(pixel_values=torch.randn(4, 3, 16, 16, generator=generator)).logits.square().sum().backward()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert [int(m.num_batches_tracked) for m in norms] == [2] * len(norms)


@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_compiled_checkpointed_blocks_update_batchnorm_statistics_once(scope):
    """Blocks compiled one by one are checkpointed around their compiled call (recomputing calls
    it again); one whole-model graph checkpoints inside itself (the compiler updates the
    statistics once: nothing to keep there). Compiled kernels sum in another order: the
    tolerance is a compiled step's, far below a second update of the statistics (~10%)."""
    ref = _two_steps()
    _same(ref, _two_steps(("full",) * 6, scope), rtol=1e-3, atol=1e-4)


def test_the_planners_probe_steps_leave_batchnorm_statistics_as_they_were():
    """The probe trains a few steps at lr 0 so that the weights stay bit-identical; its forward
    passes in train mode folded the worst-case batches into BatchNorm's statistics, so a run
    planned on the GPU started from other statistics than the same run with a cached plan."""
    from tightfit.planner.probe import run_probe_steps
    from tightfit.workload import Workload

    torch.manual_seed(0)
    data = [{"x": torch.randn(4) + 3.0, "labels": i % 2} for i in range(16)]
    model = _Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run_probe_steps(Workload(model, data, None, 8), 4, "fp32", "adamw", timed_steps=2)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))


def _cnn_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


def test_a_skipped_non_finite_step_leaves_batchnorm_statistics_as_it_found_them():
    """One sample with an inf: the step is skipped (weights unchanged), but its forward had folded
    the inf into BatchNorm's running statistics, NaN for good: every evaluation after gave NaN,
    and the runtime wrote checkpoints holding them. The statistics are now put back with the
    skip, in the Python API's step and in the runtime's, and a checkpoint refuses NaN statistics."""
    import tightfit
    from tightfit.plan import Plan
    from tightfit.runtime.checkpoint import NonFiniteCheckpointError, check_finite

    model = _cnn()
    step = tightfit.TrainStep(Plan("fp32", 8, 16, False, device="cpu"), model,
                              torch.optim.AdamW(model.parameters(), lr=1e-2), loss=_cnn_loss)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    step((x, y))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = x.clone()
    bad[0, 0, 0, 0] = float("inf")
    assert not step((bad, y)).stepped
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
    model[1].running_var.fill_(float("nan"))  # as a skipped step left them before
    with pytest.raises(NonFiniteCheckpointError, match=r"buffer '1.running_var' holds inf/NaN"):
        check_finite(model)


def test_the_runtimes_skipped_step_puts_the_buffers_back_also_when_decided_on_the_device():
    """On CUDA with a fused optimizer the skip is decided on the device and read later: the
    buffers are then chosen there, kept where the step was applied and put back where not."""
    from tightfit.buffers import buffer_snapshot, restore_buffers

    norm = torch.nn.BatchNorm1d(3)
    snapshot = buffer_snapshot([norm])
    norm.running_mean.fill_(float("nan"))
    restore_buffers(snapshot, unless=torch.tensor(True))  # applied: kept as the step left them
    assert torch.isnan(norm.running_mean).all()
    restore_buffers(snapshot, unless=torch.tensor(False))  # skipped: as the step found them
    assert torch.equal(norm.running_mean, torch.zeros(3))


def test_a_checkpointed_blocks_own_buffers_are_updated_once_per_forward():
    """A block of the user's own keeping a moving average and a counter in buffers: the
    recomputation updated them a second time (only BatchNorm's were kept)."""
    import tightfit
    from tightfit.plan import Plan

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.lin = torch.nn.Linear(d, d)
            self.register_buffer("ema", torch.zeros(d))
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.ema.mul_(0.9).add_(0.1 * x.mean(0))
                    self.seen += 1
            return x + torch.relu(self.lin(x))

    def run(checkpointing):
        torch.manual_seed(0)
        model = torch.nn.Sequential(Block(16), Block(16), torch.nn.Linear(16, 4))
        step = tightfit.TrainStep(Plan("fp32", 8, 8, checkpointing, device="cpu"), model,
                                  torch.optim.SGD(model.parameters(), lr=0.1), loss=_cnn_loss)
        step((torch.randn(8, 16), torch.randint(0, 4, (8,))))
        return int(model[0].seen), model[0].ema.clone()

    (seen, ema), (seen_ckpt, ema_ckpt) = run(False), run(True)
    assert seen == seen_ckpt == 1 and torch.equal(ema, ema_ckpt)


def test_an_oom_redo_puts_batchnorms_statistics_back_beside_a_large_buffer(monkeypatch):
    """A buffer over the snapshot bound (a large table, never written) made the OOM redo copy no
    buffer at all: BatchNorm kept the failed attempt's update (3 batches counted for 2)."""
    import tightfit
    import tightfit.buffers as buffers
    from tightfit.plan import Plan

    monkeypatch.setattr(buffers, "BUFFER_SNAPSHOT_BYTES", 4096)  # the table below is over it

    def run(micro_batch, oom):
        model = _cnn()
        model.register_buffer("table", torch.zeros(2048))
        step = tightfit.TrainStep(Plan("fp32", micro_batch, 16, False, device="cpu"), model,
                                  torch.optim.SGD(model.parameters(), lr=0.1), loss=_cnn_loss)
        fired = []

        def hook(module, inputs, output):
            if oom and not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        model[1].register_forward_hook(hook)
        g = torch.Generator().manual_seed(1)
        step((torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)))
        return int(model[1].num_batches_tracked), model[1].running_mean.clone()

    (count, mean), (count_redone, mean_redone) = run(8, False), run(16, True)
    assert count == count_redone == 2 and torch.equal(mean, mean_redone)


def test_planning_on_the_cpu_leaves_a_buffer_the_model_writes_as_it_was():
    """``tightfit.plan`` runs one forward of the sample batch (train mode) to check the loss; a
    buffer the model writes in any mode (a call counter) kept its trace."""
    import tightfit

    class Counted(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    model = Counted()
    tightfit.plan(model, (torch.randn(8, 4), torch.randint(0, 2, (8,))), effective_batch=8, device="cpu",
                  loss=_cnn_loss)
    assert int(model.calls) == 0


def test_the_runtime_trainers_skipped_step_leaves_batchnorm_statistics_as_it_found_them():
    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(16)]
    t = Trainer(Workload(_Net(), data, None, 8), Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)
    t.train_step(list(range(8)))
    norm = t.model.body[1]
    before = (norm.running_mean.clone(), int(norm.num_batches_tracked))
    handle = t.model.body[0].register_forward_hook(lambda m, i, o: o * float("inf"))
    loss, stepped = t.train_step(list(range(8, 16)))
    handle.remove()
    assert not stepped and int(norm.num_batches_tracked) == before[1] == 1
    torch.testing.assert_close(norm.running_mean, before[0], rtol=0, atol=0)


def test_a_stop_on_non_finite_steps_leaves_batchnorm_statistics_as_its_checkpoint_holds(tmp_path):
    """The stop's diagnosis runs one forward and backward in train mode to name the first non-finite
    gradient; its forward folded that micro-batch into BatchNorm's statistics, which the skipped
    steps had left as they found them: the model left in memory differed from the stop's checkpoint.
    The statistics are now put back after the diagnosis."""
    from tightfit.plan import Plan
    from tightfit.runtime.checkpoint import load_checkpoint
    from tightfit.runtime.trainer import NonFiniteTrainingError, TrainConfig, Trainer
    from tightfit.workload import Workload

    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(16)]
    t = Trainer(Workload(_Net(), data, None, 8), Plan("fp32", 8, 8),
                TrainConfig(epochs=2, lr=1e-3, max_skipped_steps=2, checkpoint_dir=str(tmp_path)), progress=False)
    # the gradients turn NaN after the first step (the forward stays finite: the diagnosis runs a backward)
    t.model.body[2].weight.register_hook(lambda g: g * float("nan") if t.step >= 1 else g)
    with pytest.raises(NonFiniteTrainingError, match="gradient of 'body.2.weight'") as e:
        t.fit()
    saved = _Net()
    load_checkpoint(e.value.checkpoint, saved)
    for name, buffer in t.model.named_buffers():
        torch.testing.assert_close(buffer, dict(saved.named_buffers())[name], rtol=0, atol=0)


def test_an_oom_redo_splits_the_window_so_that_batchnorm_gets_no_single_sample():
    """Planned 23 + 22 for 45 samples; an OOM halved the micro-batch to 11, which split the window
    as 11 + 11 + 11 + 11 + 1, and the step died telling the user to plan another effective batch.
    The redo now takes a balanced split (9 x 5) and, with BatchNorm, one with no single sample."""
    import tightfit
    from tightfit.plan import Plan, halved_micro_batch

    assert halved_micro_batch(45, 23) == 9 and halved_micro_batch(8, 8) == 4 and halved_micro_batch(7, 7) == 3
    assert halved_micro_batch(5, 4) == 2 and halved_micro_batch(5, 4, no_single=True) == 3  # 3+2, not 2+2+1
    assert halved_micro_batch(21, 22, no_single=True) == 11  # 11 + 10
    # 31 at half of 12: 6 x 5 + 1; with BatchNorm not 5 (5 x 6 + 1) but 4 (4 x 7 + 3)
    assert halved_micro_batch(31, 12) == 6 and halved_micro_batch(31, 12, no_single=True) == 4
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    step = tightfit.TrainStep(Plan("fp32", 23, 45, False, device="cpu"), model,
                              torch.optim.AdamW(model.parameters()), loss=_cnn_loss)
    batch = (torch.randn(45, 3, 8, 8), torch.randint(0, 4, (45,)))
    assert step(batch).micro_batch == 23
    fired = []

    def hook(module, inputs, output):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    model[0].register_forward_hook(hook)
    assert step(batch).micro_batch == 9


def test_an_oom_redo_leaves_no_single_sample_in_the_runs_other_windows():
    """The redo chose its micro-batch for the window that ran out of memory only, but keeps it for
    the windows after: 8 samples redone at 4 (4 x 2), then the epoch's last window of 5 split as
    4 + 1, and BatchNorm stopped the run with a ValueError; in the own loop, a last batch of 6
    redone at 3, then the next whole batch of 10 split as 3 + 3 + 3 + 1. The redo now takes a
    micro-batch that leaves no single sample in any of the run's windows (3; 2)."""
    import tightfit
    from tightfit.plan import Plan, halved_micro_batch
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    assert halved_micro_batch(8, 8, no_single=True, others=(8, 5)) == 3
    assert halved_micro_batch(4, 7, no_single=True, others=(7,)) == 2  # 2 or 3: none serves both, 4's own
    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(13)]  # windows of 8 and 5
    t = Trainer(Workload(_Net(), data, None, 8), Plan("fp32", 8, 8), TrainConfig(epochs=2, lr=1e-3), progress=False)
    fired = []

    def oom(module, args):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    t.model.body[0].register_forward_pre_hook(oom)
    result = t.fit()
    assert result.steps == 4 and result.oom_recoveries == 1 and t.micro_batch == 3

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    step = tightfit.TrainStep(Plan("fp32", 6, 10, False, device="cpu"), model,
                              torch.optim.AdamW(model.parameters()), loss=_cnn_loss)
    fired.clear()
    handle = model[0].register_forward_pre_hook(oom)
    assert step((torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,)))).micro_batch == 2  # an epoch's last batch
    handle.remove()
    assert step((torch.randn(10, 3, 8, 8), torch.randint(0, 4, (10,)))).accumulation_steps == 5


def test_an_oom_redo_of_an_odd_window_and_the_growth_back_leave_batchnorm_no_single_sample():
    """Found by a review: 7 samples at micro-batch 7 were redone as 3 + 3 + 1 (no size up to half
    avoided one), and BatchNorm stopped the run with a ValueError; growing 3 back took 6 (6 + 1).
    The redo now takes a size above half where none up to it serves (4 + 3), the growth the
    largest that leaves no single sample (5 + 2). On several ranks the same holds for each rank's
    share and padding, and the pass halved is the largest share's (a review: 10 samples on 2 ranks
    at 5 were redone at 2, 2 + 2 + 1 on each rank; a short window of 5 at 8, shares 3 and 2, was
    redone at 3: rank 0's same pass of 3)."""
    from tightfit.plan import Plan, grown_micro_batch, halved_micro_batch
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    assert halved_micro_batch(7, 7, no_single=True) == 4 and halved_micro_batch(7, 7) == 3
    assert grown_micro_batch(3, 7, no_single=True, sizes=(7,)) == 5 and grown_micro_batch(3, 7, sizes=(7,)) == 6
    assert grown_micro_batch(2, 8, no_single=True, sizes=(5,)) == 3  # 3 + 2, not 4 + 1
    assert halved_micro_batch(3, 3, no_single=True) == 1  # 2 + 1 or 1 + 1 + 1: the halving stands
    # ... and grows back (found by a review of the change: it stayed at 1 for good), to the plan's own
    # micro-batch too where that leaves one (a BatchNorm over feature maps, which the plan check let through)
    assert grown_micro_batch(1, 3, no_single=True, sizes=(3,)) == 2 and grown_micro_batch(3, 4, True, (9,)) == 4
    # two ranks: the largest share's pass is halved, and no rank's share or padding is left one sample
    assert halved_micro_batch(10, 5, no_single=True, world_size=2) == 3  # 5 as 3 + 2 on each, not 2 + 2 + 1
    assert halved_micro_batch(5, 8, world_size=2) == 2  # shares 3 and 2: 2 + 1 and 2, not the same passes
    assert grown_micro_batch(3, 8, no_single=True, sizes=(14,), world_size=2) == 5  # shares of 7: 5 + 2, not 6 + 1
    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(14)]  # two windows of 7
    t = Trainer(Workload(_Net(), data, None, 7), Plan("fp32", 7, 7), TrainConfig(epochs=2, lr=1e-3, grow_back_after=1),
                progress=False)
    fired = []

    def oom(module, args):
        if args[0].shape[0] > 4 and not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    t.model.body[0].register_forward_pre_hook(oom)
    result = t.fit()
    assert result.steps == 4 and result.oom_recoveries == 1
    assert any("7 samples as 4+3" in e for e in result.events), result.events


def test_the_trainers_oom_redo_leaves_batchnorm_statistics_as_the_smaller_micro_batch_gives_them():
    """The runtime trainer's redo after an out-of-memory step puts the buffers back first: the
    failed attempt's forward had already folded its micro-batch into BatchNorm's statistics."""
    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    def run(micro_batch, oom):
        torch.manual_seed(0)
        data = [{"x": torch.randn(4), "labels": i % 2} for i in range(8)]
        t = Trainer(Workload(_Net(), data, None, 8), Plan("fp32", micro_batch, 8),
                    TrainConfig(epochs=1, lr=1e-3, grow_back_after=0), progress=False)
        fired = []

        def hook(module, inputs, output):
            if oom and not fired:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        t.model.body[1].register_forward_hook(hook)
        r = t.fit()
        norm = t.model.body[1]
        return r.oom_recoveries, int(norm.num_batches_tracked), norm.running_mean.clone(), norm.running_var.clone()

    planned, redone = run(4, False), run(8, True)
    assert (planned[0], redone[0]) == (0, 1) and planned[1] == redone[1] == 2
    torch.testing.assert_close(redone[2:], planned[2:], rtol=0, atol=0)
