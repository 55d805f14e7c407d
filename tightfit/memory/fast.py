"""How a training step's peak memory grows with the micro-batch: the planner's one memory-growth
model, fitted to a few exact estimates so that the search can ask about any micro-batch and any
number of checkpointed blocks without tracing each.

The model. A step's peak reserved bytes at micro-batch ``B`` are a sum of tensor sizes that are
either independent of ``B`` (weights, gradients, optimizer state, workspaces) or proportional to
it (activations, the batch, temporaries), rounded by the caching allocator: an affine function
``intercept + slope x B`` up to that rounding (:class:`MemoryLine`). Two exact estimates, at
micro-batches 4 and 16 (:meth:`MemoryLine.traced`), give the line of one checkpointing choice.
Checkpointing removes the saved activations of each block it covers, so the line of ``k``
checkpointed blocks (the first ``k``) is taken ``k / n`` of the way from the line of no block to
the line of all ``n`` (:class:`BlockLines`, :meth:`MemoryLine.blend`).

Accuracy, and who checks it. The line is exact at the two traced micro-batches. The true peak
is the larger of several phases (end of the forward, recomputation in backward, the optimizer
step), each affine in ``B``: a convex function, so between 4 and 16 the line lies on or above
it and beyond 16 it may lie below; below 4 it extrapolates, and at micro-batch = effective batch
the step holds no gradients across micro-batches while the traced (accumulating) points do.
Blocks also differ (the first ones hold their activations longest). The search therefore uses
the line only to enumerate and rank, and traces every plan it returns exactly
(:mod:`tightfit.planner.search`); ``tests/test_estimate.py`` measures the line against exact
estimates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# Micro-batches of the two exact estimates a line is fitted to.
TRACED_AT = (4, 16)


@dataclass(frozen=True)
class MemoryLine:
    """Predicted peak reserved bytes ``intercept + slope x micro_batch`` of one step.

    Attributes:
        intercept: bytes at micro-batch 0.
        slope: bytes per sample.
    """

    intercept: float
    slope: float

    @classmethod
    def traced(cls, estimate_fn: Callable, precision: str, blocks: tuple[int, ...], at=TRACED_AT) -> "MemoryLine":
        """The line through exact estimates at the two micro-batches ``at``.

        Args:
            estimate_fn: ``(precision, micro_batch, checkpoint_blocks) -> MemoryEstimate``.
            precision: ``fp32|fp16|bf16``; ``blocks``: the checkpointed blocks (indices).
            at: two different micro-batches.

        Raises:
            What ``estimate_fn`` raises.
        """
        a, b = (estimate_fn(precision, m, blocks).peak_reserved_bytes for m in at)
        slope = (b - a) / (at[1] - at[0])
        return cls(a - slope * at[0], slope)

    def blend(self, other: "MemoryLine", f: float) -> "MemoryLine":
        """The line a share ``f`` (0 to 1) of the way to ``other``."""
        return MemoryLine(self.intercept + f * (other.intercept - self.intercept),
                          self.slope + f * (other.slope - self.slope))

    def reserved(self, micro_batch: int) -> float:
        """Predicted peak reserved bytes at ``micro_batch`` samples."""
        return self.intercept + self.slope * micro_batch

    def largest_fitting(self, limit: float, upper: int) -> int:
        """Largest micro-batch in ``[1, upper]`` whose predicted peak is at most ``limit`` bytes
        (0: none)."""
        if self.slope <= 0:
            return upper if self.reserved(upper) <= limit else 0
        return max(0, min(upper, int((limit - self.intercept) / self.slope)))


@dataclass(frozen=True)
class BlockLines:
    """The memory lines of one precision for every number of checkpointed blocks from ``first``
    to ``last`` (the first blocks first): exact lines at both ends, blended in between.

    Attributes:
        first, last: the fewest and most blocks checkpointed (equal when only one is searched).
        fewest, most: the lines traced with ``first`` and ``last`` blocks checkpointed.
    """

    first: int
    last: int
    fewest: MemoryLine
    most: MemoryLine

    @classmethod
    def traced(cls, estimate_fn: Callable, precision: str, first: int, last: int) -> "BlockLines":
        """Trace the lines of ``first`` and ``last`` checkpointed blocks (two exact estimates
        each; one line when ``first == last``).

        Raises:
            What ``estimate_fn`` raises.
        """
        fewest = MemoryLine.traced(estimate_fn, precision, tuple(range(first)))
        most = MemoryLine.traced(estimate_fn, precision, tuple(range(last))) if last != first else fewest
        return cls(first, last, fewest, most)

    def __call__(self, k: int) -> MemoryLine:
        """The line of the first ``k`` blocks checkpointed (``first <= k <= last``)."""
        if self.last == self.first:
            return self.fewest
        return self.fewest.blend(self.most, (k - self.first) / (self.last - self.first))
