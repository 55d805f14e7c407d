"""Estimate a training step's peak GPU memory without a GPU.

The runtime's step, :func:`tightfit.step.training_step` (forward under autocast, backward,
clipping, optimizer step, ``zero_grad``) with the plan's optimizer, runs twice on a
meta-device copy of the model -- the first step allocates the optimizer state, the second
runs forward and backward with that state held, which is where the peak of every later step
lies; with gradient accumulation (``plan.accumulation_steps > 1``) it runs two micro-batches, so
that the second's forward and backward run with the window's gradients held.
:class:`~.cuda_autocast.CudaOnMeta` makes the trace allocate what CUDA would;
:class:`~.tracker.AllocationTracker` replays every allocation through a model of the caching
allocator (:mod:`.allocator`: expandable segments, as tightfit's runtime configures it, or the
default configuration), so the result is the peak of
``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over those steps.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..devices import DeviceProfile
from ..errors import TightfitError
from ..plan import Plan
from ..units import MiB, format_bytes
from ..levers.blocks import apply_block_policies, check_block_indices, find_blocks, parse_checkpointing
from ..levers.optimizers import cast_weights
from .cuda_autocast import CpuOnMeta, CudaOnMeta, fused_attention_running
from ..step import OPTIMIZERS, MetaOptimizer, make_optimizer, training_loss, training_step
from .allocator import ALLOCATORS, make_allocator
from .ledger import Ledger
from .tracker import COMPONENTS, AllocationTracker

STEPS = 2


def handle_workspace_bytes(profile: DeviceProfile | None) -> list[int]:
    """Allocations cuBLAS keeps for the step's lifetime: one workspace per thread that runs
    matrix products (the forward's and the autograd engine's), plus cuBLASLt's 1 MiB.

    Workspace per handle: 32 MiB on compute capability >= 9.0 (NVIDIA's cuBLAS guidance for
    Hopper, PyTorch's default there), else PyTorch's default ``:4096:2:16:8`` = 8 MiB + 128 KiB.
    Measured on an NVIDIA H200 (torch 2.11): 65 MiB in all. ``profile`` None: the Hopper sizes
    (the largest, so the estimate errs high).
    """
    cc = profile.compute_capability if profile is not None else (9, 0)
    per_thread = 32 * MiB if cc >= (9, 0) else 8 * MiB + 128 * 1024
    return [per_thread, per_thread, 1 * MiB]


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted peak memory of one training step on a CUDA GPU.

    Attributes:
        peak_allocated_bytes: peak of ``torch.cuda.max_memory_allocated`` (bytes in blocks).
        peak_reserved_bytes: peak of ``torch.cuda.max_memory_reserved`` (bytes in segments).
        breakdown: bytes per component at the allocated peak -- ``parameters``, ``gradients``,
            ``optimizer_state``, ``activations`` (everything the forward leaves alive: saved for
            backward, the batch, the loss), ``temporaries`` (backward/optimizer temporaries and
            cuBLAS workspaces) and ``allocator_overhead`` (reserved minus allocated peak), so the
            values sum to ``peak_reserved_bytes``.
        plan: the plan estimated (``Plan.to_dict()`` plus ``checkpoint_blocks``).
        first_step_peak_reserved_bytes: peak reserved of the first step alone.
        allocator: the allocator configuration modelled, ``"expandable"`` or ``"default"``.
        extra: ``first_step_peak_allocated_bytes`` and ``by_allocator``: for every modelled
            configuration (:data:`~.allocator.ALLOCATORS`), its ``peak_allocated_bytes`` and
            ``peak_reserved_bytes`` for the same trace; ``start``: per configuration, the
            ``allocated_bytes`` and ``reserved_bytes`` once workspaces, parameters and the batch
            are allocated, before the first step; ``block_forward_bytes``: per block of
            :func:`tightfit.levers.blocks.find_blocks`, how many allocated bytes the forward of the last step
            gained from entering that block to entering the next (to leaving it, for the last
            block) -- what the block leaves alive for backward, net of what it frees;
            ``forward_backward_peak_bytes``: peak allocated bytes of the last step's forward,
            backward and clipping; ``optimizer_step_peak_bytes``: that of its optimizer step and
            ``zero_grad``. ``peak_allocated_bytes`` is the larger of the two (the first step,
            holding no optimizer state during its forward and backward, peaks lower).
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    breakdown: dict
    plan: dict
    first_step_peak_reserved_bytes: int = 0
    allocator: str = "expandable"
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready: ``peak_allocated_bytes``, ``peak_reserved_bytes``, ``breakdown``, ``plan``,
        ``allocator``, ``first_step_peak_reserved_bytes``."""
        return {"peak_allocated_bytes": self.peak_allocated_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "breakdown": dict(self.breakdown), "plan": dict(self.plan), "allocator": self.allocator,
                "first_step_peak_reserved_bytes": self.first_step_peak_reserved_bytes}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """Human-readable lines (GiB/MiB)."""
        lines = [f"peak reserved   {format_bytes(self.peak_reserved_bytes)}",
                 f"peak allocated  {format_bytes(self.peak_allocated_bytes)}"]
        lines += [f"  {k:<20}{format_bytes(v)}" for k, v in self.breakdown.items()]
        return "\n".join(lines)


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes,
    dtypes and ``requires_grad`` (tied parameters stay tied); the weights are not copied."""
    memo = {}
    for p in model.parameters():
        memo.setdefault(id(p), torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    return _deepcopy_module(model, memo)


_Module = torch.nn.Module
_EMPTY_CONTAINERS = (dict, OrderedDict, set)
# nn.Module's own fields (hook dicts and the like): every module has its own, never shared
_MODULE_FIELDS = frozenset(torch.nn.Module().__dict__)


def _deepcopy_module(module: torch.nn.Module, memo: dict) -> torch.nn.Module:
    """``copy.deepcopy(module, memo)``, with the modules of the tree copied directly: a module
    whose class keeps ``nn.Module``'s pickling protocol gets its ``__dict__`` entry by entry, its
    own empty hook dicts (``nn.Module``'s fields, never shared) new and empty, its children by
    this function, everything else by ``copy.deepcopy`` with the same ``memo`` (so shared objects
    stay shared, as deepcopy keeps them). Other modules go through ``copy.deepcopy``. Why: deepcopy rebuilds each of a module's
    ~15 empty hook dicts through ``__reduce_ex__``, ~0.1 s per copy of BERT-large, paid by every
    exact estimate."""
    if id(module) in memo:
        return memo[id(module)]
    cls = type(module)
    if (cls.__getstate__ is not _Module.__getstate__ or cls.__setstate__ is not _Module.__setstate__
            or cls.__reduce_ex__ is not object.__reduce_ex__ or cls.__reduce__ is not object.__reduce__
            or hasattr(cls, "__deepcopy__") or hasattr(cls, "__slots__")):
        return copy.deepcopy(module, memo)
    new = cls.__new__(cls)
    memo[id(module)] = new
    state = {}
    for k, v in module.__getstate__().items():
        if k == "_modules":
            state[k] = type(v)((n, None if c is None else _deepcopy_module(c, memo)) for n, c in v.items())
        elif k in _MODULE_FIELDS and type(v) in _EMPTY_CONTAINERS and not v:
            state[k] = type(v)()
        else:
            state[k] = copy.deepcopy(v, memo)
    new.__setstate__(state)
    return new


def _apply_order(module: torch.nn.Module, seen: set):
    """Parameters and buffers in the order ``Module.to`` moves them (children first)."""
    for child in module.children():
        yield from _apply_order(child, seen)
    for t in list(module._parameters.values()) + list(module._buffers.values()):
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            yield t


def _meta_batch(batch: dict, micro_batch: int) -> dict:
    if not isinstance(batch, dict) or not batch:
        raise TightfitError("the example batch must be a non-empty dict of tensors")
    if "labels" not in batch:  # the traced loss is cross-entropy on them
        raise TightfitError("the example batch has no 'labels' (class ids [B] or next-token targets [B, T]): the "
                            "estimate traces the step's cross-entropy loss on them")
    out = {}
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            raise TightfitError(f"example batch entry {k!r} must be a tensor with a batch dimension")
        out[k] = torch.empty((micro_batch, *v.shape[1:]), dtype=v.dtype, device="meta")
    return out


def estimate(model: torch.nn.Module, example_batch: dict, plan: Plan, device: DeviceProfile | None = None,
             checkpoint_blocks=None, allocator: str = "expandable", block_policies=None,
             log: list | None = None, host: bool = False) -> MemoryEstimate:
    """Predict peak allocated/reserved GPU memory of a training step, on any machine.

    Args:
        model: the ``nn.Module`` (any device, meta included; it is not modified -- a meta copy
            is traced). Its ``forward(**batch_without_labels)`` must return ``.logits``.
        example_batch: dict of tensors with a leading batch dimension, ``labels`` included
            (``[B]`` class targets or ``[B, T]`` next-token targets); only shapes and dtypes
            are used, resized to ``plan.micro_batch``. Unpadded batches are assumed.
        plan: precision, micro-batch, optimizer (:data:`tightfit.step.OPTIMIZERS`) and
            ``activation_checkpointing`` (all blocks) are read.
        device: the GPU profile (sets the cuBLAS workspace size); None: Hopper-sized.
        checkpoint_blocks: block indices in ``[0, blocks)`` (or ``"all"``/``"none"``/a spec string) to
            checkpoint, overriding ``plan.activation_checkpointing``; see :func:`tightfit.levers.blocks.find_blocks`.
        allocator: the caching allocator's configuration: ``"expandable"``
            (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, what tightfit's runtime sets)
            or ``"default"``. The other configuration's peaks are in ``extra["by_allocator"]``.
        block_policies: one choice per block (``none|selective|full|offload``,
            :data:`tightfit.levers.blocks.BLOCK_POLICIES`), overriding ``checkpoint_blocks`` and
            the plan; recomputed blocks replay what they keep exactly (selective: the outputs of
            the matrix products and the attention kernel), offloaded blocks drop their saved
            tensors after the forward and allocate them again in backward.
        log: a list the trace's accounting is appended to (:data:`.ledger.EVENTS`): replayed by
            :func:`from_ledger`, it gives this estimate again (:mod:`.replay` answers other
            micro-batches from it). None: not recorded.
        host: trace the step as the CPU runs it (:class:`~.cuda_autocast.CpuOnMeta`: its dropout
            and attention kernels, no cuBLAS workspaces), for a CPU run's host memory.

    Returns:
        A :class:`MemoryEstimate` (peak over two steps; see the module doc).

    Raises:
        TightfitError: malformed batch, unknown optimizer or allocator, bad block indices (not whole
            numbers, negative or past the model's blocks: :func:`~tightfit.levers.blocks.check_block_indices`)
            or policies.
    """
    # One piece on purpose (over 60 lines): the order of the allocations traced below is the order
    # the GPU makes them in, and reading it top to bottom is how the estimate is checked.
    if allocator not in ALLOCATORS:
        raise TightfitError(f"unknown allocator {allocator!r}: use one of {', '.join(ALLOCATORS)}")
    if plan.optimizer not in OPTIMIZERS:
        raise TightfitError(f"unknown optimizer {plan.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    meta = cast_weights(meta_copy(model), plan.optimizer)  # adamw8bit-bf16: the runtime's bf16 weights
    for m in meta.modules():  # train mode, as meta.train() sets it without a model's own train(): transformers'
        m.training = True      # (with the `kernels` package installed) kernelizes there, refusing the meta device
    n_blocks = len(find_blocks(meta))
    if block_policies is None and checkpoint_blocks is None and plan.block_policies is not None:
        block_policies = plan.block_policies
    if block_policies is None:
        if checkpoint_blocks is None:
            checkpoint_blocks = "all" if plan.activation_checkpointing else "none"
        indices = parse_checkpointing(checkpoint_blocks, n_blocks) if isinstance(checkpoint_blocks, str) \
            else check_block_indices(checkpoint_blocks, n_blocks)
        block_policies = ["full" if i in indices else "none" for i in range(n_blocks)]
    block_policies = tuple(block_policies)
    on_meta = CpuOnMeta if host else CudaOnMeta
    blocks = apply_block_policies(meta, block_policies, recompute_context=lambda: on_meta(plan.precision),
                                  also_saved=fused_attention_running)
    batch = _meta_batch(example_batch, plan.micro_batch)

    others = [k for k in ALLOCATORS if k != allocator]
    tracker = AllocationTracker(make_allocator(allocator), [make_allocator(k) for k in others], device, log)
    emulation = on_meta(plan.precision)
    params = [p for p in _apply_order(meta, set()) if isinstance(p, torch.nn.Parameter)]
    with tracker, emulation:
        workspaces = [torch.empty(n, dtype=torch.uint8, device="meta")
                      for n in ([] if host else handle_workspace_bytes(device))]
        for w in workspaces:
            tracker.track(w, "temporaries")
        keep = [t for t in _apply_order(meta, set())]
        for t in keep:
            tracker.track(t, "parameters")
        for v in batch.values():
            tracker.track(v, "activations")
        tracker.note("start")
        hooks = [p.register_post_accumulate_grad_hook(lambda p: tracker.relabel(p.grad, "gradients"))
                 for p in params if p.requires_grad]
        # allocated bytes entering each block, and leaving the last: notes ("block", i)
        for i, block in enumerate(blocks):
            hooks.append(block.register_forward_pre_hook(functools.partial(_mark, i, tracker)))
        if blocks:
            hooks.append(blocks[-1].register_forward_hook(functools.partial(_mark, len(blocks), tracker)))
        optimizer = make_optimizer(params, plan.optimizer, "meta",  # a MetaOptimizer of the plan's kind
                                   accumulating=plan.accumulation_steps > 1)
        for step in range(STEPS):
            tracker.restart_window()
            # unpadded micro-batches: their mean loss is the runtime's loss_sum / count; no loss
            # scaling is traced (its few 0-d tensors are left out). With accumulation the last step
            # runs two: the second's forward and backward run with the window's gradients held,
            # as every later micro-batch of a window does
            n = 2 if plan.accumulation_steps > 1 and step == STEPS - 1 else 1
            training_step(meta, [batch] * n, training_loss, n, _LabelledOptimizer(optimizer, tracker), None,
                          lambda: _forward_region(emulation, tracker), max_grad_norm=1.0)
            if step == 0:
                tracker.note("first_step")
        tracker.note("optimizer")  # the last step's optimizer step and zero_grad
        for h in hooks:
            h.remove()
    return from_ledger(tracker, plan, block_policies, allocator)


def from_ledger(ledger: Ledger, plan: Plan, block_policies: tuple[str, ...], allocator: str = "expandable") \
        -> MemoryEstimate:
    """The :class:`MemoryEstimate` of a traced step from its accounting: the tracker after the
    trace, or a :class:`~.ledger.Ledger` that replayed its log (:func:`.ledger.replay`).

    Args:
        ledger: fed every event of the step, with the notes :func:`estimate` takes.
        plan: the plan traced (``to_dict()`` goes into the estimate).
        block_policies: the policy of every block, as traced.
        allocator: the configuration of ``ledger.allocator`` (the shadows are the others, in
            :data:`~.allocator.ALLOCATORS` order).

    Raises:
        KeyError: a ledger without the notes of a whole step.
    """
    others = [k for k in ALLOCATORS if k != allocator]
    notes = ledger.notes
    indices = tuple(i for i, p in enumerate(block_policies) if p in ("full", "selective"))
    alloc = ledger.allocator
    peak = dict(ledger.peak_breakdown)
    peak["activations"] = peak.get("activations", 0) + peak.pop("forward", 0)  # peak inside a forward
    breakdown = {k: int(peak.get(k, 0)) for k in COMPONENTS}
    breakdown["allocator_overhead"] = alloc.peak_reserved - alloc.peak_allocated
    plan_dict = plan.to_dict()
    plan_dict["checkpoint_blocks"] = list(indices)
    plan_dict["activation_checkpointing"] = bool(indices)  # what was traced, whatever the plan said
    plan_dict["block_policies"] = list(block_policies) if set(block_policies) - {"none", "full"} else None
    by_allocator = {k: {"peak_allocated_bytes": a.peak_allocated, "peak_reserved_bytes": a.peak_reserved}
                    for k, a in zip([allocator] + others, [alloc] + ledger.shadows)}
    start = {k: {"allocated_bytes": m[0], "reserved_bytes": m[1]}
             for k, m in zip([allocator] + others, notes["start"][2])}
    first = notes["first_step"][2][0]
    blocks = len(block_policies)
    marks = [notes[("block", i)][0] if ("block", i) in notes else 0 for i in range(blocks + 1)]
    return MemoryEstimate(alloc.peak_allocated, alloc.peak_reserved, breakdown, plan_dict, first[3],
                          allocator, {"first_step_peak_allocated_bytes": first[2],
                                      "by_allocator": by_allocator, "start": start,
                                      "block_forward_bytes": [b - a for a, b in zip(marks, marks[1:])],
                                      "forward_backward_peak_bytes": notes["forward_backward"][1],
                                      "optimizer_step_peak_bytes": notes["optimizer"][1]})


def _mark(i: int, tracker: AllocationTracker, *args) -> None:
    tracker.note(("block", i))


class _forward_region:
    """Autocast region of the forward; what the forward leaves alive becomes 'activations'."""

    def __init__(self, emulation: CudaOnMeta, tracker: AllocationTracker):
        self.emulation, self.tracker = emulation, tracker

    def __enter__(self):
        self.tracker.label = "forward"
        self._ctx = self.emulation.forward_region()
        self._ctx.__enter__()

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self.tracker.relabel_all("forward", "activations")
        self.tracker.label = "temporaries"
        return False


class _LabelledOptimizer:
    """Wraps :class:`MetaOptimizer` so that its allocations are labelled optimizer state."""

    def __init__(self, optimizer: MetaOptimizer, tracker: AllocationTracker):
        self.optimizer, self.tracker = optimizer, tracker
        self.param_groups = optimizer.param_groups
        optimizer.temporaries_context = self._temporaries

    @contextlib.contextmanager
    def _temporaries(self):
        label, self.tracker.label = self.tracker.label, "temporaries"
        try:
            yield
        finally:
            self.tracker.label = label

    def step(self):
        self.tracker.note("forward_backward")  # the peak of the step now running, before its optimizer step
        self.tracker.restart_window()
        self.tracker.label = "optimizer_state"
        try:
            self.optimizer.step()
        finally:
            self.tracker.label = "temporaries"

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)
