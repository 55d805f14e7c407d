"""Recognise out-of-memory errors, and release what a failed attempt held.

Only out-of-memory errors are recognised: ``torch.OutOfMemoryError`` (the caching allocator's,
also raised under ``set_per_process_memory_fraction``) and the RuntimeError texts that cuBLAS,
cuDNN and the CUDA runtime give when an allocation inside a library fails.
"""

from __future__ import annotations

import gc

import torch

OOM_MESSAGES = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
    "CUDA error: out of memory",
)


def is_oom(exc: BaseException) -> bool:
    """True if ``exc`` is an out-of-memory error (by type or by a library's known message)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)


def release_memory() -> None:
    """Free the memory a failed attempt held: collect its garbage, then return the caching
    allocator's free blocks to the driver so the retry starts unfragmented.
    Call it outside the ``except`` block, once the traceback (and the frames it keeps) is gone."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
