"""tightfit where you already train: the Hugging Face Trainer (:mod:`.hf`) and Lightning (:mod:`.lightning`).

Each takes a plan from :func:`tightfit.plan` and turns it into the framework's own settings, and adds
a callback for memory and health reporting and tightfit's guards where the framework allows them.
"""

from __future__ import annotations

import importlib
import logging

from ..errors import TightfitError


def require(module: str, extra: str = "integrations"):
    """Import ``module``, or fail with one line naming the extra that installs it.

    Raises:
        TightfitError: ``module`` is not installed.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TightfitError(f"{module} is not installed: pip install 'tightfit[{extra}]'") from None


def refuse_fp16_on_cpu(plan, called: str, framework_does: str) -> None:
    """Refuse an fp16 plan for the CPU, as :class:`tightfit.TrainStep` does: neither framework has
    fp16 autocast or loss scaling there, and each trains something else without a word
    (``framework_does`` says what). A bf16 plan runs real bf16 autocast on the CPU and stays.

    Raises:
        TightfitError: ``plan`` is fp16 with ``device="cpu"``; the message names ``called``.
    """
    if plan is not None and plan.precision == "fp16" and plan.device == "cpu":
        raise TightfitError(f"{called}: an fp16 plan for the CPU (plan.device='cpu'): {framework_does}; plan on the "
                            "CPU in fp32 (as tightfit.plan makes it), or for a CUDA GPU")


def smaller_micro_batch(per_device: int, accumulation: int, samples: int | None = None) -> tuple[int, int]:
    """After an OOM at ``per_device`` x ``accumulation``: the largest micro-batch of at most half
    ``per_device`` that divides the effective batch, and its accumulation steps: the HF Trainer and
    Lightning run micro-batch x accumulation samples per optimizer step (no shorter last micro-batch),
    so only a divisor keeps the effective batch. E.g. 8 x 1 -> 4 x 2; 6 x 2 -> 3 x 4; 5 x 2 -> 2 x 5.
    ``samples``: the samples per process and step to keep (a plan's ``rank_batch``), where they are
    not ``per_device`` x ``accumulation`` (a loader of another batch than the plan's); default: those.

    Raises:
        ValueError: ``per_device`` below 2 (nothing smaller to go to).
    """
    if per_device < 2:
        raise ValueError("a micro-batch of 1 cannot be split")
    effective = samples or per_device * accumulation
    micro = next(m for m in range(per_device // 2, 0, -1) if effective % m == 0)
    return micro, effective // micro


def note_uneven(plan, framework: str) -> None:
    """Warn (logger ``tightfit.integrations``) when ``framework`` -- which runs micro-batch x
    accumulation samples per optimizer step on each of the plan's processes, with no shorter last
    micro-batch -- would not run the plan's effective batch exactly (e.g. 12 x 4 = 48 for 40;
    5 x 1 x 2 processes = 10 for 9)."""
    runs = plan.micro_batch * plan.accumulation_steps * plan.world_size
    if runs != plan.effective_batch:
        ranks = f" x {plan.world_size} processes" if plan.world_size > 1 else ""
        logging.getLogger(__name__).warning(
            f"note: {framework} effective batch is {plan.micro_batch} x {plan.accumulation_steps}{ranks} = "
            f"{runs} samples (the plan's: {plan.effective_batch})")


def note_sharding(plan, framework: str, given: bool, settings: str) -> None:
    """Warn (logger ``tightfit.integrations``) that ``framework`` replicates the model in every
    process (DDP) where ``plan`` shards it with FSDP2 and ``given`` is False (none of the
    framework's own sharding ``settings`` was given): its state may not fit as planned."""
    if plan.sharding == "fsdp" and not given:
        logging.getLogger(__name__).warning(
            f"note: the plan shards the model with FSDP2 over {plan.world_size} processes; {framework} replicates it "
            f"in every process (DDP), whose state may not fit the budget, unless given {settings}")


def check_trainable(trainable: str, model, called: str) -> None:
    """Refuse a LoRA or freezing plan (``Plan.trainable``) for a model not set up that way, as
    :class:`tightfit.TrainStep` does (:func:`tightfit.levers.trainable.check_trainable`): the
    framework would train every parameter, with gradients and optimizer state the plan left out.
    ``model`` or a module inside it (a LightningModule's wrapped model) may be the one planned.

    Raises:
        TightfitError: one line, naming ``called``.
    """
    from ..levers.trainable import check_trainable as check

    if trainable == "all":
        return
    refused = None
    # the module, then every module inside it that holds others (leaves hold no adapters or blocks)
    for candidate in (model, *(m for m in model.modules() if m is not model and next(m.children(), None))):
        try:
            check(trainable, candidate)
            return
        except TightfitError as e:
            refused = refused or e
    raise TightfitError(f"{called}: {refused}") from None


class Watch:
    """What both callbacks keep and report: ``memory_timeline`` (``(step, peak allocated bytes,
    peak reserved bytes)`` per optimizer step, CUDA), ``health`` (an NVML monitor or None),
    ``skipped_steps`` and ``events`` (one line each, also logged as warnings)."""

    memory_timeline: list
    health: object
    skipped_steps: int
    events: list

    def summary(self) -> dict:
        """``{"peak_allocated_bytes", "peak_reserved_bytes", "skipped_steps", "max_temp_c", "max_power_w",
        "health"}`` over the run so far (peaks None on the CPU)."""
        t, h = self.memory_timeline, self.health
        return {"peak_allocated_bytes": max((x[1] for x in t), default=None),
                "peak_reserved_bytes": max((x[2] for x in t), default=None), "skipped_steps": self.skipped_steps,
                "max_temp_c": h.max_temp_c if h else None, "max_power_w": h.max_power_w if h else None,
                "health": h.status if h else "off (no CUDA GPU)"}

    def _event(self, message: str) -> None:
        self.events.append(message)
        logging.getLogger(type(self).__module__).warning("tightfit: %s", message)


def skip_through_loss_scaler(scaler, optimizer) -> bool:
    """Have ``scaler`` (a ``torch.amp.GradScaler``) skip ``optimizer``'s coming step as it skips one
    whose gradients are not finite: its ``step`` leaves the weights and the optimizer's state as they
    were, and its ``update`` backs the scale off (``backoff_factor``) and restarts its growth count --
    where dropping the gradients would have it step (on nothing) and count the step towards a larger
    scale. For a step a callback finds non-finite after the scaler's ``unscale_`` found every
    gradient finite (a norm that overflows; gradients the clipping turned non-finite).

    Returns:
        False when ``scaler`` cannot skip it (None, disabled, already stepped, or no gradient of
        ``optimizer`` to check): the caller drops the gradients then.
    """
    from torch.amp.grad_scaler import OptState

    states = getattr(scaler, "_per_optimizer_states", None)
    if scaler is None or states is None or not scaler.is_enabled():
        return False
    state = states[id(optimizer)]
    if state["stage"] is OptState.STEPPED:
        return False
    if state["stage"] is OptState.READY:  # not unscaled yet (an optimizer that unscales in its step): as step would
        scaler.unscale_(optimizer)
    found = state["found_inf_per_device"]
    if not found:
        return False
    for flag in found.values():  # what unscale_ records for a non-finite gradient: step skips, update backs off
        flag.fill_(1.0)
    return True
