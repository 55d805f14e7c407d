"""Skip repeated meta kernels: the output layout of an aten op on meta tensors, reused.

A traced step calls the same ops on the same shapes over and over: every block of a stack, the
second step, the next estimate at the same micro-batch. On the meta device an op computes
nothing but its outputs' shapes, strides and dtypes, mostly in Python reference code (~2.6 s
per BERT-large step, most of a plan's time). For an op that allocates fresh outputs -- no
mutation, no output aliasing an input, plain meta tensors in and out -- those layouts depend only
on the inputs' layouts and the other arguments, so the first call's are stored and later calls
get new empty tensors of the same layouts. The allocations the tracker sees are the same, in the
same order; ``tests/test_meta_cache.py`` checks estimates byte for byte with and without it.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

MAX_ENTRIES = 200_000  # layouts kept (a few hundred bytes each); the cache restarts when full

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNCACHEABLE = object()
_cache: dict = {}
_fresh_ops: dict = {}  # op -> whether its schema makes fresh outputs (no mutation, no alias)
stats = {"hits": 0, "misses": 0}
enabled = True  # off: every call runs its meta kernel (the tests compare both)


def _makes_fresh_outputs(func) -> bool:
    fresh = _fresh_ops.get(func)
    if fresh is None:
        schema = getattr(func, "_schema", None)  # None: not an aten overload (e.g. a higher-order op)
        fresh = (schema is not None and not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
                 and all(a.alias_info is None for a in schema.arguments))
        _fresh_ops[func] = fresh
    return fresh


def _describe(x, parts: list) -> bool:
    """Append a hashable description of ``x`` to ``parts``; False when ``x`` is not plain.
    (A hand-written walk: torch's pytree costs more than the meta kernels it saves.)"""
    t = type(x)
    if t is torch.Tensor or t is torch.nn.Parameter:
        if not x.is_meta or x.layout != torch.strided:  # is_meta: a tenth of device.type's cost
            return False
        parts.append((tuple(x.shape), x.stride(), x.dtype, x.storage_offset()))
        return True
    if t is list or t is tuple:
        parts.append((t, len(x)))
        return all(_describe(y, parts) for y in x)
    if t is dict:
        parts.append((dict, tuple(x)))
        return all(_describe(y, parts) for y in x.values())
    if isinstance(x, _SCALARS):
        parts.append((t, x))  # 1 and 1.0 and True stay apart
        return True
    return False


def _key(func, args, kwargs):
    """Hashable description of the call, or None when an argument is not plain."""
    parts = [func, torch.get_default_dtype()]
    return tuple(parts) if _describe(args, parts) and _describe(kwargs, parts) else None


def _fresh(t, inputs: set, seen: set) -> bool:
    """``t`` is a plain meta tensor of a new storage of its own, exactly its size."""
    if type(t) is not torch.Tensor or t.device.type != "meta" or t.layout != torch.strided:
        return False
    st = t.untyped_storage()
    if id(st) in inputs or id(st) in seen or t.storage_offset() != 0 or t.requires_grad:
        return False
    seen.add(id(st))
    return st.nbytes() == torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta").untyped_storage().nbytes()


def _layout(out, args, kwargs):
    """The outputs' layouts -- ``(kind, entries)`` for a tensor or a tuple/list of tensors and
    scalars -- or _UNCACHEABLE when one is not a fresh, whole, plain meta tensor."""
    inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.layout == torch.strided}
    seen: set = set()
    kind, items = (type(out), out) if type(out) in (tuple, list) else (None, [out])
    entries = []
    for t in items:
        if isinstance(t, torch.Tensor):
            if not _fresh(t, inputs, seen):
                return _UNCACHEABLE
            entries.append((True, tuple(t.shape), t.stride(), t.dtype))
        elif isinstance(t, _SCALARS):
            entries.append((False, t))
        else:
            return _UNCACHEABLE
    return kind, entries


def call(func, args, kwargs):
    """``func(*args, **kwargs)`` on meta tensors, with the outputs' layouts taken from an
    earlier identical call when there was one (see the module doc).

    Returns:
        What ``func`` returns: new meta tensors of the stored shapes, strides and dtypes.
    """
    kwargs = kwargs or {}
    key = _key(func, args, kwargs) if enabled and _makes_fresh_outputs(func) else None
    if key is None:
        return func(*args, **kwargs)
    entry = _cache.get(key)
    if entry is None:
        out = func(*args, **kwargs)
        if len(_cache) >= MAX_ENTRIES:
            _cache.clear()
        _cache[key] = _layout(out, args, kwargs)
        stats["misses"] += 1
        return out
    if entry is _UNCACHEABLE:
        return func(*args, **kwargs)
    stats["hits"] += 1
    kind, entries = entry
    made = [torch.empty_strided(x[1], x[2], dtype=x[3], device="meta") if x[0] else x[1] for x in entries]
    return made[0] if kind is None else kind(made)


def clear() -> None:
    """Forget every stored layout (tests compare runs with and without it)."""
    _cache.clear()
    stats.update(hits=0, misses=0)
