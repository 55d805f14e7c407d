"""Channels-last memory format (tightfit/levers/layout.py): convolutional models on CUDA are stored
channels-last; the saved weights and a resumed run are the same as without it.

The CPU runs here force the CUDA rule (``use_channels_last(model, "cuda")`` on a CPU model):
the fused AdamW kernel walks parameter, gradient and state in memory order on the CPU as on CUDA."""

import pytest
import torch
from transformers import ResNetConfig, ResNetForImageClassification

import tightfit.runtime.trainer as trainer_module
from conftest import assert_same_params, params_of
from tightfit.levers.layout import match_parameter_strides, use_channels_last
from tightfit.plan import Plan
from tightfit.runtime.checkpoint import load_checkpoint
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload


def _resnet(seed=0, widths=(16, 32)):
    torch.manual_seed(seed)
    return ResNetForImageClassification(ResNetConfig(depths=[1, 1], hidden_sizes=list(widths), embedding_size=8,
                                                     layer_type="basic", num_labels=3))


class _Images(torch.utils.data.Dataset):
    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def _collate(items):
    return {"pixel_values": torch.stack([d["pixel_values"] for d in items]),
            "labels": torch.stack([d["labels"] for d in items])}


def test_an_optimizer_that_updates_contiguous_weights_only_gets_them_contiguous():
    """bitsandbytes' update made each weight contiguous while its state, made like the
    channels-last weight, stayed channels-last: every weight paired with another's moments."""
    model = _resnet().to(memory_format=torch.channels_last)
    line = use_channels_last(model, "cuda", "adamw8bit")
    assert line and "contiguous (NCHW)" in line and "adamw8bit" in line
    assert all(p.is_contiguous() for p in model.parameters())
    assert use_channels_last(model, "cuda", "adamw8bit") is None


def test_only_convolutional_models_on_cuda_become_channels_last():
    model = _resnet()
    assert use_channels_last(model, "cpu") is None
    assert model.resnet.embedder.embedder.convolution.weight.is_contiguous()
    line = use_channels_last(model, "cuda")
    assert line and "channels-last" in line and "convolutions" in line
    assert model.resnet.embedder.embedder.convolution.weight.is_contiguous(memory_format=torch.channels_last)
    assert not model.resnet.embedder.embedder.convolution.weight.is_contiguous()
    assert use_channels_last(model, "cuda") is None  # already done: said once
    assert use_channels_last(torch.nn.Linear(4, 4), "cuda") is None


def test_restored_optimizer_state_takes_its_parameters_strides():
    model = _resnet().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(pixel_values=torch.randn(2, 3, 16, 16)).logits.sum().backward()
    opt.step()
    saved = opt.state_dict()  # as a checkpoint reads it back: contiguous state
    saved["state"] = {k: {n: v.contiguous() for n, v in s.items()} for k, s in saved["state"].items()}
    again = torch.optim.AdamW(model.parameters(), fused=True)
    again.load_state_dict(saved)
    match_parameter_strides(again)
    for p in model.parameters():
        for v in again.state[p].values():
            if v.shape == p.shape:
                assert v.stride() == p.stride()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_a_resumed_channels_last_run_reproduces_the_uninterrupted_one(tmp_path, monkeypatch, optimizer):
    # the CUDA rule on the CPU: the run trains channels-last, as it would on a GPU
    monkeypatch.setattr(trainer_module, "use_channels_last",
                        lambda model, device_type, optimizer: use_channels_last(model, "cuda", optimizer))

    def run(folder, resume_from=None):
        w = Workload(_resnet(widths=(32, 64)), _Images(32), None, 8, collate_fn=_collate)
        cfg = TrainConfig(epochs=1, lr=1e-2, seed=3, checkpoint_dir=str(folder), checkpoint_every=1, keep_last=10)
        plan = Plan("fp32", 4, 8, optimizer=optimizer)
        w.model.to(memory_format=torch.channels_last)  # as the planning left it
        t = Trainer(w, plan, cfg, progress=False)
        weights = [p for p in t.model.parameters() if p.dim() == 4]
        if optimizer == "adamw":
            assert all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
        else:  # bitsandbytes updates contiguous weights only: put back
            assert all(p.is_contiguous() for p in weights)
        if resume_from is not None:
            t.resume(resume_from)
        t.fit()
        return t

    if optimizer == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    full = run(tmp_path / "full")
    saved = load_checkpoint(tmp_path / "full" / "ckpt-4", _resnet(widths=(32, 64)))  # weights written contiguous, loadable
    assert saved["step"] == 4
    resumed = run(tmp_path / "resumed", resume_from=tmp_path / "full" / "ckpt-1")
    assert_same_params(params_of(resumed.model), params_of(full.model))


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_on_the_gpu_a_conv_model_trains_channels_last_and_resumes_exactly(tmp_path, optimizer):
    """The fused AdamW walks memory order: a resumed run's state must take the channels-last
    strides of its parameters. bitsandbytes' 8-bit AdamW trains contiguous weights (64x64x3x3:
    8-bit state)."""
    if optimizer == "adamw8bit":
        pytest.importorskip("bitsandbytes")

    def run(folder, resume_from=None):
        w = Workload(_resnet(widths=(32, 64)), _Images(32), None, 8, collate_fn=_collate)
        cfg = TrainConfig(epochs=1, lr=1e-2, seed=3, checkpoint_dir=str(folder), checkpoint_every=1, keep_last=10)
        t = Trainer(w, Plan("bf16", 4, 8, optimizer=optimizer, device="cuda"), cfg, progress=False)
        layout = torch.channels_last if optimizer == "adamw" else torch.contiguous_format
        assert all(p.is_contiguous(memory_format=layout) for p in t.model.parameters() if p.dim() == 4)
        if resume_from is not None:
            t.resume(resume_from)
        t.fit()
        return t

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume_from=tmp_path / "full" / "ckpt-1")
    assert_same_params(params_of(resumed.model), params_of(full.model))
