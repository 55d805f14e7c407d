"""A workload: the model, its samples, the task (loss and evaluation) and the effective batch.

Samples are any map-style dataset (``len(ds)``, ``ds[i]``, e.g. a ``torch.utils.data.Dataset``)
with a collate function that turns a list of samples into a batch dict of tensors, or an object
that collates index lists itself (:class:`TextBatches`). The runtime needs only
``collate(indices)``, ``worst_case(n)`` (the planner's memory probe) and ``len``, plus the task's
``loss_sum(model, batch)`` and ``count(batch)``, so that it can split any accumulation window into
micro-batches of any size and normalise the loss by what the whole window holds (samples, or
tokens for token-level losses).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .data import TextClassificationData
from .errors import TightfitError
from .plan import MAX_BATCH
from .tasks import (CausalLM, ImageClassification, SequenceClassification, Task, causal_lm_loss_sum,
                    classification_loss_sum, count_samples, count_target_tokens, logits_classes, num_classes,
                    task_for)

__all__ = ["CausalLM", "DatasetBatches", "ImageClassification", "SequenceClassification", "Task", "TextBatches",
           "Workload", "as_batches", "causal_lm_loss_sum", "classification_loss_sum", "collate_as",
           "count_samples", "count_target_tokens"]

PAD_MULTIPLE = 8
WORST_CASE_SCAN = 10_000  # samples a dataset without its own worst case is searched for its largest


class TextBatches:
    """Tokenized texts with labels, padded per batch to the longest sequence in it.

    The texts are tokenized once, here; each field's tokens are kept as one flat int32 tensor
    (with each sample's offset and length), so that collating a batch is a few tensor ops
    (a gather and a mask) rather than Python lists of ints: the runtime's prefetch thread
    collates while the main thread launches the step's kernels, and a Python-level collate
    held the interpreter lock for about 5 ms per 256-sample batch of 128 tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        data: the samples.
        seq_len: maximum sequence length in tokens (longer texts are truncated).
    """

    def __init__(self, tokenizer, data: TextClassificationData, seq_len: int):
        import itertools

        enc = tokenizer(data.texts, truncation=True, max_length=seq_len)
        self.keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        lengths = [len(row) for row in enc["input_ids"]]
        self.lengths = torch.tensor(lengths, dtype=torch.long)  # [N] tokens per sample
        self.offsets = torch.zeros(len(lengths), dtype=torch.long)  # [N] where each sample starts
        if lengths:
            self.offsets[1:] = torch.cumsum(self.lengths, 0)[:-1]
        # [total + 1] per field: every sample's tokens end to end, then one spare slot that a
        # padding position reads (masked out after the gather)
        self.tokens = {k: torch.tensor(list(itertools.chain.from_iterable(enc[k])) + [0], dtype=torch.int32)
                       for k in self.keys}
        self.labels = list(data.labels)
        self._labels = torch.tensor(self.labels, dtype=torch.long)
        self.pad_id = tokenizer.pad_token_id or 0
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i``: its token lists (unpadded, at most ``seq_len``) and its label."""
        start, n = int(self.offsets[i]), int(self.lengths[i])
        return {**{k: self.tokens[k][start:start + n].tolist() for k in self.keys}, "labels": self.labels[i]}

    def collate(self, indices: Sequence[int], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """Batch of the given samples on the CPU.

        Returns:
            ``input_ids``, ``attention_mask`` (and ``token_type_ids``): int64 ``[B, T]`` with
            ``T`` the longest sequence among them rounded up to a multiple of 8 (at most
            ``seq_len``), or ``pad_to``; padding is the tokenizer's pad id in ``input_ids`` and 0
            elsewhere; ``labels``: int64 ``[B]``.
        """
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        lengths = self.lengths[idx]  # [B]
        longest = int(lengths.max())
        # Round up to a multiple of 8 (at most seq_len): fewer distinct shapes fragment the
        # caching allocator less, and tensor cores prefer multiples of 8.
        length = pad_to or min(self.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        cols = torch.arange(length)
        real = cols < lengths[:, None]  # [B, T] True on a sample's own tokens
        spare = self.tokens[self.keys[0]].numel() - 1
        where = torch.where(real, self.offsets[idx, None] + cols, spare)  # [B, T] flat positions
        batch = {}
        for k in self.keys:
            fill = self.pad_id if k == "input_ids" else 0
            batch[k] = torch.where(real, self.tokens[k][where].long(), fill)
        batch["labels"] = self._labels[idx]
        return batch

    def all_labels(self) -> torch.Tensor:
        """Every sample's label, int64 ``[N]`` (checked whole when a workload is made)."""
        return self._labels

    def worst_case(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` samples padded to the full ``seq_len``: the largest batch of ``n`` the data can make
        (used by the memory probe so that a plan that fits it fits every real batch)."""
        idx = [i % len(self) for i in range(n)]
        return self.collate(idx, pad_to=self.seq_len)


def collate_as(*keys: str) -> Callable[[list], dict[str, torch.Tensor]]:
    """A collate function for tuple samples (e.g. a ``TensorDataset``'s ``(x, y)``): field ``j``
    of every sample, stacked along a new first dimension ``[B, ...]``, becomes ``batch[keys[j]]``.

    Example: ``collate_as("pixel_values", "labels")`` turns samples ``([3, H, W], [])`` into
    ``{"pixel_values": [B, 3, H, W], "labels": [B]}``. The function's ``keys`` attribute holds
    ``keys`` (:meth:`DatasetBatches.all_labels` finds a ``TensorDataset``'s labels by it).
    """
    def collate(samples: list) -> dict[str, torch.Tensor]:
        if len(samples[0]) != len(keys):
            raise TightfitError(f"collate_as{keys}: samples have {len(samples[0])} fields, not {len(keys)}")
        return {k: torch.stack([torch.as_tensor(s[j]) for s in samples]) for j, k in enumerate(keys)}

    collate.keys = keys
    return collate


def _sample_size(sample) -> int:
    """Elements in one sample: tensor elements, list lengths, summed over mappings (a dict, or a
    tokenizer's ``BatchEncoding``, a ``UserDict``) and tuples."""
    if isinstance(sample, torch.Tensor):
        return sample.numel()
    if isinstance(sample, Mapping):
        return sum(_sample_size(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(_sample_size(v) for v in sample) if sample and isinstance(sample[0], (list, tuple, Mapping,
                                                                                        torch.Tensor)) else len(sample)
    return 1


def _plain_dict(batch):
    """``batch`` as a plain dict where it is another mapping (Hugging Face's collators and tokenizers give
    a ``BatchEncoding``, a ``UserDict``, which the estimator and the checks take for no dict); else as is."""
    return dict(batch) if isinstance(batch, Mapping) and not isinstance(batch, dict) else batch


def _check_map_style(data) -> None:
    """Refuse in one line what is not a map-style dataset (``len()`` and ``[i]``): a DataLoader
    (its batches are already made: the plan chooses them), an iterator or generator.

    Raises:
        TightfitError: naming what was given and what to give instead.
    """
    from torch.utils.data import DataLoader

    if isinstance(data, DataLoader):
        raise TightfitError("the data is a DataLoader: give its dataset (loader.dataset) and, if it has one, its "
                            "collate_fn as collate_fn; tightfit makes the batches, of the plan's micro-batch")
    if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TightfitError(f"the data must be a map-style dataset (len() and data[i], e.g. a torch Dataset or a "
                            f"list of samples), got {type(data).__name__}: materialise it, e.g. list(...)")


class DatasetBatches:
    """A map-style dataset and its collate function, with the interface the runtime and the
    planner use (``collate(indices)``, ``worst_case(n)``, ``len``).

    Args:
        dataset: ``len(dataset)`` and ``dataset[i]`` for ``0 <= i < len``.
        collate_fn: a list of samples -> batch dict of CPU tensors keyed by the model's inputs
            and ``labels``; default ``torch.utils.data.default_collate`` (dict samples stack into a
            dict batch; tuple samples need :func:`collate_as`).
        worst_case: ``n -> batch`` of the most memory any ``n`` samples take; default: ``n``
            copies of the largest sample (by element count) among the first
            :data:`WORST_CASE_SCAN` spread over the dataset, which is exact for fixed-size samples
            and for a collate function that pads to the longest sample.

    Attributes:
        check_batch: ``(batch, samples) -> None``, run on every batch :meth:`collate` makes, on
            the host before it can reach a device (e.g. a task's label check, which raises
            :class:`TightfitError`; ``samples``: the batch's sample indices); None: none. Set by
            :meth:`check`.

    Raises:
        TightfitError: ``dataset`` is no map-style dataset (:func:`_check_map_style`).
    """

    def __init__(self, dataset, collate_fn: Callable[[list], dict] | None = None,
                 worst_case: Callable[[int], dict] | None = None):
        from torch.utils.data import default_collate

        _check_map_style(dataset)
        self.dataset, self.collate_fn = dataset, collate_fn or default_collate
        self._worst_case, self._largest = worst_case, None
        self.check_batch: Callable[[dict, Sequence[int]], None] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]

    def collate(self, indices: Sequence[int], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """``collate_fn`` of the samples at ``indices`` (``pad_to`` is for :class:`TextBatches`' kind
        of data and ignored here); a mapping it gives (Hugging Face's collators give a
        ``BatchEncoding``, a ``UserDict``) as a plain dict of the same tensors.

        Raises:
            TightfitError: whatever :attr:`check_batch` raises on the batch.
        """
        batch = _plain_dict(self.collate_fn([self.dataset[i] for i in indices]))
        if self.check_batch is not None:  # every batch, training's and the planner's, on the host
            self.check_batch(batch, indices)
        return batch

    def worst_case(self, n: int) -> dict[str, torch.Tensor]:
        """The batch of ``n`` samples that takes the most memory (see the class docstring); a
        mapping your ``worst_case`` gives, as a plain dict, as :meth:`collate` gives one."""
        if self._worst_case is not None:
            return _plain_dict(self._worst_case(n))
        if self._largest is None:
            step = max(1, len(self) // WORST_CASE_SCAN)
            self._largest = max(range(0, len(self), step), key=lambda i: _sample_size(self.dataset[i]))
        return self.collate([self._largest] * n)

    def all_labels(self) -> torch.Tensor | None:
        """Every sample's ``labels`` ``[N]`` where they are one tensor already: a ``TensorDataset``
        collated by :func:`collate_as` with a ``"labels"`` field; else None (not read sample by sample)."""
        keys = getattr(self.collate_fn, "keys", None)
        tensors = getattr(self.dataset, "tensors", None)
        if not isinstance(self.dataset, torch.utils.data.TensorDataset) or not keys or "labels" not in keys \
                or len(tensors) != len(keys):
            return None
        return tensors[keys.index("labels")]

    def check(self, check_batch: Callable[[dict, Sequence[int]], None] | None = None) -> None:
        """Collate the first sample and check that it gives a dict of tensors, then pass that
        batch, and every batch collated after (:attr:`check_batch`), to ``check_batch`` (e.g. a
        task's label check; None: none).

        Raises:
            TightfitError: it does not (one line saying what it gave); whatever ``check_batch``
                raises.
        """
        self.check_batch = None  # the first batch's form is checked before check_batch reads it
        if len(self) == 0:
            self.check_batch = check_batch
            return
        batch = self.collate([0])
        if not isinstance(batch, dict) or not all(isinstance(v, torch.Tensor) for v in batch.values()):
            got = type(batch).__name__ if not isinstance(batch, dict) else \
                ", ".join(f"{k}: {type(v).__name__}" for k, v in batch.items())
            raise TightfitError(f"the collate function must give a dict of tensors keyed by the model's inputs and "
                                f"'labels' (got {got}); for tuple samples use collate_as('input_ids', 'labels') or "
                                f"collate_as('pixel_values', 'labels')")
        if check_batch is not None:
            check_batch(batch, [0])
        self.check_batch = check_batch


class _ClassIdCheck:
    """A classification task's batch check (:meth:`SequenceClassification.check_batch`) against the
    model's classes: those it says (:func:`num_classes`), else those of its logits on the first
    batch checked with inputs (:func:`logits_classes`, a meta forward), else unknown."""

    def __init__(self, task: SequenceClassification, model: torch.nn.Module):
        self.task, self.model = task, model
        self.classes, self.looked = num_classes(model), False

    def __call__(self, batch: dict, samples: Sequence[int] | None = None) -> None:
        if self.classes is None and not self.looked and any(k != "labels" for k in batch):
            self.classes, self.looked = logits_classes(self.model, batch), True
        self.task.check_batch(batch, samples, num_classes=self.classes, from_logits=self.looked)


def _check_all_labels(batches, check_batch) -> None:
    """``check_batch`` over every sample's labels at once where ``batches`` holds them as one tensor
    (``all_labels()``: :class:`TextBatches`, a ``TensorDataset`` in :class:`DatasetBatches`): a
    fault anywhere in them is said when the workload is made, not at the step that meets it."""
    labels = batches.all_labels() if hasattr(batches, "all_labels") else None
    if check_batch is not None and labels is not None:
        check_batch({"labels": labels}, range(len(labels)))


def as_batches(data, collate_fn: Callable[[list], dict] | None = None,
               check_batch: Callable[[dict, Sequence[int]], None] | None = None):
    """``data`` itself if it collates index lists (``collate`` and ``worst_case``, e.g.
    :class:`TextBatches`) and no ``collate_fn`` is given; otherwise a checked
    :class:`DatasetBatches` of it (:meth:`DatasetBatches.check` with ``check_batch``, which a
    :class:`DatasetBatches` given as such gets too, and which then checks every batch it collates);
    None stays None. ``check_batch(batch, samples)`` also checks every sample's labels at once
    where they are one tensor already (``all_labels()``).

    Raises:
        TightfitError: ``data`` is no map-style dataset (:class:`DatasetBatches`); the collate
            function does not give a dict of tensors; whatever ``check_batch`` raises.
    """
    if data is None:
        return data
    if isinstance(data, DatasetBatches):
        batches = data
        if check_batch is not None:
            batches.check(check_batch)
        else:
            batches.check_batch = None  # an earlier workload's (another model's classes) is not this one's
    elif collate_fn is None and hasattr(data, "collate") and hasattr(data, "worst_case"):
        batches = data  # its batches are its own: not collated here
    else:
        batches = DatasetBatches(data, collate_fn)
        batches.check(check_batch)
    _check_all_labels(batches, check_batch)
    return batches


@dataclass
class Workload:
    """What to train.

    Attributes:
        model: the ``nn.Module`` (on the CPU until the runtime moves it).
        train: training samples: a map-style dataset (with ``collate_fn``) or an object with
            ``collate``/``worst_case``/``len`` (:class:`TextBatches`); after construction always
            the latter (:func:`as_batches`).
        eval: held-out samples in the same forms, or None.
        effective_batch: samples per optimizer step, at most :data:`tightfit.plan.MAX_BATCH`.
        loss_sum: ``(model, batch) -> 0-d tensor``, the loss summed over what ``count`` counts;
            default: the task's.
        count: ``batch -> int``, samples (or tokens) in a batch that the loss sums over;
            default: the task's.
        task: what the batches mean (:mod:`tightfit.tasks`): loss and evaluation; default: the
            task of ``loss_sum``/``count`` (:func:`tightfit.tasks.task_for`; sequence
            classification when neither is given).
        collate_fn: list of samples -> batch dict, for map-style datasets (see
            :class:`DatasetBatches`).
    """

    model: torch.nn.Module
    train: Any
    eval: Any
    effective_batch: int
    loss_sum: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None
    count: Callable[[dict], int] | None = None
    task: Task | None = None
    collate_fn: Callable[[list], dict] | None = None

    def __post_init__(self):
        E = self.effective_batch
        if isinstance(E, bool) or not hasattr(E, "__index__") or operator.index(E) < 1:
            raise TightfitError(f"Workload: effective_batch {E!r} is not a whole number >= 1")
        self.effective_batch = operator.index(E)  # numpy's integers too
        if self.effective_batch > MAX_BATCH:
            raise TightfitError(f"Workload: effective_batch must be at most {MAX_BATCH} (2**31 - 1) samples")
        if self.task is None:
            self.task = task_for(self.loss_sum, self.count)
        if self.loss_sum is None:
            self.loss_sum = self.task.loss_sum
        if self.count is None:
            self.count = self.task.count
        # the task's own classification loss: the labels of a dataset given as such are checked on the
        # first sample that DatasetBatches.check collates, then on every batch it collates (on the host:
        # a class id past the model's fails in cross-entropy as a device-side assert on a GPU); a label
        # set held in one tensor is checked whole here; tightfit's own batches, and those that collate
        # index lists themselves, are not collated here
        check = None
        if isinstance(self.task, SequenceClassification) and self.loss_sum == self.task.loss_sum:
            check = _ClassIdCheck(self.task, self.model)
        self.train = as_batches(self.train, self.collate_fn, check)
        try:
            self.eval = as_batches(self.eval, self.collate_fn, check)
        except TightfitError as e:  # the same words as the training data's: say which
            raise TightfitError(f"the evaluation data: {e}") from None
