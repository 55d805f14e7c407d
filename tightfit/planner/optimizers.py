"""The optimizer as an outer dimension of the plan search: fp32 AdamW state first, then the
levers of :mod:`tightfit.levers.optimizers` where they can help.

Order (``optimizer="auto"``): search with fused AdamW (:func:`.search.search`). If its best plan
needs neither accumulation nor any block recomputed or offloaded, it stands (the levers are taken only
to pay less for memory; 8-bit state and bf16 weights also change the numerics). Otherwise (or if
nothing fits) the levers may help: 8-bit AdamW state; the state offloaded to the CPU (only where
the host has the memory for it); bf16 weights and 8-bit state (``adamw8bit-bf16``: bf16 autocast
only, so only where the precision asked for is ``auto`` or ``bf16`` and the card runs bf16; it
changes the numerics: no fp32 copy of the weights, updates stochastically rounded). Where 8-bit
state fits without accumulation or recomputation, offload and bf16 weights are searched only where
their ceiling (below) is above that plan (either can be faster: offload's step off the GPU, bf16
weights' half the bytes). The levers are
searched in the order of their bounds (:func:`.search.predicted_bound`: the fastest plan their
memory lines say fits, from the traces their searches begin with), each with the best plan found
so far to beat (``beat``: only plans its lines predict faster are traced); a bound may come from
another optimizer's traces, shifted by the difference in model state (:func:`bound_shift`), and a
lever whose such bound is far below the plan found is not traced at all. The lines' predictions
are not a strict bound (a candidate traced exactly may fit with fewer blocks than its line said,
and run faster), so which lever goes first can change the plan in a close call: on the bench
workloads the plans are those of the fixed order, with fewer traces (BERT-large at 4 GiB: 45 -> 35).
A lever whose time-model ceiling (:func:`unconstrained_samples_per_s`) is no faster than the
best plan already found is not searched: none of its plans could win. The fastest predicted plan
of those searched wins, and its reasons say why its optimizer was
chosen and what it costs (state bytes on the GPU, the optimizer step's predicted time, host
memory, bf16 weights). The other optimizers' results that fit come back too
(``SearchResult.other_optimizers``), those that a search returned: a lever that could not beat the
plan found returns none. On a GPU the planner times the first of them as well
(:func:`tightfit.planner.gpu.challenge_optimizer`), since a lever's predicted step time can be
off on a host-bound card. An explicit optimizer is searched alone.
"""

from __future__ import annotations

import time
from dataclasses import replace

from ..errors import TightfitError
from ..levers.optimizers import check_precision
from ..levers.optimizers import (LEVER_LIBRARY, LEVER_OPTIMIZERS, adamw_8bit_bf16_state_bytes, adamw_8bit_state_bytes,
                                 PINNED_HOST_SHARE, available_host_bytes, is_offloaded, offload_host_bytes, pinned_shortfall,
                                 weights_dtype)
from ..units import format_bytes, format_bytes_pair, format_rate
from ..plan import OPTIMIZER_CHOICES
from ..levers.blocks import find_blocks
from .cost import TimeModel, forward_cost, remembered_forward_costs
from .margins import HEADROOM, planned_limit
from .search import (CannotBeatError, NothingFitsError, NotTraced, SearchResult, predicted_bound, remembering, search,
                     shifted)

# `tightfit plan` plans for a card elsewhere, whose host memory it cannot see: offload is not
# ruled out by this machine's free memory (the plan's reason says how much pinned memory it needs).
UNKNOWN_HOST_BYTES = 2**62

_NAMES = {"adamw": "fp32 AdamW state", "adamw8bit": "8-bit AdamW state (bitsandbytes AdamW8bit)",
          "adamw-offload": "AdamW state and fp32 master weights on the CPU (torchao CPUOffloadOptimizer)",
          "adamw8bit-bf16": "bf16 weights, updates stochastically rounded (torchao AdamW8bit), 8-bit AdamW state; "
                            "this changes the numerics (no fp32 copy of the weights)"}


def levers_installed(kind: str | None = None) -> bool:
    """Whether the library of optimizer lever ``kind`` (:data:`LEVER_LIBRARY`, the ``levers``
    extra) can be imported; without ``kind``, that of any lever."""
    import importlib.util

    return any(importlib.util.find_spec(LEVER_LIBRARY[k]) is not None for k in ([kind] if kind else LEVER_OPTIMIZERS))


def _several_ranks() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _ranks_on_this_host() -> int:
    """Processes of this run on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 alone): each
    pins its own offloaded activations."""
    import os

    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _constrained(result: SearchResult, forced: bool = False) -> bool:
    """Whether the best plan pays for its memory in time: accumulation, or any block recomputed
    (fully or selectively) or with its activations offloaded; with ``forced`` (``--checkpointing
    on``: every block recomputed as asked, whatever the memory) accumulation only."""
    b = result.best
    return b.accumulation_steps > 1 or not forced and (bool(b.paid_blocks) or any(
        p != "none" for p in b.block_policies or ()))


_BLOCK_WORDS = {"selective": "selectively recomputed", "full": "checkpointed", "offload": "offloaded"}


def _what_it_pays(b, forced: bool = False) -> str:
    """``"7 accumulation steps, 5 selectively recomputed blocks and 1 checkpointed block"``: what
    candidate ``b`` uses to fit (with ``forced``, ``--checkpointing on``, its blocks are as asked,
    not paid for memory: accumulation only)."""
    def n(k: int, what: str) -> str:
        return f"{k} {what}{'s' if k != 1 else ''}"

    parts = [n(b.accumulation_steps, "accumulation step")] if b.accumulation_steps > 1 else []
    if not forced and b.block_policies is not None:
        parts += [n(b.block_policies.count(p), f"{w} block") for p, w in _BLOCK_WORDS.items() if p in b.block_policies]
    elif not forced and b.paid_blocks:  # frozen first blocks recompute nothing
        parts.append(n(len(b.paid_blocks), "checkpointed block"))
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def state_bytes(model, kind: str) -> int:
    """GPU bytes of the optimizer state of ``model``'s trainable parameters under ``kind``
    (:mod:`tightfit.levers.optimizers` for the layouts)."""
    if kind == "adamw8bit":
        return adamw_8bit_state_bytes(p.numel() for p in model.parameters() if p.requires_grad)
    if kind == "adamw8bit-bf16":
        return adamw_8bit_bf16_state_bytes(p.numel() for p in model.parameters() if p.requires_grad)
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        if kind == "adamw-offload":
            total += 0 if is_offloaded(n) else 8 * n
        else:
            total += 8 * n
    return total


def optimizer_step_seconds(model, kind: str, profile, micro_batches: int) -> float:
    """The time model's optimizer share of one step (:meth:`.cost.TimeModel.optimizer_seconds`),
    seconds, from ``model``'s trainable parameters."""
    from .cost import ForwardCost, TimeModel, optimizer_tensor_counts

    trained = [p for p in model.parameters() if p.requires_grad]
    cost = ForwardCost(0.0, 0, sum(p.numel() for p in trained), 0,
                       **optimizer_tensor_counts(p.shape for p in trained))
    return TimeModel(profile, cost, optimizer=kind).optimizer_seconds(micro_batches)


def weight_bytes(kind: str) -> int:
    """Bytes per weight (and per gradient) under optimizer ``kind``: 2 where it keeps the weights
    in bf16 (:func:`tightfit.levers.optimizers.weights_dtype`), else 4 (fp32)."""
    return 2 if weights_dtype(kind) is not None else 4


def least_state_bytes(model, optimizer: str = "auto", levers: bool = True) -> tuple[int, str]:
    """The least model state a step can hold on the GPU, bytes, and the optimizer that holds it:
    the weights (4 B per parameter, 2 B under ``adamw8bit-bf16``: :func:`weight_bytes`) plus, per
    trainable parameter, the gradient (as many bytes; with CPU offload none is held at once without
    accumulation) and the optimizer state (:func:`state_bytes`), over ``optimizer`` (``auto``: every
    optimizer, the levers only if ``levers``)."""
    kinds = [optimizer] if optimizer != "auto" else ["adamw"] + (list(LEVER_OPTIMIZERS) if levers else [])
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    need = {k: weight_bytes(k) * (params + (0 if k == "adamw-offload" else trainable)) + state_bytes(model, k)
            for k in kinds}
    kind = min(need, key=need.get)
    return need[kind], kind


# Of the planned limit: how much less than the model-state difference another optimizer's steps may
# hold, in a bound from a traced optimizer's steps (:func:`bound_shift`); what else differs (the
# optimizer step's temporaries, allocator rounding) was within 0.03 GiB on BERT-base and -large.
BOUND_SLACK = 0.02


# How far below a lever's bound from its own traces a bound from another's shifted traces has been:
# 0.62x (BERT-large at 4 GiB, bf16 weights from CPU offload's traces: 720 against 1,158 samples/s;
# the lines' slopes differ too). A lever is left untraced only if its stand-in bound is this many
# times below the plan found.
STAND_IN_ERROR = 1.6


def step_temporary_bytes(model, kind: str) -> int:
    """The most bytes optimizer ``kind``'s step holds beyond its state while it runs (as the
    estimator's :class:`tightfit.step.MetaOptimizer` allocates them): the 8-bit bf16 update's
    dequantized moments of its largest call or its flat call's concatenated weights and gradients,
    whichever is more (:func:`~tightfit.levers.optimizers.bf16_step_temporary_bytes`), the
    multi-tensor AdamW's square roots, none for the fused and 8-bit steps."""
    from ..levers.optimizers import bf16_step_temporary_bytes

    trained = [p for p in model.parameters() if p.requires_grad]
    if kind == "adamw-foreach":
        return sum(4 * p.numel() for p in trained)
    if kind != "adamw8bit-bf16":
        return 0
    return bf16_step_temporary_bytes(p.shape for p in trained)


def bound_shift(model, kind: str, traced: str, precision: str, limit: float) -> float:
    """Bytes to add to the peaks traced with optimizer ``traced`` for an optimistic (low) stand-in
    for ``kind``'s at the same micro-batch and blocks: the difference of their least model state
    (:func:`least_state_bytes`: CPU offload's gradients counted as freed, as without accumulation),
    less what only ``traced`` may hold at its peak -- its step's temporaries
    (:func:`step_temporary_bytes`) and, where ``kind`` keeps bf16 weights and ``traced`` fp32 ones,
    the 16-bit copies autocast makes of them (2 B per parameter) -- in full, though each is held at
    some moments only, less :data:`BOUND_SLACK` of ``limit``."""
    shift = least_state_bytes(model, kind)[0] - least_state_bytes(model, traced)[0]
    shift -= step_temporary_bytes(model, traced)
    if weights_dtype(kind) is not None and weights_dtype(traced) is None and precision != "fp32":
        shift -= 2 * sum(p.numel() for p in model.parameters() if p.is_floating_point())
    return shift - BOUND_SLACK * limit


def unconstrained_samples_per_s(cost, profile, kind: str, effective_batch: int, precision: str = "auto") -> float:
    """The time model's samples/s for optimizer ``kind`` with no memory limit: the whole effective
    batch in one micro-batch, no block recomputed or offloaded, the fastest precision allowed.
    No plan with ``kind`` is predicted faster (each of those adds time, :class:`.cost.TimeModel`),
    so a lever whose ceiling is at most the best already found need not be searched.

    Args:
        cost: the workload's :class:`.cost.ForwardCost`; ``profile``: the card.

    Raises:
        TightfitError: a ``precision`` the card cannot run.
    """
    from .search import candidate_precisions

    tm = TimeModel(profile, cost, optimizer=kind)
    precisions = ["bf16"] if weights_dtype(kind) is not None else candidate_precisions(profile, precision)
    return max(tm.samples_per_s(p, effective_batch, effective_batch, 0) for p in precisions)


def _apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` (samples/s) as text, each as the plan's headline writes a rate
    (:func:`~tightfit.units.format_rate`), so that ``b`` -- the plan already found, named beside
    every lever's ceiling -- reads the same in each line and in the headline (it read "13.15" beside
    one lever, "13" beside the next and "13.2" in the headline). An ``a`` just below ``b`` that
    would read the same gets the decimals (up to 3) that read as below: "909.7" beside "910".
    Equal texts: about the same."""
    x, y = format_rate(a), format_rate(b)
    if x == y and a < b:
        for d in range(1, 4):
            if float(f"{a:.{d}f}") < float(y):
                return f"{a:.{d}f}", y
    return x, y


def _cost_line(model, result: SearchResult, kind: str, profile) -> str:
    """What the optimizer of ``result`` costs: GPU state bytes (the traced plan's, as its breakdown
    shows them: with the ``step`` tensors and the allocator's rounding; else :func:`state_bytes`),
    step time, host memory."""
    b = result.best
    held = b.breakdown.get("optimizer_state", state_bytes(model, kind))
    gpu = f"optimizer state on the GPU {format_bytes(held)}" + (
        "" if kind == "adamw" else f" (fp32 AdamW: {format_bytes(state_bytes(model, 'adamw'))})")
    if kind == "adamw-offload":
        host = offload_host_bytes(p.numel() for p in model.parameters() if p.requires_grad)
        gpu += f", {format_bytes(host)} of pinned host memory"
    if weights_dtype(kind) is not None:
        params = sum(p.numel() for p in model.parameters())
        gpu += f"; weights in bf16 {format_bytes(2 * params)} (fp32: {format_bytes(4 * params)}), gradients too"
    step = optimizer_step_seconds(model, kind, profile, b.accumulation_steps)
    return f"{gpu}; the optimizer's share of each step predicted at {step * 1000:.0f} ms"


@remembered_forward_costs()  # the bounds' and searches' time models share one forward's cost
def search_optimizers(model, make_batch, size: int, effective_batch: int, profile, budget_bytes: int,
                      estimator, optimizer: str = "auto", estimator_at=None, levers: bool | None = None,
                      host_bytes: int | None = None, **options) -> SearchResult:
    """The fastest plan over precision x checkpointing x micro-batch (:func:`.search.search`)
    and the optimizer (the module doc says in which order).

    Args:
        model, make_batch, size, effective_batch, profile, budget_bytes: as :func:`.search.search`.
        estimator: ``kind -> estimate_fn`` (e.g. :func:`.search.estimator_for` with ``optimizer=kind``).
        optimizer: ``auto`` or one of :data:`tightfit.step.OPTIMIZERS` to search alone.
        estimator_at: ``kind -> (size, effective_batch) -> estimate_fn`` for the nothing-fits
            advice, or None.
        levers: whether ``auto`` may choose the levers (None: those whose library is installed).
        host_bytes: host memory available for offloaded optimizer state and activations (None:
            :func:`available_host_bytes`; :data:`UNKNOWN_HOST_BYTES` or more: another machine's,
            not limited).
        options: ``precision``, ``checkpointing``, ``headroom`` of :func:`.search.search`.

    Returns:
        The winner's :class:`~.search.SearchResult`, its candidates marked with the optimizer
        and the best's ``why`` saying why that optimizer.

    Raises:
        NothingFitsError: nothing fits with any optimizer searched (the fp32 AdamW message,
            with a line per lever searched).
        TightfitError: as :func:`.search.search`.
    """
    if optimizer not in OPTIMIZER_CHOICES:
        raise TightfitError(f"unknown optimizer {optimizer!r}; use {', '.join(OPTIMIZER_CHOICES)}")
    precision = options.get("precision", "auto")
    check_precision(optimizer, precision, profile)
    started = time.perf_counter()  # the result's seconds: every optimizer's search, not only the winner's
    have = available_host_bytes() if host_bytes is None else host_bytes
    pinned_state = offload_host_bytes(p.numel() for p in model.parameters() if p.requires_grad)  # adamw-offload's

    def activation_host_bytes(kind: str) -> float | None:
        # pinned host memory left to offloaded activations: the pinned share of what is available,
        # shared by the ranks on this host, less adamw-offload's pinned state; None where the host
        # is not this one
        if host_bytes is not None and host_bytes >= UNKNOWN_HOST_BYTES:
            return None
        state = pinned_state if kind == "adamw-offload" else 0
        return max(0.0, PINNED_HOST_SHARE * have / _ranks_on_this_host() - state)

    estimates = {}

    def estimate_fn(kind: str):  # one per optimizer, its traces shared by its bound and its search
        if kind not in estimates:
            estimates[kind] = remembering(estimator(kind))
        return estimates[kind]

    limit = planned_limit(budget_bytes, options.get("headroom", HEADROOM))

    def state_over_limit(kind: str) -> bool:  # the model state alone over the limit, and another's fits
        return optimizer == "auto" and least_state_bytes(model, kind)[0] > limit and \
            any(least_state_bytes(model, k)[0] <= limit for k in ["adamw", *kinds])

    def opts_for(kind: str) -> dict:  # bf16 weights train under bf16 autocast only: their search is bf16's alone
        return dict(options, precision="bf16") if weights_dtype(kind) is not None else options

    def run(kind: str, beat: float = 0.0, advise: bool = False) -> SearchResult:
        if state_over_limit(kind):  # no trace
            need = least_state_bytes(model, kind)[0]
            # fp32 AdamW's message heads the error, each lever's follows its own name
            whose = "fp32 AdamW's model state (weights, gradients, optimizer state)" if kind == "adamw" \
                else "its model state"
            shown = format_bytes_pair(need, limit)
            raise NothingFitsError(f"{whose} alone, {shown[0]}, is over the {shown[1]} a step may hold")
        at = estimator_at(kind) if estimator_at is not None else None
        # the nothing-fits advice traces each lever's smallest step only where it is the last word
        # (``advise``): under auto the levers are searched next (and say for themselves whether they fit)
        levers_next = optimizer == "auto" and bool(kinds) and not advise
        r = search(model, make_batch, size, effective_batch, profile, budget_bytes, estimate_fn(kind),
                   estimator_at=at, optimizer=kind, beat=beat, lever_estimator=None if levers_next else estimator,
                   host_bytes=activation_host_bytes(kind), **opts_for(kind))
        return replace(r, best=replace(r.best, optimizer=kind),
                       runners_up=[replace(c, optimizer=kind) for c in r.runners_up])

    if optimizer != "auto":
        r = run(optimizer)
        named = f", {_NAMES[optimizer]}" if weights_dtype(optimizer) is not None else ""  # it changes the numerics
        return _explained(r, optimizer, f"optimizer {optimizer}{named}: as asked (--optimizer {optimizer})", model,
                          profile, started)
    if levers is None:
        kinds = [k for k in LEVER_OPTIMIZERS if levers_installed(k)]
        missing = [k for k in LEVER_OPTIMIZERS if k not in kinds]
    else:
        kinds, missing = (list(LEVER_OPTIMIZERS) if levers else []), []
    levers = bool(kinds)
    results, failures, short = {}, {}, {}  # short: why a lever was not searched, in a few words
    forward = {}
    try:
        results["adamw"] = run("adamw")
    except NothingFitsError as e:
        failures["adamw"] = e
    forced = options.get("checkpointing") == "on"  # every block recomputed as asked: not paid for memory
    if "adamw" in results and not _constrained(results["adamw"], forced):
        # every block frozen (frozen-N of all N) keeps nothing to recompute: none is checkpointed
        without = ("accumulation (every block checkpointed, as --checkpointing on asks)"
                   if forced and results["adamw"].best.paid_blocks else "accumulation" if forced else
                   "accumulation, checkpointing or activation offload")
        return _explained(results["adamw"], "adamw", f"optimizer adamw (fused, fp32 state): the plan fits without "
                          f"{without}, so no optimizer lever is needed", model, profile, started)
    if not levers:
        if "adamw" in results:
            return _explained(results["adamw"], "adamw", "optimizer adamw (fused, fp32 state): the optimizer levers "
                              "were not searched (pip install 'tightfit[levers]')", model, profile, started)
        raise failures["adamw"]
    def ceiling(kind: str) -> float:  # no plan with ``kind`` is predicted faster
        if "cost" not in forward:  # one meta forward for every lever's ceiling
            forward["cost"] = forward_cost(model, make_batch, size, len(find_blocks(model)))
        return unconstrained_samples_per_s(forward["cost"], profile, kind, effective_batch, precision)

    def cannot_win(kind: str) -> bool:  # its ceiling no faster than the best found: no trace
        found = max((r.best.samples_per_s for r in results.values()), default=0.0)
        if not found or ceiling(kind) > found:
            return False
        at_most, best = _apart(ceiling(kind), found)
        short[kind] = (f"at most {at_most} samples/s even without accumulation or recomputation, "
                       + (f"below the {best} already found" if at_most != best else
                          f"about the same as the {best} already found"))
        failures[kind] = NothingFitsError(short[kind])
        return True

    # Each lever's bound (the fastest plan its memory lines say fits, from the traces its search
    # begins with) orders the searches: the lever likely to win is searched first, and the others
    # trace only plans predicted to beat it (``beat``). In the levers' order, BERT-large at 4 GiB
    # (NVIDIA H200) traced 53 estimates, 28 of them for 8-bit state, which lost to bf16 weights.
    # A lever whose ceiling is below a bound already known is ordered after it by that ceiling,
    # with no trace: it traces only if the plans found before it fall below its ceiling.
    bounds, pending, stand_in_for = {}, [], {}  # stand_in_for: lever -> the optimizer whose traces bound it
    for kind in kinds:
        if weights_dtype(kind) is not None and (precision not in ("auto", "bf16") or not profile.bf16):
            short[kind] = (f"needs bf16 autocast, --precision {precision} asked for" if precision not in ("auto", "bf16")
                           else f"needs bf16, which {profile.name} does not run")
            failures[kind] = NothingFitsError(short[kind])
            continue
        if kind == "adamw-offload":
            if _several_ranks():  # torchao's CPUOffloadOptimizer offloads one GPU's state
                continue
            if reason := pinned_shortfall(pinned_state, have):
                short[kind] = reason
                failures[kind] = NothingFitsError(reason)
                continue
        if cannot_win(kind):
            continue
        if state_over_limit(kind):
            bounds[kind] = 0.0  # its search says so, with no trace
            continue
        pending.append(kind)
    # One optimizer's traces stand in for the others' bounds, shifted by the difference in model state
    # (:func:`bound_shift`, optimistic): fp32 AdamW's where it was searched, else those of the lever
    # traced first, one whose peaks hold least of what the others' may lack (no step temporaries,
    # fp32 weights), so that the shift is close. A lever whose stand-in bound cannot beat the plan
    # found when its turn comes (by :data:`STAND_IN_ERROR`) is not traced at all. BERT-large at 4 GiB,
    # batch 256: 37 -> 27 traces (42 before the cheaper shrink), the same plan. With two levers
    # pending, the reference's traces would only bound the other one, which its own search traces
    # anyway unless the first search's plan beats it: the one with the higher ceiling goes first, and
    # the other is then often ruled out by its ceiling, with no trace (the 1.3B decoder at 11 GiB:
    # bf16 weights' ceiling 32 samples/s, offload's 6: 25 -> 17 traces, the same plan).
    ref = "adamw" if "adamw" in estimates else None
    if ref is None and len(pending) == 2:
        pending.sort(key=lambda k: -ceiling(k))
    elif ref is None:
        pending.sort(key=lambda k: (step_temporary_bytes(model, k) > 0 or weights_dtype(k) is not None,
                                    least_state_bytes(model, k)[0]))
    for kind in pending:
        found = max((r.best.samples_per_s for r in results.values()), default=0.0)
        bound_at = dict(optimizer=kind, beat=found, host_bytes=activation_host_bytes(kind), **opts_for(kind))
        if ref is not None:
            stand_in = shifted(estimate_fn(ref), bound_shift(model, kind, ref, bound_at.get("precision", "auto"), limit))
            try:
                bound, whole = predicted_bound(model, make_batch, size, effective_batch, profile, budget_bytes,
                                               stand_in, **bound_at)
            except NotTraced:  # the reference knows no step at all: the lever's own traces
                pass
            else:
                if not (whole and kind == "adamw8bit"):  # 8-bit state fitting whole: traced, its plan the one to beat
                    bounds[kind], stand_in_for[kind] = bound, ref
                    continue
        if bounds and ceiling(kind) <= max(bounds.values()):
            bounds[kind] = ceiling(kind)
            continue
        bounds[kind], whole = predicted_bound(model, make_batch, size, effective_batch, profile, budget_bytes,
                                              estimate_fn(kind), **bound_at)
        ref = ref or kind
    for kind in sorted(bounds, key=lambda k: -bounds[k]):  # stable: ties in the levers' order
        found = max((r.best.samples_per_s for r in results.values()), default=0.0)
        # where 8-bit state fits without paying, a lever can still be faster (bf16 weights: no fp32 weights
        # to cast; offload: its optimizer step off the GPU): its ceiling decides. Stopping there planned
        # ResNet-50 at 32 pixels slower at 400-450 MiB than at 300 MiB (bf16 weights; offload under fp16)
        if cannot_win(kind):
            continue
        if kind in stand_in_for and 0 < bounds[kind] * STAND_IN_ERROR <= found:  # untraced
            short[kind] = (f"not traced: bounded from {stand_in_for[kind]}'s traces at {format_rate(bounds[kind])} "
                           f"samples/s, below the {format_rate(found)} already found")
            failures[kind] = NothingFitsError(short[kind])
            continue
        try:
            results[kind] = run(kind, beat=found)  # only plans predicted faster than found are traced
        except NothingFitsError as e:
            failures[kind] = e
        except CannotBeatError as e:
            short[kind] = str(e)
            failures[kind] = NothingFitsError(short[kind])
    if not results:
        try:  # fp32 AdamW's advice again, its lever lines now the planner's traces, as the searches found
            run("adamw", advise=True)
            first = str(failures["adamw"])
        except NothingFitsError as e:
            first = str(e)
        also = "".join(f"\n  searched {_NAMES[k]} (--optimizer {k}): does not fit either"
                       f" ({str(e).splitlines()[0].split(': the smallest step tried ')[-1]})"
                       for k, e in _in_lever_order(failures) if k != "adamw")
        from .advice import lora_line, offload_line

        lora = None if "--trainable lora" in first else lora_line(model, limit)  # the advice may name it already
        offload = None if "parameter offload" in first else offload_line(
            model, limit, profile.host_link_bytes_per_s, profile, precision=options.get("precision", "auto"))
        raise NothingFitsError(first + also + "".join(f"\n  {x}" for x in (lora, offload) if x))
    kind = max(results, key=lambda k: results[k].best.samples_per_s)
    best = results[kind]
    compared = "; ".join([f"{k}: {format_rate(r.best.samples_per_s)} samples/s ({r.best.label()}, {r.best.accumulation_steps} "
                          f"accumulation step{'s' if r.best.accumulation_steps != 1 else ''})"
                          for k, r in results.items() if k != kind]
                         + [f"{k}: {short.get(k, 'fits nothing')}" for k, _ in _in_lever_order(failures) if k != "adamw"]
                         + [f"{k}: not searched ({LEVER_LIBRARY[k]} is not installed)" for k in missing])
    why = ("fp32 AdamW state fits nothing" if "adamw" in failures
           else f"{'' if kind == 'adamw' else 'fp32 AdamW state '}needs {_what_it_pays(results['adamw'].best, forced)}")
    why = f"optimizer {kind}, {_NAMES[kind]}: {why}; predicted fastest" + (f" (against {compared})" if compared else "")
    others = tuple(_explained(r, k, f"optimizer {k}, {_NAMES[k]}: the runner-up optimizer, predicted "
                                    f"{format_rate(r.best.samples_per_s)} samples/s against {best.best.samples_per_s:.0f} for "
                                    f"{kind}", model, profile, started)
                   for k, r in sorted(results.items(), key=lambda kr: -kr[1].best.samples_per_s) if k != kind)
    return replace(_explained(best, kind, why, model, profile, started), other_optimizers=others)


def _in_lever_order(failures: dict) -> list:
    """``failures``' items in the levers' order (:data:`LEVER_OPTIMIZERS`), however they were
    searched: the messages name them in one order."""
    order = ["adamw", *LEVER_OPTIMIZERS]
    return sorted(failures.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order))


def _explained(result: SearchResult, kind: str, why: str, model, profile, started: float) -> SearchResult:
    """``result`` with the optimizer's reason and cost appended to its best's ``why``, and the
    seconds since ``started`` (``time.perf_counter()``) as its search time."""
    b = result.best
    return replace(result, best=replace(b, why=f"{b.why}; {why}; {_cost_line(model, result, kind, profile)}"),
                   seconds=time.perf_counter() - started)
