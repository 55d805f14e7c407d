"""A checkpoint's trainer state in two parts: its structure (``state.pt``, ``torch.save``) and its
tensors' bytes (``state.safetensors``).

Why: checkpoints are written on a background thread while the training loop goes on, and
``torch.save`` holds Python's GIL while it writes tensor bytes, so a loop bound by its host (a
small model's eager step) stalled while the optimizer state was written: a thread launching
small ops ran at 0.55-0.67 of its speed during ``torch.save`` of AdamW's state on a 2-core host
(0.47 on a 16-core GPU host), 0.98-1.08 during safetensors' ``save_file`` of the same bytes
(``bench/results/checkpoint-gil``, ``bench/results/session-2026-12-06b``).
So the structure keeps a ``meta`` tensor of the same shape and dtype in place of each tensor
(a few KiB, written with the GIL held briefly) and the bytes go to safetensors.

Tensors are numbered in the order :func:`map_tensors` walks the state (dicts in their order,
lists and tuples, a tensor subclass's inner tensors in ``__tensor_flatten__``'s order), which is
the same when the structure is read back, since pickle keeps dicts' order. A tensor safetensors cannot
hold (a dtype it lacks, a non-contiguous one) stays in the structure, written by ``torch.save``.
A ``state.pt`` of an older tightfit holds every tensor itself and has no placeholder: it is read
as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# dtypes safetensors stores (0.8, pyproject's floor, stores more: those stay in the structure)
_STORABLE = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
             torch.bfloat16, torch.float32, torch.float64}


def map_tensors(v, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``v`` (a state: dicts, lists, tuples, tensors, other values) with every plain tensor ``t`` in
    it replaced by ``fn(t)``, in walk order (the module docstring's); a tensor subclass is rebuilt
    around its mapped inner tensors (its type and context kept). The one walk of a checkpoint's
    state: the snapshot's copies to host memory and the split into structure and tensors."""
    if isinstance(v, torch.Tensor):
        if is_traceable_wrapper_subclass(v):
            names, ctx = v.__tensor_flatten__()
            return type(v).__tensor_unflatten__({n: map_tensors(getattr(v, n), fn) for n in names}, ctx,
                                                v.size(), v.stride())
        return fn(v)
    if isinstance(v, dict):
        return {k: map_tensors(x, fn) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(map_tensors(x, fn) for x in v)
    return v


def _storable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype in _STORABLE and t.is_contiguous()


def split_state(state: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(structure, tensors)``: ``state`` with each storable CPU tensor replaced by a ``meta``
    tensor of its shape and dtype, and those tensors by name (``"0"``, ``"1"``, ... in walk order)
    for ``safetensors.torch.save_file``. The tensors are ``state``'s own (not copied)."""
    tensors: dict[str, torch.Tensor] = {}

    def out(t: torch.Tensor) -> torch.Tensor:
        if not _storable(t):
            return t
        tensors[str(len(tensors))] = t
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    return map_tensors(state, out), tensors


def join_state(structure, tensors: dict[str, torch.Tensor] | None):
    """Inverse of :func:`split_state`: ``structure`` with its ``meta`` placeholders replaced, in walk
    order, by ``tensors`` (as ``safetensors.torch.load_file`` gives them). None: ``structure`` has
    no placeholders (an older tightfit's ``state.pt``), returned as it is.

    Raises:
        ValueError: the placeholders and the tensors do not match (count, shape or dtype).
    """
    tensors, taken = tensors or {}, [0]

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            return t
        name = str(taken[0])
        taken[0] += 1
        real = tensors.get(name)
        if real is None:
            raise ValueError(f"tensor {name} of the state is missing")
        if real.shape != t.shape or real.dtype != t.dtype:
            raise ValueError(f"tensor {name} is {real.dtype} {tuple(real.shape)}, the state says "
                             f"{t.dtype} {tuple(t.shape)}")
        return real

    joined = map_tensors(structure, fill)
    if taken[0] != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for the state's {taken[0]} places")
    return joined
