"""Planning on a GPU: predict with the search, then verify and time the best candidates with
real probe steps under the budget, and keep the fastest that fits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..devices import DeviceProfile
from ..errors import TightfitError
from ..levers.checkpointing import set_activation_checkpointing
from ..levers.compile import compile_model, compile_unavailable, uncompile_model
from ..plan import Plan
from ..units import format_bytes
from ..workload import Workload
from .probe import PROBE_HEADROOM, probe_step
from .cost import peak_flops
from .search import estimator_for, search

VERIFIED = 3  # candidates timed for real (each: two probe steps)


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


def plan_on_gpu(workload: Workload, profile: DeviceProfile, budget_bytes: int, seq_len: int,
                precision: str = "auto", checkpointing: str = "auto", compile: str = "auto") -> Plan:
    """The fastest plan that really fits: the search's ranking, verified on the GPU.

    Candidates are probed in the search's order (two real training steps each, under the
    allocator cap); the first :data:`VERIFIED` that fit are timed and the fastest measured wins.
    Then, unless ``compile`` is ``"off"`` (or ``torch.compile`` cannot run here), the winner's
    precision and checkpointed blocks are compiled (:func:`compiled_variant`) and kept if faster.
    The model must be on the GPU and the caching allocator capped at the budget; it is left
    compiled when the plan says so.

    Raises:
        TightfitError: nothing fits (predicted or measured); ``compile`` is ``"on"`` where
            compilation cannot run.
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
                    precision=precision, checkpointing=checkpointing)
    ranked = [result.best] + [c for c in result.runners_up if c.samples_per_s > 0]
    E, n = workload.effective_batch, result.n_blocks
    measured, rejected, probes = [], [], {}

    def probe(cand, micro_batch):
        key = (cand.precision, cand.checkpoint_blocks, micro_batch)
        if key not in probes:
            blocks = cand.checkpoint_blocks
            set_activation_checkpointing(workload.model, bool(blocks), blocks)
            probes[key] = probe_step(workload, micro_batch, cand.precision, budget_bytes)
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
    for cand in ranked:
        if len(measured) == VERIFIED:
            break
        pr = probe(cand, cand.micro_batch)
        if not pr.fits:
            rejected.append(f"{cand.label()}: " + (f"peak {format_bytes(pr.peak_reserved_bytes)} measured"
                                                   if pr.peak_reserved_bytes else "out of memory"))
            continue
        step_s = pr.step_seconds * math.ceil(E / cand.micro_batch) / pr.micro_batches
        measured.append((E / step_s, cand, pr))
    set_activation_checkpointing(workload.model, False, ())
    if not measured:
        raise TightfitError(f"no planned candidate fits {format_bytes(budget_bytes)} for real: " + "; ".join(rejected))
    speed, best, best_probe = max(measured, key=lambda m: m[0])
    blocks = best.checkpoint_blocks
    compiled, compile_notes = None, []
    if compile != "off" and not why_not:
        compiled, compile_notes = compiled_variant(workload, best, 0.0 if compile == "on" else speed, budget_bytes)
    elif compile == "auto":
        compile_notes = [f"torch.compile not tried: {why_not}"]
    reasons = [f"searched {len(ranked) + len([c for c in result.runners_up if c.samples_per_s == 0])} plans "
               f"(precision x checkpointed blocks x micro-batch) in {result.seconds:.1f} s; "
               f"verified {len(measured)} with real steps under the budget ({int(PROBE_HEADROOM * 100)}% headroom)",
               f"fastest measured: {speed:.0f} samples/s (predicted {best.samples_per_s:.0f}), "
               f"peak {format_bytes(best_probe.peak_reserved_bytes)} reserved"]
    if line is not None:
        reasons.insert(1, f"calibrated with probes: {line.fixed_s * 1e3:.1f} ms per micro-batch + "
                          f"{line.per_sample_s * 1e3:.3f} ms per sample ({ranked[0].precision}), candidates re-ranked")
    reasons += [f"{c.label()}: {s:.0f} samples/s measured" for s, c, _ in measured if c is not best]
    reasons += [f"rejected {r}" for r in rejected]
    reasons += compile_notes
    micro_batch, use_compile = best.micro_batch, compiled is not None
    if use_compile:
        speed, micro_batch, best_probe = compiled
    else:
        uncompile_model(workload.model)
    set_activation_checkpointing(workload.model, False, ())
    reasons.append(f"planning took {time.perf_counter() - t0:.1f} s")
    return Plan(best.precision, micro_batch, E, bool(blocks), device="cuda", budget_bytes=budget_bytes,
                reasons=tuple(reasons), probe_peak_reserved_bytes=best_probe.peak_reserved_bytes,
                checkpoint_blocks=tuple(blocks) if 0 < len(blocks) < n else None,
                predicted_peak_reserved_bytes=best.peak_reserved_bytes if not use_compile else None,
                predicted_samples_per_s=speed if use_compile else best.samples_per_s, compile=use_compile)


def compiled_variant(workload: Workload, best, eager_speed: float, budget_bytes: int):
    """Try ``best`` (a verified eager candidate) compiled: same precision and checkpointed blocks,
    with as few micro-batches as fit (compiled steps keep fewer intermediates, so a larger
    micro-batch may fit than in eager mode).

    Micro-batches ``ceil(E / k)`` are probed for ``k = 1, 2, ...`` up to the eager plan's count;
    the first that fits is timed. One compiled graph (dynamic micro-batch dimension) serves all
    probes; compilation happens in the first.

    Returns:
        ``((samples/s, micro-batch, probe) or None, reasons)``: None when the compiled step is
        not faster than ``eager_speed`` (0: keep it anyway) or nothing fits; the model is left
        compiled only if not None.
    """
    E = workload.effective_batch
    model = workload.model
    set_activation_checkpointing(model, bool(best.checkpoint_blocks), best.checkpoint_blocks)
    compile_model(model)
    t0 = time.perf_counter()
    found, tried = None, []
    for k in range(1, math.ceil(E / best.micro_batch) + 1):
        mb = math.ceil(E / k)
        if k > 1 and mb == math.ceil(E / (k - 1)):
            continue
        pr = probe_step(workload, mb, best.precision, budget_bytes)
        tried.append(f"{mb} x {k}: " + (f"{format_bytes(pr.peak_reserved_bytes)} peak" if pr.peak_reserved_bytes
                                        else "out of memory"))
        if pr.fits:
            found = (E / (pr.step_seconds * k / pr.micro_batches), mb, pr)
            break
    seconds = time.perf_counter() - t0
    if found is None or found[0] <= eager_speed:
        uncompile_model(model)
        what = "nothing fits" if found is None else f"{found[0]:.0f} samples/s, not faster than eager"
        return None, [f"torch.compile ({seconds:.0f} s incl. compilation): {what} (probed {'; '.join(tried)})"]
    return found, [f"torch.compile: {found[0]:.0f} samples/s at micro-batch {found[1]} vs {eager_speed:.0f} eager "
                   f"({seconds:.0f} s incl. compilation; probed {'; '.join(tried)})"]
