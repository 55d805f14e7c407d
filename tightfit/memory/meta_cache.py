"""Skip repeated meta kernels: the output layout of an aten op on meta tensors, reused.

A traced step calls the same ops on the same shapes over and over: every block of a stack, the
second step, the next estimate at the same micro-batch. On the meta device an op computes
nothing but its outputs' shapes, strides and dtypes, mostly in Python reference code (~2.6 s
per BERT-large step, most of a plan's time). Two kinds of ops are answered without their kernel
once a call with the same inputs has run it:

- an op that allocates fresh outputs -- no mutation, no output aliasing an input, plain meta
  tensors in and out: those layouts depend only on the inputs' layouts and the other arguments,
  so the first call's are stored and later calls get new empty tensors of the same layouts;
- an in-place op (``mul_``, ``add_``, ...: it writes ``self`` and returns it) whose first call
  returned ``self`` with its shape, strides, offset, dtype and storage unchanged: on meta tensors
  it does nothing else, so later calls return ``self`` (autograd bumps the version counter above
  this level either way).

The key of a call (:func:`_key`) holds, per op, the default dtype and every argument: a tensor
as (shape, strides, dtype, storage offset), a scalar with its type (1, 1.0 and True stay apart),
lists and tuples item by item; anything else (another device, a sparse or subclass tensor, an
unknown object) makes the call uncacheable. The allocations the tracker sees are the same, in
the same order; ``tests/test_meta_cache.py`` checks estimates byte for byte with and without it.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

MAX_ENTRIES = 200_000  # layouts kept (a few hundred bytes each); the cache restarts when full

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_EXACT_SCALARS = frozenset((float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                            torch.memory_format))
_TENSOR, _PARAMETER, _STRIDED, _META = torch.Tensor, torch.nn.Parameter, torch.strided, torch.device("meta")
_empty_strided, _default_dtype = torch.empty_strided, torch.get_default_dtype
_UNCACHEABLE = object()
# torch.Tag.inplace may be missing from an older supported torch (the suspected cause of the GPU
# planner tests' AttributeError on torch 2.11); without it the schema alone says "writes self,
# returns self, aliases nothing else"
_INPLACE_TAG = getattr(torch.Tag, "inplace", None)
_SAME_SELF = object()  # an in-place call's entry: it returns its first argument, unchanged
_PLAIN = "plain"  # an op's kind: always run its kernel (views, out= variants, anything else)
_FRESH, _INPLACE = "fresh", "inplace"
_ops: dict = {}  # id(op) -> (kind, {key: entry}); aten overloads live as long as the process
_size = [0]  # entries over all ops
stats = {"hits": 0, "misses": 0}
enabled = True  # off: every call runs its meta kernel (the tests compare both)


def _kind(func) -> str:
    """:data:`_FRESH`, :data:`_INPLACE` or :data:`_PLAIN`, from ``func``'s schema."""
    schema = getattr(func, "_schema", None)  # None: not an aten overload (e.g. a higher-order op)
    if schema is None:
        return _PLAIN
    args, returns = schema.arguments, schema.returns
    if not schema.is_mutable and all(r.alias_info is None for r in returns) \
            and all(a.alias_info is None for a in args):
        return _FRESH
    tags = getattr(func, "tags", ())
    self_info = args[0].alias_info if args and args[0].name == "self" else None
    if (_INPLACE_TAG is None or _INPLACE_TAG in tags) and torch.Tag.inplace_view not in tags \
            and self_info is not None and self_info.is_write and all(a.alias_info is None for a in args[1:]) \
            and len(returns) == 1 and returns[0].alias_info is not None \
            and returns[0].alias_info.before_set == self_info.before_set:
        return _INPLACE  # writes self only, returns self (checked again on the first call)
    return _PLAIN


def _items(xs) -> list | None:
    """One hashable description per item of ``xs`` (a tuple, list or dict's values), or None
    when one is not plain. A meta tensor: ``(shape, strides, dtype, storage offset)``; an int:
    itself; another scalar: ``(type, value)``; a list or tuple: ``(type, *items)``; a dict:
    ``(dict, keys, *values)``. No two kinds of item can compare equal (an int is no tuple; the
    tuples start with a torch.Size or a type), so equal descriptions mean equal arguments.
    (A hand-written walk: torch's pytree costs more than the meta kernels it saves.)"""
    out = []
    for x in xs:
        t = type(x)
        if t is _TENSOR or t is _PARAMETER:
            if not x.is_meta or x.layout is not _STRIDED:  # is_meta: a tenth of device.type's cost
                return None
            out.append((x.shape, x.stride(), x.dtype, x.storage_offset()))
        elif t is int:
            out.append(x)
        elif t in _EXACT_SCALARS:
            out.append((t, x))  # 1.0 and True apart from 1
        elif t is list or t is tuple:
            inner = _items(x)
            if inner is None:
                return None
            out.append((t, *inner))
        elif t is dict:
            inner = _items(x.values())
            if inner is None:
                return None
            out.append((dict, tuple(x), *inner))
        elif isinstance(x, _SCALARS):  # a subclass of a scalar type (an IntEnum, ...)
            out.append((t, x))
        else:
            return None
    return out


def _key(args, kwargs) -> tuple | None:
    """Hashable description of a call's arguments (the op is the table's), or None when an
    argument is not plain."""
    described = _items(args)
    if described is None:
        return None
    if not kwargs:
        return _default_dtype(), *described
    values = _items(kwargs.values())
    return None if values is None else (_default_dtype(), *described, tuple(kwargs), *values)


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
    """The outputs' layouts -- ``(shape, strides, dtype)`` for one tensor, else ``(kind,
    entries)`` for a tuple/list of tensors and scalars -- or _UNCACHEABLE when one is not a
    fresh, whole, plain meta tensor."""
    inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.layout == torch.strided}
    seen: set = set()
    if type(out) not in (tuple, list):
        if not isinstance(out, torch.Tensor) or not _fresh(out, inputs, seen):
            return _UNCACHEABLE
        return tuple(out.shape), out.stride(), out.dtype
    entries = []
    for t in out:
        if isinstance(t, torch.Tensor):
            if not _fresh(t, inputs, seen):
                return _UNCACHEABLE
            entries.append((True, tuple(t.shape), t.stride(), t.dtype))
        elif isinstance(t, _SCALARS):
            entries.append((False, t))
        else:
            return _UNCACHEABLE
    return type(out), entries


def _state(x: torch.Tensor) -> tuple:
    """What an in-place op must leave as it was: layout and storage (object and bytes)."""
    st = x.untyped_storage()
    return x.shape, x.stride(), x.storage_offset(), x.dtype, id(st), st.nbytes()


def _same_self(func, args, kwargs):
    """Run in-place ``func``; :data:`_SAME_SELF` if it returned its first argument with nothing
    of :func:`_state` changed, else _UNCACHEABLE; with the output."""
    before = _state(args[0])
    out = func(*args, **kwargs)
    return (_SAME_SELF if out is args[0] and _state(out) == before else _UNCACHEABLE), out


def call(func, args, kwargs):
    """``func(*args, **kwargs)`` on meta tensors, answered from an earlier call with the same
    key where there was one (see the module doc).

    Returns:
        What ``func`` returns: for a fresh-output op, new meta tensors of the stored shapes,
        strides and dtypes; for an in-place op, its first argument.
    """
    kwargs = kwargs or {}
    op = _ops.get(id(func))
    if op is None:
        op = _ops[id(func)] = (_kind(func), {})
    kind, table = op
    key = _key(args, kwargs) if enabled and kind is not _PLAIN else None
    if key is None:
        return func(*args, **kwargs)
    entry = table.get(key)
    if entry is None:
        if kind is _INPLACE:
            entry, out = _same_self(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
            entry = _layout(out, args, kwargs)
        if _size[0] >= MAX_ENTRIES:
            clear_layouts()
        table[key] = entry
        _size[0] += 1
        stats["misses"] += 1
        return out
    if entry is _UNCACHEABLE:
        return func(*args, **kwargs)
    stats["hits"] += 1
    if entry is _SAME_SELF:
        return args[0]
    if len(entry) == 3:  # one tensor
        return _empty_strided(entry[0], entry[1], dtype=entry[2], device=_META)
    kind, entries = entry
    return kind([_empty_strided(x[1], x[2], dtype=x[3], device=_META) if x[0] else x[1] for x in entries])


def clear_layouts() -> None:
    """Forget every stored entry (the op kinds are kept: they depend on the op only)."""
    for _, table in _ops.values():
        table.clear()
    _size[0] = 0


def clear() -> None:
    """Forget every stored layout and the counts (tests compare runs with and without it)."""
    clear_layouts()
    stats.update(hits=0, misses=0)
