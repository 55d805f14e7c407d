"""The out-of-memory classifier: every out-of-memory text PyTorch 2.6-2.14 raises for CUDA and the
CPU allocator is caught; errors that only mention memory are not (docs/oom.md has the table)."""

import re
from pathlib import Path

import pytest
import torch

from tightfit.memory.oom import OOM_MESSAGES, is_oom

DOC = Path(__file__).resolve().parent.parent / "docs" / "oom.md"

# Texts as PyTorch builds them (several raised for real on an H200 with PyTorch 2.11, see docs/oom.md).
OOM_TEXTS = [
    "CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
    "3.12 MiB is free. Including non-PyTorch memory, this process has 139.79 GiB memory in use.",
    "CUDA out of memory. Tried to allocate more than 1EB memory.",
    "CUDA driver error: out of memory",
    "CUDA driver error: out of memory\nCUDA driver log: cuMemMap failed",  # newer versions add the log
    "CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation' in "
    "https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
    "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n",
    "CUDA error: out of memory when calling `cusparseCreate(handle)`",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasLtMatmul with transpose_mat1 0 transpose_mat2 0",
    "OOM trying to allocate workspace for cublaslt",
    "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
    "cuFFT error: CUFFT_ALLOC_FAILED",
    "cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `cusolverDnCreate(handle)`. If you keep "
    "seeing this error, you may use `torch.backends.cuda.preferred_linalg_library()`",
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)",
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate "
    "911360 bytes.",
    # the TorchScript interpreter re-raises with the original text inside
    "The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript (most recent "
    "call last):\nRuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB.",
]

NOT_OOM_TEXTS = [
    "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be asynchronously "
    "reported at some other API call",
    "CUDA error: device-side assert triggered",
    "CUDA error: misaligned address",
    "CUDA driver error: an illegal memory access was encountered",
    "CUDA driver error: device not ready",
    "cuDNN error: CUDNN_STATUS_INTERNAL_ERROR",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
    "cuFFT error: CUFFT_INTERNAL_ERROR",
    "cusolver error: CUSOLVER_STATUS_INTERNAL_ERROR, when calling `cusolverDnCreate(handle)`.",
    "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
    "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`",
    "CUDA error: insufficient resources when calling `cusparseSpMM(handle)`",
    "unable to mmap 1024 bytes from file </torch_1_2>: Cannot allocate memory (12)",
    "DataLoader worker (pid 123) is killed by signal: Killed.",
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "index 12 is out of bounds for dimension 0 with size 8",
    "memory_format channels_last is not supported for this tensor; out of memory-format options",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
    "Last error: Cuda failure 'out of memory'",
    "cuda out of memory",  # not the allocator's text (fragments are case-sensitive)
]


@pytest.mark.parametrize("text", OOM_TEXTS)
def test_out_of_memory_texts_are_caught(text):
    assert is_oom(RuntimeError(text))


@pytest.mark.parametrize("text", NOT_OOM_TEXTS)
def test_other_errors_are_not_caught(text):
    assert not is_oom(RuntimeError(text))


def test_out_of_memory_by_type_and_runtime_error_subclasses():
    assert is_oom(torch.OutOfMemoryError("Allocation on device 0 would exceed allowed memory. (out of memory)"))
    assert is_oom(torch.OutOfMemoryError("Not enough memory for workspace!"))
    assert is_oom(torch.AcceleratorError("CUDA error: out of memory"))
    assert is_oom(torch.linalg.LinAlgError("cusolver error: CUSOLVER_STATUS_ALLOC_FAILED, when calling `x`"))
    assert not is_oom(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))


@pytest.mark.parametrize("exc", [
    MemoryError(),
    MemoryError("Unable to allocate 8.00 GiB for an array with shape (1073741824,) and data type float64"),
    ValueError("CUDA out of memory. Tried to allocate 2.00 MiB"),  # only RuntimeErrors carry the texts
    KeyboardInterrupt(),
    TypeError("CUBLAS_STATUS_ALLOC_FAILED"),
])
def test_other_exception_types_are_not_caught(exc):
    assert not is_oom(exc)


def test_a_real_cpu_allocator_failure_is_caught():
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 55, dtype=torch.uint8)  # 32 PiB: malloc fails without touching memory
    assert is_oom(info.value)


def test_every_fragment_is_in_the_docs_table():
    doc = DOC.read_text()
    missing = [m for m in OOM_MESSAGES if m not in doc]
    assert not missing, f"docs/oom.md does not list {missing}"
    # and every message the docs mark as caught in bold is a fragment the code matches
    caught = doc.split("## Caught", 1)[1].split("## Not caught", 1)[0]
    assert set(re.findall(r"\*\*([^*]+)\*\*", caught)) <= set(OOM_MESSAGES)


@pytest.mark.parametrize("before, now, collected", [(None, 100, 1), (100, 100, 0), (100, 90, 0), (100, 101, 1)])
def test_release_memory_collects_only_what_an_attempt_left(monkeypatch, before, now, collected):
    """A full gc.collect() costs ~0.2 s in a process with transformers loaded; a probe whose
    tensors all died by reference count gets none, one that left memory allocated gets one,
    and a caller that read nothing before gets one as always."""
    from tightfit.memory import oom

    calls = {"gc": 0, "empty": 0}
    monkeypatch.setattr(oom.gc, "collect", lambda: calls.__setitem__("gc", calls["gc"] + 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: now)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.__setitem__("empty", calls["empty"] + 1))
    oom.release_memory(before, None)
    assert calls == {"gc": collected, "empty": 1}
