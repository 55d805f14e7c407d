"""Prefetch: prepare the next accumulation window while the current one trains.

Two overlaps (the articles' "CUDA streams" lever):
1. A background thread collates the next window's micro-batches and pins them in page-locked
   host memory, so a slow data pipeline runs while the GPU computes.
2. Each micro-batch is copied host-to-device on a side CUDA stream while the previous
   micro-batch computes; the compute stream waits on the copy's event before using it.

A pinned buffer is never reused: each batch gets its own, and it is released only after the
event of its copy has completed (DESIGN invariant 8). On the CPU both overlaps are off.
See the CUDA C++ Programming Guide, "Asynchronous Concurrent Execution", and PyTorch's
"CUDA semantics" notes on streams and ``Tensor.record_stream``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

Batch = dict[str, torch.Tensor]


def split_window(collate: Callable[[Sequence[int]], Batch], window: Sequence[int], micro_batch: int) -> list[Batch]:
    """Collate ``window`` into micro-batches of at most ``micro_batch`` samples (CPU tensors)."""
    return [collate(window[i:i + micro_batch]) for i in range(0, len(window), micro_batch)]


def _random_states() -> tuple:
    """The host's global random states that a data pipeline may draw from: torch's CPU
    generator, Python's ``random`` and NumPy's legacy global state (where NumPy is loaded)."""
    import random
    import sys

    numpy = sys.modules.get("numpy")
    state = numpy.random.get_state() if numpy is not None else None
    return (torch.random.get_rng_state(), random.getstate(),
            None if state is None else (state[0], state[1].tobytes(), *state[2:]))


def _same_states(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


class Prefetcher:
    """Collates upcoming windows in the background and stages micro-batches on the GPU.

    The first window is collated on the calling thread, watching the host's global random
    states (:func:`_random_states`): a collation that draws from them (random augmentation)
    turns the background thread off for the run, since draws on two threads interleave in an
    order that changes from run to run and across a resume (``random_collation`` then says so).
    A pipeline that draws only in later windows is not seen: give it its own generator.

    Args:
        collate: ``indices -> batch`` of CPU tensors.
        device: where batches go.
        enabled: False runs everything synchronously on the calling thread (same results).
    """

    def __init__(self, collate: Callable[[Sequence[int]], Batch], device: torch.device, enabled: bool = True):
        self.collate, self.device = collate, device
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.random_collation = False  # the first window's collation drew random numbers
        self._checked = not enabled  # the first window is collated on this thread, watched
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tightfit-prefetch") if enabled else None
        self._ahead: dict[int, tuple[int, Future]] = {}
        self._stream = torch.cuda.Stream(device) if (enabled and self.cuda) else None
        self._in_flight: list[tuple[torch.cuda.Event, Batch]] = []  # pinned sources of running copies

    def _prepare(self, window: Sequence[int], micro_batch: int) -> list[Batch]:
        micro = split_window(self.collate, window, micro_batch)
        if self.cuda and self.enabled:
            micro = [{k: v.pin_memory() for k, v in b.items()} for b in micro]
        return micro

    def schedule(self, key: int, window: Sequence[int], micro_batch: int) -> None:
        """Start collating ``window`` (identified by ``key``, e.g. its global step) in the background."""
        if self._pool is not None and self._checked and key not in self._ahead:
            self._ahead[key] = (micro_batch, self._pool.submit(self._prepare, list(window), micro_batch))

    def window(self, key: int, window: Sequence[int], micro_batch: int) -> list[Batch]:
        """The micro-batches of ``window``: the background result if it was made with this
        micro-batch, else collated now (e.g. after an OOM recovery changed the micro-batch)."""
        ahead = self._ahead.pop(key, None)
        for k in [k for k in self._ahead if k < key]:  # stale entries (never happens in order)
            self._ahead.pop(k)
        if ahead is not None and ahead[0] == micro_batch:
            return ahead[1].result()
        if self._checked:
            return self._prepare(window, micro_batch)
        before = _random_states()
        micro = self._prepare(window, micro_batch)
        self._checked = True
        if not _same_states(before, _random_states()):  # random collation: on this thread from now on
            self.random_collation = True
            self._pool.shutdown(wait=True)
            self._pool = None
        return micro

    def stage(self, batch: Batch):
        """Start the host-to-device copy of ``batch``; returns a handle for :meth:`ready`."""
        if self._stream is None:
            return {k: v.to(self.device, non_blocking=self.cuda) for k, v in batch.items()}, None
        self._release_finished()
        with torch.cuda.stream(self._stream):
            on_device = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            done = torch.cuda.Event()
            done.record(self._stream)
        self._in_flight.append((done, batch))
        return on_device, done

    def ready(self, handle) -> Batch:
        """Make the compute stream wait for the copy, and return the batch on the device."""
        on_device, done = handle
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for v in on_device.values():
                v.record_stream(current)  # the allocator must not reuse it until compute is done
        return on_device

    def _release_finished(self) -> None:
        self._in_flight = [(e, b) for e, b in self._in_flight if not e.query()]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._ahead.clear()
        if self._stream is not None:
            self._stream.synchronize()
        self._in_flight.clear()
