"""tightfit in your own training loop: a plan for your model and batch, and one call per optimizer step.

Four added lines (Accelerate needs ``prepare``, an ``accumulate()`` block, ``backward`` and
``find_executable_batch_size`` around the loop; Lightning Fabric ``setup``, ``autocast``,
``backward`` and ``clip_gradients``)::

    import tightfit
    sample_batch = collate([dataset[i] for i in range(64)])  # not next(iter(loader)): that draws the shuffle
    plan = tightfit.plan(model, sample_batch, effective_batch=64, budget="4GiB")
    step = tightfit.TrainStep(plan, model, optimizer)
    for batch in loader:        # each batch is a whole effective batch (64 samples)
        out = step(batch)       # in place of: loss = ...; loss.backward(); optimizer.step(); optimizer.zero_grad()

:func:`plan` chooses precision, micro-batch x gradient accumulation steps and activation
checkpointing with the planner's real probe steps (:func:`tightfit.planner.probe.plan_first`);
:class:`TrainStep` runs :func:`tightfit.step.training_step` -- the step the ``tightfit train``
runtime, the GPU probe and the memory estimator run -- on the micro-batches of each batch, with
the runtime's guards: OOM recovery keeping the effective batch, non-finite steps skipped,
memory timeline and GPU health. Nothing else changes: no gradient clipping unless asked for
(``max_grad_norm=``). Errors name this API's arguments (``precision=``), not the command line's flags.
"""

from __future__ import annotations

import logging
import numbers
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from .errors import TightfitError, refuses_one_sample
from .levers.checkpointing import check_checkpointing
from .masks import hf_model, with_prepared_mask
from .plan import Plan, accumulation_steps, refuse_parameter_offload

__all__ = ["StepOutcome", "TrainStep", "plan"]

log = logging.getLogger("tightfit")  # warnings show without any logging set up (logging.lastResort)

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


# ---------------------------------------------------------------- batches
class _Batch:
    """A user's batch as a dict of tensors split along dim 0, and back to its own form.

    Args:
        batch: a dict (or Mapping) of tensors ``[B, ...]``, or a tuple/list of tensors ``[B, ...]``.

    Raises:
        TightfitError: another type, no tensors, tensors whose first dimensions differ, or 0 samples.
    """

    def __init__(self, batch):
        if isinstance(batch, Mapping):
            self.keys, values = list(batch.keys()), list(batch.values())
        elif isinstance(batch, (tuple, list)):
            self.keys, values = None, list(batch)
        else:
            raise TightfitError(f"a batch must be a dict or a tuple of tensors, got {type(batch).__name__}")
        if not values or not all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values):
            raise TightfitError("every value of a batch must be a tensor with the samples along dimension 0")
        sizes = {v.shape[0] for v in values}
        if len(sizes) != 1:
            raise TightfitError(f"the tensors of a batch disagree on the number of samples (dimension 0): {sorted(sizes)}")
        if 0 in sizes:
            raise TightfitError("the batch is empty (0 samples along dimension 0)")
        self.kind = type(batch)
        self.values = values
        self.size = sizes.pop()

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The tensors keyed by name (tuple batches: ``"0"``, ``"1"``, ...), as the planner's probe takes them."""
        keys = self.keys if self.keys is not None else [str(i) for i in range(len(self.values))]
        return dict(zip(keys, self.values))

    def restore(self, d: dict[str, torch.Tensor]):
        """``d`` (a slice of :meth:`as_dict`) in the user's form: a dict, or a tuple/list in order,
        of the batch's own type where it can be rebuilt from those (a tokenizer's ``BatchEncoding``,
        a named tuple), so that a loss reading ``batch.input_ids`` or ``batch.x`` works."""
        if self.keys is not None:
            if self.kind is dict:
                return d
            try:
                return self.kind(d)  # BatchEncoding(dict), OrderedDict, ...
            except Exception:  # a Mapping type that cannot be built from a dict: the plain dict
                return d
        values = [d[str(i)] for i in range(len(self.values))]
        if self.kind is list:
            return values
        if self.kind is not tuple and hasattr(self.kind, "_fields"):  # a named tuple
            return self.kind(*values)
        return tuple(values)


def _target_tokens(model: torch.nn.Module, batch: _Batch, loss: LossFn | None):
    """For the model's own loss over integer token labels (``labels`` ``[B, T, ...]``: causal and
    masked LMs, token classification, seq2seq), which Hugging Face models take as the mean over
    the targets that are not -100: ``d -> count of those targets`` in a dict micro-batch (a 0-d
    tensor on the labels' device; a causal LM's are ``labels[:, 1:]``, it predicts the next token,
    also wrapped by DDP, ``torch.compile`` or peft: :func:`tightfit.masks.hf_model`, or held by the
    user's own module, whose loss is taken to be that model's). A peft
    prompt-learning model is not unwrapped: prompt tuning prepends a -100 label per virtual
    token, so every given label is a target (its shift is 0; prefix tuning's would be 1).
    Class ids ``[B]`` count the same way (``labels != -100``): a classifier's cross-entropy skips
    samples labelled -100 and averages over the others, so a micro-batch weighted by all its
    samples would count its labelled ones several times over (and one with none would add NaN).
    None where the loss is the user's, the labels are floats (multi-label targets ``[B, C]``,
    regression values: a mean over samples times a constant), or the model is a regression head
    (``num_labels`` 1 or ``problem_type`` "regression", which takes integer labels as values)."""
    if loss is not None or batch.keys is None or "labels" not in batch.keys:
        return None
    labels = batch.values[batch.keys.index("labels")]
    if labels.is_floating_point():
        return None
    if labels.dim() < 2:  # class ids
        return None if _regression_head(model) else lambda d: (d["labels"] != -100).sum()
    shift = label_shift(model)
    return lambda d: (d["labels"][:, shift:] != -100).sum()


def label_shift(model: torch.nn.Module) -> int:
    """1 where ``model``'s own loss predicts the next token, so that its targets are
    ``labels[:, 1:]`` (a transformers causal LM by its class, also wrapped by DDP, ``torch.compile``
    or peft, or held by the user's own module); 0 otherwise (a peft prompt-learning model: see
    :func:`_target_tokens`). Also what the Hugging Face integration counts a window's targets by."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    inner = hf_model(model)  # the wrapped model's class: a peft or compiled GPT-2 is named PeftModelForCausalLM
    if inner is not None:
        return int(type(inner).__name__ in causal)
    # the user's own module holding a causal LM, whose loss it returns (not peft's prompt learning)
    return int(not type(model).__module__.startswith("peft.") and any(type(m).__name__ in causal for m in model.modules()))


def _nothing_to_train(who: str, model: torch.nn.Module) -> str:
    """The one line for a model with no parameter to train, none at all or every one frozen, and
    no optimizer given (one over tensors outside the model may train them, e.g. a prompt)."""
    if next(model.parameters(), None) is None:
        return (f"{who}: the model has no parameters ({type(model).__name__}): give optimizer= over the tensors "
                "to train, or a model with parameters")
    return (f"{who}: the model has no trainable parameters (every one has requires_grad=False); "
            "unfreeze the ones to train, or give optimizer= over the tensors to train")


def _check_class_ids(model: torch.nn.Module, batch: _Batch, loss: LossFn | None) -> None:
    """Refuse, on the host and before any forward, class ids ``labels`` ``[B]`` that a Hugging Face
    classifier's own loss cannot take: outside ``[0, num_labels)`` and not -100
    (:func:`tightfit.tasks.check_class_ids`), which cross-entropy fails on at the step, on a GPU as a
    device-side assert that ends the CUDA context. Nothing is checked for a loss of the user's own,
    float labels, a regression head (``num_labels`` 1 or ``problem_type`` "regression", whose
    integer labels are values) or a model whose classes are unknown (:func:`tightfit.tasks.num_classes`).

    Class ids ``[B]`` of another dtype than int64 for a classifier of several classes are refused
    too: Hugging Face reads float, uint8 or bool labels as multi-label targets and keeps that reading
    in ``config.problem_type``; int32 ones fail in cross-entropy.

    Raises:
        TightfitError: one line with the range, the first sample labelled outside it and the fix;
            or with the labels' dtype and the fix.
    """
    from .tasks import check_class_ids, num_classes

    if loss is not None or batch.keys is None or "labels" not in batch.keys:
        return
    labels = batch.values[batch.keys.index("labels")]
    if labels.dim() != 1:
        return
    n = num_classes(model)
    if n is None or _regression_head(model):
        return
    name = type(hf_model(model)).__name__
    if labels.dtype != torch.int64 and n > 1:
        # Hugging Face reads labels of any dtype but int64 and int32 as multi-label targets
        # [B, num_labels] and records that in config.problem_type at the first forward, which then
        # fails every later call too; int32 reaches cross-entropy, which takes int64 only
        raise TightfitError(f"{name}: labels must be class ids, int64 [B] (the model has num_labels={n}); the "
                            f"batch's are {str(labels.dtype).removeprefix('torch.')} [B]: give labels.long()")
    check_class_ids(labels, n, range(batch.size), name)


def _regression_head(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the Hugging Face model it wraps, :func:`tightfit.masks.hf_model`) is a
    regression head, whose integer ``labels [B]`` are values, not class ids: ``num_labels`` 1 or
    ``problem_type`` "regression" in its config."""
    inner = hf_model(model)
    config = getattr(inner if inner is not None else model, "config", None)
    return getattr(config, "problem_type", None) == "regression" or getattr(config, "num_labels", None) == 1


def _loss_sum(batch: _Batch, loss: LossFn | None, tokens=None) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """``(model, dict micro-batch) -> loss summed over what it averages``: the mean loss times the
    samples in the micro-batch, or, for a model's own mean over target tokens
    (``tokens``, from :func:`_target_tokens`), times the micro-batch's target tokens (0 for one
    without targets, whose mean is NaN), so that
    :func:`tightfit.step.accumulate`, which divides by the samples (tokens) of the whole batch
    (:func:`_normaliser`), weights each micro-batch by its share: the gradient of the whole
    batch's mean loss (DESIGN invariant 1)."""
    def loss_sum(model, d):
        b = batch.restore(d)
        n = next(iter(d.values())).shape[0]
        if loss is not None:
            value = loss(model, b)
        elif batch.keys is not None:  # any Mapping: a tokenizer's BatchEncoding is a UserDict, not a dict
            out = model(**with_prepared_mask(model, b))
            value = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
            if value is None:
                # a batch's "label" (a dataset column's usual name) is no keyword a Hugging Face model takes
                # for its loss: its "labels" is; the Trainer's collator renames it, a batch of yours does not
                key = next((k for k in ("label", "label_ids") if k in b and "labels" not in b), None)
                hint = (f": it has {key!r} and no 'labels' (Hugging Face models compute their loss from "
                        f"'labels'): rename {key!r} to 'labels', or" if key else ":")
                raise TightfitError(f"the model's output has no .loss (or \"loss\" key) for this batch{hint} "
                                    "give loss=lambda model, batch: ...")
        else:
            raise TightfitError("a tuple batch needs loss=lambda model, batch: ... (the model cannot compute it)")
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TightfitError(f"the loss must be a tensor holding one number (the mean over the batch), "
                                f"got {type(value).__name__}{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        if tokens is None:
            return value.reshape(()) * n
        count = tokens(d)
        # no targets: HF's mean is 0/0 = NaN, and NaN * 0 is NaN; such a micro-batch adds 0 (and no
        # gradient). torch.where, not `if count == 0`: that would read the count on the host
        return torch.where(count > 0, value.reshape(()) * count, value.new_zeros(()))

    return loss_sum


def _normaliser(batch: _Batch, targets: int | None) -> int:
    """What :func:`_loss_sum` sums over in the whole batch: its samples (``targets`` None), or its
    ``targets``, the target tokens :func:`_target_tokens` counts (at least 1: a batch without
    targets has a loss of 0/0 either way)."""
    return batch.size if targets is None else max(1, targets)


def _traced_task(batch: _Batch, loss: LossFn | None):
    """The task the memory estimator traces for this workload (its host estimate on the CPU,
    :func:`tightfit.planner.host.host_micro_batch`): None for a loss of the user's own (the
    workload's task is then a :class:`~tightfit.tasks.LossOnly`, which is not estimated); for the
    model's own loss, its logits' cross-entropy as the estimator traces it: next-token for
    ``labels [B, T]``, else classification."""
    from .tasks import CausalLM, SequenceClassification

    if loss is not None:
        return None
    labels = batch.as_dict().get("labels")
    return CausalLM() if isinstance(labels, torch.Tensor) and labels.dim() == 2 else SequenceClassification()


class _SampleBatches:
    """The sample batch as the planner's training data: ``collate(indices)`` and ``worst_case(n)``
    (``n`` rows, the sample's rows repeated: the sample batch stands for the largest batch trained on)."""

    def __init__(self, batch: _Batch):
        self.d, self.size = batch.as_dict(), batch.size

    def __len__(self) -> int:
        return self.size

    def collate(self, indices, pad_to=None) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return {k: v.index_select(0, idx.to(v.device)) for k, v in self.d.items()}

    def worst_case(self, n: int) -> dict[str, torch.Tensor]:
        return self.collate([i % self.size for i in range(n)])


# ---------------------------------------------------------------- planning
_FLAG_VALUE = re.compile(r"--(precision|checkpointing|device|optimizer|trainable|sharding|compile) (?:'([^']*)'|(\w[\w-]*))")


def as_arguments(message: str) -> str:
    """A message of the shared checks (written for the command line), with its flags as the Python
    API's arguments: ``unknown --precision 'fp8'`` -> ``unknown precision='fp8'``, ``--optimizer
    adamw8bit`` -> ``optimizer='adamw8bit'``, ``--lr`` -> learning rate."""
    message = _FLAG_VALUE.sub(lambda m: f"{m.group(1)}={(m.group(2) if m.group(2) is not None else m.group(3))!r}",
                              message)
    for flag, arg in (("--gpu/--budget", "gpu=/budget="), ("--budget", "budget="), ("--gpu", "gpu="),
                      ("--lr", "learning rate")):
        message = message.replace(flag, arg)
    return message


def _check_loss_and_budget(model: torch.nn.Module, b: _Batch, loss: LossFn | None, budget_bytes: int | None,
                           gpu: str | None) -> None:
    """Without a GPU, what the probes would have found at plan time: one forward and loss on a
    2-sample slice of the sample batch as a training step runs them (train mode with each module's
    own training mode, gradients on, no backward; the RNG states and the modules' buffers given back,
    so the model and the run are unchanged), and a budget that holds at least the weights,
    gradients and AdamW state (:func:`tightfit.models.model_state_bytes`, 16 bytes per trainable
    fp32 parameter) and no more than the ``gpu`` card's memory.

    Raises:
        TightfitError: the loss is not one number (or the model has none, or its forward does not
            take the batch's keys and no ``loss`` was given); the budget cannot hold the model state;
            a budget above the card's memory.
        Exception: the model's or the loss's own error on the slice, with a note saying what was run.
    """
    from .devices import get_profile
    from .models import model_state_bytes
    from .units import format_bytes_pair

    if budget_bytes is not None and gpu is not None and budget_bytes > get_profile(gpu).total_bytes:
        shown = format_bytes_pair(budget_bytes, get_profile(gpu).total_bytes)
        raise TightfitError(f"budget={shown[0]} is more than the {shown[1]} of gpu={gpu!r}")
    # two samples (one repeated, as the probes repeat rows): BatchNorm cannot train on one
    d = {k: v[:2] if len(v) > 1 else torch.cat([v, v]) for k, v in b.as_dict().items()}
    try:  # as the step runs it: a model with other heads in eval mode, a loss that calls autograd
        _loss_as_a_step(model, b, loss, d)
    except TightfitError:
        raise
    except TypeError as e:  # model(**batch) of a forward that takes other arguments: a loss of the user's is needed
        if loss is not None or "unexpected keyword argument" not in str(e):
            raise _noted(e)
        raise TightfitError(f"{e}: without loss= the model is called as model(**batch) and its .loss is trained; "
                            "pass loss=fn(model, micro_batch) returning the mean loss") from None
    except Exception as e:
        raise _noted(e)
    if budget_bytes is not None:  # after the forward: it sizes lazy modules' parameters (LazyLinear)
        need = model_state_bytes(model)["total"]
        if budget_bytes < need:
            shown = format_bytes_pair(budget_bytes, need)
            raise TightfitError(f"budget={shown[0]} cannot hold the model's weights, gradients and "
                                f"AdamW state ({shown[1]}, before any activations): raise the budget")


def _loss_as_a_step(model: torch.nn.Module, b: _Batch, loss: LossFn | None, batch: dict, grad: bool = True) -> None:
    """The loss of ``batch`` (a slice of the sample batch ``b``) as a training step runs it, each
    module in the mode a step gives it, with the RNG states and the modules' buffers (BatchNorm's
    running statistics, any buffer the model writes) given back: the model and the run are as
    they were (the check draws no dropout mask the run would have drawn). No backward;
    ``grad``: gradients on (a loss that calls autograd needs them)."""
    from .buffers import KeptBuffers
    from .rng import capture_rng, restore_rng
    from .step import train_mode

    rng = capture_rng()
    try:
        with torch.set_grad_enabled(grad), train_mode(model), KeptBuffers(model.modules()):
            _loss_sum(b, loss)(model, batch)
    finally:
        restore_rng(rng)


def _noted(e: Exception) -> Exception:
    """``e``, raised by the user's model or loss in the plan's check, with a note (Python >= 3.11
    shows it under the traceback) saying what the check ran."""
    if hasattr(e, "add_note"):
        e.add_note("tightfit.plan checked the loss on 2 samples of sample_batch as a training step runs it (train "
                   "mode, gradients on); the step splits batches into micro-batches of any size, so the loss "
                   "must take any number of samples")
    return e


def _one_sample_norms(model: torch.nn.Module, plan: Plan, b: _Batch, loss: LossFn | None) -> None:
    """Refuse a plan whose micro-batches leave one sample alone where the model's norm layers
    cannot train on one (BatchNorm with one value per channel: every step would fail): one
    forward of one sample of the sample batch as a training step runs it (each module's own
    mode, no gradients; RNG and buffers given back) tells, as torch decides it (BatchNorm2d of an
    image has many values per channel and trains).

    Raises:
        TightfitError: such a plan.
    """
    from .buffers import running_stat_norms
    from .runtime.trainer import describe_split, micro_batch_sizes

    if 1 not in micro_batch_sizes(plan.effective_batch, plan.micro_batch) or not running_stat_norms(model):
        return
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        _loss_as_a_step(model, b, loss, {k: v[:1].to(device) for k, v in b.as_dict().items()}, grad=False)
    except ValueError as e:
        if not refuses_one_sample(e):
            return  # not this check's to say: the plan's own check ran the loss
        raise TightfitError(f"effective_batch={plan.effective_batch}, split as "
                            f"{describe_split(plan.effective_batch, plan.micro_batch)}, gives the model's BatchNorm "
                            "layers a micro-batch of 1 sample, which they cannot train on; plan another effective "
                            "batch, or put BatchNorm in eval mode") from None
    except Exception:  # noqa: BLE001 - any other error of one sample is the step's to meet
        return


def plan(model: torch.nn.Module, sample_batch, effective_batch: int | None = None, budget: str | int | None = None,
         *, loss: LossFn | None = None, gpu: str | None = None, precision: str = "auto",
         checkpointing: str = "auto", device: str = "auto") -> Plan:
    """The plan for training ``model`` on batches like ``sample_batch``: precision, micro-batch x
    gradient accumulation steps = ``effective_batch``, and activation checkpointing.

    On a CUDA GPU (``device="auto"`` or ``"cuda"``): the model is moved to the GPU, the caching
    allocator is capped at the budget (``torch.cuda.set_per_process_memory_fraction``, for the rest
    of the process, so that the plan and the run see the same limit), and real probe steps of
    forward, backward and a fused AdamW step find the largest micro-batch that fits with the
    planner's headroom (:func:`tightfit.planner.probe.plan_first`; the weights are left
    bit-identical, and the model's activation checkpointing as it was: :class:`TrainStep` applies
    the plan's). Without a GPU, or with ``device="cpu"``: fp32 (unless asked), the whole
    effective batch in one micro-batch unless its estimated step would hold more than half the host's
    available memory (:func:`tightfit.planner.host.host_micro_batch`), no budget; a ``budget`` or
    ``gpu`` is checked (it must hold the weights, gradients and AdamW state, and fit the card) and
    noted in the plan's reasons, and one forward and loss on two samples checks the loss (the RNG
    states given back). To predict a GPU's plan on a machine without one, use
    ``tightfit plan --model ... --gpu ...``. The model is moved to the plan's device.

    Args:
        model: the ``nn.Module`` to train (a Hugging Face model or any other).
        sample_batch: one batch as the loop will pass it: a dict of tensors (e.g. a tokenizer's
            output with ``labels``) or a tuple of tensors ``(x, y)``, samples along dim 0. Give the
            largest shapes training will see (e.g. padded to the longest sequence): the probes
            repeat its rows to make micro-batches of any size. Take it from the data set
            (``default_collate([dataset[i] for i in range(n)])``), not ``next(iter(loader))``, which
            draws from the shuffle's random numbers and so changes the run's order.
        effective_batch: samples per optimizer step (default: the sample batch's size).
        budget: GPU memory the training may use, e.g. ``"4GiB"`` or whole bytes (default: the card's).
        loss: ``(model, batch) -> 0-d tensor``, the mean loss over the batch's samples; default:
            ``model(**batch).loss`` or ``model(**batch)["loss"]`` (Hugging Face models given ``labels``).
        gpu: a known card's profile (e.g. ``"gtx-1650-ti"``) whose budget and precision rules apply.
        precision: ``"auto"`` (from the card), ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        checkpointing: activation checkpointing, ``"auto"``, ``"on"`` or ``"off"``.
        device: ``"auto"``, ``"cuda"`` or ``"cpu"``.

    Returns:
        A :class:`tightfit.Plan` (``plan.reasons`` says why each choice was made).

    Raises:
        TightfitError: a model that is not a ``torch.nn.Module``, a loss that is not a function,
            a malformed or empty batch or option, an ``effective_batch`` above
            :data:`tightfit.plan.MAX_BATCH` (2**31 - 1), a budget that cannot be read, is not
            positive, exceeds the card or cannot hold the model state, a loss that is not one number,
            class ids outside a Hugging Face classifier's ``num_labels`` (other than -100) under its own loss,
            fp16/bf16 without a GPU, ``checkpointing="on"`` for a model with nothing to checkpoint
            (no repeated blocks or Hugging Face hook), or nothing fits the budget (before any training). The message
            names this function's arguments.
    """
    from .api import resolve_device
    from .config import PlanOptions, WorkloadOptions, check_option
    from .planner.probe import plan_first
    from .units import parse_size
    from .workload import Workload

    if not isinstance(model, torch.nn.Module):
        raise TightfitError(f"model must be a torch.nn.Module (e.g. AutoModelForSequenceClassification.from_pretrained"
                            f"(...)), got {type(model).__name__}")
    if loss is not None and not callable(loss):
        raise TightfitError(f"loss must be a function (model, batch) -> scalar loss, got {type(loss).__name__}")
    b = _Batch(sample_batch)
    _check_class_ids(model, b, loss)
    E = b.size if effective_batch is None else effective_batch
    if isinstance(E, bool) or not isinstance(E, numbers.Integral) or E < 1:  # numpy's integers too
        raise TightfitError(f"effective_batch must be a whole number >= 1, got {effective_batch!r}")
    E = int(E)
    try:
        check_option(WorkloadOptions, "batch_size", E, called="effective_batch")  # at most MAX_BATCH
        if budget is not None:
            try:
                budget = f"{parse_size(budget)}B"  # bytes as text with its unit, as the command line would take it
            except TightfitError as e:
                raise TightfitError(f"budget={budget!r}: {e}") from None
        options = PlanOptions(budget=budget, gpu=gpu, precision=precision, checkpointing=checkpointing, device=device)
        check_checkpointing(model, checkpointing)
        dev, profile, budget_bytes, notes = resolve_device(options)
        notes = [as_arguments(n) for n in notes]
        workload = Workload(model, _SampleBatches(b), None, E, loss_sum=_loss_sum(b, loss),
                            count=lambda d: len(next(iter(d.values()))), task=_traced_task(b, loss))
        if dev == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total))
        model.to(dev)
        if dev == "cpu":
            _check_loss_and_budget(model, b, loss, budget_bytes, gpu)
            if budget_bytes is not None:
                from .units import format_bytes

                notes.append(f"budget {format_bytes(budget_bytes)}: checked against the model's weights, gradients "
                             "and AdamW state (on the CPU it applies to no allocation)")
        chosen = plan_first(workload, dev, profile, budget_bytes, precision, checkpointing)
        _one_sample_norms(model, chosen, b, loss)
    except TightfitError as e:
        raise TightfitError(as_arguments(str(e))) from None
    from .levers.trainable import trainable_fields

    chosen = replace(chosen, **trainable_fields(model))  # what is trained, as the other faces' plans say it
    half = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()
                   if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)})
    if half:  # the plan's precision is autocast's: weights stored in half precision stay so, and so do their updates
        note = (f"the model's trainable weights are {' and '.join(half)}: the plan leaves them so (its precision is "
                "autocast's), and updates under half a unit of their last place are lost; load the model in fp32 "
                "(e.g. torch_dtype=torch.float32) to train with fp32 weights")
        log.warning(f"tightfit: {note}")
        notes.append(note)
    return replace(chosen, reasons=chosen.reasons + tuple(notes)) if notes else chosen


# ---------------------------------------------------------------- the step
@dataclass(frozen=True)
class StepOutcome:
    """What one :class:`TrainStep` call did.

    Attributes:
        loss: the batch's mean loss (a Python float: the micro-batches' losses weighted by their samples,
            or by their target tokens for a model's own token-mean loss).
        grad_norm: global L2 norm of the unscaled gradients (before clipping, if ``max_grad_norm`` is set).
        stepped: whether the optimizer step was applied (False: non-finite gradients, skipped; or a batch
            without any target, every label -100, where there is nothing to learn: loss and norm 0.0).
        micro_batch: samples per forward/backward pass in this step (after any OOM recovery; a batch
            smaller than the micro-batch runs as one pass of its samples).
        accumulation_steps: micro-batches this step ran.
        oom_recoveries: times this step was redone with a smaller micro-batch.
        peak_allocated_bytes, peak_reserved_bytes: this step's CUDA peaks (None on the CPU).
        health: the GPU's NVML reading ``{"temp_c", "power_w", ...}`` (None without NVML or on the CPU).
    """

    loss: float
    grad_norm: float | None
    stepped: bool
    micro_batch: int
    accumulation_steps: int
    oom_recoveries: int = 0
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    health: dict | None = None


# TrainStep.state_dict's counts: key -> attribute
_STATE_COUNTS = {"micro_batch": "micro_batch", "steps": "steps", "skipped_steps": "skipped_steps",
                 "oom_recoveries": "oom_recoveries", "skipped_in_row": "_skipped_in_row", "clean_steps": "_clean_steps"}


class TrainStep:
    """One optimizer step per call on a whole effective batch, run as ``plan`` says, with the guards.

    Each call splits the batch along dim 0 into micro-batches of the plan's size, runs forward under
    autocast and backward (the loss scaled for fp16) on each, normalised so the summed gradient is the
    whole batch's; then unscales once, clips only if ``max_grad_norm`` is given, steps or skips a
    non-finite step (a WARNING on the ``tightfit`` logger, shown with no logging set up), updates the
    loss scale and zeroes the gradients (:func:`tightfit.step.training_step`). An out-of-memory error
    anywhere in the step redoes the batch from scratch with half the micro-batch -- the same samples,
    the same effective batch, the RNG states and buffers (BatchNorm's running statistics, up to
    :data:`tightfit.buffers.BUFFER_SNAPSHOT_BYTES`) restored, so the losses, weights and buffers are those of a run
    that had used the smaller micro-batch from the start -- and the micro-batch grows back after
    ``grow_back_after`` clean steps. Any other error in a call (your loss raising on a bad
    sample) propagates after the attempt is undone in the same way (gradients dropped, RNG states
    and buffers restored), so a loop that catches it and skips the batch goes on as if it had not
    been given; an error from inside or after your optimizer's step leaves what the step wrote
    (weights and state), and a CUDA device-side assert leaves the GPU unusable. The model is in
    train mode during the call and its modules get their own modes back after: a model in eval
    mode (as ``from_pretrained`` returns it) trains with every module in train mode (dropout on); a model in train mode keeps the modes you gave its parts
    (a backbone in eval mode keeps its BatchNorm statistics frozen, :func:`tightfit.step.training_modes`).

    Args:
        plan: from :func:`plan` (or any :class:`tightfit.Plan`).
        model: the model planned for, on ``plan.device`` (:func:`plan` moves it there); activation
            checkpointing applied as planned (checkpointing the model had on, yours or an earlier
            plan's, turned off with a warning when the plan has none). While the plan checkpoints,
            a Hugging Face model's KV cache is off (``config.use_cache`` False: ``generate()``
            between steps runs without it unless given ``use_cache=True``); your setting comes
            back when a later plan without checkpointing is applied.
        optimizer: your optimizer over the model's parameters; None: the plan's (fused AdamW, ``lr``;
            under ``adamw8bit-bf16`` the model's floating-point weights are first cast to bf16, in place).
        loss: ``(model, batch) -> 0-d mean loss``, as in :func:`plan`; default ``model(**batch).loss``.
        lr: learning rate of the optimizer made when ``optimizer`` is None (default: ``tightfit
            train --lr``'s, 5e-5); refused with your own optimizer, which keeps its own.
        max_grad_norm: clip the global gradient norm to this, positive and finite (default None:
            measure, do not clip).
        max_skipped_steps: raise after this many non-finite (skipped) steps in a row.
        grow_back_after: after an OOM recovery, double the micro-batch again (up to the plan's)
            after this many clean steps (0: never).
        warn_temp_c: log a warning when the GPU reaches this temperature (deg C).

    Attributes:
        micro_batch: the micro-batch in force; ``steps``, ``skipped_steps``, ``oom_recoveries``: counts.
            :meth:`state_dict` holds them and the loss scaler's state, for an exact resume.
        optimizer: yours, or the one TrainStep made (whose state :meth:`state_dict` holds).
        memory_timeline: ``(step, peak allocated bytes, peak reserved bytes)`` per step on CUDA.
        events: what the guards did, one line each (also logged to the ``tightfit`` logger).
        health: the :class:`tightfit.runtime.health.HealthMonitor` on CUDA (None on the CPU).

    Raises:
        TightfitError: (at construction, before any work) ``plan`` is not a Plan; ``max_grad_norm``
            not positive and finite (or None), ``max_skipped_steps`` below 1, ``grow_back_after``
            below 0, ``warn_temp_c`` not between 0 and 150, or (without ``optimizer``) ``lr`` not
            positive and finite (an int beyond a float's range is not); the model's
            parameters are not on ``plan.device``; a CUDA plan without a visible CUDA GPU; an fp16/bf16
            plan on the CPU. (From a call) a malformed or empty batch, or one of more samples than
            the plan's effective batch, or one whose one-sample micro-batch the model's BatchNorm
            layers cannot train on (raised after the attempt is undone); out of memory at a
            micro-batch of 1, or on one rank of a model wrapped in DDP or FSDP over several processes
            (not redone: that rank's backwards would no longer meet the other ranks'). (At construction) an ``optimizer`` that is not one or updates none
            of the model's trainable parameters, no ``optimizer`` and no trainable parameter, a
            ``loss`` that is not callable.
        NonFiniteTrainingError: ``max_skipped_steps`` non-finite steps in a row.
        PartialUpdateError: out of memory inside an optimizer step that had already written part of
            the update (not possible with fused AdamW), or after the step had applied it (the loss
            scaler's update: fused AdamW too).
    """

    def __init__(self, plan: Plan, model: torch.nn.Module, optimizer=None, *, loss: LossFn | None = None,
                 lr: float | None = None, max_grad_norm: float | None = None, max_skipped_steps: int = 20,
                 grow_back_after: int = 100, warn_temp_c: float = 82.0):
        from .config import TrainOptions, check_option
        from .levers.checkpointing import set_activation_checkpointing, turned_off_note
        from .levers.trainable import check_trainable
        from .levers.precision import make_grad_scaler
        from .runtime.health import HealthMonitor
        from .step import make_optimizer

        if not isinstance(plan, Plan):
            raise TightfitError(f"TrainStep(plan, model, optimizer): plan must be a tightfit.Plan, got {type(plan).__name__}")
        refuse_parameter_offload(plan, "TrainStep")
        if not isinstance(model, torch.nn.Module):
            raise TightfitError(f"TrainStep(plan, model, optimizer): model must be a torch.nn.Module, got "
                                f"{type(model).__name__}")
        # the checks of `tightfit train`'s options of the same name (a negative max_grad_norm would
        # turn each step into gradient ascent, NaN would write NaN into every weight)
        if optimizer is not None and lr is not None:  # it would be dropped without a word
            raise TightfitError(f"TrainStep: lr={lr!r} is for the optimizer TrainStep makes; yours keeps its own "
                                "learning rate (set it on your optimizer, or leave lr out)")
        lr = TrainOptions.lr if lr is None else lr  # `tightfit train --lr`'s default
        checked = {"max_grad_norm": max_grad_norm, "max_skipped_steps": max_skipped_steps,
                   "grow_back_after": grow_back_after, "warn_temp_c": warn_temp_c,
                   **({"lr": lr} if optimizer is None else {})}
        for name, value in checked.items():
            check_option(TrainOptions, name, value, called=name)
        self.device = _check_device(plan, model)
        check_trainable(plan.trainable, model)
        if loss is not None and not callable(loss):
            raise TightfitError(f"TrainStep: loss must be a function (model, batch) -> 0-d mean loss, got {type(loss).__name__}")
        if optimizer is not None:
            _check_optimizer(optimizer, model)
        elif not any(p.requires_grad for p in model.parameters()):
            raise TightfitError(_nothing_to_train("TrainStep", model))
        self.plan, self.loss, self.max_grad_norm = plan, loss, max_grad_norm
        self.max_skipped_steps, self.grow_back_after = max_skipped_steps, grow_back_after
        self.model = model
        self.events: list[str] = []
        if optimizer is None:  # the plan's; adamw8bit-bf16 needs the model's weights in bf16 first
            from .levers.optimizers import cast_weights

            cast_weights(model, plan.optimizer)
        # made before checkpointing is set: one refused here (adamw-offload without CUDA, a library
        # missing) leaves the model's checkpointing as it was
        self.optimizer = optimizer if optimizer is not None else make_optimizer(
            model.parameters(), plan.optimizer, self.device.type, lr)
        # the loop has no optimizer of its own to save then: state_dict carries this one's state
        self._own_optimizer = optimizer is None
        # on or off as planned: an earlier plan's checkpointing of the same model must not stay on (said: yours too)
        note = turned_off_note(model, plan.activation_checkpointing, plan.checkpoint_blocks, plan.block_policies)
        set_activation_checkpointing(model, plan.activation_checkpointing, plan.checkpoint_blocks, plan.block_policies)
        if note:
            self._event(note, logging.WARNING)
        self._fused = all(g.get("fused") for g in self.optimizer.param_groups)
        self.scaler = make_grad_scaler(plan.precision, self.device.type)
        self.health = HealthMonitor(self.device.index or 0, warn_temp_c) if self.device.type == "cuda" else None
        self.micro_batch = self._used_micro_batch = plan.micro_batch
        self.steps = self.skipped_steps = self.oom_recoveries = 0
        self._skipped_in_row = self._clean_steps = 0
        self._short_in_row, self._told_short = 0, False  # batches under the effective batch in a row; said
        self._told_token_loss = False
        self._last_update = 0  # the step whose update was the last applied (0: none yet)
        self.memory_timeline: list[tuple[int, int, int]] = []
        self._zero_grad()  # a stray backward before the loop must not leak into step 1

    def __call__(self, batch) -> StepOutcome:
        """One optimizer step on ``batch`` (a dict or tuple of tensors, samples along dim 0, on any
        device: micro-batches are copied to the plan's device one at a time). Returns a
        :class:`StepOutcome`; see the class for the errors."""
        from .step import train_mode

        b = _Batch(batch)
        if b.size > self.plan.effective_batch:  # one optimizer step over more samples than planned
            raise TightfitError(f"a batch of {b.size} samples is more than the plan's effective batch of "
                                f"{self.plan.effective_batch}: give each step at most {self.plan.effective_batch} "
                                f"samples (the loader's batch_size), or plan(effective_batch={b.size})")
        _check_class_ids(self.model, b, self.loss)  # before anything of the step: nothing to undo
        # only an epoch's last batch may be short: two in a row mean a loader whose batch_size is
        # the micro-batch, each step then training on fewer samples than planned (said once)
        self._short_in_row = self._short_in_row + 1 if b.size < self.plan.effective_batch else 0
        if self._short_in_row == 2 and not self._told_short:
            self._told_short = True
            self._event(f"step {self.steps + 1}: a second batch in a row of fewer samples ({b.size}) than the plan's "
                        f"effective batch of {self.plan.effective_batch}: each step trains on the batch it is given "
                        f"(accumulating only within it), so these steps have an effective batch of {b.size}; give "
                        f"each step {self.plan.effective_batch} samples (the loader's batch_size; only an epoch's "
                        "last batch may be smaller), or plan for the batch you give", logging.WARNING)
        if self.loss is not None and not self._told_token_loss and b.size > self.micro_batch:
            self._say_token_loss(b)
        recoveries = self.oom_recoveries
        # every window starts from zero gradients (DESIGN invariant 1), not only the first: a backward
        # of the caller's between two calls (a gradient-based metric) would otherwise add to this step's;
        # the optimizer's tensors outside the model too (a learnable temperature, a prompt)
        self._zero_grad()
        tokens = _target_tokens(self.model, b, self.loss)  # None: the loss is a mean over samples
        targets = None if tokens is None else int(tokens(b.as_dict()))
        if targets == 0 and not _ranks_in_step(self.model):
            # nothing to learn from: an update of zero gradients would still move the weights (AdamW's
            # weight decay and moments) and count a step in its bias correction (with several
            # processes every rank steps: one that skipped alone would leave the others in their all-reduce)
            self.steps += 1
            self._event(f"step {self.steps}: no target in the batch (every label is -100): nothing to learn, "
                        "no update", logging.WARNING)
            peaks, reading = self._record_memory_and_health()
            return StepOutcome(0.0, 0.0, False, min(self.micro_batch, b.size), accumulation_steps(b.size, self.micro_batch),
                               0, *peaks, reading)
        with train_mode(self.model):  # dropout on; a train-mode model's eval-mode parts stay in eval mode
            result = self._step_with_recovery(b, tokens, _normaliser(b, targets))
        self.steps += 1
        stepped = self._after_step(result.finite, b)
        peaks, reading = self._record_memory_and_health()
        return StepOutcome(result.loss, result.grad_norm, stepped, min(self._used_micro_batch, b.size),
                           accumulation_steps(b.size, self._used_micro_batch), self.oom_recoveries - recoveries, *peaks, reading)

    def _zero_grad(self) -> None:
        """Drop the gradients of the model's parameters and of every tensor the optimizer updates (yours
        may hold some outside the model)."""
        self.model.zero_grad(set_to_none=True)
        zero = getattr(self.optimizer, "zero_grad", None)  # every torch optimizer's; a stand-in may lack it
        if zero is not None:
            zero(set_to_none=True)

    def _step_with_recovery(self, b: _Batch, tokens, normaliser: float):
        """:func:`tightfit.step.training_step` on ``b`` (``tokens`` and ``normaliser``: as
        :func:`_target_tokens` and :func:`_normaliser` give them), redone with half the micro-batch after each
        OOM, as the ``tightfit train`` runtime redoes a window (:meth:`tightfit.runtime.trainer.Trainer.train_step`):
        the RNG states, the optimizer's state and the model's buffers (:func:`tightfit.buffers.buffer_snapshot`)
        as the failed attempt found them."""
        from .levers.precision import autocast
        from .memory.oom import is_oom, release_memory
        from .rng import capture_rng
        from .runtime.trainer import PartialUpdateError
        from .buffers import buffer_snapshot, restore_buffers
        from .levers.optimizers import hold_gradients
        from .step import changed_since, in_place_versions, training_step, update_ran

        d, loss_sum, rng = b.as_dict(), _loss_sum(b, self.loss, tokens), capture_rng()
        buffers = buffer_snapshot(self.model.modules())  # BatchNorm's statistics: a redo starts from these
        while True:
            # fused AdamW allocates only its new state, before any write: no snapshot needed
            before = None if self._fused else in_place_versions(self.optimizer)
            had_state = set(self.optimizer.state)
            hold_gradients(self.optimizer, accumulation_steps(b.size, self.micro_batch))  # CPU offload
            try:
                result = training_step(self.model, self._micro_batches(d, b.size), loss_sum, normaliser, self.optimizer,
                                       self.scaler, lambda: autocast(self.plan.precision, self.device.type),
                                       self.max_grad_norm)
                self._used_micro_batch = self.micro_batch
                if not result.finite:  # skipped: the buffers too as the step found them (no NaN statistics kept)
                    restore_buffers(buffers)
                return result
            except Exception as e:  # OOMs are redone; anything else propagates, the attempt undone
                # an OOM after the update was applied (fused AdamW too) must not be redone either
                ran = update_ran(e)
                written = ran or (before is not None and changed_since(self.optimizer, before))
                if not is_oom(e):
                    # a caller that skips the batch goes on clean; the optimizer's state is kept: only its
                    # step allocates state, and one that failed inside or after its step may have written it
                    try:
                        self._undo_attempt(had_state, False, rng, buffers)
                    except Exception:  # noqa: BLE001 - a device left unusable (a device-side assert): e says why
                        pass
                    if refuses_one_sample(e):  # torch's, or torch.compile's around it
                        from .runtime.trainer import describe_split

                        fix = ("plan another effective batch, so that its micro-batches leave no sample alone"
                               if b.size == self.plan.effective_batch else
                               "give the step batches that leave no one-sample micro-batch (e.g. drop_last=True "
                               "on the loader)")
                        raise TightfitError(
                            f"a batch of {b.size} sample{'' if b.size == 1 else 's'}, split as "
                            f"{describe_split(b.size, self.micro_batch)}, gives "
                            "the model's BatchNorm layers a micro-batch of 1 sample, which they cannot train on; "
                            f"{fix}, or put BatchNorm in eval mode") from e
                    raise
                where = type(e).__name__
            if ran:
                raise PartialUpdateError(f"out of memory after the optimizer step of step {self.steps + 1} had applied its "
                                         "update (in what follows it: the loss scaler's update); redoing it would "
                                         "apply the update twice")
            if written:
                raise PartialUpdateError(f"out of memory inside the optimizer step of step {self.steps + 1} after it had "
                                         "updated part of the parameters or their state; redoing it would apply that "
                                         "part twice (use fused AdamW, the plan's optimizer, to rule this out)")
            # outside the except block: the traceback and the tensors its frames held are gone
            self._undo_attempt(had_state, True, rng, buffers)
            release_memory()
            ranks = _ranks_in_step(self.model)
            if ranks:  # DESIGN invariant 12: no rank redoes a step alone
                raise TightfitError(
                    f"out of memory ({where}) at micro-batch {self.micro_batch} on rank {ranks[0]} of {ranks[1]}: the "
                    "model is wrapped for several processes (DDP or FSDP), whose every backward runs collectives "
                    "with the other ranks, so this rank cannot redo the step with a smaller micro-batch alone (its "
                    "collectives would pair with the other ranks' next ones); "
                    + ("plan a smaller micro-batch for every rank (tightfit.plan with a lower budget=, or "
                       "checkpointing='on')" if self.micro_batch > 1 else
                       "at micro-batch 1 only less memory per sample helps: activation checkpointing, bf16/fp16, "
                       "or a larger budget"))
            self._on_oom(where, b.size)

    def _undo_attempt(self, had_state: set, drop_new_state: bool, rng, buffers) -> None:
        """Undo a failed attempt at a step: its gradients, the loss scaler's step, the RNG states
        and the model's buffers as the attempt found them, and with ``drop_new_state`` the
        optimizer state it allocated (an OOM's redo: allocated, never written)."""
        from .rng import restore_rng
        from .buffers import restore_buffers

        if drop_new_state:
            for p in [p for p in self.optimizer.state if p not in had_state]:
                del self.optimizer.state[p]  # state the failed attempt allocated but never wrote
        self.optimizer.zero_grad(set_to_none=True)
        self._reset_scaler_step()
        restore_rng(rng)
        restore_buffers(buffers)

    def _micro_batches(self, d: dict, n: int):
        """The micro-batches of ``d`` on the plan's device, made one at a time (each dropped before the next)."""
        for i in range(0, n, self.micro_batch):
            yield {k: v[i:i + self.micro_batch].to(self.device, non_blocking=True) for k, v in d.items()}

    def _reset_scaler_step(self) -> None:
        # a failed attempt may have called unscale_; a scaler rebuilt from its state keeps the scale
        from .levers.precision import make_grad_scaler

        if self.scaler.is_enabled():
            state = self.scaler.state_dict()
            self.scaler = make_grad_scaler(self.plan.precision, self.device.type)
            self.scaler.load_state_dict(state)

    def _on_oom(self, where: str, size: int) -> None:
        from .runtime.trainer import describe_split

        self.oom_recoveries += 1
        self._clean_steps = 0
        if self.micro_batch == 1:
            raise TightfitError("out of memory with a micro-batch of 1"
                                + ("" if self.plan.activation_checkpointing else
                                   "; a plan with activation checkpointing would use less")
                                + ("; fp16/bf16 autocast would use less" if self.plan.precision == "fp32" else "")
                                + "; or raise the budget")
        from .buffers import running_stat_norms
        from .plan import halved_micro_batch

        # later calls bring whole effective batches, which the new micro-batch splits too
        new = halved_micro_batch(size, self.micro_batch, no_single=bool(running_stat_norms(self.model)),
                                 others=(self.plan.effective_batch,))
        self._event(f"out of memory ({where}) at micro-batch {self.micro_batch}: redoing step {self.steps + 1} "
                    f"with micro-batch {new}: {size} samples as {describe_split(size, new)}", logging.WARNING)
        self.micro_batch = new

    def _after_step(self, finite: bool, b: _Batch) -> bool:
        """Count clean and skipped steps (a stop on ``max_skipped_steps`` names where ``b``, the
        step's batch, first gives non-finite values); grow the micro-batch back after
        ``grow_back_after`` clean ones."""
        from .levers.precision import autocast, nonfinite_advice
        from .runtime.diagnose import first_nonfinite, nonfinite_input, stop_phrase
        from .runtime.trainer import NonFiniteTrainingError
        from .step import train_mode

        if not finite:
            self.skipped_steps += 1
            self._skipped_in_row += 1
            self._event(f"step {self.steps}: non-finite gradients, update skipped", logging.WARNING)
            if self._skipped_in_row >= self.max_skipped_steps:
                first = next(self._micro_batches(b.as_dict(), b.size))
                loss_sum = _loss_sum(b, self.loss, _target_tokens(self.model, b, self.loss))
                # under DDP each rank holds its own batch: a backward run by some ranks only would hang
                alone = _process_group_size() == 1
                culprit = first_nonfinite(self.model, lambda: loss_sum(self.model, first),
                                          lambda: autocast(self.plan.precision, self.device.type),
                                          lambda: train_mode(self.model), self.scaler.is_enabled(), backward=alone)
                in_data = nonfinite_input(first, len(next(iter(first.values()))))
                advice = as_arguments(nonfinite_advice(self.plan.precision, own_loop=True))
                last = self._last_update
                spoiled = (f" The last update applied was step {last}'s (the weights are its weights): if it spoiled "
                           "them, a lower learning rate alone will not help; restore the weights from before it."
                           if last else "")
                raise NonFiniteTrainingError(f"{self._skipped_in_row} steps in a row had non-finite gradients; "
                                             f"{stop_phrase(culprit, in_data, advice)}{spoiled}", self.steps,
                                             last_update=last or None)
            return False
        self._last_update = self.steps
        self._skipped_in_row = 0
        self._clean_steps += 1
        if (self.grow_back_after and self.micro_batch < self.plan.micro_batch
                and self._clean_steps >= self.grow_back_after):
            from .buffers import running_stat_norms
            from .plan import grown_micro_batch

            # later calls bring whole effective batches, which the micro-batch splits too
            new = grown_micro_batch(self.micro_batch, self.plan.micro_batch, bool(running_stat_norms(self.model)),
                                    (self.plan.effective_batch, b.size))
            if new > self.micro_batch:
                self._event(f"{self._clean_steps} clean steps: growing micro-batch back {self.micro_batch} -> {new}")
            self.micro_batch, self._clean_steps = new, 0
        return True

    def _record_memory_and_health(self) -> tuple[tuple[int | None, int | None], dict | None]:
        """This step's CUDA peaks (appended to :attr:`memory_timeline`, then reset) and the GPU's health."""
        if self.device.type != "cuda":
            return (None, None), None
        peaks = (torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device))
        self.memory_timeline.append((self.steps, *peaks))
        torch.cuda.reset_peak_memory_stats(self.device)  # the next entry is the next step's peak
        reading = self.health.sample() if self.health is not None else None
        if reading and "warning" in reading:
            self._event(reading["warning"])
        return peaks, reading

    def state_dict(self) -> dict:
        """What a resumed loop needs beside the model's and the optimizer's state dicts, for an
        exact resume (DESIGN invariant 5): the loss scaler's state (fp16's loss scale and growth
        tracker), the micro-batch in force after OOM recoveries, the counts behind the guards
        (steps, skipped steps in a row, clean steps towards growing the micro-batch back), and this
        process's random number generators' states (Python, NumPy, torch CPU and CUDA: dropout's
        masks draw from them; :func:`tightfit.rng.capture_rng`), and, where TrainStep made the
        optimizer (no ``optimizer`` given), that optimizer's state dict under ``"optimizer"``
        (None with yours, which you save yourself). Plain Python numbers and tensors,
        so ``torch.load(..., weights_only=True)`` reads it back. The plan's own fields are kept to
        refuse a state of another plan in :meth:`load_state_dict`.

        Not in it: where your data stands (a loader's shuffle is drawn when its epoch's iterator is
        made; skip the batches already trained yourself). Under several processes each rank saves
        and loads its own (the ranks' RNG streams differ).
        """
        from .rng import capture_rng

        return {"plan": self._plan_fields(), **{k: getattr(self, a) for k, a in _STATE_COUNTS.items()},
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None, "rng": capture_rng(),
                "optimizer": self.optimizer.state_dict() if self._own_optimizer else None}

    def _plan_fields(self) -> dict:
        return {"precision": self.plan.precision, "micro_batch": self.plan.micro_batch,
                "effective_batch": self.plan.effective_batch}

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` gave, on a ``TrainStep`` made with the same plan
        (load the model's state dict, and your optimizer's, yourself, as your loop saved them; the
        optimizer TrainStep made gets its state from ``state``, learning rate included, as
        ``torch.optim``'s ``load_state_dict`` gives it); the RNG states are restored too, so the
        steps after it draw what the saved run's did.

        Raises:
            TightfitError: ``state`` is not a TrainStep's state (a key, a count, the loss scaler's,
                the RNG's or the optimizer's state missing or malformed), was saved under a plan of
                another precision, micro-batch or effective batch, or holds the state of the
                optimizer TrainStep made where this one was given yours (or none where this one
                made it). Nothing is changed then.
        """
        from .levers.precision import make_grad_scaler
        from .rng import capture_rng, restore_rng

        def refuse(what: str):
            return TightfitError(f"TrainStep.load_state_dict: not a TrainStep's state ({what}); give it what "
                                 "TrainStep.state_dict() returned")

        # "optimizer" is absent from the states of tightfit before it was kept (read as None)
        if not isinstance(state, dict) or set(state) - {"optimizer"} != {"plan", "scaler", "rng", *_STATE_COUNTS}:
            raise refuse("its keys differ" if isinstance(state, dict) else f"a {type(state).__name__}")
        mine = self._plan_fields()
        if state["plan"] != mine:
            raise TightfitError(f"TrainStep.load_state_dict: the state was saved under a plan of {state['plan']}, this "
                                f"TrainStep runs {mine}; resume with the plan the run was saved under")
        for k in _STATE_COUNTS:
            if not isinstance(state[k], int) or isinstance(state[k], bool) or state[k] < 0:
                raise refuse(f"{k} {state[k]!r} is not a whole number >= 0")
        mb = state["micro_batch"]
        if not 1 <= mb <= self.plan.micro_batch:
            raise refuse(f"micro_batch {mb} is not between 1 and the plan's {self.plan.micro_batch}")
        if (state["scaler"] is None) == self.scaler.is_enabled():
            raise refuse(f"its loss scaler does not match this plan's precision ({self.plan.precision})")
        optimizer_state = state.get("optimizer")
        if optimizer_state is not None and not self._own_optimizer:
            raise TightfitError("TrainStep.load_state_dict: the state holds the optimizer TrainStep made (the run had "
                                "no optimizer of yours); this TrainStep was given yours: make it without optimizer=, "
                                "as the run was")
        if optimizer_state is None and self._own_optimizer:
            # the AdamW moments and step count would start again: the resumed run would not be the saved one's
            raise TightfitError("TrainStep.load_state_dict: the state holds no optimizer state (saved by a TrainStep "
                                "given your optimizer, or by an earlier tightfit that kept none), and this TrainStep "
                                "made its own: give it the optimizer the run was saved with, or start without the state")
        scaler = self.scaler
        if state["scaler"] is not None:  # into a new scaler: one that fails part-way leaves this one as it was
            scaler = make_grad_scaler(self.plan.precision, self.device.type)
            try:
                scaler.load_state_dict(state["scaler"])
            except Exception as e:  # noqa: BLE001 - a malformed scaler state, whatever torch raises
                raise refuse(f"its loss scaler's state: {type(e).__name__}: {e}") from None
        before = capture_rng()
        try:
            restore_rng(state["rng"])
        except Exception as e:  # noqa: BLE001 - a malformed RNG state: the generators put back first
            restore_rng(before)
            raise refuse(f"its RNG states: {type(e).__name__}: {e}") from None
        if optimizer_state is not None:
            try:  # torch checks the groups before it replaces anything: a refusal leaves the optimizer as it was
                self.optimizer.load_state_dict(optimizer_state)
            except Exception as e:  # noqa: BLE001 - a malformed optimizer state, whatever torch raises
                restore_rng(before)
                raise refuse(f"its optimizer's state: {type(e).__name__}: {e}") from None
        self.scaler, self._used_micro_batch = scaler, mb
        for k, attribute in _STATE_COUNTS.items():
            setattr(self, attribute, state[k])
        self._last_update = self.steps - self._skipped_in_row  # the steps before the skipped ones were applied

    def plan_in_force(self) -> Plan:
        """The plan with the micro-batch now in use (after OOM recoveries)."""
        if self.micro_batch == self.plan.micro_batch:
            return self.plan
        return self.plan.with_micro_batch(self.micro_batch, f"micro-batch {self.micro_batch} after OOM recovery")

    def summary(self) -> dict:
        """``{"steps", "skipped_steps", "oom_recoveries", "micro_batch", "peak_allocated_bytes",
        "peak_reserved_bytes", "max_temp_c", "max_power_w", "health"}``: the run so far (peaks:
        the largest of :attr:`memory_timeline`, None on the CPU)."""
        t = self.memory_timeline
        h = self.health
        return {"steps": self.steps, "skipped_steps": self.skipped_steps, "oom_recoveries": self.oom_recoveries,
                "micro_batch": self.micro_batch,
                "peak_allocated_bytes": max((x[1] for x in t), default=None),
                "peak_reserved_bytes": max((x[2] for x in t), default=None),
                "max_temp_c": h.max_temp_c if h else None, "max_power_w": h.max_power_w if h else None,
                "health": h.status if h else "off (CPU)"}

    def _say_token_loss(self, b: _Batch) -> None:
        """Warn once where ``loss=`` meets token labels with -100 in a batch split into micro-batches:
        the micro-batches' losses are weighed by their samples, so a loss that is a mean over target
        tokens weighs a micro-batch with fewer targets more than one batch would (the model's own
        loss, ``loss`` left out, is weighed by its targets). Labels on a GPU are read on the first
        step only (one sync)."""
        if b.keys is None or "labels" not in b.keys:
            return
        labels = b.values[b.keys.index("labels")]
        on_device = labels.device.type != "cpu"  # read there on the first step only: a sync per step otherwise
        if labels.is_floating_point() or labels.dim() < 2 or (on_device and self.steps) or not (labels == -100).any():
            return
        self._told_token_loss = True
        self._event(f"step {self.steps + 1}: your loss= is weighed across the micro-batches by their samples; with "
                    "token labels of -100, a loss that is a mean over target tokens then weighs micro-batches "
                    "with fewer targets more than one batch of the effective size would: leave loss= out to "
                    "train on the model's own loss, weighed by its target tokens", logging.WARNING)

    def _event(self, message: str, level: int = logging.INFO) -> None:
        self.events.append(message)
        log.log(level, "tightfit: %s", message)


def _process_group_size() -> int:
    """Processes in the default process group (1 where there is none)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _ranks_in_step(model: torch.nn.Module) -> tuple[int, int] | None:
    """``(rank, world size)`` where ``model`` trains in step with other processes -- a
    DistributedDataParallel or FSDP wrapper in it, under a process group of more than one rank --
    whose collectives (gradient all-reduce, all-gathers) each backward must meet on every rank;
    None otherwise (one process, or ranks training models of their own)."""
    if _process_group_size() == 1:
        return None
    dist = torch.distributed
    wrapped = any(isinstance(m, torch.nn.parallel.DistributedDataParallel)
                  or type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules())
    return (dist.get_rank(), dist.get_world_size()) if wrapped else None


def _check_optimizer(optimizer, model: torch.nn.Module) -> None:
    """Refuse an optimizer that is not one (no ``param_groups``) or updates none of ``model``'s
    trainable parameters (e.g. one built over another model object): every step would report a
    step and change nothing.

    Raises:
        TightfitError: either case, in one line.
    """
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list) or not callable(getattr(optimizer, "step", None)):
        raise TightfitError(f"TrainStep(plan, model, optimizer): optimizer must be a torch.optim.Optimizer over the "
                            f"model's parameters (or None: the plan's), got {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters() if p.requires_grad}
    # an optimizer offloading state to the host (torchao's CPUOffloadOptimizer, adamw-offload) keeps
    # host copies in its groups, and the model's parameters as the keys of param_d2h_map
    updated = {id(p) for g in groups for p in g.get("params", ())} | {id(p) for p in getattr(optimizer, "param_d2h_map", ())}
    if mine and not mine & updated:
        raise TightfitError("TrainStep: the optimizer updates none of the model's trainable parameters (was it built "
                            "over another model object?)")


def _check_device(plan: Plan, model: torch.nn.Module) -> torch.device:
    """The device the step runs on: the model's, which must be the plan's (checked before any work,
    as :func:`plan` checks its arguments).

    Raises:
        TightfitError: a CUDA plan without a visible CUDA GPU; fp16/bf16 on the CPU; parameters not
            on ``plan.device``.
    """
    if plan.device == "cuda" and not torch.cuda.is_available():
        raise TightfitError("the plan is for a CUDA GPU (plan.device='cuda'), but no CUDA GPU is visible: "
                            "plan on this machine with tightfit.plan")
    if plan.device == "cpu" and plan.precision != "fp32":
        raise TightfitError(f"precision={plan.precision!r} needs a CUDA GPU; on the CPU the plan must be fp32 "
                            "(as tightfit.plan makes it)")
    devices = {p.device for p in model.parameters()}
    if any(d.type != plan.device for d in devices):
        raise TightfitError(f"the plan is for {plan.device}, but the model's parameters are on "
                            f"{', '.join(sorted(map(str, devices)))}: plan with this model (tightfit.plan moves it), "
                            f"or model.to({plan.device!r})")
    return next(iter(devices)) if len(devices) == 1 else torch.device(plan.device)

