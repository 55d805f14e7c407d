"""The planner's safety margins: which one applies where, and why. Every margin the planner
applies is defined here and applied by one function.

A plan must still fit when the run differs from what the planner saw. Three things can differ,
and each has its own margin, applied once to the quantity it protects:

1. **Memory outside tensors** -- the CUDA context, library handles, other processes.
   :meth:`tightfit.devices.DeviceProfile.budget_bytes` takes it off the card's memory
   (``CUDA_CONTEXT_BYTES`` and ``SAFETY_MARGIN`` in :mod:`tightfit.devices`) when the budget
   comes from the card; a budget the user gives (``--budget 4GiB``) is taken as it is.
2. **The run's own growth** -- fragmentation that grows over the first steps, real batches
   that differ from the traced or probed one. :data:`HEADROOM` of the budget stays free at the
   step's peak: :func:`planned_limit` is what any peak is compared with, whether it is
   *predicted* (the search, :mod:`.search`) or *measured* (a probe step on the GPU,
   :mod:`.probe`). The two are never applied to one number: on a GPU the search's predictions
   are only a ranking, and the measured probe alone decides what fits.
3. **The estimator's error** -- a prediction made without a GPU has no probe to catch it. The
   estimator under-predicts the reserved memory of checkpointed steps by up to 4.9% on the
   NVIDIA H200 expandable-segment fixture (docs/memory-estimator.md), so such a prediction
   carries :data:`CHECKPOINTED_RESERVED_MARGIN` on its reserved bytes
   (:func:`estimator_margin_bytes`, used by :func:`tightfit.planner.search.estimator_for`).
   Plans that a GPU verifies (:func:`tightfit.planner.gpu.plan_on_gpu`) predict with 0 here.

What stacks, on purpose: a checkpointed plan made without a GPU for a card's own budget passes
all three -- ``1.05 x predicted reserved <= 0.95 x budget``, the budget being
``0.95 x (card - context)`` -- about 86% of the card's memory less the context for the
predicted peak. Each covers a different risk (non-tensor memory, run-time growth, estimator
error), so they multiply rather than overlap; planned plans were kept exactly as they were
when the margins were gathered here (bench/plan_snapshot.sh).
"""

from __future__ import annotations

# Share of the budget kept free at the step's peak (predicted or measured), see the module doc.
HEADROOM = 0.05
# Share added to the predicted reserved bytes of a checkpointed step planned without a GPU.
CHECKPOINTED_RESERVED_MARGIN = 0.05


def planned_limit(budget_bytes: int, headroom: float = HEADROOM) -> float:
    """The bytes a step's peak reserved memory may reach: ``budget_bytes x (1 - headroom)``.

    Args:
        budget_bytes: what the process may hold in tensors, bytes.
        headroom: share of the budget kept free (:data:`HEADROOM`).
    """
    return budget_bytes * (1 - headroom)


def estimator_margin_bytes(reserved_bytes: float, checkpointed: bool,
                          margin: float = CHECKPOINTED_RESERVED_MARGIN) -> int:
    """The extra bytes a prediction of ``reserved_bytes`` carries for the estimator's error: the
    ``margin`` share of it for a checkpointed step, 0 otherwise (and 0 with ``margin`` 0, when a
    GPU verifies the plan). Bytes in, bytes out (rounded down)."""
    return int(margin * reserved_bytes) if checkpointed else 0
