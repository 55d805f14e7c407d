"""Python's garbage collector, kept off the training loop's critical path.

A training step allocates thousands of short-lived Python objects (tensor wrappers, autograd
nodes' Python handles), so CPython's automatic collections run every few steps and, now and
then, walk every tracked object the process holds: the model's modules, the tokenised dataset.
On a host-bound step (a small model on a fast GPU) that is host time the GPU waits for. As
torchtitan does (``components/gc``), the loop collects once up front, moves what survives into
the permanent generation (:func:`gc.freeze`: the model and the data are never walked again),
turns automatic collection off and collects the young generations every ``every`` steps.
"""

from __future__ import annotations

import contextlib
import gc

EVERY = 50  # steps between two collections of the young generations (torchtitan's default)


class PausedCollector:
    """Call :meth:`step` after each training step; see the module doc.

    Args:
        every: steps between two ``gc.collect(1)`` calls.
    """

    def __init__(self, every: int = EVERY):
        self.every, self._steps = every, 0

    def step(self) -> None:
        self._steps += 1
        if self._steps % self.every == 0:
            gc.collect(1)


@contextlib.contextmanager
def collector_paused(every: int = EVERY):
    """Within the block, Python's automatic garbage collection is off and the objects alive at
    its start are frozen (:func:`gc.freeze`); yields a :class:`PausedCollector` whose ``step()``
    collects the young generations every ``every`` calls. Afterwards the objects are unfrozen and
    automatic collection is back as it was. If the collector was off already (the caller manages
    it), nothing is changed and ``step()`` does nothing."""
    if not gc.isenabled():
        yield PausedCollector(every=2**62)
        return
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield PausedCollector(every)
    finally:
        gc.unfreeze()
        gc.enable()
