"""Exact estimates at more micro-batches from the traces already made, without tracing again.

For one plan but the micro-batch ``B`` (precision, optimizer, block policies, whether it
accumulates), a traced step is usually the same program at every ``B``: the same ledger events
(:mod:`.ledger`) in the same order, each byte count ``a + b x B`` with integers ``a`` and ``b``
(activations, their gradients and the batch grow with ``B``; weights, gradients and optimizer
state do not). The events keep the bytes requested, before the allocator models round them, and
the operands of kernel scratch (:mod:`.scratch`), whose sizes are not affine in ``B``; replaying
the events of another ``B`` through fresh allocator models (:func:`.ledger.replay`) gives the
estimate a trace would, for a small fraction of its cost.

When it is trusted. Not every combination is one program in ``B``: offloaded blocks keep saved
tensors under 1 MiB on the device (a threshold crossed as ``B`` grows), ``B = 1`` makes size-1
dimensions (other strides and broadcasts), and a kernel may choose its path by size. So an
estimate at ``B`` is replayed only *between* traced micro-batches: when the traced ``B >= 2`` of
the combination that run consecutively around ``B`` -- at least three, one each side of it --
have the same events and every byte count of theirs lies on one line with an integer slope;
anything else is traced (and its events join the evidence). Why between: a decision that flips
once as ``B`` grows (a size threshold) takes the same side at both ends of the run only if it
takes it everywhere in between; a count that is convex or concave in ``B`` (a maximum of lines,
a product of two dimensions that grow with it) is affine on the whole run when it is on three
of its points. What this does not prove: a choice that flips back and forth as ``B`` grows (by
divisibility, say) inside the trace's own control flow; none is known in the traced step (the
reduction staging's launch configuration is one, and is recomputed from its operands).
``tests/test_replay.py`` compares replayed estimates with traced ones.
"""

from __future__ import annotations

import bisect
import importlib

import torch

from ..devices import DeviceProfile
from ..plan import Plan
from .allocator import ALLOCATORS, make_allocator
from .ledger import Ledger, replay

_estimate = importlib.import_module(".estimate", __package__)  # its estimate() read at call time
MIN_POINTS = 3  # traced micro-batches on one line around a replayed one (two ends and a check)
stats = {"traced": 0, "replayed": 0}


def split(log: list) -> tuple[tuple, list[int]]:
    """``log``'s events without their byte counts (a hashable skeleton), and the counts in order
    (``"m"`` events' bytes, ``"s"`` events' operands)."""
    skeleton, numbers = [], []
    for e in log:
        op = e[0]
        if op == "m":
            skeleton.append(("m", e[2]))
            numbers.append(e[1])
        elif op == "s":
            skeleton.append(("s", len(e[1]), len(e[2])))
            numbers += e[1]
            numbers += e[2]
        else:
            skeleton.append(e)
    return tuple(skeleton), numbers


def join(skeleton: tuple, numbers) -> list:
    """The log of ``skeleton`` with the byte counts ``numbers`` (the inverse of :func:`split`)."""
    it = iter(numbers)
    out = []
    for e in skeleton:
        op = e[0]
        if op == "m":
            out.append(("m", next(it), e[1]))
        elif op == "s":
            out.append(("s", tuple(next(it) for _ in range(e[1])), tuple(next(it) for _ in range(e[2]))))
        else:
            out.append(e)
    return out


def interpolated(points: list[tuple[int, tuple, list[int]]], micro_batch: int) -> list | None:
    """The log at ``micro_batch`` from traced ``(B, skeleton, numbers)`` points (sorted by B),
    or None where it is not proven (module doc): the points around ``micro_batch`` must share
    one skeleton, count at least :data:`MIN_POINTS` with one on each side, and have every number
    on one line with an integer slope (bytes per sample)."""
    i = bisect.bisect_left(points, micro_batch, key=lambda p: p[0])
    if i == 0 or i == len(points) or points[i][0] == micro_batch:
        return None  # not strictly between two traced micro-batches
    skeleton = points[i - 1][1]
    lo, hi = i - 1, i
    while lo > 0 and points[lo - 1][1] == skeleton:
        lo -= 1
    while hi + 1 < len(points) and points[hi + 1][1] == skeleton:
        hi += 1
    if points[i][1] != skeleton or hi - lo + 1 < MIN_POINTS:
        return None
    (b0, _, n0), (b1, _, n1) = points[lo], points[hi]
    slopes = []
    for x, y in zip(n0, n1):
        slope, rest = divmod(y - x, b1 - b0)
        if rest:
            return None
        slopes.append(slope)
    for b, _, n in points[lo + 1:hi]:  # the run's inner points: on the line too
        if any(x + s * (b - b0) != z for x, s, z in zip(n0, slopes, n)):
            return None
    return join(skeleton, [x + s * (micro_batch - b0) for x, s in zip(n0, slopes)])


class Replayer:
    """Exact estimates of one model and example batch (:func:`.estimate.estimate`): traced,
    or replayed from earlier traces where that is proven to give the same (module doc).

    Args:
        model, example_batch, device, allocator: as :func:`.estimate.estimate` takes them.

    Attributes:
        traced, replayed: how many estimates were traced and replayed.
    """

    def __init__(self, model: torch.nn.Module, example_batch: dict, device: DeviceProfile | None = None,
                 allocator: str = "expandable"):
        self.model, self.example_batch, self.device, self.allocator = model, example_batch, device, allocator
        self._points: dict[tuple, list] = {}  # combination -> sorted [(B, skeleton, numbers)]
        self._policies: dict[tuple, tuple] = {}  # combination -> every block's policy, as traced
        self.traced = self.replayed = 0

    def estimate(self, plan: Plan, checkpoint_blocks=None, block_policies=None):
        """The :class:`~.estimate.MemoryEstimate` :func:`.estimate.estimate` gives for these
        arguments (``allocator`` and ``device``: the replayer's).

        Raises:
            What :func:`.estimate.estimate` raises.
        """
        key = _combination(plan, checkpoint_blocks, block_policies)
        points = self._points.setdefault(key, [])
        log = interpolated(points, plan.micro_batch) if plan.micro_batch >= 2 else None
        if log is not None:
            self.replayed += 1
            stats["replayed"] += 1
            others = [k for k in ALLOCATORS if k != self.allocator]
            ledger = replay(log, Ledger(make_allocator(self.allocator), [make_allocator(k) for k in others],
                                        self.device))
            return _estimate.from_ledger(ledger, plan, self._policies[key], self.allocator)
        log = []
        est = _estimate.estimate(self.model, self.example_batch, plan, self.device, checkpoint_blocks,
                                 self.allocator, block_policies, log=log)
        self.traced += 1
        stats["traced"] += 1
        if plan.micro_batch >= 2 and all(b != plan.micro_batch for b, _, _ in points):  # size-1 dims: apart
            skeleton, numbers = split(log)
            same = next((p[1] for p in points if p[1] == skeleton), skeleton)  # one skeleton object kept
            bisect.insort(points, (plan.micro_batch, same, numbers), key=lambda p: p[0])
            self._policies[key] = _policies(est)
        return est


def _combination(plan: Plan, checkpoint_blocks, block_policies) -> tuple:
    """What a trace depends on besides the micro-batch (and the effective batch, beyond whether
    the step accumulates)."""
    def frozen(x):
        return x if x is None or isinstance(x, str) else tuple(x)

    return (plan.precision, plan.optimizer, plan.accumulation_steps > 1, plan.activation_checkpointing,
            frozen(plan.block_policies), frozen(checkpoint_blocks), frozen(block_policies))


def _policies(est) -> tuple[str, ...]:
    """Every block's policy as ``est`` was traced (its plan names the blocks recomputed fully
    unless it mixes policies)."""
    if est.plan.get("block_policies") is not None:
        return tuple(est.plan["block_policies"])
    full = set(est.plan["checkpoint_blocks"])
    return tuple("full" if i in full else "none" for i in range(len(est.extra["block_forward_bytes"])))
