"""Checkpoints off the training loop's critical path.

At a step boundary the loop only copies the state into host memory
(:func:`~tightfit.runtime.checkpoint.take_snapshot`: device-to-host copies into reused pinned
buffers, in stream order); a single background thread then serialises, fsyncs and hashes it
and renames the folder into place (:func:`~tightfit.runtime.checkpoint.write_snapshot`, manifest
last), so a crash or kill at any moment leaves either the whole checkpoint or none; then it
records the run's checkpoint times including that write beside it
(:func:`~tightfit.runtime.checkpoint.write_checkpoint_times`). One write
is in flight at a time: the next save waits for the previous one, which bounds the host memory
to one copy of the weights and the state. :meth:`CheckpointWriter.flush` waits for the write in
flight and re-raises its error; the trainer calls it at every stop (end of training, a signal,
non-finite steps, an error), so a run never ends with a checkpoint half-written.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .checkpoint import (_HostBuffers, check_finite, frozen_entries, take_snapshot, write_checkpoint_times,
                         write_failure, write_snapshot)


class CheckpointWriter:
    """Writes checkpoints in the background, one at a time.

    Args:
        folder: where ``ckpt-<step>`` folders go; ``keep_last``: newest checkpoints kept.
        background: False writes on the calling thread (same files).
        carried: seconds ``(held, writing)`` of the run's checkpoints before this writer's (an
            earlier session's, from the checkpoint resumed), added to the times each checkpoint
            records beside it.

    Attributes:
        blocked_seconds: time the caller spent in :meth:`save` and :meth:`flush` (the snapshot,
            and waiting for the previous write), a wait that held no training left out.
        write_seconds: time the writer spent writing and hashing.
        host_bytes: host memory held by the snapshot buffers (one copy of the weights and the
            state, reused by every checkpoint).
        last_hold: seconds the last :meth:`save` took for its snapshot alone (not waiting for
            the previous write); None before the first.
    """

    def __init__(self, folder: str | Path, keep_last: int = 2, background: bool = True,
                 carried: tuple[float, float] = (0.0, 0.0)):
        self.folder, self.keep_last, self.carried = Path(folder), keep_last, carried
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tightfit-checkpoint") if background else None
        self._pending: Future | None = None
        self._buffers = _HostBuffers()
        self.blocked_seconds = self.write_seconds = 0.0
        self.host_bytes = 0
        self.last_hold: float | None = None

    @property
    def busy(self) -> bool:
        """Whether a background write is still in flight (a :meth:`save` now would wait for it)."""
        return self._pending is not None and not self._pending.done()

    def save(self, step: int, model: torch.nn.Module, state: dict, abandoned=(), last: bool = False) -> Path:
        """Snapshot ``model`` and ``state`` now and write them as ``ckpt-<step>`` (in the
        background unless built otherwise), then prune (``abandoned``: as
        :func:`~tightfit.runtime.checkpoint.prune_checkpoints` takes it). Returns the folder the
        checkpoint will have.

        Args:
            last: no step will change ``model`` or ``state``'s tensors until :meth:`flush` (the
                end of training): only the finite check runs now, and the model's buffers are
                cloned on their device (the evaluation that follows may write one,
                :func:`~tightfit.runtime.checkpoint.frozen_entries`); the writer thread copies them
                itself, into the earlier snapshots' buffers where there are, else into pageable
                host memory. A run's first snapshot spends most of its time
                pinning its buffers (0.22 s of the main job's 0.23 s, NVIDIA H100 host,
                bench/results/checkpoint-schedule), which the end of training need not pay.

        Raises:
            NonFiniteCheckpointError: a parameter holds inf/NaN (nothing is written).
            CheckpointWriteError: this or the previous background write failed (its checkpoint is
                not in place; the earlier ones are).
        """
        t0 = time.perf_counter()
        try:
            self._wait()  # its buffers are reused by this snapshot
            t_snap = time.perf_counter()
            if last and self._pool is not None:
                check_finite(model)
                entries = frozen_entries(model)  # as the last step left them, whatever the evaluation writes
                ready = None
                if any(p.is_cuda for p in model.parameters()):
                    ready = torch.cuda.Event()
                    ready.record()  # the last step's updates are queued before it
                self.last_hold = time.perf_counter() - t_snap
                held = self.blocked_seconds + time.perf_counter() - t0
                self._pending = self._pool.submit(self._copy_and_write, step, model, entries, state, ready,
                                                  frozenset(abandoned), held)
                return self.folder / f"ckpt-{step}"
            snap = take_snapshot(model, state, self._buffers)
            self.last_hold = time.perf_counter() - t_snap
            self.host_bytes = max(self.host_bytes, snap.nbytes)
            held = self.blocked_seconds + time.perf_counter() - t0  # up to this snapshot, for the write's record
            if self._pool is None:
                self._write(step, snap, abandoned, held)
            else:
                self._pending = self._pool.submit(self._write, step, snap, frozenset(abandoned), held)
        finally:
            self.blocked_seconds += time.perf_counter() - t0
        return self.folder / f"ckpt-{step}"

    def _copy_and_write(self, step: int, model: torch.nn.Module, entries: dict, state: dict, ready, abandoned,
                        held: float) -> Path:
        """:meth:`save` with ``last``, on the writer thread: the copies, then the write."""
        if ready is not None:
            ready.synchronize()
        # into the buffers of earlier snapshots where there are (the previous write is done: save
        # waited for it), so that checkpointing still holds one host copy of the state at most
        snap = take_snapshot(model, state, self._buffers, pin=False, check=False, entries=entries)  # checked by save
        self.host_bytes = max(self.host_bytes, snap.nbytes)
        return self._write(step, snap, abandoned, held)

    def _write(self, step: int, snap, abandoned=(), held: float = 0.0) -> Path:
        t0 = time.perf_counter()
        try:
            path = write_snapshot(self.folder, step, snap, self.keep_last, abandoned)
        except Exception as e:  # e.g. the disk full: its temporary folder is gone, the others untouched
            failure = write_failure(e, step, self.folder)
            if failure is None:
                raise
            raise failure from e
        finally:
            self.write_seconds += time.perf_counter() - t0
        # its state's counters were taken before this write: a resume from it reads these instead
        with contextlib.suppress(OSError):  # whole without them (its state's stand); a full disk fails the next write
            write_checkpoint_times(path, self.carried[0] + held, self.carried[1] + self.write_seconds)
        return path

    def flush(self, holds_loop: bool = True) -> None:
        """Wait for the write in flight; re-raise its error (raised once). ``holds_loop`` False:
        the wait holds no training (after the evaluation that followed it): not counted in
        :attr:`blocked_seconds`."""
        t0 = time.perf_counter()
        try:
            self._wait()
        finally:
            if holds_loop:
                self.blocked_seconds += time.perf_counter() - t0

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """:meth:`flush`, then stop the writer thread."""
        try:
            self.flush()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
