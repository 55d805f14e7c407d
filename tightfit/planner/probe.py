"""The first planner: pick precision from the card, then find the largest micro-batch that fits
the budget with real probe steps on the GPU (two steps of forward, backward and optimizer step,
on a worst-case batch padded to the full sequence length).

A probe runs the runtime's step (:func:`tightfit.step.training_step`) with a throw-away
optimizer of the plan's kind at lr = 0 (the run's weight decay, scaled by lr), so the weights
stay bit-identical; the RNG states are restored and the probe's memory released afterwards.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from ..devices import DeviceProfile
from ..errors import TightfitError
from ..buffers import KeptBuffers
from ..levers.checkpointing import can_checkpoint, kept_checkpointing, set_activation_checkpointing
from ..levers.optimizers import hold_gradients, release, weights_in
from ..levers.precision import autocast, check_precision, fallback_precisions, make_grad_scaler, preferred_precision
from ..plan import Plan, accumulation_steps, balanced_micro_batch
from ..memory.oom import is_oom, release_memory
from ..step import make_optimizer, train_mode, training_step
from ..rng import capture_rng, restore_rng
from ..units import format_bytes
from ..workload import Workload
from .bisection import bisect
from .margins import HEADROOM

# The share of the budget a probe's measured peak must leave free: the planner's one headroom,
# the same that predictions are held to (:mod:`.margins` says why and where each margin applies).
PROBE_HEADROOM = HEADROOM


@dataclass(frozen=True)
class ProbeResult:
    """One probe: whether it fit, its peak reserved/allocated bytes (None on OOM), and the time
    of its steady-state step."""

    micro_batch: int
    fits: bool
    peak_reserved_bytes: int | None
    peak_allocated_bytes: int | None
    step_seconds: float | None = None  # wall time of a steady-state step (the median timed step)
    micro_batches: int = 1  # micro-batches in that step


# Micro-batches in a timed probe step: the plan's own accumulation steps, up to this many. The
# samples/s of a plan of k micro-batches is read as k / m times a timed step of m, which counts the
# optimizer's update k / m times: a whole step (m = k) counts it once, as the run does. With two
# micro-batches per timed step (as before), 64 x 4 for BERT-base at 4 GiB was charged 8-bit
# AdamW's update (~4 ms of a ~60 ms step) twice, which is what tells it from 128 x 2 or 86 x 3.
TIMED_MICRO_BATCHES = 4


def probe_step(workload: Workload, micro_batch: int, precision: str, budget_bytes: int,
               timed_steps: int = 2, optimizer: str = "adamw") -> ProbeResult:
    """Run ``1 + timed_steps`` full training steps of ``micro_batch`` worst-case samples on the
    model's CUDA device (:func:`run_probe_steps`): the first allocates the optimizer's state;
    the timed ones run the plan's micro-batches when it accumulates (so gradients are held; at
    most :data:`TIMED_MICRO_BATCHES`), and their median is the step time (more timed steps give
    a steadier time).

    Args:
        precision: the plan's precision (autocast, and loss scaling for fp16).
        optimizer: the plan's optimizer (``Plan.optimizer``, one of :data:`tightfit.step.OPTIMIZERS`);
            the model's checkpointing is the caller's to set, as the plan says.

    Returns:
        A :class:`ProbeResult`; ``fits`` is False on OOM or when the peak reserved memory
        exceeds ``(1 - PROBE_HEADROOM) * budget_bytes``.

    Raises:
        Any non-OOM error of the step, unchanged.
    """
    device = next(workload.model.parameters()).device
    rng = capture_rng()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    oom = False
    # the weights in the optimizer's dtype (adamw8bit-bf16: bf16) for the steps, and back after the
    # failed step's memory is gone and the peaks are read: the restore is no part of the step
    try:
        with weights_in(workload.model, optimizer):
            before = torch.cuda.memory_allocated(device)
            try:
                seconds, micro_batches = run_probe_steps(workload, micro_batch, precision, optimizer, timed_steps)
            except Exception as e:
                if not is_oom(e):
                    raise
                oom = True
            reserved = torch.cuda.max_memory_reserved(device)
            allocated = torch.cuda.max_memory_allocated(device)
            release_memory(before, device)
    finally:  # a failed probe too leaves the random streams as it found them
        restore_rng(rng)
    if oom:
        return ProbeResult(micro_batch, False, None, None)
    return ProbeResult(micro_batch, reserved <= (1 - PROBE_HEADROOM) * budget_bytes, reserved, allocated,
                       seconds, micro_batches)


def run_probe_steps(workload: Workload, micro_batch: int, precision: str, optimizer: str,
                    timed_steps: int = 2) -> tuple[float, int]:
    """The probe's steps, on the model's device (the CPU too): ``1 + timed_steps`` runs of
    :func:`tightfit.step.training_step` in train mode, with the plan's optimizer built by
    :func:`tightfit.step.make_optimizer` at lr 0 with the run's weight decay (the weights
    stay bit-identical), the runtime's loss (``workload.loss_sum`` over ``workload.count``) and
    its autocast and loss scaler for ``precision`` (the scaler starts at scale 1, so that an
    overflow does not skip the first step, which allocates the optimizer's state). An optimizer
    that keeps bf16 weights (``adamw8bit-bf16``) steps a bf16 copy of them, and the fp32 weights
    are restored bit for bit afterwards from a host copy (:func:`tightfit.levers.optimizers.weights_in`:
    the cast drops each fp32 weight's low 16 bits).

    With accumulation, every micro-batch after the first runs forward and backward while the
    window's gradients are held: the timed steps do the plan's accumulation steps, at most
    :data:`TIMED_MICRO_BATCHES` (so that the optimizer's update is counted once per step).

    Returns:
        ``(seconds, micro_batches)``: the median wall time of the timed steps (each
        synchronised with the device), and the micro-batches in each. The median, not the
        fastest: the probe stands for the run's steady state, and a host-bound step's fastest
        of a few over-states it (on an NVIDIA H200 the main job's fastest of 30 steps was 8%
        under their median, bench/results/speed-2).

    Raises:
        Any error of a step, unchanged (an OOM included); the gradients are freed first and the
        throw-away optimizer dies with the error.
    """
    # BatchNorm's running statistics too are left as they were (the worst-case batches would be
    # folded into them, and the planned run start from other statistics than a cached plan's)
    with weights_in(workload.model, optimizer), KeptBuffers(workload.model.modules()):
        return _probe_steps(workload, micro_batch, precision, optimizer, timed_steps)


def _probe_steps(workload: Workload, micro_batch: int, precision: str, optimizer: str,
                 timed_steps: int) -> tuple[float, int]:
    model = workload.model
    device = next(model.parameters()).device
    accumulating = micro_batch < workload.effective_batch
    # lr 0 leaves the weights bit-identical (AdamW's decoupled decay is scaled by lr too); the
    # run's weight decay (make_optimizer's default), so that an optimizer compiled per tensor
    # (torchao's) is compiled here for the run, not again in its first step for another constant
    opt = make_optimizer(model.parameters(), optimizer, device.type, lr=0.0, accumulating=accumulating)
    scaler = make_grad_scaler(precision, device.type, init_scale=1.0)
    # The worst-case micro-batch is collated once, before any timing, and pinned on a GPU: the
    # run's prefetcher collates in the background and copies from pinned memory while the GPU
    # computes (runtime/prefetch.py), so the step time it sees holds no collation and no
    # synchronous copy. Collated inside the timing, ResNet-50's 128 images (77 MB) cost the
    # probe more than the GPU's work: verified at 1,463-1,685 samples/s against 3,607 in the run
    # (NVIDIA H200, bench/results/recompute-1).
    host = workload.train.worst_case(micro_batch)
    normaliser = workload.count(host) or 1  # per worst-case micro-batch (0 targets: as the trainer, 1)
    if device.type == "cuda":
        host = {k: v.pin_memory() for k, v in host.items()}

    def worst_case(n):  # copied one at a time, as the step asks: each is dropped before the next
        for _ in range(n):
            yield {k: v.to(device, non_blocking=True, copy=True) for k, v in host.items()}

    times = []
    try:
        with train_mode(model):  # the run's training modes (dropout active): its masks are saved too
            # The first step allocates the optimizer's state; the later ones run forward and backward
            # with that state held -- the steady state of every later step (one step alone
            # under-predicts). The median timed step is the step time (one alone is noisy).
            timed = min(accumulation_steps(workload.effective_batch, micro_batch), TIMED_MICRO_BATCHES)
            for i, micro_batches in enumerate((1,) + (timed,) * max(1, timed_steps)):
                hold_gradients(opt, micro_batches)
                t0 = time.perf_counter()
                training_step(model, worst_case(micro_batches), workload.loss_sum, normaliser * micro_batches,
                              opt, scaler, lambda: autocast(precision, device.type))
                _synchronize(device)
                if i:
                    times.append(time.perf_counter() - t0)
    finally:
        opt.zero_grad(set_to_none=True)
        release(opt)  # a throw-away optimizer leaves no hook on the model
    return statistics.median(times), micro_batches


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def largest_micro_batch(workload: Workload, precision: str, budget_bytes: int, upper: int,
                        optimizer: str = "adamw") -> ProbeResult | None:
    """The largest micro-batch in ``[1, upper]`` whose probe step fits (:func:`probe_step`):
    ``upper`` first, then bisection (:func:`.bisection.bisect`; each miss is an out-of-memory
    probe).

    Args:
        precision: ``fp32|fp16|bf16``; ``budget_bytes``: the budget (bytes); ``upper``: samples.
        optimizer: the plan's optimizer, whose state the probes hold (:func:`probe_step`).

    Returns:
        The probe of the largest fitting micro-batch, or None if even 1 does not fit.

    Raises:
        Any non-OOM error of a probe step, unchanged.
    """
    first = probe_step(workload, upper, precision, budget_bytes, optimizer=optimizer)
    if first.fits:
        return first
    fitting: dict[int, ProbeResult] = {}

    def fits(micro_batch: int) -> bool:
        r = probe_step(workload, micro_batch, precision, budget_bytes, optimizer=optimizer)
        if r.fits:
            fitting[micro_batch] = r
        return r.fits

    return fitting.get(bisect(0, upper, fits))  # 0 fits trivially, upper does not


def plan_first(workload: Workload, device: str, profile: DeviceProfile | None, budget_bytes: int | None,
               precision: str = "auto", checkpointing: str = "auto", optimizer: str = "adamw") -> Plan:
    """Choose the plan for ``workload``.

    On the CPU: fp32, the whole effective batch in one micro-batch, or with accumulation where
    that would not fit half the host's available memory (:func:`.host.host_micro_batch`).
    On a GPU: precision from the card (:func:`preferred_precision`); the largest micro-batch that
    a probe step fits in ``budget_bytes``, without activation checkpointing if any fits, else
    with it; if nothing fits in fp32, fp16/bf16 are tried for their smaller activations.
    The model must already be on ``device``, and the caching allocator capped to the budget; its
    activation checkpointing, which the probes set as each try needs, is left as it was found
    (:func:`~tightfit.levers.checkpointing.kept_checkpointing`; the runtime applies the plan's).

    Args:
        precision: ``"auto"`` or an explicit ``fp32|fp16|bf16``.
        checkpointing: ``"auto"``, ``"on"`` or ``"off"``.
        optimizer: the plan's optimizer (:data:`tightfit.step.OPTIMIZERS`); on a GPU the probes
            step it, so that its state (8-bit, on the CPU, bf16 weights) is what they measure.

    Raises:
        TightfitError: nothing fits, or an explicit precision the card cannot run.
    """
    E = workload.effective_batch
    if device == "cpu":
        from .host import host_micro_batch

        prec = "fp32" if precision == "auto" else precision
        check_precision(prec, None)
        ckpt = checkpointing == "on"
        mb, why = host_micro_batch(workload, prec, ckpt)
        return Plan(prec, mb, E, ckpt, device="cpu", budget_bytes=None,
                    reasons=(why or "CPU: fp32, the whole effective batch in one micro-batch (it fits the host's "
                             "memory; no GPU budget applies)",)
                    + (("activation checkpointing on (asked for)",) if ckpt else ()))
    if precision == "auto":
        first, why = preferred_precision(profile)
        candidates = fallback_precisions(profile, first)
    else:
        check_precision(precision, profile)
        first, why, candidates = precision, f"{precision} (asked for)", [precision]
    ckpt_options = {"auto": [False, True], "on": [True], "off": [False]}[checkpointing]
    if checkpointing == "auto" and not can_checkpoint(workload.model):
        ckpt_options = [False]  # nothing to checkpoint: "nothing fits" rather than a ValueError
    tried = []
    with kept_checkpointing(workload.model):  # the probes set their own; the runtime applies the plan's
        for prec in candidates:
            for ckpt in ckpt_options:
                set_activation_checkpointing(workload.model, ckpt)
                best = largest_micro_batch(workload, prec, budget_bytes, E, optimizer)
                tried.append(f"{prec}{' + checkpointing' if ckpt else ''}: "
                             + (f"micro-batch {best.micro_batch}" if best else "micro-batch 1 does not fit"))
                if best is None:
                    continue
                mb = balanced_micro_batch(E, best.micro_batch)
                reasons = [why if prec == first else f"{prec}: {first} did not fit even at micro-batch 1 "
                           f"(fp16/bf16 halve activation memory)"]
                reasons.append(f"largest micro-batch that fits {format_bytes(budget_bytes)} (probe step, "
                               f"{int(PROBE_HEADROOM * 100)}% headroom): {best.micro_batch} -> {mb} x "
                               f"{accumulation_steps(E, mb)} accumulation steps = effective batch {E}")
                reasons.append("activation checkpointing on: nothing fits without it"
                               if ckpt and checkpointing == "auto" else f"activation checkpointing {'on' if ckpt else 'off'}"
                               + (" (asked for)" if checkpointing != "auto" else ": not needed to fit"))
                peak = best.peak_reserved_bytes
                if mb != best.micro_batch:
                    peak = probe_step(workload, mb, prec, budget_bytes, optimizer=optimizer).peak_reserved_bytes
                return Plan(prec, mb, E, ckpt, optimizer=optimizer, device=device, budget_bytes=budget_bytes,
                            reasons=tuple(reasons), probe_peak_reserved_bytes=peak)
    from .search import NothingFitsError  # (search imports this module)

    raise NothingFitsError(f"nothing fits the budget of {format_bytes(budget_bytes)}: " + "; ".join(tried))
