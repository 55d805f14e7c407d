"""Planning on a GPU: predict with the search, then verify and time the best candidates with
real probe steps under the budget, and keep the fastest that fits."""

from __future__ import annotations

import math
import time

import torch

from ..devices import DeviceProfile
from ..errors import TightfitError
from ..levers.checkpointing import set_activation_checkpointing
from ..plan import Plan
from ..units import format_bytes
from ..workload import Workload
from .probe import PROBE_HEADROOM, probe_step
from .search import estimator_for, search

VERIFIED = 3  # candidates timed for real (each: two probe steps)


def plan_on_gpu(workload: Workload, profile: DeviceProfile, budget_bytes: int, seq_len: int,
                precision: str = "auto", checkpointing: str = "auto") -> Plan:
    """The fastest plan that really fits: the search's ranking, verified on the GPU.

    Candidates are probed in the search's order (two real training steps each, under the
    allocator cap); the first :data:`VERIFIED` that fit are timed and the fastest measured wins.
    The model must be on the GPU and the caching allocator capped at the budget.

    Raises:
        TightfitError: nothing fits (predicted or measured).
    """
    t0 = time.perf_counter()
    make_batch = lambda micro_batch, size: workload.train.worst_case(micro_batch)  # noqa: E731
    result = search(workload.model, make_batch, seq_len, workload.effective_batch, profile, budget_bytes,
                    estimator_for(workload.model, make_batch, seq_len, profile, workload.effective_batch,
                                  checkpointed_margin=0.0),  # the probes verify for real
                    precision=precision, checkpointing=checkpointing)
    ranked = [result.best] + [c for c in result.runners_up if c.samples_per_s > 0]
    E, n = workload.effective_batch, result.n_blocks
    measured, rejected = [], []
    for cand in ranked:
        if len(measured) == VERIFIED:
            break
        blocks = cand.checkpoint_blocks
        set_activation_checkpointing(workload.model, bool(blocks), blocks)
        probe = probe_step(workload, cand.micro_batch, cand.precision, budget_bytes)
        if not probe.fits:
            rejected.append(f"{cand.label()}: " + (f"peak {format_bytes(probe.peak_reserved_bytes)} measured"
                                                   if probe.peak_reserved_bytes else "out of memory"))
            continue
        step_s = probe.step_seconds * math.ceil(E / cand.micro_batch) / probe.micro_batches
        measured.append((E / step_s, cand, probe))
    set_activation_checkpointing(workload.model, False, ())
    if not measured:
        raise TightfitError(f"no planned candidate fits {format_bytes(budget_bytes)} for real: " + "; ".join(rejected))
    speed, best, probe = max(measured, key=lambda m: m[0])
    blocks = best.checkpoint_blocks
    reasons = [f"searched {len(ranked) + len([c for c in result.runners_up if c.samples_per_s == 0])} plans "
               f"(precision x checkpointed blocks x micro-batch) in {result.seconds:.1f} s; "
               f"verified {len(measured)} with real steps under the budget ({int(PROBE_HEADROOM * 100)}% headroom)",
               f"fastest measured: {speed:.0f} samples/s (predicted {best.samples_per_s:.0f}), "
               f"peak {format_bytes(probe.peak_reserved_bytes)} reserved"]
    reasons += [f"{c.label()}: {s:.0f} samples/s measured" for s, c, _ in measured if c is not best]
    reasons += [f"rejected {r}" for r in rejected]
    reasons.append(f"planning took {time.perf_counter() - t0:.1f} s")
    return Plan(best.precision, best.micro_batch, E, bool(blocks), device="cuda", budget_bytes=budget_bytes,
                reasons=tuple(reasons), probe_peak_reserved_bytes=probe.peak_reserved_bytes,
                checkpoint_blocks=tuple(blocks) if 0 < len(blocks) < n else None,
                predicted_peak_reserved_bytes=best.peak_reserved_bytes, predicted_samples_per_s=best.samples_per_s)
