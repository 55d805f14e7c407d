"""Kernel scratch: bytes some CUDA kernels take from the caching allocator while they run, on
top of their inputs and outputs, and free (to the cache) when they return.

Each model is split in two: the *operands* (a few integers read from the op's tensors, with
the op's structure checked) and the *sizes* computed from them, so that a recorded trace
(:mod:`.ledger`) keeps the operands and a replay at another micro-batch sizes the scratch as a
trace would (staging buffers are not proportional to the micro-batch).
"""

from __future__ import annotations

import torch

_DIM_REDUCTIONS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim)
DEFAULT_SM_COUNT, DEFAULT_THREADS_PER_SM = 132, 2048  # an H100/H200 when the card is unknown

# The ops for which kernel_workspace_bytes or reduction_staging_bytes can be non-zero.
SCRATCH_OPS = frozenset((torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
                         *_DIM_REDUCTIONS))


def convolution_operands(func, args, out) -> tuple[int, ...]:
    """Bytes of the two activations a cuDNN convolution's workspace is sized by (forward:
    ``args[0]`` and ``out``; backward: the incoming gradient ``args[0]`` and the input
    ``args[1]``); ``()`` for every other op."""
    if func is torch.ops.aten.convolution_backward.default:
        tensors = (args[0], args[1])
    elif func is torch.ops.aten.convolution.default:
        tensors = (args[0], out)
    else:
        return ()
    return tuple(t.numel() * t.element_size() for t in tensors)


def kernel_workspace_bytes(func, args, out) -> int:
    """Scratch bytes a cuDNN convolution takes from the caching allocator while it runs, on top
    of its inputs and outputs (``out``: what ``func`` returned).

    The algorithm, hence the workspace, is chosen on the GPU; modelled as the larger of the
    convolution's input and output activations (forward: ``args[0]`` and ``out``; backward:
    the incoming gradient ``args[0]`` and the input ``args[1]``; shapes N x C x H x W), which
    matches the allocated bytes a trace without it missed on an NVIDIA H200 for ResNet-50 with
    checkpointing (30/108/187 MiB measured against 25/98/196 MiB at micro-batch 8/32/64, fp32).
    0 for every other op.
    """
    return max(convolution_operands(func, args, out), default=0)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(1, n).bit_length() - 1))


def reduction_operands(func, args) -> tuple[int, ...]:
    """``(outputs, inputs)`` of a CUDA sum/mean over leading dimensions of a contiguous
    floating-point tensor (elements kept, elements reduced into each), the case
    :func:`staging_bytes` sizes; ``()`` for any other op or reduction."""
    if func not in _DIM_REDUCTIONS or not isinstance(args[0], torch.Tensor):
        return ()
    x = args[0]
    if x.dim() < 2 or not x.is_contiguous() or not x.is_floating_point() or x.dtype == torch.float64:
        return ()
    dims = args[1] if len(args) > 1 and args[1] is not None else list(range(x.dim()))
    dims = sorted({int(d) % x.dim() for d in dims}) or list(range(x.dim()))
    if dims != list(range(len(dims))) or len(dims) == x.dim():
        return ()  # not a reduction over leading dimensions only
    outputs = 1
    for n in x.shape[len(dims):]:
        outputs *= n
    return outputs, x.numel() // max(outputs, 1)


def staging_bytes(outputs: int, inputs: int, sm_count: int = DEFAULT_SM_COUNT,
                  threads_per_sm: int = DEFAULT_THREADS_PER_SM) -> list[int]:
    """``[staging buffer, semaphores]`` bytes of a reduction of ``inputs`` elements into each
    of ``outputs`` (:func:`reduction_operands`), ``[]`` when it needs none; the launch
    configuration of :func:`reduction_staging_bytes`."""
    vec = 4
    while outputs % vec:
        vec //= 2
    max_threads = 512 // vec
    dim0, dim1 = outputs // vec, inputs
    dim0_pow2 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    dim1_pow2 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, max_threads // width)
    width = min(dim0_pow2, max_threads // height)
    step_output, step_input = width, 1
    if inputs >= height * 16 or inputs >= 256:
        step_input, block_y = height, True
    else:
        step_output, block_y = step_output * height, False
    grid_x = -(-(outputs // vec) // step_output)
    target = sm_count * (threads_per_sm // (width * height))
    per_thread = -(-inputs // step_input)
    if not (block_y and per_thread >= 256 and grid_x <= target):
        return []
    ctas = max(min(-(-target // grid_x), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return []
    return [4 * outputs * ctas * width * vec, 4 * grid_x]


def reduction_staging_bytes(func, args, sm_count: int = DEFAULT_SM_COUNT,
                            threads_per_sm: int = DEFAULT_THREADS_PER_SM) -> list[int]:
    """Sizes of the buffers a CUDA sum/mean over leading dimensions takes from the caching
    allocator while it runs: ``[staging buffer, semaphores]`` (``[]`` when it needs none).

    A bias gradient (``sum`` of a ``[tokens, features]`` gradient over the tokens) is reduced by
    several thread blocks per output ("global reduce"), which exchange fp32 partial sums through
    a staging buffer of ``4 x outputs x blocks_per_output x block_width x vector_size`` bytes --
    e.g. 132 MiB for a ``[6304, 3072]`` gradient on an H200, more than the gradient itself. The
    launch configuration follows ``setReduceConfig`` in PyTorch's
    ``aten/src/ATen/native/cuda/Reduce.cuh`` for a contiguous input; it reproduces the sizes
    measured on an NVIDIA H200 (``[6304, 768]``: 38,928,384 + 24 bytes; ``[6304, 3072]``:
    138,412,032 + 96 bytes). Reductions over the last dimension need no large buffer (0 here).
    """
    operands = reduction_operands(func, args)
    return staging_bytes(*operands, sm_count, threads_per_sm) if operands else []


def scratch_sizes(conv: tuple[int, ...], reduction: tuple[int, ...], sm_count: int, threads_per_sm: int) -> list[int]:
    """The non-zero scratch allocations (bytes, in allocation order) of an op with the operands
    ``conv`` (:func:`convolution_operands`) and ``reduction`` (:func:`reduction_operands`)."""
    sizes = [max(conv, default=0), *(staging_bytes(*reduction, sm_count, threads_per_sm) if reduction else ())]
    return [n for n in sizes if n]
