"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``), default
settings (no ``max_split_size_mb``, no expandable segments, one stream, no memory cap).

Rules reproduced:
- every request is rounded up to a multiple of 512 bytes (at least 512);
- requests of at most 1 MiB come from the *small* pool, packed into 2 MiB segments; larger
  ones from the *large* pool: 1-10 MiB requests open a 20 MiB segment, >= 10 MiB requests a
  segment of their size rounded up to 2 MiB;
- a request takes the smallest free cached block that fits (ties: lowest address), split when
  the rest is >= 512 B (small pool) or > 1 MiB (large pool), otherwise taken whole;
- freed blocks merge with free neighbours of the same segment; segments are never returned
  (``empty_cache`` is not modelled), so *reserved* memory only grows.

Allocated bytes count whole blocks (as ``torch.cuda.memory_allocated`` does); reserved bytes
count segments (``torch.cuda.memory_reserved``).
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


def round_size(nbytes: int) -> int:
    """Bytes a request of ``nbytes`` occupies: a multiple of 512, at least 512."""
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """Bytes of the segment (one ``cudaMalloc``) opened for a rounded request of ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class Block:
    """A piece of a segment: ``[addr, addr + size)``, free or allocated."""

    addr: int
    size: int
    small: bool
    free: bool = True
    prev: "Block | None" = field(default=None, repr=False)
    next: "Block | None" = field(default=None, repr=False)

    def key(self):
        return (self.size, self.addr)


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` and tracks allocated and reserved bytes and their peaks.

    Attributes:
        allocated, reserved: current bytes.
        peak_allocated, peak_reserved: maxima since construction.
    """

    def __init__(self):
        self._pools = {True: [], False: []}  # small?, sorted [(size, addr, block)]
        self._next_addr = 0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0

    def malloc(self, nbytes: int) -> Block:
        """Allocate ``nbytes`` (>= 0); returns the block (its ``size`` is what it occupies)."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            seg = segment_size(size)
            block = Block(self._next_addr, seg, small)
            self._next_addr += seg
            self.reserved += seg
            self.peak_reserved = max(self.peak_reserved, self.reserved)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = Block(block.addr + size, rest, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            bisect.insort(pool, (tail.size, tail.addr, tail))
        block.free = False
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return block

    def free(self, block: Block) -> None:
        """Return ``block`` to its pool, merged with free neighbours of its segment."""
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
