"""The settings compared on one workload, each trained with tightfit's runtime and timed alike.

- ``no budget``: one micro-batch of the effective batch, fp16/bf16 x checkpointing none/all,
  no memory cap: the best is the reference speed of the model on this GPU;
- ``plain``: what a user tuning by hand runs: fp32/fp16/bf16 x checkpointing none/all, each at
  the largest batch whose probe steps fit the budget (found by bisection), no accumulation;
- ``compiled no budget``: the same as ``no budget`` in bf16 without checkpointing, compiled by
  ``torch.compile`` -- tightfit's compilation lever without a memory cap, for reference;
- ``tightfit``: :func:`tightfit.planner.gpu.plan_on_gpu`, then a long run at the effective batch
  (out-of-memory recoveries after planning are counted).

samples/s counts the steps after the first ``warmup`` (first allocations, kernel heuristics),
each step ended by a CUDA synchronisation.
"""

from __future__ import annotations

import gc
import time

import torch

from ..devices import detect
from ..levers.checkpointing import set_activation_checkpointing
from ..levers.blocks import find_blocks
from ..plan import Plan
from ..planner.gpu import plan_on_gpu
from ..planner.probe import largest_micro_batch
from ..runtime.trainer import TrainConfig, Trainer
from .workloads import BenchWorkload, make_workload


def cap_memory(budget_bytes: int | None) -> None:
    """Cap the caching allocator at ``budget_bytes`` (None: the whole card)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if budget_bytes is None else budget_bytes / total)


def clean() -> None:
    """Free the last setting's memory and compiled graphs (a new model instance would otherwise
    count as a recompilation of the same code, and past torch's recompile limit run eagerly)."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def speed_after_warmup(ends: list[float], warmup: int, samples_per_step: int) -> float | None:
    """Samples/s over the steps after the first ``warmup``, the one rule of every row.

    Args:
        ends: the end times (seconds) of consecutive steps, the first step's first.
        warmup: steps left out; the span from the end of step ``warmup`` to the last end holds
            exactly the later steps (0: from the end of the first step).
        samples_per_step: samples in each step.

    Returns:
        samples/s, or None with fewer than two ends after the warm-up.
    """
    timed = ends[warmup - 1:] if warmup > 0 else ends
    return samples_per_step * (len(timed) - 1) / (timed[-1] - timed[0]) if len(timed) > 1 else None


def timed_run(workload, plan: Plan, steps: int, warmup: int) -> dict:
    """Train ``steps`` optimizer steps of ``plan``; speed over the steps after ``warmup``."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = Trainer(workload, plan, TrainConfig(epochs=1, max_steps=steps, lr=1e-5, checkpoint_dir=None,
                                            warmup_ratio=0.0), progress=False)
    res = t.fit()
    # each step's end as the trainer read its values (no extra sync: steps may be queued ahead)
    speed = speed_after_warmup([end for end, _ in res.step_ends], warmup, workload.effective_batch)
    return {"samples_per_s": float("nan") if speed is None else speed, "peak_reserved_bytes": res.peak_reserved_bytes,
            "peak_allocated_bytes": res.peak_allocated_bytes, "ooms_after_planning": res.oom_recoveries,
            "steps": res.steps, "precision": plan.precision, "compile": plan.compile, "micro_batch": plan.micro_batch,
            "accumulation_steps": plan.accumulation_steps, "effective_batch": workload.effective_batch,
            "checkpointed_blocks": len(plan.checkpoint_blocks) if plan.checkpoint_blocks is not None
            else (len(find_blocks(workload.model)) if plan.activation_checkpointing else 0)}


def no_budget(w: BenchWorkload, steps: int, warmup: int, precisions=("fp16", "bf16")) -> list[dict]:
    """The effective batch in one micro-batch, without a memory cap."""
    return [_unbudgeted(w, steps, warmup, "no budget", prec, ck) for prec in precisions for ck in (False, True)]


def compiled_no_budget(w: BenchWorkload, steps: int, warmup: int, precision: str = "bf16") -> dict:
    """The effective batch in one micro-batch, compiled, without checkpointing or a memory cap."""
    return _unbudgeted(w, steps, warmup, "compiled no budget", precision, False, compile=True)


def _unbudgeted(w: BenchWorkload, steps: int, warmup: int, setting: str, precision: str, checkpointing: bool,
                compile: bool = False) -> dict:
    """One timed run of the effective batch in one micro-batch, no memory cap; ``wall_seconds``
    includes what ``samples_per_s`` leaves out (model build, first steps, compilation)."""
    cap_memory(None)
    wl = make_workload(w, w.effective_batch, w.effective_batch * steps)
    n = len(find_blocks(wl.model))
    plan = Plan(precision, w.effective_batch, w.effective_batch, checkpointing, device="cuda",
                checkpoint_blocks=tuple(range(n)) if checkpointing else None, compile=compile)
    t0 = time.perf_counter()
    row = {"setting": setting, **timed_run(wl, plan, steps, warmup), "wall_seconds": time.perf_counter() - t0}
    del wl
    clean()
    return row


def plain(w: BenchWorkload, steps: int, warmup: int, precisions=("fp32", "fp16", "bf16")) -> list[dict]:
    """Each precision x checkpointing none/all at the largest batch that fits, no accumulation."""
    budget = w.budget_bytes
    rows = []
    for prec in precisions:
        for ck in (False, True):
            cap_memory(budget)
            wl = make_workload(w, 2 * w.effective_batch, 2 * w.effective_batch)
            n = len(find_blocks(wl.model))
            set_activation_checkpointing(wl.model, ck, tuple(range(n)) if ck else ())
            t0 = time.perf_counter()
            best = largest_micro_batch(wl, prec, budget, 2 * w.effective_batch)
            search_s = time.perf_counter() - t0
            set_activation_checkpointing(wl.model, False, ())
            base = {"setting": "plain", "precision": prec, "checkpointed_blocks": n if ck else 0,
                    "planning_seconds": search_s}
            if best is None:
                rows.append({**base, "fits": False})
            else:
                mb = best.micro_batch
                wl.effective_batch = mb
                wl.train.n = mb * steps
                plan = Plan(prec, mb, mb, ck, device="cuda", checkpoint_blocks=tuple(range(n)) if ck else None)
                rows.append({**base, **timed_run(wl, plan, steps, warmup)})
            del wl
            clean()
    return rows


def tightfit(w: BenchWorkload, steps: int, warmup: int) -> dict:
    """tightfit's plan for the budget (timed, trial steps included) and a ``steps``-step run."""
    cap_memory(w.budget_bytes)
    wl = make_workload(w, w.effective_batch, w.effective_batch * steps)
    t0 = time.perf_counter()
    plan = plan_on_gpu(wl, detect(), w.budget_bytes, w.size)
    planning_s = time.perf_counter() - t0
    row = {"setting": "tightfit", "planning_seconds": planning_s, "reasons": list(plan.reasons),
           "predicted_samples_per_s": plan.predicted_samples_per_s, **timed_run(wl, plan, steps, warmup)}
    del wl
    clean()
    cap_memory(None)
    return row
