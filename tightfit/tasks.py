"""Tasks: what a workload's batches mean.

A task knows its loss, what that loss is normalised by, how to evaluate a model on held-out
batches, and how to make an example batch of any size for a model config. Batches are dicts of
tensors keyed by the model's ``forward`` arguments plus ``labels``.

- :class:`SequenceClassification`: ``input_ids``/``attention_mask`` ``[B, T]``, ``labels`` ``[B]``;
  evaluation: accuracy and mean loss per sample.
- :class:`ImageClassification`: ``pixel_values`` ``[B, C, H, W]``, ``labels`` ``[B]``; the same
  evaluation.
- :class:`CausalLM`: ``input_ids``/``attention_mask``/``labels`` ``[B, T]`` (``labels`` -100 at
  padding); evaluation: mean loss per target token and perplexity.

The loss is a *sum* over what :meth:`Task.count` counts, so that the runtime can divide it by the
count of a whole accumulation window (DESIGN invariant 1). Evaluation is the sum of per-batch
statistics (:meth:`Task.eval_sums`) turned into metrics (:meth:`Task.summarize`), so that the
runtime can evaluate in batches of any size (halving them on out-of-memory errors) and get what
:meth:`Task.evaluate` gives on the same samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterable, Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F

from .errors import TightfitError
from .masks import hf_model, model_inputs

Batch = dict[str, torch.Tensor]


@runtime_checkable
class Task(Protocol):
    """What a workload's batches mean (see the module docstring).

    Attributes:
        kind: ``"text"``, ``"causal-lm"`` or ``"image"``: what a batch's *size* means in
            :meth:`example_batch` (sequence length in tokens, or image side in pixels).
    """

    kind: str

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        """The training loss summed (not averaged) over what :meth:`count` counts: 0-d fp32."""

    def count(self, batch: Batch) -> int:
        """How many units (samples or target tokens) :meth:`loss_sum` sums over."""

    def eval_sums(self, model: torch.nn.Module, batch: Batch) -> dict[str, float]:
        """Additive evaluation statistics of one batch (Python numbers; summed over batches)."""

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Metrics from the statistics of all batches."""

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
        """Metrics of ``model`` on ``batches`` (no gradients; the caller sets eval mode)."""

    def example_batch(self, config, micro_batch: int, size: int, device: str | torch.device = "meta") -> Batch:
        """A batch of ``micro_batch`` samples of ``size`` for a model built from ``config``."""


def evaluate_batches(task: Task, model: torch.nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
    """``task.summarize`` of the summed ``task.eval_sums`` over ``batches``, without gradients.

    Args:
        task: the task.
        model: the model, on the batches' device (its mode is left as the caller set it).
        batches: batch dicts.

    Returns:
        The task's metrics, e.g. ``{"accuracy", "loss"}`` or ``{"loss", "perplexity", "tokens"}``.
    """
    totals: dict[str, float] = {}
    with torch.no_grad():
        for batch in batches:
            add_sums(totals, task.eval_sums(model, batch))
    return task.summarize(totals)


def add_sums(totals: dict[str, float], part: dict[str, float]) -> None:
    """Add one batch's :meth:`Task.eval_sums` into ``totals`` in place."""
    for k, v in part.items():
        totals[k] = totals.get(k, 0) + v


# ---------------------------------------------------------------- losses (also used on their own)
def count_samples(batch: Batch) -> int:
    """Samples the classification loss sums over: the labels in ``labels`` ``[B]`` that are not
    -100 (cross-entropy skips those, as Hugging Face's classifiers do)."""
    return int((batch["labels"] != -100).sum())


def model_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``model(**inputs).logits``.

    Raises:
        TightfitError: the model's output has no ``.logits`` (a plain tensor, say); its forward does
            not take the batch's inputs by name.
    """
    inputs = model_inputs(model, batch)
    try:
        out = model(**inputs)
    except TypeError as e:  # the call itself, not some call inside the forward: its class names the error
        # the forward's own name (an inherited one is its base class's: "Sequential.forward")
        names = {getattr(type(m).forward, "__qualname__", "") for m in
                 (model, getattr(model, "module", None), getattr(model, "_orig_mod", None)) if m is not None}
        if not any(str(e).startswith(f"{n}() got an unexpected keyword argument") for n in names if n):
            raise
        raise TightfitError(f"{e}: tightfit calls the model as model(**inputs) with the batch's inputs by name "
                            f"({', '.join(inputs)}); give it a forward that takes them (e.g. def forward(self, "
                            f"{next(iter(inputs), 'x')}): ... return SimpleNamespace(logits=...))") from None
    logits = getattr(out, "logits", None)
    if logits is None:
        raise TightfitError(f"the model returned {type(out).__name__}, not an output with .logits: its forward must "
                            f"return e.g. a transformers ModelOutput (wrap it: return SimpleNamespace(logits=...))")
    return logits


def classification_loss_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed (not averaged) cross-entropy of ``logits`` ``[B, C]`` against ``labels`` ``[B]``,
    as a 0-d fp32 tensor, so that dividing by the window's sample count gives the mean over the
    whole accumulation window."""
    logits = model_logits(model, batch)
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")


def count_target_tokens(batch: Batch) -> int:
    """Tokens a causal-LM loss sums over: next-token targets ``labels[:, 1:]`` that are not
    padding (-100)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def causal_lm_loss_sum(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Summed next-token cross-entropy over non-padding targets (``labels`` ``[B, T]``, -100 at
    padding; ``logits`` ``[B, T, V]``), as a 0-d fp32 tensor in nats: divided by the window's
    :func:`count_target_tokens`, the accumulated gradient is that of the token-level mean over
    the whole window."""
    logits = model_logits(model, batch)[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


# ---------------------------------------------------------------- example batches
def size_name(kind: str) -> str:
    """What a sample's size is called for a task of ``kind`` (:attr:`Task.kind`): ``"image size"``
    (pixels a side) or ``"sequence length"`` (tokens), as plan, estimate and the report say it."""
    return "image size" if kind == "image" else "sequence length"


def _check_sizes(kind: str, micro_batch: int, size: int) -> None:
    if micro_batch < 1:
        raise TightfitError(f"micro-batch must be >= 1, got {micro_batch}")
    if size < 1:
        raise TightfitError(f"{size_name(kind)} must be >= 1, got {size}")


def _random_ints(high: int, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """Uniform int64 in ``[0, high)`` on a real device; zeros on ``meta`` (shapes only)."""
    if dev.type == "meta":
        return torch.zeros(shape, dtype=torch.long, device=dev)
    return torch.randint(0, high, shape, device=dev)


def max_positions(config) -> int | None:
    """The longest sequence a text model's ``config`` takes (``max_position_embeddings``, else
    ``n_positions``), or None where it names no limit: absent, or not positive (XLNet's -1: its
    relative positions take any length)."""
    for name in ("max_position_embeddings", "n_positions"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            return limit
    return None


def _token_batch(config, micro_batch: int, size: int, dev: torch.device) -> Batch:
    """Random ``input_ids`` and an all-ones ``attention_mask``, int64 ``[micro_batch, size]``."""
    limit = max_positions(config)
    if limit and size > limit:
        raise TightfitError(f"sequence length {size} exceeds the model's {limit} positions")
    ids = _random_ints(config.vocab_size, (micro_batch, size), dev)
    return {"input_ids": ids, "attention_mask": torch.ones(micro_batch, size, dtype=torch.long, device=dev)}


# ---------------------------------------------------------------- class ids
IGNORE_INDEX = -100  # cross-entropy's ignore_index: a sample labelled so is left out of the loss


def num_classes(model: torch.nn.Module) -> int | None:
    """The classes of ``model``'s logits ``[B, C]`` where the model says so: ``config.num_labels``
    of a Hugging Face classifier (:func:`tightfit.masks.hf_model`, also wrapped by DDP,
    ``torch.compile`` or peft; a class named ``...For*Classification``, e.g.
    ``BertForSequenceClassification``). None for any other model (a plain module, a multiple-choice
    head whose classes are its choices): its classes are not guessed."""
    inner = hf_model(model)
    name = type(inner).__name__
    if inner is None or "Classification" not in name or "TokenClassification" in name:
        return None
    n = getattr(getattr(inner, "config", None), "num_labels", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def logits_classes(model: torch.nn.Module, batch: Batch) -> int | None:
    """The classes ``C`` of ``model``'s logits ``[B, C]`` on ``batch``'s inputs, from forwards of a
    meta copy of the model (:func:`tightfit.memory.estimate.meta_copy`: shapes only, no
    arithmetic; the model, its hooks and its compiled graphs untouched), for a model that does not
    say (:func:`num_classes` None). Read twice, the second time with each input's last dimension
    doubled (more tokens, a wider image): a width that follows the input (a pointer over positions)
    is no class count. None where the first forward fails (a model that reads its values) or the
    logits are not ``[B, C]``.
    """
    from .memory.estimate import meta_copy

    inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None) or model  # compiled, DDP
    try:
        copy = meta_copy(inner).eval()
        for m in copy.modules():  # the owner's hooks (their closures) see no meta tensors
            m._forward_hooks.clear()
            m._forward_pre_hooks.clear()
        inputs = {k: torch.empty_like(v, device="meta") for k, v in batch.items() if torch.is_tensor(v)}
        with torch.no_grad():
            logits = model_logits(copy, inputs)
    except Exception:  # noqa: BLE001 - not every model runs on meta tensors: its classes stay unknown
        return None
    if not torch.is_tensor(logits) or logits.dim() != 2:
        return None
    wider = {k: v.new_empty((*v.shape[:-1], 2 * v.shape[-1])) if v.dim() >= 2 else v for k, v in inputs.items()}
    try:
        with torch.no_grad():
            again = model_logits(copy, wider)
    except Exception:  # noqa: BLE001 - a model of one input size: its width stands
        return int(logits.shape[-1])
    return int(logits.shape[-1]) if torch.is_tensor(again) and again.shape[-1] == logits.shape[-1] else None


def check_class_ids(labels: torch.Tensor, num_classes: int | None, samples: Sequence[int] | None = None,
                    who: str = "SequenceClassification", from_logits: bool = False) -> None:
    """Refuse class ids outside ``[0, num_classes)`` (``num_classes`` None: below 0) other than -100
    (:data:`IGNORE_INDEX`), which
    cross-entropy fails on at the step: on the CPU as ``IndexError: Target 2 is out of bounds``,
    on a GPU as a device-side assert that ends the CUDA context (nothing after it runs, not even a
    checkpoint). Runs on the host: labels on another device are not read (that would wait for it).

    Args:
        labels: class ids, int64 or uint8 ``[N]`` (a batch's, or a dataset's whole label set).
        num_classes: the model's classes (:func:`num_classes`); None where they are unknown: only
            negative class ids are refused (no model takes one but -100).
        samples: the sample index of each of ``labels`` (``[N]``) for the message; None: unknown.
        who: the task, as the message names it.
        from_logits: ``num_classes`` is the width of the model's logits (:func:`logits_classes`),
            not a ``num_labels`` it says.

    Raises:
        TightfitError: one line with the range, where it came from, the first label outside it,
            its sample and the fix.
    """
    if labels.device.type != "cpu" or labels.numel() == 0:
        return
    low, high = torch.aminmax(labels)  # the usual batch: one pass over [N], no copy
    if (num_classes is None or int(high) < num_classes) and int(low) >= 0:
        return
    ids = labels.long()  # uint8 cannot hold -100
    bad = (ids < 0) & (ids != IGNORE_INDEX)
    if num_classes is not None:
        bad |= ids >= num_classes
    if not bool(bad.any()):
        return
    at = int(bad.nonzero()[0, 0])
    value = int(ids[at])
    where = f"sample {int(samples[at])} is labelled {value}" if samples is not None else f"a batch holds {value}"
    if num_classes is None:
        raise TightfitError(f"{who}: labels must be class ids >= 0, or {IGNORE_INDEX} to leave a sample out; {where} "
                            "(number the classes from 0)")
    grow = f"a head of {value + 1} outputs" if from_logits else f"num_labels={value + 1}"
    fix = (f"number the classes 0..{num_classes - 1}, or give the model {grow}" if value >= num_classes
           else f"number the classes 0..{num_classes - 1}")
    source = f"the model's logits have {num_classes}" if from_logits else "the model's num_labels"
    raise TightfitError(f"{who}: labels must be class ids in [0, {num_classes}) ({source}), or "
                        f"{IGNORE_INDEX} to leave a sample out; {where} ({fix})")


# ---------------------------------------------------------------- the tasks
@dataclass(frozen=True)
class SequenceClassification:
    """One label per text: cross-entropy over ``logits`` ``[B, num_labels]``.

    Batches: ``input_ids``, ``attention_mask`` (and ``token_type_ids``) int64 ``[B, T]``,
    ``labels`` int64 ``[B]``. Evaluation: ``{"accuracy", "loss"}`` (mean cross-entropy per sample,
    nats).
    """

    kind: ClassVar[str] = "text"

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return classification_loss_sum(model, batch)

    def count(self, batch: Batch) -> int:
        return count_samples(batch)

    def check_batch(self, batch: Batch, samples: Sequence[int] | None = None, num_classes: int | None = None,
                    from_logits: bool = False) -> None:
        """Refuse a batch whose ``labels`` are not class ids ``[B]`` of a type cross-entropy takes,
        int64 or uint8 (float, int32 or ``[B, 1]`` labels failed in cross-entropy at the run's first step),
        or not in ``[0, num_classes)`` or -100 (:func:`check_class_ids`; where the model's number of
        classes is unknown, only negative ids other than -100 are refused). Cheap enough for every batch: a few operations over ``[B]``.

        Args:
            batch: a collated batch dict.
            samples: the sample index of each row (``[B]``) for the message, or None.
            num_classes: the model's classes (:func:`num_classes`), or None: unknown (only negative
                ids are refused).
            from_logits: ``num_classes`` is its logits' width (:func:`logits_classes`).

        Raises:
            TightfitError: one line with the labels' dtype and shape and the fix, or with the
                first label out of range, its sample and the fix.
        """
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if not torch.is_tensor(labels):
            raise TightfitError(f"{type(self).__name__}: the batches have no 'labels' tensor (class ids, int64 [B])")
        if labels.dtype not in (torch.int64, torch.uint8) or labels.dim() != 1:  # int32: "expected ... Long or Byte"
            fix = "labels.squeeze(1)" if labels.dim() == 2 and labels.shape[1] == 1 else "labels.long()"
            shape = ", ".join(["B", *map(str, labels.shape[1:])]) if labels.dim() else ""  # checked on a sample or two
            raise TightfitError(f"{type(self).__name__}: labels must be class ids, int64 [B]; the batches' are "
                                f"{str(labels.dtype).removeprefix('torch.')} [{shape}] (e.g. {fix} in the "
                                "collate function)")
        check_class_ids(labels, num_classes, samples, type(self).__name__, from_logits)  # None: negative ids only

    def eval_sums(self, model: torch.nn.Module, batch: Batch) -> dict[str, float]:
        """``{"correct", "loss_sum", "samples"}`` of one batch's labelled samples (argmax of fp32
        logits; a label of -100 is left out, as in training)."""
        logits = model_logits(model, batch).float()
        loss = F.cross_entropy(logits, batch["labels"], reduction="sum")  # ignore_index -100
        return {"correct": int((logits.argmax(-1) == batch["labels"]).sum()), "loss_sum": float(loss),
                "samples": count_samples(batch)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """``{"accuracy": correct / samples, "loss": loss_sum / samples}`` (NaN without samples)."""
        n = sums.get("samples", 0)
        if not n:
            return {"accuracy": math.nan, "loss": math.nan}
        return {"accuracy": sums["correct"] / n, "loss": sums["loss_sum"] / n}

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
        return evaluate_batches(self, model, batches)

    def example_batch(self, config, micro_batch: int, size: int, device: str | torch.device = "meta") -> Batch:
        """``input_ids``/``attention_mask`` int64 ``[micro_batch, size]`` (size: tokens) and
        ``labels`` int64 ``[micro_batch]`` below ``config.num_labels``; random on a real device,
        zeros on ``meta``.

        Raises:
            TightfitError: sizes below 1, or ``size`` past the model's positions.
        """
        _check_sizes(self.kind, micro_batch, size)
        dev = torch.device(device)
        batch = _token_batch(config, micro_batch, size, dev)
        batch["labels"] = _random_ints(config.num_labels, (micro_batch,), dev)
        return batch


@dataclass(frozen=True)
class ImageClassification(SequenceClassification):
    """One label per image; the loss and evaluation of :class:`SequenceClassification`.

    Batches: ``pixel_values`` fp32 ``[B, C, H, W]``, ``labels`` int64 ``[B]``.
    """

    kind: ClassVar[str] = "image"

    def example_batch(self, config, micro_batch: int, size: int, device: str | torch.device = "meta") -> Batch:
        """``pixel_values`` fp32 ``[micro_batch, config.num_channels (3), size, size]`` (size:
        pixels; standard normal on a real device, uninitialised on ``meta``) and ``labels``
        int64 ``[micro_batch]`` below ``config.num_labels``.

        Raises:
            TightfitError: sizes below 1.
        """
        _check_sizes(self.kind, micro_batch, size)
        dev = torch.device(device)
        shape = (micro_batch, getattr(config, "num_channels", 3), size, size)
        pixels = torch.empty(shape, device=dev) if dev.type == "meta" else torch.randn(shape, device=dev)
        return {"pixel_values": pixels, "labels": _random_ints(config.num_labels, (micro_batch,), dev)}


@dataclass(frozen=True)
class CausalLM:
    """Next-token prediction: cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``.

    Batches: ``input_ids``, ``attention_mask``, ``labels`` int64 ``[B, T]`` with -100 in
    ``labels`` where the text is padding. The loss is normalised by target tokens. Evaluation:
    ``{"loss": mean loss per target token (nats), "perplexity": exp(loss), "tokens": targets}``.
    """

    kind: ClassVar[str] = "causal-lm"

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return causal_lm_loss_sum(model, batch)

    def count(self, batch: Batch) -> int:
        return count_target_tokens(batch)

    def eval_sums(self, model: torch.nn.Module, batch: Batch) -> dict[str, float]:
        """``{"loss_sum", "tokens"}`` of one batch: summed token loss (nats) and target tokens."""
        return {"loss_sum": float(causal_lm_loss_sum(model, batch)), "tokens": count_target_tokens(batch)}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        """Mean token loss, its perplexity and the token count (NaN without tokens)."""
        tokens = int(sums.get("tokens", 0))
        loss = sums["loss_sum"] / tokens if tokens else math.nan
        try:
            perplexity = math.exp(loss)  # NaN for a NaN loss (and without tokens)
        except OverflowError:  # past ~709.78 nats (a diverged model): inf, as an inf loss's
            perplexity = math.inf
        return {"loss": loss, "perplexity": perplexity, "tokens": tokens}

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
        return evaluate_batches(self, model, batches)

    def example_batch(self, config, micro_batch: int, size: int, device: str | torch.device = "meta") -> Batch:
        """``input_ids``/``attention_mask``/``labels`` int64 ``[micro_batch, size]`` (``labels`` a
        copy of ``input_ids``; size: tokens).

        Raises:
            TightfitError: sizes below 1, or ``size`` past the model's positions.
        """
        _check_sizes(self.kind, micro_batch, size)
        batch = _token_batch(config, micro_batch, size, torch.device(device))
        batch["labels"] = batch["input_ids"].clone()
        return batch


@dataclass(frozen=True)
class LossOnly:
    """A task made of a user's ``loss_sum(model, batch)`` and ``count(batch)``; evaluation gives
    ``{"loss": summed loss / count}`` (the loss in the units the training normalises by)."""

    loss_fn: object
    count_fn: object
    kind: ClassVar[str] = "custom"

    def loss_sum(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        return self.loss_fn(model, batch)

    def count(self, batch: Batch) -> int:
        return int(self.count_fn(batch))

    def eval_sums(self, model: torch.nn.Module, batch: Batch) -> dict[str, float]:
        return {"loss_sum": float(self.loss_fn(model, batch)), "count": int(self.count_fn(batch))}

    def summarize(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums.get("count", 0)
        return {"loss": sums["loss_sum"] / n if n else math.nan}

    def evaluate(self, model: torch.nn.Module, batches: Iterable[Batch]) -> dict[str, float]:
        return evaluate_batches(self, model, batches)

    def example_batch(self, config, micro_batch: int, size: int, device: str | torch.device = "meta") -> Batch:
        raise TightfitError("a task made of a loss function cannot make example batches; give the data instead")


def task_for(loss_sum=None, count=None) -> Task:
    """The task behind a ``(loss_sum, count)`` pair: the built-in task for the built-in functions
    (:class:`SequenceClassification` when both are None), else a :class:`LossOnly`.

    Raises:
        TightfitError: only one of the two is given for a custom loss.
    """
    builtin = {(None, None): SequenceClassification(),
               (classification_loss_sum, count_samples): SequenceClassification(),
               (classification_loss_sum, None): SequenceClassification(),
               (causal_lm_loss_sum, count_target_tokens): CausalLM(),
               (causal_lm_loss_sum, None): CausalLM()}
    key = (loss_sum, count)
    if key in builtin:
        return builtin[key]
    if loss_sum is None or count is None:
        raise TightfitError("a custom loss_sum needs its count (what the loss sums over) too, and vice versa")
    return LossOnly(loss_sum, count)
