"""The planner's fast path: peak memory for any micro-batch and any set of checkpointed blocks
from four traces, without tracing again.

:func:`fit` traces the step (:func:`.estimate.estimate`) at two micro-batch sizes ``lo < hi``,
once with no block checkpointed and once with all of them, and keeps, per trace:

- ``F``: the peak allocated bytes of the forward, backward and clipping of a steady-state step;
- ``O``: the peak allocated bytes of its optimizer step (parameters, gradients, optimizer state,
  the batch);
- ``g_i``: per block ``i`` (:func:`tightfit.levers.blocks.find_blocks`), the allocated bytes the forward gains
  across that block -- what the block leaves alive for backward.

Every one of these is an affine function of the micro-batch ``B`` (sums of tensor sizes that are
either independent of ``B`` or proportional to it, up to the allocator's 512-byte rounding), so
two sizes give each line. The per-block saving of checkpointing block ``i`` is
``s_i(B) = g_i(B, none) - g_i(B, all)``. For a set ``S`` of checkpointed blocks, with ``j`` the last
block of ``S``:

- no block checkpointed: ``F = F_none(B)``; all: ``F = F_all(B)``;
- otherwise ``F = max(F_none(B) - sum_{i in S} s_i(B), F_all(B) + sum_{i not in S, i < j} s_i(B))``:
  the end of the forward holds everything the non-checkpointed blocks save; the recomputation of
  block ``j`` in backward happens while the blocks before ``j`` still hold their saved tensors
  (blocks after ``j`` have finished their backward), as in the all-checkpointed trace at its peak;
- peak allocated ``= max(F, O(B))``.

Peak reserved is the predicted peak allocated plus the largest ``reserved - allocated`` of the
traces of the same checkpointing (none, all; for a subset, of all four traces): the allocator's
overhead is not additive per block or per sample, and taking the largest errs high.

Accuracy: exact at the traced points. The true peak is the larger of several phases, each affine
in ``B`` (a convex function of ``B``), so between ``lo`` and ``hi`` the lines lie on or above it
(errs high) and beyond ``hi`` they may lie below it: fit with ``hi`` at least the largest
micro-batch to be asked. Blocks are assumed to run in the order of :func:`tightfit.levers.blocks.find_blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TightfitError
from ..plan import Plan

_KEYS = ("forward_backward_peak_bytes", "optimizer_step_peak_bytes")


def _line(x0: int, y0: float, x1: int, y1: float):
    slope = (y1 - y0) / (x1 - x0)
    return (y0 - slope * x0, slope)


def _at(line, b: int) -> float:
    return line[0] + line[1] * b


@dataclass(frozen=True)
class FastMemoryModel:
    """Affine-in-micro-batch memory lines of one workload and precision (see the module doc).

    Attributes:
        n_blocks: the model's blocks (:func:`tightfit.levers.blocks.find_blocks`).
        micro_batches: ``(lo, hi)``, the traced sizes.
        forward_backward: ``{"none": line, "all": line}``, ``line = (bytes at B=0, bytes per sample)``.
        optimizer_step: line of the optimizer step's peak allocated bytes.
        block_saving: per block, the line of bytes saved by checkpointing it.
        overhead_bytes: ``{"none": bytes, "all": bytes, "some": bytes}``, the largest
            ``peak_reserved - peak_allocated`` of the traces with no, all, or either checkpointing.
        allocator: the allocator configuration modelled.
    """

    n_blocks: int
    micro_batches: tuple
    forward_backward: dict
    optimizer_step: tuple
    block_saving: tuple
    overhead_bytes: dict
    allocator: str

    def peak_allocated_bytes(self, micro_batch: int, checkpoint_blocks=()) -> int:
        """Predicted peak allocated bytes for ``micro_batch`` (>= 1) samples with the blocks
        ``checkpoint_blocks`` (indices) checkpointed.

        Raises:
            TightfitError: micro-batch < 1 or a block index outside ``[0, n_blocks)``.
        """
        if micro_batch < 1:
            raise TightfitError(f"micro-batch must be >= 1, got {micro_batch}")
        chosen = set(checkpoint_blocks)
        if any(not 0 <= i < self.n_blocks for i in chosen):
            raise TightfitError(f"block indices {sorted(chosen)} out of range: the model has {self.n_blocks} blocks")
        b = micro_batch
        if not chosen:
            fb = _at(self.forward_backward["none"], b)
        elif len(chosen) == self.n_blocks:
            fb = _at(self.forward_backward["all"], b)
        else:
            save = [_at(line, b) for line in self.block_saving]
            last = max(chosen)
            fb = max(_at(self.forward_backward["none"], b) - sum(save[i] for i in chosen),
                     _at(self.forward_backward["all"], b) + sum(save[i] for i in range(last) if i not in chosen))
        return int(round(max(fb, _at(self.optimizer_step, b))))

    def peak_reserved_bytes(self, micro_batch: int, checkpoint_blocks=()) -> int:
        """Predicted peak reserved bytes: peak allocated plus the traces' largest allocator overhead.

        Raises:
            TightfitError: as :meth:`peak_allocated_bytes`.
        """
        chosen = set(checkpoint_blocks)
        kind = "none" if not chosen else "all" if len(chosen) == self.n_blocks else "some"
        return self.peak_allocated_bytes(micro_batch, chosen) + self.overhead_bytes[kind]


def fit(model, example_batch: dict, plan: Plan, device=None, micro_batches=(4, 16),
        allocator: str = "expandable") -> FastMemoryModel:
    """Trace ``model`` at two micro-batch sizes with no and with all blocks checkpointed (four
    traces; two for a model without blocks) and return the :class:`FastMemoryModel`.

    Args:
        model, example_batch, device, allocator: as for :func:`.estimate.estimate`.
        plan: precision and optimizer are read (its micro-batch and checkpointing are not).
        micro_batches: ``(lo, hi)`` with ``1 <= lo < hi``; predictions are exact there and err
            high between them.

    Raises:
        TightfitError: ``micro_batches`` not two increasing sizes >= 1, or what
            :func:`.estimate.estimate` raises.
    """
    from ..levers.blocks import find_blocks
    from .estimate import estimate, meta_copy

    lo, hi = micro_batches
    if not 1 <= lo < hi:
        raise TightfitError(f"micro_batches must be two sizes 1 <= lo < hi, got {micro_batches}")
    n_blocks = len(find_blocks(meta_copy(model)))
    runs = {}
    for ckpt in (("none", "all") if n_blocks else ("none",)):
        for b in (lo, hi):
            p = Plan(plan.precision, b, b, optimizer=plan.optimizer)
            runs[ckpt, b] = estimate(model, example_batch, p, device, checkpoint_blocks=ckpt, allocator=allocator)

    def line(ckpt, get):
        return _line(lo, get(runs[ckpt, lo]), hi, get(runs[ckpt, hi]))

    fb = {c: line(c, lambda e: e.extra[_KEYS[0]]) for c in {k for k, _ in runs}}
    fb.setdefault("all", fb["none"])
    saving = tuple(
        _line(lo, runs["none", lo].extra["block_forward_bytes"][i] - runs["all", lo].extra["block_forward_bytes"][i],
              hi, runs["none", hi].extra["block_forward_bytes"][i] - runs["all", hi].extra["block_forward_bytes"][i])
        for i in range(n_blocks))
    return FastMemoryModel(
        n_blocks=n_blocks, micro_batches=(lo, hi), forward_backward=fb,
        optimizer_step=line("none", lambda e: e.extra[_KEYS[1]]), block_saving=saving,
        overhead_bytes=_overheads(runs),
        allocator=allocator)


def _overheads(runs: dict) -> dict:
    over = {k: e.peak_reserved_bytes - e.peak_allocated_bytes for k, e in runs.items()}
    by = {c: max(v for (k, _), v in over.items() if k == c) for c in {k for k, _ in over}}
    by.setdefault("all", by["none"])
    return {"none": by["none"], "all": by["all"], "some": max(over.values())}
