"""The benchmark's workloads: an architecture of the model registry (:mod:`tightfit.models`), its
input size, the emulated card's budget and the effective batch every setting trains with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import TightfitError
from ..levers.layout import use_channels_last
from ..models import build_model
from ..units import parse_size
from ..workload import Workload


@dataclass(frozen=True)
class BenchWorkload:
    """One benchmark workload.

    Attributes:
        name: ``<arch>-<size>@<budget>``.
        arch: a name of the model registry (:data:`tightfit.models.REGISTRY`).
        size: sequence length (text) or image side in pixels.
        budget: memory budget, e.g. ``"4GiB"`` (bytes from :attr:`budget_bytes`).
        effective_batch: samples per optimizer step for tightfit and the no-budget reference.
    """

    name: str
    arch: str
    size: int
    budget: str
    effective_batch: int

    @property
    def budget_bytes(self) -> int:
        return parse_size(self.budget)


WORKLOADS = {w.name: w for w in (
    BenchWorkload("bert-base-128@4GiB", "bert-base", 128, "4GiB", 256),
    BenchWorkload("bert-base-128@11GiB", "bert-base", 128, "11GiB", 256),
    BenchWorkload("bert-base-512@11GiB", "bert-base", 512, "11GiB", 64),
    BenchWorkload("bert-large-128@11GiB", "bert-large", 128, "11GiB", 128),
    BenchWorkload("vit-b16-224@10GiB", "vit-b16", 224, "10GiB", 128),
    BenchWorkload("resnet50-224@4GiB", "resnet50", 224, "4GiB", 256),
    BenchWorkload("minilm-32@smoke", "minilm", 32, "1GiB", 8),  # a CPU smoke test of the harness
)}


def get_workload(name: str) -> BenchWorkload:
    """The workload called ``name``.

    Raises:
        TightfitError: unknown name (the message lists the known ones).
    """
    if name not in WORKLOADS:
        raise TightfitError(f"unknown benchmark workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


class ZooSamples:
    """Random samples of an architecture's input, with the interface of
    :class:`tightfit.workload.TextBatches` (``collate``, ``worst_case``, ``len``) and of a
    map-style dataset (``[i]``: one sample's dict, for the HF Trainer).

    ``pool`` distinct samples are drawn once on the CPU (seed 0); sample ``i`` is sample
    ``i % pool`` of the pool, so ``n`` can be large without holding ``n`` images. Every text
    sample is at the full sequence length (the worst case).
    """

    def __init__(self, make_batch, size: int, n: int, pool: int = 512):
        torch.manual_seed(0)
        self.batch = make_batch(min(n, pool), size, device="cpu")
        self.pool, self.n = min(n, pool), n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {k: v[i % self.pool] for k, v in self.batch.items()}

    def collate(self, indices, pad_to=None) -> dict:
        idx = torch.tensor([i % self.pool for i in indices])
        return {k: v[idx] for k, v in self.batch.items()}

    def worst_case(self, n: int) -> dict:
        return self.collate(range(n))


def make_workload(w: BenchWorkload, effective_batch: int, samples: int, device: str = "cuda") -> Workload:
    """A fresh model (seed 0, fp32 weights on ``device``) with ``samples`` random samples, trained
    with the registry's task for the architecture (e.g. token-level loss for a causal LM)."""
    torch.manual_seed(0)
    model, make_batch = build_model(w.arch, device="cpu")
    model.to(device)
    use_channels_last(model, device)  # as tightfit train does: every setting in the layout it trains in
    return Workload(model, ZooSamples(make_batch, w.size, samples), None, effective_batch,
                    task=make_batch.task)
