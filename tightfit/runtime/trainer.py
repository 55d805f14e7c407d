"""The training loop: accumulation windows, mixed precision, clipping, and the guards.

Read it top to bottom in :meth:`Trainer.fit`. Each optimizer step consumes one *window* of
``effective_batch`` samples, split into micro-batches of ``plan.micro_batch``; the loss of
every micro-batch is divided by the number of samples in the whole window, so the summed
gradient equals the gradient of one batch made of the same samples (DESIGN invariant 1).
The step itself is :func:`tightfit.step.training_step`, the one the planner's probe and the
memory estimator run too (DESIGN invariant 13); the trainer adds the guards around it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import random
import re
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..config import TrainOptions, _positive_finite, option
from ..devices import DeviceProfile
from ..errors import TightfitError
from ..fileio import UntilClosed
from ..levers.checkpointing import restore_kv_cache, set_activation_checkpointing
from ..levers.compile import compile_model, compile_unavailable, eager_calls, uncompile_model
from ..levers.layout import match_parameter_strides, use_channels_last
from ..levers.trainable import check_trainable
from ..levers.optimizers import cast_weights, hold_gradients, set_lr
from ..buffers import buffer_snapshot, restore_buffers
from ..step import (PendingStep, StepResult, accumulate, changed_since, in_place_versions, make_optimizer,
                    module_mode, train_mode, training_modes, training_step, update_ran)
from ..levers.precision import autocast, make_grad_scaler, nonfinite_advice
from ..plan import Plan, grown_micro_batch
from ..workload import Workload
from .diagnose import stop_phrase
from .distributed import World, micro_batches_per_rank, shard_of
from .health import HealthMonitor
from ..memory.oom import is_oom, release_memory
from .checkpoint_schedule import CheckpointCosts, CheckpointSchedule, first_hold_seconds
from .graphs import StepGraphs, graphs_unavailable
from .prefetch import Prefetcher
from ..rng import capture_rng, restore_rng
from ..units import count_of, format_bytes

_log = logging.getLogger(__name__)


def _folder_path(value) -> str | None:
    """``rule`` of ``checkpoint_dir``: a path (a str or an ``os.PathLike``)."""
    return None if isinstance(value, (str, os.PathLike)) else \
        f"must be a folder path (str or os.PathLike), not {value!r} (a {type(value).__name__})"


@dataclass(frozen=True)
class TrainConfig(TrainOptions):
    """Settings of a run that are not memory/speed choices (those are in the Plan): the training
    options (:class:`tightfit.config.TrainOptions`, where each is documented, defaulted and
    checked) and what the runtime needs besides them.

    Attributes:
        checkpoint_dir: folder for ``ckpt-<step>`` checkpoints (None: no checkpoints).
        cooldown_max_s: the longest pause of one cool-down (``cooldown_temp_c``).
        prefetch: collate the next window in the background and copy micro-batches to the GPU on
            a side stream (:mod:`tightfit.runtime.prefetch`).
        background_checkpoints: write periodic checkpoints on a background thread
            (:mod:`tightfit.runtime.async_checkpoint`); False: on the loop's thread.
    """

    checkpoint_dir: str | None = option(None, cli=False, rule=_folder_path)
    cooldown_max_s: float = option(300.0, cli=False, rule=_positive_finite)
    prefetch: bool = option(True, cli=False)
    background_checkpoints: bool = option(True, cli=False)

    @classmethod
    def from_options(cls, options: TrainOptions, **runtime) -> "TrainConfig":
        """The config of ``options`` with the runtime's own settings (``checkpoint_dir=...``)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(options)}, **runtime)


@dataclass
class TrainResult:
    """What the run did, measured.

    Attributes:
        steps: optimizer steps taken (skipped non-finite steps and windows without targets included).
        samples: training samples consumed.
        train_seconds: wall time of the training loop (evaluation excluded).
        samples_per_s: ``samples / train_seconds``.
        final_loss: mean loss of the last window.
        skipped_steps: steps whose gradients were non-finite (not applied).
        oom_recoveries: windows redone with a smaller micro-batch.
        plan: the plan in force at the end (micro-batch after recoveries).
        peak_allocated_bytes, peak_reserved_bytes: CUDA peaks (None on the CPU).
        eval: last evaluation ``{"accuracy", "loss", "samples"}`` or None.
        step_ends: ``(seconds since this process's loop began, samples so far)`` after each step
            of this process (for the delivered samples/s: :mod:`tightfit.report.speed`).
        checkpoint_seconds: time the training loop was held by checkpoints (snapshots, waiting for a
            write in flight); the last write goes on during the evaluation, and a wait for it
            after the evaluation holds no training (the run's wall time has it, not this);
            checkpoint_write_seconds: time spent writing and hashing them (in the background).
        eval_seconds: wall time of the evaluation.
        graphed_steps, step_graphs, graph_pool_bytes: this session's steps replayed as CUDA graphs,
            the graphs captured and the most memory their pool added (:mod:`.graphs`).
        graphs_off: why this session replayed no step, or stopped replaying (None: it replayed to
            the end), e.g. ``"the plan accumulates several micro-batches per step"``.
    """

    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    samples_per_s: float = 0.0
    final_loss: float = math.nan
    skipped_steps: int = 0
    oom_recoveries: int = 0
    plan: Plan | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    eval: dict | None = None
    events: list[str] = field(default_factory=list)
    step_ends: list[tuple[float, int]] = field(default_factory=list)
    checkpoint_seconds: float = 0.0
    checkpoint_write_seconds: float = 0.0
    eval_seconds: float = 0.0
    graphed_steps: int = 0
    step_graphs: int = 0
    graph_pool_bytes: int = 0
    graphs_off: str | None = None


class StoppedError(TightfitError):
    """Training stopped before its last step, at a step boundary, with the run's state saved.

    Attributes:
        step: optimizer steps done.
        checkpoint: the checkpoint written at the stop (None if the run writes none), from
            which ``--resume`` continues.
    """

    def __init__(self, message: str, step: int = 0, checkpoint: str | None = None):
        super().__init__(message)
        self.step, self.checkpoint = step, checkpoint

    def reworded(self, message: str) -> "StoppedError":
        """The same stop (its type and every attribute: step, checkpoint, a subclass's own) said
        in ``message``."""
        again = copy.copy(self)
        again.args = (message,)
        return again


class NonFiniteTrainingError(StoppedError):
    """Too many optimizer steps in a row had non-finite (inf/NaN) gradients. The weights are
    finite (skipped steps are not applied), so a checkpoint is written at the stop.

    Attributes:
        last_update: the step whose update was the last applied (the weights at the stop are its
            weights; that update may be what spoiled them); None where not known.
    """

    def __init__(self, message: str, step: int = 0, checkpoint: str | None = None, last_update: int | None = None):
        super().__init__(message, step, checkpoint)
        self.last_update = last_update


class TrainingInterrupted(StoppedError):
    """SIGINT (Ctrl-C) or SIGTERM arrived; the run stopped at the next step boundary.

    Attributes:
        signal_name: the signal that stopped it, ``"SIGINT"`` or ``"SIGTERM"`` (the command's exit
            code is 128 plus its number: :func:`tightfit.errors.signal_exit_code`); on a rank that
            stopped on the other ranks' stop vote, what that rank recorded (no signal's name: 130;
            the ``--gpus`` launcher reports a SIGTERM's 143 from any rank first).
    """

    def __init__(self, message: str, step: int = 0, checkpoint: str | None = None, signal_name: str = "SIGINT"):
        super().__init__(message, step, checkpoint)
        self.signal_name = signal_name


class PartialUpdateError(TightfitError):
    """Out of memory inside the optimizer step after it had changed some parameters or state, or
    after the step had applied its update: redoing the step would apply (part of) the update twice
    (DESIGN invariant 10)."""


# Added to the key of a negative seed: Python seeds random.Random from abs(key), so seed -5 shuffled
# epoch 0 as seed 5 did; 2**128 lies beyond every non-negative seed's key (seeds < 2**64), whose
# orders stay as they were.
_NEGATIVE_SEED_KEYS = 2**128


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Sample order of one epoch: a permutation of ``range(n)`` fixed by ``(seed, epoch)``; each
    seed of :data:`tightfit.config.SEED_RANGE` has its own (a negative one too)."""
    order = list(range(n))
    key = seed * 1_000_003 + epoch if seed >= 0 else _NEGATIVE_SEED_KEYS - seed * 1_000_003 + epoch
    random.Random(key).shuffle(order)
    return order


def windows_of(order: list[int], effective_batch: int) -> list[list[int]]:
    """Split an epoch's order into accumulation windows; the last may be shorter (it is stepped,
    normalised by what it holds)."""
    return [order[i:i + effective_batch] for i in range(0, len(order), effective_batch)]


def steps_per_epoch(n: int, effective_batch: int) -> int:
    return math.ceil(n / effective_batch)


def epoch_steps(epochs: float, n: int, effective_batch: int) -> int:
    """Optimizer steps of ``epochs`` over ``n`` samples: ``ceil(epochs x steps per epoch)``, a
    fraction of a step rounded up, except a float's last-digit error (``0.07 x 100`` is
    ``7.000000000000001``: 7 steps, not 8)."""
    steps = epochs * steps_per_epoch(n, effective_batch)
    return max(1, math.ceil(round(steps, 9))) if steps > 0 else 0


def rounded_epochs_note(epochs: float, n: int, effective_batch: int, steps: int) -> str | None:
    """A note where ``steps`` optimizer steps (:func:`epoch_steps`: a fraction of an epoch is a
    fraction of its steps, each a whole effective batch but the epoch's last) train more than a
    tenth more samples than ``epochs`` x ``n`` (``--epochs 0.05`` of 100 samples at batch 32: 5,
    and one step of 32 trained); None otherwise."""
    asked = epochs * n
    per_epoch = steps_per_epoch(n, effective_batch)
    full, rest = divmod(steps, per_epoch)
    trained = full * n + rest * effective_batch  # an epoch's windows are whole but its last
    if trained <= 1.1 * asked:
        return None
    return (f"{epochs:g} epoch(s) of {n} training samples trains {steps} optimizer step{'s' if steps != 1 else ''} "
            f"({per_epoch} per epoch, each of the effective batch {effective_batch} but an epoch's last): {trained} "
            f"samples ({trained / n:.3g} epochs), where {epochs:g} x {n} samples is {asked:.4g}")


def window_sizes(n: int, effective_batch: int, steps: int) -> list[int]:
    """The sizes of the windows a run of ``steps`` optimizer steps over ``n`` samples trains
    (samples): ``effective_batch`` where an epoch holds a full window, and the epoch's short last
    window where the run reaches it (step ``n // effective_batch + 1``)."""
    full, last = divmod(n, effective_batch)
    return ([effective_batch] if full else []) + ([last] if last and steps > full else [])


def batchnorm_sees_one_sample(model: torch.nn.Module, n: int, effective_batch: int, micro_batch: int,
                              steps: int, forward: Callable[[], object],
                              fix: str = "choose another effective batch (or micro-batch), or put "
                                         "BatchNorm in eval mode", world_size: int = 1) -> str | None:
    """Why ``steps`` optimizer steps over ``n`` training samples would give the model's BatchNorm
    layers a micro-batch of one sample they cannot train on (None: they would not). BatchNorm in
    train mode cannot normalise a single value per channel (``ValueError: Expected more than 1
    value per channel when training``): with one sample, a layer over ``[1, C]`` features, or over
    feature maps pooled to 1 x 1; a window split as 4+4+1, or an epoch's last window of one sample
    (when the run gets there), would stop the run there. Counted are BatchNorm layers that train
    (those in train mode, and all of them in a model in eval mode, which the runtime trains in
    train mode), and only where ``forward`` (the model on one sample, :func:`one_sample_forward`)
    fails in training modes (:func:`starves_batchnorm`: ResNet-50 at 224 pixels normalises one
    image over 7 x 7 values and trains). ``fix``: what the message advises. With ``world_size``
    ranks each window is shared out first (:func:`~tightfit.runtime.distributed.shard_of`), and
    a rank with fewer micro-batches than another runs padding micro-batches of one sample
    (:meth:`~tightfit.runtime.distributed.World.padding`): each counts as a micro-batch of 1."""
    from ..step import training_modes

    norms = [m for m, training in training_modes(model) if training and isinstance(m, _BatchNorm)]
    if not norms:
        return None
    for window in window_sizes(n, effective_batch, steps):
        ranks = rank_micro_batch_sizes(window, micro_batch, world_size)
        if any(1 in sizes for sizes in ranks):
            if not starves_batchnorm(model, forward):
                return None
            which = "each" if window == effective_batch else "the last"
            if world_size > 1:
                split = _ranks_split(ranks)
                padded = len({len(micro_batch_sizes(s, micro_batch)) for s in _share_sizes(window, world_size)}) > 1 \
                    or window < world_size
                where = (f"micro-batch {micro_batch} on {world_size} ranks splits {which} window of "
                         f"{count_of(window, 'sample')} as {split}"  # a window of 1 on several ranks
                         + (" (a rank with fewer micro-batches adds padding ones of 1 sample)" if padded else ""))
            elif window == 1:
                where = f"the last window of each epoch holds 1 sample ({count_of(n, 'training sample')}, " \
                        f"effective batch {effective_batch})"
            else:
                where = f"micro-batch {micro_batch} splits {which} window of {window} samples as {'+'.join(map(str, ranks[0]))}"
            return f"the model's BatchNorm layers cannot train on a micro-batch of 1 sample, and {where}; {fix}"
    return None


def rank_micro_batch_sizes(window_size: int, micro_batch: int, world_size: int = 1) -> list[list[int]]:
    """Each rank's micro-batch sizes for a window of ``window_size`` samples: its share
    (:func:`~tightfit.runtime.distributed.shard_of`) split as :func:`micro_batch_sizes`, then a
    padding micro-batch of one sample for each it runs fewer than the rank with the most (e.g. 7
    samples at micro-batch 2 on 2 ranks: ``[[2, 2], [2, 1]]``; 1 sample on 2: ``[[1], [1]]``)."""
    if world_size <= 1:
        return [micro_batch_sizes(window_size, micro_batch)]
    most = micro_batches_per_rank(window_size, world_size, micro_batch)
    ranks = [micro_batch_sizes(share, micro_batch) for share in _share_sizes(window_size, world_size)]
    return [sizes + [1] * (most - len(sizes)) for sizes in ranks]


def _share_sizes(window_size: int, world_size: int) -> list[int]:
    """How many samples of a window each rank holds (:func:`~tightfit.runtime.distributed.shard_of`'s shares)."""
    return [len(shard_of(range(window_size), r, world_size)) for r in range(world_size)]


def one_sample_forward(workload: Workload, model: torch.nn.Module, device: torch.device,
                       precision: str = "fp32") -> Callable[[], object]:
    """A function running ``workload``'s loss on its first training sample (``collate([0])``,
    moved to ``device``) with ``model`` under ``precision``'s autocast, as a step does: the
    ``forward`` of :func:`batchnorm_sees_one_sample`."""
    def forward():
        with autocast(precision, device.type):
            return workload.loss_sum(model, {k: v.to(device) for k, v in workload.train.collate([0]).items()})
    return forward


def starves_batchnorm(model: torch.nn.Module, forward) -> bool:
    """Whether ``forward()`` (the model on one sample) fails in training modes
    (:func:`tightfit.step.train_mode`), as BatchNorm does where it gets a single value per
    channel (``ValueError: Expected more than 1 value per channel when training``). It runs under
    ``no_grad`` with the modes training uses (a branch that runs only in training, such as an
    auxiliary head, is reached), and the model's buffers (:class:`tightfit.buffers.KeptBuffers`:
    BatchNorm's running statistics) and the random streams are put back after. A forward failing
    for another reason also answers True (cannot tell: every layer counts)."""
    from ..buffers import KeptBuffers
    from ..rng import capture_rng, restore_rng
    from ..step import train_mode

    rng = capture_rng()
    try:
        with KeptBuffers(model.modules()), train_mode(model), torch.no_grad():
            forward()
    except Exception:  # noqa: BLE001 - BatchNorm's refusal, or an unusual batch or model: the cautious answer
        return True
    finally:
        restore_rng(rng)
    return False


def micro_batch_sizes(window_size: int, micro_batch: int) -> list[int]:
    """Sizes of the micro-batches a window of ``window_size`` samples is split into: full
    micro-batches, then the remainder (e.g. 7 samples at micro-batch 3: ``[3, 3, 1]``)."""
    full, rest = divmod(window_size, micro_batch)
    return [micro_batch] * full + ([rest] if rest else [])


def _ranks_split(ranks: list[list[int]]) -> str:
    """``"2+2 and 2+1"``: each rank's micro-batch sizes (:func:`rank_micro_batch_sizes`)."""
    return " and ".join("+".join(map(str, sizes)) for sizes in ranks)


def describe_split(window_size: int, micro_batch: int) -> str:
    """``"3+3+1"`` for 7 samples at micro-batch 3; ``"4 x 8"`` when all micro-batches are equal."""
    sizes = micro_batch_sizes(window_size, micro_batch)
    if len(set(sizes)) == 1:
        return f"{sizes[0]} x {len(sizes)}"
    return "+".join(map(str, sizes)) if len(sizes) <= 6 else f"{micro_batch} x {len(sizes) - 1} + {sizes[-1]}"


@dataclass(frozen=True)
class _Launched:
    """A step run on the GPU (:meth:`Trainer._launch`): its values, possibly still on the
    device, its window and the micro-batch it ran with."""

    pending: PendingStep
    window: list[int]
    micro_batch: int
    backed_off: bool = False  # it ran out of memory and was redone with a smaller micro-batch
    lr: float = math.nan  # the learning rate its update ran with (the schedule moves on after it)
    no_targets: bool = False  # its window held no target (one process): nothing ran, no update

    @property
    def deferred(self) -> bool:
        """Whether its values are still on the device (its skip decided there)."""
        return self.pending.known is None


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


class Trainer:
    """Trains ``workload.model`` under ``plan``.

    Args:
        workload: model, samples and loss.
        plan: precision, micro-batch, checkpointing, device.
        config: optimiser and schedule settings.
        log: called with one dict per metrics record (``{"type": "train"|"eval"|"event", ...}``).
        progress: show a tqdm progress bar.
        profile: the card whose rules apply (the advice after a non-finite stop names bf16 only
            where it runs natively); None: unknown or the CPU.
        world: the ranks training together under torchrun (:mod:`tightfit.runtime.distributed`);
            None: this process alone.

    Raises:
        TightfitError: a plan of another effective batch than the workload's; a compiling plan
            where compilation is unavailable; an optimizer other than AdamW.
    """

    def __init__(self, workload: Workload, plan: Plan, config: TrainConfig,
                 log: Callable[[dict], None] = lambda record: None, progress: bool = True,
                 profile: DeviceProfile | None = None, world: World | None = None):
        if plan.effective_batch != workload.effective_batch:  # else: the workload's windows, the plan's numbers
            raise TightfitError(f"the plan's effective_batch {plan.effective_batch} differs from the workload's "
                                f"{workload.effective_batch}: plan for this workload, or give both the same "
                                "effective_batch")
        self.w, self.plan, self.cfg, self.log, self.profile = workload, plan, config, log, profile
        self.progress = progress
        self.device = torch.device(plan.device)
        # the plan's optimizer may keep the weights in bf16 (adamw8bit-bf16): cast before the move
        check_trainable(plan.trainable, workload.model)
        # parameter offload: the model stays where it is (the host); FSDP2 moves it block by block
        offload = plan.sharding == "fsdp-offload"
        self.model = cast_weights(workload.model, plan.optimizer)
        self.model = self.model if offload else self.model.to(self.device)
        self.world = world or World()
        if not (self.world.distributed or offload):  # before compilation, which specialises on strides
            layout = use_channels_last(self.model, self.device.type, plan.optimizer)
            if layout:
                _log.info("tightfit: %s", layout)
        self.model.zero_grad(set_to_none=True)  # a stray backward before training must not leak into step 1
        # checkpointing turns the KV cache off; the user's setting comes back when fit() ends
        set_activation_checkpointing(self.model, plan.activation_checkpointing, plan.checkpoint_blocks,
                                     plan.block_policies)
        self.steps_per_epoch = steps_per_epoch(len(workload.train), workload.effective_batch)
        total = epoch_steps(config.epochs, len(workload.train), workload.effective_batch)
        self.total_steps = min(total, config.max_steps) if config.max_steps else total
        one = None if offload else batchnorm_sees_one_sample(  # before compilation and the DDP/FSDP2 wrapper
            self.model, len(workload.train), workload.effective_batch, plan.micro_batch, self.total_steps,
            one_sample_forward(workload, self.model, self.device, plan.precision), world_size=self.world.size)
        if one:
            raise TightfitError(one)
        if plan.compile:
            why = compile_unavailable(self.device.type)
            if why:
                raise TightfitError(f"the plan compiles the model, but {why}")
            compile_model(self.model, plan.compile_scope)
        else:
            uncompile_model(self.model)
        # several ranks (or parameter offload): DDP or FSDP2 as the plan says, before the optimizer
        # sees the parameters
        self.model = self.world.wrap(self.model, plan.sharding, plan.precision, self.device)
        self.world.seed_rank(config.seed)
        params = [p for p in self.model.parameters() if p.requires_grad]  # frozen: no state
        if not params:
            raise TightfitError("no parameter of the model requires grad: there is nothing to train")
        if len(workload.train) == 0:
            raise TightfitError("the training data is empty (0 samples)")
        if workload.eval is not None and len(workload.eval) == 0:  # its metrics would be NaN, silently
            raise TightfitError("the evaluation data is empty (0 samples): give held-out samples, or eval=None "
                                "to evaluate nothing")
        # fused AdamW on CUDA (plan.optimizer "adamw"): one kernel, no large temporaries, so an
        # OOM cannot leave a half-applied update behind; "adamw-foreach" allocates per-step temporaries.
        if not plan.optimizer.startswith("adamw"):
            raise TightfitError(f"the runtime trains with AdamW; got optimizer {plan.optimizer!r}")
        self.optimizer = make_optimizer(params, plan.optimizer, self.device.type, config.lr, config.weight_decay,
                                        accumulating=plan.accumulation_steps > 1)
        if config.max_steps and config.max_steps > total:  # said once, where it was asked for
            warnings.warn(f"max_steps={config.max_steps} is more than the {total} optimizer steps of "
                          f"{config.epochs:g} epoch(s): training {total} (raise epochs for more)", stacklevel=2)
        steps, warmup = self.total_steps, int(config.warmup_ratio * self.total_steps)
        # Linear warm-up then linear decay to 0; the closure holds numbers only, not self.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: (s + 1) / max(1, warmup) if s < warmup
            else max(0.0, (steps - s) / max(1, steps - warmup)))
        self.scaler = make_grad_scaler(plan.precision, self.device.type)
        # CUDA graphs: the plain eager step of one micro-batch replayed, not launched op by op
        self.graphs_off = "--cuda-graphs off" if config.cuda_graphs == "off" else \
            graphs_unavailable(plan, self.model, self.world.distributed)
        self._graphs = None if self.graphs_off else StepGraphs(
            self.model, self.optimizer, workload.loss_sum, self.scaler, self._autocast, config.max_grad_norm,
            plan.budget_bytes)
        gpu = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.device.type == "cuda" else 0)  # this rank's GPU
        self.health = (HealthMonitor(gpu, warn_temp_c=config.warn_temp_c)
                       if self.device.type == "cuda" else None)
        self._cooling_given_up = False  # a cool-down that could not cool ends them (_cool_down)
        self.memory_timeline: list[tuple[int, int, int]] = []  # (step, peak allocated, peak reserved) bytes
        self._peaks = (0, 0)
        self._current_bytes = (0, 0)  # allocated, reserved bytes at the last _record_memory
        self.loader = Prefetcher(workload.train.collate, self.device, enabled=config.prefetch)
        self._random_collation_noted = False
        self._windows: dict[int, list[list[int]]] = {}  # epoch -> its accumulation windows
        self.micro_batch = plan.micro_batch
        self._used_micro_batch = plan.micro_batch  # the micro-batch of the last step taken
        self._step_lr = math.nan  # the learning rate of the last step taken
        self._fused = all(g.get("fused") for g in self.optimizer.param_groups)
        self.step = 0
        self.result = TrainResult(plan=plan)
        self._skipped_in_row = 0
        self._clean_windows = 0
        self._stop_signal: str | None = None
        self._stop_note: str | None = None  # a stop signal's note, not yet in the metrics
        self._writer = None  # the CheckpointWriter, made at the first checkpoint
        # the plain grid where several ranks must agree on the steps, or where torch.distributed.checkpoint
        # writes in the loop (no background writer whose holds the schedule could weigh)
        self._schedule = CheckpointSchedule(self.cfg.checkpoint_every, self.world.distributed or self.world.writes_dcp)
        self._abandoned: set[int] = set()  # steps of checkpoints a resume left behind (see resume)
        self._last_update = 0  # the step whose update was the last applied (0: none yet)
        self._listed_modules: list[torch.nn.Module] | None = None  # the model's modules, listed by fit()
        self._train_modes: list[tuple[torch.nn.Module, bool]] | None = None  # their training modes, set by fit()
        # whole-run times a checkpoint carries over a resume (train_seconds is in the result):
        # the process's start (the caller may set it earlier, to count planning), the earlier
        # sessions' wall time, and the checkpoint times they counted (held, writing), seconds
        self.wall_start = time.perf_counter()
        self.resumed_wall_seconds = 0.0
        self._checkpoint_base = (0.0, 0.0)
        self.resumed_peak_rss_bytes = 0  # the earlier sessions' peak host memory (bytes), as they counted it
        self.resumed_health: tuple[float | None, float | None] = (None, None)  # their hottest GPU reading (C, W)

    # ---------------------------------------------------------------- the loop
    def fit(self) -> TrainResult:
        """Train for ``total_steps`` optimizer steps, then evaluate on the held-out samples.

        Raises:
            NonFiniteTrainingError: ``max_skipped_steps`` non-finite steps in a row, or a checkpoint
                refused for a value the gradients did not show (:meth:`_checkpoint_in_loop`).
            TightfitError: a micro-batch of 1 runs out of memory.
        """
        bar = self._progress_bar()
        t0 = time.perf_counter() - self.result.train_seconds  # continues the clock on resume
        samples0 = self.result.samples
        self._t_fit = time.perf_counter()  # the progress bar's rate counts this process's steps only
        trained = False
        try:
            # the modes the steps train in (tightfit.step.training_modes): all train for a model in
            # eval mode (from_pretrained), the caller's own for one in train mode (a frozen backbone's
            # BatchNorm left in eval mode stays so); the caller's modes come back at the end
            self._train_modes = training_modes(self.model)
            self._listed_modules = [m for m, _ in self._train_modes]  # the modules train_step checks (see there)
            with self._stop_on_signals(), train_mode(self.model, self._train_modes):
                self._train_loop(bar, t0, samples0)
            trained = True
        finally:
            self._train_modes = None  # a later train_step takes the model's modes as it then finds them
            self.loader.close()
            if bar is not None:
                bar.close()
            restore_kv_cache(self.world.unwrap(self.model))  # the user's, turned off by checkpointing
            if not trained:
                self.flush_checkpoints()  # no run ends with a checkpoint still being written
            if self._graphs is not None:  # their pool's memory back for the evaluation and the caller
                with contextlib.suppress(Exception) if not trained else contextlib.nullcontext():
                    self._graphs.release()  # (a failed run's own error is the one to see)
        self.result.train_seconds = time.perf_counter() - t0
        self.result.steps = self.step
        self._note_graphs()
        self.result.samples_per_s = self.result.samples / max(self.result.train_seconds, 1e-9)
        self.result.plan = self.plan_in_force()
        try:  # the last checkpoint is written in the background while the model is evaluated
            if self.w.eval is not None:
                t_eval = time.perf_counter()
                self.result.eval = self.evaluate()
                self.result.eval_seconds = time.perf_counter() - t_eval
                self.log({"type": "eval", "step": self.step, **self.result.eval})
        finally:
            # ... and is in place before fit returns: a wait now holds no training (the run's wall time has it)
            self.flush_checkpoints(holds_loop=False)
        if self.device.type == "cuda":  # the run's peaks: every step's and the evaluation's
            self.result.peak_allocated_bytes = max(self._peaks[0], torch.cuda.max_memory_allocated(self.device))
            self.result.peak_reserved_bytes = max(self._peaks[1], torch.cuda.max_memory_reserved(self.device))
        return self.result

    def _train_loop(self, bar, t0: float, samples0: int) -> None:
        """The steps of :meth:`fit`; stops at a step boundary on a signal or a run of non-finite steps.

        Where a step boundary needs nothing exact (:meth:`_may_run_ahead`), the next step is
        queued on the GPU before this one's loss and gradient norm are read, so the host's
        bookkeeping between steps runs while the GPU computes instead of after it has drained.
        """
        ahead = None  # step self.step, queued while the previous one was still running
        while self.step < self.total_steps:
            window = self.window_at(self.step)
            if self.step + 1 < self.total_steps:
                self.loader.schedule(self.step + 1, self.world.shard(self.window_at(self.step + 1)), self.micro_batch)
            launched, ahead = ahead or self._launch(window, self.step), None
            if self._may_run_ahead(launched):
                nxt = self.step + 1
                if nxt + 1 < self.total_steps:
                    self.loader.schedule(nxt + 1, self.world.shard(self.window_at(nxt + 1)), self.micro_batch)
                ahead = self._launch(self.window_at(nxt), nxt)
            loss, stepped = self._settle(launched)
            loss, stop = self.world.after_step(loss, self._stop_signal is not None)  # the ranks' mean; any stop
            if stop and not self._stop_signal:
                self._stop_signal = "a stop on another rank"
            self._log_stop_note()
            self.step += 1
            if stepped:
                self._last_update = self.step
            self.result.samples += len(window)
            self.result.final_loss = loss
            now = time.perf_counter()
            elapsed = now - t0
            self.result.step_ends.append((now - self._t_fit, self.result.samples - samples0))
            self._record_memory()
            if bar is not None:
                rate = (self.result.samples - samples0) / max(now - self._t_fit, 1e-9)
                bar.set_postfix(loss=f"{loss:.4f}", mb=self.micro_batch, samples_s=f"{rate:.1f}", refresh=False)
                bar.update(1)  # redraws at most every tqdm's mininterval
            if self.step % self.cfg.log_every == 0 or self.step == self.total_steps:
                self.log(self._train_record((self.step - 1) // self.steps_per_epoch, loss, stepped, elapsed, window))
            saved = None
            if self.cfg.checkpoint_dir and (self.step == self.total_steps or self._checkpoint_due(self.step)):
                self.result.train_seconds = time.perf_counter() - t0
                saved = self._checkpoint_in_loop()
            if self._skipped_in_row >= self.cfg.max_skipped_steps:
                where = saved or self._checkpoint_at_stop(t0)  # skipped steps left the weights finite
                self.flush_checkpoints()
                culprit, in_data = self._first_nonfinite(window)  # after the checkpoint
                what = f"{self._skipped_in_row} steps in a row had non-finite gradients"
                self._event(f"{what} (first non-finite values in {culprit}): stopped after step {self.step}"
                            + (f", checkpoint {where}" if where else ""), show=False, session=True)  # the error says it
                advice = nonfinite_advice(self.plan.precision, self.profile, self.cfg.lr)
                raise NonFiniteTrainingError(f"{what}; {stop_phrase(culprit, in_data, advice)}", self.step, where,
                                             last_update=self._last_update)
            # several ranks stop on the vote only: a signal that reaches one rank after it (in its logging
            # or checkpoint) waits for the next step's, or that rank alone would stop and its checkpoint's
            # collectives meet the others' next step (DESIGN invariant 12); one process stops at once
            stop = stop if self.world.distributed else self._stop_signal is not None
            # also after the last step where an evaluation would follow: the signal was taken to stop
            # "after the current step", and the resume evaluates (else: after the queued step)
            if stop and (self.step < self.total_steps or self.w.eval is not None) and ahead is None:
                self._log_stop_note()  # a signal after this step's note point (e.g. in its checkpoint)
                where = saved or self._checkpoint_at_stop(t0)
                self.flush_checkpoints()
                self._event(f"{self._stop_signal}: stopped after step {self.step}"  # the error says it on screen
                            + (f", checkpoint {where}" if where else ""), show=False, session=True)
                raise TrainingInterrupted(f"{self._stop_signal}: stopped after step {self.step} of "
                                          f"{self.total_steps}", self.step, where, self._stop_signal)
            self._cool_down()

    def _note_graphs(self) -> None:
        """Count this session's CUDA graph replays in the result, record why it replayed none or
        stopped replaying (``graphs_off``), and say what they did (an event)."""
        g, r = self._graphs, self.result
        if g is None:
            r.graphs_off = self.graphs_off
        elif g.off:
            r.graphs_off = g.off
        elif self.micro_batch < self.plan.micro_batch:  # a back-off's micro-batch splits the windows (_launch_step)
            r.graphs_off = (f"since an out-of-memory back-off the steps run as micro-batches of "
                            f"{self.micro_batch}, eagerly")
        elif not g.replayed:
            r.graphs_off = g.why_none()
        if g is None or not (g.replayed or g.off):
            return
        r.graphed_steps, r.step_graphs, r.graph_pool_bytes = g.replayed, g.captured, g.pool_peak
        if not g.replayed:
            self._event(f"CUDA graphs not used: {g.off}")
            return
        said = (f"CUDA graphs: {g.replayed:,} steps replayed from {g.captured} captured step graphs "
                f"({format_bytes(g.pool_peak)} of memory for them at most)")
        self._event(said + (f"; then off: {g.off}" if g.off else ""), show=bool(g.off))

    def _checkpoint_due(self, step: int) -> bool:
        """Whether the loop checkpoints after optimizer step ``step`` (before the end of training):
        :class:`~tightfit.runtime.checkpoint_schedule.CheckpointSchedule`, with this session's
        clocks and the next snapshot's hold (the last one measured, else predicted from its bytes)."""
        def costs() -> CheckpointCosts:
            w = self._writer
            if w is None or w.last_hold is None:
                hold = first_hold_seconds(self.model, self.optimizer)
            else:
                hold = w.last_hold
            return CheckpointCosts(time.perf_counter() - self._t_fit, w.blocked_seconds if w else 0.0, hold,
                                   w is not None and w.busy)

        return self._schedule.due(step, costs)

    def _log_stop_note(self) -> None:
        """Log a stop signal's note, if one is waiting (see :meth:`_stop_on_signals`: the handler
        logs nothing itself)."""
        if self._stop_note:
            self._event(self._stop_note, session=True)
            self._stop_note = None

    def _checkpoint_in_loop(self) -> str:
        """The loop's checkpoint (:meth:`save_checkpoint` in the background); returns its path.

        Where the model holds a value that is not finite although the steps' gradients were (a
        BatchNorm running variance overflowed in a forward that normalised by the batch's own
        statistics, so the loss and gradients stayed finite), the checkpoint is refused (DESIGN
        invariant 3) and the run stops as on non-finite steps, saying which value, what to try and
        which earlier checkpoint to go back to (those in place stay).

        Raises:
            NonFiniteTrainingError: such a value (``checkpoint`` None, ``last_update`` the last
                applied step).
        """
        from .checkpoint import NonFiniteCheckpointError

        try:
            # at the end of training nothing changes the state before flush_checkpoints: the writer copies it
            return self.save_checkpoint(background=True, last=self.trained)
        except NonFiniteCheckpointError as e:
            self.flush_checkpoints()  # an earlier checkpoint still being written is in place first
            what = str(e).removeprefix("refusing to write a checkpoint: ")
            message = (f"after step {self.step} the model is not finite ({what}), which the check of the gradients does "
                       "not see (e.g. a BatchNorm running variance that overflowed while each batch was normalised by "
                       "its own statistics), so it is not checkpointed")
            self._event(f"{message}: stopped after step {self.step}", show=False, session=True)  # the error says it
            raise NonFiniteTrainingError(f"{message}. {nonfinite_advice(self.plan.precision, self.profile, self.cfg.lr)}",
                                         self.step, None, last_update=self._last_update) from None

    def _checkpoint_at_stop(self, t0: float) -> str | None:
        """Write a checkpoint of the state now; None when the run writes no checkpoints or the
        weights are not finite (the newest earlier checkpoint then stands)."""
        from .checkpoint import NonFiniteCheckpointError

        if not self.cfg.checkpoint_dir:
            return None
        self.result.train_seconds = time.perf_counter() - t0
        try:
            return self.save_checkpoint()
        except NonFiniteCheckpointError:
            return None

    def _stop_on_signals(self):
        """Within the block, SIGINT/SIGTERM ask for a stop at the next step boundary (a second
        SIGINT interrupts at once), unless the process ignores them (``SIG_IGN``); the previous
        handlers are restored after."""
        if threading.current_thread() is not threading.main_thread():
            return contextlib.nullcontext()  # signal handlers can only be set from the main thread

        @contextlib.contextmanager
        def handled():
            def ask_to_stop(signum, frame):
                name = signal.Signals(signum).name
                if self._stop_signal and signum == signal.SIGINT:
                    raise KeyboardInterrupt
                if self._stop_signal:  # a repeated SIGTERM (e.g. from a supervisor and its child): stopping already
                    return
                self._stop_signal = name
                again = " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""  # SIGTERM: none
                self._stop_note = f"{name} received: stopping after the current step{again}"
                # The handler runs between two bytecodes of the main thread, which may be inside a
                # write to metrics.jsonl or the log stream: a write here raised "reentrant call".
                # The loop logs and shows the note at the step's end.

            # a signal ignored by whoever started the process stays ignored, as Python leaves it (a
            # shell starts background jobs, `cmd &`, with SIGINT ignored: Ctrl-C is not theirs)
            old = {s: signal.signal(s, ask_to_stop) for s in (signal.SIGINT, signal.SIGTERM)
                   if signal.getsignal(s) is not signal.SIG_IGN}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        return handled()

    def window_at(self, step: int) -> list[int]:
        """The samples of global step ``step``: the data position is the step itself, since each
        epoch's order is fixed by ``(seed, epoch)``; the last window of an epoch may be short."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if epoch not in self._windows:  # keep this epoch's and the next (prefetch looks ahead)
            self._windows = {e: w for e, w in self._windows.items() if e == epoch - 1}
            self._windows[epoch] = windows_of(epoch_order(len(self.w.train), self.cfg.seed, epoch),
                                              self.w.effective_batch)
        return self._windows[epoch][index]

    # ---------------------------------------------------------------- one optimizer step
    def _may_run_ahead(self, launched: "_Launched") -> bool:
        """Whether the step after ``launched`` may be queued before ``launched``'s values are
        read: on one CUDA process, when the boundary after ``launched`` writes no metrics line
        and no checkpoint, ends no run, cannot stop it (a signal, ``max_skipped_steps``) and
        cannot change the micro-batch (no grow-back pending). The step's values are then on
        the device still (:class:`~tightfit.step.PendingStep`), its skip decided there."""
        boundary = self.step + 1
        return (launched.deferred and not self.world.distributed and boundary < self.total_steps
                and boundary % self.cfg.log_every != 0
                and not (self.cfg.checkpoint_dir and self._checkpoint_due(boundary))
                and self._stop_signal is None and self._skipped_in_row + 1 < self.cfg.max_skipped_steps
                and not (self.cfg.grow_back_after and self.micro_batch < self.plan.micro_batch))

    def train_step(self, window: list[int]) -> tuple[float, bool]:
        """One optimizer step over one accumulation window, recovering from out-of-memory errors.

        An OOM in forward, backward or the optimizer step redoes the window from scratch with
        half the micro-batch (twice the accumulation): gradients are zeroed, the failed
        attempt's memory released, the loss scaler's per-step state reset, and the RNG states and
        the model's buffers restored (:func:`tightfit.buffers.buffer_snapshot`: BatchNorm's running
        statistics, up to :data:`tightfit.buffers.BUFFER_SNAPSHOT_BYTES`), so the redo draws the same
        dropout masks and ends with the same state as a run that used the smaller micro-batch from
        the start (DESIGN invariant 2). Anything but an OOM propagates.

        Returns:
            ``(mean loss of the window, whether the update was applied)``; ``(0.0, False)`` for a
            window without targets on one process, which makes no update (:meth:`_micro_batches`).

        Raises:
            TightfitError: a micro-batch of 1 still runs out of memory.
            PartialUpdateError: the OOM came inside the optimizer step after it had changed a
                parameter or its state (impossible with fused AdamW, whose only allocations, the
                state on the first step, come before any write), or after the step had applied its
                update (the loss scaler's update, the buffers' restore: fused AdamW too).
            NonFiniteTrainingError: after ``max_skipped_steps`` non-finite steps in a row.
        """
        return self._settle(self._launch(window, self.step))

    def _launch(self, window: list[int], index: int) -> "_Launched":
        """Run step ``index`` (0-based) on ``window`` as :meth:`train_step` does, leaving its
        values on the device where the step allows (:meth:`_settle` reads them)."""
        if self._listed_modules is None:
            self._listed_modules = list(self.model.modules())
        # Steady state (fit() keeps the model in its training modes between steps): a check of the
        # modules seen at the start of fit(), no walk of the module tree; any module out of its
        # training mode (flipped by a callback, a step called directly on an eval-mode model) is set.
        modes = self._train_modes if self._train_modes is not None else training_modes(self.model)
        if all(m.training == mode for m, mode in modes):
            return self._launch_step(window, index)
        with train_mode(self.model, modes):  # dropout on; a train-mode model's eval-mode parts stay so
            return self._launch_step(window, index)

    def _settle(self, launched: "_Launched") -> tuple[float, bool]:
        """Read a launched step's values (waiting for that step only) and count it:
        ``(mean loss of the window, whether the update was applied)``."""
        result = launched.pending.result()
        if launched.backed_off:  # its clean-step count starts here, after the step read before it
            self._clean_windows = 0
        self._grad_norm = result.grad_norm
        self._used_micro_batch = launched.micro_batch  # what this step ran with (before any grow-back)
        self._step_lr = launched.lr
        if launched.no_targets:  # neither a clean nor a non-finite step: the streak and the clean count stand
            self._event(f"step {self.step + 1}: no target in the window (every label is -100): nothing to learn, "
                        "no update")
            return result.loss, False
        return result.loss, self._after_step(result.finite, launched.window)

    def _launch_step(self, window: list[int], index: int) -> "_Launched":
        rng, backed_off = capture_rng(), False
        # BatchNorm's running statistics as the window found them: a forward that then ran out of
        # memory has updated them once already (one clone per buffer; none above BUFFER_SNAPSHOT_BYTES)
        buffers = buffer_snapshot(self._listed_modules)  # listed by _launch
        while True:
            self._guard = None  # several ranks: the loss function that agrees on OOMs (_micro_batches)
            # Fused AdamW allocates only its new state, before any write (see make_optimizer): it
            # needs no snapshot, which would cost a walk over every state tensor at every step.
            before = None if self._fused else in_place_versions(self.optimizer)
            had_state = set(self.optimizer.state)
            stepped = False  # the step has returned: its update (unless skipped) is in the weights
            try:
                micro_batches, normaliser = self._micro_batches(window, index)
                if not normaliser:  # no target in the window (one process): nothing to learn, nothing runs
                    pending = PendingStep(result=StepResult(0.0, 0.0, True))
                    break
                if self._graphs is not None and self._guard is None and len(window) <= self.micro_batch:
                    pending = self._graphs.step(micro_batches, normaliser)  # one micro-batch: a graph's replay
                else:  # several micro-batches (a back-off's smaller one splits the window): eager
                    pending = training_step(self.model, micro_batches, self._guard or self.w.loss_sum, normaliser,
                                            self.optimizer, self.scaler, self._autocast, self.cfg.max_grad_norm,
                                            defer=True)
                # from here on an OOM (restore_buffers' torch.where below allocates on the device) comes
                # after the update: a redo would apply it twice, as after apply_update's own (update_ran)
                stepped = True
                if self._guard is not None:
                    self._guard.restore_statistics()
                # a skipped (non-finite) step leaves the buffers too as it found them: BatchNorm's
                # statistics would keep a NaN for good (decided on the device: chosen there, no sync)
                known = pending.known
                if known is None or not known.finite:
                    restore_buffers(buffers, unless=None if known is not None else pending.applied)
                break
            except Exception as e:  # only OOMs are handled; anything else propagates unchanged
                if not is_oom(e):
                    raise
                if stepped or update_ran(e):  # after the update was applied (fused AdamW too): a redo would apply it twice
                    raise PartialUpdateError(
                        f"out of memory after the optimizer step of step {index + 1} had applied its update (in "
                        "what follows it: the loss scaler's update, the buffers' restore); redoing the window would apply it twice, so "
                        "training stops (the last checkpoint is intact)") from e
                where = type(e).__name__
                self.world.on_oom(e, self._guard)  # the other ranks learn of it (or all stop)
            if before is not None and changed_since(self.optimizer, before):
                raise PartialUpdateError(
                    f"out of memory inside the optimizer step of step {index + 1} after it had updated part "
                    "of the parameters or their state; redoing it would apply that part twice, so training stops "
                    "(the last checkpoint is intact)")
            for p in [p for p in self.optimizer.state if p not in had_state]:
                del self.optimizer.state[p]  # state allocated by the failed attempt, never written: start it again
            # Outside the except block: the traceback and the tensors its frames held are gone.
            self.world.reshard(self.model)  # FSDP2 alone: end the failed pass first (it may reduce gradients)
            if self._graphs is not None:  # graphs of the micro-batch given up hold memory the redo needs
                self._graphs.release()
            self.optimizer.zero_grad(set_to_none=True)
            self._reset_scaler_step()
            release_memory()
            restore_rng(rng)
            restore_buffers(buffers)
            self._on_oom(where, index, len(window))
            backed_off = True
        lr = float(self.scheduler.get_last_lr()[0])  # this step's (a tensor under torchao's optimizers)
        known = pending.known  # None: decided on the device, where optimizer.step() ran (a no-op if skipped)
        if known is None or (known.finite and normaliser):
            self.scheduler.step()  # the schedule follows the data, applied or skipped
        else:
            with warnings.catch_warnings():  # a skipped (or no-target) first step makes torch warn about the order
                warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
                self.scheduler.step()
        return _Launched(pending, window, self.micro_batch, backed_off, lr, no_targets=not normaliser)

    def _micro_batches(self, window: list[int], index: int) -> tuple:
        """``(micro-batches, normaliser)`` of ``window`` (step ``index``): an iterator of its
        micro-batches on the device, each staged one ahead (the next is copied while this one
        computes), and the samples (or tokens) of the whole window that the loss is divided by: 0 on
        one process for a window without any, which :meth:`_launch_step` then makes no update of."""
        micro = self.loader.window(index, self.world.shard(window), self.micro_batch)
        if self.loader.random_collation and not self._random_collation_noted:
            self._random_collation_noted = True
            self._event("prefetch off: the data's collation draws random numbers (augmentation); it runs on the "
                        "training thread, so that runs repeat and resume exactly")
        total = sum(self.w.count(b) for b in micro)  # normaliser of the whole window
        if self.world.distributed:  # this rank's share, padded so all ranks run as many passes
            pad = self.world.padding(window, self.micro_batch)
            micro = micro + ([self.w.train.collate(window[:1])] * pad if pad else [])
            total = self.world.normaliser(total)
            self._guard = self.world.guard(self.model, self.w.loss_sum, len(micro), pad)
        hold_gradients(self.optimizer, len(micro))  # offloaded gradients: kept on the GPU only to accumulate

        def staged():
            handle = self.loader.stage(micro[0])
            for i in range(len(micro)):
                batch = self.loader.ready(handle)
                if i + 1 < len(micro):  # copy the next micro-batch while this one computes
                    handle = self.loader.stage(micro[i + 1])
                yield batch
                del batch

        # A window without targets (every label -100, or only padding) counts 0. One process makes no update
        # of it: zero gradients would still move the weights (AdamW's weight decay and moments) and count a
        # step in its bias correction, as TrainStep says. Several ranks still step it with zero gradients,
        # divided by 1, not 0: skipping it is a decision all ranks would have to take together (DESIGN
        # invariant 12). (Not max(1, total): there it is the window's count over the world size, e.g. 0.5.)
        return staged(), total if not self.world.distributed else total or 1

    def _autocast(self):
        return autocast(self.plan.precision, self.device.type)

    def _forward_backward(self, window: list[int]) -> float:
        """Forward and backward of ``window`` only, as the step does them (no update): returns
        the window's mean loss and leaves the summed gradients in ``.grad``."""
        micro_batches, normaliser = self._micro_batches(window, self.step)
        return float(accumulate(self.model, micro_batches, self.w.loss_sum, normaliser or 1,  # 0: no target
                                self.scaler, self._autocast))

    def _reset_scaler_step(self) -> None:
        # A failed attempt may have called unscale_ already; a scaler rebuilt from its state
        # dict keeps the loss scale and growth tracker but forgets that per-step record.
        if self.scaler.is_enabled():
            state = self.scaler.state_dict()
            self.scaler = make_grad_scaler(self.plan.precision, self.device.type)
            self.scaler.load_state_dict(state)

    def _on_oom(self, where: str, index: int, size: int) -> None:
        """Halve the micro-batch after an OOM in step ``index`` (0-based) on a window of ``size`` samples."""
        self.result.oom_recoveries += 1
        self._clean_windows = 0
        if self.micro_batch == 1:
            raise TightfitError(
                "out of memory with a micro-batch of 1"
                + ("" if self.plan.activation_checkpointing else "; a plan with activation checkpointing would use less")
                + ("; fp16/bf16 autocast would use less" if self.plan.precision == "fp32" else "")
                + "; or raise the budget")
        from ..plan import halved_micro_batch

        # the new micro-batch splits every window of the run from now on
        others = window_sizes(len(self.w.train), self.w.effective_batch, self.total_steps)
        # the same on every rank (a function of the window and the world size)
        world = self.world.size
        new = halved_micro_batch(size, self.micro_batch, no_single=self._no_single(), others=others, world_size=world)
        split = (describe_split(size, new) if world == 1 else
                 _ranks_split(rank_micro_batch_sizes(size, new, world)) + " on the ranks")
        msg = (f"out of memory ({where}) at micro-batch {self.micro_batch}: redoing step {index + 1} "
               f"with micro-batch {new}: {size} samples as {split}")
        self._event(msg)
        self.micro_batch = new

    def _no_single(self) -> bool:
        """Whether a micro-batch of one sample is to be avoided: BatchNorm would refuse it (the
        same on every rank: their models are alike)."""
        from ..buffers import running_stat_norms

        return bool(running_stat_norms(self.world.unwrap(self.model)))

    def _after_step(self, finite: bool, window: list[int]) -> bool:
        """Count clean and skipped steps, grow the micro-batch back (the step zeroed the gradients)."""
        if finite:
            self._skipped_in_row = 0
            self._clean_windows += 1
            if (self.cfg.grow_back_after and self.micro_batch < self.plan.micro_batch
                    and self._clean_windows >= self.cfg.grow_back_after):
                new = grown_micro_batch(self.micro_batch, self.plan.micro_batch, self._no_single(),
                                        window_sizes(len(self.w.train), self.w.effective_batch, self.total_steps),
                                        self.world.size)
                if new > self.micro_batch:
                    self._event(f"{self._clean_windows} clean steps: growing micro-batch back {self.micro_batch} -> {new}")
                self.micro_batch, self._clean_windows = new, 0
            return True
        self.result.skipped_steps += 1
        self._skipped_in_row += 1  # fit() stops at max_skipped_steps in a row
        scale = f" (loss scale now {self.scaler.get_scale():g})" if self.scaler.is_enabled() else ""
        # in the report's events, not on screen: fp16's loss scale skips a few steps at a run's start by design
        self._event(f"step {self.step + 1}: non-finite gradients, update skipped{scale}", show=False)
        return False

    def _first_nonfinite(self, window: list[int]) -> tuple[str, str | None]:
        """Where this window's first micro-batch first gives non-finite values
        (:func:`.diagnose.first_nonfinite`), and what non-finite values the batch itself holds
        (:func:`.diagnose.nonfinite_input`, or None)."""
        from .diagnose import first_nonfinite, nonfinite_input

        first = window[:self.micro_batch]
        batch = _to_device(self.w.train.collate(first), self.device)
        culprit = first_nonfinite(self.model, lambda: self.w.loss_sum(self.model, batch),
                                  lambda: autocast(self.plan.precision, self.device.type),
                                  lambda: train_mode(self.model, self._train_modes), self.scaler.is_enabled())
        return culprit, nonfinite_input(batch, len(first), first)

    # ---------------------------------------------------------------- checkpoint / resume
    def plan_in_force(self) -> Plan:
        """The plan with the micro-batch now in use (after OOM recoveries)."""
        if self.micro_batch == self.plan.micro_batch:
            return self.plan
        return self.plan.with_micro_batch(self.micro_batch, f"micro-batch {self.micro_batch} after OOM recovery")

    def state_dict(self) -> dict:
        """Everything but the weights that an exact resume needs (tensors and plain values)."""
        r = self.result
        return {
            # the plan as chosen (not the backed-off one), so that a resumed run grows the
            # micro-batch back exactly when the uninterrupted run would
            "step": self.step, "micro_batch": self.micro_batch, "plan": self.plan.to_dict(),
            # what fixes the sample order: a resume of another seed or data size would train some
            # samples of the epoch twice and skip others
            "order": {"seed": self.cfg.seed, "train_samples": len(self.w.train)},
            "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(), "rng": capture_rng(),
            "counters": {"samples": r.samples, "skipped_steps": r.skipped_steps, "oom_recoveries": r.oom_recoveries,
                         "train_seconds": r.train_seconds, "final_loss": r.final_loss,
                         "skipped_in_row": self._skipped_in_row, "clean_windows": self._clean_windows,
                         "last_update": self._last_update,
                         **dict(zip(("checkpoint_seconds", "checkpoint_write_seconds"), self._checkpoint_times())),
                         "wall_seconds": self.resumed_wall_seconds + time.perf_counter() - self.wall_start,
                         # the run's peaks so far (this session's and the earlier ones'), for its summary
                         "peak_allocated_bytes": self._peaks[0], "peak_reserved_bytes": self._peaks[1],
                         "peak_rss_bytes": self.peak_rss_bytes(),
                         **dict(zip(("max_temp_c", "max_power_w"), self.health_maxima()))},
        }

    def peak_rss_bytes(self) -> int:
        """The run's peak host memory (bytes): this process's (``ru_maxrss``) or an earlier
        session's, counted before a resume, whichever is larger."""
        import resource

        return max(self.resumed_peak_rss_bytes, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def health_maxima(self) -> tuple[float | None, float | None]:
        """The run's hottest GPU temperature (C) and highest power (W): this session's readings or an
        earlier session's, counted before a resume, whichever is larger; None where none was read."""
        now = (self.health.max_temp_c, self.health.max_power_w) if self.health is not None else (None, None)
        return tuple(max((v for v in pair if v is not None), default=None) for pair in zip(now, self.resumed_health))

    def save_checkpoint(self, background: bool = False, last: bool = False) -> str:
        """Write ``ckpt-<step>`` atomically (never with non-finite weights); keep the newest few.
        With ``background`` (and ``config.background_checkpoints``) only the copy to host memory
        happens now and the write goes on in the background (:mod:`.async_checkpoint`; the next
        save and :meth:`flush_checkpoints` wait for it); with ``last`` too, not even the copy
        (the caller changes neither the model nor the optimizer before :meth:`flush_checkpoints`:
        the end of training). Returns its path.

        Raises:
            NonFiniteCheckpointError: a parameter holds inf/NaN (nothing is written).
        """
        from .async_checkpoint import CheckpointWriter

        self._abandoned.discard(self.step)  # written anew by this run
        if self.world.writes_dcp:  # every rank writes its part with torch.distributed.checkpoint
            from .sharded_checkpoint import save_sharded

            from .checkpoint import write_checkpoint_times, write_failure

            state = {k: v for k, v in self.state_dict().items() if k != "optimizer"}
            t0 = time.perf_counter()
            try:
                path = save_sharded(self.cfg.checkpoint_dir, self.step, self.model, self.optimizer, state, self.world,
                                    self.cfg.keep_last, frozenset(self._abandoned))
            except Exception as e:  # DCP gathers every rank's write failures and raises them on all
                failure = write_failure(e, self.step, self.cfg.checkpoint_dir)
                if failure is None:
                    raise
                raise failure from e
            held = time.perf_counter() - t0  # written in the loop's time: it holds the loop as long as it writes
            self.result.checkpoint_seconds += held
            self.result.checkpoint_write_seconds += held
            if self.world.is_main:  # its state's counters were taken before this write: a resume reads these
                with contextlib.suppress(OSError):  # the checkpoint is whole without them
                    write_checkpoint_times(path, self.result.checkpoint_seconds, self.result.checkpoint_write_seconds)
            self.log({"type": "checkpoint", "step": self.step, "path": str(path)})
            return str(path)
        if self._writer is None:
            self._writer = CheckpointWriter(self.cfg.checkpoint_dir, self.cfg.keep_last,
                                            background=self.cfg.background_checkpoints, carried=self._checkpoint_base)
        path = self._writer.save(self.step, self.model, self.state_dict(), self._abandoned, last=background and last)
        if not background:
            self.flush_checkpoints()
        self.log({"type": "checkpoint", "step": self.step, "path": str(path)})
        return str(path)

    @property
    def trained(self) -> bool:
        """Whether the training loop has taken its last step (what follows: the evaluation)."""
        return bool(self.total_steps) and self.step == self.total_steps

    def writing_checkpoint(self) -> bool:
        """Whether a checkpoint is being written in the background now."""
        return self._writer is not None and self._writer.busy

    def flush_checkpoints(self, holds_loop: bool = True) -> None:
        """Wait until the checkpoint being written in the background is in place (re-raising
        the writer's error), and count the time checkpoints took (``holds_loop`` False: the wait
        holds no training, as after the final evaluation, and is not counted as holding the loop)."""
        if self._writer is not None:
            try:
                self._writer.flush(holds_loop)
            finally:
                self.result.checkpoint_seconds, self.result.checkpoint_write_seconds = self._checkpoint_times()

    def _checkpoint_times(self) -> tuple[float, float]:
        """Seconds checkpoints held the loop and spent writing, over the whole run so far (the
        earlier sessions' from the checkpoint resumed, plus this process's writer's)."""
        if self._writer is None:  # none written here yet (or written by several ranks, counted as they went)
            return self.result.checkpoint_seconds, self.result.checkpoint_write_seconds
        held, writing = self._checkpoint_base
        return held + self._writer.blocked_seconds, writing + self._writer.write_seconds

    def resume(self, path, state: dict | None = None, verified: bool = False) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`: weights, optimizer, loss scaler,
        scheduler, RNG states, data position and micro-batch; :meth:`fit` then continues.
        ``state`` and ``verified``: as :func:`~tightfit.runtime.checkpoint.load_checkpoint` (a
        caller that verified and read the checkpoint already passes them: read and hashed once)."""
        from .checkpoint import (check_trained_parameters, check_training_state, checkpoint_step, checkpoint_times,
                                 list_checkpoints, load_checkpoint, read_state, verify_checkpoint)

        from .sharded_checkpoint import is_sharded, load_sharded

        # verified and read before anything is loaded: a checkpoint refused here leaves the model,
        # optimizer and schedule as they were (a caller going on with a fresh start trains from them)
        if not verified:
            verify_checkpoint(path)
        saved = read_state(path) if state is None else state
        check_training_state(path, saved, is_sharded(path))
        check_same_windows(path, saved, self.w.effective_batch, self.cfg.seed, len(self.w.train))
        if not is_sharded(path) and not self.world.sharded:  # DCP matches the state by parameter name itself
            check_trained_parameters(path, saved["optimizer"], self.optimizer)
        if saved["step"] > self.total_steps:  # fit() would train nothing and report the checkpoint's steps
            raise TightfitError(f"checkpoint {os.path.basename(os.fspath(path))} is at step {saved['step']}, past this "
                                f"run's {self.total_steps} steps: give a checkpoint of this run, or more epochs")
        if is_sharded(path):  # written by several ranks: DCP reshards to this world size
            state = load_sharded(path, self.model, self.optimizer, self.world, verified=True, state=saved)
        elif self.world.sharded:  # one process's checkpoint, resumed under FSDP2: each rank keeps its shard
            from .sharded_checkpoint import load_whole_into_sharded
            state = load_whole_into_sharded(path, self.model, self.optimizer, verified=True, state=saved)
        else:
            state = load_checkpoint(path, self.world.unwrap(self.model), verified=True, state=saved)
            self.optimizer.load_state_dict(state["optimizer"])
            match_parameter_strides(self.optimizer)  # channels-last parameters: state saved contiguous
        self.scheduler.load_state_dict(state["scheduler"])
        lr_changed = self.scheduler.base_lrs != [self.cfg.lr] * len(self.scheduler.base_lrs)
        if lr_changed:  # resumed with a new --lr
            self.scheduler.base_lrs = [self.cfg.lr] * len(self.scheduler.base_lrs)
            factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
            for group in self.optimizer.param_groups:
                set_lr(group, self.cfg.lr * factor)
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        # the checkpoint's micro-batch (smaller after an OOM back-off), unless this plan's is smaller
        # (planned again for less memory): then the plan's
        self.step, self.micro_batch = state["step"], min(state["micro_batch"], self.plan.micro_batch)
        c = state["counters"]
        self.result.samples, self.result.skipped_steps = c["samples"], c["skipped_steps"]
        self.result.oom_recoveries, self.result.train_seconds = c["oom_recoveries"], c["train_seconds"]
        self.result.final_loss = c["final_loss"]
        self._skipped_in_row, self._clean_windows = c["skipped_in_row"], c["clean_windows"]
        self._last_update = c.get("last_update", self.step - self._skipped_in_row)  # (older checkpoints: derived)
        # the earlier sessions' times (absent from checkpoints of older versions: 0), with the checkpoint's
        # own write where it was recorded beside it (its state was taken before the write)
        saved_times = (c.get("checkpoint_seconds", 0.0), c.get("checkpoint_write_seconds", 0.0))
        self._checkpoint_base = tuple(map(max, saved_times, checkpoint_times(path) or saved_times))
        self.result.checkpoint_seconds, self.result.checkpoint_write_seconds = self._checkpoint_base
        self.resumed_wall_seconds = c.get("wall_seconds", 0.0)
        # the earlier sessions' peaks (absent from checkpoints of older versions: 0): the run's are the largest
        self._peaks = (max(self._peaks[0], c.get("peak_allocated_bytes", 0)),
                       max(self._peaks[1], c.get("peak_reserved_bytes", 0)))
        self.resumed_peak_rss_bytes = c.get("peak_rss_bytes", 0)
        self.resumed_health = (c.get("max_temp_c"), c.get("max_power_w"))  # (older checkpoints: none)
        if lr_changed:  # the run of non-finite steps belonged to the old learning rate
            self._skipped_in_row = 0
        restore_rng(state["rng"])
        if self.world.distributed and not state.get("rng_of_this_rank"):
            # a checkpoint of another world size holds one rank's RNG states: restored on every rank,
            # each would drop the same units of its own samples (no resume across world sizes is exact)
            self.world.seed_rank(self.cfg.seed + self.step)
        if self.cfg.checkpoint_dir:  # the later checkpoints belong to the stretch this resume abandons
            self._abandoned = {checkpoint_step(p) for p in list_checkpoints(self.cfg.checkpoint_dir)
                               if checkpoint_step(p) > self.step}
        self._event(f"resumed from {path} at step {self.step} with micro-batch {self.micro_batch}", session=True)

    # ---------------------------------------------------------------- evaluation
    def evaluate(self) -> dict:
        """Evaluate on the held-out samples with the workload's task, in eval mode and eagerly (a
        compiled model's compiled calls are set aside, :func:`~tightfit.levers.compile.eager_calls`);
        the evaluation batch halves on OOM independently of the training micro-batch (under FSDP2 on
        several ranks an OOM stops every rank instead: :meth:`_evaluate`). Under FSDP2 the
        parameters are resharded after it.

        Returns:
            The task's metrics (:meth:`tightfit.tasks.Task.summarize`) plus ``"samples"`` (what
            the metrics divide by: the labelled held-out samples, a label of -100 left out; with
            ``"held_out"``, all of them, where the two differ) and ``"eval_batch"`` (the
            evaluation batch that ran): for classification
            ``{"accuracy", "loss", "samples", "eval_batch"}`` (loss: mean cross-entropy per sample);
            for a causal LM ``{"loss", "perplexity", "tokens", "samples", "eval_batch"}`` (loss: mean
            per target token).

        Raises:
            TightfitError: an evaluation batch of 1 runs out of memory; any evaluation OOM under
                FSDP2 on several ranks.
        """
        # eagerly: the graphs compiled for training do not serve no_grad, and compiling them
        # anew would cost more than the evaluation
        with module_mode(self.model, False), eager_calls(self.world.unwrap(self.model)):
            try:
                return self._evaluate(self.w.eval)
            finally:  # FSDP2 leaves the root's parameters gathered on the GPU after a forward without backward
                self.world.reshard(self.model)

    def _evaluate(self, data) -> dict:
        """The OOM back-off around :meth:`_eval_batch`: every held-out sample is counted once,
        in batches of ``2 x micro_batch`` at first, halved after each OOM. Under FSDP2 on several
        ranks, whose every forward all-gathers, one rank cannot halve alone (its forwards would
        no longer pair with the others'): the batch is the training micro-batch (the probe
        verified it with a backward besides), and an OOM stops every rank, as in training.

        Raises:
            TightfitError: an OOM with a batch of 1, or any OOM under FSDP2 on several ranks.
        """
        together = self.world.sharded and self.world.distributed
        batch_size = max(1, min(len(data), (1 if together else 2) * self.micro_batch))
        i, totals = 0, {}
        while i < len(data):
            idx = list(range(i, min(i + batch_size, len(data))))
            try:
                for k, v in self._eval_batch(data.collate(idx)).items():
                    totals[k] = totals.get(k, 0) + v
                i += len(idx)
                continue
            except Exception as e:  # only OOMs; the failed batch's tensors died with its frame
                if not is_oom(e):
                    raise
            release_memory()
            if together:
                raise TightfitError(
                    f"out of memory in evaluation on rank {self.world.rank} under FSDP2 (its collectives run in "
                    "every forward, so no rank can halve its evaluation batch alone): every rank stops"
                    + ("; the trained weights are in the run's last checkpoint" if self.cfg.checkpoint_dir else ""))
            if batch_size == 1:
                raise TightfitError("out of memory in evaluation with a batch of 1")
            batch_size //= 2
            self._event(f"out of memory in evaluation: evaluation batch -> {batch_size}")
        # "samples": what the metrics divide by -- the labelled ones (a label of -100 is left out)
        counted = int(totals["samples"]) if "samples" in totals else len(data)
        return {**self.w.task.summarize(totals), "samples": counted, "eval_batch": batch_size,
                **({"held_out": len(data)} if counted != len(data) else {})}

    @torch.no_grad()
    def _eval_batch(self, batch: dict) -> dict[str, float]:
        """The task's additive statistics of one batch (:meth:`tightfit.tasks.Task.eval_sums`),
        under the plan's autocast."""
        batch = _to_device(batch, self.device)
        with autocast(self.plan.precision, self.device.type):
            return self.w.task.eval_sums(self.model, batch)

    # ---------------------------------------------------------------- memory and health
    def _record_memory(self) -> None:
        """Append this step's peak allocated and reserved bytes (plain ints) to the timeline."""
        if self.device.type == "cuda":
            # One read of the allocator's counters: torch.cuda.max_memory_allocated and its kin
            # each build and flatten the whole statistics dict.
            stats = torch.cuda.memory_stats_as_nested_dict(self.device)
            peak_alloc = stats["allocated_bytes"]["all"]["peak"]
            peak_res = stats["reserved_bytes"]["all"]["peak"]
            self._current_bytes = (stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"])
            self.memory_timeline.append((self.step, peak_alloc, peak_res))
            self._peaks = (max(self._peaks[0], peak_alloc), max(self._peaks[1], peak_res))
            torch.cuda.reset_peak_memory_stats(self.device)  # the next entry is the next step's peak

    def _cool_down(self, sleep: Callable[[float], None] = time.sleep) -> float:
        """Pause while the GPU is at or above ``cooldown_temp_c``, until it is 5 deg C below or
        ``cooldown_max_s`` have passed. Returns seconds paused.

        A pause that ran its whole ``cooldown_max_s`` without bringing the GPU 5 deg C below the
        limit ends the cool-downs of this session (an event says so): the limit is under what the
        card reaches at rest or with its cooling as it is, and pausing before every step (e.g.
        ``--cooldown-temp 20`` on a GPU idling at 35 deg C: 300 s per step) would only stall the run."""
        limit = self.cfg.cooldown_temp_c
        if limit is None or self.health is None or not self.health.available or self._cooling_given_up:
            return 0.0
        reading = self.health.sample()
        if not reading or reading.get("temp_c", 0.0) < limit:
            return 0.0
        self._event(f"GPU at {reading['temp_c']:.0f} C >= {limit:.0f} C: pausing to cool down")
        paused = 0.0
        while paused < self.cfg.cooldown_max_s:
            sleep(2.0)
            paused += 2.0
            reading = self.health.sample(force=True)
            if not reading or reading.get("temp_c", 0.0) <= limit - 5:
                self._event(f"resuming after {paused:.0f} s of cool-down")
                break
        else:  # the whole pause, and still hot
            self._cooling_given_up = True
            self._event(f"resuming after {paused:.0f} s of cool-down that left the GPU at "
                        f"{reading['temp_c']:.0f} C, above the {limit - 5:.0f} C a pause waits for: no more "
                        f"cool-down pauses in this session (a cool-down limit of {limit:.0f} C, --cooldown-temp, "
                        f"may be under what this GPU cools to; 82 C is the usual limit)")
        return paused

    # ---------------------------------------------------------------- logging
    def event(self, message: str, show: bool = True, session: bool = False) -> None:
        """Record ``message`` as one of the run's events (``metrics.jsonl``, the report), and show it
        (``show`` False: it was shown already); ``session``: as :meth:`_event`'s."""
        self._event(message, show, session)

    def _event(self, message: str, show: bool = True, session: bool = False) -> None:
        """Record ``message`` (shown on the log when ``show``). ``session``: it says how a session
        started or ended (a resume, a stop), kept in the run's history by a resume from an earlier
        checkpoint (:func:`tightfit.report.metrics.keep_metrics_until`); other events after that
        checkpoint happen again in the resumed run."""
        self.result.events.append(message)
        self.log({"type": "event", "step": self.step, "message": message, **({"session": True} if session else {})})
        if show:
            _log.info("tightfit: %s", message)  # shown by the command line, with or without a progress bar

    def _train_record(self, epoch: int, loss: float, stepped: bool, elapsed: float, window: list[int]) -> dict:
        rec = {"type": "train", "step": self.step, "epoch": epoch, "loss": loss,
               "lr": self._step_lr,  # the rate this step's update ran with, not the next one's
               "grad_norm": float(self._grad_norm),
               "stepped": stepped, "micro_batch": self._used_micro_batch, "window_samples": len(window),
               # what the window really held (on this rank), e.g. "3+3+1" for 7 samples at micro-batch 3
               "micro_batches": describe_split(len(self.world.shard(window)), self._used_micro_batch),
               "accumulation_steps": len(micro_batch_sizes(len(self.world.shard(window)), self._used_micro_batch)),
               "samples": self.result.samples, "samples_per_s": self.result.samples / max(elapsed, 1e-9)}
        if self.world.distributed:
            rec["world_size"] = self.world.size
        if self.scaler.is_enabled():
            rec["loss_scale"] = float(self.scaler.get_scale())
        if self.device.type == "cuda":
            rec["allocated_bytes"], rec["reserved_bytes"] = self._current_bytes  # read by _record_memory
            rec["step_peak_allocated_bytes"], rec["step_peak_reserved_bytes"] = self.memory_timeline[-1][1:]
        if self.health is not None:
            h = self.health.sample()
            if self.world.distributed:  # health per GPU: every rank's reading, on rank 0's record
                rec["gpus"] = self.world.gather(h)
            if h:
                rec.update(h)
                if "warning" in h:
                    self._event(h["warning"])
        return rec

    def _progress_bar(self):
        if not self.progress:
            return None
        from tqdm import tqdm
        return tqdm(total=self.total_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                    file=UntilClosed(sys.stderr))


def check_same_windows(path, state: dict, effective_batch: int, seed: int | None = None,
                       train_samples: int | None = None) -> None:
    """Refuse a checkpoint of a run with another effective batch, seed or number of training
    samples: its data position counts windows of that size in that epoch's order (fixed by the
    seed and the sample count), so the resumed run would train samples twice (or skip them).
    A checkpoint of an older version without the order's record is checked on the batch alone;
    ``seed`` / ``train_samples`` None: not checked.

    Raises:
        TightfitError: one line naming what differs, both ways.
    """
    name = os.path.basename(os.fspath(path))
    saved = (state.get("plan") or {}).get("effective_batch")
    if saved is not None and saved != effective_batch:
        raise TightfitError(f"checkpoint {name} was written by a run of effective batch {saved}, and "
                            f"this run's is {effective_batch}: it is not this run's checkpoint")
    order = state.get("order") or {}
    for what, mine in (("seed", seed), ("train_samples", train_samples)):
        if mine is not None and order.get(what) is not None and order[what] != mine:
            said = "seed" if what == "seed" else "training samples"
            raise TightfitError(f"checkpoint {name} was written by a run of {said} {order[what]}, and this run's "
                                f"is {mine}: its epoch's sample order is another, so the resumed run would train "
                                f"some samples twice and skip others")
