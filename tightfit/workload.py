"""A workload: the model, how to make a batch of any samples, and the loss.

The runtime only needs ``collate(indices)``, ``count(batch)`` and ``loss_sum(model, batch)``,
so that it can split any accumulation window into micro-batches of any size and normalise
the loss by what the whole window holds (samples here; tokens for token-level losses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .data import TextClassificationData

PAD_MULTIPLE = 8


class TextBatches:
    """Tokenized texts with labels, padded per batch to the longest sequence in it.

    Args:
        tokenizer: a Hugging Face tokenizer.
        data: the samples.
        seq_len: maximum sequence length in tokens (longer texts are truncated).
    """

    def __init__(self, tokenizer, data: TextClassificationData, seq_len: int):
        enc = tokenizer(data.texts, truncation=True, max_length=seq_len)
        self.keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        self.encoded = {k: enc[k] for k in self.keys}
        self.labels = list(data.labels)
        self.pad_id = tokenizer.pad_token_id or 0
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.labels)

    def collate(self, indices: Sequence[int], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        """Batch of the given samples on the CPU.

        Returns:
            ``input_ids``, ``attention_mask`` (and ``token_type_ids``): int64 ``[B, T]`` with
            ``T`` the longest sequence among them rounded up to a multiple of 8 (at most
            ``seq_len``), or ``pad_to``; ``labels``: int64 ``[B]``.
        """
        longest = max(len(self.encoded["input_ids"][i]) for i in indices)
        # Round up to a multiple of 8 (at most seq_len): fewer distinct shapes fragment the
        # caching allocator less, and tensor cores prefer multiples of 8.
        length = pad_to or min(self.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        batch = {}
        for k in self.keys:
            fill = self.pad_id if k == "input_ids" else 0
            rows = [self.encoded[k][i][:length] for i in indices]
            batch[k] = torch.tensor([r + [fill] * (length - len(r)) for r in rows], dtype=torch.long)
        batch["labels"] = torch.tensor([self.labels[i] for i in indices], dtype=torch.long)
        return batch

    def worst_case(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` samples padded to the full ``seq_len``: the largest batch of ``n`` the data can make
        (used by the memory probe so that a plan that fits it fits every real batch)."""
        idx = [i % len(self) for i in range(n)]
        return self.collate(idx, pad_to=self.seq_len)


def count_samples(batch: dict[str, torch.Tensor]) -> int:
    """Samples the classification loss sums over (one per label)."""
    return int(batch["labels"].numel())


def classification_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed (not averaged) cross-entropy over the batch, as a 0-d fp32 tensor, so that dividing
    by the window's sample count gives the mean over the whole accumulation window."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    return F.cross_entropy(logits.float(), batch["labels"], reduction="sum")


@dataclass
class Workload:
    """What to train.

    Attributes:
        model: the ``nn.Module`` (on the CPU until the runtime moves it).
        train: training samples (``collate``, ``worst_case``, ``len``).
        eval: held-out samples, or None.
        effective_batch: samples per optimizer step.
        loss_sum: ``(model, batch) -> 0-d tensor``, the loss summed over what ``count`` counts.
        count: ``batch -> int``, samples (or tokens) in a batch that the loss sums over.
    """

    model: torch.nn.Module
    train: TextBatches
    eval: TextBatches | None
    effective_batch: int
    loss_sum: object = classification_loss_sum
    count: object = count_samples


def count_target_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens a causal-LM loss sums over: next-token targets that are not padding (-100)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def causal_lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over non-padding targets (``labels`` ``[B, T]``, -100 at
    padding), as a 0-d fp32 tensor: divided by the window's :func:`count_target_tokens`, the
    accumulated gradient is that of the token-level mean over the whole window."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")
