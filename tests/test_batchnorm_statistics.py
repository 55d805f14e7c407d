"""BatchNorm's running statistics see each training sample once, as in a plain PyTorch loop.

Recomputed blocks update them once per forward, as blocks that are not checkpointed do: a checkpointed block's forward runs twice in train mode (forward, then the
recomputation in backward), and without :class:`tightfit.buffers.KeptBuffers` the same
batch was folded into the statistics twice (its momentum applied twice, ``num_batches_tracked``
counted twice), so evaluation after a checkpointed run differed from the same run without it.
The planner's probe steps (worst-case batches, weights kept bit-identical at lr 0) leave them as
they were. (Padding micro-batches on several ranks: tests/test_distributed.py.)"""

import pytest
import torch

from tightfit.levers.blocks import find_blocks
from tightfit.levers.checkpointing import set_activation_checkpointing
from tightfit.levers.compile import compile_model


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
    import types

    from tightfit.planner.probe import run_probe_steps
    from tightfit.workload import Workload

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))

        def forward(self, x):
            return types.SimpleNamespace(logits=self.body(x))

    torch.manual_seed(0)
    data = [{"x": torch.randn(4) + 3.0, "labels": i % 2} for i in range(16)]
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    run_probe_steps(Workload(model, data, None, 8), 4, "fp32", "adamw", timed_steps=2)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, msg=name)
