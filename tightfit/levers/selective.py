"""Selective activation checkpointing: inside a checkpointed block, keep the outputs of the
expensive ops (matrix products, attention, convolutions) and recompute only the cheap ones
(layer norms, activations, dropout, residual adds) in backward.

Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (PyTorch's selective
checkpointing, "SAC"): the non-reentrant checkpoint caches the outputs of the ops the policy
saves and reruns the others, restoring the RNG state first, so dropout masks are recomputed
identically (DESIGN invariant 4). See
https://pytorch.org/docs/stable/checkpoint.html#torch.utils.checkpoint.create_selective_checkpoint_contexts
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    """The ATen overload packets that exist in this torch (newer ones may be missing in older)."""
    return frozenset(getattr(_aten, n) for n in names if hasattr(_aten, n))


# Ops whose outputs a selectively checkpointed block keeps: the FLOP-heavy ones, whose
# recomputation would cost as much as the forward itself.
SAVED_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_flash_attention_forward", "_efficient_attention_forward")


def is_saved(func) -> bool:
    """Whether the selective policy keeps the output of the ATen op ``func`` (an ``OpOverload``)."""
    return getattr(func, "overloadpacket", func) in SAVED_OPS


def selective_context_fn(recompute_context=None, also_saved=None):
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for selective recomputation.

    Args:
        recompute_context: optional zero-argument callable giving one more context entered
            around the recomputation (the estimator's CUDA emulation).
        also_saved: optional zero-argument callable; when it returns True the op now running is
            saved whatever it is (the estimator's stand-in for a fused attention kernel,
            which allocates through ``empty``).

    Returns:
        A zero-argument callable returning ``(forward_context, recompute_context)``.
    """
    def policy(ctx, func, *args, **kwargs):
        if is_saved(func) or (also_saved is not None and also_saved()):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        forward, recompute = create_selective_checkpoint_contexts(policy)
        if recompute_context is None:
            return forward, recompute
        return forward, _both(recompute, recompute_context())

    return context_fn


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield
