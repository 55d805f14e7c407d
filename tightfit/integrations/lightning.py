"""tightfit with Lightning: the plan as ``Trainer`` arguments, and a ``Callback`` for the rest.

Three added lines, two changed::

    import tightfit
    from tightfit.integrations.lightning import TightfitCallback, trainer_arguments
    plan = tightfit.plan(module, sample_batch, effective_batch=32, budget="4GiB", loss=...)
    trainer = L.Trainer(**trainer_arguments(plan, max_epochs=3, ...), callbacks=[TightfitCallback(plan)])
    trainer.fit(module, DataLoader(dataset, batch_size=plan.micro_batch))

What each part does, and what Lightning leaves out of reach:

- :func:`trainer_arguments`: ``accumulate_grad_batches``, ``precision`` (``"32-true"``,
  ``"16-mixed"``, ``"bf16-mixed"``) and the accelerator, merged with your arguments (devices and
  gradient clipping stay yours). The precision plugin is fixed when the ``Trainer`` is made, so
  only these arguments can set it.
- :class:`TightfitCallback`: at ``setup`` turns activation checkpointing on as planned (the
  model's own Hugging Face hook, non-reentrant, or tightfit's block wrappers; off, with a warning,
  where the model had it on and the plan has none), sets
  ``trainer.accumulate_grad_batches`` to the plan's (as Lightning's own
  ``GradientAccumulationScheduler`` does; under manual optimization, where Lightning accumulates
  nothing and refuses ``accumulate_grad_batches`` above 1, it leaves it and says to step every
  ``plan.accumulation_steps`` batches in ``training_step``) and warns when the precision or the loader's batch
  differ from the plan (saying what the effective batch becomes; under manual optimization, that
  it is the loader's batch times the batches your ``training_step`` steps over); logs per-step peak allocated/reserved memory and GPU health (NVML);
  skips an optimizer step whose (unscaled) gradients are not finite, or whose norm is not (finite
  gradients that overflow it) -- in ``32-true``/``bf16-mixed`` by dropping the gradients, so that
  the optimizer leaves every parameter and its state as they were; in ``16-mixed`` by having the
  Trainer's loss scaler skip it as it skips an inf gradient, backing off its scale -- and
  stops ``fit`` after ``max_skipped_steps`` in a row. Its counts of skipped steps (in all, and in a
  row) go into the Trainer's checkpoints (``state_dict``), so a ``fit(ckpt_path=...)`` goes on from them.
- Exact accumulation: Lightning divides every micro-batch's loss by ``accumulate_grad_batches``, also
  in an epoch's last window, which may hold fewer samples (or a short last micro-batch). With
  accumulation, the callback weighs each micro-batch by the samples it holds (a short one's loss is
  scaled by its share of a full micro-batch before its backward) and, before the optimizer step,
  scales the window's gradient to the mean over the samples the window really held, so that the
  step is that of one batch of the same samples however they are split. It takes ``training_step``'s
  loss to be a mean over the micro-batch's samples (their count: Lightning's ``extract_batch_size``;
  a batch without one is left as Lightning scales it, with a warning) and acts under automatic
  optimization only.
- Out of memory: Lightning has no hook that can redo a step with smaller micro-batches (the
  loader's batch is fixed; ``Tuner.scale_batch_size`` searches before training and keeps no
  effective batch). The callback names the plan to fit again with, ``plan.with_micro_batch(n)``:
  its micro-batch and accumulation (under manual optimization: how many batches your
  ``training_step`` steps over) keep the effective batch, and ``fit`` raises the OOM as it would
  without tightfit. The plan's probes chose a
  micro-batch that fits the budget with headroom, so this is the exception.
"""

from __future__ import annotations

import logging

import torch

from ..errors import TightfitError
from ..plan import Plan, refuse_parameter_offload
from . import (Watch, check_trainable, note_sharding, note_uneven, refuse_fp16_on_cpu, require, skip_through_loss_scaler,
               smaller_micro_batch)

# what Lightning does with an fp16 plan on the CPU (refuse_fp16_on_cpu)
_LIGHTNING_FP16_ON_CPU = ("Lightning trains precision='16-mixed' on the CPU as 'bf16-mixed' (no fp16 autocast or "
                          "loss scaling there), not the plan's fp16")

L = require("lightning.pytorch")

__all__ = ["TightfitCallback", "trainer_arguments"]

log = logging.getLogger(__name__)

PRECISION = {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}


# accelerators that run a plan made for each device ("auto" finds the GPU the plan was made on;
# for a CPU plan it becomes "cpu": Lightning's "auto" would take a GPU wherever one is visible)
_ACCELERATORS = {"cuda": ("gpu", "cuda", "auto"), "cpu": ("cpu", "auto")}


def _unified_precision(value):
    """Lightning's own spelling of a ``precision`` argument (``16`` -> ``"16-mixed"``), to compare with the plan's."""
    import warnings

    try:
        from lightning.fabric.connector import _convert_precision_to_unified_args
    except ImportError:  # another Lightning version: compare as written
        return str(value)
    with warnings.catch_warnings():  # Lightning warns about the old spellings itself when the Trainer is made
        warnings.simplefilter("ignore")
        try:
            return _convert_precision_to_unified_args(value)
        except ValueError:
            return str(value)


def trainer_arguments(plan: Plan, **yours) -> dict:
    """``lightning.Trainer`` keyword arguments that run ``plan``, merged with ``yours``:
    ``L.Trainer(**trainer_arguments(plan, max_epochs=3, ...), callbacks=[TightfitCallback(plan)])``.

    The plan sets ``accumulate_grad_batches`` (its accumulation steps), ``precision`` (autocast;
    fp16 with dynamic loss scaling) and ``accelerator`` (``"gpu"`` or ``"cpu"``; yours is kept when
    it runs the plan's device; ``"auto"`` is kept for a CUDA plan and becomes ``"cpu"`` for a CPU
    plan, where Lightning's own choice would be a visible GPU the plan was not made for).
    Everything else is yours or Lightning's: ``devices``, gradient clipping (``gradient_clip_val``;
    none unless you give it). The loader's ``batch_size`` is the plan's micro-batch
    (``plan.micro_batch``). Lightning's effective batch is micro-batch x accumulation steps, which
    is the plan's unless its last micro-batch is short (e.g. 40 samples as 12+12+12+4: Lightning
    runs 12 x 4 = 48); a note is logged then.

    Args:
        plan: from :func:`tightfit.plan`.
        yours: your own ``Trainer`` keywords; one the plan sets may be given only with the plan's
            value (delete your ``accumulate_grad_batches`` and ``precision``). Under manual optimization
            (``automatic_optimization = False``) Lightning refuses ``accumulate_grad_batches`` above 1:
            drop it from the result and step every ``plan.accumulation_steps`` batches yourself.

    Raises:
        TightfitError: ``plan`` is not a :class:`tightfit.Plan`; one of ``yours`` sets what the plan
            sets to another value (one line naming each); an fp16 plan for the CPU (Lightning would
            train it as ``bf16-mixed``; :class:`tightfit.TrainStep` refuses it too; a bf16 one runs
            ``bf16-mixed`` autocast on the CPU).
    """
    if not isinstance(plan, Plan):
        raise TightfitError(f"trainer_arguments(plan): plan must be a tightfit.Plan, got {type(plan).__name__}")
    refuse_parameter_offload(plan, "the Lightning integration")
    refuse_fp16_on_cpu(plan, "trainer_arguments(plan)", _LIGHTNING_FP16_ON_CPU)
    planned = {"accumulate_grad_batches": plan.accumulation_steps, "precision": PRECISION[plan.precision],
               "accelerator": "gpu" if plan.device == "cuda" else "cpu"}
    conflicts = []
    if "accumulate_grad_batches" in yours and yours["accumulate_grad_batches"] != plan.accumulation_steps:
        conflicts.append(f"accumulate_grad_batches={yours['accumulate_grad_batches']!r} (the plan chose "
                         f"{plan.accumulation_steps})")
    if "precision" in yours and _unified_precision(yours["precision"]) != planned["precision"]:
        conflicts.append(f"precision={yours['precision']!r} (the plan chose {planned['precision']!r})")
    if "accelerator" in yours:
        if str(yours["accelerator"]) in _ACCELERATORS[plan.device]:
            if not (plan.device == "cpu" and yours["accelerator"] == "auto"):  # auto: the plan's CPU (above)
                planned["accelerator"] = yours["accelerator"]
        else:
            conflicts.append(f"accelerator={yours['accelerator']!r} (the plan chose {planned['accelerator']!r})")
    if conflicts:
        raise TightfitError(f"trainer_arguments(plan, ...): your {', '.join(conflicts)}; the plan sets "
                            f"{'it' if len(conflicts) == 1 else 'them'}: delete "
                            f"{'it' if len(conflicts) == 1 else 'them'} from your arguments (it sets "
                            f"{', '.join(planned)})")
    note_uneven(plan, "Lightning's")
    strategy = yours.get("strategy")  # "fsdp", an FSDPStrategy or ModelParallelStrategy: sharded; "ddp": not
    name = (strategy if isinstance(strategy, str) else type(strategy).__name__).lower()
    sharded = strategy is not None and any(w in name for w in ("fsdp", "parallel", "deepspeed"))
    note_sharding(plan, "Lightning", sharded, "a sharding strategy (strategy='fsdp')")
    return {**yours, **planned}


def _checkpointable(module: torch.nn.Module) -> torch.nn.Module:
    """The module activation checkpointing applies to: the first submodule with Hugging Face's hook
    (the wrapped transformer), else ``module`` itself (tightfit's wrappers around its repeated blocks)."""
    return next((m for m in module.modules() if getattr(m, "supports_gradient_checkpointing", False)), module)


class TightfitCallback(Watch, L.Callback):
    """Activation checkpointing and accumulation from the plan, memory and health reporting, and the
    non-finite guard, for ``lightning.Trainer.fit`` (see the module doc for what each hook does).

    Logged each optimizer step (``self.log``, to the Trainer's loggers): ``peak_allocated_bytes``,
    ``peak_reserved_bytes`` (CUDA, since the previous step), ``gpu_temp_c``, ``gpu_power_w`` (NVML).

    Args:
        plan: from :func:`tightfit.plan`.
        max_skipped_steps: raise after this many non-finite steps in a row.
        warn_temp_c: log a warning when the GPU reaches this temperature (deg C).

    Attributes:
        memory_timeline: ``(step, peak allocated bytes, peak reserved bytes)`` per optimizer step (CUDA).
        skipped_steps, events: what the guards did.

    Raises (from ``fit``):
        NonFiniteTrainingError: ``max_skipped_steps`` non-finite steps in a row.
    """

    def __init__(self, plan: Plan, max_skipped_steps: int = 20, warn_temp_c: float = 82.0):
        if not isinstance(plan, Plan):
            raise TightfitError(f"TightfitCallback(plan): plan must be a tightfit.Plan, got {type(plan).__name__}")
        refuse_fp16_on_cpu(plan, "TightfitCallback(plan)", _LIGHTNING_FP16_ON_CPU)  # as trainer_arguments does
        from ..config import check_guard_options

        check_guard_options(max_skipped_steps, warn_temp_c)
        self.plan, self.max_skipped_steps, self.warn_temp_c = plan, max_skipped_steps, warn_temp_c
        self.memory_timeline: list[tuple[int, int, int]] = []
        self.skipped_steps, self._skipped_in_row = 0, 0
        self._restored_in_row: int | None = None  # skipped steps in a row a resumed fit goes on from
        self.events: list[str] = []
        self.health = None
        self._last_step = 0
        self._unit: int | None = None  # samples in a full micro-batch (the loader's batch_size)
        self._sample_count: int | None = None  # samples of the micro-batch about to run backward
        self._window_samples: int | None = 0  # samples whose backward ran in this window (None: unknown)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Before ``fit``: checkpointing as planned, the plan's accumulation, checks of precision."""
        if stage != "fit":
            return
        from ..levers.checkpointing import set_activation_checkpointing, turned_off_note

        # on or off as planned: an earlier plan's checkpointing of the same module must not stay on (said: yours too)
        check_trainable(self.plan.trainable, pl_module, "the TightfitCallback")  # LoRA or freezing as planned
        planned = (self.plan.activation_checkpointing, self.plan.checkpoint_blocks, self.plan.block_policies)
        note = turned_off_note(_checkpointable(pl_module), *planned)
        set_activation_checkpointing(_checkpointable(pl_module), *planned)
        if note:
            self._event(note)
        if not pl_module.automatic_optimization:  # Lightning accumulates nothing for it: the training_step does
            if self.plan.accumulation_steps > 1:
                self._event(f"manual optimization: Lightning does not accumulate (accumulate_grad_batches is for "
                            f"automatic optimization), so the plan's {self.plan.accumulation_steps} is not set; for the "
                            f"plan's effective batch of {self.plan.effective_batch}, step your optimizer once every "
                            f"{self.plan.accumulation_steps} training batches of {self.plan.micro_batch}, each loss "
                            f"divided by {self.plan.accumulation_steps}")
        elif trainer.accumulate_grad_batches != self.plan.accumulation_steps:
            self._event(f"your Trainer's accumulate_grad_batches={trainer.accumulate_grad_batches} replaced by the "
                        f"plan's {self.plan.accumulation_steps}")
            trainer.accumulate_grad_batches = self.plan.accumulation_steps
        want = PRECISION[self.plan.precision]
        if str(trainer.precision) != want:
            self._event(f"your Trainer runs precision={trainer.precision!r}, the plan chose {want!r}: "
                        f"make the Trainer with trainer_arguments(plan)")

    def state_dict(self) -> dict:
        """The guards' counts, in the Trainer's checkpoints (``skipped_steps``, ``skipped_in_row``), as
        :meth:`tightfit.TrainStep.state_dict` keeps them: a ``fit(ckpt_path=...)`` goes on counting."""
        return {"skipped_steps": self.skipped_steps, "skipped_in_row": self._skipped_in_row}

    def load_state_dict(self, state_dict: dict) -> None:
        """Resuming from a checkpoint: the counts as it was written (before ``on_train_start``)."""
        self.skipped_steps = int(state_dict.get("skipped_steps", self.skipped_steps))
        self._restored_in_row = int(state_dict.get("skipped_in_row", 0))

    def on_train_start(self, trainer, pl_module) -> None:
        """Check the loader's batch against the plan's micro-batch; start the peaks and the health monitor.
        A new ``fit`` starts its own count of non-finite steps in a row (one resumed from a checkpoint:
        the count as it was written) and of optimizer steps."""
        # a count loaded by validate/test(ckpt_path=...) before a fresh fit is not this fit's: only a fit
        # resumed from a checkpoint (trainer.ckpt_path) goes on from one
        resumed = self._restored_in_row if getattr(trainer, "ckpt_path", None) else None
        self._skipped_in_row, self._restored_in_row = resumed or 0, None
        self._last_step = trainer.global_step
        batch = getattr(trainer.train_dataloader, "batch_size", None)
        if batch is not None and batch != self.plan.micro_batch:
            acc = trainer.accumulate_grad_batches
            if pl_module.automatic_optimization:
                trains = f"each optimizer step trains on {batch} x {acc} = {batch * acc} samples"
            else:  # Lightning accumulates nothing (acc is 1): how many batches a step takes is the training_step's
                trains = (f"under manual optimization, where your training_step decides how many training batches "
                          f"each optimizer step takes, each step trains on {batch} x that many samples (the plan's: "
                          f"{self.plan.micro_batch} x {self.plan.accumulation_steps})")
            self._event(f"your training loader's batch_size={batch}, the plan chose micro-batch "
                        f"{self.plan.micro_batch}: {trains} (the plan's effective "
                        f"batch: {self.plan.effective_batch}); make the loader with batch_size=plan.micro_batch")
        self._unit = batch or self.plan.micro_batch
        self._window_samples = 0
        if pl_module.device.type == "cuda":
            from ..runtime.health import HealthMonitor

            torch.cuda.reset_peak_memory_stats(pl_module.device)
            self.health = HealthMonitor(pl_module.device.index or 0, self.warn_temp_c)

    def _weighing(self, trainer, pl_module) -> bool:
        return pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1 and self._unit is not None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        """At a window's first micro-batch, copy the model's buffers (BatchNorm's statistics, for a
        skipped step); count the micro-batch's samples (for the exact accumulation, see the module doc)."""
        if getattr(self, "_window_buffers", None) is None:
            from ..buffers import buffer_snapshot

            self._window_buffers = buffer_snapshot(pl_module.modules())
        if not self._weighing(trainer, pl_module):
            return
        from lightning.pytorch.utilities.data import extract_batch_size

        try:
            self._sample_count = extract_batch_size(batch)
        except Exception:  # no tensor to count: this window is left as Lightning scales it
            self._sample_count = None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        """Weigh a micro-batch that holds other than a full micro-batch's samples by its share of one."""
        if not self._weighing(trainer, pl_module) or self._window_samples is None:
            return
        n = self._sample_count
        if n is None:
            self._window_samples = None
            if not any("cannot be counted" in e for e in self.events):  # said once
                self._event("a training batch whose samples cannot be counted: its accumulation window is scaled as "
                            "Lightning scales it (by accumulate_grad_batches), not by the samples it holds")
            return
        self._window_samples += n
        if n != self._unit:
            share = n / self._unit
            loss.register_hook(lambda g: g * share)  # this micro-batch's backward only

    def _to_window_mean(self, trainer, pl_module) -> None:
        """Scale the window's gradient, ``sum of (share of a full micro-batch x mean loss) / accumulate_grad_batches``
        as Lightning left it, to the mean over the samples the window held."""
        samples, self._window_samples = self._window_samples, 0
        if not self._weighing(trainer, pl_module) or not samples:
            return
        factor = trainer.accumulate_grad_batches * self._unit / samples
        if factor != 1:  # a short window: the last of an epoch
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """Scale a short window's gradient to its samples' mean (see the module doc); skip the step
        (16-mixed: through the loss scaler; else: drop the gradients) if a gradient or their norm is not
        finite; raise after too many."""
        from ..buffers import restore_buffers

        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        kept, self._window_buffers = getattr(self, "_window_buffers", None), None
        # the norm, not only each tensor (what unscale_ checks): finite gradients whose norm overflows
        # (~1e19 and up in fp32) are a non-finite step too, as in tightfit's own runtime (clipped, they
        # are zeros the optimizer would apply; unclipped, AdamW's second moment overflows)
        if not grads or bool(torch.isfinite(torch.nn.utils.get_total_norm(grads))):
            self._skipped_in_row = 0
            self._to_window_mean(trainer, pl_module)
            return
        restore_buffers(kept)  # the window's forwards folded the non-finite values into BatchNorm's statistics
        self._window_samples = 0
        self.skipped_steps += 1
        self._skipped_in_row += 1
        # the Trainer's loss scaler (16-mixed, whatever the plan chose) skips it and backs its scale off, as
        # for an inf gradient, also where its unscale_ found every gradient finite (a norm that overflows)
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        if not skip_through_loss_scaler(scaler, getattr(optimizer, "_optimizer", optimizer)):
            for p in pl_module.parameters():
                p.grad = None  # torch.optim leaves parameters without a gradient, and their state, untouched
        self._event(f"step {trainer.global_step + 1}: non-finite gradients, update skipped")
        if self._skipped_in_row >= self.max_skipped_steps:
            from ..levers.precision import nonfinite_advice
            from ..loop import as_arguments
            from ..runtime.trainer import NonFiniteTrainingError

            precision = str(trainer.precision)  # what the Trainer runs, the plan's or not (setup warned)
            precision = "bf16" if "bf16" in precision else "fp16" if precision.startswith("16") else "fp32"
            raise NonFiniteTrainingError(f"{self._skipped_in_row} steps in a row had non-finite gradients. "
                                         f"{as_arguments(nonfinite_advice(precision, own_loop=True))}",
                                         trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """After each optimizer step: its memory peaks (then reset) and the GPU's health, logged."""
        if trainer.global_step == self._last_step:  # a micro-batch inside an accumulation window
            return
        self._last_step = trainer.global_step
        if pl_module.device.type != "cuda":
            return
        peaks = (torch.cuda.max_memory_allocated(pl_module.device), torch.cuda.max_memory_reserved(pl_module.device))
        self.memory_timeline.append((trainer.global_step, *peaks))
        torch.cuda.reset_peak_memory_stats(pl_module.device)
        pl_module.log_dict({"peak_allocated_bytes": float(peaks[0]), "peak_reserved_bytes": float(peaks[1])},
                           on_step=True, on_epoch=False)
        reading = self.health.sample() if self.health is not None else None
        if reading and "temp_c" in reading:
            pl_module.log_dict({"gpu_temp_c": reading["temp_c"], "gpu_power_w": reading["power_w"]},
                               on_step=True, on_epoch=False)
            if "warning" in reading:
                self._event(reading["warning"])

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """On an out-of-memory error: say which micro-batch and accumulation keep the plan's
        effective batch (also where the loader's batch size differed from the plan's)."""
        from ..memory.oom import is_oom

        if not is_oom(exception):
            return
        if not getattr(trainer, "training", True):  # validation (the sanity check too), test or predict
            stage = "the sanity check's validation" if getattr(trainer, "sanity_checking", False) else "validation"
            if getattr(trainer, "testing", False) or getattr(trainer, "predicting", False):
                stage = "testing" if getattr(trainer, "testing", False) else "prediction"
            self._event(f"out of memory in {stage}, not in a training step: give its DataLoader a smaller batch_size "
                        "(the plan sizes the training micro-batch only)")
            return
        mb, acc = getattr(trainer.train_dataloader, "batch_size", None) or self.plan.micro_batch, \
            trainer.accumulate_grad_batches
        if mb > 1:
            # a divisor of the plan's samples per process and window: Lightning runs micro-batch x
            # accumulation samples per optimizer step. Said as the plan to fit with: trainer_arguments(plan)
            # refuses another accumulate_grad_batches than the plan's, and this callback's setup puts the plan's back
            E = self.plan.effective_batch
            new_mb, _ = smaller_micro_batch(mb, acc, samples=self.plan.rank_batch)
            new = self.plan.with_micro_batch(new_mb)
            if pl_module.automatic_optimization:
                at, steps = f"{mb} x {acc}", ""
            else:  # Lightning refuses accumulate_grad_batches above 1 here: the training_step accumulates
                at, steps = f"{mb}", f", your optimizer stepped every {new.accumulation_steps} training batches"
            self._event(f"out of memory at micro-batch {at}: Lightning cannot redo the step; fit again with "
                        f"plan = plan.with_micro_batch({new_mb}) ({new_mb} x {new.accumulation_steps}: the plan's "
                        f"effective batch of {E}) in trainer_arguments(plan), TightfitCallback(plan) and "
                        f"DataLoader(batch_size=plan.micro_batch){steps}, or plan for a smaller budget")
        else:
            self._event("out of memory at micro-batch 1: plan with activation checkpointing or fp16/bf16, "
                        "or raise the budget")

