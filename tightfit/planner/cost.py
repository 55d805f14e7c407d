"""The time model: predicted seconds per optimizer step for a plan on a card.

A micro-batch's forward + backward costs ``3 x`` its forward FLOPs (backward = 2 x forward,
Kaplan et al. 2020, "Scaling Laws for Neural Language Models", sec. 2.1), plus one more forward
of every checkpointed block (recomputation, Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost"). The GPU runs that at the card's rate for the precision times an
achievable share (:data:`ACHIEVED_SHARE`); meanwhile the CPU must launch every kernel
(:data:`LAUNCH_S` each). Whichever is longer sets the micro-batch's time: small micro-batches
are launch-bound, large ones compute-bound. The fused AdamW step streams weights, gradients
and both moments through memory once per step. On a GPU, :meth:`TimeModel.calibrate` replaces
the assumed constants with timed probe steps.

Per-block choices (:data:`tightfit.levers.blocks.BLOCK_POLICIES`): a ``full`` block costs one
more forward of the block; a ``selective`` block reruns only the ops whose outputs the
selective policy drops (:mod:`tightfit.levers.selective`: no matrix product, so their FLOPs
are left out, but each is a kernel launch, counted from the traced forward, and each reads its
input and writes its output through memory at the card's bandwidth); an ``offload``
block copies its saved activations to the host and back over the host link
(``DeviceProfile.host_link_bytes_per_s``, pinned memory): the device-to-host copies run on a
side stream beside the forward's compute, the host-to-device copies are waited for in backward.

The optimizer levers (:mod:`tightfit.levers.optimizers`) cost differently: bitsandbytes' 8-bit
AdamW streams weights, gradients and 1-byte moments through memory
(:data:`ADAMW8BIT_BYTES_PER_PARAM`) in one kernel per parameter tensor, each followed by a device
sync (:data:`OPTIMIZER_CALL_S` each);
bf16 weights with torchao's 8-bit AdamW (``adamw8bit-bf16``) stream bf16 weights and gradients and
1-byte moments (:data:`ADAMW8BIT_BF16_BYTES_PER_PARAM`) in one compiled call per chunk of 8-bit
tensors (:data:`TORCHAO_CHUNK_CALL_S` each), one flat call for its small tensors
(:data:`TORCHAO_FLAT_CALL_S`) and one per other tensor (:data:`TORCHAO_CALL_S`);
CPU offload copies the gradients to the host (once per micro-batch: the accumulated gradient is
copied again after each) and the new weights back over the host link, and runs AdamW on the CPU at
:data:`CPU_ADAMW_PARAMS_PER_S`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from ..devices import DeviceProfile
from ..plan import accumulation_steps

# Share of the peak rate that a well-shaped transformer/CNN training step reaches in eager
# PyTorch (MFU); a prior only, replaced by calibration on a GPU.
ACHIEVED_SHARE = 0.45
# CPU time per ATen op through eager PyTorch and Hugging Face modules (Python, dispatch, launch),
# seconds: 23-27 us per op and pass over the model measured by the planner's calibration for
# BERT-base/-large and ViT-B/16 on an NVIDIA H200 host (bench/results/bench/; 40 us for ResNet-50).
LAUNCH_S = 25e-6
# AdamW step: read weight, gradient, two moments; write weight and two moments (fp32).
ADAMW_BYTES_PER_PARAM = 7 * 4
# bitsandbytes AdamW8bit step (fp32 weights and gradients): read weight, gradient and two 1-byte
# moments, write weight and moments (the per-block scales, 8 B per 256 elements, left out).
ADAMW8BIT_BYTES_PER_PARAM = 4 + 4 + 2 + 4 + 2
# Per parameter tensor of bitsandbytes' AdamW8bit step: a Python call, one kernel launch and a
# ``torch.cuda.synchronize()`` (bitsandbytes/optim/optimizer.py ``step``: ``sync_gpu(p)``). One
# step over BERT-large's 335.1M parameters in 393 tensors took 26.5 ms on an NVIDIA H200 (torch
# 2.11, bitsandbytes 0.50.2; bench/results/optimizer-levers/optimizer_step_time.json); less its
# bytes at the card's 4.8 TB/s (1.1 ms), 65 us per tensor. tightfit's step now leaves the sync out
# (tightfit.levers.optimizers._stream_ordered): BERT-base's whole training step was ~70 us per tensor
# faster (bench/results/optimizer-sync/); the constant, measured with the syncs, is not re-fitted.
OPTIMIZER_CALL_S = 65e-6
# torchao AdamW8bit step over bf16 weights (adamw8bit-bf16): read weight, gradient and two 1-byte
# moments, write weight and moments (scales left out).
ADAMW8BIT_BF16_BYTES_PER_PARAM = 2 + 2 + 2 + 2 + 2
# Host time per parameter tensor of torchao's 8-bit AdamW step over bf16 weights with stochastic
# rounding, one compiled call per tensor (guards, Python, kernel launches; the 8-bit moments passed
# as plain tensors). Measured on one NVIDIA H200 host, BERT-large's 393 tensors (torch 2.11,
# torchao 0.18; bench/results/update-groups/update_groups-per-tensor.json): 81.1 ms per step.
# (44.6 ms on a faster host, bench/results/optimizer-dispatch-2/.) The GPU's share is ~8.4 ms.
TORCHAO_CALL_S = 81.13e-3 / 393
# Host time of one chunk's call (tightfit.levers.optimizers._compiled_chunk_update: the
# concatenations, one compiled call, one multi-tensor copy back per dtype and the counters' add) and
# of the flat call over the small tensors (_compiled_flat_update: the same shape of work), whatever
# their tensor counts, as a training step pays it: estimated as two per-tensor calls each. Measured
# alone on an NVIDIA H100 host (torch 2.11; bench/results/session-2026-12-06/update_chunks-*.json),
# BERT-large's update took 22.0 ms of host time in 26 calls, 0.44 of its 393 per-tensor calls' 49.9
# ms: 1.38 ms a call on the scale of the H200 host above. Not adopted: in a training step the host
# queues the update while the GPU still runs the backward, and this estimate predicted BERT-large's
# eager step at 4 GiB (64 x 2, 22 blocks) at 601 samples/s against 584 timed on that H100 (-3%), where
# the update alone's 1.38 ms would predict 528 (-10%). The step's overlap of host and GPU is not
# modelled; until it is, this is the figure that fits the steps measured.
TORCHAO_CHUNK_CALL_S = 2 * TORCHAO_CALL_S
TORCHAO_FLAT_CALL_S = 2 * TORCHAO_CALL_S
# Fused AdamW on the host CPU as ``adamw-offload`` runs it: one fused step over every offloaded
# tensor (tightfit.levers.host_adamw), parameters per second. Measured on an NVIDIA H200 host (16
# threads, torch 2.11; bench/results/optimizer-levers-3/optimizer_step_time.json): the fused CPU
# AdamW over BERT-large's 393 tensors (335.1M parameters) at 3.6e9 parameters/s; the whole
# ``adamw-offload`` step, the weights' copies back to the GPU included, 110.6 ms (torchao's one
# AdamW per tensor: 665 ms, bench/results/optimizer-levers/).
CPU_ADAMW_PARAMS_PER_S = 3.6e9


class _OpCounter(TorchDispatchMode):
    """Counts ATen calls (each is about one kernel launch on a GPU): all of them, those inside
    a repeated block (``depth`` > 0 while one runs), and those of them that selective
    recomputation reruns."""

    def __init__(self):
        super().__init__()
        self.ops = self.block_ops = self.recomputed_ops = 0
        self.recomputed_bytes = 0
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ..levers.selective import is_saved

        self.ops += 1
        out = func(*args, **(kwargs or {}))
        if self.depth:
            self.block_ops += 1
            if not is_saved(func):
                self.recomputed_ops += 1
                if not getattr(func, "is_view", False):  # a view writes nothing
                        self.recomputed_bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                                                 if isinstance(t, torch.Tensor))
        return out


def peak_flops(profile: DeviceProfile, precision: str) -> float:
    """The card's dense FLOP/s for ``precision`` that a long run of matrix products can hold: the
    datasheet peak times :attr:`~tightfit.devices.DeviceProfile.sustained_share` (below 1 where
    the power limit lowers the clocks, e.g. the T4); bf16 falls back to the fp32 rate where the
    card has no bf16 rate. Sources per card: docs/planner.md, "Card table"."""
    p = profile
    rate = {"fp32": p.fp32_tflops, "fp16": p.fp16_tflops, "bf16": p.bf16_tflops or p.fp32_tflops}[precision]
    return 1e12 * rate * p.sustained_share


@dataclass(frozen=True)
class ForwardCost:
    """One sample's forward pass, measured by tracing on meta tensors.

    Attributes:
        flops_per_sample: forward FLOPs of one sample (``torch.utils.flop_counter``).
        ops: ATen calls of one forward (independent of the micro-batch).
        trainable_params: parameters the optimizer updates.
        n_blocks: repeated blocks (recomputation unit).
        selective_ops_per_block: ATen calls a selectively checkpointed block reruns in backward
            (the average over the blocks; 0 when unknown).
        selective_bytes_per_sample: bytes those ops write per sample and block (fp32 trace).
        trainable_tensors: parameter tensors the optimizer updates.
        offloaded_params: trainable parameters in tensors that CPU offload moves to the host
            (:func:`tightfit.levers.optimizers.is_offloaded`).
        chunked_tensors: trainable tensors that ``adamw8bit-bf16`` updates in its chunks' calls
            (its 8-bit tensors; :func:`tightfit.levers.optimizers.bf16_update_calls`).
        chunk_calls: those calls (:func:`tightfit.levers.optimizers.update_chunks`).
        flat_tensors: trainable tensors that ``adamw8bit-bf16`` updates in its flat call (0 or
            at least 2; :func:`tightfit.levers.optimizers.bf16_flat_call`).
        free_blocks: leading blocks that run no backward (frozen, nothing trained before them:
            :func:`tightfit.levers.freezing.frozen_prefix_blocks`): no backward compute, and
            checkpointing them recomputes nothing.
    """

    flops_per_sample: float
    ops: int
    trainable_params: int
    n_blocks: int
    selective_ops_per_block: float = 0.0
    selective_bytes_per_sample: float = 0.0
    trainable_tensors: int = 0
    offloaded_params: int = 0
    chunked_tensors: int = 0
    chunk_calls: int = 0
    free_blocks: int = 0
    flat_tensors: int = 0


def optimizer_tensor_counts(shapes) -> dict:
    """:class:`ForwardCost`'s counts of the trainable tensors of ``shapes`` (in the order of
    ``model.parameters()``) that the optimizers' host time depends on: ``trainable_tensors``,
    ``offloaded_params``, ``chunked_tensors``, ``chunk_calls`` and ``flat_tensors``."""
    from ..levers.optimizers import bf16_flat_call, bf16_update_calls, is_offloaded, is_quantized_torchao

    shapes = [tuple(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    flat = len(bf16_flat_call(shapes))
    chunks = [c for c in bf16_update_calls(shapes)[bool(flat):] if is_quantized_torchao(sizes[c[0]])]
    return dict(trainable_tensors=len(sizes), offloaded_params=sum(n for n in sizes if is_offloaded(n)),
                chunked_tensors=sum(len(c) for c in chunks), chunk_calls=len(chunks), flat_tensors=flat)


# (id(model), id(make_batch), size, n_blocks) -> (model, make_batch, ForwardCost) inside
# remembered_forward_costs(): the searches of one plan (a bound and a search per optimizer) ask for
# the same forward up to seven times, ~0.8 s each for BERT-large on a 2-core host. Scoped to one
# planning call, so the model cannot change under it and nothing outlives it (the entry holds the
# model, so that its id is not reused while the scope lasts).
_REMEMBERED: contextvars.ContextVar = contextvars.ContextVar("tightfit_forward_costs", default=None)


@contextlib.contextmanager
def remembered_forward_costs():
    """Within this context :func:`forward_cost` traces each (model, make_batch, size, n_blocks)
    once; nested uses share the outer scope's."""
    token = _REMEMBERED.set({}) if _REMEMBERED.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _REMEMBERED.reset(token)


def forward_cost(model: torch.nn.Module, make_batch, size: int, n_blocks: int) -> ForwardCost:
    """Trace one forward of ``model`` (meta device) on a batch of 2 to count FLOPs and kernels
    (in all, and those selective recomputation reruns in the repeated blocks); traced once per
    arguments inside :func:`remembered_forward_costs`."""
    memo = _REMEMBERED.get()
    if memo is None:
        return _trace_forward_cost(model, make_batch, size, n_blocks)
    key = (id(model), id(make_batch), size, n_blocks)
    if key not in memo:
        memo[key] = (model, make_batch, _trace_forward_cost(model, make_batch, size, n_blocks))
    return memo[key][2]


def _trace_forward_cost(model: torch.nn.Module, make_batch, size: int, n_blocks: int) -> ForwardCost:
    from ..levers.blocks import find_blocks
    from ..memory.cuda_autocast import CudaOnMeta
    from ..memory.estimate import meta_copy

    meta = meta_copy(model)
    batch = {k: v.to("meta") for k, v in make_batch(2, size).items() if k != "labels"}  # CPU batches too
    counter = _OpCounter()
    hooks = []
    for block in find_blocks(meta):
        hooks.append(block.register_forward_pre_hook(lambda *a: setattr(counter, "depth", counter.depth + 1)))
        hooks.append(block.register_forward_hook(lambda *a: setattr(counter, "depth", counter.depth - 1)))
    with torch.no_grad(), CudaOnMeta("fp32"), FlopCounterMode(display=False) as flops, counter:
        meta(**batch)
    for h in hooks:
        h.remove()
    from ..levers.freezing import frozen_prefix_blocks

    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    per_block = 1 / n_blocks if n_blocks else 0.0
    return ForwardCost(flops.get_total_flops() / 2, counter.ops, sum(math.prod(s) for s in shapes), n_blocks,
                       counter.recomputed_ops * per_block, counter.recomputed_bytes * per_block / 2,
                       free_blocks=frozen_prefix_blocks(model, make_batch(1, size)), **optimizer_tensor_counts(shapes))


def passes(n_blocks: int, free_blocks: int, checkpointed: int) -> float:
    """Passes over the model's forward that one micro-batch costs: the forward, the backward
    (twice the forward, Kaplan et al. 2020's 6N FLOPs per token against the forward's 2N) where
    it runs, and the recomputation of the ``checkpointed`` first blocks less the
    ``free_blocks`` first ones, which run no backward and recompute nothing
    (:func:`tightfit.levers.freezing.frozen_prefix_blocks`)."""
    n = n_blocks or 1
    free = min(free_blocks, n)
    return 3 - 2 * free / n + max(0, checkpointed - free) / n


@dataclass(frozen=True)
class TimeModel:
    """Predicts seconds per optimizer step.

    Attributes:
        profile: the card (rates per precision, memory bandwidth).
        cost: the workload's forward cost.
        achieved_share: share of the peak rate reached (per precision after calibration).
        launch_s: seconds per kernel launch.
        offload_bytes: per precision, the bytes one sample's block saves for backward (what an
            offloaded block sends to the host and back); filled by the search from its traces.
        optimizer: the plan's optimizer (``Plan.optimizer``).
    """

    profile: DeviceProfile
    cost: ForwardCost
    achieved_share: dict | None = None
    launch_s: float = LAUNCH_S
    offload_bytes: dict = field(default_factory=dict)
    optimizer: str = "adamw"

    def rate(self, precision: str) -> float:
        """Achievable FLOP/s for ``precision`` on this card."""
        share = (self.achieved_share or {}).get(precision, ACHIEVED_SHARE)
        return peak_flops(self.profile, precision) * share

    def micro_batch_seconds(self, precision: str, micro_batch: int, checkpointed: int, policies=None) -> float:
        """Forward + backward (+ recomputation, + waiting for host copies) of one micro-batch:
        max(compute, kernel launches) + the transfers not hidden. ``policies``: one choice per
        block (None: ``checkpointed`` blocks recompute fully, the others keep everything)."""
        return sum(self.micro_batch_parts(precision, micro_batch, checkpointed, policies))

    def micro_batch_parts(self, precision: str, micro_batch: int, checkpointed: int, policies=None):
        """``(without recomputation, recomputation, transfer)`` seconds of one micro-batch (see
        :meth:`micro_batch_seconds`)."""
        c = self.cost
        n, free = c.n_blocks or 1, c.free_blocks
        # the first blocks: those that run no backward recompute nothing
        full = checkpointed if policies is None else free + sum(p == "full" for p in policies[free:])
        selective = 0 if policies is None else sum(p == "selective" for p in policies[free:])
        flops = micro_batch * c.flops_per_sample
        launches = c.ops * self.launch_s
        bare, paid = passes(n, free, 0), passes(n, free, full)
        base = max(bare * flops / self.rate(precision), bare * launches)
        bw = self.profile.memory_bytes_per_s or 500e9
        rerun = selective * micro_batch * c.selective_bytes_per_sample * 2 / bw  # read + write, memory-bound
        total = max(paid * flops / self.rate(precision) + rerun,
                    paid * launches + selective * self._selective_launches() * self.launch_s)
        moved = self.offloaded_bytes(precision, micro_batch, policies)
        bw = self.profile.host_link_bytes_per_s or 12e9  # built-in cards: PCIe, devices.py
        # device-to-host beside the forward (a third of the compute), host-to-device waited for
        transfer = max(0.0, moved / bw - total / 3) + moved / bw if moved else 0.0
        return base, total - base, transfer

    def offloaded_bytes(self, precision: str, micro_batch: int, policies=None) -> float:
        """Bytes the offloaded blocks of ``policies`` (one choice per block; None: none) save for
        backward in one micro-batch: what goes to pinned host memory and back (``offload_bytes``
        per offloaded block and sample)."""
        offloaded = sum(p == "offload" for p in policies or ())
        return offloaded * micro_batch * self.offload_bytes.get(precision, 0.0)

    def _selective_launches(self) -> float:
        """Kernel-launch equivalents a selective block adds: its recomputed ops, and each of its
        forward ops once more, for passing through the selective policy's Python dispatch mode
        (``torch.utils.checkpoint``'s caching mode sees every op)."""
        c = self.cost
        return c.selective_ops_per_block + c.ops / (c.n_blocks or 1)

    def optimizer_seconds(self, micro_batches: int = 1) -> float:
        """The optimizer's share of one step with ``micro_batches`` micro-batches, seconds.

        ``adamw``: the fused step, memory-bound over the trainable parameters
        (:data:`ADAMW_BYTES_PER_PARAM` at the card's memory bandwidth). ``adamw8bit``:
        :data:`ADAMW8BIT_BYTES_PER_PARAM` at the card's memory bandwidth plus
        :data:`OPTIMIZER_CALL_S` per tensor. ``adamw8bit-bf16``: :data:`ADAMW8BIT_BF16_BYTES_PER_PARAM`
        at the card's memory bandwidth plus :data:`TORCHAO_CHUNK_CALL_S` per chunk of 8-bit tensors,
        :data:`TORCHAO_FLAT_CALL_S` for the flat call and :data:`TORCHAO_CALL_S` per other tensor.
        ``adamw-offload``: the offloaded parameters' fp32 gradients to the host after every
        micro-batch and their weights back (4 B each way per parameter over
        ``host_link_bytes_per_s``; the copies overlap the backward only in part, so all are
        counted), AdamW on the CPU (:data:`CPU_ADAMW_PARAMS_PER_S`), and fused AdamW on the GPU
        for the rest.
        """
        c, bw = self.cost, self.profile.memory_bytes_per_s or 500e9
        if self.optimizer == "adamw8bit":
            return c.trainable_params * ADAMW8BIT_BYTES_PER_PARAM / bw + c.trainable_tensors * OPTIMIZER_CALL_S
        if self.optimizer == "adamw8bit-bf16":
            alone = c.trainable_tensors - c.chunked_tensors - c.flat_tensors
            return (c.trainable_params * ADAMW8BIT_BF16_BYTES_PER_PARAM / bw + c.chunk_calls * TORCHAO_CHUNK_CALL_S
                    + bool(c.flat_tensors) * TORCHAO_FLAT_CALL_S + alone * TORCHAO_CALL_S)
        if self.optimizer == "adamw-offload":
            n = c.offloaded_params
            link = 4 * n * (micro_batches + 1) / self.profile.host_link_bytes_per_s
            return link + n / CPU_ADAMW_PARAMS_PER_S + (c.trainable_params - n) * ADAMW_BYTES_PER_PARAM / bw
        return c.trainable_params * ADAMW_BYTES_PER_PARAM / bw

    def step_seconds(self, precision: str, micro_batch: int, effective_batch: int, checkpointed: int,
                     policies=None) -> float:
        """One optimizer step: ``ceil(E / mb)`` micro-batches (the last may be smaller) + the
        optimizer (:meth:`optimizer_seconds`)."""
        return sum(self.step_parts(precision, micro_batch, effective_batch, checkpointed, policies)) \
            + self.optimizer_seconds(accumulation_steps(effective_batch, micro_batch))

    def step_parts(self, precision: str, micro_batch: int, effective_batch: int, checkpointed: int,
                   policies=None) -> tuple[float, float, float]:
        """``(forward + backward, recomputation, host transfers not hidden)`` seconds of one
        optimizer step's micro-batches (the AdamW step not included)."""
        full, rest = divmod(effective_batch, micro_batch)
        parts = [full * x for x in self.micro_batch_parts(precision, micro_batch, checkpointed, policies)]
        if rest:
            parts = [a + b for a, b in zip(parts, self.micro_batch_parts(precision, rest, checkpointed, policies))]
        return tuple(parts)

    def samples_per_s(self, precision: str, micro_batch: int, effective_batch: int, checkpointed: int,
                      policies=None) -> float:
        return effective_batch / self.step_seconds(precision, micro_batch, effective_batch, checkpointed, policies)

    def calibrate(self, precision: str, micro_batch: int, checkpointed: int, measured_step_s: float,
                  effective_batch: int) -> "TimeModel":
        """A model whose achieved share for ``precision`` reproduces a measured step time
        (the share is kept within (0, 1])."""
        opt = self.optimizer_seconds(accumulation_steps(effective_batch, micro_batch))
        compute = self.step_seconds(precision, micro_batch, effective_batch, checkpointed) - opt
        share = (self.achieved_share or {}).get(precision, ACHIEVED_SHARE)
        measured = max(measured_step_s - opt, 1e-9)
        new = dict(self.achieved_share or {})
        new[precision] = min(1.0, max(1e-3, share * compute / measured))
        return replace(self, achieved_share=new)


def mfu(flops_per_sample: float, samples_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: ``3 x forward FLOPs x samples/s / peak FLOP/s`` (PaLM, Chowdhery
    et al. 2022, appendix B; recomputation not counted)."""
    return 3 * flops_per_sample * samples_per_s / peak_flops if peak_flops else math.nan
