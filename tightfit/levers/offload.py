"""Activation offload: the tensors a block saves for backward are copied to pinned host memory
during the forward and copied back when backward needs them, so the GPU holds none of them
in between.

A ``torch.autograd.graph.saved_tensors_hooks`` pair, as ``torch.autograd.graph.save_on_cpu``
(which it follows) but keeping parameters and small tensors on the GPU (a weight's copy
would cost transfer time and free no memory) and copying to the host on a side stream, so
the device-to-host copies overlap the forward's compute (torchtune's ``OffloadActivations``
does the same). Gradients are exact: the values come back bit for bit.

On the meta device (the estimator's trace) nothing is copied: the saved tensor is dropped
and an empty tensor of its size is allocated in backward, where the host-to-device copy
would allocate it; the bytes offloaded are counted in ``bytes_offloaded``.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

# Saved tensors below this size stay on the GPU (the copy's launch cost exceeds the memory won).
MIN_OFFLOAD_BYTES = 1 << 20


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it live in pinned host memory.

    Args:
        min_bytes: saved tensors smaller than this stay where they are (None:
            :data:`MIN_OFFLOAD_BYTES`).

    Attributes:
        bytes_offloaded: bytes copied to the host (on the meta device: that would be), so far.
    """

    _streams: dict = {}  # one side stream per CUDA device, shared by every block

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
        if t.device.type == "meta":
            with _disable_current_modes():  # a shape record, not a device allocation
                host = torch.empty(t.size(), dtype=t.dtype, device="meta")
            return ("meta", host, None)
        stream = HostOffload._streams.setdefault(t.device, torch.cuda.Stream(t.device))
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)  # dense, as save_on_cpu
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written by now
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(stream)  # its memory is not reused before the copy has read it
        event = stream.record_event()
        return (t.device, host, event)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, extra = packed
        if device == "meta":  # the host-to-device copy's allocation
            return torch.empty(host.size(), dtype=host.dtype, device="meta")
        torch.cuda.current_stream(device).wait_event(extra)  # the host copy is complete
        return host.to(device, non_blocking=True)
