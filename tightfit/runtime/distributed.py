"""Several processes training one model: PyTorch's own engine (torchrun, DDP, FSDP2) under
tightfit's plan and guards.

The process group comes from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT``): NCCL on CUDA, gloo on the CPU. Multi-node is the same
rendezvous (``docs/distributed.md``). What tightfit adds is only what keeps its guarantees
across ranks:

* **Data.** Each accumulation window (``effective_batch`` samples, the same on every rank) is
  cut into ``world_size`` contiguous shares that differ by at most one sample
  (:func:`shard_of`); every rank runs the same number of micro-batches (a rank whose share is
  short adds a zero-weight micro-batch, so the collectives of the step line up), and the loss is
  divided by the samples of the whole window, all ranks together (:meth:`World.normaliser`).
  So micro-batch x accumulation steps x world size = effective batch, and no sample is seen
  twice or skipped.
* **Out of memory.** DDP's gradient all-reduce runs only in the backward of a window's last
  micro-batch (``require_backward_grad_sync`` is off before it, as ``DDP.no_sync`` does). At the
  end of that micro-batch's forward (a forward hook on the user's module, which runs before DDP
  arms its all-reduce) the ranks agree with one all-reduce of a flag (:class:`WindowGuard`): a
  rank that ran out of memory earlier in the window joins that same all-reduce from its
  recovery path, so every rank learns of it, none waits alone in a collective, and all redo the
  window with the same halved micro-batch. An OOM after the agreement (in the synchronising
  backward or the optimizer step), or any OOM under FSDP2 (whose forward all-gathers), stops
  the run with a clear error: torchrun then ends every rank, and ``--resume`` continues.
* **Non-finite steps.** DDP leaves bit-identical gradients on every rank and FSDP2's clipping
  computes the global norm, so every rank takes the same skip decision (tests check it).
* **Stops.** The stop request of a signal is OR-ed across ranks with the step's loss.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch

from ..errors import TightfitError
from ..buffers import buffer_snapshot, restore_buffers

_log = logging.getLogger(__name__)

# NVLink multicast (NVLS) is kept off: set in every process tightfit starts or joins.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory in this window: this rank redoes the window too (a
    ``torch.OutOfMemoryError``, so the trainer's one OOM path handles it)."""


# What gloo and torch.distributed say when a collective loses a peer that has exited (its own error
# said why, on its own stderr): gloo raises a plain RuntimeError.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote worker crashing")


def lost_a_peer(e: BaseException) -> bool:
    """Whether ``e``, raised in a process of several (under torchrun), is a collective's error
    after another process ended (its error, if any, is its own to say): gloo's error (a
    RuntimeError or ``DistNetworkError``) of a connection the peer closed or reset. Not every
    ``DistNetworkError``: a store that could not be reached (a client timed out connecting, a port
    in use) is one too, which no process's exit explains and whose own message is the one to show."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not isinstance(e, RuntimeError):
        return False
    return any(s in str(e) for s in _PEER_GONE)


def shard_of(window: list[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous share of ``window``: shares differ by at most one sample (the
    first ``len(window) % world_size`` ranks hold one more), and together they are ``window``."""
    base, extra = divmod(len(window), world_size)
    start = rank * base + min(rank, extra)
    return window[start:start + base + (rank < extra)]


def micro_batches_per_rank(window_size: int, world_size: int, micro_batch: int) -> int:
    """Micro-batches every rank runs for a window: those of the largest share (at least one)."""
    largest = -(-window_size // world_size)
    return max(1, -(-largest // micro_batch))


@dataclass
class World:
    """This process's place among the ranks (a single process: rank 0 of 1).

    Attributes:
        rank, size, local_rank: from torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.
        backend: ``"nccl"``, ``"gloo"`` or None (one process).
        sharding: ``"none"``, ``"ddp"``, ``"fsdp"`` or ``"fsdp-offload"``, set by :meth:`wrap`
            (one process may run ``"fsdp-offload"``: FSDP2 over a process group of one).
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    backend: str | None = None
    sharding: str = "none"
    _armed: "WindowGuard | None" = None  # the guard whose agreement the next forward ends with
    _own_group: bool = False  # a one-process group made by wrap() for parameter offload

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that plans and writes the run folder."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def sharded(self) -> bool:
        """FSDP2 holds the model (``fsdp`` or ``fsdp-offload``): its state is DTensors, written
        and read with torch.distributed.checkpoint."""
        return self.sharding in ("fsdp", "fsdp-offload")

    @property
    def writes_dcp(self) -> bool:
        """Checkpoints go through :mod:`.sharded_checkpoint` (several processes, or FSDP2 alone)."""
        return self.distributed or self.sharded

    # ---------------------------------------------------------------- the process group
    @classmethod
    def from_env(cls, device: str = "auto") -> "World":
        """Join the process group that torchrun describes in the environment (one process when
        ``WORLD_SIZE`` is unset or 1). NCCL with one GPU per process (``cuda:LOCAL_RANK``) when
        CUDA is used, else gloo; NVLink multicast is kept off.

        Raises:
            TightfitError: fewer visible GPUs than local processes.
        """
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size <= 1:
            return cls()
        import torch.distributed as dist

        for k, v in NO_MULTICAST_ENV.items():
            os.environ.setdefault(k, v)
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            if local >= torch.cuda.device_count():
                raise TightfitError(f"process {local} of this node has no GPU: {torch.cuda.device_count()} visible "
                                    f"(--nproc-per-node must not exceed the GPUs)")
            torch.cuda.set_device(local)
        backend = "nccl" if cuda else "gloo"
        if not dist.is_initialized():
            # Imported before the group exists: imported after, torch.distributed.checkpoint keeps
            # references to the default group that outlive destroy_process_group, so gloo's
            # threads live on into interpreter shutdown, where a still-running C++ thread aborts
            # the process ("terminate called without an active exception"; pytorch/pytorch#190489)
            from torch.distributed import checkpoint  # noqa: F401
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                                    device_id=torch.device("cuda", local) if cuda else None)
        if rank != 0:  # rank 0 speaks for the run; the others say only what stops them
            logging.getLogger("tightfit").setLevel(logging.ERROR)
        return cls(rank, size, local, backend)

    def _one_process_group(self, cuda: bool) -> None:
        """A process group of this process alone, which FSDP2 needs even on one GPU (an in-memory
        store: no port, no rendezvous); NCCL for the GPU, gloo for host tensors (gloo alone on
        the CPU, where the runtime's path is tested without the offload itself)."""
        import torch.distributed as dist

        if dist.is_initialized():
            return
        from torch.distributed import checkpoint  # noqa: F401  (before the group: see from_env)

        if cuda:
            dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._own_group = True

    def close(self) -> None:
        """Leave the process group (after the last collective, on every rank: it waits for all)."""
        if self._own_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._own_group = False
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                # No rank tears its connections down while a peer still uses them: gloo aborts
                # the process (SIGABRT) when a peer closes a pair it is reading.
                dist.barrier()
                dist.destroy_process_group()

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    # ---------------------------------------------------------------- collectives
    def all_sum(self, values: list[float]) -> list[float]:
        """``values`` summed over the ranks (float64; one all-reduce)."""
        if not self.distributed:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        dist.all_reduce(t)
        return t.tolist()

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (pickled)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj) -> list:
        """Every rank's ``obj``, by rank, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def decide(self, fn):
        """Run ``fn()`` on rank 0 and give its result to every rank; a TightfitError it raises
        is raised on every rank (no rank is left waiting for the result)."""
        if not self.distributed:
            return fn()
        result = error = None
        if self.is_main:
            try:
                result = fn()
            except TightfitError as e:
                error = str(e)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise TightfitError(error)
        return result

    # ---------------------------------------------------------------- the data of a window
    def shard(self, window: list[int]) -> list[int]:
        """This rank's samples of ``window`` (:func:`shard_of`)."""
        return shard_of(window, self.rank, self.size) if self.distributed else window

    def padding(self, window: list[int], micro_batch: int) -> int:
        """Zero-weight micro-batches this rank adds so that every rank runs
        :func:`micro_batches_per_rank` of them."""
        if not self.distributed:
            return 0
        own = -(-len(self.shard(window)) // micro_batch)
        return micro_batches_per_rank(len(window), self.size, micro_batch) - own

    def normaliser(self, local_count: float) -> float:
        """What each rank divides its summed loss by: the window's samples (or tokens) over all
        ranks, divided by the world size because DDP and FSDP2 average the ranks' gradients."""
        if not self.distributed:
            return local_count
        return self.all_sum([local_count])[0] / self.size

    # ---------------------------------------------------------------- the model
    def wrap(self, model: torch.nn.Module, sharding: str, precision: str = "fp32",
             device: torch.device | None = None) -> torch.nn.Module:
        """``model`` under DDP or FSDP2 (``fully_shard`` on each repeated block, then on the
        whole), as ``sharding`` says; unchanged for one process unless ``fsdp-offload``. Call it
        before the optimizer is made (FSDP2 replaces the parameters by sharded ones).

        ``fsdp-offload`` (parameter offload): FSDP2's ``CPUOffloadPolicy``, the fp32 shards of the
        parameters and their gradients in pinned host memory (AdamW's state follows them there:
        the optimizer steps on the CPU), each block's parameters copied to the GPU for its
        forward and again for its backward. Under ``bf16`` they are gathered in bf16 and their
        gradients reduced in fp32 (``MixedPrecisionPolicy``): a block on the GPU costs half.
        ``model`` may be on the CPU: ``fully_shard`` moves each block to the GPU, then its shard
        to the host, so the whole model is never on the GPU. On a CPU ``device`` (tests) the
        same FSDP2 path runs without the policy: the shards are in host memory already.

        Raises:
            TightfitError: FSDP2 asked for a model without repeated blocks.
        """
        offload = sharding == "fsdp-offload"
        self.sharding = sharding if self.distributed or offload else "none"
        if self.sharding == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            import inspect

            cuda = self.backend == "nccl"
            # No buffer sync in the forward (no collective there: a rank that runs out of memory in
            # it leaves no one waiting; the weights and buffers are synced once, at construction);
            # gradients as views of DDP's buckets (no extra copy). torch >= 2.13 renames the flag.
            sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters
                    else "broadcast_buffers")
            # The agreement runs at the end of the user's module's forward, before DDP's own
            # post-forward arms the gradient all-reduce: a window abandoned there leaves DDP unarmed.
            model.register_forward_hook(self._agree_after_forward)
            return DDP(model, device_ids=[self.local_rank] if cuda else None, gradient_as_bucket_view=True,
                       **{sync: False})
        if self.sharded:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            from ..levers.blocks import find_blocks

            blocks = find_blocks(model)
            if not blocks:
                raise TightfitError("FSDP2 sharding needs a model with repeated blocks (transformer layers)")
            options = {}
            cuda = (device.type == "cuda") if device is not None else self.backend == "nccl"
            if offload and not self.distributed:
                self._one_process_group(cuda)
                if not cuda:
                    from torch.distributed.device_mesh import init_device_mesh

                    options["mesh"] = init_device_mesh("cpu", (1,))
            if offload and cuda:  # on the CPU the parameters are in host memory already
                options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
                if precision == "bf16":
                    options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in blocks:
                fully_shard(block, **options)
            fully_shard(model, **options)
        return model

    def reshard(self, model: torch.nn.Module) -> None:
        """Under FSDP2 (``model``: the root module): end what an interrupted pass (an OOM) left open,
        so that the redo starts as a fresh pass does. A backward that raised never ran FSDP2's
        end-of-backward callback, whose flag then stays set: the redo's backward would not queue
        it, and the root's gradients (embeddings, head) would never be reduced. The callback is run
        here (what it reduces, the caller's ``zero_grad`` then clears); then the parameters left
        all-gathered are freed. (torch 2.13's ``FSDPModule.reset_iter_state`` is not used: after
        a backward that raised, the redo's gradients then differed from the plain runtime's, as
        if the failed pass's unreduced gradients were kept; ``tests/test_param_offload.py``.)
        Call it outside the ``except`` block, once the failed pass's graph is freed: the callback
        allocates what it reduces."""
        if self.sharded:
            state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
            if state is not None and getattr(state._state_ctx, "post_backward_final_callback_queued", False):
                state._root_post_backward_final_callback()
            for m in model.modules():
                if hasattr(m, "reshard") and type(m).__name__.startswith("FSDP"):
                    m.reshard()

    @staticmethod
    def unwrap(model: torch.nn.Module) -> torch.nn.Module:
        """The user's module inside a DDP wrapper (FSDP2 shards in place: the module itself)."""
        return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model

    def set_gradient_sync(self, model: torch.nn.Module, sync: bool) -> None:
        """DDP: all-reduce gradients in the next backward only if ``sync`` (what ``no_sync()``
        sets; read by DDP's forward). FSDP2 reduce-scatters every micro-batch: its gradients then
        stay sharded, which is what makes it fit."""
        if self.sharding == "ddp":
            model.require_backward_grad_sync = sync

    def seed_rank(self, seed: int) -> None:
        """Seed the run's random streams (dropout, augmentation) from ``seed``: each rank its own
        (the same weights come from rank 0); one process by ``seed`` itself, so that a ``Trainer``
        made by hand trains alike at each run of the same ``TrainConfig(seed=...)``."""
        from ..rng import seed_everything

        seed_everything(seed + 1_000_003 * self.rank if self.distributed else seed)

    def _agree_after_forward(self, module, args, output):
        guard, self._armed = self._armed, None
        if guard is not None:
            guard.agree(failed=False)

    def guard(self, model: torch.nn.Module, loss_sum, micro_batches: int, padding: int) -> "WindowGuard":
        """The loss function of one attempt at a window (see :class:`WindowGuard`)."""
        return WindowGuard(self, model, loss_sum, micro_batches, padding)

    def on_oom(self, exc: BaseException, guard: "WindowGuard | None") -> None:
        """Called on every rank whose attempt at a window ran out of memory, before it redoes the
        window: a rank whose own OOM came before the agreement joins it (so the others learn of
        it). An OOM past the agreement, or under FSDP2, cannot be agreed on without a rank left
        in a collective: it stops this rank (torchrun then stops the others).

        Raises:
            TightfitError: the OOM cannot be recovered from together.
        """
        if isinstance(exc, PeerOutOfMemory) or not self.distributed:
            return  # one process (parameter offload too): the trainer redoes the window (reshard first)
        if self.sharded or guard is None or guard.agreed:
            where = "under FSDP2 (its collectives run in every pass)" if self.sharded else \
                "after the ranks had agreed to synchronise the gradients"
            raise TightfitError(f"out of memory on rank {self.rank} {where}: every rank stops; continue with "
                                "--resume (from the last checkpoint) and a smaller --budget share or checkpointing")
        guard.agree(failed=True)

    def after_step(self, loss: float, stop: bool) -> tuple[float, bool]:
        """The window's loss averaged over the ranks, and whether any rank asked to stop (one
        all-reduce per step)."""
        if not self.distributed:
            return loss, stop
        total, stops = self.all_sum([loss, float(stop)])
        return total / self.size, stops > 0


class WindowGuard:
    """The loss function of one attempt at a window on one rank: it switches DDP's gradient
    all-reduce on for the last micro-batch only, gives padding micro-batches zero weight (and
    BatchNorm's running statistics back as they were before them, :meth:`restore_statistics`), and,
    after the last micro-batch's forward and before its (synchronising) backward, agrees with
    the other ranks that no one ran out of memory.

    Attributes:
        agreed: the agreement of this attempt has taken place.
    """

    def __init__(self, world: World, model, loss_sum, micro_batches: int, padding: int):
        self.world, self.model, self.loss_sum = world, model, loss_sum
        self.n, self.real = micro_batches, micro_batches - padding
        self.i = 0
        self.agreed = False
        self._kept: list = []  # the buffers before the first padding micro-batch (restore_statistics)

    def agree(self, failed: bool) -> None:
        """One all-reduce of "someone failed" (every rank calls it once per attempt).

        Raises:
            PeerOutOfMemory: another rank ran out of memory in this window.
        """
        self.agreed = True
        if self.world.all_sum([float(failed)])[0] > 0 and not failed:
            raise PeerOutOfMemory("another rank ran out of memory in this window")

    def __call__(self, model, batch) -> torch.Tensor:
        i, self.i = self.i, self.i + 1
        last = i == self.n - 1
        self.world.set_gradient_sync(model, last)
        if last and self.world.sharding == "ddp":
            self.world._armed = self  # the model's forward ends with the agreement (World.wrap)
        padding = i >= self.real
        if padding and not self._kept:  # repeats of this rank's samples: BatchNorm must not count them
            self._kept.append(buffer_snapshot(model.modules()))
        try:
            loss = self.loss_sum(model, batch)
        finally:
            self.world._armed = None
        if padding:
            loss = loss * 0.0  # keeps the collectives in step, adds nothing
        return loss

    def restore_statistics(self) -> None:
        """After the window's backward: BatchNorm's running statistics back to what they were
        before its padding micro-batches (not at once after their forward: autograd saved the
        statistics for their backward and would refuse them changed in place)."""
        if self._kept:
            restore_buffers(self._kept.pop())
