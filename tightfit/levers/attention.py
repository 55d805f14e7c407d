"""Attention kernels for a run whose batch shapes vary: without cuDNN's.

PyTorch (2.10 and later, with the cuDNN >= 9.15 its CUDA 13 wheels ship) runs
``scaled_dot_product_attention`` with cuDNN's kernels first on sm90 and sm100 cards (Hopper and
Blackwell datacenter GPUs; ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``,
``check_prefer_cudnn_attention``). cuDNN builds an execution graph for each problem shape it meets
(batch, heads, sequence lengths, strides; ``aten/src/ATen/native/cudnn/MHA.cpp`` caches one per
shape), tens of milliseconds of host time for the forward and the backward. A ``tightfit train``
text run pads each micro-batch to its longest sample (a multiple of 8): it meets a new shape at
each new length and at each epoch's short last micro-batch, and pays those builds in eager steps
that CUDA graphs cannot replay yet. Without cuDNN, attention takes the flash or memory-efficient
kernel, which build nothing per shape.

Measured side by side on one NVIDIA H100 (the main job, ``tightfit train --full --budget 4GiB``,
memory capped at 4 GiB, two runs each, ``bench/results/attention-kernels/``): with cuDNN's kernels
the whole run trained at 7,666-7,829 samples/s against a steady 10,041-10,049 (0.76-0.78), its
eager steps at new shapes 115-175 ms; without them at 9,206-9,208 against a steady 10,471-10,474
(0.88), the steady step itself 4% faster, planning 0.88-0.89 s instead of 1.06-1.18 s. (Those runs set
the flag before ``tightfit.api.train``, as this module now does inside it.)

Runs of fixed shapes (images, the bench's worst-case batches) keep PyTorch's choice: there
cuDNN's graphs are built once and its kernels may be the faster.
"""

from __future__ import annotations

import contextlib
import threading

import torch

_LOCK = threading.Lock()
_STATE = {"inside": 0, "found": True}  # blocks inside; the setting the first found, put back by the last


@contextlib.contextmanager
def without_cudnn_attention(active: bool = True):
    """Within the block, ``scaled_dot_product_attention`` takes no cuDNN kernel; ``active`` False:
    nothing changes. The setting (``torch.backends.cuda.enable_cudnn_sdp``) is the process's, not the
    thread's: overlapping blocks (two ``tightfit.api.train`` calls in threads) count, the first turns
    it off and the last to leave puts back what the first found, and any run in the process meanwhile
    (an image run too) takes no cuDNN attention kernel. The backward of an attention call runs the
    kernel its forward chose, so only the forwards (and CUDA graph captures) need to be inside."""
    if not active:
        yield
        return
    with _LOCK:
        if _STATE["inside"] == 0:
            _STATE["found"] = torch.backends.cuda.cudnn_sdp_enabled()
            torch.backends.cuda.enable_cudnn_sdp(False)
        _STATE["inside"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["inside"] -= 1
            if _STATE["inside"] == 0:
                torch.backends.cuda.enable_cudnn_sdp(_STATE["found"])
