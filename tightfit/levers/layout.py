"""Channels-last memory format for convolutional models on CUDA GPUs.

Tensor cores run 2-D convolutions in the NHWC layout; with PyTorch's default NCHW tensors
cuDNN transposes around every convolution (or picks slower kernels). Stored channels-last, the
weights make every convolution's output channels-last too, so the whole network runs without
transposes: same values, same memory, fewer kernels. PyTorch's guide:
https://pytorch.org/tutorials/intermediate/memory_format_tutorial.html. Measured on an NVIDIA
H200 (ResNet-50, bf16 autocast, micro-batch 64, torch 2.11): 3,275 against 2,162 samples/s at
the same peak memory (``bench/results/recompute-1/conv_layout.md``).

Only the parameters' strides change: ``state_dict`` keys, shapes and values do not, the saved
weights are written contiguous (:func:`tightfit.runtime.checkpoint.take_snapshot` copies them
into contiguous host buffers), and optimizer state keeps each parameter's strides across a
checkpoint (the fused AdamW kernels walk parameter, gradient and state in memory order, so a
state tensor of other strides than its parameter would be updated at the wrong elements).
"""

from __future__ import annotations

import torch


def convolutions(model: torch.nn.Module) -> int:
    """How many 2-D convolutions (``nn.Conv2d``) ``model`` has."""
    return sum(isinstance(m, torch.nn.Conv2d) for m in model.modules())


# Optimizers whose update keeps a channels-last parameter's layout and pairs it with state of the
# same strides (torch's AdamW). bitsandbytes' 8-bit AdamW makes each parameter contiguous in its
# update (``p.data = p.data.contiguous()``, 0.50) while its state, made like the parameter before,
# stays channels-last: its kernels would pair every weight with another element's moments. The
# torchao levers are not verified with channels-last weights.
CHANNELS_LAST_OPTIMIZERS = ("adamw", "adamw-foreach")


def use_channels_last(model: torch.nn.Module, device_type: str, optimizer: str | None = None) -> str | None:
    """Store ``model``'s 4-D parameters and buffers channels-last, in place, where it pays: on a
    CUDA device, for a model with 2-D convolutions, trained by an optimizer of
    :data:`CHANNELS_LAST_OPTIMIZERS`. Inputs need no change (a convolution whose weight is
    channels-last returns channels-last output). With another optimizer a channels-last model is
    put back in the default (contiguous) format.

    Args:
        model: the model, already on its device.
        device_type: ``"cuda"`` or ``"cpu"`` (the CPU is left as it is: its convolutions gain
            little and the CPU runs are the reference).
        optimizer: the plan's optimizer (:data:`tightfit.step.OPTIMIZERS`); None: not chosen yet
            (before planning, whose probes then time the layout that the fused AdamW trains in).

    Returns:
        A line for the log saying what was done, or None when nothing was (also when the model
        is in that format already).
    """
    n = convolutions(model)
    if device_type != "cuda" or n == 0:
        return None
    four_d = [t for t in list(model.parameters()) + list(model.buffers()) if t.dim() == 4]
    if optimizer is not None and optimizer not in CHANNELS_LAST_OPTIMIZERS:
        if all(t.is_contiguous() for t in four_d):
            return None
        model.to(memory_format=torch.contiguous_format)
        return (f"memory format: contiguous (NCHW) for the model's {n} convolutions: optimizer {optimizer} "
                f"updates contiguous weights only")
    if all(t.is_contiguous(memory_format=torch.channels_last) for t in four_d):
        return None
    model.to(memory_format=torch.channels_last)
    return f"memory format: channels-last for the model's {n} convolutions (tensor cores' native layout)"


def match_parameter_strides(optimizer: torch.optim.Optimizer) -> None:
    """Give every optimizer state tensor of a parameter's shape that parameter's strides, in place
    of the state (values unchanged). Called after ``optimizer.load_state_dict``: a checkpoint
    read back (``torch.load``, then the optimizer's cast to the parameter's device) may hold state
    in another memory format than the parameter it updates."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and type(v) is torch.Tensor and v.shape == p.shape \
                        and v.stride() != p.stride():
                    state[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)
