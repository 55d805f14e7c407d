"""Activation offload: the tensors a block saves for backward are copied to pinned host memory
during the forward and copied back when backward needs them, so the GPU holds none of them
in between.

A ``torch.autograd.graph.saved_tensors_hooks`` pair, as ``torch.autograd.graph.save_on_cpu``
(which it follows) but keeping parameters and small tensors on the GPU (a weight's copy
would cost transfer time and free no memory) and copying to the host on a side stream, so
the device-to-host copies overlap the forward's compute (torchtune's ``OffloadActivations``
does the same). Gradients are exact: the values come back bit for bit.

Memory is freed in stream order, so that the caching allocator's reserved memory depends on
the order of the step's allocations only, not on how far the CPU runs ahead of the GPU: each
saved tensor stays referenced (a "stash", as torchtune's ``max_fwd_stash_size``) until
:data:`STASH_TENSORS` later tensors have been packed; then the compute stream waits for its
copy's event and the reference is dropped, so the allocator may reuse its memory at once for
work queued after that wait. The rest of the stash is released in the same way when backward
unpacks its first offloaded tensor. (``Tensor.record_stream`` instead, as this module first
did, makes a freed block reusable only once the allocator sees its event complete at a later
``malloc``: with the CPU ahead of the GPU, blocks of copies still queued pile up beside the
new allocations and peak reserved memory exceeded the trace's by 7-34% on an H200,
bench/results/block-policies/.) When the copies are slower than the forward, the forward
waits for them, which the planner's time model already assumes.

On the meta device (the estimator's trace) nothing is copied: the saved tensor is stashed
and dropped as on the GPU, and an empty tensor of its size is allocated in backward, where the
host-to-device copy would allocate it; the bytes offloaded are counted in ``bytes_offloaded``.
"""

from __future__ import annotations

from collections import deque

import torch
from torch.utils._python_dispatch import _disable_current_modes

# Saved tensors below this size stay on the GPU (the copy's launch cost exceeds the memory won).
MIN_OFFLOAD_BYTES = 1 << 20

# Saved tensors kept alive on the device while their copies to the host may run: the copy of
# a tensor overlaps the compute that produces the next ones (torchtune's default stash size).
STASH_TENSORS = 5


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it live in pinned host memory.

    Args:
        min_bytes: saved tensors smaller than this stay where they are (None:
            :data:`MIN_OFFLOAD_BYTES`).

    Attributes:
        bytes_offloaded: bytes copied to the host (on the meta device: that would be), so far.
    """

    _streams: dict = {}  # one side stream per CUDA device, shared by every block
    _stash: dict = {}  # device -> deque of (saved tensor, its copy's event or None on meta)

    def __init__(self, min_bytes: int | None = None):
        self.min_bytes = MIN_OFFLOAD_BYTES if min_bytes is None else min_bytes
        self.bytes_offloaded = 0
        super().__init__(self._pack, self._unpack)

    def _offloads(self, t: torch.Tensor) -> bool:
        base = t if t._base is None else t._base  # a linear layer saves ``weight.t()``, a view
        return (t.device.type in ("cuda", "meta") and not isinstance(base, torch.nn.Parameter)
                and t.layout == torch.strided and min(t.untyped_storage().nbytes(),
                                                     t.numel() * t.element_size()) >= self.min_bytes)

    def _pack(self, t: torch.Tensor):
        if not self._offloads(t):
            return t
        self.bytes_offloaded += t.numel() * t.element_size()
        stash = HostOffload._stash.setdefault(t.device, deque())
        _release(stash, STASH_TENSORS - 1)  # room for t
        if t.device.type == "meta":
            with _disable_current_modes():  # a shape record, not a device allocation
                host = torch.empty(t.size(), dtype=t.dtype, device="meta")
            stash.append((t, None))
            return (t.device, host, None)
        stream = HostOffload._streams.setdefault(t.device, torch.cuda.Stream(t.device))
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)  # dense, as save_on_cpu
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by now
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        event = stream.record_event()
        stash.append((t, event))  # t's memory is not reused before the copy has read it
        return (t.device, host, event)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, event = packed
        HostOffload.release(device)  # backward has begun: the forward's last copies are waited for
        if device.type == "meta":  # the host-to-device copy's allocation
            return torch.empty(host.size(), dtype=host.dtype, device="meta")
        torch.cuda.current_stream(device).wait_event(event)  # the host copy is complete
        return host.to(device, non_blocking=True)

    @staticmethod
    def release(device: torch.device | None = None) -> None:
        """Drop the stashed saved tensors of ``device`` (None: of every device), the compute
        stream waiting first for their copies to the host. Called by the first unpack of a
        backward; call it after a forward that has no backward (an out-of-memory error) to
        free their memory at once instead of at the next offloaded forward."""
        for key in list(HostOffload._stash) if device is None else [device]:
            _release(HostOffload._stash.get(key, ()), 0)


def _release(stash: deque, keep: int) -> None:
    """Drop the oldest stashed tensors until ``keep`` remain, the current stream of each one's
    device waiting for its copy's event first (stream-ordered reuse of its memory)."""
    while len(stash) > keep:
        t, event = stash.popleft()
        if event is not None:
            torch.cuda.current_stream(t.device).wait_event(event)
