"""Account every device allocation of a traced step: a torch-dispatch mode over meta tensors.

Each new storage produced by an aten op (what autograd, kernels and the optimizer allocate) is
replayed as a ``malloc`` through an allocator model (:mod:`.allocator`), and as a ``free``
when the storage dies (a weakref finaliser), so the order of allocations and frees is the
step's own. Storages are counted once however many views share them. Each live block carries a
component label; the totals per label are snapshot whenever allocated memory reaches a new peak.
Further allocator models (``shadows``) can replay the same sequence, so that one trace gives
the peaks under several allocator configurations.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import meta_cache
from .allocator import make_allocator

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


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
    if func is torch.ops.aten.convolution_backward.default:
        tensors = (args[0], args[1])
    elif func is torch.ops.aten.convolution.default:
        tensors = (args[0], out)
    else:
        return 0
    return max(t.numel() * t.element_size() for t in tensors)


_DIM_REDUCTIONS = (torch.ops.aten.sum.dim_IntList, torch.ops.aten.mean.dim)
DEFAULT_SM_COUNT, DEFAULT_THREADS_PER_SM = 132, 2048  # an H100/H200 when the card is unknown


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(1, n).bit_length() - 1))


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
    if func not in _DIM_REDUCTIONS or not isinstance(args[0], torch.Tensor):
        return []
    x = args[0]
    if x.dim() < 2 or not x.is_contiguous() or not x.is_floating_point() or x.dtype == torch.float64:
        return []
    dims = args[1] if len(args) > 1 and args[1] is not None else list(range(x.dim()))
    dims = sorted({int(d) % x.dim() for d in dims}) or list(range(x.dim()))
    if dims != list(range(len(dims))) or len(dims) == x.dim():
        return []  # not a reduction over leading dimensions only
    outputs = 1
    for n in x.shape[len(dims):]:
        outputs *= n
    inputs = x.numel() // max(outputs, 1)
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


# The ops for which kernel_workspace_bytes or reduction_staging_bytes can be non-zero.
_SCRATCH_OPS = frozenset((torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default,
                          *_DIM_REDUCTIONS))


class _StorageRef(weakref.ref):
    """A weak reference to a tracked storage that remembers its key in ``_live`` (cheaper to
    make than ``weakref.finalize``, and called at the same moment: when the storage dies)."""

    __slots__ = ("key",)


def _leaves(out):
    """What an aten op returned, flat (torch's pytree only for nested results: it is slower)."""
    if type(out) is torch.Tensor:
        return (out,)
    if type(out) in (tuple, list) and not any(type(t) in (tuple, list, dict) for t in out):
        return out
    return tree_leaves(out)


class AllocationTracker(TorchDispatchMode):
    """Replays a meta-device trace through the allocator model.

    Args:
        allocator: the allocator model whose allocated peak sets ``peak_breakdown``
            (default: expandable segments, :func:`~.allocator.make_allocator`).
        shadows: more allocator models fed the same ``malloc``/``free`` sequence.
        device: the GPU profile whose SM count sizes reduction staging buffers (None: an H200's).

    Attributes:
        allocator, shadows: as given.
        label: component given to new allocations (``"temporaries"`` unless set).
        peak_breakdown: bytes per component when allocated memory last reached its peak.
        window_peak: the most allocated bytes since the caller last assigned it (a phase's peak).
    """

    def __init__(self, allocator=None, shadows=(), device=None):
        super().__init__()
        self.sm_count = getattr(device, "sm_count", 0) or DEFAULT_SM_COUNT
        self.threads_per_sm = device.max_threads_per_sm if device is not None else DEFAULT_THREADS_PER_SM
        self.allocator = allocator or make_allocator()
        self.shadows = list(shadows)
        self.label = "temporaries"
        self._live: dict[int, list] = {}  # id(storage) -> [block, label]
        self.totals: Counter = Counter()
        self.peak_breakdown: dict[str, int] = {}
        self._peak = -1
        self.window_peak = 0  # max allocated bytes since the caller last set it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = meta_cache.call(func, args, kwargs)  # a repeated op's layouts without its meta kernel
        for t in _leaves(out):
            if isinstance(t, torch.Tensor) and t.is_meta:  # is_meta: a tenth of device.type's cost
                self.track(t)
        if func not in _SCRATCH_OPS:  # most ops: no kernel scratch (skips two calls per op)
            return out
        ws = [n for n in (kernel_workspace_bytes(func, args, out),
                          *reduction_staging_bytes(func, args, self.sm_count, self.threads_per_sm)) if n]
        if ws:  # held by the kernel beside its outputs, freed (to the cache) when it returns
            models = [self.allocator] + self.shadows
            blocks = [[a.malloc(n) for n in ws] for a in models]
            held = sum(b.size for b in blocks[0])
            self.totals["temporaries"] += held
            self._note_peak()
            self.totals["temporaries"] -= held
            for a, bs in zip(models, blocks):
                for b in reversed(bs):
                    a.free(b)
        return out

    def _note_peak(self) -> None:
        """After an allocation: update the window's peak and, at a new peak, the breakdown."""
        self.window_peak = max(self.window_peak, self.allocator.allocated)
        if self.allocator.allocated > self._peak:
            self._peak = self.allocator.allocated
            self.peak_breakdown = dict(self.totals)

    def track(self, t: torch.Tensor, label: str | None = None) -> None:
        """Account ``t``'s storage once (no-op if already live or empty)."""
        st = t.untyped_storage()
        key = id(st)
        if key in self._live or st.nbytes() == 0:
            return
        nbytes = st.nbytes()
        block = self.allocator.malloc(nbytes)
        ref = _StorageRef(st, self._storage_died)
        ref.key = key
        # the reference lives in the entry: the storage's death frees its blocks, as long as it is tracked
        entry = [block, label or self.label, [a.malloc(nbytes) for a in self.shadows], ref]
        self._live[key] = entry
        self.totals[entry[1]] += block.size
        self._note_peak()

    def relabel(self, t: torch.Tensor, label: str, only_from: tuple[str, ...] | None = None) -> None:
        """Give ``t``'s live storage the component ``label``."""
        entry = self._live.get(id(t.untyped_storage()))
        if entry is not None and entry[1] != label and (only_from is None or entry[1] in only_from):
            self.totals[entry[1]] -= entry[0].size
            self.totals[label] += entry[0].size
            entry[1] = label

    def relabel_all(self, old: str, new: str) -> None:
        """Move every live block labelled ``old`` to ``new``."""
        for entry in self._live.values():
            if entry[1] == old:
                entry[1] = new
        self.totals[new] += self.totals.pop(old, 0)

    def live_bytes(self) -> int:
        return self.allocator.allocated

    def _storage_died(self, ref: _StorageRef) -> None:
        self._free(ref.key)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.totals[entry[1]] -= entry[0].size
            self.allocator.free(entry[0])
            for a, b in zip(self.shadows, entry[2]):
                a.free(b)
