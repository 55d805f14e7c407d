"""A model's repeated blocks (transformer layers, ResNet bottlenecks), and what each keeps for
backward: its saved activations (``none``), only its inputs and the outputs of its matrix
products and attention (``selective``), only its inputs (``full``), or everything in pinned
host memory (``offload``).

Recomputation wraps a block's ``forward`` in the non-reentrant
``torch.utils.checkpoint.checkpoint`` (as the Hugging Face hook does for whole models), fully or
with a selective policy (:mod:`.selective`): the block recomputes with the same dropout masks
(the RNG state is restored), and it works when the inputs do not require grad. Offload runs the
block's forward under :class:`~.offload.HostOffload`.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import re
from collections import defaultdict

import torch

from ..buffers import buffer_modules
from ..errors import TightfitError

_ORIG = "_tightfit_forward"
_POLICY = "_tightfit_block_policy"
_KEPT = "_tightfit_buffer_modules"

# What a block keeps for backward, least memory-saving first: "none" saves its activations,
# "selective" recomputes the cheap ops, "full" everything, "offload" keeps them on the host.
BLOCK_POLICIES = ("none", "selective", "full", "offload")


def describe_policies(policies) -> str:
    """Per-block choices as runs of consecutive blocks, for display: ``("full",) * 23 +
    ("selective",)`` -> ``"0-22 full, 23 selective"`` (one word per block is unreadable at 24)."""
    runs, start = [], 0
    for i in range(1, len(policies) + 1):
        if i == len(policies) or policies[i] != policies[start]:
            runs.append(f"{start}{'' if i - 1 == start else f'-{i - 1}'} {policies[start]}")
            start = i
    return ", ".join(runs)


def parse_policies(spec: str, n_blocks: int) -> tuple[str, ...]:
    """One policy per block from ``spec``: one word per block, apart by commas or spaces
    (``"full,full,selective"``, ``"full full selective"``, or the JSON list ``tightfit plan --json``
    prints, ``'["full", "full", "selective"]'``) or runs as :func:`describe_policies` shows them
    (``"0-22 full, 23 selective"``, as ``tightfit plan`` prints them, its leading ``blocks`` too).

    Raises:
        TightfitError: an unknown policy, a malformed run, a block named twice or left out, or as
            many words as blocks not given.
    """
    words = [w for w in re.split(r"[\s,\[\]\"']+", spec) if w]
    if words and not re.search(r"\d", spec):  # no block numbers: one word per block, however they are apart
        unknown = [w for w in words if w not in BLOCK_POLICIES]
        if unknown:
            raise TightfitError(f"block policies {spec!r}: unknown policy {unknown[0]!r}: use one of "
                                f"{', '.join(BLOCK_POLICIES)}, one per block, or runs such as '0-3 full'")
        items = words
    else:
        items = [x.strip() for x in re.sub(r"^\s*blocks\s+", "", spec).split(",") if x.strip()]  # the plan line's word
    if all(x in BLOCK_POLICIES for x in items):
        if len(items) != n_blocks:
            raise TightfitError(f"{len(items)} block polic{'y' if len(items) == 1 else 'ies'} for a model with "
                                f"{n_blocks} blocks: give one per block, "
                                f"or runs such as '0-{n_blocks - 1} full'")
        return tuple(items)
    policies: list[str | None] = [None] * n_blocks
    for item in items:
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?\s+(\w+)", item)
        if not m:
            what = (f"a policy without its blocks: give one word per block, or runs of blocks such as '0-3 {item}', "
                    "not both") if item in BLOCK_POLICIES else \
                f"neither a policy ({', '.join(BLOCK_POLICIES)}) nor a run of blocks such as '0-3 full'"
            raise TightfitError(f"block policies {spec!r}: {item!r} is {what}")
        first, last, policy = int(m.group(1)), int(m.group(2) or m.group(1)), m.group(3)
        if policy not in BLOCK_POLICIES:
            raise TightfitError(f"unknown block policy {policy!r}: use one of {', '.join(BLOCK_POLICIES)}")
        if first > last:
            raise TightfitError(f"block policies {spec!r}: {item.split()[0]} runs backwards; write {last}-{first}")
        if not first <= last < n_blocks:
            named = f"blocks {item.split()[0]} are" if first < last else f"block {first} is"
            raise TightfitError(f"block policies {spec!r}: {named} not among the model's {n_blocks} (0-{n_blocks - 1})")
        for i in range(first, last + 1):
            if policies[i] is not None:
                raise TightfitError(f"block policies {spec!r}: block {i} is given twice")
            policies[i] = policy
    missing = [i for i, p in enumerate(policies) if p is None]
    if missing:
        raise TightfitError(f"block policies {spec!r}: block {missing[0]} has none; give every block of the "
                            f"{n_blocks} (0-{n_blocks - 1}) one")
    return tuple(policies)


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of ``model`` in forward order.

    Candidates are the children of ``nn.ModuleList``/``nn.Sequential`` containers (not lists
    themselves, which have no forward to wrap), grouped by class; among the classes holding at
    least 90% of the parameters of the largest group, the one with the most instances wins
    (ResNet: the 16 bottleneck layers rather than the 4 stages; BERT: its layers). A second stack
    of another class beside those blocks (one list of them, held by another module than the one
    holding the blocks' list; modules of layers, not single ``Linear`` layers), neither inside nor around them,
    with at least :data:`OTHER_STACK_SHARE` of their parameters (an encoder-decoder's encoder
    layers) joins them, in registration order. Returns ``[]`` for a model without such containers.
    """
    groups: dict[type, list[torch.nn.Module]] = defaultdict(list)
    container = {}  # id(child) -> the list holding it (its first)
    for module in model.modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            for child in module.children():
                # a list nested in a list (Funnel's blocks of layers) is iterated, never called: a
                # wrapper on its forward would checkpoint nothing; its layers are the candidates
                if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                    continue
                if id(child) not in container and any(True for _ in child.parameters()):
                    container[id(child)] = module
                    groups[type(child)].append(child)
    groups = {k: v for k, v in groups.items() if len(v) >= 2}
    if not groups:
        return []
    size = {k: sum(p.numel() for m in v for p in m.parameters()) for k, v in groups.items()}
    top = max(size.values())
    best = max((k for k in groups if size[k] >= 0.9 * top), key=lambda k: (len(groups[k]), size[k]))
    # an encoder-decoder (BART: its encoder's and its decoder's layers are two classes) repeats two
    # kinds of block side by side: a group of another class, outside the chosen blocks and around none
    # of them, holding a comparable share of the parameters, is blocks too (else the encoder's layers
    # would count among the input layers: frozen by frozen-embeddings, never checkpointed)
    if len(groups) == 1:
        return groups[best]
    parent = {id(c): m for m in model.modules() for c in m.children()}
    chosen, taken = [best], {id(m) for b in groups[best] for m in b.modules()}
    owners = {id(parent.get(id(container[id(b)]))) for b in groups[best]}  # the modules holding the blocks' lists
    for k in groups:
        if k in chosen or size[k] < OTHER_STACK_SHARE * size[best] or not any(True for _ in groups[k][0].children()):
            continue  # a single layer (Linear, Conv1d) repeated in lists is no stack of blocks
        lists = {id(container[id(b)]) for b in groups[k]}
        if len(lists) != 1 or id(parent.get(id(container[id(groups[k][0])]))) in owners:
            continue  # a stack is one list, held by another module than the blocks' (XLM's attention and
            # feed-forward lists, side by side in one module, run interleaved: not a stack of their own)
        inside = {id(m) for b in groups[k] for m in b.modules()}
        if taken.isdisjoint(inside):  # neither within the chosen blocks (ResNet's conv layers) nor around them (stages)
            chosen.append(k)
            taken |= inside
    if len(chosen) == 1:
        return groups[best]
    members = {id(b) for c in chosen for b in groups[c]}
    return [m for m in model.modules() if id(m) in members]  # registration order: the encoder's first


#: the share of the chosen blocks' parameters a second, separate stack of blocks of another class
#: holds to count as blocks too (:func:`find_blocks`; BART's encoder layers hold 3/4 of its decoder's)
OTHER_STACK_SHARE = 0.25


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
        idx = [int(x) for x in text.split(",")]
    except ValueError:
        raise TightfitError(f"--checkpointing takes none, all or block indices like 0,2,5; got {spec!r}") from None
    return check_block_indices(idx, n_blocks)


def check_block_indices(indices, n_blocks: int) -> tuple[int, ...]:
    """The sorted, distinct block indices of ``indices``, each a whole number in ``[0, n_blocks)``
    (a negative index names no block: ``-1`` is not the last one).

    Raises:
        TightfitError: ``indices`` not a collection of whole numbers, or an index out of range.
    """
    try:
        idx = set(indices)
    except TypeError:
        raise TightfitError(f"block indices must be a collection of whole numbers (e.g. (0, 2)), "
                            f"not {indices!r}") from None
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) for i in idx):
        raise TightfitError(f"block indices must be whole numbers, not {sorted(idx, key=repr)!r}")
    bad = sorted(int(i) for i in idx if not 0 <= i < n_blocks)
    if bad:
        raise TightfitError(f"block indices {bad} out of range: the model has {n_blocks} blocks (0-{n_blocks - 1})"
                            if n_blocks else f"block indices {bad} out of range: this model has no repeated blocks")
    return tuple(sorted(int(i) for i in idx))


def apply_checkpointing(model: torch.nn.Module, indices, recompute_context=None, policy: str = "full",
                        also_saved=None) -> list[torch.nn.Module]:
    """Checkpoint exactly the blocks ``indices`` of :func:`find_blocks` with ``policy`` (others
    run normally).

    Args:
        indices: block indices, ``"all"``, ``"none"`` or a spec string for :func:`parse_checkpointing`.
        recompute_context: optional zero-argument callable giving a context entered around each
            recomputation (the estimator re-enters its CUDA emulation there, since torch-function
            modes are not active inside the autograd engine).
        policy: what the chosen blocks keep, one of :data:`BLOCK_POLICIES` (``"full"``: recompute).
        also_saved: for ``"selective"``, see :func:`.selective.selective_context_fn`.

    Returns:
        The model's blocks.

    Raises:
        TightfitError: bad indices or policy.
    """
    blocks = find_blocks(model)
    if isinstance(indices, str):
        indices = parse_checkpointing(indices, len(blocks))
    chosen = set(indices)
    return apply_block_policies(model, [policy if i in chosen else "none" for i in range(len(blocks))],
                                recompute_context, also_saved, blocks)


def apply_block_policies(model: torch.nn.Module, policies, recompute_context=None, also_saved=None,
                         blocks=None) -> list[torch.nn.Module]:
    """Give block ``i`` of :func:`find_blocks` the policy ``policies[i]`` (:data:`BLOCK_POLICIES`).

    Args:
        policies: one policy per block (a sequence as long as the model's blocks).
        recompute_context, also_saved: as in :func:`apply_checkpointing`.
        blocks: the model's blocks, if already found.

    Returns:
        The model's blocks.

    Raises:
        TightfitError: an unknown policy, or as many policies as blocks not given.
    """
    blocks = find_blocks(model) if blocks is None else blocks
    policies = tuple(policies)
    bad = sorted({p for p in policies if p not in BLOCK_POLICIES})
    if bad:
        raise TightfitError(f"unknown block policy {bad[0]!r}: use one of {', '.join(BLOCK_POLICIES)}")
    if any(p != "none" for p in policies) and not blocks:
        raise TightfitError(f"{type(model).__name__} has no repeated blocks to checkpoint")
    if len(policies) != len(blocks):
        raise TightfitError(f"{len(policies)} block policies for a model with {len(blocks)} blocks")
    for block, policy in zip(blocks, policies):
        if _ORIG in block.__dict__:  # unwrap an earlier choice (its recompute context may differ)
            del block.forward
            del block.__dict__[_ORIG]
            del block.__dict__[_POLICY]
            del block.__dict__[_KEPT]
        if policy != "none":
            original = block.forward
            kept = buffer_modules(block)
            block.__dict__[_ORIG] = original
            block.__dict__[_POLICY] = policy
            block.__dict__[_KEPT] = kept
            block.forward = functools.partial(_wrapped, original, policy, recompute_context, also_saved, kept)
    return blocks


def is_checkpointed(block: torch.nn.Module) -> bool:
    """Whether :func:`apply_block_policies` wraps ``block`` (any policy but ``"none"``)."""
    return _ORIG in block.__dict__


def block_policy(block: torch.nn.Module) -> str:
    """The policy :func:`apply_block_policies` gave ``block`` (:data:`BLOCK_POLICIES`)."""
    return block.__dict__.get(_POLICY, "none")


def block_buffers(block: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``block`` holding buffers a forward may update, as
    :func:`apply_block_policies` found them (:func:`tightfit.buffers.buffer_modules`; empty for a
    block it did not wrap)."""
    return block.__dict__.get(_KEPT, [])


def run_block(forward, policy: str, recompute_context, also_saved, kept, *args, **kwargs):
    """Call ``forward(*args, **kwargs)`` (a block's forward, eager or compiled) under ``policy``.

    ``kept``: the block's modules holding buffers a forward may update (:func:`block_buffers`),
    kept as they were before each recomputation (:class:`tightfit.buffers.KeptBuffers`): a
    recomputation runs the block's forward a second time in train mode, and BatchNorm would fold
    the same batch into its statistics twice (its momentum applied twice, ``num_batches_tracked``
    counted twice; a moving average of the user's own likewise), so that evaluation would differ
    from the same step not checkpointed.
    """
    from torch.utils.checkpoint import checkpoint, noop_context_fn

    if policy == "offload":
        from .offload import HostOffload
        with HostOffload():
            return forward(*args, **kwargs)
    from .selective import _tracing, selective_context_fn
    if policy == "selective":
        context_fn = selective_context_fn(recompute_context, also_saved)
    elif recompute_context is None:
        context_fn = None
    else:
        context_fn = lambda: (contextlib.nullcontext(), recompute_context())  # noqa: E731
    if kept and not _tracing():  # a compiled graph's checkpoint updates the buffers once already
        context_fn = _keeping_buffers(context_fn or noop_context_fn, kept)
    if context_fn is None:  # none given: dynamo takes no other (it compiles a checkpoint inside a graph)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _keeping_buffers(context_fn, kept):
    """``context_fn`` with :class:`~tightfit.buffers.KeptBuffers` entered outside its recomputation context
    (before a selective policy's mode, so that its copies are not taken for recomputed ops)."""
    from ..buffers import KeptBuffers
    from .selective import _both

    def fn():
        forward, recompute = context_fn()
        return forward, _both(KeptBuffers(kept), recompute)
    return fn


def _wrapped(forward, policy, recompute_context, also_saved, kept, *args, **kwargs):
    return run_block(forward, policy, recompute_context, also_saved, kept, *args, **kwargs)


# Model attribute naming the modules that tightfit.levers.compile compiled (kept here, beside the
# blocks, so that checkpointing can ask without importing the compile lever).
COMPILED_MARK = "_tightfit_compiled"


def compiled_by_blocks(model: torch.nn.Module) -> bool:
    """Whether :func:`tightfit.levers.compile.compile_model` compiled ``model``'s blocks one by
    one (not the whole model)."""
    modules = model.__dict__.get(COMPILED_MARK)
    return bool(modules) and modules[0] is not model
