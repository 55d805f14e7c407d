"""Planning on a GPU: predict with the search, then verify and time the best candidates with
real probe steps under the budget, and keep the fastest that fits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from ..devices import DeviceProfile
from ..errors import TightfitError
from ..memory.oom import release_memory
from ..levers.checkpointing import set_activation_checkpointing
from ..levers.compile import compile_model, compile_scope, compile_unavailable, uncompile_model
from ..plan import Plan
from ..units import format_bytes
from ..workload import Workload
from .probe import PROBE_HEADROOM, probe_step
from .cost import peak_flops
from .search import estimator_for, search

VERIFIED = 3  # candidates timed for real (each: one probe, probe_step)
VERIFIED_STEPS = 2  # timed steps of each verification probe (the fastest is the step time)
RETIMED_STEPS = 5  # timed steps of the final eager-vs-compiled comparison
VERIFICATION = f"verification timing ({VERIFIED_STEPS} timed steps, the fastest)"


@dataclass(frozen=True)
class MicroBatchLine:
    """Measured time of one micro-batch's forward + backward: ``fixed_s + per_sample_s x m``.

    On a fast GPU a micro-batch costs a fixed CPU time (Python, autograd, kernel launches) that
    does not shrink with its size, so accumulation steps cost nearly a whole micro-batch each;
    on a slow card the per-sample term dominates. Both terms scale with the passes over the
    model (``3 + checkpointed share``: forward, backward = 2 forwards, recomputation); the
    per-sample term also with the precision's rate relative to the calibrated one.
    """

    precision: str
    passes: float  # 3 + checkpointed share of the calibrated candidate
    fixed_s: float
    per_sample_s: float
    rates: dict  # precision -> relative rate (1.0 for the calibrated precision)

    @classmethod
    def fit(cls, cand, big, small, n_blocks: int, profile: DeviceProfile) -> "MicroBatchLine | None":
        """Two probes of ``cand`` at micro-batches ``big`` > ``small`` (their steady-state step
        times); ``profile`` gives the other precisions' rates relative to ``cand``'s."""
        u_big = big.step_seconds / big.micro_batches
        u_small = small.step_seconds / small.micro_batches
        if big.micro_batch <= small.micro_batch:
            return None
        per_sample = max(0.0, (u_big - u_small) / (big.micro_batch - small.micro_batch))
        fixed = max(0.0, u_big - per_sample * big.micro_batch)
        ref = peak_flops(profile, cand.precision)
        rates = {p: peak_flops(profile, p) / ref for p in ("fp32", "fp16", "bf16") if peak_flops(profile, p)}
        return cls(cand.precision, 3 + len(cand.checkpoint_blocks) / max(n_blocks, 1), fixed, per_sample, rates)

    def step_seconds(self, cand, effective_batch: int, n_blocks: int) -> float:
        """Predicted forward + backward time of one optimizer step of ``cand``."""
        scale = (3 + len(cand.checkpoint_blocks) / max(n_blocks, 1)) / self.passes
        rate = self.rates.get(cand.precision, 1.0) or 1.0
        full, rest = divmod(effective_batch, cand.micro_batch)
        t = full * (self.fixed_s + self.per_sample_s * cand.micro_batch / rate) * scale
        if rest:
            t += (self.fixed_s + self.per_sample_s * rest / rate) * scale
        return t


def _samples_per_s(pr, effective_batch: int) -> float:
    """Samples/s of a whole optimizer step (``ceil(E / micro-batch)`` micro-batches), from a probe."""
    return effective_batch / (pr.step_seconds * math.ceil(effective_batch / pr.micro_batch) / pr.micro_batches)


def _peak(pr) -> str:
    return f"{format_bytes(pr.peak_reserved_bytes)} peak" if pr.peak_reserved_bytes else "out of memory"


def _first_true(lo: int, hi: int, pred) -> int:
    """The smallest ``i`` in ``[lo, hi]`` with ``pred(i)``, for a ``pred`` false then true, taken
    true at ``hi`` (not evaluated there)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def plan_on_gpu(workload: Workload, profile: DeviceProfile, budget_bytes: int, seq_len: int,
                precision: str = "auto", checkpointing: str = "auto", compile: str = "auto") -> Plan:
    """The fastest plan that really fits: the search's ranking, verified on the GPU.

    Candidates are probed in the search's order (real training steps under the allocator cap,
    :data:`VERIFIED_STEPS` of them timed); the first :data:`VERIFIED` that fit are timed and the
    fastest in that verification timing wins among eager plans. Then, unless ``compile`` is
    ``"off"`` (or ``torch.compile`` cannot run here), the winner's precision and checkpointed
    blocks are compiled (:func:`compiled_variant`) and kept if faster when both are retimed side
    by side (:data:`RETIMED_STEPS` timed steps each). Every samples/s figure in the plan's reasons
    names its timing, and one line starting ``decided by:`` names the timing that decided.
    The model must be on the GPU and the caching allocator capped at the budget; it is left
    compiled when the plan says so.

    With ``compile="auto"`` a compiler error leaves the verified eager plan in place (noted in
    its reasons); with ``"on"`` it is raised. When no compiled micro-batch fits, the plan runs
    eager either way, and says so.

    Raises:
        TightfitError: nothing fits (predicted or measured); ``compile`` is ``"on"`` where
            compilation cannot run.
        Exception: the compiler's own error, with ``compile="on"``.
    """
    if compile not in ("auto", "on", "off"):
        raise TightfitError(f"compile must be auto, on or off; got {compile!r}")
    why_not = compile_unavailable("cuda")
    if compile == "on" and why_not:
        raise TightfitError(f"--compile on: {why_not}")
    t0 = time.perf_counter()
    make_batch = lambda micro_batch, size: workload.train.worst_case(micro_batch)  # noqa: E731
    result = search(workload.model, make_batch, seq_len, workload.effective_batch, profile, budget_bytes,
                    estimator_for(workload.model, make_batch, seq_len, profile, workload.effective_batch,
                                  checkpointed_margin=0.0),  # the probes verify for real
                    precision=precision, checkpointing=checkpointing,
                    estimator_at=lambda size, effective_batch: None if size != seq_len else estimator_for(
                        workload.model, make_batch, seq_len, profile, effective_batch, checkpointed_margin=0.0))
    ranked = [result.best] + [c for c in result.runners_up if c.samples_per_s > 0]
    E, n = workload.effective_batch, result.n_blocks
    measured, rejected, probes = [], [], {}

    def probe(cand, micro_batch):
        key = (cand.precision, cand.checkpoint_blocks, micro_batch)
        if key not in probes:
            blocks = cand.checkpoint_blocks
            set_activation_checkpointing(workload.model, bool(blocks), blocks)
            probes[key] = probe_step(workload, micro_batch, cand.precision, budget_bytes, timed_steps=VERIFIED_STEPS)
        return probes[key]

    # Calibrate: the search's first choice at its micro-batch and at a quarter of it gives the
    # card's fixed cost per micro-batch (kernel launches, Python) and its cost per sample.
    line = None
    first = probe(ranked[0], ranked[0].micro_batch)
    if first.fits and ranked[0].micro_batch >= 4:
        small = probe(ranked[0], ranked[0].micro_batch // 4)
        if small.fits:
            line = MicroBatchLine.fit(ranked[0], first, small, n, profile)
    if line is not None:
        ranked.sort(key=lambda c: -E / line.step_seconds(c, E, n))
    def verify(cand):
        pr = probe(cand, cand.micro_batch)
        if pr.fits:
            measured.append((_samples_per_s(pr, E), cand, pr))
        else:
            rejected.append(f"{cand.label()}: {_peak(pr)}")

    for cand in ranked:
        if len(measured) == VERIFIED:
            break
        verify(cand)
    # None fit for real (the prediction was short, e.g. memory held elsewhere in the process):
    # halve the micro-batch of the candidate that checkpoints the most until a real step fits.
    smallest = max(ranked, key=lambda c: len(c.checkpoint_blocks))
    while not measured and smallest.micro_batch > 1:
        mb = smallest.micro_batch // 2
        smallest = replace(smallest, micro_batch=mb, accumulation_steps=math.ceil(E / mb), samples_per_s=0.0,
                           peak_reserved_bytes=None, peak_allocated_bytes=None, breakdown={})
        verify(smallest)
    set_activation_checkpointing(workload.model, False, ())
    if not measured:
        raise TightfitError(f"no planned candidate fits {format_bytes(budget_bytes)} for real: " + "; ".join(rejected))
    verified_speed, best, best_probe = max(measured, key=lambda m: m[0])
    blocks = best.checkpoint_blocks
    compiled, compile_notes, retimed = None, [], None
    if compile != "off" and not why_not:
        try:
            compiled, compile_notes = compiled_variant(workload, best, budget_bytes, n)
            if compiled is not None and compile == "auto":
                compiled, retimed, compile_notes = _compiled_or_eager(workload, best, compiled, budget_bytes,
                                                                      compile_notes)
        except Exception as e:  # a compiler failure: the verified eager plan stands
            if compile == "on":
                raise
            uncompile_model(workload.model)
            release_memory()
            compiled = None
            compile_notes = [f"torch.compile failed, eager plan kept: {type(e).__name__}: "
                             f"{(str(e).strip().splitlines() or [''])[0][:200]}"]
        if compile == "on" and compiled is None:
            compile_notes.append("--compile on: no compiled micro-batch fits, so the plan runs eager")
    elif compile == "auto":
        compile_notes = [f"torch.compile not tried: {why_not}"]
    others = sorted(((s, c) for s, c, _ in measured if c is not best), key=lambda m: -m[0])
    reasons = [f"searched {len(ranked) + len([c for c in result.runners_up if c.samples_per_s == 0])} plans "
               f"(precision x checkpointed blocks x micro-batch) in {result.seconds:.1f} s; "
               f"verified {len(measured)} with real steps under the budget ({int(PROBE_HEADROOM * 100)}% headroom)",
               f"{VERIFICATION}: {best.label()}: {verified_speed:.0f} samples/s"
               + (f" (predicted {best.samples_per_s:.0f})" if best.samples_per_s
                  else " (micro-batch halved from the prediction)")
               + f", peak {format_bytes(best_probe.peak_reserved_bytes)} reserved: the fastest verified"]
    if line is not None:
        reasons.insert(1, f"calibrated with probes: {line.fixed_s * 1e3:.1f} ms per micro-batch + "
                          f"{line.per_sample_s * 1e3:.3f} ms per sample ({ranked[0].precision}), candidates re-ranked")
    reasons += [f"{VERIFICATION}: {c.label()}: {s:.0f} samples/s"
                + (f" (predicted {c.samples_per_s:.0f})" if c.samples_per_s else "") for s, c in others]
    reasons += [f"rejected {r}" for r in rejected]
    reasons += compile_notes
    reasons.append(_decision(best, verified_speed, others, compiled, retimed))
    micro_batch, use_compile = best.micro_batch, compiled is not None
    speed = None
    if use_compile:
        speed, micro_batch, blocks, best_probe = compiled
    else:
        uncompile_model(workload.model)
    set_activation_checkpointing(workload.model, False, ())
    reasons.append(f"planning took {time.perf_counter() - t0:.1f} s")
    return Plan(best.precision, micro_batch, E, bool(blocks), device="cuda", budget_bytes=budget_bytes,
                reasons=tuple(reasons), probe_peak_reserved_bytes=best_probe.peak_reserved_bytes,
                checkpoint_blocks=tuple(blocks) if 0 < len(blocks) < n else None,
                predicted_peak_reserved_bytes=best.peak_reserved_bytes if not use_compile else None,
                # compiled: the measured samples/s that decided (the estimator does not model
                # compiled steps); eager: the search's prediction (None where it had none)
                predicted_samples_per_s=speed if use_compile else best.samples_per_s or None, compile=use_compile)


def _decision(best, verified_speed: float, others: list, compiled, retimed) -> str:
    """The reason line that names the timing which decided the plan.

    Args:
        best: the eager candidate fastest in the verification timing, at ``verified_speed``
            samples/s; ``others``: ``(samples/s, candidate)`` of the other verified ones.
        compiled: the compiled variant kept (samples/s first), or None.
        retimed: ``(compiled samples/s, eager samples/s)`` of the side-by-side retiming, or None
            when there was none.
    """
    if others:
        s, c = others[0]
        eager = (f"the verification timing chose {best.label()} at {verified_speed:.0f} samples/s, "
                 f"{verified_speed / s:.2f}x the next ({c.label()}, {s:.0f})")
    else:
        eager = f"the verification timing had only {best.label()} at {verified_speed:.0f} samples/s"
    if retimed is None:
        if compiled is None:
            return f"decided by: {eager}"
        return (f"decided by: --compile on (the compiled variant, {compiled[0]:.0f} samples/s in its first "
                f"timing after compilation, runs whatever its speed); among eager candidates {eager}")
    c_speed, e_speed = retimed
    kept = "compiled" if compiled is not None else "eager"
    line = (f"decided by: {eager}; then the side-by-side retiming ({RETIMED_STEPS} timed steps each, the "
            f"fastest) of it against its compiled variant kept {kept}: compiled {c_speed:.0f} vs eager "
            f"{e_speed:.0f} samples/s")
    above = [s for s, _ in others if s > e_speed] + ([verified_speed] if verified_speed > e_speed else [])
    if above:
        line += (f". The retimed eager figure ({e_speed:.0f}) is below verification figures "
                 f"({', '.join(f'{s:.0f}' for s in sorted(above, reverse=True))}): the same step timed at another "
                 f"moment (after compilation, with other CPU load and GPU clocks); figures are compared only "
                 f"within one timing")
    return line


def _compiled_or_eager(workload: Workload, best, compiled, budget_bytes: int, notes: list):
    """Time the eager winner and the compiled variant again, side by side with more steps each
    (the compiled variant's first probes ran right after compilation), and keep the faster.
    A retime that no longer fits the headroom counts as 0 samples/s.

    Returns:
        ``(compiled or None, (compiled samples/s, eager samples/s), notes)``; the compiled
        entry carries its retimed samples/s; the model is left compiled only if the compiled
        variant won.
    """
    E, model = workload.effective_batch, workload.model

    def retime(mb, blocks):
        set_activation_checkpointing(model, bool(blocks), blocks)
        pr = probe_step(workload, mb, best.precision, budget_bytes, timed_steps=RETIMED_STEPS)
        return _samples_per_s(pr, E) if pr.fits else 0.0

    c_speed = retime(compiled[1], compiled[2])
    uncompile_model(model)
    e_speed = retime(best.micro_batch, best.checkpoint_blocks)
    note = (f"retimed side by side ({RETIMED_STEPS} timed steps each, the fastest): compiled {c_speed:.0f} vs "
            f"eager {e_speed:.0f} samples/s" + (" (no longer within the headroom)" if not (c_speed and e_speed) else ""))
    if c_speed <= e_speed or c_speed == 0:
        return None, (c_speed, e_speed), notes + [note + ": eager kept"]
    compile_model(model)
    return (c_speed,) + tuple(compiled[1:]), (c_speed, e_speed), notes + [note + ": compiled kept"]


def compiled_variant(workload: Workload, best, budget_bytes: int, n_blocks: int):
    """Try ``best`` (a verified eager candidate) compiled, with as few micro-batches as fit
    (compiled steps keep fewer intermediates, so a larger micro-batch may fit than in eager mode).

    Micro-batch counts ``k`` run from 1 to the eager plan's count (micro-batch ``ceil(E / k)``);
    the smallest ``k`` that fits with the most checkpointing on offer is found first (``k = 1``,
    then bisection over the counts). When the blocks are compiled one by one
    (:func:`~tightfit.levers.compile.compile_scope`), checkpointing other blocks costs no
    compilation, so that ``k`` gets the fewest checkpointed blocks (the first ones first) that
    fit, by bisection over the block count; when it needed checkpointing, the next count is
    tried too (fewer blocks, one more micro-batch), and the faster is kept. A model compiled
    whole keeps ``best``'s blocks (another set would recompile). One compiled graph (dynamic
    micro-batch dimension) serves all probes.

    Returns:
        ``((samples/s, micro-batch, checkpointed blocks, probe) or None, reasons)``: None when
        nothing fits; the model is left compiled only if not None.
    """
    E = workload.effective_batch
    model = workload.model
    regional = compile_scope(model) == "blocks"
    compile_model(model)
    t0 = time.perf_counter()
    tried, probes = [], {}

    def probe(mb, blocks):
        key = (mb, blocks)
        if key not in probes:
            set_activation_checkpointing(model, bool(blocks), blocks)
            pr = probes[key] = probe_step(workload, mb, best.precision, budget_bytes, timed_steps=VERIFIED_STEPS)
            tried.append(f"{mb} x {math.ceil(E / mb)}, {len(blocks)} blocks: {_peak(pr)}")
        return probes[key]

    most = tuple(range(n_blocks)) if regional else best.checkpoint_blocks

    def fewest_blocks(mb):  # the fewest checkpointed blocks that fit at mb, or None
        if not probe(mb, most).fits:
            return None
        if not regional:
            return most
        return tuple(range(_first_true(0, n_blocks, lambda c: probe(mb, tuple(range(c))).fits)))

    found = []
    counts = sorted({math.ceil(E / math.ceil(E / k)) for k in range(1, math.ceil(E / best.micro_batch) + 1)})

    def fits(i):  # count i fits with the most checkpointing: true from some i on
        return probe(math.ceil(E / counts[i]), most).fits

    # the first count that fits: k = 1, else bisection (each miss is an out-of-memory probe)
    first = 0 if fits(0) else _first_true(1, len(counts) - 1, fits)
    for k in counts[first:]:
        mb = math.ceil(E / k)
        blocks = fewest_blocks(mb)
        if blocks is None:
            continue
        pr = probe(mb, blocks)
        found.append((_samples_per_s(pr, E), mb, blocks, pr))
        if not regional or not blocks or len(found) == 2:
            break
    seconds = time.perf_counter() - t0
    result = max(found, key=lambda f: f[0]) if found else None
    scope = "each block" if regional else "whole model"
    if result is None:
        uncompile_model(model)
        return None, [f"torch.compile ({scope}, {seconds:.0f} s incl. compilation): nothing fits "
                      f"(probed {'; '.join(tried)})"]
    return result, [f"torch.compile ({scope}): {result[0]:.0f} samples/s in its first timing after compilation "
                    f"({VERIFIED_STEPS} timed steps, the fastest) at micro-batch {result[1]} with "
                    f"{len(result[2])} checkpointed blocks ({seconds:.0f} s incl. compilation; probed {'; '.join(tried)})"]
