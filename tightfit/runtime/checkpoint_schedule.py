"""When the training loop checkpoints: every N steps, or by default as often as it costs little.

A checkpoint holds the loop for its snapshot (weights and optimizer state copied to host memory)
and, while the previous write is still going, for the rest of that write. On a fast step a fixed
grid costs much: the main job replaying CUDA graphs ran 100 steps in 0.32 s while a write took
0.4 s, and checkpoints every 100 steps held 0.69 s of its 5.6 s of training (12%; NVIDIA H100,
bench/results/cuda-graphs call 6).

``checkpoint_every=N`` keeps the grid: a checkpoint at every multiple of N. The default
(``None``) keeps the grid of :data:`AUTO_EVERY` steps but takes a checkpoint at a multiple of it
only where the previous write is done (the loop never waits for one) and the time checkpoints
have held the loop in this session, this one's predicted snapshot included, stays within
:data:`SHARE` of the session's training time so far. A run whose snapshot is costly against its
steps then checkpoints late or at its end only; one whose snapshot is small against 100 steps,
every 100 steps. Several processes keep the plain grid (every rank must checkpoint at the same
step, and their clocks differ), and so does a run whose checkpoints torch.distributed.checkpoint
writes in the loop. The end of training and every stop checkpoint regardless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

AUTO_EVERY = 100  # the default grid, in optimizer steps
SHARE = 0.02  # the default's bound on the training time checkpoints may hold the loop
# the first snapshot's rate before one is measured (bytes/s): it pins its host buffers, most of
# its time (a 21M-parameter model with AdamW state: 243 MiB in 0.22 s, of which 6 ms the copies,
# on an NVIDIA H100's host; bench/results/checkpoint-schedule)
FIRST_SNAPSHOT_BYTES_PER_S = 1e9


class CheckpointCosts(NamedTuple):
    """What the default weighs at a step of its grid.

    Attributes:
        seconds: training time of this session so far (s).
        held: time checkpoints held the loop in this session so far (s).
        next_hold: the predicted hold of this checkpoint's snapshot (s).
        writer_busy: the previous checkpoint is still being written.
    """

    seconds: float
    held: float
    next_hold: float
    writer_busy: bool


@dataclass
class CheckpointSchedule:
    """The steps at which the loop checkpoints (see the module's doc).

    Args:
        every: ``checkpoint_every``: steps between checkpoints; 0: at the end only; None: the
            default, at multiples of :data:`AUTO_EVERY` where cheap.
        plain_grid: the default keeps the plain grid: several processes train together, or
            torch.distributed.checkpoint writes in the loop (no background write to weigh).
    """

    every: int | None
    plain_grid: bool = False

    def __post_init__(self):
        self._decided: tuple[int, bool] | None = None  # (step, verdict): asked twice per boundary

    @property
    def grid(self) -> int:
        """Steps between the checkpoints the grid allows (0: none before the end)."""
        return AUTO_EVERY if self.every is None else self.every

    @property
    def adaptive(self) -> bool:
        """Whether a step of the grid may go without a checkpoint (the default on one process)."""
        return self.every is None and not self.plain_grid

    def due(self, step: int, costs: Callable[[], CheckpointCosts]) -> bool:
        """Whether the loop checkpoints after optimizer step ``step`` (the end of training aside,
        which always does); ``costs`` is asked only at a step of the grid, by the default. The
        verdict for a step is kept: the loop asks before it queues the next step and again at the
        boundary, with other clocks."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]
        verdict = bool(self.grid) and step % self.grid == 0
        if verdict and self.adaptive:
            c = costs()
            verdict = not c.writer_busy and c.held + c.next_hold <= SHARE * c.seconds
        self._decided = (step, verdict)
        return verdict


def first_hold_seconds(model, optimizer) -> float:
    """Predicted loop time (s) of a run's first snapshot: the bytes of ``model``'s state dict and
    ``optimizer``'s state (every plain tensor, those inside tensor subclasses too) at
    :data:`FIRST_SNAPSHOT_BYTES_PER_S`. Later snapshots are predicted by the last one measured."""
    from .state_tensors import map_tensors

    nbytes = 0

    def count(t):
        nonlocal nbytes
        nbytes += t.numel() * t.element_size()
        return t

    map_tensors([model.state_dict(), optimizer.state_dict()], count)
    return nbytes / FIRST_SNAPSHOT_BYTES_PER_S
