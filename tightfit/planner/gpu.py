"""Planning on a GPU: the search's stages (:mod:`.search`: enumerate, predict), then the three
that need the card, each a function with a typed result:

3. **verify** (:func:`verify_on_gpu` -> :class:`Verification`): calibrate the time per
   micro-batch with two probes (:class:`MicroBatchLine`), re-rank, and run the best candidates
   for real under the budget; the fastest that fits wins among eager plans. On a bf16 card, a
   model with convolutions has its winner timed in fp16 too (:func:`challenge_precision`).
4. **compile** (:func:`compiled_variant` -> :class:`CompileSearch`): the winner compiled, with
   as few micro-batches and checkpointed blocks as fit, then smaller micro-batches with fewer
   blocks while they time faster.
5. **retime** (:func:`retime` -> :class:`Retiming`): the eager winner and its compiled variant
   timed again side by side; the faster is kept.

:func:`plan_on_gpu` runs them in order and writes the plan's reasons. Every probe goes through
:func:`~tightfit.planner.probe.probe_step`, which is all the stages touch of the GPU, so tests
run them on the CPU with an injected ``probe_step``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace

from ..config import option_given
from ..devices import DeviceProfile
from ..errors import TightfitError, error_line
from ..memory.oom import release_memory
from ..levers.blocks import find_blocks
from ..levers.checkpointing import set_activation_checkpointing
from ..levers.compile import GRAPHED, WHOLE_MODEL, compile_model, compile_scope, compile_unavailable, uncompile_model
from ..levers.layout import CHANNELS_LAST_OPTIMIZERS, convolutions
from ..levers.optimizers import BF16_WEIGHTS, LEVER_OPTIMIZERS, weights_dtype
from ..plan import Plan, accumulation_steps, micro_batch_for, plan_with_blocks, without_free_blocks
from ..units import format_bytes, format_rate
from ..workload import Workload
from .bisection import bisect, gallop
from .cost import passes, peak_flops
from .probe import PROBE_HEADROOM, ProbeResult, probe_step
from .optimizers import levers_installed, search_optimizers
from .search import Candidate, SearchResult, estimator_for, paid_blocks
from .warmup import any_length, warm_compiled, warm_other_lengths

VERIFIED = 3  # candidates timed for real (each: one probe, probe_step)
# timed steps of each verification probe; their median is the step time. Three, not two: the
# median of two is their mean, and the process's first timed step on a cold GPU ran 5x the steady
# one (the main job's only candidate timed at 245 samples/s against 1,371 steady on an NVIDIA H200),
# which sent a 25-second run to a 13-second compilation (bench/results/short-run-compile)
VERIFIED_STEPS = 3
RETIMED_STEPS = 5  # timed steps of the final eager-vs-compiled comparison, and of the eager plan's last timing
VERIFICATION = f"verification timing ({VERIFIED_STEPS} timed steps, the median)"
# A candidate (or the runner-up optimizer's best) predicted below this share of the prediction of
# the fastest candidate measured so far is not timed: it cannot win. Across the 114 verification
# timings in bench/results made on the card planned for, measured / predicted ran from 0.46
# (BERT-base's host-bound 8-bit step) to 1.3, so one prediction beats another's by at most
# 1.3 / 0.46 = 2.8x more than it should. 0.35 < 1 / 2.8. (The timings of another card's profile,
# `--gpu`, are scaled alike: the ratio is what counts.) BERT-large at 4 GiB: the CPU offload
# candidates predicted at 0.26-0.27 of the winner took ~15 s of probes.
VERIFY_MIN_SHARE = 0.35
# fp16 replaces bf16 only when it times at least this much faster side by side: bf16 needs no
# loss scaling (no skipped steps) and has fp32's range, which is worth a few percent.
FP16_MIN_GAIN = 1.05
# A run predicted to take less than this at its eager speed is not compiled: regional compilation
# and the retiming cost 15-40 s on an H200 (bench/results), which a short run cannot win back.
COMPILE_MIN_RUN_S = 60.0


# The compiled stage's last try, the model compiled whole and replayed as CUDA graphs
# (graphed_variant), runs only where this environment variable is "1". Measured once in the
# planner (NVIDIA H100, BERT-base seq 128 at 4 GiB, bench/results/session-2026-12-07c): kept at
# 3,146 samples/s against the blocks' 3,051 in their first timings (+3%; the run then delivered
# 3,321, 0.69 of the compiled no-budget step), and that session's device time ran out before its
# retiming (whose eager side then ran out of memory) and the GPU test suite were seen right.
GRAPHS_ENV = "TIGHTFIT_PLAN_CUDA_GRAPHS"


def graphs_planned(allowed: bool = True) -> bool:
    """Whether the GPU planner tries a compiled plan replayed as CUDA graphs: ``allowed`` (not
    ``--cuda-graphs off``) and :data:`GRAPHS_ENV` set to ``"1"``."""
    return allowed and os.environ.get(GRAPHS_ENV) == "1"


def _run_seconds_under(run_samples: int | None, samples_per_s: float, minimum_s: float) -> float | None:
    """The predicted seconds of a run of ``run_samples`` samples at ``samples_per_s`` when under
    ``minimum_s``; None when not, or when the run's length or speed is unknown."""
    if not run_samples or samples_per_s <= 0:
        return None
    seconds = run_samples / samples_per_s
    return seconds if seconds < minimum_s else None


def too_short_to_compile(run_samples: int | None, eager_samples_per_s: float) -> str | None:
    """Why compiling does not pay for a run of ``run_samples`` samples at the verified eager
    ``eager_samples_per_s`` (None: it may; also when the run's length is unknown)."""
    seconds = _run_seconds_under(run_samples, eager_samples_per_s, COMPILE_MIN_RUN_S)
    if seconds is None:
        return None
    return (f"the run is predicted to take {seconds:.0f} s at the verified eager speed "
            f"({format_rate(eager_samples_per_s)} samples/s), less than the {COMPILE_MIN_RUN_S:.0f} s that "
            f"compilation needs to repay its cost")


# A compiled plan that checkpoints (nearly) every block is tried as one whole-model graph only for
# a run predicted to take at least this long at the blocks' compiled speed: on an NVIDIA H200 the
# whole graph ran ~25% faster (BERT-large at 4 GiB 782 vs 620 samples/s, bench/results/step-breakdown-2;
# BERT-base 3,527 vs 2,819, bench/results/resume-compile) but compiled in 50-80 s, which ~25% of a
# run repays from about 250 s on.
WHOLE_MODEL_MIN_RUN_S = 300.0


def too_short_for_whole_model(run_samples: int | None, blocks_samples_per_s: float) -> str | None:
    """Why one whole-model graph is not tried for a run of ``run_samples`` samples at the compiled
    blocks' ``blocks_samples_per_s`` (None: it may be; also when the run's length is unknown)."""
    seconds = _run_seconds_under(run_samples, blocks_samples_per_s, WHOLE_MODEL_MIN_RUN_S)
    if seconds is None:
        return None
    return (f"one whole-model graph not tried: the run is predicted to take {seconds:.0f} s at the compiled "
            f"blocks' speed, less than the {WHOLE_MODEL_MIN_RUN_S:.0f} s that its compilation needs to repay it")


def compiled_next(compile: str, why_not: str | None, run_samples: int | None, result: SearchResult) -> bool:
    """Whether the plan will be compiled whatever the eager timings say: ``compile="on"``, or
    ``"auto"`` for a run long enough to repay compilation even at the search's predicted speed
    (:func:`too_short_to_compile`; the time model mostly over-states the eager speed: measured /
    predicted 0.46-1.3 across bench/results). Then the compiled stage picks micro-batch and
    blocks itself, and the eager verification times one candidate per precision and optimizer,
    uncalibrated (:func:`verify_on_gpu`): on BERT-large at 4 GiB (NVIDIA H200,
    bench/results/plan-breakdown) the calibration and two more candidates took 9 s of probes. Where
    the plan then runs eager after all under ``"auto"`` (the run too short at the measured speed,
    the compiled variant slower or failing), :func:`plan_on_gpu` times every eager candidate then.
    ``why_not``: why ``torch.compile`` cannot run here (None: it can)."""
    if why_not or compile == "off":
        return False
    return compile == "on" or too_short_to_compile(run_samples, result.best.samples_per_s) is None


class NotFitForReal(TightfitError):
    """No planned candidate fit the budget when probed on the GPU (its message lists them)."""


@dataclass(frozen=True)
class MicroBatchLine:
    """Measured time of one micro-batch's forward + backward: ``fixed_s + per_sample_s x m``.

    On a fast GPU a micro-batch costs a fixed CPU time (Python, autograd, kernel launches) that
    does not shrink with its size, so accumulation steps cost nearly a whole micro-batch each;
    on a slow card the per-sample term dominates. Both terms scale with the passes over the
    model (:func:`~.cost.passes`: forward, backward = 2 forwards where it runs, recomputation); the
    per-sample term also with the precision's rate relative to the calibrated one.

    Attributes:
        precision: the calibrated candidate's precision.
        passes: the calibrated candidate's passes over the model (:func:`~.cost.passes`).
        fixed_s, per_sample_s: seconds per micro-batch and per sample.
        rates: precision -> rate relative to the calibrated precision (1.0 for it).
    """

    precision: str
    passes: float
    fixed_s: float
    per_sample_s: float
    rates: dict

    @classmethod
    def fit(cls, cand, big, small, n_blocks: int, profile: DeviceProfile) -> "MicroBatchLine | None":
        """Two probes of ``cand`` at micro-batches ``big`` > ``small`` (their steady-state step
        times); ``profile`` gives the other precisions' rates relative to ``cand``'s. None when
        ``big`` is not the larger."""
        u_big = big.step_seconds / big.micro_batches
        u_small = small.step_seconds / small.micro_batches
        if big.micro_batch <= small.micro_batch:
            return None
        per_sample = max(0.0, (u_big - u_small) / (big.micro_batch - small.micro_batch))
        fixed = max(0.0, u_big - per_sample * big.micro_batch)
        ref = peak_flops(profile, cand.precision)
        rates = {p: peak_flops(profile, p) / ref for p in ("fp32", "fp16", "bf16") if peak_flops(profile, p)}
        return cls(cand.precision, passes(n_blocks, cand.free_blocks, len(cand.checkpoint_blocks)), fixed, per_sample,
                   rates)

    def step_seconds(self, cand, effective_batch: int, n_blocks: int) -> float:
        """Predicted forward + backward time of one optimizer step of ``cand``, seconds."""
        scale = passes(n_blocks, cand.free_blocks, len(cand.checkpoint_blocks)) / self.passes
        rate = self.rates.get(cand.precision, 1.0) or 1.0
        full, rest = divmod(effective_batch, cand.micro_batch)
        t = full * (self.fixed_s + self.per_sample_s * cand.micro_batch / rate) * scale
        if rest:
            t += (self.fixed_s + self.per_sample_s * rest / rate) * scale
        return t


@dataclass(frozen=True)
class Measured:
    """A candidate that fit for real, with its samples/s in the verification timing."""

    samples_per_s: float
    candidate: Candidate
    probe: ProbeResult


@dataclass(frozen=True)
class Verification:
    """Stage 3's result.

    Attributes:
        ranked: the search's fitting candidates, re-ranked by the calibration when there was one.
        line: the calibrated time line (None: no calibration, the search's order kept).
        measured: the candidates that fit for real, in the order verified (at least one).
        rejected: ``"label: peak"`` of those that did not.
        not_timed: labels of candidates predicted too slow to win to be timed (:data:`VERIFY_MIN_SHARE`).
    """

    ranked: list[Candidate]
    line: MicroBatchLine | None
    measured: list[Measured]
    rejected: list[str]
    not_timed: list[str] = field(default_factory=list)

    @property
    def best(self) -> Measured:
        """The fastest in the verification timing (ties: the first verified)."""
        return max(self.measured, key=lambda m: m.samples_per_s)

    def label(self, c: Candidate) -> str:
        """``c.label()``, with its optimizer where the measured candidates have several."""
        mixed = len({m.candidate.optimizer for m in self.measured}) > 1
        return c.label() + (f", optimizer {c.optimizer}" if mixed else "")

    @property
    def others(self) -> list[Measured]:
        """The other measured candidates, fastest first."""
        best = self.best.candidate
        return sorted((m for m in self.measured if m.candidate is not best), key=lambda m: -m.samples_per_s)


@dataclass(frozen=True)
class CompiledVariant:
    """A compiled plan that fits: its samples/s (in the timing named where it is used), its
    micro-batch, its checkpointed blocks and its probe."""

    samples_per_s: float
    micro_batch: int
    checkpoint_blocks: tuple[int, ...]
    probe: ProbeResult
    scope: str | None = None  # compile_model's scope (None: blocks one by one where identical)
    optimizer: str | None = None  # another optimizer than the eager winner's, faster compiled (None: the same)


@dataclass(frozen=True)
class CompileSearch:
    """Stage 4's result: the compiled variant (None: nothing fits compiled) and a reason line."""

    variant: CompiledVariant | None
    notes: list[str]


@dataclass(frozen=True)
class Retiming:
    """Stage 5's result: both plans' samples/s in the side-by-side retiming (0: no longer within
    the headroom), and the note saying which was kept."""

    compiled_samples_per_s: float
    eager_samples_per_s: float
    note: str

    @property
    def compiled_kept(self) -> bool:
        return self.compiled_samples_per_s > self.eager_samples_per_s and self.compiled_samples_per_s != 0


@dataclass(frozen=True)
class CompileOutcome:
    """Stages 4 and 5 together: the compiled variant kept (None: eager), the retiming (None
    where there was none), the reason lines, and with ``--compile on`` the variant timed again
    (:func:`steady_timing`; None otherwise)."""

    variant: CompiledVariant | None
    retiming: Retiming | None
    notes: list[str]
    steady_samples_per_s: float | None = None


def _samples_per_s(pr: ProbeResult, effective_batch: int) -> float:
    """Samples/s of a whole optimizer step (``ceil(E / micro-batch)`` micro-batches), from a probe."""
    return effective_batch / (pr.step_seconds * accumulation_steps(effective_batch, pr.micro_batch)
                              / pr.micro_batches)


def _peak(pr: ProbeResult) -> str:
    return f"{format_bytes(pr.peak_reserved_bytes)} peak" if pr.peak_reserved_bytes else "out of memory"


def plan_on_gpu(workload: Workload, profile: DeviceProfile, budget_bytes: int, seq_len: int,
                precision: str = "auto", checkpointing: str = "auto", compile: str = "auto",
                run_samples: int | None = None, timings: dict | None = None, per_block: bool = True,
                optimizer: str = "auto", cuda_graphs: bool | None = None) -> Plan:
    """The fastest plan that really fits: the search's ranking, verified on the GPU.

    Candidates are probed in the search's order (real training steps under the allocator cap,
    :data:`VERIFIED_STEPS` of them timed); the first :data:`VERIFIED` that fit are timed and the
    fastest in that verification timing wins among eager plans. Then, unless ``compile`` is
    ``"off"`` (or ``torch.compile`` cannot run here), the winner's precision and checkpointed
    blocks are compiled (:func:`compiled_variant`) and kept if faster when both are retimed side
    by side (:data:`RETIMED_STEPS` timed steps each). Every samples/s figure in the plan's reasons
    names its timing, and one line starting ``decided by:`` names the timing that decided.
    Where the plan will be compiled anyway (``compile="on"``, or a run long enough by the search's
    prediction: :func:`compiled_next`) only one eager candidate per precision and optimizer is
    timed, without calibration: the compiled stage picks micro-batch and blocks itself. With ``optimizer="auto"`` the runner-up optimizer's predicted best is timed the same way
    (:func:`challenge_optimizer`) and replaces the winner if faster for real.
    The model must be on the GPU and the caching allocator capped at the budget; it is left
    compiled when the plan says so.

    With ``compile="auto"`` a compiler error leaves the verified eager plan in place (noted in
    its reasons); with ``"on"`` it is raised. When no compiled micro-batch fits, the plan runs
    eager either way, and says so.

    Planning is kept in proportion to the run: with ``compile="auto"`` a run predicted to take
    less than :data:`COMPILE_MIN_RUN_S` at the verified eager speed is not compiled (compilation
    and its retiming could not repay their cost), and the reasons say so; nor is one whole-model
    graph tried for a run shorter than :data:`WHOLE_MODEL_MIN_RUN_S` at the compiled blocks' speed.

    Args:
        budget_bytes: what the step may hold, bytes (the allocator's cap); ``seq_len``: tokens.
        run_samples: samples the run will train on (steps x effective batch; None: unknown).
        timings: filled with the stages' wall times, seconds: ``search_s``, ``verify_s``,
            ``compile_s`` (compile and retime, compilation included); and the plan's speeds,
            samples/s: ``predicted_samples_per_s`` (the search's time model for the eager winner)
            and ``probed_samples_per_s`` (the timing that decided).
        per_block: also search selective recomputation and activation offload per block
            (:func:`~tightfit.planner.search.search`); False: whole blocks only.
        cuda_graphs: the compiled stage may try the model replayed as CUDA graphs
            (:func:`graphed_variant`); None: as :func:`graphs_planned` says.
        optimizer: ``auto`` (fp32 AdamW state first, then the optimizer levers:
            :mod:`.optimizers`) or the one to use.

    Raises:
        TightfitError: nothing fits (predicted or measured); ``compile`` is ``"on"`` where
            compilation cannot run.
        Exception: the compiler's own error, with ``compile="on"``.
    """
    if compile not in ("auto", "on", "off"):
        raise TightfitError(f"compile must be auto, on or off; got {compile!r}")
    why_not = compile_unavailable("cuda")
    if compile == "on" and why_not:
        raise TightfitError(f"{option_given('compile', 'on')}: {why_not}")
    t0 = time.perf_counter()
    make_batch = lambda micro_batch, size: workload.train.worst_case(micro_batch)  # noqa: E731
    model = workload.model

    def searched(kind: str) -> SearchResult:
        return search_optimizers(
            model, make_batch, seq_len, workload.effective_batch, profile, budget_bytes,
            lambda kind: estimator_for(model, make_batch, seq_len, profile, workload.effective_batch,
                                       checkpointed_margin=0.0, optimizer=kind),  # the probes verify for real
            optimizer=kind, precision=precision, checkpointing=checkpointing,
            estimator_at=lambda kind: lambda size, effective_batch: None if size != seq_len else estimator_for(
                model, make_batch, seq_len, profile, effective_batch, checkpointed_margin=0.0, optimizer=kind),
            per_block=per_block)

    searched_first = searched(optimizer)
    t_verify = time.perf_counter()

    def verified(thin: bool):  # stage 3 and the challenges of its winner (thin: see compiled_next)
        r, v, fb = _verified(workload, searched_first, profile, budget_bytes, optimizer, searched, compiled_next=thin)
        ch = f16 = None
        if fb is None and r.other_optimizers:  # auto: the runner-up optimizer is timed too
            r, v, ch = challenge_optimizer(workload, r, v, budget_bytes)
        if precision == "auto":  # fp16's convolutions may beat bf16's (cuDNN), which the time model does not see
            v, f16 = challenge_precision(workload, v, profile, budget_bytes)
        return r, v, fb, ch, f16

    thin = compiled_next(compile, why_not, run_samples, searched_first)
    result, verification, fallback, challenge, fp16 = verified(thin)
    best = verification.best
    if compile == "auto" and not why_not:
        why_not = too_short_to_compile(run_samples, best.samples_per_s)
    t_compile = time.perf_counter()
    others = [m.candidate.optimizer for m in verification.measured if m.candidate.optimizer != best.candidate.optimizer]
    outcome = compile_and_retime(workload, best.candidate, budget_bytes, result.n_blocks, compile, why_not,
                                 run_samples, others[0] if others else None,
                                 graphs_planned() if cuda_graphs is None else cuda_graphs,
                                 _unrecomputed_micro_batch(result, best.candidate))
    if thin and compile == "auto" and outcome.variant is None:
        # eager after all (too short at the measured speed, slower compiled, or a compiler error): the
        # candidates and calibration left to the compiled stage are timed now, as for an eager plan
        first = best.candidate
        result, verification, fallback, challenge, fp16 = verified(False)
        best = verification.best
        if best.candidate != first:  # the retiming compared another candidate: the new one is timed again below
            outcome = replace(outcome, retiming=None, notes=outcome.notes + [
                f"the plan runs eager: every eager candidate timed, as for an eager plan ({VERIFICATION})"])
    steady = outcome.steady_samples_per_s
    if outcome.variant is None and outcome.retiming is None:  # an eager plan timed only in the verification
        c = best.candidate
        steady = steady_timing(workload, c.precision, c.optimizer, c.micro_batch, c.checkpoint_blocks,
                               c.block_policies, budget_bytes)
    t_end = time.perf_counter()
    if timings is not None:
        retimed = outcome.retiming.eager_samples_per_s if outcome.retiming else 0.0
        timings.update(search_s=t_verify - t0, verify_s=t_compile - t_verify,
                       compile_s=t_end - t_compile,
                       predicted_samples_per_s=best.candidate.samples_per_s or None,
                       probed_samples_per_s=steady or (outcome.variant.samples_per_s if outcome.variant else
                                                       (retimed or best.samples_per_s)))
    reasons = _reasons(result, verification, outcome)
    if steady:
        reasons.append(f"the plan timed again ({RETIMED_STEPS} timed steps, the median), the speed the run is "
                       f"expected to deliver: {format_rate(steady)} samples/s")
    chosen = result.best.why.find("; optimizer ")  # why this optimizer, and its cost (.optimizers)
    if chosen >= 0:
        line = result.best.why[chosen + 2:]
        if fallback:  # searched alone as if asked for: say it was the fallback's choice instead
            line = line.replace(f": as asked (--optimizer {result.best.optimizer})", "")
        reasons.insert(0, line)
    if fallback:
        reasons.insert(0, fallback)
    if challenge:
        reasons.insert(1, challenge)
    if fp16:
        reasons.insert(0, fp16)
    if outcome.variant is not None and outcome.variant.optimizer:  # the compiled timing changed the optimizer: first
        switched = next(r for r in reasons if r.startswith("optimizer compiled:"))
        reasons.remove(switched)
        reasons.insert(0, switched)
    variant = outcome.variant
    if variant is None:
        uncompile_model(workload.model)
    set_activation_checkpointing(workload.model, False, ())
    # where the planner's own time went (bench/plan_breakdown.py times each probe step); no total:
    # the planning time is the caller's one figure (`tightfit train`'s "planning took", the cache's)
    reasons.append(f"where the planner's time went: search {t_verify - t0:.1f} s (exact estimates, no GPU), "
                   f"verification on the GPU {t_compile - t_verify:.1f} s, compilation and timing of the chosen "
                   f"plan {t_end - t_compile:.1f} s")
    plan = _gpu_plan(best, variant, workload.effective_batch, budget_bytes, result.n_blocks, reasons)
    plan = without_free_blocks(plan, best.candidate.free_blocks, result.n_blocks)  # frozen first blocks: nothing to recompute
    return replace(plan, trainable=result.trainable, trainable_params=result.trainable_params)


def _verified(workload: Workload, result: SearchResult, profile: DeviceProfile, budget_bytes: int, optimizer: str,
              searched, compiled_next: bool = False) -> tuple[SearchResult, "Verification", str | None]:
    """Verify ``result`` on the GPU; with ``optimizer="auto"``, where none of its candidates fits
    for real, search and verify the optimizer levers after its optimizer in turn
    (:data:`~.optimizers.LEVER_OPTIMIZERS`): the prediction put the optimizer's state within the
    budget, the GPU did not, so the next lever's smaller state is tried rather than giving up.
    ``searched``: ``kind -> SearchResult``; ``compiled_next``: as in :func:`verify_on_gpu`.
    Returns the result verified, its verification and
    the line saying why another optimizer was used (None if none was).

    Raises:
        NotFitForReal: nothing fits for real with any optimizer tried (the first failure's message,
            a line per lever tried).
    """
    try:
        return result, verify_on_gpu(workload, result, profile, budget_bytes, compiled_next), None
    except NotFitForReal as first:
        kind = result.best.optimizer or "adamw"
        if optimizer != "auto" or not levers_installed():
            raise
        failures = [f"{kind}: {first}"]
        later = LEVER_OPTIMIZERS[LEVER_OPTIMIZERS.index(kind) + 1:] if kind in LEVER_OPTIMIZERS else LEVER_OPTIMIZERS
        for lever in later:
            if not levers_installed(lever):
                continue
            try:
                other = searched(lever)
                verification = verify_on_gpu(workload, other, profile, budget_bytes, compiled_next)
            except TightfitError as e:  # predicted not to fit, or not for real either
                failures.append(f"{lever}: {str(e).splitlines()[0]}")
                continue
            return other, verification, (f"fell back to {lever}: no candidate with {kind} state fit for real "
                                         f"(predicted to fit; {'; '.join(f.split(': ', 1)[0] for f in failures)} "
                                         f"out of memory on the GPU)")
        raise NotFitForReal("\n  ".join(failures)) from None


def challenge_optimizer(workload: Workload, result: SearchResult, verification: Verification,
                        budget_bytes: int) -> tuple[SearchResult, Verification, str]:
    """Time the runner-up optimizer's predicted best (``result.other_optimizers[0]``) as the
    winner's candidates were timed (:data:`VERIFICATION`), and keep the faster for real.

    The optimizer is chosen on the time model's prediction, and a lever's step (e.g. 8-bit
    AdamW's one kernel per tensor) can cost a host-bound card far more than predicted: on an
    NVIDIA H200 capped at 4 GiB the 8-bit plan of BERT-base (seq 128, effective batch 256) was
    predicted at 4,101 samples/s and verified at 1,883 (bench/results/speed-4). One probe decides.

    Returns:
        The result and verification kept (the runner-up's when it is faster), with both
        optimizers' measured candidates where the runner-up fit (the compiled stage times it
        again, :func:`challenge_compiled_optimizer`), and a reason line saying what was timed and kept.
    """
    other = result.other_optimizers[0]
    c, won = other.best, verification.best
    what = f"the runner-up optimizer {c.optimizer} ({c.label()}, predicted {format_rate(c.samples_per_s)} samples/s)"
    if too_slow_to_win(c, won.candidate):
        return result, verification, (f"{what}: not timed, predicted below {VERIFY_MIN_SHARE:.2f} of the "
                                      f"{won.candidate.samples_per_s:.0f} predicted for {won.candidate.optimizer}; "
                                      f"{won.candidate.optimizer} kept")
    set_activation_checkpointing(workload.model, bool(c.checkpoint_blocks), c.checkpoint_blocks, c.block_policies)
    try:
        pr = probe_step(workload, c.micro_batch, c.precision, budget_bytes, timed_steps=VERIFIED_STEPS,
                        optimizer=c.optimizer)
    finally:
        set_activation_checkpointing(workload.model, False, ())
    if not pr.fits:
        return result, verification, f"{what}: {_peak(pr)} in its {VERIFICATION}; {won.candidate.optimizer} kept"
    speed = _samples_per_s(pr, workload.effective_batch)
    line = (f"{what}: {format_rate(speed)} samples/s in its {VERIFICATION}, against {won.samples_per_s:.0f} for "
            f"{won.candidate.optimizer} ({won.candidate.label()}, predicted {won.candidate.samples_per_s:.0f})")
    mine = Measured(speed, c, pr)
    if speed <= won.samples_per_s:  # measured all the same: the compiled stage times it again (it may win there)
        return result, replace(verification, measured=verification.measured + [mine]), \
            f"{line}: {won.candidate.optimizer} kept"
    kept = replace(verification, ranked=verification.ranked + [c], measured=[mine] + verification.measured)
    return other, kept, f"{line}: {c.optimizer} kept, faster for real than predicted"


def challenge_precision(workload: Workload, verification: Verification, profile: DeviceProfile,
                        budget_bytes: int) -> tuple[Verification, str | None]:
    """On a card with bf16 and fp16 tensor cores, time the verified bf16 winner in fp16 too, for a
    model with convolutions, side by side with bf16 again (:data:`VERIFICATION` each), and keep
    fp16 (autocast with dynamic loss scaling) where it is at least :data:`FP16_MIN_GAIN` times
    faster. Both keep 2-byte activations, so the winner's micro-batch and blocks fit alike (the
    probe checks it).

    The time model gives both precisions the card's one 16-bit tensor rate, which holds for
    matrix products; cuDNN's convolution kernels differ: on an NVIDIA H200 ResNet-50
    (channels-last, micro-batch 256) trained at 5,996 samples/s in fp16 against 4,639 in bf16
    (bench/results/recompute-1/conv_layout.md). Models without convolutions, and optimizers
    keeping bf16 weights (:data:`~tightfit.levers.optimizers.BF16_WEIGHTS`), are not timed.

    Returns:
        The verification (with both side-by-side timings in place of the bf16 winner's when
        fp16 was timed) and a reason line (None when nothing was timed).
    """
    won = verification.best
    c = won.candidate
    if c.precision != "bf16" or not profile.fp16_tensor_cores or c.optimizer in BF16_WEIGHTS \
            or not convolutions(workload.model):
        return verification, None
    E, model = workload.effective_batch, workload.model
    set_activation_checkpointing(model, bool(c.checkpoint_blocks), c.checkpoint_blocks, c.block_policies)
    try:
        timed = {p: probe_step(workload, c.micro_batch, p, budget_bytes, timed_steps=VERIFIED_STEPS,
                               optimizer=c.optimizer) for p in ("bf16", "fp16")}
    finally:
        set_activation_checkpointing(model, False, ())
    speed = {p: _samples_per_s(pr, E) if pr.fits else 0.0 for p, pr in timed.items()}
    what = (f"precision: {c.label()} timed in bf16 and fp16 side by side ({VERIFICATION} each; the model has "
            f"convolutions, whose fp16 kernels may be faster)")
    if not (timed["fp16"].fits and timed["bf16"].fits):
        return verification, f"{what}: " + "; ".join(f"{p} {_peak(pr)}" for p, pr in timed.items()) + "; bf16 kept"
    if speed["fp16"] < FP16_MIN_GAIN * speed["bf16"]:
        return verification, (f"{what}: fp16 {format_rate(speed['fp16'])} vs bf16 {format_rate(speed['bf16'])} "
                               f"samples/s, under the {FP16_MIN_GAIN:.2f}x that fp16's loss scaling must repay; bf16 kept")
    bf16 = Measured(speed["bf16"], c, timed["bf16"])
    mine = Measured(speed["fp16"], replace(c, precision="fp16"), timed["fp16"])
    measured = [mine, bf16] + [m for m in verification.measured if m is not won]
    return (replace(verification, ranked=verification.ranked + [mine.candidate], measured=measured),
            f"{what}: fp16 {format_rate(speed['fp16'])} vs bf16 {format_rate(speed['bf16'])} samples/s "
            f"({speed['fp16'] / speed['bf16']:.2f}x): fp16 autocast with dynamic loss scaling kept")


def _gpu_plan(best: Measured, variant: CompiledVariant | None, effective_batch: int, budget_bytes: int,
              n_blocks: int, reasons: list[str]) -> Plan:
    """The plan of the verified eager winner ``best``, or of the compiled ``variant`` kept.
    Compiled: the measured samples/s that decided stands as its speed (the estimator does not
    model compiled steps); eager: the search's prediction (None where it had none)."""
    c = best.candidate
    if variant is not None:
        return plan_with_blocks(c.precision, variant.micro_batch, effective_batch, variant.checkpoint_blocks,
                                n_blocks, device="cuda", budget_bytes=budget_bytes, reasons=tuple(reasons),
                                optimizer=variant.optimizer or c.optimizer,
                                probe_peak_reserved_bytes=variant.probe.peak_reserved_bytes,
                                predicted_peak_reserved_bytes=None, predicted_samples_per_s=variant.samples_per_s,
                                compile=True, compile_scope=variant.scope)
    return plan_with_blocks(c.precision, c.micro_batch, effective_batch, c.checkpoint_blocks, n_blocks,
                            device="cuda", budget_bytes=budget_bytes, reasons=tuple(reasons), optimizer=c.optimizer,
                            probe_peak_reserved_bytes=best.probe.peak_reserved_bytes,
                            predicted_peak_reserved_bytes=c.peak_reserved_bytes,
                            predicted_samples_per_s=c.samples_per_s or None, compile=False,
                            block_policies=c.block_policies)


# ---------------------------------------------------------------- stage 3: verify

def _cached_prober(workload: Workload, budget_bytes: int, timed_steps: int = VERIFIED_STEPS):
    """``(candidate, micro_batch) -> ProbeResult``: a probe step of the candidate's precision
    and checkpointed blocks, each (precision, blocks, micro-batch) run once."""
    probes = {}

    def probe(cand: Candidate, micro_batch: int) -> ProbeResult:
        key = (cand.precision, cand.checkpoint_blocks, cand.block_policies, micro_batch, cand.optimizer)
        if key not in probes:
            blocks = cand.checkpoint_blocks
            set_activation_checkpointing(workload.model, bool(blocks), blocks, cand.block_policies)
            probes[key] = probe_step(workload, micro_batch, cand.precision, budget_bytes, timed_steps=timed_steps,
                                     optimizer=cand.optimizer)
        return probes[key]

    return probe


def calibrate(probe, first: Candidate, n_blocks: int, profile: DeviceProfile) -> MicroBatchLine | None:
    """The search's first choice probed at its micro-batch and at a quarter of it: the card's
    fixed cost per micro-batch (kernel launches, Python) and its cost per sample. None where
    either probe does not fit or the micro-batch is below 4."""
    big = probe(first, first.micro_batch)
    if not big.fits or first.micro_batch < 4:
        return None
    small = probe(first, first.micro_batch // 4)
    return MicroBatchLine.fit(first, big, small, n_blocks, profile) if small.fits else None


def verify_on_gpu(workload: Workload, result: SearchResult, profile: DeviceProfile,
                  budget_bytes: int, compiled_next: bool = False) -> Verification:
    """Stage 3: calibrate (:func:`calibrate`; not for a single candidate), re-rank the search's
    fitting candidates by the calibrated line, and probe them in that order until :data:`VERIFIED` fit for real. If none
    does (the prediction was short, e.g. memory held elsewhere in the process), halve the
    micro-batch of the candidate that checkpoints the most until a real step fits. Leaves no
    block checkpointed.

    ``compiled_next``: the plan will be compiled whatever the eager timings say (:func:`compiled_next`),
    and the compiled stage searches micro-batch and checkpointed blocks itself
    (:func:`compiled_variant`), keeping only the eager winner's precision and optimizer. Then a
    candidate of the same precision and optimizer as one already verified is not timed (its
    timing could not change the plan), and there is no calibration (it only re-ranks).

    Raises:
        TightfitError: no candidate fits for real, even at micro-batch 1.
    """
    E, n = workload.effective_batch, result.n_blocks
    ranked = [result.best] + [c for c in result.runners_up if c.samples_per_s > 0]
    probe = _cached_prober(workload, budget_bytes)
    # a line re-ranks candidates: with one there is nothing to rank, and its second probe is saved
    line = calibrate(probe, ranked[0], n, profile) if len(ranked) > 1 and not compiled_next else None
    if line is not None:
        ranked.sort(key=lambda c: -E / line.step_seconds(c, E, n))
    measured, rejected, not_timed = [], [], []

    def verify(cand: Candidate) -> None:
        pr = probe(cand, cand.micro_batch)
        if pr.fits:
            measured.append(Measured(_samples_per_s(pr, E), cand, pr))
        else:
            rejected.append(f"{cand.label()}: {_peak(pr)}")

    for cand in ranked:
        if len(measured) == VERIFIED:
            break
        if compiled_next and any((m.candidate.precision, m.candidate.optimizer) == (cand.precision, cand.optimizer)
                                 for m in measured):
            continue
        if measured and too_slow_to_win(cand, max(measured, key=lambda m: m.samples_per_s).candidate):
            not_timed.append(cand.label())
            continue
        verify(cand)
    smallest = max(ranked, key=lambda c: len(c.checkpoint_blocks))
    while not measured and smallest.micro_batch > 1:
        mb = smallest.micro_batch // 2
        smallest = replace(smallest, micro_batch=mb, accumulation_steps=accumulation_steps(E, mb), samples_per_s=0.0,
                           peak_reserved_bytes=None, peak_allocated_bytes=None, breakdown={})
        verify(smallest)
    set_activation_checkpointing(workload.model, False, ())
    if not measured:
        raise NotFitForReal(f"no planned candidate fits {format_bytes(budget_bytes)} for real: " + "; ".join(rejected))
    return Verification(ranked, line, measured, rejected, not_timed)


def too_slow_to_win(cand: Candidate, fastest: Candidate) -> bool:
    """Whether ``cand``'s predicted samples/s is below :data:`VERIFY_MIN_SHARE` of the prediction
    for ``fastest`` (the fastest candidate measured): then it is not timed. False where either
    prediction is unknown (0)."""
    return bool(cand.samples_per_s and fastest.samples_per_s) and \
        cand.samples_per_s < VERIFY_MIN_SHARE * fastest.samples_per_s


# ---------------------------------------------------------------- stages 4 and 5: compile, retime

def steady_timing(workload: Workload, precision: str, optimizer: str, micro_batch: int, blocks: tuple,
                  policies, budget_bytes: int) -> float | None:
    """The chosen plan (the model as it is, compiled or not, with ``blocks`` checkpointed under
    ``policies``) timed again with :data:`RETIMED_STEPS` timed steps (their median): the
    samples/s the run is expected to deliver, for a plan that no side-by-side retiming timed.
    The verification's figure (or a compiled variant's first timing) decided among candidates,
    but it is the largest of a few short timings and so over-states the winner (on an NVIDIA
    H200 the main job's fastest of 30 steps was 8% under their median, bench/results/speed-2).
    None when the step no longer fits the headroom.

    Raises:
        Any non-OOM error of the step, unchanged.
    """
    set_activation_checkpointing(workload.model, bool(blocks), blocks, policies)
    try:
        pr = probe_step(workload, micro_batch, precision, budget_bytes, timed_steps=RETIMED_STEPS,
                        optimizer=optimizer)
    finally:
        set_activation_checkpointing(workload.model, False, ())
    return _samples_per_s(pr, workload.effective_batch) if pr.fits else None


def _unrecomputed_micro_batch(result: SearchResult, best: Candidate) -> int | None:
    """The largest micro-batch, with several per step, that the search predicts to fit with
    ``best``'s precision and optimizer and nothing recomputed (None: none)."""
    fits = [c.micro_batch for c in (result.best, *result.runners_up)
            if c.samples_per_s > 0 and not c.paid_blocks and c.block_policies is None
            and c.precision == best.precision and c.optimizer == best.optimizer
            and c.micro_batch < result.effective_batch]
    return max(fits, default=None)


def compile_and_retime(workload: Workload, best: Candidate, budget_bytes: int, n_blocks: int, compile: str,
                       why_not: str | None, run_samples: int | None = None,
                       other_optimizer: str | None = None, cuda_graphs: bool = False,
                       unrecomputed_micro_batch: int | None = None) -> CompileOutcome:
    """Stages 4 and 5 for the eager winner ``best``: its compiled variant
    (:func:`compiled_variant`; ``cuda_graphs`` and ``unrecomputed_micro_batch`` as there), retimed
    against it with ``compile="auto"`` (:func:`retime`), and
    timed with ``other_optimizer`` (the runner-up optimizer that fit in the verification; None:
    none) too (:func:`challenge_compiled_optimizer`). ``why_not``: why ``torch.compile`` cannot
    run here (None: it can). A compiler failure with ``compile="auto"`` leaves the model eager
    and says so.

    Raises:
        Exception: the compiler's own error, with ``compile="on"``.
    """
    if compile == "off" or why_not:
        return CompileOutcome(None, None, [f"torch.compile not tried: {why_not}"] if compile == "auto" else [])
    variant, retiming, notes, steady = None, None, [], None
    try:
        with any_length(workload.train):  # compiled for every sequence length from the first probe
            found = compiled_variant(workload, best, budget_bytes, n_blocks, run_samples, cuda_graphs,
                                     unrecomputed_micro_batch)
            variant, notes = found.variant, found.notes
            if variant is not None:  # other sequence lengths compile now, not during the run
                notes = notes + warm_other_lengths(workload, variant.micro_batch, variant.checkpoint_blocks,
                                                   best.precision, budget_bytes, best.optimizer)
            if variant is not None and compile == "auto":
                retiming = retime(workload, best, variant, budget_bytes)
                notes = notes + [retiming.note]
                variant = replace(variant, samples_per_s=retiming.compiled_samples_per_s) \
                    if retiming.compiled_kept else None
            if variant is not None and other_optimizer is not None:
                variant, note = challenge_compiled_optimizer(workload, best, variant, other_optimizer, budget_bytes)
                notes = notes + [note]
            if variant is not None and compile == "on":  # no retiming: the variant's speed, timed again
                steady = steady_timing(workload, best.precision, variant.optimizer or best.optimizer,
                                       variant.micro_batch, variant.checkpoint_blocks, None, budget_bytes)
    except Exception as e:  # a compiler failure: the verified eager plan stands
        if compile == "on":
            raise
        uncompile_model(workload.model)
        release_memory()
        variant, steady = None, None
        notes = [f"torch.compile failed, eager plan kept: {error_line(e)}"]
    if compile == "on" and variant is None:
        notes.append("--compile on: no compiled micro-batch fits, so the plan runs eager")
    return CompileOutcome(variant, retiming, notes, steady)


def challenge_compiled_optimizer(workload: Workload, best: Candidate, variant: CompiledVariant, other: str,
                                 budget_bytes: int) -> tuple[CompiledVariant, str]:
    """The compiled ``variant`` of ``best`` timed with ``best``'s optimizer and with ``other``
    side by side (:data:`RETIMED_STEPS` timed steps each, the median), the model compiled as it
    is: the optimizer is not part of the compiled graph, so this compiles nothing. The faster
    that fits is kept.

    The optimizers were ranked on eager timings, where an 8-bit optimizer's smaller state buys a
    larger micro-batch; a compiled step keeps fewer intermediates, and there fp32 AdamW may fit
    the same micro-batch and run faster (each 8-bit update launches kernels per tensor): BERT-base
    at 4 GiB (NVIDIA H200) trained at 3,788 samples/s compiled with fp32 AdamW, and at 3,172 to
    3,282 with the 8-bit AdamW that its eager timing chose (bench/results/recompute-1, recompute-2).
    A convolutional model (stored channels-last) is not timed with an optimizer that makes its
    weights contiguous (:data:`~tightfit.levers.layout.CHANNELS_LAST_OPTIMIZERS`), nor any model
    with an optimizer that keeps its weights in another dtype
    (:func:`~tightfit.levers.optimizers.weights_dtype`): the graph would compile again for those
    strides or dtypes (BERT-large at 4 GiB, NVIDIA H200: bf16 weights compiled, the runner-up's
    fp32 weights failed in the graph's matmul, bench/results/past-the-card).

    Returns:
        The variant (with ``optimizer=other`` where that was faster) and a reason line.
    """
    mine = best.optimizer
    what = f"optimizer compiled: the runner-up optimizer {other} timed with the compiled plan"
    if weights_dtype(other) != weights_dtype(mine):
        return variant, f"{what}: not timed ({other} keeps the weights in another dtype than the graph's); {mine} kept"
    if convolutions(workload.model) and other not in CHANNELS_LAST_OPTIMIZERS:
        return variant, f"{what}: not timed ({other} stores the weights contiguous, the graph is channels-last); {mine} kept"
    E, model = workload.effective_batch, workload.model

    def timed(o: str) -> ProbeResult:
        return probe_step(workload, variant.micro_batch, best.precision, budget_bytes, timed_steps=RETIMED_STEPS,
                          optimizer=o)

    set_activation_checkpointing(model, bool(variant.checkpoint_blocks), variant.checkpoint_blocks)
    failed = None
    try:
        probes = {mine: timed(mine)}  # the plan's own optimizer failing is the compiled plan failing: raised
        try:
            probes[other] = timed(other)
        except Exception as e:  # noqa: BLE001 - the runner-up's failure leaves the compiled plan won
            failed = error_line(e)
    finally:
        set_activation_checkpointing(model, False, ())
    speed = {o: _samples_per_s(pr, E) if pr.fits else 0.0 for o, pr in probes.items()}
    if failed:
        release_memory()  # outside the except block: the failed probe's frames are gone
        return (replace(variant, samples_per_s=speed[mine]) if speed[mine] else variant), \
            f"{what}: failed ({failed}); {mine} kept"
    line = (f"{what} ({variant.micro_batch} x {accumulation_steps(E, variant.micro_batch)}, side by side, "
            f"{RETIMED_STEPS} timed steps each, the median): " +
            ", ".join(f"{o} {format_rate(v)} samples/s" if v else f"{o} {_peak(probes[o])}" for o, v in speed.items()))
    if speed[other] > speed[mine]:
        return replace(variant, samples_per_s=speed[other], optimizer=other, probe=probes[other]), line + f": {other} kept"
    return (replace(variant, samples_per_s=speed[mine]) if speed[mine] else variant), line + f": {mine} kept"


def retime(workload: Workload, best: Candidate, variant: CompiledVariant, budget_bytes: int) -> Retiming:
    """Stage 5: time the eager winner and the compiled variant again, side by side with more
    steps each (the compiled variant's first probes ran right after compilation). A retime that
    no longer fits the headroom counts as 0 samples/s. The model is left compiled only if the
    compiled variant is faster."""
    E, model = workload.effective_batch, workload.model

    def timed(mb: int, blocks: tuple, policies=None) -> float:
        set_activation_checkpointing(model, bool(blocks), blocks, policies)
        pr = probe_step(workload, mb, best.precision, budget_bytes, timed_steps=RETIMED_STEPS,
                        optimizer=best.optimizer)
        return _samples_per_s(pr, E) if pr.fits else 0.0

    c_speed = timed(variant.micro_batch, variant.checkpoint_blocks)
    uncompile_model(model)
    e_speed = timed(best.micro_batch, best.checkpoint_blocks, best.block_policies)
    note = (f"retimed side by side ({RETIMED_STEPS} timed steps each, the median): compiled {c_speed:.0f} vs "
            f"eager {format_rate(e_speed)} samples/s" + (" (no longer within the headroom)" if not (c_speed and e_speed) else ""))
    retiming = Retiming(c_speed, e_speed, note)
    if not retiming.compiled_kept:
        return replace(retiming, note=note + ": eager kept")
    compile_model(model, variant.scope)
    if variant.scope == GRAPHED:  # uncompiling it dropped the compiled code and the graphs: again now, not in the run
        warm_compiled(workload, variant.micro_batch, (), best.precision, budget_bytes, best.optimizer)
    return replace(retiming, note=note + ": compiled kept")


def compiled_variant(workload: Workload, best: Candidate, budget_bytes: int, n_blocks: int,
                     run_samples: int | None = None, cuda_graphs: bool = False,
                     unrecomputed_micro_batch: int | None = None) -> CompileSearch:
    """Stage 4: try ``best`` (a verified eager candidate) compiled, with as few micro-batches as
    fit (compiled steps keep fewer intermediates, so a larger micro-batch may fit than in eager
    mode).

    Micro-batch counts ``k`` run from 1 (micro-batch ``ceil(E / k)``); the smallest ``k`` up to
    the eager plan's count that fits with the most checkpointing on offer is found first (``k = 1``,
    then bisection over the counts). When the blocks are compiled one by one
    (:func:`~tightfit.levers.compile.compile_scope`), checkpointing other blocks costs no
    compilation, so that ``k`` gets the fewest checkpointed blocks (the first ones first) that
    fit, stepping down from the most (:func:`~.bisection.gallop`); when it needed checkpointing, the next
    counts are tried too (fewer blocks, one more micro-batch each, past the eager plan's count) while
    each is faster than the one before, and the fastest is kept. The eager plan's own
    micro-batch is probed with its blocks first (:func:`_compiled_candidates`): an eager plan of
    one micro-batch and no checkpointing is probed compiled once. A model compiled
    whole keeps ``best``'s blocks (another set would recompile). One compiled graph (dynamic
    micro-batch dimension) serves all probes. The model is left compiled only if a variant fits.
    Blocks compiled one by one with (nearly) every block checkpointed are then tried as one
    whole-model graph (:func:`whole_model_variant`), unless a run of ``run_samples`` samples is
    too short to repay that compilation (:func:`too_short_for_whole_model`; None: unknown length).
    Last, a variant that recomputes blocks is tried against the largest micro-batch without
    recomputation compiled whole and replayed as CUDA graphs (:func:`graphed_variant`): the
    largest probed so (blocks compiled one by one), else ``unrecomputed_micro_batch`` (the
    search's prediction, for a model compiled whole, whose probes keep the eager plan's blocks;
    None: none); only with ``cuda_graphs`` (:func:`graphs_planned`), and not for a run too short to
    repay a whole-model compilation.
    """
    E, model = workload.effective_batch, workload.model
    regional = compile_scope(model) == "blocks"
    compile_model(model)
    t0 = time.perf_counter()
    tried, probes = [], {}

    def probe(mb: int, blocks: tuple) -> ProbeResult:
        if (mb, blocks) not in probes:
            set_activation_checkpointing(model, bool(blocks), blocks)
            pr = probes[mb, blocks] = probe_step(workload, mb, best.precision, budget_bytes, optimizer=best.optimizer,
                                                 timed_steps=VERIFIED_STEPS)
            timing = f", {format_rate(_samples_per_s(pr, E))} samples/s" if pr.fits and pr.step_seconds else ""
            tried.append(f"{mb} x {accumulation_steps(E, mb)}, {len(blocks)} blocks: {_peak(pr)}{timing}")
        return probes[mb, blocks]

    most = tuple(range(n_blocks)) if regional else best.checkpoint_blocks
    found = _compiled_candidates(E, best.micro_batch, n_blocks, most, regional, probe,
                                 eager_blocks=len(best.checkpoint_blocks))
    seconds = time.perf_counter() - t0
    scope = "each block" if regional else "whole model"
    if not found:
        uncompile_model(model)
        return CompileSearch(None, [f"torch.compile ({scope}, {seconds:.0f} s incl. compilation): nothing fits "
                                    f"(probed {'; '.join(tried)})"])
    v = max(found, key=lambda f: f.samples_per_s)
    notes = [f"torch.compile ({scope}): {format_rate(v.samples_per_s)} samples/s in its first timing after compilation "
             f"({VERIFIED_STEPS} timed steps, the median) at micro-batch {v.micro_batch} with "
             f"{len(v.checkpoint_blocks)} checkpointed blocks ({seconds:.0f} s incl. compilation; probed {'; '.join(tried)})"]
    # (nearly) every block checkpointed: one whole-model graph with every block checkpointed may
    # beat the blocks (the model's own hook, a Hugging Face model's, checkpoints inside the graph;
    # tightfit's wrappers cannot). At most an eighth of the blocks more to recompute (~4% more GPU
    # work) against three compiled calls per block saved: worth one more timing.
    # (Frozen first blocks recompute nothing either way: only the blocks that keep activations count.)
    kept = n_blocks - best.free_blocks
    paid = len(paid_blocks(v.checkpoint_blocks, best.free_blocks))
    short = too_short_for_whole_model(run_samples, v.samples_per_s)
    if regional and kept > 0 and paid and kept - paid <= kept // 8 and \
            getattr(model, "supports_gradient_checkpointing", False):
        if short:
            return CompileSearch(v, notes + [short])
        whole, note = whole_model_variant(workload, best, v, budget_bytes)
        v, notes = whole or v, notes + [note]
    # probed without recomputation (frozen first blocks recompute nothing), or the search's prediction
    if regional:
        unrecomputed = [f.micro_batch for f in found if not paid_blocks(f.checkpoint_blocks, best.free_blocks)]
    else:
        unrecomputed = [unrecomputed_micro_batch] if unrecomputed_micro_batch else []
    unrecomputed = [mb for mb in unrecomputed if accumulation_steps(E, mb) > 1]
    if cuda_graphs and paid and unrecomputed and not short:
        graphed, note = graphed_variant(workload, best, v, max(unrecomputed), budget_bytes)
        v, notes = graphed or v, notes + [note]
    return CompileSearch(v, notes)


def graphed_variant(workload: Workload, best: Candidate, current: CompiledVariant, micro_batch: int,
                    budget_bytes: int) -> tuple[CompiledVariant | None, str]:
    """Stage 4, last: the largest ``micro_batch`` whose compiled step fit with no block
    recomputed (several micro-batches per step) compiled whole and replayed as CUDA graphs
    (:data:`~tightfit.levers.compile.GRAPHED`), against ``current``, which recomputes blocks at a
    larger micro-batch. A small micro-batch's compiled step is bound by the host that launches
    its kernels; replayed as graphs it is not, and it recomputes nothing: BERT-base seq 128 at
    4 GiB, 64 x 4 replayed, ran 3,514-3,646 samples/s, 0.91-1.0 of the compiled step with no
    budget, where the blocks' 64 x 4 ran 2,241-2,849 (NVIDIA H100, bench/results/session-2026-12-07b).
    Only a micro-batch whose step fit compiled block by block, or (a model compiled whole) that
    the search predicts to fit eager, is tried (the whole graph's intermediates were fewer than
    either): a capture that runs out of memory part-way keeps its memory under torch 2.11
    (pytorch/pytorch#190308), so no bisection over sizes happens here; the probe's first step,
    the graphs' eager warm-up, meets any shortage before a capture does.

    Returns:
        The graphed variant when it fits and its timing beats ``current``'s (the model is left
        compiled so), else None (the model is compiled as ``current`` says again, with its
        blocks checkpointed), and the reason line. A compiler error counts as not kept, with its
        first line in the reason.
    """
    model, E = workload.model, workload.effective_batch
    t0, pr, failed = time.perf_counter(), None, None
    uncompile_model(model)
    try:
        set_activation_checkpointing(model, False, ())
        compile_model(model, GRAPHED)
        pr = probe_step(workload, micro_batch, best.precision, budget_bytes, optimizer=best.optimizer,
                        timed_steps=VERIFIED_STEPS)
    except Exception as e:  # noqa: BLE001 - a compiler failure keeps the current variant
        failed = error_line(e)
    line = (f"as one whole-model graph replayed as CUDA graphs, nothing recomputed ({time.perf_counter() - t0:.0f} s "
            f"incl. compilation): {micro_batch} x {accumulation_steps(E, micro_batch)}: ")
    if failed is None and pr.fits and _samples_per_s(pr, E) > current.samples_per_s:
        rate = _samples_per_s(pr, E)
        return (CompiledVariant(rate, micro_batch, (), pr, GRAPHED),
                line + f"{format_rate(rate)} samples/s, peak {format_bytes(pr.peak_reserved_bytes)} reserved, kept")
    uncompile_model(model)  # the graphs and their memory pool freed too (released to the driver)
    compile_model(model, current.scope)
    set_activation_checkpointing(model, True, None if current.scope == WHOLE_MODEL else current.checkpoint_blocks)
    if failed:
        return None, line + f"failed ({failed}), the variant before kept"
    return None, line + (f"{format_rate(_samples_per_s(pr, E))} samples/s, the variant before kept" if pr.fits
                         else f"{_peak(pr)}, the variant before kept")


def whole_model_variant(workload: Workload, best: Candidate, regional: CompiledVariant,
                        budget_bytes: int) -> tuple[CompiledVariant | None, str]:
    """Stage 4, last: ``regional`` (blocks compiled one by one, all or nearly all checkpointed)
    tried again as one whole-model graph with every block checkpointed by the model's own hook
    inside it (:data:`~tightfit.levers.compile.WHOLE_MODEL`), at the same micro-batch. Blocks compiled one
    by one and checkpointed around their compiled call make three compiled calls per block and
    micro-batch (forward, recomputation, backward), and such a step is bound by the host that
    launches them (BERT-large at 4 GiB, NVIDIA H200: 620 samples/s, as one graph 782;
    bench/results/step-breakdown-2).

    When the graph does not fit at that micro-batch, it is probed once more with one micro-batch
    more per step (``micro_batch_for(E, k + 1)``): the batch dimension is dynamic, so this
    compiles nothing, and one graph's step at half the micro-batch can still beat the blocks'
    (BERT-large at 4 GiB, NVIDIA H200: 3.84 GiB at 128 x 1 against a 3.8 GiB limit,
    bench/results/update-groups).

    Returns:
        The whole-model variant when it fits and its timing beats ``regional``'s (the model is
        left compiled whole), else None (the model is compiled block by block again), and the
        reason line. A compiler error counts as not kept, with its first line in the reason.
    """
    model, E = workload.model, workload.effective_batch
    t0 = time.perf_counter()
    uncompile_model(model)
    tried = []  # (micro-batch, probe) in order
    try:
        compile_model(model, WHOLE_MODEL)
        set_activation_checkpointing(model, True, None)  # the model's own hook: inside the graph
        mb = regional.micro_batch
        smaller = micro_batch_for(E, accumulation_steps(E, mb) + 1)
        for size in (mb, smaller):
            tried.append((size, probe_step(workload, size, best.precision, budget_bytes, optimizer=best.optimizer,
                                           timed_steps=VERIFIED_STEPS)))
            if tried[-1][1].fits or smaller == mb:
                break
        failed = None
    except Exception as e:  # noqa: BLE001 - a compiler failure keeps the blocks compiled one by one
        failed = error_line(e)
        release_memory()
    mb, pr = tried[-1] if tried else (regional.micro_batch, None)
    seconds = time.perf_counter() - t0
    line = f"as one whole-model graph, checkpointing inside ({seconds:.0f} s incl. compilation): "
    if len(tried) == 2:  # the regional micro-batch did not fit: say so, then what the next one did
        first = tried[0][0]
        line += (f"{first} x {accumulation_steps(E, first)}: {_peak(tried[0][1])}; "
                 f"{mb} x {accumulation_steps(E, mb)}: ")
    if failed is None and pr.fits and _samples_per_s(pr, E) > regional.samples_per_s:
        rate = _samples_per_s(pr, E)
        every = tuple(range(len(find_blocks(model))))
        return (CompiledVariant(rate, mb, every, pr, WHOLE_MODEL),
                line + f"{format_rate(rate)} samples/s with every block checkpointed, kept")
    uncompile_model(model)
    compile_model(model)
    set_activation_checkpointing(model, True, regional.checkpoint_blocks)
    if failed:
        return None, line + f"failed ({failed}), each block kept"
    return None, line + (f"{format_rate(_samples_per_s(pr, E))} samples/s, each block kept" if pr.fits
                         else f"{_peak(pr)}, each block kept")


def _compiled_candidates(E: int, eager_micro_batch: int, n_blocks: int, most: tuple, regional: bool,
                         probe, eager_blocks: int | None = None) -> list[CompiledVariant]:
    """The compiled variants that fit, by ``probe(mb, blocks)``: at the fewest micro-batches that
    fit with ``most`` blocks checkpointed and, where blocks are compiled one by one and that
    needed checkpointing, at one micro-batch more per step after another (fewer blocks to
    recompute at each), for as long as each is faster than the one before. A compiled step's
    activations are a fraction of an eager one's, so the counts walked may go past the eager
    plan's: BERT-base seq 128 at 4 GiB (NVIDIA H200, 8-bit AdamW) was planned 256 x 1 with 10 of
    12 blocks recomputed, 0.71 of the compiled step with no budget, and its compiled step at a
    smaller micro-batch keeps most blocks (bench/results/session-2026-12-06b). Each count's
    search over blocks starts from the previous count's fewest (a smaller micro-batch needs no
    more), and changing either costs no compilation (dynamic batch dimension, blocks
    checkpointed around their compiled call).

    At the eager plan's own micro-batch the search over blocks starts from the eager plan's
    ``eager_blocks`` (the first that many): a compiled step keeps no more than the eager one,
    so that count fits, and one fewer usually does not (BERT-base seq 128 at 4 GiB on an NVIDIA
    H200: 11 eager, 11 compiled): two probes instead of a bisection from every block."""
    counts = sorted({accumulation_steps(E, micro_batch_for(E, k))
                     for k in range(1, accumulation_steps(E, eager_micro_batch) + 1)})

    hinted = regional and eager_blocks is not None  # the eager count is tried first at its micro-batch

    def fits(i: int) -> bool:  # count i fits with the most checkpointing: true from some i on
        mb = micro_batch_for(E, counts[i])
        if hinted and mb == eager_micro_batch and probe(mb, tuple(range(eager_blocks))).fits:
            return True  # fewer blocks than the most fit, so the most fit too
        return probe(mb, most).fits

    def fewest_blocks(mb: int, start: int) -> tuple | None:  # the fewest checkpointed blocks that fit at mb
        fits_at = lambda c: probe(mb, tuple(range(c))).fits  # noqa: E731
        if hinted and mb == eager_micro_batch and start >= eager_blocks and fits_at(eager_blocks):
            if eager_blocks == 0 or not fits_at(eager_blocks - 1):
                return tuple(range(eager_blocks))
            return tuple(range(gallop(eager_blocks - 1, -1, fits_at)))
        if not probe(mb, most if not regional or start == len(most) else tuple(range(start))).fits:
            return None
        if not regional:
            return most
        return tuple(range(gallop(start, -1, fits_at)))  # the fewest that fit lie near the start

    # the first count that fits: k = 1, else bisection (each miss is an out-of-memory probe)
    first = 0 if fits(0) else bisect(len(counts) - 1, 0, fits)
    found, k, start = [], counts[first], len(most)
    while True:
        mb = micro_batch_for(E, k)
        blocks = fewest_blocks(mb, start)
        if blocks is None:
            break
        pr = probe(mb, blocks)
        found.append(CompiledVariant(_samples_per_s(pr, E), mb, blocks, pr))
        if not regional or not blocks or mb <= 2 or len(found) > 1 and (
                found[-1].samples_per_s <= found[-2].samples_per_s  # slower: a smaller one would be too
                or len(blocks) >= len(found[-2].checkpoint_blocks)):  # no recomputation saved: no gain to come
            break
        # the next micro-batch down (not k + 1: above sqrt(E) that may give the same micro-batch);
        # not 1, which a dynamic batch dimension does not cover (another compilation)
        k, start = accumulation_steps(E, mb - 1), len(blocks)
    # The walk ends at the first count slower than the one before. Where blocks are still
    # recomputed there, the step that recomputes none is probed too, at the largest micro-batch
    # it fits: a block not checkpointed makes two compiled calls per micro-batch, not three, and
    # no recomputation, so it can win where the counts between lost (BERT-base seq 128 at 4 GiB,
    # NVIDIA H100: 128 x 2 with 7 blocks timed slower than 256 x 1 with 10, and the walk ended;
    # bench/results/recompute-3).
    if regional and found and found[-1].checkpoint_blocks:
        mb = _largest_unrecomputed(E, found[-1].micro_batch, lambda m: probe(m, ()).fits)
        if mb is not None:
            pr = probe(mb, ())  # probed already (cached): it fit
            found.append(CompiledVariant(_samples_per_s(pr, E), mb, (), pr))
    return found


def _largest_unrecomputed(E: int, needs_blocks: int, fits) -> int | None:
    """The largest micro-batch under ``needs_blocks`` (a micro-batch whose step needs checkpointed
    blocks), and at least 2, whose step ``fits(micro_batch)`` with none: micro-batch counts doubled
    from the largest count of ``needs_blocks``'s micro-batch until one fits, then bisection between
    the last two (2 log2 of the distance in counts, or fewer, probes; no count of a micro-batch
    known not to fit). None when micro-batch 2 does not fit either.
    (Not 1: a dynamic batch dimension does not cover it, another compilation.)"""
    if needs_blocks <= 2:
        return None
    # the largest count whose micro-batch is still needs_blocks (or more): known not to fit
    miss, last = max(1, accumulation_steps(E, needs_blocks - 1) - 1), accumulation_steps(E, 2)
    count_fits = lambda k: fits(micro_batch_for(E, k))  # noqa: E731
    while miss < last:
        k = min(2 * miss, last)
        if count_fits(k):
            return micro_batch_for(E, bisect(k, miss, count_fits))
        miss = k
    return None


# ---------------------------------------------------------------- the plan's reasons

def _reasons(result: SearchResult, verification: Verification, outcome: CompileOutcome) -> list[str]:
    """The plan's reason lines: what was searched and verified, each verified speed with its
    timing, the rejected candidates, the compile stage's notes and the ``decided by:`` line."""
    v = verification
    best, measured = v.best, v.measured
    c = best.candidate
    searched = len(v.ranked) + len([r for r in result.runners_up if r.samples_per_s == 0])
    reasons = [f"searched {searched} plans (precision x checkpointed blocks x micro-batch) in {result.seconds:.1f} s; "
               f"verified {len(measured)} with real steps under the budget ({int(PROBE_HEADROOM * 100)}% headroom)",
               f"{VERIFICATION}: {v.label(c)}: {format_rate(best.samples_per_s)} samples/s"
               + (f" (predicted {c.samples_per_s:.0f})" if c.samples_per_s
                  else " (micro-batch halved from the prediction)")
               + f", peak {format_bytes(best.probe.peak_reserved_bytes)} reserved: the fastest verified"]
    if v.line is not None:
        reasons.insert(1, f"calibrated with probes: {v.line.fixed_s * 1e3:.1f} ms per micro-batch + "
                          f"{v.line.per_sample_s * 1e3:.3f} ms per sample ({v.ranked[0].precision}), "
                          f"candidates re-ranked")
    reasons += [f"{VERIFICATION}: {v.label(m.candidate)}: {format_rate(m.samples_per_s)} samples/s"
                + (f" (predicted {m.candidate.samples_per_s:.0f})" if m.candidate.samples_per_s else "")
                for m in v.others]
    reasons += [f"rejected {r}" for r in v.rejected]
    if v.not_timed:
        reasons.append(f"not timed, predicted below {VERIFY_MIN_SHARE:.2f} of the fastest verified candidate's "
                       f"prediction: {'; '.join(v.not_timed)}")
    reasons += outcome.notes
    reasons.append(_decision(v, outcome))
    return reasons


def _decision(verification: Verification, outcome: CompileOutcome) -> str:
    """The reason line that names the timing which decided the plan: the verification timing
    among eager candidates, then the side-by-side retiming against the compiled variant where
    there was one, or ``--compile on``."""
    best, others = verification.best, verification.others
    label, speed = verification.label(best.candidate), best.samples_per_s
    if others:
        o = others[0]
        eager = (f"the verification timing chose {label} at {format_rate(speed)} samples/s, "
                 f"{speed / o.samples_per_s:.2f}x the next ({verification.label(o.candidate)}, {o.samples_per_s:.0f})")
    else:
        eager = f"the verification timing had only {label} at {format_rate(speed)} samples/s"
    retimed, compiled = outcome.retiming, outcome.variant
    if retimed is None:
        if compiled is None:
            return f"decided by: {eager}"
        return (f"decided by: --compile on (the compiled variant, {format_rate(compiled.samples_per_s)} samples/s in its "
                f"first timing after compilation, runs whatever its speed); among eager candidates {eager}")
    c_speed, e_speed = retimed.compiled_samples_per_s, retimed.eager_samples_per_s
    kept = "compiled" if compiled is not None else "eager"
    line = (f"decided by: {eager}; then the side-by-side retiming ({RETIMED_STEPS} timed steps each, the "
            f"median) of it against its compiled variant kept {kept}: compiled {c_speed:.0f} vs eager "
            f"{format_rate(e_speed)} samples/s")
    above = [o.samples_per_s for o in others if o.samples_per_s > e_speed] + ([speed] if speed > e_speed else [])
    if above:
        line += (f". The retimed eager figure ({e_speed:.0f}) is below verification figures "
                 f"({', '.join(f'{s:.0f}' for s in sorted(above, reverse=True))}): the same step timed at another "
                 f"moment (after compilation, with other CPU load and GPU clocks); figures are compared only "
                 f"within one timing")
    return line
