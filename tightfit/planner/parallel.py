"""Exact estimates traced side by side in worker processes.

An exact estimate (:func:`tightfit.memory.estimate`) is seconds of single-threaded Python (it
runs two training steps through the meta-tensor tracker), and the search asks for several whose
keys it knows in advance: the memory lines' ends (stage 1), the fastest candidates (stage 2) and
a bisection's next levels. :func:`trace_all` traces such a batch in forked workers, one estimate
each, so that with idle cores a batch could cost about one trace instead of one per key.

Workers are forked (``multiprocessing``'s ``fork`` start method), so the model and the estimate
function are inherited, never pickled; only the keys go out and the :class:`MemoryEstimate`
results come back. The estimate touches meta tensors only, never the GPU, so a parent that has
already initialised CUDA may fork (a child that called CUDA would fail; none does). An estimate
that raises in a worker is left out of the results, so that the caller's own call raises it
with its usual traceback; a pool that cannot start or breaks leaves everything to the caller.
Results are the same estimates the caller would trace (estimates are deterministic), only earlier.

The number of workers is :func:`plan_workers`: ``TIGHTFIT_PLAN_WORKERS`` (default 0: off). Off
by default because it has not paid where it matters: on the 16-core host of an NVIDIA H200 the
search took 0.86-1.29x its one-by-one time with 12 workers (``bench/results/plan-time-2/``), for
reasons not yet found, while on a 2-core host two workers traced two estimates 1.4-1.8x faster.
A pool that fails says so once (a warning of the ``tightfit.planner.parallel`` logger) and the search goes on in the calling process.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor

from ..errors import TightfitError

ENV = "TIGHTFIT_PLAN_WORKERS"
MAX_WORKERS = 16  # a search rarely knows more keys in advance

_FN: Callable | None = None  # the estimate function forked workers call (inherited at the fork)
_WARNED = False
_log = logging.getLogger(__name__)


def plan_workers() -> int:
    """Worker processes for :func:`trace_all` (0: trace in the calling process): the whole number
    in ``TIGHTFIT_PLAN_WORKERS`` (0 when unset, or where processes cannot be forked), at most
    :data:`MAX_WORKERS`.

    Raises:
        TightfitError: ``TIGHTFIT_PLAN_WORKERS`` is not a whole number >= 0.
    """
    value = (os.environ.get(ENV) or "").strip()
    if not value or "fork" not in multiprocessing.get_all_start_methods():
        return 0
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise TightfitError(f"{ENV}={value!r}: use a whole number of worker processes, 0 to trace "
                            f"estimates in the planning process")
    return min(n, MAX_WORKERS)


def _one_thread() -> None:
    """A worker's initializer: one intra-op thread, so that workers do not oversubscribe the cores."""
    import torch

    torch.set_num_threads(1)


def _call(key: tuple):
    """In a worker: the estimate of ``key`` = (precision, micro-batch, choice), or None if it raised."""
    try:
        return _FN(*key)
    except Exception:  # the caller traces it again and raises it itself
        return None


def trace_all(estimate_fn: Callable, keys: Iterable[tuple], workers: int | None = None) -> dict:
    """Trace ``keys`` (``(precision, micro_batch, choice)`` tuples for ``estimate_fn``) in up
    to ``workers`` forked processes (None: :func:`plan_workers`).

    Returns:
        ``key -> MemoryEstimate`` for the keys traced; empty when there are fewer than two keys
        or workers (the caller traces them itself, as it would have).

    Raises:
        TightfitError: as :func:`plan_workers`.
    """
    global _FN, _WARNED
    keys = list(dict.fromkeys(keys))
    workers = plan_workers() if workers is None else workers
    if workers < 2 or len(keys) < 2:
        return {}
    _FN = estimate_fn
    try:
        with warnings.catch_warnings():  # Python 3.12 warns on any fork of a threaded process
            warnings.simplefilter("ignore", DeprecationWarning)
            with ProcessPoolExecutor(min(workers, len(keys)), mp_context=multiprocessing.get_context("fork"),
                                     initializer=_one_thread) as pool:
                results = list(pool.map(_call, keys))
    except Exception as e:  # a pool that could not start or broke (a worker killed): trace in this process
        if not _WARNED:
            _WARNED = True
            _log.warning(f"warning: {ENV}: worker processes failed ({type(e).__name__}: {e}); tracing in the "
                         "planning process")  # logged: a Python caller silences it with the logging module
        return {}
    finally:
        _FN = None
    return {k: r for k, r in zip(keys, results) if r is not None}
