"""The accounting of a traced step, kept as a list of events that can be replayed.

:class:`~.tracker.AllocationTracker` turns what a traced step allocates and frees into calls on
a :class:`Ledger`: ``malloc`` and ``free`` of storages (numbered in the order they were
allocated), component labels, kernel scratch (:mod:`.scratch`), and the notes
:func:`~.estimate.estimate` reads (allocated bytes entering each block, phase peaks). The
ledger replays each call through the allocator models and keeps the totals per component at
the allocated peak. Given a ``log`` list, it also appends each call to it as a tuple
(:data:`EVENTS`), with the requested bytes before any rounding (the allocator models round);
:func:`replay` feeds such a log to a fresh ledger, which ends in the state the trace ended in,
without tracing -- :mod:`.replay` uses it to answer other micro-batches.
"""

from __future__ import annotations

from collections import Counter

from .allocator import make_allocator
from .scratch import DEFAULT_SM_COUNT, DEFAULT_THREADS_PER_SM, scratch_sizes

#: The log's events, by their first item: ``("m", bytes, label)`` a storage allocated (its number:
#: how many ``"m"`` came before it); ``("f", number)`` freed; ``("r", number, label)`` relabelled;
#: ``("a", old, new)`` every live block labelled ``old`` relabelled; ``("s", conv, reduction)``
#: a kernel's scratch (:func:`~.scratch.scratch_sizes` operands, bytes and element counts);
#: ``("w",)`` the window's peak restarted; ``("n", name)`` a note taken.
EVENTS = ("m", "f", "r", "a", "s", "w", "n")


class Ledger:
    """Allocator models fed one step's allocations, with per-component totals.

    Args:
        allocator: the model whose allocated peak sets ``peak_breakdown`` (default: expandable
            segments, :func:`~.allocator.make_allocator`).
        shadows: more allocator models fed the same ``malloc``/``free`` sequence.
        device: the GPU profile whose SM count sizes reduction staging buffers (None: an H200's).
        log: a list the calls are appended to (:data:`EVENTS`); None: not recorded.

    Attributes:
        allocator, shadows, log: as given.
        totals: live bytes per component (blocks as the allocator sizes them).
        peak_breakdown: ``totals`` when allocated memory last reached a new peak.
        window_peak: the most allocated bytes since :meth:`restart_window`.
        notes: name -> :meth:`note`'s record.
    """

    def __init__(self, allocator=None, shadows=(), device=None, log: list | None = None):
        self.sm_count = getattr(device, "sm_count", 0) or DEFAULT_SM_COUNT
        self.threads_per_sm = device.max_threads_per_sm if device is not None else DEFAULT_THREADS_PER_SM
        self.allocator = allocator or make_allocator()
        self.shadows = list(shadows)
        self.log = log
        self._live: dict[int, list] = {}  # number -> [block, label, shadow blocks]
        self._count = 0  # storages allocated so far (the next one's number)
        self.totals: Counter = Counter()
        self.peak_breakdown: dict[str, int] = {}
        self._peak = -1
        self.window_peak = 0
        self.notes: dict = {}

    def _note_peak(self) -> None:
        """After an allocation: update the window's peak and, at a new peak, the breakdown."""
        allocated = self.allocator.allocated
        if allocated > self.window_peak:
            self.window_peak = allocated
        if allocated > self._peak:
            self._peak = allocated
            self.peak_breakdown = dict(self.totals)

    def malloc(self, nbytes: int, label: str) -> int:
        """Allocate a storage of ``nbytes`` (> 0) labelled ``label``; returns its number."""
        if self.log is not None:
            self.log.append(("m", nbytes, label))
        block = self.allocator.malloc(nbytes)
        number = self._count
        self._count += 1
        self._live[number] = [block, label, [a.malloc(nbytes) for a in self.shadows]]
        self.totals[label] += block.size
        self._note_peak()
        return number

    def free(self, number: int) -> None:
        """Free storage ``number`` (no-op if it is not live)."""
        entry = self._live.pop(number, None)
        if entry is None:
            return
        if self.log is not None:
            self.log.append(("f", number))
        self.totals[entry[1]] -= entry[0].size
        self.allocator.free(entry[0])
        for a, b in zip(self.shadows, entry[2]):
            a.free(b)

    def relabel_storage(self, number: int, label: str, only_from: tuple[str, ...] | None = None) -> None:
        """Give live storage ``number`` the component ``label`` (only if its label is in
        ``only_from``, where given)."""
        entry = self._live.get(number)
        if entry is None or entry[1] == label or (only_from is not None and entry[1] not in only_from):
            return
        if self.log is not None:
            self.log.append(("r", number, label))
        self.totals[entry[1]] -= entry[0].size
        self.totals[label] += entry[0].size
        entry[1] = label

    def relabel_all(self, old: str, new: str) -> None:
        """Move every live block labelled ``old`` to ``new``."""
        if self.log is not None:
            self.log.append(("a", old, new))
        for entry in self._live.values():
            if entry[1] == old:
                entry[1] = new
        self.totals[new] += self.totals.pop(old, 0)

    def scratch(self, conv: tuple[int, ...], reduction: tuple[int, ...]) -> None:
        """A kernel's scratch (:func:`~.scratch.scratch_sizes` of these operands): held beside its
        outputs while it runs, freed (to the cache) when it returns; labelled temporaries."""
        if self.log is not None:
            self.log.append(("s", conv, reduction))
        ws = scratch_sizes(conv, reduction, self.sm_count, self.threads_per_sm)
        if not ws:
            return
        models = [self.allocator] + self.shadows
        blocks = [[a.malloc(n) for n in ws] for a in models]
        held = sum(b.size for b in blocks[0])
        self.totals["temporaries"] += held
        self._note_peak()
        self.totals["temporaries"] -= held
        for a, bs in zip(models, blocks):
            for b in reversed(bs):
                a.free(b)

    def restart_window(self) -> None:
        """Start a new phase: its peak so far is what is allocated now."""
        if self.log is not None:
            self.log.append(("w",))
        self.window_peak = self.allocator.allocated

    def note(self, name) -> None:
        """Record under ``name`` in ``notes``: ``(allocated, window_peak, per model (allocated,
        reserved, peak_allocated, peak_reserved))``, bytes, the main model first."""
        if self.log is not None:
            self.log.append(("n", name))
        self.notes[name] = (self.allocator.allocated, self.window_peak,
                            tuple((a.allocated, a.reserved, a.peak_allocated, a.peak_reserved)
                                  for a in [self.allocator] + self.shadows))


def replay(log: list, ledger: Ledger) -> Ledger:
    """Feed ``log`` (:data:`EVENTS`, as a traced step recorded them) to ``ledger`` (fresh, with
    the trace's allocator models and device); returns it.

    Raises:
        ValueError: an event that is not one of :data:`EVENTS`.
    """
    calls = {"m": ledger.malloc, "f": ledger.free, "r": ledger.relabel_storage, "a": ledger.relabel_all,
             "s": ledger.scratch, "w": ledger.restart_window, "n": ledger.note}
    for event in log:
        call = calls.get(event[0])
        if call is None:
            raise ValueError(f"unknown ledger event {event!r}")
        call(*event[1:])
    return ledger
