"""A model's repeated blocks (transformer layers, ResNet bottlenecks), and checkpointing of all
or some of them.

Checkpointing wraps each chosen block's ``forward`` in the non-reentrant
``torch.utils.checkpoint.checkpoint`` (as the Hugging Face hook does for whole models): the
block keeps only its inputs for backward and recomputes the rest, with the same dropout masks
(the RNG state is restored), and it works when the inputs do not require grad.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict

import torch

from ..errors import TightfitError

_ORIG = "_tightfit_forward"


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model`` in forward order.

    Candidates are the children of ``nn.ModuleList``/``nn.Sequential`` containers, grouped by
    class; among the classes holding at least 90% of the parameters of the largest group,
    the one with the most instances wins (ResNet: the 16 bottleneck layers rather than the 4
    stages; BERT: its layers). Returns ``[]`` for a model without such containers.
    """
    groups: dict[type, list[torch.nn.Module]] = defaultdict(list)
    seen = set()
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            for child in module.children():
                if id(child) not in seen and any(True for _ in child.parameters()):
                    seen.add(id(child))
                    groups[type(child)].append(child)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return []
    size = {k: sum(p.numel() for m in v for p in m.parameters()) for k, v in groups.items()}
    top = max(size.values())
    best = max((k for k in groups if size[k] >= 0.9 * top), key=lambda k: (len(groups[k]), size[k]))
    return groups[best]


def parse_checkpointing(spec: str | None, n_blocks: int) -> tuple[int, ...]:
    """Read ``none``, ``all`` or comma-separated block indices into the sorted indices to checkpoint.

    Raises:
        TightfitError: malformed text, or an index outside ``[0, n_blocks)``.
    """
    text = "none" if spec is None else spec.strip().lower()
    if text in ("none", "off"):
        return ()
    if text in ("all", "on"):
        if n_blocks == 0:
            raise TightfitError("this model has no repeated blocks to checkpoint")
        return tuple(range(n_blocks))
    try:
        idx = sorted({int(x) for x in text.split(",")})
    except ValueError:
        raise TightfitError(f"--checkpointing takes none, all or block indices like 0,2,5; got {spec!r}") from None
    bad = [i for i in idx if not 0 <= i < n_blocks]
    if bad or not idx:
        raise TightfitError(f"block indices {bad or spec!r} out of range: the model has {n_blocks} blocks (0-{n_blocks - 1})")
    return tuple(idx)


def apply_checkpointing(model: torch.nn.Module, indices, recompute_context=None) -> list[torch.nn.Module]:
    """Checkpoint exactly the blocks ``indices`` of :func:`find_blocks` (others run normally).

    Args:
        indices: block indices, ``"all"``, ``"none"`` or a spec string for :func:`parse_checkpointing`.
        recompute_context: optional zero-argument callable giving a context entered around each
            recomputation (the estimator re-enters its CUDA emulation there, since torch-function
            modes are not active inside the autograd engine).

    Returns:
        The model's blocks.

    Raises:
        TightfitError: bad indices.
    """
    blocks = find_blocks(model)
    if isinstance(indices, str):
        indices = parse_checkpointing(indices, len(blocks))
    chosen = set(indices)
    if chosen and not blocks:
        raise TightfitError(f"{type(model).__name__} has no repeated blocks to checkpoint")
    for i, block in enumerate(blocks):
        wrapped = _ORIG in block.__dict__
        if wrapped and i in chosen:  # re-wrap: the recompute context may have changed
            del block.forward
            block.forward = functools.partial(_checkpointed, block.__dict__[_ORIG], recompute_context)
        elif i in chosen:
            original = block.forward
            block.__dict__[_ORIG] = original
            block.forward = functools.partial(_checkpointed, original, recompute_context)
        elif i not in chosen and wrapped:
            del block.forward
            del block.__dict__[_ORIG]
    return blocks


def is_checkpointed(block: torch.nn.Module) -> bool:
    """Whether :func:`apply_checkpointing` wraps ``block``."""
    return _ORIG in block.__dict__


def _checkpointed(forward, recompute_context, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    if recompute_context is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), recompute_context()), **kwargs)


# Model attribute naming the modules that tightfit.levers.compile compiled (kept here, beside the
# blocks, so that checkpointing can ask without importing the compile lever).
COMPILED_MARK = "_tightfit_compiled"


def compiled_by_blocks(model: torch.nn.Module) -> bool:
    """Whether :func:`tightfit.levers.compile.compile_model` compiled ``model``'s blocks one by
    one (not the whole model)."""
    modules = model.__dict__.get(COMPILED_MARK)
    return bool(modules) and modules[0] is not model
