"""Recognise out-of-memory errors, and release what a failed attempt held.

Only out-of-memory errors are recognised: ``torch.OutOfMemoryError`` by type (the caching
allocator's, also under ``set_per_process_memory_fraction`` and the ``cudaMallocAsync`` backend),
and RuntimeErrors whose text holds one of the exact fragments in :data:`OOM_MESSAGES`: the
messages PyTorch 2.6 to 2.14 builds when an allocation fails in the CUDA driver (expandable
segments), the CUDA runtime, cuBLAS/cuBLASLt, cuDNN, cuFFT, cuSOLVER, cuSPARSE or the CPU
allocator. Anything else -- an illegal memory access, a library's internal error, Python's
``MemoryError`` -- is not an out-of-memory error here and propagates unchanged. ``docs/oom.md``
has the table of every message, where it comes from, and why it is or is not caught.
"""

from __future__ import annotations

import gc

import torch

# Exact fragments of out-of-memory messages (case-sensitive), each with where PyTorch builds it.
# docs/oom.md lists each one (a test keeps the two in step).
OOM_MESSAGES = (
    # c10/cuda/CUDACachingAllocator.cpp: the caching allocator's text, for when a wrapper
    # (the TorchScript interpreter, a re-raise) has lost the OutOfMemoryError type
    "CUDA out of memory.",
    # c10/cuda/driver_api.h C10_CUDA_DRIVER_CHECK (and ATen's AT_CUDA_DRIVER_CHECK) with
    # CUDA_ERROR_OUT_OF_MEMORY: expandable segments' cuMemMap / cuMemSetAccess / cuMemAddressReserve
    "CUDA driver error: out of memory",
    # c10/cuda/CUDAException.cpp C10_CUDA_CHECK with cudaErrorMemoryAllocation (torch.AcceleratorError
    # from 2.8): pinned host memory, streams, kernel launches; also ATen's TORCH_CUDASPARSE_CHECK,
    # whose cusparseGetErrorString(CUSPARSE_STATUS_ALLOC_FAILED) is "out of memory"
    "CUDA error: out of memory",
    "cudaErrorMemoryAllocation",  # the help line C10_CUDA_CHECK appends for that error
    # aten/src/ATen/cuda/Exceptions.h TORCH_CUDABLAS_CHECK and the cuBLASLt calls in CUDABlas.cpp
    "CUBLAS_STATUS_ALLOC_FAILED",
    "OOM trying to allocate workspace for cublaslt",  # CUDABlas.cpp, cuBLASLt workspace
    # AT_CUDNN_CHECK: cuDNN 8's status, and cuDNN 9's two allocation statuses
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "CUFFT_ALLOC_FAILED",  # aten/src/ATen/native/cuda/CuFFTUtils.h CUFFT_CHECK
    "CUSOLVER_STATUS_ALLOC_FAILED",  # TORCH_CUSOLVER_CHECK
    # c10/core/impl/alloc_cpu.cpp: posix_memalign failed (Linux, macOS) / got no memory (Windows)
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


def is_oom(exc: BaseException) -> bool:
    """True if ``exc`` is an out-of-memory error: a ``torch.OutOfMemoryError``, or a RuntimeError
    whose message holds one of the exact fragments in :data:`OOM_MESSAGES`.

    Errors that merely mention memory (an illegal memory access, a library's internal error,
    ``MemoryError`` from Python) are not out-of-memory errors here; see ``docs/oom.md``.
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(fragment in text for fragment in OOM_MESSAGES)


def release_memory(allocated_before: int | None = None, device: torch.device | None = None) -> None:
    """Free the memory a failed attempt held: the activations offloading still kept on the device
    (a forward that failed has no backward to release them, :meth:`HostOffload.release
    <tightfit.levers.offload.HostOffload.release>`), its garbage, then the caching allocator's
    free blocks, returned to the driver so the retry starts unfragmented.
    Call it outside the ``except`` block, once the traceback (and the frames it keeps) is gone.

    Args:
        allocated_before: ``torch.cuda.memory_allocated(device)`` in bytes before the attempt.
            When given, the garbage collector runs only if more than that is still allocated:
            a full ``gc.collect()`` costs ~0.2 s once transformers is loaded, two of them were
            0.39 s of the main job's 1.39 s of planning (NVIDIA H100, bench/results/
            checkpoint-schedule/call-3), and a probe whose tensors all died by reference count
            leaves nothing for it to find.
        device: the CUDA device ``allocated_before`` was read on (the current one if None).
    """
    from ..levers.offload import HostOffload

    HostOffload.release()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if allocated_before is None or not cuda or torch.cuda.memory_allocated(device) > allocated_before:
        gc.collect()  # tensors held in reference cycles (a failed step's frames, autograd graphs)
    if cuda:
        torch.cuda.empty_cache()
