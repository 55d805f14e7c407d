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


def use_channels_last(model: torch.nn.Module, device_type: str) -> str | None:
    """Store ``model``'s 4-D parameters and buffers channels-last, in place, where it pays: on a
    CUDA device, for a model with 2-D convolutions. Inputs need no change (a convolution whose
    weight is channels-last returns channels-last output).

    Args:
        model: the model, already on its device.
        device_type: ``"cuda"`` or ``"cpu"`` (the CPU is left as it is: its convolutions gain
            little and the CPU runs are the reference).

    Returns:
        A line for the log saying what was done, or None when nothing was (also when the model
        is channels-last already).
    """
    n = convolutions(model)
    if device_type != "cuda" or n == 0:
        return None
    four_d = [t for t in list(model.parameters()) + list(model.buffers()) if t.dim() == 4]
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
