"""The FSDP2 micro-batch verified by two real steps on every rank before training.

Under FSDP2 no GPU can run the unsharded step, so the planner's micro-batch comes from the
estimator (:func:`tightfit.planner.sharding.fsdp_micro_batch`), and an OOM during training
stops every rank (FSDP2's collectives run in every pass). So on CUDA each rank first runs two
full steps (forward, backward, gradient reduce-scatter, AdamW, whose moments the first allocates
and the second holds throughout) on the worst-case micro-batch (every sample padded to the full
sequence length) at learning rate 0, which leaves the weights as they were, and their peak
reserved memory must stay within the planner's headroom; the optimizer state, gradients and RNG states are
then put back as before. The ranks agree (one all-reduce per attempt) on whether any ran out
of memory (or past the headroom); if one did, all take a fifth less and try again.

Ranks of one run hold the same shapes, so they run out of memory at the same allocation and
reach the agreement together; an OOM on one rank alone, inside a collective, would leave the
others waiting until the process group's timeout (torchrun then stops them all).
"""

from __future__ import annotations

import torch

from ..errors import TightfitError
from ..memory.oom import is_oom, release_memory
from ..rng import capture_rng, restore_rng
from ..buffers import KeptBuffers
from ..step import train_mode, training_step
from .margins import planned_limit


PROBE_STEPS = 2  # the second runs its forward and backward with AdamW's moments in place, as every later step


def _attempt(trainer, micro_batch: int) -> bool:
    """:data:`PROBE_STEPS` learning-rate-0 steps of ``micro_batch`` worst-case samples; whether
    they ran out of memory or, on a GPU, their peak reserved memory passed the planner's limit
    (:func:`tightfit.planner.margins.planned_limit` of the plan's budget: fragmentation grows
    over the next steps; on 2 H200s at 4 GiB each, BERT-large at micro-batch 128 peaked at 3.27 GiB
    in its first step, 3.98 GiB from the second on, and ran out of memory at the sixth,
    bench/results/multi-gpu-2)."""
    batch = {k: v.to(trainer.device) for k, v in trainer.w.train.worst_case(micro_batch).items()}
    cuda = trainer.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(trainer.device)
    try:
        # as the training steps run (dropout on); BatchNorm's statistics left as they were
        with train_mode(trainer.model), KeptBuffers(trainer.model.modules()):
            for _ in range(PROBE_STEPS):
                training_step(trainer.model, [batch], trainer.w.loss_sum, float(trainer.w.count(batch) or 1),
                              trainer.optimizer, trainer.scaler, trainer._autocast, trainer.cfg.max_grad_norm)
    except Exception as e:  # only OOMs are handled; anything else propagates
        if not is_oom(e):
            raise
        return True
    budget = trainer.plan.budget_bytes
    return bool(cuda and budget and torch.cuda.max_memory_reserved(trainer.device) > planned_limit(budget))


def verify_micro_batch(trainer) -> int:
    """Run the probe step on every rank of ``trainer`` (a :class:`tightfit.runtime.trainer.Trainer`
    under FSDP2, before :meth:`fit`; a collective: every rank calls it) and set its micro-batch to
    the largest that ran on all ranks, a fifth less at each try from the planned one.

    Returns:
        The micro-batch in force (samples per rank).

    Raises:
        TightfitError: a micro-batch of 1 runs out of memory.
    """
    world, opt = trainer.world, trainer.optimizer
    rng = capture_rng()
    lrs = [g["lr"] for g in opt.param_groups]
    scaler = trainer.scaler.state_dict() if trainer.scaler.is_enabled() else None
    mb = trainer.micro_batch
    while True:
        for g in opt.param_groups:  # AdamW at lr 0: p * (1 - 0 * wd) - 0 * update == p
            g["lr"] = 0.0
        failed = False
        try:
            failed = _attempt(trainer, mb)
        finally:
            if failed:  # before zero_grad: ending the failed pass may reduce gradients
                world.reshard(trainer.model)
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            opt.state.clear()  # the first real step allocates it again, as without the probe
            if scaler is not None:
                trainer.scaler.load_state_dict(scaler)
            restore_rng(rng)
        if failed:
            release_memory()
        if world.all_sum([float(failed)])[0] == 0:
            break
        if mb == 1:
            if trainer.plan.sharding == "fsdp-offload" and not world.distributed:
                raise TightfitError("micro-batch 1 runs out of memory with parameter offload in the probe step: "
                                    "a larger budget, --checkpointing on, or a shorter --seq-len")
            raise TightfitError("micro-batch 1 runs out of memory under FSDP2 in the probe step: use more GPUs, "
                                "a larger budget or --checkpointing on")
        mb = max(1, min(mb - 1, mb * 4 // 5))  # a fifth less: under parameter offload each micro-batch more
        # of a window costs a pass over the host gradients, so halving would give away too much
    trainer.micro_batch = trainer._used_micro_batch = mb
    return mb
