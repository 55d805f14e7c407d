"""Compile at planning time what the run would otherwise compile during its first steps.

Text batches are padded to their longest sample (a multiple of 8), so a run meets many sequence
lengths, while the planner's probes all run the worst case (the full ``seq_len``). Under
``torch.compile`` the first new length recompiles with the sequence dimension dynamic
(TorchInductor's "automatic dynamic shapes": a dimension seen with two sizes is compiled for
any size), which took seconds inside the run's first steps and left the plan's timing measured
on the static graph. One warm-up step at another length here makes that recompilation happen
while planning, and the retiming that follows times the dynamic graph that the run will use
(TorchDynamo tries the newest compiled entry first).

A run also meets two kinds of batch at every length: with padding, and without (every sample as
long as the batch). Hugging Face models with SDPA attention drop an all-ones mask (the block
gets ``attention_mask=None``, so that SDPA may use its flash kernel) and give the blocks a mask
tensor otherwise: two compiled graphs (one for the encoders that tightfit hands a 4-D mask,
:mod:`tightfit.masks`, whose blocks always get a mask tensor). The warm-up steps one batch of each kind, with the
length dimension marked dynamic (:func:`~tightfit.levers.compile.length_dynamic`), so that each
kind is compiled once for every length; the planner's first compiled probes already mark the
full length dynamic (:func:`any_length`), so the kind they meet is not compiled twice.
See https://pytorch.org/docs/stable/torch.compiler_dynamic_shapes.html.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import replace

import torch

from ..levers.checkpointing import set_activation_checkpointing
from ..levers.compile import length_dynamic
from ..masks import takes_prepared_mask
from ..workload import PAD_MULTIPLE, Workload
from .probe import probe_step


class _AtLength:
    """The training data's batches padded to ``length`` tokens (the probe's ``worst_case``).
    ``padded``: True gives the first sample a padding position at the end (``attention_mask``
    ``[B, T]`` 0 there), False makes the mask all ones (no padding), None leaves the batch as
    the data collates it."""

    def __init__(self, data, length: int, padded: bool | None = None):
        self.data, self.length, self.padded = data, length, padded

    def __len__(self) -> int:
        return len(self.data)

    def collate(self, indices, pad_to=None):
        batch = self.data.collate(indices, pad_to=self.length)
        mask = batch.get("attention_mask")
        if self.padded is None or not torch.is_tensor(mask) or mask.dim() != 2:
            return batch
        mask = mask.clone()
        if self.padded:
            mask[0, -1] = 0
        else:
            mask.fill_(1)
        return {**batch, "attention_mask": mask}

    def worst_case(self, n: int):
        return self.collate([i % len(self.data) for i in range(n)])


def other_length(data) -> int | None:
    """A second sequence length for ``data`` (tokens): half its ``seq_len``, a multiple of
    :data:`~tightfit.workload.PAD_MULTIPLE`; None for data of fixed-size samples (images) or
    too short to have another length."""
    seq_len = getattr(data, "seq_len", None)
    collate = getattr(data, "collate", None)
    if not isinstance(seq_len, int) or collate is None or "pad_to" not in inspect.signature(collate).parameters:
        return None
    length = (seq_len // 2) // PAD_MULTIPLE * PAD_MULTIPLE
    return length if 2 <= length < seq_len else None


def pads_to_multiple(data, samples: int = 32) -> bool:
    """Whether ``data``'s own collate pads every batch to a multiple of
    :data:`~tightfit.workload.PAD_MULTIPLE` tokens (tightfit's text data does), judged from up
    to ``samples`` samples collated one at a time. TorchInductor guards some kernels on that
    alignment (a length not a multiple of 8 compiles a second graph), so data of other lengths
    needs a second warm-up length."""
    n = len(data)
    for i in sorted({k * n // samples for k in range(min(samples, n))}):
        ids = data.collate([i]).get("input_ids")
        if torch.is_tensor(ids) and ids.dim() == 2 and ids.shape[1] % PAD_MULTIPLE:
            return False
    return True


def any_length(data):
    """A context in which compiled calls mark the full sequence length of text data of several
    lengths (:func:`other_length`) dynamic (:func:`~tightfit.levers.compile.length_dynamic`), so
    that the planner's first compiled probes compile the graph that serves every length, not one
    for the full length alone that the warm-up would then compile again (a block compiles in
    seconds). Does nothing for other data."""
    length = data.seq_len if other_length(data) is not None else None
    return length_dynamic(length) if length else contextlib.nullcontext()


def mask_kinds(data, model: torch.nn.Module) -> tuple:
    """The kinds of batch :func:`warm_other_lengths` steps (``_AtLength``'s ``padded``): with
    and without padding for data whose batches hold a 2-D ``attention_mask``, else one as is.
    An encoder handed its mask in 4-D (:func:`~tightfit.masks.takes_prepared_mask`) gets a mask
    tensor either way: one padded batch compiles its one graph."""
    mask = data.worst_case(1).get("attention_mask")
    if not (torch.is_tensor(mask) and mask.dim() == 2):
        return (None,)
    return (True,) if takes_prepared_mask(model) else (True, False)


def warm_other_lengths(workload: Workload, micro_batch: int, blocks: tuple, precision: str,
                       budget_bytes: int, optimizer: str = "adamw") -> list[str]:
    """Run training steps (:func:`~tightfit.planner.probe.probe_step`, lr 0: weights
    unchanged) of the compiled model at :func:`other_length`, one per :func:`mask_kinds` (with
    and without padding), the length dimension marked dynamic, with ``blocks`` checkpointed and
    the plan's ``optimizer`` (its state is part of the step's memory).

    Returns:
        The reason line saying so and how long it took (none for data of one length).

    Raises:
        Any non-OOM error of the step (a compiler error), unchanged.
    """
    length = other_length(workload.train)
    if length is None:
        return []
    t0 = time.perf_counter()
    set_activation_checkpointing(workload.model, bool(blocks), blocks)
    kinds = mask_kinds(workload.train, workload.model)
    # data not padded to a multiple of 8 also meets the graph for unaligned lengths (one more)
    lengths = (length,) if pads_to_multiple(workload.train) else (length, length + 1)
    for at in lengths:
        with length_dynamic(at):
            for padded in kinds:
                probe_step(replace(workload, train=_AtLength(workload.train, at, padded)), micro_batch, precision,
                           budget_bytes, timed_steps=1, optimizer=optimizer)
    shown = " and ".join(str(at) for at in lengths)
    return [f"compiled for any sequence length at planning time: {len(kinds) * len(lengths)} warm-up step(s) at "
            f"{shown} tokens{', with and without padding' if len(kinds) > 1 else ''}"
            f"{' (the data is not padded to a multiple of 8)' if len(lengths) > 1 else ''} "
            f"({time.perf_counter() - t0:.1f} s), so the run does not recompile"]


def warm_compiled_plan(workload: Workload, plan, budget_bytes: int) -> float:
    """Compile ``plan``'s model before training (a plan taken from the cache, whose planning
    compiled nothing in this process): one probe step at the worst case and one at
    :func:`other_length`, at the plan's micro-batch and checkpointed blocks. TorchInductor's
    own on-disk caches make this faster than the first compilation. Leaves the model compiled
    and no block checkpointed (the trainer applies the plan).

    Returns:
        Seconds spent (0.0 when the plan does not compile).
    """
    from ..levers.compile import compile_model

    if not plan.compile:
        return 0.0
    t0 = time.perf_counter()
    model = workload.model
    blocks = plan.checkpointed_blocks(_n_blocks(model))
    compile_model(model, plan.compile_scope)
    warm_compiled(workload, plan.micro_batch, blocks, plan.precision, budget_bytes, plan.optimizer)
    set_activation_checkpointing(model, False, ())
    return time.perf_counter() - t0


def warm_compiled(workload: Workload, micro_batch: int, blocks: tuple, precision: str, budget_bytes: int,
                  optimizer: str) -> None:
    """Run the compiled model's steps once at the worst case and at :func:`other_length`
    (:func:`warm_other_lengths`), ``blocks`` checkpointed (left so): what compiles, and what is
    recorded as CUDA graphs, does so now rather than in the run's first steps."""
    set_activation_checkpointing(workload.model, bool(blocks), blocks)
    with any_length(workload.train):
        probe_step(workload, micro_batch, precision, budget_bytes, timed_steps=1, optimizer=optimizer)
    warm_other_lengths(workload, micro_batch, blocks, precision, budget_bytes, optimizer)


def _n_blocks(model) -> int:
    from ..levers.blocks import find_blocks

    return len(find_blocks(model))
