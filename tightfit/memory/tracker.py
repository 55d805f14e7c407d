"""Account every device allocation of a traced step: a torch-dispatch mode over meta tensors.

Each new storage produced by an aten op (what autograd, kernels and the optimizer allocate) is
replayed as a ``malloc`` through an allocator model (:mod:`.allocator`), and as a ``free``
when the storage dies (a weakref finaliser), so the order of allocations and frees is the
step's own. Storages are counted once however many views share them. Each live block carries a
component label; the totals per label are snapshot whenever allocated memory reaches a new peak.
Further allocator models (``shadows``) can replay the same sequence, so that one trace gives
the peaks under several allocator configurations. The accounting itself is the
:class:`~.ledger.Ledger`'s, which can also record it for a replay.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import meta_cache
from .ledger import Ledger
# the scratch models lived here; importers of this module still find them
from .scratch import (DEFAULT_SM_COUNT, DEFAULT_THREADS_PER_SM, SCRATCH_OPS,  # noqa: F401
                      convolution_operands, kernel_workspace_bytes, reduction_operands,
                      reduction_staging_bytes)

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
_SCRATCH_IDS = frozenset(id(op) for op in SCRATCH_OPS)  # an OpOverload's hash is a Python call


class _StorageRef(weakref.ref):
    """A weak reference to a tracked storage that remembers its key in ``_storages`` (cheaper to
    make than ``weakref.finalize``, and called at the same moment: when the storage dies)."""

    __slots__ = ("key",)


def _leaves(out):
    """What an aten op returned, flat (torch's pytree only for nested results: it is slower)."""
    if type(out) is torch.Tensor:
        return (out,)
    if type(out) in (tuple, list) and not any(type(t) in (tuple, list, dict) for t in out):
        return out
    return tree_leaves(out)


class AllocationTracker(Ledger, TorchDispatchMode):
    """Replays a meta-device trace through the allocator model: a :class:`~.ledger.Ledger` fed
    by a torch-dispatch mode.

    Args:
        allocator: the allocator model whose allocated peak sets ``peak_breakdown``
            (default: expandable segments, :func:`~.allocator.make_allocator`).
        shadows: more allocator models fed the same ``malloc``/``free`` sequence.
        device: the GPU profile whose SM count sizes reduction staging buffers (None: an H200's).
        log: a list the ledger's calls are appended to (:data:`~.ledger.EVENTS`); None: not recorded.

    Attributes:
        allocator, shadows: as given.
        label: component given to new allocations (``"temporaries"`` unless set).
        peak_breakdown: bytes per component when allocated memory last reached its peak.
        window_peak: the most allocated bytes since :meth:`~.ledger.Ledger.restart_window`.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: torch wraps a mode's __torch_dispatch__ in a dynamo-disabling frame (for
        # torch.compile inside a mode) at ~10 us an op, a tenth of a trace; a meta trace compiles nothing
        return False

    def __init__(self, allocator=None, shadows=(), device=None, log: list | None = None):
        TorchDispatchMode.__init__(self)
        Ledger.__init__(self, allocator, shadows, device, log)
        self.label = "temporaries"
        self._storages: dict[int, list] = {}  # id(storage) -> [ledger number, weak reference]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = meta_cache.call(func, args, kwargs)  # a repeated op's layouts without its meta kernel
        if type(out) is torch.Tensor:  # most ops: one tensor (no walk over the outputs)
            if out.is_meta:
                self.track(out)
        else:
            for t in _leaves(out):
                if isinstance(t, torch.Tensor) and t.is_meta:  # is_meta: a tenth of device.type's cost
                    self.track(t)
        if id(func) not in _SCRATCH_IDS:  # most ops: no kernel scratch (skips two calls per op)
            return out
        conv, reduction = convolution_operands(func, args, out), reduction_operands(func, args)
        if conv or reduction:  # held by the kernel beside its outputs, freed (to the cache) when it returns
            self.scratch(conv, reduction)
        return out

    def track(self, t: torch.Tensor, label: str | None = None) -> None:
        """Account ``t``'s storage once (no-op if already live or empty)."""
        st = t.untyped_storage()
        key = id(st)
        if key in self._storages:
            return
        nbytes = st.nbytes()
        if nbytes == 0:
            return
        ref = _StorageRef(st, self._storage_died)
        ref.key = key
        # the reference lives in the entry: the storage's death frees its blocks, as long as it is tracked
        self._storages[key] = [self.malloc(nbytes, label or self.label), ref]

    def relabel(self, t: torch.Tensor, label: str, only_from: tuple[str, ...] | None = None) -> None:
        """Give ``t``'s live storage the component ``label``."""
        entry = self._storages.get(id(t.untyped_storage()))
        if entry is not None:
            self.relabel_storage(entry[0], label, only_from)

    def live_bytes(self) -> int:
        return self.allocator.allocated

    def __enter__(self):
        self._interrupts = _interrupts_outside_callbacks()
        self._interrupts.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._interrupts.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            # the trace is over: its storages' weak references go, and with them their callbacks
            # (a Ctrl-C in one after the handler below is gone would be dropped; their frees would
            # only have lengthened the log past the step)
            self._storages.clear()
            self._interrupts.__exit__(None, None, None)

    def _storage_died(self, ref: _StorageRef) -> None:
        entry = self._storages.pop(ref.key, None)
        if entry is not None:
            self.free(entry[0])


@contextlib.contextmanager
def _interrupts_outside_callbacks():
    """Within the block (on the main thread, under Python's default SIGINT handler), a Ctrl-C that
    arrives while :meth:`AllocationTracker._storage_died` runs is raised just after it instead:
    Python prints and drops an exception raised in a weakref callback, and the command went on
    (``tightfit plan`` printed its plan and exited 0). Elsewhere it is raised at once, as usual."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return

    def handler(signum, frame):
        while frame is not None:
            if frame.f_code is _CALLBACK_CODE:  # again from another thread, once the callback has returned
                threading.Timer(0.001, _thread.interrupt_main).start()
                return
            frame = frame.f_back
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_CALLBACK_CODE = AllocationTracker._storage_died.__code__
