"""tightfit with the Hugging Face ``Trainer``: the plan as ``TrainingArguments``, a callback, and an OOM redo.

Three added lines, three changed::

    import tightfit
    from tightfit.integrations import hf
    plan = tightfit.plan(model, sample_batch, effective_batch=32, budget="4GiB")
    args = TrainingArguments(**hf.training_arguments(plan, output_dir="out", ...))  # your other arguments
    trainer = Trainer(model, args, ..., callbacks=[hf.TightfitCallback(plan)])
    hf.train(trainer)            # in place of trainer.train()

What each part does, and what the Trainer leaves out of reach:

- :func:`training_arguments`: micro-batch, gradient accumulation steps, fp16/bf16 autocast and
  activation checkpointing (non-reentrant), as the ``TrainingArguments`` that mean them, merged with
  yours; nothing else changes (the optimizer and gradient clipping stay the Trainer's or yours).
- :class:`TightfitCallback`: per-step peak allocated/reserved memory and GPU health (NVML) in the
  Trainer's logs; skips an optimizer step whose gradients are not finite (in fp32/bf16 the Trainer
  would apply it; in fp16 it goes to the Trainer's loss scaler, which skips it and backs off its scale)
  and stops training after
  ``max_skipped_steps`` in a row (its counts go into each checkpoint's ``trainer_state.json``, so a
  resumed run goes on from them); warns when the arguments differ from the plan (after an OOM redo
  of :func:`train`: the redo's), and, under a plain ``trainer.train()``, when the Trainer would scale
  the loss by the accumulation steps (below).
- :func:`train`: the OOM policy. An out-of-memory error inside the Trainer's step cannot be caught
  inside it, so :func:`train` catches it around ``trainer.train()`` and trains again with half the
  micro-batch and twice the accumulation (the same effective batch): from the start when no
  optimizer step had been taken (the weights are untouched; the RNG states are restored), else
  from the newest checkpoint this call wrote at or before the failed step (or the one it was asked
  to resume from; never another run's folder left in ``output_dir``: the Trainer restores weights,
  optimizer, schedule, RNG and data position, and :func:`train` the stateful callbacks' counts, such
  as early stopping's, as that checkpoint was written); with no such checkpoint to go back to, it
  stops with a message saying so.
  An OOM raised by evaluation during ``trainer.train()`` is not redone (a smaller training
  micro-batch would not help it): it is refused naming ``per_device_eval_batch_size``.
  The Trainer's own ``auto_find_batch_size`` also restarts after an OOM, but shrinks the
  per-device batch at the same accumulation -- a smaller effective batch -- and restarts from
  step 0 with the weights the failed attempt had already updated; :func:`training_arguments`
  turns it off.

  It also keeps the gradient of micro-batch x accumulation that of one batch of the effective size
  -- the mean over the window's labelled items (samples; target tokens for a causal LM), also in a
  short last window of an epoch -- where the Trainer alone would not: for a model whose ``forward``
  takes ``**kwargs`` the Trainer assumes the loss divides by ``num_items_in_batch`` (the window's
  count of labels) and skips its own division by the accumulation steps; a loss that ignores the
  count (BERT's sequence classification head, among others: transformers#37766) then grows with the
  accumulation steps; and without ``**kwargs`` it divides each micro-batch's mean by the number of
  micro-batches, which weighs the samples of a short last micro-batch more. :func:`train` has each
  micro-batch's own mean loss weighed by its share of the window's items
  (:func:`scale_loss_as_one_batch`); a loss that already divides by the count (causal LMs) keeps the
  Trainer's handling. A :class:`TightfitCallback` under a plain ``trainer.train()`` warns when the
  Trainer would scale a loss by the accumulation steps.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import logging
import os
import textwrap
from collections.abc import Mapping

import torch

from ..config import check_guard_options
from ..errors import TightfitError
from ..plan import Plan, refuse_parameter_offload
from . import (Watch, check_trainable, note_sharding, note_uneven, refuse_fp16_on_cpu, require, skip_through_loss_scaler,
               smaller_micro_batch)

# what the Trainer does with an fp16 plan on the CPU (refuse_fp16_on_cpu)
_HF_FP16_ON_CPU = ("the Trainer runs fp16=True, use_cpu=True in fp32 without a word (accelerate has no fp16 "
                   "autocast or loss scaling on the CPU)")

transformers = require("transformers")
require("accelerate")  # the Trainer's own dependency

__all__ = ["TightfitCallback", "loss_uses_item_count", "scale_loss_as_one_batch", "smaller_micro_batch", "train",
           "training_arguments"]

log = logging.getLogger(__name__)

# tightfit's optimizer kinds (tightfit.step.OPTIMIZERS) as the Trainer's ``optim`` names
# (bitsandbytes' AdamW8bit is the Trainer's "adamw_bnb_8bit"; it has no CPU-offloaded AdamW)
_OPTIM = {"adamw": "adamw_torch_fused", "adamw-foreach": "adamw_torch", "sgd": "sgd", "adamw8bit": "adamw_bnb_8bit"}


def checkpointing_field() -> str:
    """The ``TrainingArguments`` field that turns activation checkpointing on: transformers 5.x
    renamed ``gradient_checkpointing`` to ``activation_checkpointing`` (the old name warns)."""
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def training_arguments(plan: Plan, **yours) -> dict:
    """``TrainingArguments`` keyword arguments that run ``plan``, merged with ``yours``:
    ``TrainingArguments(**training_arguments(plan, output_dir="out", learning_rate=2e-5, ...))``.

    The plan sets ``per_device_train_batch_size`` = the micro-batch, ``gradient_accumulation_steps``
    = the plan's accumulation steps, ``fp16``/``bf16`` (autocast; fp16 with the Trainer's dynamic
    loss scaling), ``activation_checkpointing`` (``gradient_checkpointing`` before transformers 5;
    non-reentrant, every layer: the Trainer cannot checkpoint a subset, so a plan that checkpoints
    some blocks uses less memory and more time here; for a model without Hugging Face's hook, or
    with BatchNorm, or a plan of per-block selective recomputation or activation offload
    (``block_policies``), :func:`train` runs tightfit's block wrappers instead), ``use_cpu`` and ``auto_find_batch_size=False``
    (see the module doc). Everything else is yours or the Trainer's default: ``optim`` is set only
    when you gave none and the Trainer's default is not the plan's optimizer (transformers 5's
    default is the plan's fused AdamW); gradient
    clipping stays ``max_grad_norm`` (yours, or the Trainer's 1.0). The Trainer's effective batch is
    micro-batch x accumulation steps, which is the plan's unless its last micro-batch is short (e.g.
    10 samples as 4+4+2: the Trainer runs 4 x 3 = 12); a note is logged then.

    Args:
        plan: from :func:`tightfit.plan`.
        yours: your own ``TrainingArguments`` keywords; one the plan sets may be given only with the
            plan's value (delete your batch size, accumulation and precision arguments).

    Raises:
        TightfitError: ``plan`` is not a :class:`tightfit.Plan`; one of ``yours`` sets what the plan
            sets to another value (one line naming each); the plan's optimizer has no Trainer
            counterpart (``adamw-offload``); an fp16 plan for the CPU (the Trainer would train it in
            fp32 without saying so, as :class:`tightfit.TrainStep` refuses it; a bf16 one runs bf16
            autocast on the CPU).
    """
    if not isinstance(plan, Plan):
        raise TightfitError(f"training_arguments(plan): plan must be a tightfit.Plan, got {type(plan).__name__}")
    refuse_parameter_offload(plan, "the HF Trainer integration")
    refuse_fp16_on_cpu(plan, "training_arguments(plan)", _HF_FP16_ON_CPU)
    ckpt = plan.activation_checkpointing
    if plan.optimizer not in _OPTIM:
        raise TightfitError(f"the HF Trainer has no optimizer for plan.optimizer {plan.optimizer!r}; "
                            f"plan with one of {', '.join(_OPTIM)}")
    name = checkpointing_field()
    planned = {"per_device_train_batch_size": plan.micro_batch, "gradient_accumulation_steps": plan.accumulation_steps,
               "fp16": plan.precision == "fp16", "bf16": plan.precision == "bf16",
               name: ckpt, f"{name}_kwargs": {"use_reentrant": False} if ckpt else None,
               "use_cpu": plan.device == "cpu", "auto_find_batch_size": False}
    default = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}["optim"]
    if "optim" not in yours and _OPTIM[plan.optimizer] != getattr(default, "value", default):
        planned["optim"] = _OPTIM[plan.optimizer]  # only when the Trainer's default is not the plan's optimizer
    old = "gradient_checkpointing" if name == "activation_checkpointing" else None
    as_yours = {(name + k[len(old):] if old and k.startswith(old) else k): k for k in yours}  # named as you named it
    given = {k: yours[y] for k, y in as_yours.items()}
    conflicts = [f"{as_yours[k]}={given[k]!r} (the plan chose {v!r})" for k, v in planned.items()
                 if k in given and given[k] != v and not (k.endswith("_kwargs") and not ckpt)]
    if conflicts:
        raise TightfitError(f"training_arguments(plan, ...): your {', '.join(conflicts)}; the plan sets "
                            f"{'it' if len(conflicts) == 1 else 'them'}: delete "
                            f"{'it' if len(conflicts) == 1 else 'them'} from your arguments (the plan's effective "
                            f"batch is {plan.micro_batch} x {plan.accumulation_steps}; "
                            f"it sets {', '.join(planned)})")
    note_uneven(plan, "the Trainer's")
    note_sharding(plan, "the Trainer", bool(yours.get("fsdp") or yours.get("deepspeed")),
                  "its own FSDP settings (fsdp=..., fsdp_config=...) or DeepSpeed ZeRO-3")
    return {**given, **planned}


def _forward_uses_item_count(fn) -> bool | None:
    """Whether one ``forward`` passes ``num_items_in_batch`` on to its loss: it names
    ``num_items_in_batch``, or calls a loss (a callable whose name has "loss") with ``**kwargs``
    (as ``self.loss_function(logits, labels, vocab_size=..., **kwargs)``). None: no source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "num_items_in_batch" or \
                isinstance(node, ast.Attribute) and node.attr == "num_items_in_batch" or \
                isinstance(node, ast.Constant) and node.value == "num_items_in_batch" or \
                isinstance(node, ast.keyword) and node.arg == "num_items_in_batch":
            return True
        if isinstance(node, ast.Call) and any(k.arg is None for k in node.keywords):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if "loss" in name.lower():
                return True
    return False


def loss_uses_item_count(model) -> bool | None:
    """Whether ``model``'s own loss divides by the ``num_items_in_batch`` the Hugging Face Trainer
    passes to a ``forward`` that takes ``**kwargs``: the model's ``accepts_loss_kwargs`` where it sets
    one (as the Trainer reads it), else whether a ``forward`` of its class or a base class hands the
    count to its loss (read from their source). None: not known (no ``**kwargs``, or no source).

    A ``forward`` with ``**kwargs`` whose loss ignores the count (``BertForSequenceClassification``'s
    ``CrossEntropyLoss()``) gives, under the Trainer's gradient accumulation, a loss and gradient
    ``gradient_accumulation_steps`` times those of one batch (transformers#37766).
    """
    if hasattr(model, "get_base_model"):  # PEFT: the Trainer inspects the base model
        model = model.get_base_model()
    if hasattr(model, "accepts_loss_kwargs"):
        return bool(model.accepts_loss_kwargs)
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return None  # the Trainer passes it nothing
    seen = []
    for cls in type(model).__mro__:
        if cls is torch.nn.Module:
            break
        if "forward" in vars(cls):
            seen.append(_forward_uses_item_count(vars(cls)["forward"]))
    if any(seen):
        return True
    return None if None in seen or not seen else False


def _own_compute_loss_uses_count(trainer) -> bool:
    """Whether ``trainer``'s class overrides ``compute_loss`` with one whose body uses
    ``num_items_in_batch`` (read from its source, as :func:`_forward_uses_item_count` reads a
    forward): the Trainer hands it the window's count, and it is that loss's to use. Taking the
    keyword is not enough: the Trainer passes it to every override (transformers 5), and one that
    ignores it returns a mean the Trainer must divide by the accumulation steps."""
    own = type(trainer).compute_loss
    return own is not transformers.Trainer.compute_loss and _forward_uses_item_count(own) is True


def _drops_item_count(trainer) -> bool:
    """Whether ``trainer`` (as built) would skip its division by the accumulation steps for a loss
    that does not divide by ``num_items_in_batch`` itself."""
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        return False
    if getattr(trainer, "compute_loss_func", None) is not None:
        return False  # yours gets the count (and the Trainer counts on it)
    if _own_compute_loss_uses_count(trainer):
        return False  # the same: your compute_loss divides by the count (transformers' documented pattern)
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return False  # you said how your compute_loss scales (transformers 5.x)
    smoother = getattr(trainer, "label_smoother", None)
    if smoother is not None:  # the Trainer's own loss, not the model's
        try:
            return "num_items_in_batch" not in inspect.signature(smoother).parameters
        except (TypeError, ValueError):
            return False
    model = trainer.model
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    if unwrap is not None:
        model = unwrap(model)
    return loss_uses_item_count(model) is False


def _divides_by_steps(trainer) -> bool:
    """Whether ``trainer`` (as set now) divides each micro-batch's loss by the accumulation steps
    (transformers' ``training_step``): no ``loss_is_scaled_for_ga`` of True, no ``compute_loss_func``,
    and no count handed to the model (``model_accepts_loss_kwargs`` False)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is not None:
        return not scaled
    return getattr(trainer, "compute_loss_func", None) is None and not getattr(trainer, "model_accepts_loss_kwargs", False)


def _label_items(trainer, batch):
    """The labelled items of one micro-batch as the Trainer counts ``num_items_in_batch`` (labels not
    -100; a causal LM's from the second position on, as its loss shifts them): a 0-d tensor, or None
    when the batch has no ``labels`` tensor."""
    labels = batch.get("shift_labels", batch.get("labels")) if isinstance(batch, Mapping) else None
    if not torch.is_tensor(labels):
        return None
    # token labels only ([B, T]): a classifier on a causal LM's states has class ids ([B]) nothing shifts
    if "shift_labels" not in batch and labels.dim() >= 2 and _shifts_labels(trainer):
        labels = labels[..., 1:]
    return labels.ne(-100).sum()


def _window_items(trainer, batches: list):
    """The labelled items of an accumulation window's micro-batches (:func:`_label_items`, summed):
    a 0-d tensor, or None where the window is empty or a micro-batch has no ``labels`` tensor."""
    items = [_label_items(trainer, b) for b in batches]
    return None if not items or any(n is None for n in items) else sum(items)


def _counted_unshifted(model) -> bool:
    """Whether the Trainer counts ``model``'s labels unshifted although its loss shifts them (a
    causal LM whose ``loss_type`` names no causal LM loss, as the Trainer decides its
    ``_loss_shifts_labels``; every causal LM under transformers without ``LOSS_MAPPING``): what
    :func:`_recount_targets` mends under :func:`train`."""
    from ..loop import label_shift

    if label_shift(model) != 1 or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return True
    return LOSS_MAPPING.get(getattr(model, "loss_type", None)) is not ForCausalLMLoss


def _shifts_labels(trainer) -> bool:
    """Whether the trained model's loss predicts the next token (its targets are ``labels[..., 1:]``):
    the Trainer's own verdict (``_loss_shifts_labels``, from the model's ``loss_type``) or the causal
    LM classes' (:func:`tightfit.loop.label_shift`), since a causal LM whose ``loss_type`` names no
    loss (GPT-2's ``GPT2LMHeadModel``, transformers 5.25) still shifts its labels."""
    from ..loop import label_shift

    return bool(getattr(trainer, "_loss_shifts_labels", False)) or label_shift(trainer.model) == 1


def _recount_targets(trainer) -> bool:
    """Make the Trainer's ``num_items_in_batch`` the window's target tokens for a causal LM whose
    loss divides by it but which the Trainer counts unshifted (its ``_loss_shifts_labels`` False
    or absent: GPT-2 under transformers 5.25, every causal LM under older ones): one label too many
    per row, so each window's loss came out scaled by targets / (targets + rows). The count is the
    same whoever divides by it: the model's loss, the label smoother or your ``compute_loss_func``.
    One process only (the Trainer may gather the count across processes). Returns whether it
    changed anything."""
    if getattr(trainer, "_loss_shifts_labels", False) or not _shifts_labels(trainer) or not _one_process(trainer):
        return False
    get_batch_samples = trainer.get_batch_samples

    def recounted(epoch_iterator, num_batches, device):
        batches, count = get_batch_samples(epoch_iterator, num_batches, device)
        ours = _window_items(trainer, batches)
        if count is None or ours is None:
            return batches, count
        return batches, ours.to(count.device) if torch.is_tensor(count) else ours

    trainer.get_batch_samples = recounted
    trainer._tightfit_weighs_items = True
    log.info("tightfit: the Trainer counts %s's labels unshifted (its loss_type names no causal LM loss): "
             "num_items_in_batch counted from each row's second position on, as its loss shifts them",
             type(trainer.model).__name__)
    return True


def _one_process(trainer) -> bool:
    """Whether ``trainer`` trains in one process on at most one GPU and has ``get_batch_samples``
    (where it counts each window's ``num_items_in_batch``)."""
    args = trainer.args
    return callable(getattr(trainer, "get_batch_samples", None)) and args.world_size == 1 and args.n_gpu <= 1


def _can_weigh_items(trainer) -> bool:
    """Whether :func:`scale_loss_as_one_batch` can weigh each micro-batch's loss itself: the Trainer's
    own ``compute_loss`` on the model's own loss (no ``compute_loss_func``, label smoother, or
    ``loss_is_scaled_for_ga`` of yours), one process, and a Trainer with ``get_batch_samples``."""
    return (type(trainer).compute_loss is transformers.Trainer.compute_loss
            and getattr(trainer, "compute_loss_func", None) is None
            and getattr(trainer, "label_smoother", None) is None
            and getattr(trainer, "loss_is_scaled_for_ga", None) is None
            and _one_process(trainer))


def scale_loss_as_one_batch(trainer) -> bool:
    """Make ``trainer``'s gradient of each accumulation window that of one batch of the window's
    samples, however the window is split into micro-batches (see the module doc). :func:`train` does
    this; it stays in force for the Trainer's later ``train()`` calls.

    Where the model's loss does not itself divide by ``num_items_in_batch`` (:func:`loss_uses_item_count`
    not True), each micro-batch's loss -- the model's own mean over its labelled items -- is multiplied
    by its share of the window's labelled items (counted as the Trainer counts ``num_items_in_batch``)
    and the Trainer's division by the accumulation steps is turned off (``loss_is_scaled_for_ga``);
    the model is then given no count (``model_accepts_loss_kwargs = False``). A window whose batches
    have no ``labels`` falls back to the Trainer's division by its number of micro-batches. With your
    own ``compute_loss``, ``compute_loss_func`` or label smoothing, or several processes, the Trainer
    only divides a loss that ignores the count by the accumulation steps (``model_accepts_loss_kwargs
    = False``), which is exact when all micro-batches of a window hold as many items.

    Returns:
        Whether it changed anything.
    """
    if getattr(trainer, "_tightfit_weighs_items", False):
        return False  # done by an earlier call
    model = trainer.model
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    if unwrap is not None:
        model = unwrap(model)
    if trainer.model_accepts_loss_kwargs and loss_uses_item_count(model) is True:
        return _recount_targets(trainer)  # the model divides by the window's count itself: that count right
    if not _can_weigh_items(trainer):
        changed = _drops_item_count(trainer)
        if changed:
            trainer.model_accepts_loss_kwargs = False
        # a forward without **kwargs (model_accepts_loss_kwargs False) is given no count either: the
        # Trainer divides its mean by the accumulation steps all the same, and that is said too
        if not _divides_by_steps(trainer):
            return changed
        # the Trainer's division is exact only for windows of equal micro-batches: tightfit cannot
        # weigh a loss it did not compute (your compute_loss, label smoothing, several processes)
        say = log.warning if trainer.args.gradient_accumulation_steps > 1 else log.info  # one micro-batch: exact
        say("tightfit: %s's loss ignores num_items_in_batch (or is given none), so the Trainer divides each "
            "micro-batch's mean by the accumulation steps (model_accepts_loss_kwargs=False): a window trains as one batch "
            "of its samples only where its micro-batches hold as many labelled items (a short last "
            "micro-batch, or labels of -100, weigh differently); %s", type(trainer.model).__name__,
            "to make every window exact, have your compute_loss divide its sum by num_items_in_batch (for a forward "
            "without **kwargs, set trainer.model_accepts_loss_kwargs = True too, so that the Trainer counts them)"
            if type(trainer).compute_loss is not transformers.Trainer.compute_loss else
            "hf.train weighs each micro-batch itself only for the model's own loss, without label smoothing, in one process")
        return changed

    window = {"items": None}  # the labelled items of the accumulation window being trained
    get_batch_samples, compute_loss = trainer.get_batch_samples, trainer.compute_loss

    def counted_batch_samples(epoch_iterator, num_batches, device):
        batches, count = get_batch_samples(epoch_iterator, num_batches, device)
        window["items"] = _window_items(trainer, batches)
        return batches, count

    def weighed_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        items = _label_items(trainer, inputs) if model.training else None  # before compute_loss takes labels
        out = compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not model.training:  # evaluation: the loss as the model gives it
            return out
        loss = out[0] if return_outputs else out
        if items is not None and window["items"] is not None:
            items = items.to(loss.device)
            # no labelled item: the model's mean is 0/0 = NaN, and NaN x 0 is NaN; such a micro-batch
            # adds 0 to the window's loss (torch.where: no host read of the count), as TrainStep's does
            loss = torch.where(items > 0, loss * (items / window["items"].to(loss.device)), loss.new_zeros(()))
        else:  # no labels to count: the Trainer's own division by the window's micro-batches
            loss = loss / trainer.current_gradient_accumulation_steps
        return (loss, *out[1:]) if return_outputs else loss

    trainer.get_batch_samples, trainer.compute_loss = counted_batch_samples, weighed_loss
    trainer.model_accepts_loss_kwargs = False  # the model's own mean over each micro-batch, no count passed
    trainer.loss_is_scaled_for_ga = True  # weighed above: the Trainer divides no further
    trainer._tightfit_weighs_items = True
    log.info("tightfit: %s's loss is weighed by each micro-batch's share of its accumulation window's labelled "
             "items, as one batch of the window", type(trainer.model).__name__)
    return True


class TightfitCallback(Watch, transformers.TrainerCallback):
    """Memory and health reporting and the non-finite guard for the Hugging Face ``Trainer``.

    At every optimizer step: the peak allocated and reserved CUDA memory since the previous one
    (:attr:`memory_timeline`) and an NVML health reading; both go into the Trainer's logs as
    ``peak_allocated_bytes``, ``peak_reserved_bytes`` (the largest since the last log, bytes),
    ``gpu_temp_c`` and ``gpu_power_w``. Before the optimizer step, after the Trainer has unscaled
    and clipped: if a gradient is not finite, the step is skipped -- in fp32/bf16 by dropping the
    gradients, so that the optimizer leaves every parameter and its state as they were (the
    learning-rate schedule still advances, as in ``tightfit train``); in fp16 by having the Trainer's
    loss scaler skip it as it skips an inf gradient: the step is not taken and the scale is backed
    off (``GradScaler.update``), also where the scaler's ``unscale_`` had found every gradient finite
    (the schedule then does as the Trainer does for a step its scaler skips). Under :func:`train` a
    step whose gradients are finite but whose norm (before the Trainer's clipping) is not is skipped
    too, in every precision (the clipping made them zeros, which the optimizer would apply and the
    loss scaler count as a clean step). After ``max_skipped_steps``
    skipped steps in a row training stops (:attr:`stop_reason` says why; :func:`train` raises it).

    Args:
        plan: the plan the arguments were made from (None: no check of the arguments).
        max_skipped_steps: stop after this many non-finite steps in a row.
        warn_temp_c: log a warning when the GPU reaches this temperature (deg C).

    Attributes:
        memory_timeline: ``(step, peak allocated bytes, peak reserved bytes)`` per optimizer step (CUDA).
        skipped_steps, events, stop_reason: what the guards did.
    """

    def __init__(self, plan: Plan | None = None, max_skipped_steps: int = 20, warn_temp_c: float = 82.0):
        if plan is not None and not isinstance(plan, Plan):
            raise TightfitError(f"TightfitCallback(plan): plan must be a tightfit.Plan or None, got {type(plan).__name__}")
        refuse_fp16_on_cpu(plan, "TightfitCallback(plan)", _HF_FP16_ON_CPU)  # as training_arguments does
        check_guard_options(max_skipped_steps, warn_temp_c)
        self.plan, self.max_skipped_steps, self.warn_temp_c = plan, max_skipped_steps, warn_temp_c
        self.memory_timeline: list[tuple[int, int, int]] = []
        self.skipped_steps, self._skipped_in_row = 0, 0
        self.events: list[str] = []
        self.stop_reason: str | None = None
        self.health = None
        self._logged_upto = 0  # memory_timeline entries already in a log record
        self._redone_at: tuple[int, int] | None = None  # per-device batch x accumulation of train()'s OOM redo
        self._in_train = False  # run by train(), which fixes the Trainer's loss scaling
        self._grad_norm = None  # the window's gradient norm before the Trainer's clipping (handed over by train())
        self._redo_in_row: int | None = None  # skipped steps in a row that train()'s OOM redo goes on from

    def on_train_begin(self, args, state, control, train_dataloader=None, model=None, **kwargs):
        """Check the arguments against the plan; start the memory peaks and the health monitor.
        A new ``train`` starts its own count of non-finite steps in a row, without the last one's stop
        (an OOM redo of :func:`train` from a checkpoint: the count as that checkpoint was written)."""
        self.stop_reason, self._skipped_in_row, self._redo_in_row = None, self._redo_in_row or 0, None
        saved = (state.stateful_callbacks or {}).get(_STATE_KEY)
        if isinstance(saved, Mapping):  # resumed from a checkpoint that holds the counts (see _keep_counts)
            self.skipped_steps = int(saved.get("skipped_steps", self.skipped_steps))
            self._skipped_in_row = int(saved.get("skipped_in_row", 0))
        if self.plan is not None:
            self._check_arguments(args, train_dataloader)
            if model is not None and not self._in_train:  # hf.train refuses it before the Trainer starts
                try:
                    check_trainable(self.plan.trainable, model, "the TightfitCallback")
                except TightfitError as e:
                    self._event(str(e))
            if not self._in_train and _per_block(self.plan):
                self._event("the plan's per-block activation policies (selective recomputation, activation offload: "
                            f"{', '.join(self.plan.block_policies)}) run only under hf.train(trainer); a plain "
                            "trainer.train() "
                            + ("recomputes every layer whole instead (more time than planned)"
                               if getattr(args, _checkpointing_argument(args), False) else
                               "keeps every layer's activations (more memory than planned)"))
        if not self._in_train and model is not None and _counted_unshifted(model):
            self._event(f"the Trainer counts {type(model).__name__}'s labels unshifted (its loss_type names no causal LM "
                        "loss) while its loss predicts the next token: each window's loss and gradient come out "
                        "scaled by target tokens / (target tokens + rows); hf.train(trainer) counts them from each "
                        "row's second position on")
        if not self._in_train and args.gradient_accumulation_steps > 1 and model is not None \
                and loss_uses_item_count(model) is False:
            self._event(f"{type(model).__name__}'s forward takes **kwargs but its loss ignores num_items_in_batch: "
                        f"unless your compute_loss divides by num_items_in_batch or trainer.model_accepts_loss_kwargs "
                        f"is False, the Trainer's loss and gradients are "
                        f"{args.gradient_accumulation_steps} (gradient_accumulation_steps) times those of one batch "
                        f"(transformers#37766); hf.train(trainer) weighs each micro-batch as one batch of the window")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            if self.health is None:
                from ..runtime.health import HealthMonitor

                self.health = HealthMonitor(torch.cuda.current_device(), self.warn_temp_c)

    def _check_arguments(self, args, loader) -> None:
        p = self.plan
        batch = getattr(loader, "batch_size", None) or args.per_device_train_batch_size
        precision = {"fp16": "fp16=True", "bf16": "bf16=True", "fp32": "fp16=False, bf16=False"}
        # after train()'s OOM redo, the plan in force is the redo's (same effective batch)
        micro, steps = self._redone_at or (p.micro_batch, p.accumulation_steps)
        want = {"per_device_train_batch_size": (batch, micro),
                "gradient_accumulation_steps": (args.gradient_accumulation_steps, steps),
                "precision": ("fp16" if args.fp16 else "bf16" if args.bf16 else "fp32", p.precision)}
        for name, (got, planned) in want.items():
            if got != planned:
                yours, chosen = ((precision[got], precision[planned]) if name == "precision" else
                                 (f"{name}={got}", planned))
                self._event(f"your TrainingArguments run {yours}, the plan chose {chosen}"
                            + (" (a batch found by auto_find_batch_size: the effective batch is smaller than "
                               "planned)" if name == "per_device_train_batch_size" and args.auto_find_batch_size
                               else ""))

    def _redo(self, micro: int, steps: int, reason: str) -> None:
        """:func:`train` trains again at ``micro`` x ``steps`` after an OOM: the plan in force from now."""
        self._redone_at = (micro, steps)
        if self.plan is not None:
            self.plan = self.plan.with_micro_batch(micro, reason)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        """The model's buffers as the window finds them (BatchNorm's statistics), for a skipped step."""
        from ..buffers import buffer_snapshot

        self._window_buffers = None if model is None else buffer_snapshot(model.modules())

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        """Skip the step (fp32/bf16: drop the gradients) if a gradient is not finite, and put the
        buffers back as the window found them (its forwards folded the non-finite values into
        BatchNorm's statistics); stop after too many in a row."""
        from ..buffers import restore_buffers

        # The norm before the Trainer's clipping (under train()): finite, every gradient is (one sync).
        # Finite gradients whose norm overflows (~1e19 and up in fp32) are a non-finite step too, as in
        # tightfit's own runtime: the Trainer's clipping has made them zeros by now, which the optimizer
        # would apply (AdamW's moments and weight decay move the weights, its step counted).
        norm, self._grad_norm = self._grad_norm, None
        if norm is not None and bool(torch.isfinite(torch.as_tensor(norm)).all()):
            finite, overflow = True, False
        else:
            verdicts: dict = {}  # per device, whether each gradient is finite (what unscale_ checks, per tensor)
            for p in model.parameters():
                if p.grad is not None:
                    verdicts.setdefault(p.grad.device, []).append(torch.isfinite(p.grad).all())
            finite = all(bool(torch.stack(v).all()) for v in verdicts.values())  # one host sync per device
            overflow = finite and norm is not None
        kept, self._window_buffers = getattr(self, "_window_buffers", None), None
        if finite and not overflow:
            self._skipped_in_row = 0
            return
        restore_buffers(kept)
        self.skipped_steps += 1
        self._skipped_in_row += 1
        # fp16: the loss scaler skips it and backs its scale off, as for an inf gradient, also where its
        # unscale_ found every gradient finite (a norm that overflows); without a scaler, drop the gradients
        if not skip_through_loss_scaler(getattr(optimizer, "scaler", None), getattr(optimizer, "optimizer", optimizer)):
            for p in model.parameters():
                p.grad = None  # torch.optim leaves parameters without a gradient, and their state, untouched
        self._event(f"step {state.global_step + 1}: non-finite gradients, update skipped")
        if self._skipped_in_row >= self.max_skipped_steps:
            from ..levers.precision import nonfinite_advice
            from ..loop import as_arguments

            precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
            self.stop_reason = (f"{self._skipped_in_row} steps in a row had non-finite gradients. "
                                f"{as_arguments(nonfinite_advice(precision, None, args.learning_rate))}")
            log.error("tightfit: %s", self.stop_reason)
            control.should_training_stop = True

    def _keep_counts(self, state) -> None:
        """The guards' counts into ``state``, the ``TrainerState`` the Trainer writes into each
        checkpoint's ``trainer_state.json`` (after ``on_step_end``) and loads back on a resume, where
        :meth:`on_train_begin` reads them, as :meth:`tightfit.TrainStep.state_dict` keeps them. Under
        their own key in ``stateful_callbacks``, not as an ``ExportableState``: the Trainer's own restore
        of those (``restore_callback_states_from_checkpoint``) makes a new callback from its arguments,
        without the plan, in place of this one (with that option on, the Trainer logs that it ignores this
        entry, which is this callback's to read)."""
        if isinstance(state.stateful_callbacks, dict):
            state.stateful_callbacks[_STATE_KEY] = {"skipped_steps": self.skipped_steps,
                                                    "skipped_in_row": self._skipped_in_row}

    def on_step_end(self, args, state, control, **kwargs):
        """Record this optimizer step's memory peaks (then reset them) and sample the GPU's health;
        keep the guards' counts where the step's checkpoint will write them."""
        self._keep_counts(state)
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return
        self.memory_timeline.append((state.global_step, torch.cuda.max_memory_allocated(),
                                     torch.cuda.max_memory_reserved()))
        torch.cuda.reset_peak_memory_stats()
        reading = self.health.sample() if self.health is not None else None
        if reading and "warning" in reading:
            self._event(reading["warning"])

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Add the memory peaks since the last log and the latest health reading to the Trainer's logs."""
        if logs is None:
            return
        recent = self.memory_timeline[self._logged_upto:]
        self._logged_upto = len(self.memory_timeline)
        if recent:
            logs["peak_allocated_bytes"] = max(x[1] for x in recent)
            logs["peak_reserved_bytes"] = max(x[2] for x in recent)
        reading = self.health.sample() if self.health is not None else None
        if reading and "temp_c" in reading:
            logs["gpu_temp_c"], logs["gpu_power_w"] = reading["temp_c"], reading["power_w"]
        # The Trainer appends a copy of ``logs`` to ``log_history`` before calling ``on_log``:
        # what is added here must go into that copy too, or only the printed line shows it.
        if state.log_history:
            state.log_history[-1].update({k: v for k, v in logs.items() if k in _ADDED_KEYS})



_ADDED_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "gpu_temp_c", "gpu_power_w")
_STATE_KEY = "tightfit.TightfitCallback"  # its counts in TrainerState.stateful_callbacks (TightfitCallback._keep_counts)


class _SavedCheckpoints(transformers.TrainerCallback):
    """The checkpoint folders the Trainer saves while :func:`train` runs, as ``(global step, path)``:
    the only ones (with the checkpoint it resumed from) an OOM redo may go back to; and, by path,
    ``trainer``'s stateful callbacks as each was written (:func:`_callback_states`)."""

    def __init__(self, trainer):
        self.saved: list[tuple[int, str]] = []
        self.callback_states: dict[str, list] = {}
        self._trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        """The per-device batch in force goes into the state the checkpoints write: a Trainer resumed
        from a checkpoint (an OOM redo's) keeps the ``train_batch_size`` that checkpoint holds, the
        failed batch, where a later resume must find the redo's (:func:`_resume_micro_batch`)."""
        if not args.auto_find_batch_size:  # that one's batch is the Trainer's own to record
            state.train_batch_size = args.train_batch_size

    def on_save(self, args, state, control, **kwargs):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self.saved.append((state.global_step, path))
        self.callback_states[path] = _callback_states(self._trainer)


def _callback_states(trainer, in_row: bool = True) -> list:
    """The attributes of ``trainer``'s stateful callbacks (``ExportableState``: early stopping's count of
    evaluations without improvement) and the TightfitCallbacks' counts of skipped steps, as
    ``(callback, attributes)``, for :func:`_restore_callback_states`. ``in_row``: with the count of
    skipped steps in a row (False: 0, as a new ``train`` starts with)."""
    exportable = getattr(transformers.trainer_callback, "ExportableState", None)
    callbacks = trainer.callback_handler.callbacks
    states = [] if exportable is None else \
        [(c, copy.deepcopy(c.state().get("attributes", {}))) for c in callbacks if isinstance(c, exportable)]
    return states + [(c, {"skipped_steps": c.skipped_steps, "_redo_in_row": c._skipped_in_row if in_row else 0})
                     for c in callbacks if isinstance(c, TightfitCallback)]


def _restore_callback_states(states: list) -> None:
    """Put :func:`_callback_states`' attributes back on the same callback objects (the Trainer's own
    restoring, ``restore_callback_states_from_checkpoint``, makes new ones, and is yours to ask for):
    an OOM redo must not count what the failed attempt's evaluations counted."""
    for callback, attributes in states:
        for name, value in attributes.items():
            setattr(callback, name, copy.deepcopy(value))


class _FirstOptimizerStep(transformers.TrainerCallback):
    """What the optimizer held as the first optimizer step of a :func:`train` attempt began
    (``started``: the optimizer, :func:`tightfit.step.in_place_versions` of its weights and state,
    the parameters with state), so that an OOM inside that step can tell whether it wrote anything."""

    def __init__(self):
        self.started = None

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        from ..step import in_place_versions

        if state.global_step == 0 and optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
            self.started = (inner, in_place_versions(inner), set(inner.state))


def _checkpoint_as_planned(trainer, plans: list) -> None:
    """Where the Trainer's own checkpointing (the model's Hugging Face hook) cannot run the plan's,
    tightfit's block wrappers run it and the Trainer's flag is turned off: a model without the hook
    (a ResNet: the Trainer raised ValueError), or one with BatchNorm, whose running statistics the
    hook's recomputation updates a second time (MobileViT). ``plans``: the TightfitCallbacks' (the
    first one's blocks; without one, every block, as the Trainer's flag means)."""
    from ..buffers import running_stat_norms
    from ..levers.blocks import find_blocks
    from ..levers.checkpointing import set_activation_checkpointing

    args, model = trainer.args, trainer.model
    name = _checkpointing_argument(args)
    plan = plans[0] if plans else None
    if not find_blocks(model):
        return
    # the Trainer's hook runs the plan: a model with the hook and no BatchNorm, and a plan it can run
    # (it recomputes every layer whole, nothing else: no selective recomputation, no offload)
    hooked = getattr(model, "supports_gradient_checkpointing", False) and not running_stat_norms(model)
    if not _per_block(plan) and (not getattr(args, name, False) or hooked):
        return
    setattr(args, name, False)
    set_activation_checkpointing(model, True, plan and plan.checkpoint_blocks, plan and plan.block_policies)


def _checkpointing_argument(args) -> str:
    """The name of ``args``' activation checkpointing flag (transformers 5 renamed ``gradient_checkpointing``)."""
    return "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"


def _per_block(plan) -> bool:
    """Whether ``plan`` keeps some block's activations otherwise than the Trainer can: selective
    recomputation or activation offload (``block_policies``)."""
    return plan is not None and any(p not in ("none", "full") for p in plan.block_policies or ())


def _redo_checkpoint(saved: list[tuple[int, str]], failed_step: int, started_from) -> str | None:
    """The newest checkpoint of ``saved`` (written by this :func:`train` call) at a step <= ``failed_step``
    that is still there (``save_total_limit`` deletes old ones), else ``started_from`` (the checkpoint
    the call resumed from) if it is still there, else None."""
    for step, path in sorted(saved, reverse=True):
        if step <= failed_step and os.path.isdir(path):
            return path
    return str(started_from) if started_from and os.path.isdir(started_from) else None


def _watch_evaluation(trainer):
    """Record an exception that leaves ``trainer.evaluate`` or ``trainer.predict`` (the Trainer's
    evaluation during ``train()`` goes through ``evaluate``), by wrapping them on this instance: an
    OOM there is evaluation's, not the training step's.

    Returns:
        ``(failed, undo)``: the list the exceptions are appended to, and a function that removes
        the wrappers (leaving any instance attribute of the user's as it was).
    """
    failed: list[BaseException] = []
    missing = object()
    saved = {}
    for name in ("evaluate", "predict"):
        saved[name] = vars(trainer).get(name, missing)
        method = getattr(trainer, name)

        def watched(*a, _method=method, **k):
            try:
                return _method(*a, **k)
            except Exception as e:
                failed.append(e)
                raise

        setattr(trainer, name, watched)

    def undo():
        for name, own in saved.items():
            if own is missing:
                vars(trainer).pop(name, None)
            else:
                setattr(trainer, name, own)

    return failed, undo


def _watch_grad_norm(trainer, callbacks):
    """Hand ``callbacks`` (the TightfitCallbacks) the gradient norm the Trainer's clipping measures,
    before it clips (``accelerator.clip_grad_norm_``, wrapped on this instance): finite gradients
    whose norm overflows are clipped to zeros, which their non-finite check would take for finite.

    Returns:
        A function that removes the wrapper.
    """
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is None or not callbacks:
        return lambda: None
    own, clip = vars(accelerator).get("clip_grad_norm_"), accelerator.clip_grad_norm_

    def clip_grad_norm_(*a, **k):
        norm = clip(*a, **k)
        for c in callbacks:
            c._grad_norm = norm
        return norm

    def undo():  # any instance attribute of the user's back as it was
        if own is None:
            vars(accelerator).pop("clip_grad_norm_", None)
        else:
            accelerator.clip_grad_norm_ = own

    accelerator.clip_grad_norm_ = clip_grad_norm_
    return undo


def _resume_micro_batch(trainer, checkpoint, callbacks) -> None:
    """Resuming from ``checkpoint``: train on at the per-device batch in force when it was written
    (its ``trainer_state.json``'s ``train_batch_size``: smaller than the arguments' after an OOM redo of
    :func:`train`), as tightfit's own runtime resumes at its checkpoint's micro-batch -- the same
    effective batch, and the split the uninterrupted run went on with (its dropout masks), without
    running out of memory again first. Only a smaller batch that divides the effective batch is taken
    (a larger one: the arguments were planned again for less memory); ``callbacks``' plan becomes it.
    Only for a run a :class:`TightfitCallback` with a plan watches: another's batch is the user's."""
    if not any(c.plan is not None for c in callbacks):
        return
    if not checkpoint or not os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):
        return
    args = trainer.args
    saved = transformers.TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json")).train_batch_size
    mb, acc = args.per_device_train_batch_size, args.gradient_accumulation_steps
    micro = saved // max(1, args.n_gpu) if saved else None
    if not micro or micro >= mb or (mb * acc) % micro or args.dataloader_drop_last:
        return
    args.per_device_train_batch_size, args.gradient_accumulation_steps = micro, mb * acc // micro
    trainer._train_batch_size = args.train_batch_size  # what the Trainer's loader reads (see train())
    for c in callbacks:
        c._redo(micro, args.gradient_accumulation_steps, f"the per-device batch in force at {checkpoint}")
    log.warning(f"tightfit: resuming from {checkpoint}, written at per-device batch {micro}: training on at "
                f"{micro} x {args.gradient_accumulation_steps} (same effective batch), not {mb} x {acc}")


def train(trainer, **train_kwargs):
    """``trainer.train(**train_kwargs)`` with tightfit's OOM policy (see the module doc): after an
    out-of-memory error, train again at a smaller micro-batch with the same effective batch
    (:func:`smaller_micro_batch`), from the start if no optimizer step had been taken, else from the
    newest checkpoint this call wrote at a step <= the failed step (or, with none, the checkpoint
    ``resume_from_checkpoint`` named; a checkpoint folder in ``output_dir`` from an earlier run is
    never used). Before it, unless the model's loss divides by the Trainer's ``num_items_in_batch``
    itself, each micro-batch's loss is weighed by its share of its window's labelled items
    (:func:`scale_loss_as_one_batch`), so every window -- also an epoch's short last one -- trains as
    one batch of its samples however it is split, in the redo too. Its :class:`TightfitCallback` s check the arguments against the
    redo's micro-batch and accumulation (their ``plan`` becomes the redo's). Resumed from a checkpoint
    written at a smaller per-device batch (after a redo), it trains on at that batch, with the same
    effective batch (:func:`_resume_micro_batch`).

    Returns:
        What ``trainer.train`` returns (a ``TrainOutput``). After a redo from a checkpoint it is
        what the Trainer returns for a resumed run: ``training_loss`` is the mean over the steps
        trained after that checkpoint only (the steps before it are in the checkpoint's
        ``trainer_state.json`` log history); a warning says so.

    Only an OOM of training is redone: one raised by evaluation inside ``trainer.train()`` (the
    Trainer's ``evaluate``) is refused as evaluation's -- a smaller training micro-batch would not
    help it. When no attempt finishes, ``trainer.args``' batch and accumulation and the callbacks'
    ``plan`` are left as they were before the call, not at the last redo's.

    An OOM inside the first optimizer step is redone only if that step wrote nothing (weights,
    moments, step counters: :func:`tightfit.step.in_place_versions`); the state it allocated is
    dropped, and an optimizer the Trainer made is made afresh. With ``dataloader_drop_last`` no
    OOM is redone: a smaller per-device batch would drop other samples. Nor under several processes
    (``args.world_size > 1``): one rank's redo would run other collectives than its peers (DESIGN
    invariant 12).

    Raises:
        TightfitError: ``trainer`` is not a ``transformers.Trainer``; out of memory at a per-device
            batch of 1, with ``dataloader_drop_last``, under several processes (one process
            cannot redo alone: the others would wait in their collectives), inside a first optimizer step that had written
            part of its update, or after an optimizer step with no checkpoint of this call to go back
            to; out of memory in evaluation (naming ``per_device_eval_batch_size``; the OOM is its
            ``__cause__``).
        NonFiniteTrainingError: a :class:`TightfitCallback` stopped training on non-finite steps.
        Anything else ``trainer.train`` raises, unchanged.
    """
    from transformers.trainer_utils import get_last_checkpoint

    from ..buffers import buffer_snapshot, restore_buffers
    from ..memory.oom import is_oom, release_memory
    from ..step import changed_since
    from ..rng import capture_rng, restore_rng
    from ..runtime.trainer import NonFiniteTrainingError

    if not isinstance(trainer, transformers.Trainer):
        raise TightfitError(f"hf.train(trainer): trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    args = trainer.args
    ours = [c for c in trainer.callback_handler.callbacks if isinstance(c, TightfitCallback)]
    for c in ours:  # a LoRA or freezing plan for a model not set up so: its state would not fit as planned
        if c.plan is not None:
            check_trainable(c.plan.trainable, trainer.model, "hf.train(trainer)")
    # the user's, put back if no attempt finishes (a redo's smaller batch is no use to a failed run)
    users = (args.per_device_train_batch_size, args.gradient_accumulation_steps, vars(trainer).get("_train_batch_size"),
             [(c, c.plan, c._redone_at) for c in ours])
    scale_loss_as_one_batch(trainer)  # before the first attempt: the redo keeps it
    _checkpoint_as_planned(trainer, [c.plan for c in ours if c.plan is not None])
    for c in ours:
        c._in_train = True
    started_from = train_kwargs.get("resume_from_checkpoint")
    if started_from is True:  # as the Trainer resolves it, before this call writes any checkpoint
        started_from = get_last_checkpoint(args.output_dir) if args.output_dir and os.path.isdir(args.output_dir) else None
    _resume_micro_batch(trainer, started_from, ours)
    saves, first_step = _SavedCheckpoints(trainer), _FirstOptimizerStep()
    callbacks_at_start = _callback_states(trainer, in_row=False)  # what a redo from the start, or to started_from, starts with
    trainer.add_callback(saves)
    trainer.add_callback(first_step)
    made_here = trainer.optimizer is None  # the Trainer makes it in train() and keeps it for the next call
    rng, redone_from, finished = capture_rng(), None, False
    buffers = buffer_snapshot(trainer.model.modules())  # BatchNorm's statistics: a redo from the start starts from these
    evaluation_failed, unwrap = _watch_evaluation(trainer)
    unwatch_norm = _watch_grad_norm(trainer, ours)
    try:
        while True:
            evaluation_failed.clear()
            try:
                output = trainer.train(**train_kwargs)
                finished = True
                break
            except Exception as e:  # only OOMs are handled; anything else propagates unchanged
                if not is_oom(e):
                    raise
                if evaluation_failed:  # a smaller training micro-batch would not help it
                    raise TightfitError(
                        f"out of memory in evaluation (inside trainer.train(), after step "
                        f"{trainer.state.global_step}) with per_device_eval_batch_size="
                        f"{args.per_device_eval_batch_size}: lower per_device_eval_batch_size (the plan sizes the "
                        f"training micro-batch only; an OOM in evaluation is not redone)") from e
                where = type(e).__name__
            step = trainer.state.global_step
            mb, acc = args.per_device_train_batch_size, args.gradient_accumulation_steps
            if mb == 1:
                raise TightfitError("out of memory in the Trainer with a per-device batch of 1; "
                                    "plan with activation checkpointing or fp16/bf16, or raise the budget")
            if args.world_size > 1:  # the other ranks are not redoing: they would wait in their collectives
                raise TightfitError(f"out of memory in the Trainer at per-device batch {mb} x {acc} on one of "
                                    f"{args.world_size} processes: a redo by this process alone would leave the others "
                                    "waiting in their gradient all-reduces, so it is not redone; plan for a smaller "
                                    "budget (the plan's micro-batch for every process), or train with tightfit train, "
                                    "whose processes back off together")
            if args.dataloader_drop_last:  # the windows of a smaller batch would drop other samples
                raise TightfitError(f"out of memory in the Trainer at per-device batch {mb} x {acc} with "
                                    "dataloader_drop_last=True: a smaller per-device batch would drop other samples "
                                    "than the planned one (its last windows differ), so it is not redone; set "
                                    "dataloader_drop_last=False, or plan for a smaller budget")
            if step == 0 and first_step.started is not None:  # inside the first optimizer step
                optimizer, before, had_state = first_step.started
                if changed_since(optimizer, before):
                    raise TightfitError("out of memory inside the Trainer's first optimizer step after it had updated "
                                        "part of the weights or the optimizer's state: training again would apply that "
                                        "part twice, so it stops; start again from your initial weights with a "
                                        "smaller per-device batch, or plan for a smaller budget")
                for p in [p for p in optimizer.state if p not in had_state]:
                    del optimizer.state[p]  # allocated by the failed step, never written
            first_step.started = None
            if step == 0 and made_here:  # the redo makes its optimizer and schedule afresh, as a new run would
                trainer.optimizer = trainer.lr_scheduler = None
            if step > 0:  # the weights have moved: go back to a checkpoint, never redo on top of them
                last = _redo_checkpoint(saves.saved, step, started_from)
                if last is None:
                    raise TightfitError(f"out of memory in the Trainer at step {step + 1} at per-device batch {mb}, "
                                        f"with no checkpoint in {args.output_dir} written by this run to train again "
                                        f"from (its weights have moved since step 0); set save_steps, or plan for a "
                                        f"smaller budget")
                train_kwargs["resume_from_checkpoint"] = redone_from = last
            # the stateful callbacks (early stopping's patience) as that checkpoint, or this call, found them
            _restore_callback_states(saves.callback_states.get(last, callbacks_at_start) if step else callbacks_at_start)
            trainer.model.zero_grad(set_to_none=True)
            release_memory()  # outside the except block: the failed attempt's frames are gone
            if step == 0:
                restore_rng(rng)  # the redo draws the data order and dropout as a run at the smaller batch would
                restore_buffers(buffers)  # and BatchNorm's statistics without the failed attempt's updates
            args.per_device_train_batch_size, args.gradient_accumulation_steps = smaller_micro_batch(mb, acc)
            # the Trainer reads its loader's batch from this attribute, set from the arguments at construction
            # (the one it updates itself for auto_find_batch_size)
            trainer._train_batch_size = args.train_batch_size
            for c in ours:  # their check compares the arguments with the plan in force: the redo's
                c._redo(args.per_device_train_batch_size, args.gradient_accumulation_steps,
                        f"out of memory in the Trainer at per-device batch {mb} x {acc}")
            log.warning(f"tightfit: out of memory ({where}) at per-device batch {mb} x {acc}: training again with "
                        f"{args.per_device_train_batch_size} x {args.gradient_accumulation_steps} (same effective "
                        f"batch) " + (f"from {train_kwargs['resume_from_checkpoint']}" if step else "from the start"))
    finally:
        unwrap()
        unwatch_norm()
        trainer.remove_callback(saves)
        trainer.remove_callback(first_step)
        for c in ours:
            c._in_train = False
        if not finished:
            args.per_device_train_batch_size, args.gradient_accumulation_steps = users[0], users[1]
            if users[2] is not None:
                trainer._train_batch_size = users[2]
            for c, plan, redone_at in users[3]:
                c.plan, c._redone_at = plan, redone_at
    stopped = [c.stop_reason for c in ours if c.stop_reason]
    if stopped:
        raise NonFiniteTrainingError(stopped[0], trainer.state.global_step)
    if redone_from is not None:  # the Trainer's own resume semantics: its loss counts from the checkpoint
        log.warning(f"tightfit: the run was trained again from {redone_from} after an out-of-memory error: its "
                    f"training_loss ({output.training_loss:.4f}) is the mean over the steps after that checkpoint "
                    f"only, as for any resumed Trainer run")
    return output
