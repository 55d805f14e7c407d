"""Selective activation checkpointing: inside a checkpointed block, keep the outputs of the
expensive ops (matrix products, attention, convolutions) and recompute only the cheap ones
(layer norms, activations, dropout, residual adds) in backward.

Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (PyTorch's selective
checkpointing, "SAC"): the non-reentrant checkpoint caches the outputs of the ops the policy
saves and reruns the others, restoring the RNG state first, so dropout masks are recomputed
identically (DESIGN invariant 4). See
https://pytorch.org/docs/stable/checkpoint.html#torch.utils.checkpoint.create_selective_checkpoint_contexts

Restoring the RNG state at the start of the recomputation is not enough when a saved op draws
random numbers: on CUDA the fused attention kernels (``_scaled_dot_product_efficient_attention``,
flash, cuDNN) apply attention dropout themselves and advance the Philox offset, and since the
recomputation takes their output from the cache instead of running them, every later dropout of
the block would draw from an offset too early: other masks than the forward's, wrong gradients.
:class:`_ReplayRandomState` puts the generator where the forward left it after each random op.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
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
        if _tracing():  # the compiler replays random ops itself (functionalized RNG) and wants the modes alone
            return forward, recompute
        states: list = []  # the generator states after each random op of this forward
        forward = _both(forward, _ReplayRandomState(states, record=True))
        recompute = _both(recompute, _ReplayRandomState(states, record=False))
        if recompute_context is None:
            return forward, recompute
        return forward, _both(recompute, recompute_context())

    return context_fn


class _ReplayRandomState(TorchDispatchMode):
    """Entered above the selective checkpoint's own dispatch modes: in the forward
    (``record=True``) it keeps the default generator's state after each op that draws random
    numbers (ATen tag ``nondeterministic_seeded``); in the recomputation it sets the generator
    to that state after the same op, whether the op ran again or came from the cache (module doc).
    Meta and fake tensors draw nothing and are left alone."""

    def __init__(self, states: list, record: bool):
        super().__init__()
        self.states, self.record, self.index = states, record, 0

    def __enter__(self):
        self.index = 0  # a second backward (retain_graph) replays from the start
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            generator = _default_generator(args, kwargs)
            if generator is not None:
                if self.record:
                    self.states.append(generator.get_state())
                elif self.index < len(self.states):  # more random ops than recorded: SAC raises
                    generator.set_state(self.states[self.index])
                self.index += 1
        return out


def _tracing() -> bool:
    """Whether dynamo or AOTAutograd is tracing (the test of ``torch.utils.checkpoint``)."""
    return torch.compiler.is_compiling() or \
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None


def _default_generator(args, kwargs) -> torch.Generator | None:
    """The default generator an op with these arguments draws from (that of its first tensor's
    device), or None for meta and fake tensors, other devices, and while compiling."""
    if _tracing():
        return None
    tensor = next((a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)), None)
    if tensor is not None:
        from torch._subclasses.fake_tensor import FakeTensor
        if isinstance(tensor, FakeTensor):
            return None
        device = tensor.device
    else:
        device = torch.device(kwargs.get("device") or "cpu")  # a factory op
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]
    return None  # meta (the estimator's trace) and other devices


class _both:
    """Enter ``first`` then ``second`` (exit in reverse); re-enterable as dispatch modes are."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __enter__(self):
        self.first.__enter__()
        try:
            self.second.__enter__()
        except BaseException:
            self.first.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.second.__exit__(*exc)
        finally:
            self.first.__exit__(*exc)
        return False
