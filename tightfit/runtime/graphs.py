"""The eager step replayed as CUDA graphs: one capture per batch shape, no launches on the host.

An eager step of a small model is bound by the host that launches its kernels: the main job's
step (MiniLM, 32 x 64 tokens, bf16) took 14.0-25.1 ms, depending on the host, of which the GPU
needed ~3 ms; captured whole (forward, backward, clipping and fused AdamW in one
``torch.cuda.graph``) it ran in 3.2 ms, with the same losses and weights checksum over 6 steps,
dropout on (NVIDIA H100, bench/results/cuda-graphs).

:class:`StepGraphs` runs :func:`tightfit.step.training_step` itself under capture -- the one step,
its guards included: the clipping, the non-finite verdict handed to fused AdamW on the device
(``found_inf``), the gradients freed at the end -- so a replay does what the eager step does.
What a replay cannot do, the capture is kept from needing:

- **Shapes are fixed**: one graph per key (every input's shape and dtype, and the window's
  normaliser, which the graph holds as a constant). A key is captured the next time it comes;
  its first step runs eagerly, which also creates the optimizer's state (an allocation captured
  would be replayed as a reset) and measures the memory the step needs above what is allocated
  (at a later step where the first created the optimizer's state).
  At most :data:`MAX_GRAPHS` keys are captured; the rest run eagerly.
- **The learning rate moves**: during capture each parameter group's ``lr`` is a 0-d fp32 CUDA
  tensor (fused AdamW reads a tensor ``lr`` on the device), written before every replay; between
  steps the groups hold the schedule's floats as always. Eager steps run at the same rate rounded
  to fp32 (:func:`fp32_rates`), so they and the replays update alike to the last bit.
- **Dropout**: PyTorch registers the CUDA generator with the graph, so each replay draws the
  next random numbers in order, as the eager step would (``torch.cuda.get_rng_state`` moves on
  with the replays: checkpoints and resumes stay exact).
- **Memory**: the graphs share one private pool, which holds the largest captured step's
  intermediates (each replay frees them all; its only output, ``[grad norm, loss]``, is copied
  out before the next replay). A key is captured only if what is allocated, the pool so far and
  twice the step's measured need (its graph, and an eager step beside it) fit in 95% of the
  plan's budget; otherwise it runs eagerly.
- **No host syncs**: a step that reads a value on the host cannot be captured, and under torch
  2.11 a capture that fails part-way keeps its memory and stops the caching allocator from
  returning any memory until the process ends (pytorch/pytorch#190308). The run's first eager
  steps are therefore watched (:func:`host_syncs`) until one is seen clean, and no key is
  captured before; after :data:`SYNCING_STEPS` syncing steps graphs are off for the run. A
  capture that fails anyway also turns them off; that step runs eagerly. The watched steps are
  also checked for random numbers drawn on the CPU (LayerDrop), which a replay would not draw
  again: graphs off.

Used only where every step is a plain eager step of one micro-batch: CUDA, one process, fused
AdamW (``plan.optimizer == "adamw"``), no compilation, no activation checkpointing or per-block
policy, no loss scaling (fp16's scaler keeps per-step state in Python), a model without module or
parameter hooks or submodules the user compiled (:func:`graphs_unavailable`). docs/cuda-graphs.md
has the measurements.
"""

from __future__ import annotations

import contextlib
import random
import struct
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..errors import error_line
from ..levers.compile import MODULE_HOOKS, compiled_call, has_hooks
from ..step import PendingStep, training_step, update_applied

SYNCING_STEPS = 2  # eager steps seen syncing on the host that turn graphs off
MAX_GRAPHS = 16  # keys captured at most (the main job's run met 4)
FIT = 0.95  # share of the budget a capture may bring the memory to (the planner's margin)


def graphs_unavailable(plan, model: torch.nn.Module, distributed: bool = False) -> str | None:
    """Why ``plan``'s steps of ``model`` cannot be replayed as CUDA graphs (None: they can,
    window by window).

    Args:
        plan: a :class:`tightfit.plan.Plan`.
        model: the model trained; one with module hooks is not replayed (a replay runs no Python:
            a hook that counts or records would silently stop doing so).
        distributed: several processes train together.
    """
    if plan.device != "cuda":
        return "not on a CUDA GPU"
    if plan.sharding == "fsdp-offload" and not distributed:
        return "parameter offload (FSDP2) brings the parameters from host memory at every step"
    if distributed or plan.sharding != "none":
        return "the plan shards or replicates the model over processes"
    if plan.compile:
        return "the plan compiles the model (torch.compile)"
    if plan.activation_checkpointing or any(p != "none" for p in plan.block_policies or ()):
        return "the plan recomputes or offloads activations"
    if plan.precision == "fp16":
        return "fp16's loss scaler keeps per-step state on the host"
    if plan.optimizer != "adamw":
        return f"the optimizer {plan.optimizer} is not captured (fused AdamW only)"
    if plan.accumulation_steps > 1:
        return "the plan accumulates several micro-batches per step"
    hooked = next((name or "the model" for name, m in model.named_modules() if has_hooks(m)), None)
    hooked = hooked or next((name for name, p in model.named_parameters()
                             if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)), None)
    if hooked is not None or any(getattr(torch.nn.modules.module, "_global" + h) for h in MODULE_HOOKS):
        return f"{hooked or 'a global module hook'} has a hook, which a replay would not run"
    compiled = next((name or "the model" for name, m in model.named_modules()
                     if compiled_call(m) is not None or type(m).__name__ == "OptimizedModule"), None)
    if compiled is not None:  # its compiler may compile or autotune at the capture, which then fails
        return f"{compiled} is compiled by torch.compile"
    return None


@contextlib.contextmanager
def host_syncs(found: list[str]):
    """Within the block, append to ``found`` the message of each synchronizing CUDA call this
    thread makes (``.item()``, a copy to pageable host memory, a stream or event synchronize):
    torch's sync debug mode set to ``"warn"``, its warnings taken from this thread only and not
    shown; the mode and the warning filters are restored after. Warnings of other threads in the
    meantime are shown as usual. torch calls the mode a prototype that does not see every
    synchronizing operation."""
    me, mode = threading.get_ident(), torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        show = warnings.showwarning

        def take(message, category, filename, lineno, file=None, line=None):
            if threading.get_ident() == me and "synchroniz" in str(message):
                found.append(str(message).strip().splitlines()[0][:120])
            else:
                show(message, category, filename, lineno, file, line)

        warnings.filterwarnings("always", message=".*synchroniz")
        warnings.showwarning = take
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode(mode)


@contextlib.contextmanager
def fp32_rates(optimizer):
    """Within the block, each parameter group's learning rate rounded to the nearest fp32 value:
    the rate a replayed update reads from its fp32 tensor. The fused kernel takes a Python rate as
    a double, so an eager step at the unrounded rate could differ from a replay in the last bit of
    an update; with both at the rounded rate, the eager steps of a run with graphs (the first of
    each shape, those after a resume) update exactly as its replays. The groups get their rates
    back after (the schedule, checkpoints and the metrics keep them unrounded)."""
    groups = optimizer.param_groups
    rates = [g["lr"] for g in groups]
    for g, rate in zip(groups, rates):
        g["lr"] = struct.unpack("f", struct.pack("f", rate))[0]
    try:
        yield
    finally:
        for g, rate in zip(groups, rates):
            g["lr"] = rate


# What a new stream's cuBLAS workspaces take at most (cuBLAS and cuBLASLt, each 32 MiB on Hopper
# under torch 2.11's defaults, less on older cards; 65 MiB allocated measured on an H100,
# bench/results/cuda-graphs call 7): counted by the capture check before the stream is made.
STREAM_WORKSPACE_BYTES = 66 << 20

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the captures' stream, one per process
_WARMED: set[tuple[int, int]] = set()  # (device index, thread) whose cuBLAS handle has its workspace on it
_STREAMS_LOCK = threading.Lock()


def _index(device: torch.device) -> int:
    """``device``'s CUDA index (no index: the current device's)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's stream for captures on ``device`` (a CUDA device; no index: the current one),
    shared by every :class:`StepGraphs`: cuBLAS keeps a workspace for each stream it has run on
    until the process ends (65 MiB on an H100, measured), so a stream per run would leave that
    much behind at every run. The calling thread's workspaces for it (cuBLAS's handles are per
    thread) are made here, by one small matmul in fp32 and in bf16, in the ordinary pool before
    the thread's first capture: made during a capture, they would land in the graphs' private pool
    and keep it from being returned.

    Raises:
        torch.OutOfMemoryError: no memory for the workspaces; other CUDA errors unchanged.
    """
    index = _index(device)
    with _STREAMS_LOCK:
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
        warmed = (index, threading.get_ident()) in _WARMED
    if warmed:
        return stream
    current = torch.cuda.current_stream(index)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for dtype in (torch.float32, torch.bfloat16):
            if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
                continue  # a card without bf16 GEMMs (Pascal, Turing) runs no bf16 step either
            a = torch.ones(16, 16, device=index, dtype=dtype)
            torch.addmm(a, a, a)
    current.wait_stream(stream)
    with _STREAMS_LOCK:
        _WARMED.add((index, threading.get_ident()))
    return stream


def _stream_made(device: torch.device) -> bool:
    """Whether :func:`capture_stream` has made this thread's workspaces on ``device``'s stream."""
    return (_index(device), threading.get_ident()) in _WARMED


def _end_generator_capture(device: torch.device) -> None:
    """Give the CUDA generator a copy of its state (same seed and offset) after a capture that
    failed: torch 2.11 leaves the state it registered for the capture marked as capturing, and
    every later random op then fails ("Offset increment outside graph capture"). The capture drew
    nothing from the real offset, so the eager steps go on with the numbers they would have had."""
    generator = torch.cuda.default_generators[_index(device)]
    generator.graphsafe_set_state(generator.clone_state())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]  # the batch the graph reads, copied in before each replay
    values: torch.Tensor  # [grad norm, loss] the graph writes (fp32, 2 elements)


class StepGraphs:
    """Replays one-micro-batch training steps as CUDA graphs (see the module doc).

    Args:
        model, optimizer, loss_sum, scaler, autocast_ctx, max_grad_norm: as
            :func:`tightfit.step.training_step` takes them (``optimizer``: fused AdamW on CUDA).
        budget_bytes: the plan's GPU memory budget (None: the device's total memory).

    Attributes:
        seen: steps given to :meth:`step`; replayed: steps run as a replay; captured: graphs
            captured; declined: captures the budget declined; pool_bytes: memory the graphs held now have added to the reserved
            memory (bytes), pool_peak: the most they held; off: why graphs stopped (None: on).
    """

    def __init__(self, model: torch.nn.Module, optimizer, loss_sum: Callable, scaler, autocast_ctx: Callable,
                 max_grad_norm: float | None, budget_bytes: int | None):
        self.model, self.optimizer, self.loss_sum, self.scaler = model, optimizer, loss_sum, scaler
        self.autocast_ctx, self.max_grad_norm = autocast_ctx, max_grad_norm
        self.device = next(p.device for g in optimizer.param_groups for p in g["params"])
        self.budget = budget_bytes or torch.cuda.get_device_properties(self.device).total_memory
        self._graphs: dict[tuple, _Graph] = {}
        self._need: dict[tuple, int] = {}  # key -> bytes its eager step allocated above what was allocated
        self._declined: set[tuple] = set()
        self._pool = None
        self._lrs = [torch.zeros((), dtype=torch.float32, device=self.device) for _ in optimizer.param_groups]
        self.replayed = self.captured = self.pool_bytes = self.pool_peak = self.declined = self.seen = 0
        self._syncing = 0  # eager steps seen to sync on the host
        self._watched = False  # an eager step was watched and seen clean: later keys are only measured
        self.off: str | None = None

    def step(self, micro_batches: Iterator[dict], normaliser: float) -> PendingStep:
        """One step on the window's only micro-batch (the first of ``micro_batches``): a replay of
        its key's graph, a capture then a replay, or the eager step. Returns its
        :class:`~tightfit.step.PendingStep`.

        Raises:
            Errors of the eager step, out-of-memory included, unchanged (a replay allocates nothing;
            a capture or the captures' stream that fails turns graphs off instead).
        """
        batch = next(micro_batches)
        self.seen += 1
        key = (tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items())), float(normaliser))
        graph = self._graphs.get(key)
        if graph is None and key in self._need and self._may_capture(key):
            graph = self._capture(key, batch, normaliser)
        if graph is None:
            return self._eager(key, batch, normaliser)
        for name, t in batch.items():
            graph.inputs[name].copy_(t, non_blocking=True)
        for lr, group in zip(self._lrs, self.optimizer.param_groups):
            lr.fill_(group["lr"])  # the schedule's rate for this step (a kernel, no sync)
        graph.graph.replay()
        self.replayed += 1
        with update_applied():  # the replay has applied the update: an OOM in the verdict's tensor is not redone
            return PendingStep(graph.values)

    def why_none(self) -> str:
        """Why no step was replayed though graphs stayed on: the budget declined every capture, or
        no batch shape came again after its measured eager step."""
        if self.declined:
            return "the budget cannot hold a step's graph beside an eager step"
        return (f"no batch shape came again after its first, measured, eager step ({self.seen} step"
                f"{'' if self.seen == 1 else 's'} in this session; a run's first step, which makes the "
                "optimizer's state, is not measured)")

    def release(self) -> None:
        """Drop every captured graph and give their pool's memory back to the device (the end of
        :meth:`Trainer.fit <tightfit.runtime.trainer.Trainer.fit>`, an out-of-memory back-off, a
        failed capture); keys are captured again when they next come. Waits for the GPU (the
        graphs may still be running)."""
        if self._pool is None:
            return
        torch.cuda.synchronize(self.device)
        for g in self._graphs.values():
            g.graph.reset()
        self._graphs.clear()
        self._declined.clear()
        self._pool, self.pool_bytes = None, 0
        torch.cuda.empty_cache()  # a private pool's memory is returned once no graph uses it

    def _eager(self, key: tuple, batch: dict, normaliser: float) -> PendingStep:
        def run():
            with fp32_rates(self.optimizer):  # the rate a replay reads: eager steps and replays update alike
                return training_step(self.model, iter([batch]), self.loss_sum, normaliser, self.optimizer,
                                     self.scaler, self.autocast_ctx, self.max_grad_norm, defer=True)

        if key in self._need or self.off is not None:
            return run()
        # A key not yet cleared for capture: measured (what its step allocates above what is
        # allocated; not at the step that creates the optimizer's state, which only it allocates)
        # and, until one step is seen clean, watched for host syncs (a capture cannot hold them: it
        # would fail, and torch 2.11 then keeps the memory it reserved, and returns no cached
        # memory, until the process ends) and for random numbers drawn on the CPU (e.g. LayerDrop),
        # which a replay would not draw again.
        before, states, syncs = torch.cuda.memory_allocated(self.device), len(self.optimizer.state), []
        if self._watched:
            pending = run()
        else:
            cpu_rng, py_rng = torch.random.get_rng_state(), random.getstate()
            with host_syncs(syncs):
                pending = run()
            if not torch.equal(cpu_rng, torch.random.get_rng_state()) or py_rng != random.getstate():
                self.off = "the step draws random numbers on the CPU (e.g. LayerDrop), which a replay would not draw"
                return pending
            if syncs:
                self._syncing += 1  # a first step may sync once (a lazy initialisation): twice is the step's own
                if self._syncing >= SYNCING_STEPS:
                    self.off = f"the step reads a value on the host ({syncs[0]}), which a CUDA graph cannot capture"
                return pending
            self._watched = True
        if len(self.optimizer.state) == states:  # the allocator counts at launch: no sync to read the peak
            self._need[key] = max(0, torch.cuda.max_memory_allocated(self.device) - before)
        return pending

    def _may_capture(self, key: tuple) -> bool:
        if self.off is not None or key in self._declined:
            return False
        if len(self._graphs) >= MAX_GRAPHS:
            return False
        # its graph and an eager step beside it, each up to the largest need measured (its own
        # included), and the captures' stream's workspaces where this thread has not made them yet
        extra = 0 if _stream_made(self.device) else STREAM_WORKSPACE_BYTES
        if torch.cuda.memory_allocated(self.device) + extra + self.pool_bytes + 2 * max(self._need.values()) \
                > FIT * self.budget:
            self._declined.add(key)  # runs eagerly from now on
            self.declined += 1
            return False
        if extra:
            try:
                capture_stream(self.device)
            except Exception as e:  # noqa: BLE001 - no memory for its workspaces, say: eager from now on
                self.off = f"the captures' stream could not be made: {error_line(e)}"
                return False
        return True

    def _capture(self, key: tuple, batch: dict, normaliser: float) -> _Graph | None:
        """Capture the step for ``key`` (nothing runs until the replay); None if capture failed,
        which turns graphs off (``off`` says why) and leaves the gradients freed."""
        groups = self.optimizer.param_groups
        rates, capturable = [g["lr"] for g in groups], [g.get("capturable") for g in groups]
        inputs = {k: v.clone() for k, v in batch.items()}  # outside the pool: read by every replay
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.device)
        try:
            for g, lr in zip(groups, self._lrs):
                g["lr"], g["capturable"] = lr, True  # fused AdamW: the same kernel, the rate read on the device
            # thread_local: the prefetch and checkpoint threads' own CUDA calls do not break the capture
            with torch.cuda.graph(graph, pool=self._pool, stream=capture_stream(self.device),  # made: no allocation
                                  capture_error_mode="thread_local"):
                pending = training_step(self.model, iter([inputs]), self.loss_sum, normaliser, self.optimizer,
                                        self.scaler, self.autocast_ctx, self.max_grad_norm, defer=True)
            values = pending.values
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: eager from now on
            self.off = (f"capture failed: {error_line(e)} "
                        "(torch may keep the memory it reserved for the capture until the process ends)")
            self.optimizer.zero_grad(set_to_none=True)
            _end_generator_capture(self.device)
            with contextlib.suppress(Exception):  # a capture that failed may hold no graph to destroy
                graph.reset()
            self.release()  # what the failed capture allocated in the pool too
            return None
        finally:  # the groups as the eager step has them: checkpoints of both runs hold the same
            for g, rate, flag in zip(groups, rates, capturable):
                g["lr"], g["capturable"] = rate, flag
        self.captured += 1
        self.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        self.pool_peak = max(self.pool_peak, self.pool_bytes)
        self._graphs[key] = _Graph(graph, inputs, values)
        return self._graphs[key]
