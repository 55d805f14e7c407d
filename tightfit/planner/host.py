"""Training on the CPU: the micro-batch that fits the host's memory.

A CPU run has no budget to plan against, but a whole effective batch in one micro-batch can ask
for more memory than the machine has: `tightfit train --batch-size 2000` of the shipped MiniLM
held 24 GB and was killed by the kernel, with no message. So a large effective batch is split
into micro-batches whose predicted peak fits a share of the memory available now, with gradient
accumulation (the same samples per optimizer step, the same result up to summation order).
"""

from __future__ import annotations

from ..memory.fast import TRACED_AT, MemoryLine
from ..plan import Plan, balanced_micro_batch
from ..units import format_bytes

# The share of the host memory available at planning time that one step may hold: the rest is
# for the data, the evaluation, a checkpoint's copy and whatever else runs on the machine.
HOST_SHARE = 0.5


def host_micro_batch(workload, precision: str, checkpointing: bool,
                     available_bytes: int | None = None) -> tuple[int, str | None]:
    """The micro-batch of a CPU run: the whole effective batch where its predicted peak fits
    :data:`HOST_SHARE` of the available host memory, else the largest that does (balanced over
    the accumulation steps, at least 1), and the reason (None when the whole batch was estimated to fit).

    The peak is the memory estimator's allocated bytes (:func:`tightfit.memory.estimate` with
    ``host=True``: two training steps traced on meta tensors as the CPU runs them, AdamW's state
    included) at micro-batches 4 and 16
    (:data:`~tightfit.memory.fast.TRACED_AT`), extended as a line; an effective batch up to 16
    is not traced (no such batch of the models tightfit trains needs gigabytes).

    Args:
        workload: the :class:`~tightfit.workload.Workload` (its ``train.worst_case(n)`` batches).
        precision: the run's precision (``fp32`` on the CPU unless asked).
        checkpointing: every block checkpointed (``--checkpointing on``) or none.
        available_bytes: host memory available, bytes (None: ``MemAvailable`` now).

    Returns:
        ``(micro_batch, reason)``; a model whose step the estimator cannot trace, or that trains
        with a loss function of the user's own (a :class:`~tightfit.tasks.LossOnly` task, which
        the estimator does not model), keeps the whole batch, and the reason says so.
    """
    from ..levers.blocks import find_blocks
    from ..levers.optimizers import available_host_bytes
    from ..tasks import LossOnly
    from ..memory.estimate import estimate

    E = workload.effective_batch
    if E <= max(TRACED_AT):
        # no figure of the batch here: under several processes E is one process's share, which the plan's
        # own line gives beside the effective batch
        return E, (f"CPU: the whole effective batch in one micro-batch (batches of up to {max(TRACED_AT)} samples a "
                   "process are small enough not to estimate their host memory)")
    if isinstance(getattr(workload, "task", None), LossOnly):  # a loss of the user's own (tightfit.plan(loss=...))
        return E, ("CPU: the whole effective batch in one micro-batch; its host memory is not estimated: the "
                   "estimator traces a model's logits with its task's loss, not a loss function of your own")
    have = available_host_bytes() if available_bytes is None else available_bytes
    limit = HOST_SHARE * have
    blocks = tuple(range(len(find_blocks(workload.model)))) if checkpointing else ()
    example = workload.train.worst_case(1)

    def peak(m: int) -> int:  # a micro-batch of m, the window's gradients held as with accumulation
        return estimate(workload.model, example, Plan(precision, m, max(m, E), device="cpu"),
                        checkpoint_blocks=blocks, host=True).peak_allocated_bytes

    try:
        small, large = (peak(m) for m in TRACED_AT)
    except Exception as e:  # noqa: BLE001 - a model the meta-tensor tracer cannot run: the whole batch, as asked
        return E, (f"CPU: the whole effective batch in one micro-batch; its host memory could not be estimated "
                   f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    slope = (large - small) / (TRACED_AT[1] - TRACED_AT[0])
    line = MemoryLine(small - slope * TRACED_AT[0], slope)  # of allocated bytes: a host holds no cache
    whole = line.reserved(E)
    if whole <= limit:
        return E, None
    mb = balanced_micro_batch(E, max(1, line.largest_fitting(limit, E)))
    return mb, (f"CPU: micro-batch {mb} with gradient accumulation: the whole batch of {E} in one would need about "
                f"{format_bytes(whole)} of host memory, more than {int(HOST_SHARE * 100)}% of the "
                f"{format_bytes(have)} available")
