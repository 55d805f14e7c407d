"""Plan search without a GPU: the fastest plan whose predicted peak memory fits the budget.

The planner is one pipeline of named stages; this module holds those that need no GPU, and
:mod:`.gpu` the three that do:

0. **unconstrained** (:func:`unconstrained`): the plan none can beat (the whole batch in one
   micro-batch, nothing recomputed, the preferred precision), traced exactly; where it fits, the
   search ends there.
1. **enumerate** (:func:`enumerate_candidates`): for each precision the card allows and each
   number of checkpointed blocks (the first blocks first, since every block of a stack
   recomputes at the same cost and the earliest hold their activations longest), the largest
   micro-batch that fits the planned limit (:mod:`.margins`) by the memory lines
   (:mod:`tightfit.memory.fast`, two exact estimates per precision and end of the block range),
   balanced over the accumulation steps, with its predicted samples/s (:mod:`.cost`). Per
   number of micro-batches only the fewest blocks that reach it is a candidate. Then the
   per-block choices past whole-block recomputation (:func:`_choice_ladders`): blocks
   recomputed selectively, then fully on top of that, or offloaded to the host, one block
   at a time, the cheapest memory first; per number of micro-batches the fastest of each.
2. **predict** (:func:`predict`): trace the candidates exactly (:mod:`tightfit.memory`), in
   predicted order, while the next one could still beat the best traced so far; one that does
   not fit checkpoints more blocks or shrinks. Then :func:`rank` names the winner and says why
   every runner-up lost.
3. **verify on the GPU**, 4. **compile**, 5. **retime**: :mod:`.gpu`.

Exact estimates whose keys are known in advance (the lines' ends, the first candidates, a
shrink's first guess and its neighbours) are traced side by side in worker processes when
``TIGHTFIT_PLAN_WORKERS`` asks for them (:mod:`.parallel`); the answers are the same either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from ..devices import DeviceProfile
from ..errors import TightfitError, refuses_one_sample
from ..levers.precision import check_precision, preferred_precision
from ..memory.fast import TRACED_AT, BlockLines, MemoryLine
from ..plan import Plan, accumulation_steps, micro_batch_for, plan_with_blocks, without_free_blocks
from ..units import format_bytes, format_rate
from .advice import lever_peaks, nothing_fits_lines
from .bisection import bisect
from .cost import TimeModel, forward_cost
from .margins import CHECKPOINTED_RESERVED_MARGIN, HEADROOM, estimator_margin_bytes, planned_limit
from .parallel import plan_workers, trace_all

# ``(precision, micro_batch, checkpoint_blocks) -> MemoryEstimate``: an exact estimate of one step.
EstimateFn = Callable


def paid_blocks(checkpoint_blocks, free_blocks: int) -> tuple[int, ...]:
    """The checkpointed blocks (indices) that keep activations, and so cost recomputation: not the
    frozen first ``free_blocks``, whose forward saves nothing for a backward."""
    return tuple(i for i in checkpoint_blocks or () if i >= free_blocks)


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
        block_policies: one choice per block (:data:`tightfit.levers.blocks.BLOCK_POLICIES`)
            where the candidate mixes them; then ``checkpoint_blocks`` are the blocks recomputed
            fully. None: ``checkpoint_blocks`` recompute fully, the others keep everything.
        optimizer: the optimizer searched with (``Plan.optimizer``; set by
            :func:`tightfit.planner.optimizers.search_optimizers`).
        traced: False for a runner-up whose fit comes from the memory line alone (never traced
            exactly: it may miss the limit by the line's error, a few percent).
        free_blocks: the model's first blocks that keep no activations (frozen, nothing trained
            before them): in ``checkpoint_blocks`` for the search's arithmetic, never said to be
            checkpointed (:meth:`label`, :meth:`to_dict`).
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
    block_policies: tuple[str, ...] | None = None
    optimizer: str = "adamw"
    traced: bool = True
    free_blocks: int = 0

    @property
    def paid_blocks(self) -> tuple[int, ...]:
        """The checkpointed blocks that cost recomputation (:func:`paid_blocks`)."""
        return paid_blocks(self.checkpoint_blocks, self.free_blocks)

    @property
    def choice(self) -> tuple:
        """What the estimator traces: the block policies, or the checkpointed blocks' indices."""
        return self.block_policies if self.block_policies is not None else self.checkpoint_blocks

    @property
    def status(self) -> str:
        """``"fits"``, ``"fits by the memory line, not traced"``, ``"does not fit"`` or ``"not searched"``."""
        if self.micro_batch is None:
            return "not searched"
        if self.samples_per_s <= 0:
            return "does not fit"
        return "fits" if self.traced else "fits by the memory line, not traced"

    def to_dict(self) -> dict:
        """JSON-ready: the fields plus ``status``; no figure that was not computed (None instead
        of 0 for an unsearched micro-batch or for the samples/s of a plan that does not fit, and
        for ``traced`` where nothing was searched)."""
        d = asdict(self)
        d.pop("free_blocks")
        d["checkpoint_blocks"] = None if self.checkpoint_blocks is None else list(self.paid_blocks)
        d["block_policies"] = None if self.block_policies is None else list(self.block_policies)
        d["samples_per_s"] = self.samples_per_s or None
        d["status"] = self.status
        if self.micro_batch is None:  # nothing was traced for a precision not searched
            d["traced"] = None
        return d

    def label(self) -> str:
        """``"bf16, checkpointing 2 blocks, micro-batch 32"`` (the precision alone if not searched)."""
        if self.micro_batch is None:  # a precision that was not searched
            return self.precision
        if self.block_policies is not None:
            kinds = [f"{self.block_policies.count(p)} {p}" for p in ("selective", "full", "offload")
                     if p in self.block_policies]
            return f"{self.precision}, blocks {' + '.join(kinds)}, micro-batch {self.micro_batch}"
        ck = len(self.paid_blocks)
        return f"{self.precision}, checkpointing {ck} block{'s' if ck != 1 else ''}, micro-batch {self.micro_batch}"


@dataclass(frozen=True)
class SearchResult:
    """The winner, the runners-up, and the search's own facts.

    Attributes:
        best: the winner (its ``why`` says why it won).
        runners_up: every other candidate, fastest first, then those that do not fit.
        budget_bytes: the budget planned for, bytes.
        effective_batch: samples per optimizer step.
        n_blocks: the model's repeated blocks.
        seconds: wall time of the search.
        other_optimizers: with ``optimizer="auto"``, the results of the other optimizers that
            fit and whose searches returned one (a lever that could not beat the plan found
            returns none), fastest predicted first (:func:`tightfit.planner.optimizers.search_optimizers`;
            the GPU planner verifies the first of them too, since the time model of an optimizer
            lever can be off); empty otherwise.
        trainable, trainable_params: what the model searched trains (``Plan``'s fields of the
            same names, :func:`tightfit.levers.trainable.trainable_fields`).
    """

    best: Candidate
    runners_up: list[Candidate]
    budget_bytes: int
    effective_batch: int
    n_blocks: int
    seconds: float
    other_optimizers: tuple = ()
    trainable: str = "all"
    trainable_params: int | None = None

    def to_plan(self, device: str = "cuda") -> Plan:
        """The winner as a :class:`~tightfit.plan.Plan` (checkpointing on if any block is; not
        the first blocks that keep no activations, :func:`~tightfit.plan.without_free_blocks`)."""
        b = self.best
        plan = plan_with_blocks(b.precision, b.micro_batch, self.effective_batch, b.checkpoint_blocks, self.n_blocks,
                                device=device, budget_bytes=self.budget_bytes, reasons=(b.why,), optimizer=b.optimizer,
                                predicted_peak_reserved_bytes=b.peak_reserved_bytes,
                                predicted_samples_per_s=b.samples_per_s, block_policies=b.block_policies,
                                trainable=self.trainable, trainable_params=self.trainable_params)
        return without_free_blocks(plan, b.free_blocks, self.n_blocks)

    def to_dict(self) -> dict:
        """JSON: ``plan``, ``budget_bytes``, ``predicted_peak_bytes`` (reserved),
        ``predicted_peak_allocated_bytes``, ``breakdown``, ``predicted_samples_per_s``,
        ``checkpoint_blocks``, ``runners_up`` (:meth:`Candidate.to_dict`: each with a ``status``
        and a ``why``), ``planning_seconds``."""
        b = self.best
        plan = self.to_plan()
        return {"plan": plan.to_dict(), "checkpoint_blocks": list(plan.checkpointed_blocks(self.n_blocks)),
                "block_policies": None if b.block_policies is None else list(b.block_policies),
                "budget_bytes": self.budget_bytes, "predicted_peak_bytes": b.peak_reserved_bytes,
                "predicted_peak_allocated_bytes": b.peak_allocated_bytes, "breakdown": b.breakdown,
                "predicted_samples_per_s": b.samples_per_s,
                "runners_up": [c.to_dict() for c in self.runners_up],
                "planning_seconds": self.seconds}


@dataclass(frozen=True)
class SearchSpace:
    """What the search ranges over and the facts it ranks by.

    Attributes:
        precisions: the precisions to search, the card's preferred one first (ties go to it).
        first_blocks, last_blocks: the fewest and most blocks checkpointed (the first ones).
        n_blocks: the model's repeated blocks.
        effective_batch: samples per optimizer step.
        budget_bytes, limit: the budget and the planned limit under it (bytes, :mod:`.margins`).
        headroom: the share of the budget kept free.
        grad_bytes: the trainable parameters' gradients, bytes (held across micro-batches).
        time_model: predicts samples/s.
        ladders: the per-block choices searched past whole-block recomputation
            (``"selective"``, ``"offload"``; :func:`_choice_ladders`).
        host_bytes: pinned host memory offloaded activations may hold, bytes (None: not limited).
        least_micro_batch: the smallest micro-batch the model trains on: 1, or 2 where its
            BatchNorm cannot train on one sample (:func:`refuses_one_sample_step`).
    """

    precisions: list[str]
    first_blocks: int
    last_blocks: int
    n_blocks: int
    effective_batch: int
    budget_bytes: int
    limit: float
    headroom: float
    grad_bytes: int
    time_model: TimeModel
    ladders: tuple[str, ...] = ()
    host_bytes: float | None = None
    least_micro_batch: int = 1

    def is_end(self, k: int) -> bool:
        """Whether ``k`` checkpointed blocks is an end of the range (where lines are traced)."""
        return k in (self.first_blocks, self.last_blocks)


@dataclass(frozen=True)
class Enumeration:
    """Stage 1's output: every candidate, and the memory lines they were read from.

    Attributes:
        candidates: fitting ones (by the lines), those that do not fit at micro-batch 1, and
            precisions not searched, in enumeration order.
        lines: per searched precision, the lines of every number of checkpointed blocks.
    """

    candidates: list[Candidate]
    lines: dict[str, BlockLines]


@dataclass(frozen=True)
class Prediction:
    """Stage 2's output before ranking.

    Attributes:
        traced: candidates whose memory was traced exactly and fits, in tracing order.
        evaluated: the enumeration's candidates, those found not to fit when traced exactly
            moved to the end as "does not fit".
    """

    traced: list[Candidate]
    evaluated: list[Candidate]


def candidate_precisions(profile: DeviceProfile, precision: str = "auto") -> list[str]:
    """Precisions to search: the user's, or every one the card runs natively (bf16 only at
    compute capability >= 8.0; fp16 from 5.3) -- the time model decides between them, so fp16
    on a card without tensor cores wins only where memory makes it pay.

    Raises:
        TightfitError: an explicit precision the card cannot run.
    """
    if precision != "auto":
        check_precision(precision, profile)
        return [precision]
    first = preferred_precision(profile)[0]
    if profile.bf16:  # bf16 saves what fp16 saves, at the same rate, with no loss scaling
        return [first] if first == "bf16" else [first, "bf16"]
    return [first] + [p for p in ("fp32", "fp16") if p != first and profile.compute_capability >= (5, 3)]


class NothingFitsError(TightfitError):
    """No plan fits the budget (the message says by how much and what would fit)."""


class CannotBeatError(TightfitError):
    """No candidate is predicted faster than the ``beat`` given to :func:`search` (the lines'
    predictions bound every exact one from above), so none was traced."""


def search(model, make_batch, size: int, effective_batch: int, profile: DeviceProfile, budget_bytes: int,
           estimate_fn: EstimateFn, precision: str = "auto", headroom: float = HEADROOM,
           checkpointing: str = "auto", estimator_at=None, per_block: bool = True,
           optimizer: str = "adamw", beat: float = 0.0, lever_estimator=None,
           host_bytes: float | None = None, _lever_precisions=None) -> SearchResult:
    """Find the fastest plan that fits: :func:`enumerate_candidates`, then :func:`predict`, then
    :func:`rank`.

    Args:
        model: the ``nn.Module`` (meta or real; not modified).
        make_batch: ``(micro_batch, size) -> batch dict`` (see :func:`tightfit.models.build_model`).
        size: sequence length or image size.
        effective_batch: samples per optimizer step.
        profile: the card (precision rules and rates).
        budget_bytes: memory the step may use (reserved), bytes.
        estimate_fn: ``(precision, micro_batch, choice) -> MemoryEstimate``; ``choice``: the
            checkpointed blocks' indices, or one policy per block (strings).
        headroom: share of the budget kept free (:mod:`.margins`).
        checkpointing: ``"auto"`` (search), ``"off"`` (none) or ``"on"`` (all blocks).
        estimator_at: ``(size, effective_batch) -> estimate_fn``, used only when nothing fits, to
            find what does (:func:`.advice.nothing_fits_lines`); None: only the levers are given.
        per_block: with ``checkpointing="auto"``, also search selective recomputation and
            activation offload per block (:func:`_choice_ladders`).
        optimizer: the optimizer ``estimate_fn`` traces (:func:`estimator_for`), for the time
            model; the search over optimizers is :mod:`.optimizers`'.
        beat: samples/s of a plan found elsewhere (another optimizer's): only candidates
            predicted faster are traced (the exact traces are the search's cost).
        lever_estimator: ``kind -> estimate_fn`` of the other optimizers, used only when nothing
            fits: the advice says which optimizer lever would fit by estimating its smallest
            step as the search of it would (:func:`.advice.lever_peaks`, in the precisions searched
            first: a retry of a skipped precision searches it alone, ``_lever_precisions``); None:
            by its savings.
        host_bytes: pinned host memory the offloaded activations of one micro-batch may hold,
            bytes (None: not limited, e.g. planning for another machine): an offloading choice
            gets at most the micro-batch whose offloaded activations fit it.

    Raises:
        CannotBeatError: no plan of the space is predicted faster than ``beat`` (:func:`ceiling`; then
            nothing is traced), or candidates fit by the lines but none is predicted faster.
        NothingFitsError: nothing fits, even at micro-batch 1 with every block checkpointed (the
            message says by how many bytes, what the model state costs, what fits instead and
            which levers would make it fit); an unknown ``checkpointing``; a ``precision`` the
            card cannot run.
    """
    t0 = time.perf_counter()
    estimate_fn = remembering(estimate_fn)
    space = search_space(model, make_batch, size, effective_batch, profile, budget_bytes, precision, headroom,
                         checkpointing, per_block, optimizer, host_bytes)
    if beat > 0 and ceiling(space) <= beat:  # no plan in the space is predicted faster: none traced
        raise CannotBeatError(f"no plan predicted faster than the {format_rate(beat)} samples/s already found")
    prediction = unconstrained(space, estimate_fn, beat) or \
        predict(space, enumerate_candidates(space, estimate_fn), estimate_fn, beat)
    if not prediction.traced and beat > 0 and any(c.samples_per_s > 0 for c in prediction.evaluated):
        raise CannotBeatError(f"no plan predicted faster than the {format_rate(beat)} samples/s already found")
    if not prediction.traced:
        def retry(other: str, lever_precisions) -> SearchResult:  # the same search in one other precision
            return search(model, make_batch, size, effective_batch, profile, budget_bytes, estimate_fn,
                          precision=other, headroom=headroom, checkpointing=checkpointing, estimator_at=estimator_at,
                          per_block=per_block, optimizer=optimizer, beat=beat, lever_estimator=lever_estimator,
                          host_bytes=host_bytes, _lever_precisions=lever_precisions)

        skipped = [c.precision for c in prediction.evaluated if c.micro_batch is None]
        if skipped:  # the slow precision is needed for memory after all
            return retry(skipped[0], _lever_precisions or space.precisions)
        if precision == "auto" and "fp32" not in space.precisions:
            # autocast saves a 16-bit copy of each weight for backward: at micro-batch 1 fp32 can
            # need less (BERT-base at 2 GiB: 1.84 GiB in fp32, 1.93 GiB in bf16)
            try:
                found = retry("fp32", space.precisions)
            except NothingFitsError:
                pass
            else:
                b = found.best
                why = f"{b.why}; precision fp32: {', '.join(space.precisions)} fits nothing in this budget, fp32 does"
                return replace(found, best=replace(b, why=why))
        _raise_nothing_fits(space, prediction.evaluated, model, make_batch, size, profile, estimate_fn, estimator_at,
                            optimizer, lever_estimator, _lever_precisions or space.precisions, precision)
    from ..levers.trainable import trainable_fields

    free = space.time_model.cost.free_blocks
    if free:  # said of every candidate, so that none is said to checkpoint frozen first blocks
        mark = {id(c): replace(c, free_blocks=free) for c in prediction.traced + prediction.evaluated}
        prediction = Prediction([mark[id(c)] for c in prediction.traced], [mark[id(c)] for c in prediction.evaluated])
    return replace(rank(space, prediction, time.perf_counter() - t0), **trainable_fields(model))


def predicted_bound(model, make_batch, size: int, effective_batch: int, profile: DeviceProfile, budget_bytes: int,
                    estimate_fn: EstimateFn, precision: str = "auto", headroom: float = HEADROOM,
                    checkpointing: str = "auto", per_block: bool = True, optimizer: str = "adamw",
                    host_bytes: float | None = None, beat: float = 0.0) -> tuple[float, bool]:
    """What :func:`search` with the same arguments is predicted to find at most, from stages 0 and
    1 alone: the plan none can beat where it fits (traced exactly), else the fastest candidate the
    memory lines say fits, in samples/s (0.0 where the lines fit nothing in the precisions searched
    first). Stage 2 checkpoints more or shrinks a candidate that does not fit when traced, and
    may take fewer blocks where one fits better than its line said (a few percent faster): a
    bound of the lines' predictions, as :func:`search`'s ``beat`` compares. It costs the traces
    :func:`search` makes first anyway, and ``estimate_fn`` made by :func:`remembering` keeps them
    for it. Where no plan of the space can beat ``beat`` (:func:`ceiling`) nothing is traced and
    the ceiling is the bound, as :func:`search` would raise :class:`CannotBeatError` untraced.
    Arguments as :func:`search`.

    Returns:
        ``(samples_per_s, unconstrained)``: the bound, and whether the plan none can beat fits.

    Raises:
        What :func:`search_space` and ``estimate_fn`` raise.
    """
    estimate_fn = remembering(estimate_fn)
    space = search_space(model, make_batch, size, effective_batch, profile, budget_bytes, precision, headroom,
                         checkpointing, per_block, optimizer, host_bytes)
    if beat > 0 and ceiling(space) <= beat:
        return ceiling(space), False
    whole = unconstrained(space, estimate_fn)
    if whole is not None:
        return whole.traced[0].samples_per_s, True
    return max((c.samples_per_s for c in enumerate_candidates(space, estimate_fn).candidates), default=0.0), False


def remembering(estimate_fn: EstimateFn) -> EstimateFn:
    """``estimate_fn`` remembering its answers: each (precision, micro-batch, blocks) is traced once,
    across the :func:`predicted_bound` and :func:`search` calls given the returned function.
    Its ``prefetch(keys)`` traces the keys not yet known side by side (:func:`.parallel.trace_all`)
    when worker processes are asked for, and does nothing otherwise; later calls answer the same."""
    if hasattr(estimate_fn, "prefetch"):  # already remembering (a retry of another precision)
        return estimate_fn
    traced = {}

    def fn(precision, micro_batch, blocks):
        key = (precision, micro_batch, tuple(blocks))
        if key not in traced:
            traced[key] = estimate_fn(precision, micro_batch, blocks)
        return traced[key]

    def prefetch(keys) -> None:
        keys = [(p, m, tuple(b)) for p, m, b in keys]
        traced.update(trace_all(estimate_fn, [k for k in keys if k not in traced]))

    fn.prefetch = prefetch
    fn.known = traced.get  # (precision, micro_batch, blocks) -> its estimate if already known, else None
    fn.known_all = traced.values
    return fn


class NotTraced(LookupError):
    """An estimate :func:`shifted` was asked for that its function has not traced."""


def shifted(estimate_fn: EstimateFn, delta: float) -> EstimateFn:
    """The estimates ``estimate_fn`` (made by :func:`remembering`) already knows, their peak
    reserved bytes moved by ``delta``: another optimizer's steps as one with other model state
    would hold them, for a bound only (:func:`tightfit.planner.optimizers.search_optimizers`).
    What ``estimate_fn`` does not know yet it traces (the bound asks the memory lines' steps, which
    the reference's own search traced, and at most a whole-batch step per end of the blocks), but
    micro-batch 1, asked only where a memory line fits nothing, is taken to fit (it adds only the
    slowest candidate to the bound).

    Raises:
        NotTraced: (when called) micro-batch 1 where ``estimate_fn`` knows no estimate at all.
    """
    def fn(precision, micro_batch, blocks):
        est = estimate_fn.known((precision, micro_batch, tuple(blocks)))
        if est is None and micro_batch == 1:  # the search's last resort (nothing fits by the line)
            any_known = next(iter(estimate_fn.known_all()), None)  # only an estimate's other fields are read
            if any_known is None:
                raise NotTraced((precision, micro_batch, tuple(blocks)))
            return replace(any_known, peak_reserved_bytes=0)  # taken to fit: a bound
        if est is None:  # the whole batch at an end of the blocks: traced once, for the reference too
            est = estimate_fn(precision, micro_batch, blocks)
        return replace(est, peak_reserved_bytes=int(est.peak_reserved_bytes + delta))

    return fn


def _prefetch(estimate_fn: EstimateFn, keys) -> None:
    """``estimate_fn.prefetch(keys)`` where it has one (estimate functions of tests need not)."""
    if hasattr(estimate_fn, "prefetch"):
        estimate_fn.prefetch(list(keys))


def search_space(model, make_batch, size: int, effective_batch: int, profile: DeviceProfile, budget_bytes: int,
                 precision: str = "auto", headroom: float = HEADROOM, checkpointing: str = "auto",
                 per_block: bool = True, optimizer: str = "adamw", host_bytes: float | None = None) -> SearchSpace:
    """The :class:`SearchSpace` of a workload on a card (one meta trace of the forward for the
    time model). Arguments as :func:`search`.

    Raises:
        TightfitError: an unknown ``checkpointing``, or a ``precision`` the card cannot run.
    """
    from ..levers.blocks import find_blocks
    from ..levers.optimizers import trainable_gradient_bytes

    n_blocks = len(find_blocks(model))
    grad_bytes = trainable_gradient_bytes(model, optimizer)  # adamw8bit-bf16: bf16 gradients
    tm = TimeModel(profile, forward_cost(model, make_batch, size, n_blocks), optimizer=optimizer)
    free = tm.cost.free_blocks  # frozen first blocks: checkpointing them changes nothing
    ends = checkpoint_ends(checkpointing, n_blocks)
    if checkpointing == "auto":  # the memory lines run from the first block that keeps activations
        ends = (min(free, n_blocks), n_blocks)
    ladders = per_block_ladders(checkpointing, n_blocks, free, per_block)
    least = 2 if effective_batch >= 2 and refuses_one_sample_step(model, make_batch, size) else 1
    return SearchSpace(candidate_precisions(profile, precision), ends[0], ends[1], n_blocks, effective_batch,
                       budget_bytes, planned_limit(budget_bytes, headroom), headroom, grad_bytes, tm, ladders,
                       host_bytes, least)


def refuses_one_sample_step(model, make_batch, size: int) -> bool:
    """Whether ``model`` cannot train on a micro-batch of one sample: its forward on one sample
    (``make_batch(1, size)``; a meta copy in train mode, nothing computed) meets BatchNorm's
    refusal of a single value per channel (:func:`~tightfit.errors.refuses_one_sample`), as
    ResNet-50 does at 32 pixels, where its last maps are 1 x 1. The search then plans no
    micro-batch below 2, and its exact traces of the smallest step take 2: a trace at 1 raised,
    and stopped the whole plan at some budgets and not at others. False without running-stat
    norms (nothing run), and where the forward fails otherwise (the traces then say why)."""
    import torch

    from ..buffers import running_stat_norms
    from ..memory.estimate import meta_copy
    from ..step import train_mode

    if not running_stat_norms(model):
        return False
    meta = meta_copy(model)
    batch = {k: v.to("meta") for k, v in make_batch(1, size).items() if k != "labels"}  # CPU batches too
    try:
        with train_mode(meta), torch.no_grad():
            meta(**batch)
    except ValueError as e:
        return refuses_one_sample(e)
    except Exception:  # noqa: BLE001 - not this check's to say
        return False
    return False


def per_block_ladders(checkpointing: str, n_blocks: int, free_blocks: int, per_block: bool = True) -> tuple:
    """The per-block choices the search makes besides whole-block recomputation: selective
    recomputation and activation offload, with ``checkpointing="auto"``, blocks, and no frozen
    first blocks (``free_blocks``: per-block choices blend their lines over every block)."""
    return ("selective", "offload") if per_block and checkpointing == "auto" and n_blocks and not free_blocks else ()


def least_memory_options(first: int, last: int, n_blocks: int, ladders: tuple) -> list[tuple]:
    """The block choices of the search's least-memory steps, for the refusals' word on each lever
    (:func:`.advice.lever_peaks`): the most and the fewest blocks checkpointed, and every block
    under each per-block choice of ``ladders`` (:func:`per_block_ladders`)."""
    return [tuple(range(k)) for k in dict.fromkeys((last, first))] + [(p,) * n_blocks for p in ladders]


def checkpoint_ends(checkpointing: str, n_blocks: int) -> tuple[int, int]:
    """The fewest and most blocks the search checkpoints under ``checkpointing`` (``"auto"``:
    0 to all ``n_blocks``; ``"off"``: none; ``"on"``: all).

    Raises:
        TightfitError: an unknown ``checkpointing``.
    """
    ends = {"auto": (0, n_blocks), "off": (0, 0), "on": (n_blocks, n_blocks)}.get(checkpointing)
    if ends is None:
        raise TightfitError(f"unknown checkpointing {checkpointing!r}; use auto, on or off")
    return ends


# ---------------------------------------------------------------- stage 0: the plan none can beat

def unconstrained(space: SearchSpace, estimate_fn: EstimateFn, beat: float = 0.0) -> Prediction | None:
    """The plan no other in the space can beat, traced first: the whole effective batch in one
    micro-batch (no accumulation), the fewest blocks checkpointed the space allows, in the
    card's preferred precision. Where it fits, the search is over in one exact trace (a small
    job's planning is then in proportion to its run), and the other precisions are "not
    searched". None (search on) where it does not fit, where another precision is predicted
    faster at the same plan, or where it is not faster than ``beat``. With worker processes
    (:mod:`.parallel`) the memory lines' traces (stage 1, :func:`_line_keys`) run alongside it.

    Raises:
        What ``estimate_fn`` raises.
    """
    E, tm, first = space.effective_batch, space.time_model, space.precisions[0]
    blocks = tuple(range(space.first_blocks))
    speed = _unconstrained_speed(space, first)
    if speed < ceiling(space) or speed <= beat:
        return None
    _prefetch(estimate_fn, [(first, E, blocks), *_line_keys(space, first)])
    est = estimate_fn(first, E, blocks)
    if est.peak_reserved_bytes > space.limit:
        return None
    best = _traced(space, Candidate(first, E, blocks, 1, None, None), E, blocks, est)
    skipped = [Candidate(p, None, None, None, None, None, why=(
        f"not searched: {tm.rate(p) / tm.rate(first):.3g}x the {first} rate on this card, and {first} fits"
        if tm.rate(p) < tm.rate(first) / 2 else
        f"not searched: {first} fits the whole batch in one micro-batch"
        + (" without recomputation" if not blocks else "") + ", which no other precision is predicted to beat"))
        for p in space.precisions[1:]]
    return Prediction([best], [best, *skipped])


def _unconstrained_speed(space: SearchSpace, precision: str) -> float:
    """Predicted samples/s of the whole effective batch in one micro-batch with the fewest blocks
    checkpointed that the space allows."""
    E = space.effective_batch
    return space.time_model.samples_per_s(precision, E, E, space.first_blocks)


def ceiling(space: SearchSpace) -> float:
    """The most samples/s any plan of the space is predicted to reach: the unconstrained plan's
    in the fastest precision (accumulation, recomputation and host transfers only add time)."""
    return max(_unconstrained_speed(space, p) for p in space.precisions)


# ---------------------------------------------------------------- stage 1: enumerate

def enumerate_candidates(space: SearchSpace, estimate_fn: EstimateFn) -> Enumeration:
    """Stage 1: per precision, the candidates the memory lines say fit (the fewest blocks per
    number of micro-batches), and where even micro-batch 1 does not fit, a "does not fit" one.
    A much slower precision (fp16 on Pascal: 1/64 of the rate) is only for memory: it is not
    searched once something fits (DESIGN invariant 7).

    Raises:
        What ``estimate_fn`` raises.
    """
    tm, first = space.time_model, space.precisions[0]
    _prefetch(estimate_fn, _line_keys(space, first))
    candidates: list[Candidate] = []
    lines = {}
    for prec in space.precisions:
        if prec != first and tm.rate(prec) < tm.rate(first) / 2 and any(c.samples_per_s > 0 for c in candidates):
            candidates.append(Candidate(prec, None, None, None, None, None,
                                        why=f"not searched: {tm.rate(prec) / tm.rate(first):.3g}x the "
                                            f"{first} rate on this card, and {first} fits"))
            continue
        lines[prec] = BlockLines.traced(estimate_fn, prec, space.first_blocks, space.last_blocks)
        whole = _frontier(space, prec, lines[prec], estimate_fn)
        candidates += whole
        if space.ladders:  # only where they beat whole blocks at the same number of micro-batches
            fastest = {c.accumulation_steps: c.samples_per_s for c in whole if c.samples_per_s > 0}
            candidates += [c for c in _ladder_candidates(space, prec, lines[prec], estimate_fn)
                           if c.samples_per_s > fastest.get(c.accumulation_steps, 0.0)]
    return Enumeration(candidates, lines)


def _line_keys(space: SearchSpace, prec: str) -> list[tuple]:
    """The exact estimates stage 1 traces for ``prec`` whatever they say: the memory lines of
    the fewest and most checkpointed blocks and of the per-block ladders' ends."""
    ends = {tuple(range(space.first_blocks)), tuple(range(space.last_blocks))}
    ends |= {(ladder,) * space.n_blocks for ladder in space.ladders}
    return [(prec, m, choice) for choice in sorted(ends, key=str) for m in TRACED_AT]


def _choice_ladders(space: SearchSpace, prec: str, lines: BlockLines, estimate_fn: EstimateFn):
    """The per-block choices past whole-block recomputation, as ``(policies, MemoryLine)``
    pairs: the first ``k`` blocks selective (the others keep everything), then all selective
    with the first ``k`` recomputed fully, and the first ``k`` offloaded. Each ladder's memory
    line is traced at its ends (all blocks with one choice) and blended in between, as
    :class:`~tightfit.memory.fast.BlockLines` does for whole blocks. Also fills the time model's
    bytes an offloaded block moves per sample: what a block saves, the slope of no
    checkpointing less that of all blocks recomputed."""
    n = space.n_blocks
    none, full = lines(0), lines(n)
    space.time_model.offload_bytes[prec] = max(0.0, (none.slope - full.slope) / n)
    out = []
    if "selective" in space.ladders:
        sel = MemoryLine.traced(estimate_fn, prec, ("selective",) * n)
        blends = [none.blend(sel, k / n) for k in range(1, n + 1)] + [sel.blend(full, k / n) for k in range(1, n)]
        out += list(zip(_rungs("selective", n), blends))  # (the last rung, every block full, is whole blocks')
    if "offload" in space.ladders:
        off = MemoryLine.traced(estimate_fn, prec, ("offload",) * n)
        out += list(zip(_rungs("offload", n), [none.blend(off, k / n) for k in range(1, n + 1)]))
    return out


def _rungs(ladder: str, n: int) -> list[tuple]:
    """The choices of a per-block ladder over ``n`` blocks, least saving first: ``offload``, the
    first k blocks offloaded; ``selective``, the first k selective, then every block selective with
    the first k recomputed fully, up to every block recomputed."""
    if ladder == "offload":
        return [("offload",) * k + ("none",) * (n - k) for k in range(1, n + 1)]
    return ([("selective",) * k + ("none",) * (n - k) for k in range(1, n + 1)]
            + [("full",) * k + ("selective",) * (n - k) for k in range(1, n + 1)])


def _ladder_candidates(space: SearchSpace, prec: str, lines: BlockLines, estimate_fn: EstimateFn) -> list[Candidate]:
    """Per ladder of :func:`_choice_ladders` and number of micro-batches, the fastest choice
    that fits by its memory line (traced exactly in stage 2 when it could win) and, where it
    offloads, whose offloaded activations fit the host's pinned memory (``space.host_bytes``); and
    the whole batch in one micro-batch where only the gradients the line holds across micro-batches
    put it over (traced exactly in stage 2, as :func:`_largest_fitting` traces the ends)."""
    E, tm = space.effective_batch, space.time_model
    best: dict[tuple, Candidate] = {}
    for policies, line in _choice_ladders(space, prec, lines, estimate_fn):
        m = line.largest_fitting(space.limit, E)
        on_host = tm.offloaded_bytes(prec, 1, policies)  # per sample
        if on_host and space.host_bytes is not None:  # one micro-batch's offloaded activations at a time
            m = min(m, int(space.host_bytes // on_host))
        # the line holds the window's gradients, which one micro-batch of the whole batch does not
        # (as :func:`_largest_fitting`'s ends): where that step may fit, stage 2 traces it (and shrinks)
        held = 0.0
        if m < E and line.reserved(E) - space.grad_bytes <= space.limit and \
                not (on_host and space.host_bytes is not None and on_host * E > space.host_bytes):
            m, held = E, space.grad_bytes
        if m < space.least_micro_batch:
            continue
        steps = accumulation_steps(E, m)
        mb = micro_batch_for(E, steps)
        full = tuple(i for i, p in enumerate(policies) if p == "full")
        c = Candidate(prec, mb, full, steps, int(line.reserved(mb) - held), None,
                      samples_per_s=tm.samples_per_s(prec, mb, E, len(full), policies), block_policies=policies)
        # one whose held gradients were left out is kept beside the line's own: its exact trace may
        # refuse it, and must not have displaced a choice that fits (a faster ladder's, at the same key)
        key = ("offload" in policies, steps, bool(held))
        if key not in best or c.samples_per_s > best[key].samples_per_s:
            best[key] = c
    return list(best.values())


def _frontier(space: SearchSpace, prec: str, lines: BlockLines, estimate_fn: EstimateFn) -> list[Candidate]:
    """The candidates of one precision: per number of micro-batches, the fewest checkpointed
    blocks that reach it (more would only add recomputation); plus, at an end of the block
    range where even micro-batch 1 does not fit, a candidate saying so."""
    E = space.effective_batch
    frontier: dict[int, Candidate] = {}  # accumulation steps -> fewest blocks that reach them
    out = []
    for k in range(space.first_blocks, space.last_blocks + 1):
        line = lines(k)
        fit = _largest_fitting(space, prec, k, line, estimate_fn)
        exact = fit.exact_peaks
        if fit.micro_batch == 0:
            if space.is_end(k):  # why fewer blocks lose, or nothing fits
                least = space.least_micro_batch
                out.append(Candidate(prec, least, tuple(range(k)), accumulation_steps(E, least), exact[least], None,
                                     why=f"does not fit: {format_bytes(exact[least])} at micro-batch {least}"))
            continue
        steps = accumulation_steps(E, fit.micro_batch)
        if steps in frontier:  # more recomputation for the same number of micro-batches
            continue
        mb = micro_batch_for(E, steps)  # balanced windows
        frontier[steps] = Candidate(prec, mb, tuple(range(k)), steps, int(exact.get(mb, line.reserved(mb))), None,
                                    samples_per_s=space.time_model.samples_per_s(prec, mb, E, k))
    return out + list(frontier.values())


@dataclass(frozen=True)
class _Fit:
    """The largest micro-batch that fits (0: none), and the exact peaks (reserved bytes by
    micro-batch) traced to find it."""

    micro_batch: int
    exact_peaks: dict


def _largest_fitting(space: SearchSpace, prec: str, k: int, line, estimate_fn: EstimateFn) -> _Fit:
    """The largest micro-batch that fits the limit with the first ``k`` blocks checkpointed,
    by ``line`` (:class:`~tightfit.memory.fast.MemoryLine`), and where the line is not to be
    trusted, by exact traces.

    The line comes from traces at micro-batches 4 and 16; at the ends of the block range the
    step differs in kind at both ends of the micro-batch range: one micro-batch holds no
    gradients across micro-batches (:func:`estimator_for` traces them held only when accumulating), and
    below 4 the line extrapolates. Those ends are traced exactly when the answer could change.
    """
    E, limit, least = space.effective_batch, space.limit, space.least_micro_batch
    m = line.largest_fitting(limit, E)
    m = m if m >= least else 0
    exact: dict[int, int] = {}
    if space.is_end(k):
        if m < E and line.reserved(E) - space.grad_bytes <= limit:
            exact[E] = estimate_fn(prec, E, tuple(range(k))).peak_reserved_bytes
            m = E if exact[E] <= limit else m
        if m == 0:
            exact[least] = estimate_fn(prec, least, tuple(range(k))).peak_reserved_bytes
            m = least if exact[least] <= limit else 0
    return _Fit(m, exact)


# ---------------------------------------------------------------- stage 2: predict

def predict(space: SearchSpace, enumeration: Enumeration, estimate_fn: EstimateFn, beat: float = 0.0) -> Prediction:
    """Stage 2: trace the candidates that fit by the lines exactly, fastest predicted first.
    One that does not fit is tried with more blocks checkpointed at its micro-batch
    (:func:`_more_blocks`) and shrunk (:func:`_shrink`); both results compete. A per-block
    ladder's candidate over at its micro-batch is shrunk, and at the end, where the next rung of
    its ladder is predicted faster than every plan traced, climbs it at the same micro-batch
    (:func:`_higher_rung`). A shrunk plan is
    slower, so tracing stops once the next candidate's prediction -- an upper bound -- cannot
    beat the best traced so far, or ``beat`` (samples/s found elsewhere).

    Raises:
        What ``estimate_fn`` raises.
    """
    order = space.precisions  # ties go to the card's preferred precision
    evaluated = list(enumeration.candidates)
    fitting = sorted((c for c in evaluated if c.samples_per_s > 0),
                     key=lambda c: (-round(c.samples_per_s, 6), order.index(c.precision), len(c.checkpoint_blocks)))
    traced: list[Candidate] = []
    missed: list[Candidate] = []  # per-block ladder candidates over at their own micro-batch
    # the first traces of the candidates the loop below reaches first, side by side
    _prefetch(estimate_fn, [(c.precision, c.micro_batch, c.choice) for c in fitting if c.samples_per_s > beat]
              [:max(1, plan_workers())])
    for cand in fitting:
        if cand.samples_per_s <= max([beat] + [v.samples_per_s for v in traced]):
            break
        more = None if cand.block_policies is not None else \
            _more_blocks(space, cand, enumeration.lines[cand.precision], estimate_fn)
        if more:  # the same micro-batches with more blocks checkpointed: may beat shrinking
            traced += more
            if len(more[0].checkpoint_blocks) <= len(cand.checkpoint_blocks):
                continue  # it fit as predicted (or with fewer blocks)
        got = _shrink(space, cand, estimate_fn, None if cand.block_policies is not None else
                      enumeration.lines[cand.precision](len(cand.checkpoint_blocks)))
        if cand.block_policies is not None and not (isinstance(got, Candidate) and got.micro_batch == cand.micro_batch):
            missed.append(cand)  # over at its micro-batch: higher on its ladder, below, if that can still win
        if isinstance(got, Candidate):
            traced.append(got)
            continue
        least = space.least_micro_batch
        evaluated = [c for c in evaluated if c is not cand] + [replace(
            cand, micro_batch=least, accumulation_steps=accumulation_steps(space.effective_batch, least),
            peak_reserved_bytes=got, samples_per_s=0.0,
            why=f"does not fit when traced exactly: {format_bytes(got)} at micro-batch {least}")]
    for cand in missed:  # fastest first, as they were met
        more = _higher_rung(space, cand, estimate_fn, max([beat] + [v.samples_per_s for v in traced]))
        if more is not None:
            traced.append(more)
    return Prediction(traced, evaluated)


def _higher_rung(space: SearchSpace, c: Candidate, estimate_fn: EstimateFn, beat: float = 0.0) -> Candidate | None:
    """For ``c``, a per-block ladder's candidate over the limit at its micro-batch: the lowest rung
    above it on its ladder (:func:`_rungs`) that fits at the same micro-batch, by bisection, its
    offloaded activations within the host's pinned memory, where the next rung is predicted faster
    than ``beat`` (samples/s already traced). None where not even the top rung fits, or climbing
    cannot win. Why not only a smaller micro-batch (:func:`_shrink`): a
    micro-batch of the whole batch holds no gradients across micro-batches, so the step one
    micro-batch smaller can need more memory, not less (BERT-base at 1000 MiB on a GTX 1650 Ti
    rules, AdamW state offloaded: 7 offloaded blocks at 32 x 1 were over, every smaller micro-batch
    too, while 9 blocks at 32 x 1 fit; the plan fell to a slower one of fp32 recomputation)."""
    rungs = _rungs("offload" if "offload" in c.block_policies else "selective", len(c.block_policies))
    at, mb, tm = rungs.index(c.block_policies), c.micro_batch, space.time_model
    host = space.host_bytes
    top = len(rungs) - 1
    while top > at and host is not None and tm.offloaded_bytes(c.precision, mb, rungs[top]) > host:
        top -= 1  # offloading more than the pinned memory holds
    peaks = {}

    def fits(i: int) -> bool:
        peaks[i] = estimate_fn(c.precision, mb, rungs[i])
        return peaks[i].peak_reserved_bytes <= space.limit

    def speed(i: int) -> float:
        return tm.samples_per_s(c.precision, mb, space.effective_batch, rungs[i].count("full"), rungs[i])

    if top == at or speed(at + 1) <= beat or not fits(top):
        return None
    good = bisect(top, at, fits)
    policies = rungs[good]
    full = tuple(i for i, p in enumerate(policies) if p == "full")
    return _traced(space, replace(c, block_policies=policies, checkpoint_blocks=full), mb, full, peaks[good])


def _more_blocks(space: SearchSpace, c: Candidate, lines: BlockLines, estimate_fn: EstimateFn) -> list[Candidate]:
    """Trace the candidate exactly at its micro-batch; if it does not fit, checkpoint more blocks
    (the fewest the memory line, shifted by the exact trace's error, says could fit; traced again
    each time) up to the most searched; then fewer where they fit (:func:`_fewer_blocks`).
    Empty if no block count fits at this micro-batch."""
    blocks, n_max, limit = c.checkpoint_blocks, space.last_blocks, space.limit
    while len(blocks) <= n_max:
        est = estimate_fn(c.precision, c.micro_batch, blocks)
        if est.peak_reserved_bytes <= limit:
            return _fewer_blocks(space, c, lines, blocks, est, estimate_fn)
        error = est.peak_reserved_bytes - lines(len(blocks)).reserved(c.micro_batch)
        k = next((j for j in range(len(blocks) + 1, n_max + 1)
                  if lines(j).reserved(c.micro_batch) + error <= limit), n_max + 1)
        blocks = tuple(range(k))
    return []


def _fewer_blocks(space: SearchSpace, c: Candidate, lines: BlockLines, blocks: tuple, est,
                  estimate_fn: EstimateFn) -> list[Candidate]:
    """``c`` at its micro-batch with ``blocks`` checkpointed, traced as ``est`` and fitting, and
    first the fewest blocks where the memory line, shifted onto that trace, says fewer fit and
    traces agree (each block fewer is one block's recomputation saved). The lines are fit on
    traces at other micro-batches and may over-state this one: ResNet-50 (micro-batch 128,
    4 GiB) was planned with 11 of 16 blocks checkpointed where 7 fit. The fewest the shifted line
    says fit is traced at once (and the line shifted onto it again); one that does not fit is
    bisected against the fewest traced that fit (:func:`.bisection.bisect`): the 1.3B decoder
    at 11 GiB went from 19 to 14 blocks in 1 trace, where a block at a time took 5. The first
    count traced stays a candidate: the verification falls back to it if the fewest miss for real."""
    limit, mb, first = space.limit, c.micro_batch, _traced(space, c, c.micro_batch, blocks, est)
    traced = {len(blocks): est}

    def fits(k: int) -> bool:
        traced[k] = estimate_fn(c.precision, mb, tuple(range(k)))
        return traced[k].peak_reserved_bytes <= limit

    n = len(blocks)
    while n > space.first_blocks:
        error = traced[n].peak_reserved_bytes - lines(n).reserved(mb)  # the line shifted onto the fewest that fit
        fewest = next((k for k in range(space.first_blocks, n) if lines(k).reserved(mb) + error <= limit), None)
        if fewest is None:
            break
        if not fits(fewest):
            n = bisect(n, fewest, fits)  # between the fewest that fit and the count that did not
            break
        n = fewest
    blocks = tuple(range(n))
    return [first] if blocks == first.checkpoint_blocks else [_traced(space, c, mb, blocks, traced[n]), first]


def _shrink(space: SearchSpace, c: Candidate, estimate_fn: EstimateFn, line: MemoryLine | None = None) \
        -> Candidate | int:
    """Trace the candidate exactly; if it does not fit, the largest smaller balanced micro-batch
    (more accumulation steps) that does. The peak grows with the micro-batch, so the answer is
    one boundary in the list of balanced micro-batches: found from a first guess
    (:func:`_first_guess`: the candidate's memory ``line`` where given, shifted onto the trace
    that did not fit), by steps that double away from the
    guess until the boundary is bracketed, then by bisection (:func:`.bisection.bisect`): two or
    three exact traces when the guess is close, never more than about twice a plain bisection's.
    If even the least micro-batch (1, or 2: ``space.least_micro_batch``) does not fit: its exact
    peak reserved bytes (an int) instead of a candidate."""
    E, mb = space.effective_batch, c.micro_batch
    est = estimate_fn(c.precision, mb, c.choice)
    if est.peak_reserved_bytes <= space.limit:
        return _traced(space, c, mb, c.checkpoint_blocks, est)
    smaller = [mb]  # balanced micro-batches below mb, largest first, down to the least (1, or 2: BatchNorm)
    while smaller[-1] > space.least_micro_batch:
        m = smaller[-1]
        smaller.append(min(m - 1, micro_batch_for(E, accumulation_steps(E, m) + 1)))  # strictly smaller
    last = len(smaller) - 1
    if last == 0:  # the least micro-batch did not fit
        return est.peak_reserved_bytes
    peaks = {0: est}

    def fits(i: int) -> bool:
        peaks[i] = estimate_fn(c.precision, smaller[i], c.choice)
        return peaks[i].peak_reserved_bytes <= space.limit

    g = _first_guess(smaller, est, space.limit, line)
    _prefetch(estimate_fn, [(c.precision, smaller[i], c.choice) for i in (g - 1, g, g + 1) if 1 <= i <= last])
    if fits(g):  # the boundary lies toward larger micro-batches (smaller indices), down to 0, a miss
        good, bad, step = g, 0, 1
        while good - step > bad:
            if not fits(good - step):
                bad = good - step
                break
            good, step = good - step, 2 * step
    else:  # toward smaller micro-batches
        good, bad, step = None, g, 1
        while good is None and bad < last:
            j = min(bad + step, last)
            if fits(j):
                good = j
            else:
                bad, step = j, 2 * step
        if good is None:  # not even the least micro-batch
            return peaks[last].peak_reserved_bytes
    good = bisect(good, bad, fits)
    return _traced(space, c, smaller[good], c.checkpoint_blocks, peaks[good])


def _first_guess(smaller: list[int], est, limit: float, line: MemoryLine | None = None) -> int:
    """The index in ``smaller`` (balanced micro-batches, largest first; ``smaller[0]`` traced as
    ``est``, over ``limit``) of the largest micro-batch predicted to fit: by ``line``'s slope
    from ``est``'s peak where a line is given, else taking the model state (weights, gradients,
    optimizer state at the peak) as fixed and the rest of the peak as proportional to the
    micro-batch. At least 1, at most the last index."""
    over = est.peak_reserved_bytes - limit
    if line is not None and line.slope > 0:
        m = smaller[0] - over / line.slope
        # the secant from the line's largest traced micro-batch to ``est``: where a flat phase
        # (the optimizer step's temporaries) holds the peak at the line's micro-batches, the
        # line's slope is a fraction of the activations' and its guess falls to micro-batch 1
        # (BERT-large, 8-bit state, every block checkpointed: 0.004 against 0.02 GiB per sample)
        top = TRACED_AT[-1]
        if smaller[0] > top and est.peak_reserved_bytes > line.reserved(top):
            secant = (est.peak_reserved_bytes - line.reserved(top)) / (smaller[0] - top)
            m = max(m, smaller[0] - over / secant)
    else:
        fixed = sum(est.breakdown.get(k, 0) for k in ("parameters", "gradients", "optimizer_state"))
        rest = est.peak_reserved_bytes - fixed
        m = smaller[0] * (limit - fixed) / rest if rest > 0 else 0
    return next((i for i, v in enumerate(smaller) if i >= 1 and v <= m), len(smaller) - 1)


def _traced(space: SearchSpace, c: Candidate, mb: int, blocks: tuple, est) -> Candidate:
    """``c`` at micro-batch ``mb`` with ``blocks`` checkpointed, with its exact estimate ``est``."""
    E = space.effective_batch
    return Candidate(c.precision, mb, blocks, accumulation_steps(E, mb), est.peak_reserved_bytes,
                     est.peak_allocated_bytes, dict(est.breakdown),
                     space.time_model.samples_per_s(c.precision, mb, E, len(blocks), c.block_policies),
                     block_policies=c.block_policies)


def rank(space: SearchSpace, prediction: Prediction, seconds: float) -> SearchResult:
    """The fastest traced candidate (ties: the one traced first) and the runners-up, each with
    why it lost: traced ones and those only predicted by the lines (fastest first, saying which),
    then those that do not fit. ``seconds``: the search's wall time so far."""
    traced, evaluated = prediction.traced, prediction.evaluated
    order = {id(c): i for i, c in enumerate(traced)}  # ties: the earlier (preferred) one
    best = max(traced, key=lambda c: (round(c.samples_per_s, 6), -order[id(c)]))
    best = replace(best, why=f"fastest predicted: {format_rate(best.samples_per_s)} samples/s, peak "
                             f"{format_bytes(best.peak_reserved_bytes)} of {format_bytes(space.budget_bytes)}"
                             + _overheads(space, best))
    first = space.precisions[0]
    if best.precision != first:  # not the card's preferred precision: memory made the other one pay
        rival = max((c.samples_per_s for c in traced + evaluated if c.precision == first and c.samples_per_s > 0),
                    default=0.0)
        because = (", whose activations take twice the memory and so more recomputation or offload to fit"
                   if first == "fp32" else "")
        best = replace(best, why=f"{best.why}; precision {best.precision}: predicted faster here than {first}, this "
                                 f"card's first choice{because}" + (f" (its fastest plan: {format_rate(rival)} samples/s)"
                                                                   if rival else " (it fits nothing)"))
    done = {_key(v) for v in traced}
    others = [v for v in traced if _key(v) != _key(best)]
    others += [c for c in evaluated if c.samples_per_s > 0 and _key(c) not in done]
    others.sort(key=lambda c: -c.samples_per_s)
    runners = []
    for c in others + [c for c in evaluated if c.samples_per_s == 0]:
        if c.samples_per_s > 0:
            exact = _key(c) in done
            ratio = c.samples_per_s / best.samples_per_s
            c = replace(c, why=f"{'slower' if ratio < 0.995 else 'as fast, ranked after it'}: predicted "
                               f"{format_rate(c.samples_per_s)} samples/s ({ratio:.2f}x)"
                               + ("" if exact else ", memory from the line, not traced exactly"), traced=exact)
        runners.append(c)
    return SearchResult(best, runners, space.budget_bytes, space.effective_batch, space.n_blocks, seconds)


def _key(c: Candidate) -> tuple:
    return c.precision, c.checkpoint_blocks, c.block_policies


def _overheads(space: SearchSpace, c: Candidate) -> str:
    """``"; per step: recomputation 12 ms, host transfers 3 ms (1.50 GiB of pinned host memory)"``
    (the parts paid, predicted; the pinned memory: one micro-batch's offloaded activations)."""
    tm = space.time_model
    _, recompute, transfer = tm.step_parts(c.precision, c.micro_batch, space.effective_batch,
                                           len(c.checkpoint_blocks), c.block_policies)
    parts = [f"{name} {t * 1e3:.0f} ms" for name, t in (("recomputation", recompute), ("host transfers", transfer))
             if t > 0]
    pinned = tm.offloaded_bytes(c.precision, c.micro_batch, c.block_policies)
    if pinned and parts:
        parts[-1] += f" ({format_bytes(pinned)} of pinned host memory)"
    return f"; per step: {', '.join(parts)}" if parts else ""


def _raise_nothing_fits(space: SearchSpace, evaluated: list[Candidate], model, make_batch, size: int,
                        profile: DeviceProfile, estimate_fn: EstimateFn, estimator_at,
                        optimizer: str = "adamw", lever_estimator=None, lever_precisions=(),
                        asked_precision: str = "auto") -> None:
    """Raise the error that says by how much the smallest step tried misses, what the model
    state costs, what fits instead and which levers would make it fit
    (:func:`.advice.nothing_fits_lines`).

    Raises:
        NothingFitsError: always.
    """
    limit, n_blocks, mb = space.limit, space.n_blocks, space.least_micro_batch
    smallest = min((c for c in evaluated if c.peak_reserved_bytes), key=lambda c: c.peak_reserved_bytes)
    # the least memory searched, exactly: the least micro-batch (1, or 2: BatchNorm) with every
    # block or none checkpointed (a checkpointed step carries the estimator's margin, :mod:`.margins`,
    # so either may be smaller)
    options = [tuple(range(k)) for k in dict.fromkeys((space.last_blocks, space.first_blocks))]
    ests = [estimate_fn(smallest.precision, mb, o) for o in options]
    i = min(range(len(options)), key=lambda j: ests[j].peak_reserved_bytes)
    est, least = ests[i], options[i]
    options.sort(key=lambda o: o != least)
    size_flag = "--image-size" if getattr(make_batch, "kind", "text") == "image" else "--seq-len"
    # each lever's smallest step as the search of it would trace it (a lever would fit only if it plans)
    peaks = None if lever_estimator is None else lever_peaks(
        model, lever_estimator, lever_precisions,
        least_memory_options(space.first_blocks, space.last_blocks, n_blocks, space.ladders), limit,
        space.effective_batch)
    # what fits instead, in every precision the search plans in: fp32 too under --precision auto,
    # which the search falls back to where the card's 16-bit precision fits nothing (search())
    planned_precisions = list(space.precisions) + (
        ["fp32"] if asked_precision == "auto" and "fp32" not in space.precisions else [])
    lines = nothing_fits_lines(model, est, limit, smallest.precision, options, size, space.effective_batch,
                               size_flag, profile.host_link_bytes_per_s, estimator_at, optimizer, profile, peaks,
                               asked_precision=asked_precision, precisions=planned_precisions)
    if space.last_blocks < n_blocks:  # checkpointing was turned off
        every = estimate_fn(smallest.precision, mb, tuple(range(n_blocks))).peak_reserved_bytes
        lines.insert(0, f"{'fits' if every <= limit else 'does not fit either'}: micro-batch {mb} with all "
                        f"{n_blocks} blocks checkpointed, {format_bytes(every)} (--checkpointing auto)")
    raise NothingFitsError(
        f"nothing fits {format_bytes(space.budget_bytes)} (planned against {format_bytes(limit)}, keeping "
        f"{int(space.headroom * 100)}% headroom): the smallest step tried ({smallest.precision}, micro-batch {mb}, "
        f"{len(least)} of {n_blocks} blocks checkpointed) needs {format_bytes(est.peak_reserved_bytes)}, "
        f"{format_bytes(est.peak_reserved_bytes - limit)} over" + "".join("\n  " + x for x in lines))


# ---------------------------------------------------------------- the estimator the stages use

def estimator_for(model, make_batch, size: int, profile: DeviceProfile, effective_batch: int,
                  checkpointed_margin: float = CHECKPOINTED_RESERVED_MARGIN, optimizer: str = "adamw") -> EstimateFn:
    """``estimate_fn`` backed by :func:`tightfit.memory.estimate` (through a
    :class:`~tightfit.memory.replay.Replayer`: the same estimates, fewer traces): with accumulation
    the estimate traces a micro-batch run with the window's gradients held (as every micro-batch
    after a window's first runs); checkpointed plans carry the estimator's margin on reserved (:func:`.margins.estimator_margin_bytes`;
    ``checkpointed_margin`` 0 when real probe steps verify the plan).

    Args:
        model, make_batch, size: the workload (``make_batch(micro_batch, size)``).
        profile: the card modelled; ``effective_batch``: samples per optimizer step.
        optimizer: the plan's optimizer (:data:`tightfit.step.OPTIMIZERS`).

    Raises:
        What :func:`tightfit.memory.estimate` raises, when the returned function is called.
    """
    from ..memory.estimate import MemoryEstimate
    from ..memory.replay import Replayer

    from ..levers.freezing import frozen_prefix_blocks

    # the same answers as tracing each estimate, some replayed from earlier traces of the same blocks
    replayer = Replayer(model, make_batch(1, size), profile)
    free = frozen_prefix_blocks(model, make_batch(1, size))  # frozen first blocks: checkpointed, they recompute nothing

    def fn(precision: str, micro_batch: int, blocks) -> MemoryEstimate:
        # the window's effective batch: with accumulation the estimate traces a micro-batch run
        # with the window's gradients held
        plan = Plan(precision, micro_batch, max(micro_batch, effective_batch), optimizer=optimizer, device="cuda")
        blocks = tuple(blocks)
        if blocks and isinstance(blocks[0], str):  # one policy per block
            est = replayer.estimate(plan, block_policies=blocks)
            checkpointed = any(p != "none" for p in blocks)
        else:
            est = replayer.estimate(plan, checkpoint_blocks=blocks)
            checkpointed = any(i >= free for i in blocks)
        margin = estimator_margin_bytes(est.peak_reserved_bytes, checkpointed, checkpointed_margin)
        if not margin:
            return est
        bd = dict(est.breakdown)
        bd["estimator_margin"] = margin  # its own line: `tightfit estimate` of the same step shows none
        return MemoryEstimate(est.peak_allocated_bytes, est.peak_reserved_bytes + margin, bd, est.plan,
                              est.first_step_peak_reserved_bytes, est.allocator, est.extra)

    return fn
