"""``torch.compile`` as a lever: fewer, fused kernels per micro-batch.

On a fast GPU a small or checkpointed micro-batch is bound by the CPU that launches its
kernels (tens of microseconds per eager op); TorchInductor fuses the element-wise ops
(bias, GELU, dropout, residual adds, LayerNorm) into a few Triton kernels, which cuts the
fixed cost per micro-batch and keeps fewer intermediates for backward (less activation memory).
The model is compiled in place (``nn.Module.compile``), so its ``state_dict`` keys do not change.

The batch dimension is marked dynamic (``torch._dynamo.maybe_mark_dynamic``) so that one
compiled graph serves every micro-batch size: the short last micro-batch of a window and the
halved micro-batch after an out-of-memory recovery do not recompile.
See https://pytorch.org/docs/stable/torch.compiler.html.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


def compile_unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` is not used on ``device_type`` (None: it can be).

    Only CUDA devices with Triton are considered: on the CPU TorchInductor needs a C++
    compiler and the step is compute-bound, so compiling gains little for its minutes.
    """
    if device_type != "cuda":
        return "compilation is used on CUDA GPUs only"
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - very old torch
        return "this torch has no Triton support"
    if not has_triton():
        return "Triton is not installed"
    return None


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` was compiled in place by :func:`compile_model`."""
    return getattr(model, "_compiled_call_impl", None) is not None


def compile_model(model: torch.nn.Module) -> None:
    """Compile ``model``'s forward in place with TorchInductor (default mode: no CUDA graphs,
    whose private memory pool would sit outside the planned budget). Every call marks the
    micro-batch dimension of its tensor arguments dynamic before entering the compiled code.
    Compilation itself happens at the first call. A second call does nothing."""
    if is_compiled(model):
        return
    model.compile()
    compiled = model._compiled_call_impl

    def call(*args, **kwargs):  # runs outside the compiled region, where marking takes effect
        _mark_batch_dynamic(tree_leaves((args, kwargs)))
        return compiled(*args, **kwargs)

    model._compiled_call_impl = call


def uncompile_model(model: torch.nn.Module) -> None:
    """Undo :func:`compile_model`: the eager forward runs again."""
    if is_compiled(model):
        model._compiled_call_impl = None


def _mark_batch_dynamic(values) -> None:
    """Mark dimension 0 (the micro-batch) of every tensor in ``values`` dynamic for the compiler,
    so micro-batches of other sizes reuse the compiled graph."""
    for v in values:
        if torch.is_tensor(v) and v.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(v, 0)
