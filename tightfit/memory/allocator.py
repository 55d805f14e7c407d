"""Models of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), one
stream, no memory cap, no ``empty_cache``, in two configurations.

Common rules (both models):
- every request is rounded up to a multiple of 512 bytes (at least 512) (``round_size``);
- requests of at most 1 MiB are served from the *small* pool, larger ones from the *large* pool;
- a request first takes the smallest free cached block of its pool that fits (ties: lowest
  address) (``get_free_block``), which is split when the rest is large enough
  (``should_split``); a freed block merges with free neighbours (``free_block``);
- *allocated* bytes count whole blocks (``torch.cuda.memory_allocated``), *reserved* bytes the
  device memory held (``torch.cuda.memory_reserved``); without ``empty_cache`` reserved only grows.

Default allocator (:class:`CachingAllocatorModel`, no ``PYTORCH_CUDA_ALLOC_CONF``):
- a request no free block fits opens a new segment (one ``cudaMalloc``,
  ``get_allocation_size``): 2 MiB for the small pool; 20 MiB for 1-10 MiB requests; the request
  rounded up to 2 MiB for requests of 10 MiB or more;
- a block is split when the rest is >= 512 B (small pool) or > 1 MiB (large pool); otherwise the
  whole block is handed out and counts as allocated.

Expandable segments (:class:`ExpandableSegmentsModel`, ``expandable_segments:True``):
- each pool (of each stream) has one segment: a virtual address range (1 1/8 the card's memory,
  so it never runs out) whose physical pages are mapped from its start as needed
  (``ExpandableSegment::map``); page size 2 MiB (``kSmallBuffer``) for the small pool and 20 MiB
  (``kLargeBuffer``) for the large pool (``find_expandable_block``);
- a request no free block fits is placed at the end of the mapped range, starting in the free
  block there if the last block is free, and the pages it lacks are mapped, rounded up to whole
  pages (``try_allocate_expandable_block``, ``map_block``): reserved = mapped pages, which is
  the segment's high-water mark rounded up to a page;
- any block is split when the rest is >= 512 B (``should_split`` with expandable segments), so a
  block occupies exactly its rounded request;
- in best fit, the free block at the end of the mapped range counts as unbounded (it can grow
  into unmapped pages), so another fitting block is preferred to it (``get_free_block``,
  ``expandable_size``);
- pages are unmapped only by ``empty_cache`` or an out-of-memory retry, neither modelled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20

#: The environment variables PyTorch's CUDA allocator reads its configuration from (torch >= 2.9
#: reads the second too); the runtime sets the first (:mod:`tightfit.runtime.allocator`).
ALLOC_CONF, ALLOC_CONF_ANY_DEVICE = "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"

#: Allocator configurations modelled: ``"expandable"`` (``expandable_segments:True``, what
#: tightfit's runtime sets) and ``"default"`` (no ``PYTORCH_CUDA_ALLOC_CONF``).
ALLOCATORS = ("expandable", "default")


def round_size(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` occupies: a multiple of 512, at least 512."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """Default allocator: bytes of the segment (one ``cudaMalloc``) opened for a rounded request of ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def page_size(size: int) -> int:
    """Expandable segments: bytes of one mapped page of the pool serving a rounded request of ``size``."""
    return SMALL_BUFFER if size <= SMALL_SIZE else LARGE_BUFFER


@dataclass(eq=False, slots=True)  # slots: made and read hundreds of thousands of times a plan
class Block:
    """A piece of a segment: ``[addr, addr + size)`` bytes, free or allocated."""

    addr: int
    size: int
    small: bool
    free: bool = True
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)


class _AllocatorBase:
    """Bookkeeping shared by both models: free lists per pool (sorted ``(size, addr, block)``),
    splitting, merging and the byte counters.

    Attributes:
        allocated, reserved: current bytes.
        peak_allocated, peak_reserved: maxima since construction (bytes).
    """

    def __init__(self):
        self._pools = {True: [], False: []}  # small? -> sorted [(size, addr, block)]
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def _best_fit(self, nbytes: int):
        """``(rounded size, small pool?, that pool's free list, index of its smallest free block
        that fits -- len(pool) if none)``; free lists are sorted by (size, address)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        return size, small, pool, bisect.bisect_left(pool, (size, -1))

    def _map(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _split(self, block: Block, size: int) -> None:
        """Cut ``block`` to ``size`` bytes; the rest becomes a free block after it."""
        tail = Block(block.addr + size, block.size - size, block.small, True, block, block.next)
        if block.next is not None:
            block.next.prev = tail
        block.next, block.size = tail, size
        bisect.insort(self._pools[block.small], (tail.size, tail.addr, tail))

    def _hand_out(self, block: Block) -> Block:
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> Block:
        """Return ``block`` to its pool, merged with free neighbours; returns the merged free block."""
        self.allocated -= block.size
        block.free = True
        pool = self._pools[block.small]
        for nb in (block.prev, block.next):
            if nb is not None and nb.free:
                pool.pop(bisect.bisect_left(pool, (nb.size, nb.addr)))
                if nb is block.prev:
                    nb.size += block.size
                    nb.next = block.next
                    if block.next is not None:
                        block.next.prev = nb
                    block = nb
                else:
                    block.size += nb.size
                    block.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = block
        bisect.insort(pool, (block.size, block.addr, block))
        return block


class CachingAllocatorModel(_AllocatorBase):
    """The default allocator (see the module doc): replays ``malloc``/``free`` and tracks
    allocated and reserved bytes and their peaks."""

    def __init__(self):
        super().__init__()
        self._next_addr = 0

    def malloc(self, nbytes: int) -> Block:
        """Allocate ``nbytes`` (>= 0); returns the block (its ``size`` is what it occupies)."""
        size, small, pool, i = self._best_fit(nbytes)
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            seg = segment_size(size)
            block = Block(self._next_addr, seg, small)
            self._next_addr += seg
            self._map(seg)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            self._split(block, size)
        return self._hand_out(block)


class ExpandableSegmentsModel(_AllocatorBase):
    """The allocator with ``expandable_segments:True`` (see the module doc): one growing segment
    per pool; replays ``malloc``/``free`` and tracks allocated and reserved bytes and their peaks.
    """

    def __init__(self):
        super().__init__()
        self._end = {True: 0, False: 0}  # mapped bytes of each pool's segment
        self._last: dict[bool, Block | None] = {True: None, False: None}  # block ending at _end

    def malloc(self, nbytes: int) -> Block:
        """Allocate ``nbytes`` (>= 0); returns the block (its ``size`` is the rounded request)."""
        size, small, pool, i = self._best_fit(nbytes)
        if i < len(pool):
            if pool[i][2] is self._last[small] and i + 1 < len(pool):
                i += 1  # the growable end block counts as unbounded: take the next fitting block
            block = pool.pop(i)[2]
        else:
            block = self._grow(size, small)
        if block.size - size >= MIN_BLOCK:
            self._split(block, size)
            if block is self._last[small]:
                self._last[small] = block.next
        return self._hand_out(block)

    def _grow(self, size: int, small: bool) -> Block:
        """Map whole pages at the segment's end so that a free block of >= ``size`` bytes ends there."""
        last = self._last[small]
        have = last.size if last is not None and last.free else 0
        page = page_size(size)
        grow = -(-(size - have) // page) * page
        if have:
            pool = self._pools[small]
            pool.pop(bisect.bisect_left(pool, (last.size, last.addr)))
            last.size += grow
            block = last
        else:
            block = Block(self._end[small], grow, small, True, last, None)
            if last is not None:
                last.next = block
            self._last[small] = block
        self._end[small] += grow
        self._map(grow)
        return block

    def free(self, block: Block) -> Block:
        merged = super().free(block)
        if merged.next is None:
            self._last[merged.small] = merged
        return merged


def make_allocator(kind: str = "expandable") -> _AllocatorBase:
    """A fresh allocator model: ``"expandable"`` or ``"default"`` (see :data:`ALLOCATORS`).

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind == "expandable":
        return ExpandableSegmentsModel()
    if kind == "default":
        return CachingAllocatorModel()
    raise ValueError(f"unknown allocator {kind!r}: use one of {', '.join(ALLOCATORS)}")
