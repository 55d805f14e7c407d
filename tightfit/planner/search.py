"""Plan search: the fastest plan whose predicted peak memory fits the budget.

For each precision the card allows and each number of checkpointed blocks (none, a quarter,
half, three quarters, all -- the first blocks first, since every block of a stack recomputes at
the same cost and the earliest hold their activations longest), find the largest micro-batch
that fits ``budget x (1 - headroom)`` (memory from the estimator, :mod:`tightfit.memory`),
balance it over the accumulation steps, and predict samples/s (:mod:`.cost`). The winner is the
fastest; the runners-up are the best of every other (precision, checkpointing) and say why they
lost. Memory for any micro-batch comes from two traces per (precision, checkpointing), since
every byte that grows with the micro-batch grows linearly; the winner is then traced exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

from ..devices import DeviceProfile
from ..errors import TightfitError
from ..levers.precision import check_precision, preferred_precision
from ..plan import Plan
from ..units import format_bytes
from .advice import nothing_fits_lines
from .cost import TimeModel, forward_cost

# Budget share left free for fragmentation growth over the first steps and for batches that
# differ from the traced one.
HEADROOM = 0.05


@dataclass(frozen=True)
class Candidate:
    """One evaluated plan.

    Attributes:
        precision, micro_batch, checkpoint_blocks: the choices (blocks by index); micro-batch
            and blocks are None for a precision that was not searched.
        accumulation_steps: ``ceil(effective_batch / micro_batch)`` (None: not searched).
        peak_reserved_bytes, peak_allocated_bytes: predicted peaks, bytes (None if not known).
        breakdown: bytes per component at the peak.
        samples_per_s: predicted throughput (0 if it does not fit or was not searched).
        why: why it lost (runners-up) or why it won.
    """

    precision: str
    micro_batch: int | None
    checkpoint_blocks: tuple[int, ...] | None
    accumulation_steps: int | None
    peak_reserved_bytes: int | None
    peak_allocated_bytes: int | None
    breakdown: dict = field(default_factory=dict)
    samples_per_s: float = 0.0
    why: str = ""

    @property
    def status(self) -> str:
        """``"fits"``, ``"does not fit"`` or ``"not searched"``."""
        if self.micro_batch is None:
            return "not searched"
        return "fits" if self.samples_per_s > 0 else "does not fit"

    def to_dict(self) -> dict:
        """JSON-ready: the fields plus ``status``; no figure that was not computed (None instead
        of 0 for an unsearched micro-batch or for the samples/s of a plan that does not fit)."""
        d = asdict(self)
        d["checkpoint_blocks"] = None if self.checkpoint_blocks is None else list(self.checkpoint_blocks)
        d["samples_per_s"] = self.samples_per_s or None
        d["status"] = self.status
        return d

    def label(self) -> str:
        if self.micro_batch is None:  # a precision that was not searched
            return self.precision
        ck = len(self.checkpoint_blocks)
        return f"{self.precision}, checkpointing {ck} block{'s' if ck != 1 else ''}, micro-batch {self.micro_batch}"


@dataclass(frozen=True)
class SearchResult:
    """The winner, the runners-up, and the search's own facts."""

    best: Candidate
    runners_up: list[Candidate]
    budget_bytes: int
    effective_batch: int
    n_blocks: int
    seconds: float

    def to_plan(self, device: str = "cuda") -> Plan:
        """The winner as a :class:`~tightfit.plan.Plan` (checkpointing on if any block is)."""
        b = self.best
        partial = 0 < len(b.checkpoint_blocks) < self.n_blocks
        return Plan(b.precision, b.micro_batch, self.effective_batch, bool(b.checkpoint_blocks), device=device,
                    budget_bytes=self.budget_bytes, reasons=(b.why,),
                    checkpoint_blocks=tuple(b.checkpoint_blocks) if partial else None,
                    predicted_peak_reserved_bytes=b.peak_reserved_bytes, predicted_samples_per_s=b.samples_per_s)

    def to_dict(self) -> dict:
        """JSON: ``plan``, ``budget_bytes``, ``predicted_peak_bytes`` (reserved),
        ``predicted_peak_allocated_bytes``, ``breakdown``, ``predicted_samples_per_s``,
        ``checkpoint_blocks``, ``runners_up`` (:meth:`Candidate.to_dict`: each with a ``status``
        and a ``why``), ``planning_seconds``."""
        b = self.best
        return {"plan": self.to_plan().to_dict(), "checkpoint_blocks": list(b.checkpoint_blocks),
                "budget_bytes": self.budget_bytes, "predicted_peak_bytes": b.peak_reserved_bytes,
                "predicted_peak_allocated_bytes": b.peak_allocated_bytes, "breakdown": b.breakdown,
                "predicted_samples_per_s": b.samples_per_s,
                "runners_up": [c.to_dict() for c in self.runners_up],
                "planning_seconds": self.seconds}


def candidate_precisions(profile: DeviceProfile, precision: str = "auto") -> list[str]:
    """Precisions to search: the user's, or every one the card runs natively (bf16 only at
    compute capability >= 8.0; fp16 from 5.3) -- the time model decides between them, so fp16
    on a card without tensor cores wins only where memory makes it pay."""
    if precision != "auto":
        check_precision(precision, profile)
        return [precision]
    first = preferred_precision(profile)[0]
    if profile.bf16:  # bf16 saves what fp16 saves, at the same rate, with no loss scaling
        return [first] if first == "bf16" else [first, "bf16"]
    return [first] + [p for p in ("fp32", "fp16") if p != first and profile.compute_capability >= (5, 3)]


@dataclass(frozen=True)
class _MemoryLine:
    """Predicted peak reserved bytes ``intercept + slope x micro_batch`` for one (precision,
    checkpointed blocks): every byte that grows with the micro-batch grows linearly."""

    intercept: float
    slope: float

    @classmethod
    def traced(cls, estimate_fn, precision: str, blocks: tuple[int, ...], at=(4, 16)) -> "_MemoryLine":
        """The line through exact traces at two micro-batches."""
        a, b = (estimate_fn(precision, m, blocks).peak_reserved_bytes for m in at)
        slope = (b - a) / (at[1] - at[0])
        return cls(a - slope * at[0], slope)

    def blend(self, other: "_MemoryLine", f: float) -> "_MemoryLine":
        """The line a share ``f`` of the way to ``other`` (memory falls linearly with the
        number of blocks checkpointed)."""
        return _MemoryLine(self.intercept + f * (other.intercept - self.intercept),
                           self.slope + f * (other.slope - self.slope))

    def reserved(self, micro_batch: int) -> float:
        return self.intercept + self.slope * micro_batch

    def largest_fitting(self, limit: float, upper: int) -> int:
        """Largest micro-batch in ``[1, upper]`` whose predicted peak is at most ``limit`` (0: none)."""
        if self.slope <= 0:
            return upper if self.reserved(upper) <= limit else 0
        return max(0, min(upper, int((limit - self.intercept) / self.slope)))


def search(model, make_batch, size: int, effective_batch: int, profile: DeviceProfile, budget_bytes: int,
           estimate_fn, precision: str = "auto", headroom: float = HEADROOM,
           checkpointing: str = "auto", estimator_at=None) -> SearchResult:
    """Find the fastest plan that fits.

    Args:
        model: the ``nn.Module`` (meta or real; not modified).
        make_batch: ``(micro_batch, size) -> batch dict`` (see :func:`tightfit.memory.zoo.build_model`).
        size: sequence length or image size.
        effective_batch: samples per optimizer step.
        profile: the card (precision rules and rates).
        budget_bytes: memory the step may use (reserved).
        estimate_fn: ``(precision, micro_batch, checkpoint_blocks) -> MemoryEstimate``.
        checkpointing: ``"auto"`` (search), ``"off"`` (none) or ``"on"`` (all blocks).
        estimator_at: ``(size, effective_batch) -> estimate_fn``, used only when nothing fits, to
            find what does (:func:`.advice.nothing_fits_lines`); None: only the levers are given.

    Raises:
        TightfitError: nothing fits, even at micro-batch 1 with every block checkpointed; the
            message says by how many bytes, what the model state costs, what fits instead and
            which levers would make it fit.
    """
    from ..levers.blocks import find_blocks

    t0 = time.perf_counter()
    traced = {}
    exact = estimate_fn

    def estimate_fn(precision, micro_batch, blocks):  # noqa: F811 -- each point is traced once
        key = (precision, micro_batch, tuple(blocks))
        if key not in traced:
            traced[key] = exact(precision, micro_batch, blocks)
        return traced[key]

    n_blocks = len(find_blocks(model))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    tm = TimeModel(profile, forward_cost(model, make_batch, size, n_blocks))
    limit = budget_bytes * (1 - headroom)
    # Blocks checkpointed: any number from 0 to n ("auto"); per number of micro-batches only the
    # fewest blocks that reach it is a candidate (more would only add recomputation).
    ks = {"auto": [0, n_blocks], "off": [0], "on": [n_blocks]}[checkpointing]
    evaluated: list[Candidate] = []
    curves = {}  # precision -> memory line of k checkpointed blocks
    precisions = candidate_precisions(profile, precision)
    for prec in precisions:
        if (prec != precisions[0] and tm.rate(prec) < tm.rate(precisions[0]) / 2
                and any(c.samples_per_s > 0 for c in evaluated)):
            # a much slower precision (fp16 on Pascal: 1/64) is only for memory: skip it when
            # something already fits (DESIGN invariant 7)
            evaluated.append(Candidate(prec, None, None, None, None, None,
                                       why=f"not searched: {tm.rate(prec) / tm.rate(precisions[0]):.3g}x the "
                                           f"{precisions[0]} rate on this card, and {precisions[0]} fits"))
            continue
        lo = _MemoryLine.traced(estimate_fn, prec, tuple(range(ks[0])))
        hi = _MemoryLine.traced(estimate_fn, prec, tuple(range(ks[-1]))) if len(ks) > 1 else lo
        curves[prec] = (lambda k, lo=lo, hi=hi: lo.blend(hi, (k - ks[0]) / (ks[-1] - ks[0])) if len(ks) > 1 else lo)
        frontier: dict[int, Candidate] = {}  # accumulation steps -> fewest blocks that reach them
        for k in range(ks[0], ks[-1] + 1):
            curve = curves[prec](k)
            m = curve.largest_fitting(limit, effective_batch)
            peak_at = {}  # exact peaks where the line is not to be trusted
            if k in (ks[0], ks[-1]):
                # The line comes from traces at micro-batches 4 and 16; at the ends of the range
                # the step differs in kind: one micro-batch holds no gradients across micro-
                # batches (estimator_for adds them only when accumulating), and below 4 the
                # line extrapolates. Trace those ends exactly when the answer could change.
                if m < effective_batch and curve.reserved(effective_batch) - grad_bytes <= limit:
                    peak_at[effective_batch] = estimate_fn(prec, effective_batch, tuple(range(k))).peak_reserved_bytes
                    m = effective_batch if peak_at[effective_batch] <= limit else m
                if m == 0:
                    peak_at[1] = estimate_fn(prec, 1, tuple(range(k))).peak_reserved_bytes
                    m = 1 if peak_at[1] <= limit else 0
            if m == 0:
                if k in (ks[0], ks[-1]):  # why fewer blocks lose, or nothing fits
                    evaluated.append(Candidate(prec, 1, tuple(range(k)), effective_batch, peak_at[1],
                                               None, why=f"does not fit: {format_bytes(peak_at[1])} "
                                                         f"at micro-batch 1"))
                continue
            steps = math.ceil(effective_batch / m)
            if steps in frontier:  # more recomputation for the same number of micro-batches
                continue
            mb = math.ceil(effective_batch / steps)  # balanced windows
            frontier[steps] = Candidate(prec, mb, tuple(range(k)), steps, int(peak_at.get(mb, curve.reserved(mb))),
                                        None, samples_per_s=tm.samples_per_s(prec, mb, effective_batch, k))
        evaluated.extend(frontier.values())
    order = candidate_precisions(profile, precision)  # ties go to the card's preferred precision
    fitting = sorted((c for c in evaluated if c.samples_per_s > 0),
                     key=lambda c: (-round(c.samples_per_s, 6), order.index(c.precision), len(c.checkpoint_blocks)))
    # Trace candidates exactly in predicted order; one that does not fit shrinks (and slows), so
    # go on while the next one's prediction -- an upper bound -- could still beat the best so far.
    verified: list[Candidate] = []
    for cand in fitting:
        if verified and cand.samples_per_s <= max(v.samples_per_s for v in verified):
            break
        more = _more_blocks(cand, curves[cand.precision], ks[-1], estimate_fn, limit, effective_batch, tm)
        if more is not None:  # the same micro-batches with more blocks checkpointed: may beat shrinking
            verified.append(more)
            if more.checkpoint_blocks == cand.checkpoint_blocks:
                continue  # it fit as predicted
        got = _verify(cand, estimate_fn, limit, effective_batch, tm)
        if isinstance(got, Candidate):
            verified.append(got)
            continue
        evaluated = [c for c in evaluated if c is not cand] + [Candidate(**{
            **asdict(cand), "micro_batch": 1, "peak_reserved_bytes": got, "samples_per_s": 0.0,
            "why": f"does not fit when traced exactly: {format_bytes(got)} at micro-batch 1"})]
    skipped = [c.precision for c in evaluated if c.micro_batch is None]
    if not verified and skipped:  # the slow precision is needed for memory after all
        return search(model, make_batch, size, effective_batch, profile, budget_bytes, estimate_fn,
                      precision=skipped[0], headroom=headroom, checkpointing=checkpointing,
                      estimator_at=estimator_at)
    if not verified:
        smallest = min((c for c in evaluated if c.peak_reserved_bytes), key=lambda c: c.peak_reserved_bytes)
        # the least memory searched, exactly: micro-batch 1 with every block or none checkpointed
        # (a checkpointed step carries estimator_for's margin, so either may be smaller)
        options = [tuple(range(k)) for k in dict.fromkeys((ks[-1], ks[0]))]
        est, least = min(((estimate_fn(smallest.precision, 1, o), o) for o in options),
                         key=lambda e: e[0].peak_reserved_bytes)
        options.sort(key=lambda o: o != least)
        size_flag = "--image-size" if getattr(make_batch, "kind", "text") == "image" else "--seq-len"
        lines = nothing_fits_lines(model, est, limit, smallest.precision, options, size,
                                   effective_batch, size_flag, profile.host_link_bytes_per_s, estimator_at)
        if ks[-1] < n_blocks:  # checkpointing was turned off
            every = estimate_fn(smallest.precision, 1, tuple(range(n_blocks))).peak_reserved_bytes
            lines.insert(0, f"{'fits' if every <= limit else 'does not fit either'}: micro-batch 1 with all "
                            f"{n_blocks} blocks checkpointed, {format_bytes(every)} (--checkpointing auto)")
        raise TightfitError(
            f"nothing fits {format_bytes(budget_bytes)} (planned against {format_bytes(limit)}, keeping "
            f"{int(headroom * 100)}% headroom): the smallest step tried ({smallest.precision}, micro-batch 1, "
            f"{len(least)} of {n_blocks} blocks checkpointed) needs {format_bytes(est.peak_reserved_bytes)}, "
            f"{format_bytes(est.peak_reserved_bytes - limit)} over" + "".join("\n  " + x for x in lines))
    rank = {id(c): i for i, c in enumerate(verified)}  # ties: the earlier (preferred) one
    best = max(verified, key=lambda c: (round(c.samples_per_s, 6), -rank[id(c)]))
    why = (f"fastest predicted: {best.samples_per_s:.0f} samples/s, peak {format_bytes(best.peak_reserved_bytes)} "
           f"of {format_bytes(budget_bytes)}")
    best = Candidate(**{**asdict(best), "why": why})
    runners = []
    done = {(v.precision, v.checkpoint_blocks) for v in verified}
    others = [v for v in verified if (v.precision, v.checkpoint_blocks) != (best.precision, best.checkpoint_blocks)]
    others += [c for c in evaluated if c.samples_per_s > 0 and (c.precision, c.checkpoint_blocks) not in done]
    others.sort(key=lambda c: -c.samples_per_s)
    for c in others + [c for c in evaluated if c.samples_per_s == 0]:
        if c.samples_per_s > 0:
            exact = (c.precision, c.checkpoint_blocks) in done
            ratio = c.samples_per_s / best.samples_per_s
            c = Candidate(**{**asdict(c), "why": (
                f"{'slower' if ratio < 0.995 else 'as fast, ranked after it'}: predicted {c.samples_per_s:.0f} "
                f"samples/s ({ratio:.2f}x)" + ("" if exact else ", memory from the line, not traced exactly"))})
        runners.append(c)
    return SearchResult(best, runners, budget_bytes, effective_batch, n_blocks, time.perf_counter() - t0)


def _more_blocks(c: Candidate, curve, n_max: int, estimate_fn, limit: float, effective_batch: int,
                 tm: TimeModel) -> Candidate | None:
    """Trace the candidate exactly at its micro-batch; if it does not fit, checkpoint more blocks
    (the fewest the memory line, shifted by the exact trace's error, says could fit; traced again
    each time) up to ``n_max``. None if no block count fits at this micro-batch."""
    blocks = c.checkpoint_blocks
    while len(blocks) <= n_max:
        est = estimate_fn(c.precision, c.micro_batch, blocks)
        if est.peak_reserved_bytes <= limit:
            return _traced(c, c.micro_batch, blocks, est, effective_batch, tm)
        error = est.peak_reserved_bytes - curve(len(blocks)).reserved(c.micro_batch)
        k = next((j for j in range(len(blocks) + 1, n_max + 1)
                  if curve(j).reserved(c.micro_batch) + error <= limit), n_max + 1)
        blocks = tuple(range(k))
    return None


def _verify(c: Candidate, estimate_fn, limit: float, effective_batch: int, tm: TimeModel) -> Candidate | int:
    """Trace the candidate exactly; while it does not fit, take the next smaller balanced
    micro-batch (one more accumulation step). If even micro-batch 1 does not fit: its exact peak
    reserved bytes (an int) instead of a candidate."""
    mb = c.micro_batch
    while True:
        est = estimate_fn(c.precision, mb, c.checkpoint_blocks)
        if est.peak_reserved_bytes <= limit:
            return _traced(c, mb, c.checkpoint_blocks, est, effective_batch, tm)
        if mb == 1:
            return est.peak_reserved_bytes
        steps = math.ceil(effective_batch / mb) + 1
        mb = min(mb - 1, math.ceil(effective_batch / steps))  # strictly smaller: always ends


def _traced(c: Candidate, mb: int, blocks: tuple, est, effective_batch: int, tm: TimeModel) -> Candidate:
    """``c`` at micro-batch ``mb`` with ``blocks`` checkpointed, with its exact estimate ``est``."""
    return Candidate(c.precision, mb, blocks, math.ceil(effective_batch / mb), est.peak_reserved_bytes,
                     est.peak_allocated_bytes, dict(est.breakdown),
                     tm.samples_per_s(c.precision, mb, effective_batch, len(blocks)))


# The estimator under-predicts reserved memory of checkpointed steps by up to 4.9% on the NVIDIA
# H200 expandable-segment fixture (docs/memory-estimator.md); a plan made without a GPU to verify
# it keeps a 5% margin on them.
CHECKPOINTED_RESERVED_MARGIN = 0.05


def estimator_for(model, make_batch, size: int, profile: DeviceProfile, effective_batch: int,
                  checkpointed_margin: float = CHECKPOINTED_RESERVED_MARGIN):
    """``estimate_fn`` backed by :func:`tightfit.memory.estimate`: with accumulation the window's
    gradients are held while later micro-batches run forward and backward, so their bytes are
    added to any peak that the estimate reached with gradients freed; checkpointed plans get
    ``checkpointed_margin`` on reserved (0 when real probe steps verify the plan)."""
    from ..memory.estimate import MemoryEstimate, estimate

    example = make_batch(1, size)
    grads = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)

    def fn(precision: str, micro_batch: int, blocks) -> MemoryEstimate:
        plan = Plan(precision, micro_batch, micro_batch, device="cuda")
        est = estimate(model, example, plan, device=profile, checkpoint_blocks=tuple(blocks))
        extra = max(0, grads - est.breakdown.get("gradients", 0)) if micro_batch < effective_batch else 0
        margin = int(checkpointed_margin * (est.peak_reserved_bytes + extra)) if blocks else 0
        if not extra and not margin:
            return est
        bd = dict(est.breakdown)
        bd["gradients"] = bd.get("gradients", 0) + extra
        bd["allocator_overhead"] = bd.get("allocator_overhead", 0) + margin
        return MemoryEstimate(est.peak_allocated_bytes + extra, est.peak_reserved_bytes + extra + margin, bd, est.plan,
                              est.first_step_peak_reserved_bytes, est.allocator, est.extra)

    return fn
