"""The Plan: an immutable, JSON-serialisable record of how a training step is run.

The planner makes it, the runtime applies it, the report shows it. Fields use the field's
terms: micro-batch x gradient accumulation steps (x world size) = effective batch.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from .errors import TightfitError

PRECISIONS = ("fp32", "fp16", "bf16")
# What ``--optimizer`` may ask for: the planner's choice, fused AdamW, or an optimizer lever
# (tightfit.levers.optimizers: bitsandbytes' 8-bit AdamW, torchao's AdamW offloaded to the CPU,
# bf16 weights with torchao's 8-bit AdamW rounding them stochastically).
OPTIMIZER_CHOICES = ("auto", "adamw", "adamw8bit", "adamw-offload", "adamw8bit-bf16")
SHARDINGS = ("none", "ddp", "fsdp", "fsdp-offload")
# Plan.compile_scope: blocks one by one where identical (None), the whole model ("model"), the
# whole model replayed as CUDA graphs ("model-graphs"); tightfit.levers.compile applies them
COMPILE_SCOPES = (None, "model", "model-graphs")
# The largest batch, micro or effective (samples): no data set fills a larger one, and far above it
# the tracer's and torch's size arithmetic overflows (--batch-size 10**30 died in a TypeError deep
# in the search, --micro-batch 10**15 in "Storage size calculation overflowed").
MAX_BATCH = 2**31 - 1


def refuse_parameter_offload(plan, where: str) -> None:
    """Refuse a parameter-offload plan (``sharding="fsdp-offload"``) in ``where``, a loop that is
    not tightfit's runtime (the HF Trainer, Lightning, :class:`tightfit.TrainStep`): only
    ``tightfit train`` wraps the model in FSDP2 with its shards in host memory.

    Raises:
        TightfitError: one line naming ``where``.
    """
    if getattr(plan, "sharding", "none") == "fsdp-offload":
        raise TightfitError(f"{where} does not offload parameters: a plan with sharding 'fsdp-offload' runs "
                            "through tightfit train (or tightfit.api.train), which wraps the model in FSDP2")


def rank_batch(effective_batch: int, world_size: int) -> int:
    """Samples of one window that each of ``world_size`` processes trains on:
    ``ceil(effective_batch / world_size)`` (the ranks' shares differ by at most one sample)."""
    return -(-effective_batch // world_size)


def accumulation_steps(effective_batch: int, micro_batch: int) -> int:
    """Micro-batches per optimizer step: ``ceil(effective_batch / micro_batch)`` (the last one
    holds the rest). Both in samples, >= 1. The one place this formula is written; it also gives
    the micro-batch of a number of steps (:func:`micro_batch_for`)."""
    return -(-effective_batch // micro_batch)


def micro_batch_for(effective_batch: int, steps: int) -> int:
    """The smallest micro-batch (samples) that covers ``effective_batch`` samples in ``steps``
    micro-batches: ``ceil(effective_batch / steps)``, so the windows are as even as they can be."""
    return accumulation_steps(effective_batch, steps)


def balanced_micro_batch(effective_batch: int, micro_batch: int) -> int:
    """The smallest micro-batch with as many accumulation steps as ``micro_batch``: e.g. 32
    samples with at most 20 per pass -> 2 passes of 16 rather than 20 + 12 (same passes, lower
    peak). Samples in, samples out."""
    return micro_batch_for(effective_batch, accumulation_steps(effective_batch, micro_batch))


def _leaves_one(micro_batch: int, sizes: Sequence[int], world_size: int = 1) -> bool:
    """Whether splitting windows of ``sizes`` samples into micro-batches of ``micro_batch`` (the
    last one short) gives some micro-batch a single sample (every one, at micro-batch 1). On
    ``world_size`` ranks each window is shared out first (shares differing by one sample), and a
    rank with fewer micro-batches than another runs padding micro-batches of one sample."""
    if micro_batch == 1:
        return True
    for s in sizes:
        q, r = divmod(s, world_size)
        shares = {q, q + 1} if r else {q}
        if any(x > micro_batch and x % micro_batch == 1 for x in shares):
            return True
        if len({-(-x // micro_batch) for x in shares}) > 1:  # padded with micro-batches of 1
            return True
    return False


def halved_micro_batch(size: int, micro_batch: int, no_single: bool = False, others: Sequence[int] = (),
                       world_size: int = 1) -> int:
    """The micro-batch an out-of-memory redo of a window of ``size`` samples takes: at most half
    of ``micro_batch``, and of the pass that ran out of memory (a window shorter than the
    micro-batch ran as one pass of ``size``: 3 samples at micro-batch 8 are redone as 2 + 1, not
    as the same pass of 3), balanced (:func:`balanced_micro_batch`: 45 samples at half of 23 run
    as 9 x 5, not 11 + 11 + 11 + 11 + 1). With ``no_single`` (a model whose BatchNorm cannot train
    on one sample), a size whose split leaves no micro-batch of 1 in this window nor in ``others``,
    the sizes of the run's other windows, which the micro-batch splits from then on too (an
    epoch's short last window, or its full ones): the largest up to half, else the smallest above
    half that is still smaller than the failed pass (7 samples: 4 + 3, where 3 and 2 leave one);
    where none serves them all, the same for this window alone. On ``world_size`` ranks the pass
    halved is that of the largest share of the window (every rank takes the same micro-batch),
    and "no micro-batch of 1" counts every rank's share and padding (:func:`_leaves_one`).
    Where every smaller split leaves one, the halved size (a BatchNorm that normalises over a
    feature map trains on one sample). Samples in, samples out.
    """
    share = -(-size // world_size)  # the largest share: its pass is the one halved
    # half of the pass that failed, rounded up (21 samples at micro-batch 22: 11 + 10)
    new = balanced_micro_batch(share, max(1, min(micro_batch // 2, -(-share // 2))))
    if not no_single or not _leaves_one(new, (size, *others), world_size):
        return new
    smaller = range(new - 1, 1, -1)
    larger = range(new + 1, min(micro_batch, share))  # still a smaller pass than the one that failed
    for sizes in ((size, *others), (size,)):  # every window of the run, else this one
        found = next((m for m in (new, *smaller, *larger) if not _leaves_one(m, sizes, world_size)), None)
        if found is not None:
            return found
    return new  # every smaller split leaves one: the halving stands (BatchNorm over 7 x 7 values trains on one)


def grown_micro_batch(micro_batch: int, planned: int, no_single: bool = False, sizes: Sequence[int] = (),
                      world_size: int = 1) -> int:
    """The micro-batch to grow back to after clean steps since an out-of-memory redo: twice
    ``micro_batch``, at most the ``planned`` one; with ``no_single`` (BatchNorm), the largest up
    to that whose split of windows of ``sizes`` samples (over ``world_size`` ranks,
    :func:`_leaves_one`) leaves no micro-batch of 1 (7 samples at 3 grow to 5, not 6 + 1), or
    ``micro_batch`` itself where none does, unless ``micro_batch`` leaves one already (then twice
    it). The ``planned`` micro-batch is always taken (the plan was checked against BatchNorm: one
    that normalises over a feature map trains on one sample). Samples in, samples out."""
    new = min(planned, micro_batch * 2)
    if no_single and new != planned:
        fits = next((m for m in range(new, micro_batch, -1) if not _leaves_one(m, sizes, world_size)), None)
        new = fits if fits is not None else new if _leaves_one(micro_batch, sizes, world_size) else micro_batch
    return new


@dataclass(frozen=True)
class Plan:
    """How one training step runs.

    Attributes:
        precision: ``"fp32"``, ``"fp16"`` (autocast + dynamic loss scaling) or ``"bf16"``
            (autocast); the weights stay fp32 in all three, except under ``adamw8bit-bf16``
            (bf16 weights, bf16 only).
        micro_batch: samples per forward/backward pass; one above a process's share of the
            effective batch (:attr:`rank_batch`) is lowered to it, since one micro-batch then
            covers the whole window.
        effective_batch: samples per optimizer step (the whole accumulation window).
        activation_checkpointing: recompute each transformer block's activations in backward.
        optimizer: the optimizer, one of :data:`tightfit.step.OPTIMIZERS`: ``"adamw"`` (fused),
            ``"adamw8bit"`` (8-bit state), ``"adamw-offload"`` (state on the CPU) or
            ``"adamw8bit-bf16"`` (bf16 weights, 8-bit state) for training.
        device: ``"cuda"`` or ``"cpu"``.
        budget_bytes: memory the step may use on the GPU (None on the CPU / no limit).
        reasons: one line per choice, saying why it was made.
        probe_peak_reserved_bytes: peak reserved memory measured by the probe step (None if
            no probe ran).
        checkpoint_blocks: indices of the repeated blocks to checkpoint when
            ``activation_checkpointing`` is on (None: all of them).
        predicted_peak_reserved_bytes, predicted_samples_per_s: the planner's predictions.
        compile: run the model's forward (and its backward) compiled by ``torch.compile``
            (:mod:`tightfit.levers.compile`); CUDA only.
        compile_scope: with ``compile``, ``"model"`` compiles the whole model as one graph
            (:data:`tightfit.levers.compile.WHOLE_MODEL`); ``"model-graphs"`` compiles it whole and
            replays it as CUDA graphs (:data:`tightfit.levers.compile.GRAPHED`; no recomputation);
            None: repeated blocks one by one where they are identical
            (:func:`tightfit.levers.compile.compile_scope`).
        block_policies: what each repeated block keeps for backward, one of ``none``,
            ``selective`` (recompute only the cheap ops), ``full`` (recompute the block) or
            ``offload`` (saved tensors in pinned host memory) per block
            (:data:`tightfit.levers.blocks.BLOCK_POLICIES`); None: ``activation_checkpointing``
            and ``checkpoint_blocks`` say which blocks recompute fully (plans written before
            per-block choices existed).
        world_size: processes (GPUs) training together under torchrun; each runs
            ``micro_batch`` samples per pass, so micro-batch x accumulation steps x world size
            = effective batch (:func:`rank_batch`).
        sharding: ``"none"`` (one process), ``"ddp"`` (replicated state, gradients all-reduced) or
            ``"fsdp"`` (parameters, gradients and optimizer state sharded by FSDP2) or
            ``"fsdp-offload"`` (FSDP2 with its shards in host memory, on one process or several:
            parameter offload); see :mod:`tightfit.planner.sharding`.
        trainable: what is trained: ``"all"`` parameters, ``"lora"`` adapters and the head, or all
            but frozen layers (``"frozen-embeddings"``, ``"frozen-N"``; :mod:`tightfit.levers.trainable`).
        trainable_params: parameters the optimizer updates (None: not counted).

    Raises:
        TightfitError: (at construction, one line) a field of the wrong kind or value: an unknown
            precision, device, optimizer, trainable or sharding; a batch size or world size that is
            not a whole number >= 1, a batch size above :data:`MAX_BATCH`; block indices or policies that are not a tuple of them.
    """

    precision: str
    micro_batch: int
    effective_batch: int
    activation_checkpointing: bool = False
    optimizer: str = "adamw"
    device: str = "cpu"
    budget_bytes: int | None = None
    reasons: tuple[str, ...] = field(default_factory=tuple)
    probe_peak_reserved_bytes: int | None = None
    checkpoint_blocks: tuple[int, ...] | None = None
    predicted_peak_reserved_bytes: int | None = None
    predicted_samples_per_s: float | None = None
    compile: bool = False
    block_policies: tuple[str, ...] | None = None
    world_size: int = 1
    sharding: str = "none"
    trainable: str = "all"
    trainable_params: int | None = None
    compile_scope: str | None = None

    def __post_init__(self):
        self._check_kinds()
        if self.precision not in PRECISIONS:
            raise TightfitError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISIONS)}")
        if self.micro_batch < 1 or self.effective_batch < 1:
            raise TightfitError("micro-batch and effective batch must be >= 1")
        if max(self.micro_batch, self.effective_batch) > MAX_BATCH:
            raise TightfitError(f"micro-batch and effective batch must be at most {MAX_BATCH} (2**31 - 1) samples")
        if self.world_size < 1 or self.sharding not in SHARDINGS:
            raise TightfitError(f"world size must be >= 1 and sharding one of {', '.join(SHARDINGS)}")
        if self.compile_scope not in COMPILE_SCOPES:
            raise TightfitError(f"unknown compile scope {self.compile_scope!r}; use \"model\", "
                                f"\"model-graphs\" or none")
        if self.compile_scope == "model-graphs":
            self._check_graphed()
        from .levers.optimizers import check_precision

        check_precision(self.optimizer, self.precision)  # bf16 weights: bf16 autocast only
        if self.checkpoint_blocks and not self.activation_checkpointing:  # the runtime would checkpoint none
            raise TightfitError(f"Plan: checkpoint_blocks {self.checkpoint_blocks} with activation_checkpointing "
                                "False: set activation_checkpointing=True to checkpoint them, or give no blocks")
        if self.micro_batch > self.rank_batch:
            object.__setattr__(self, "micro_batch", self.rank_batch)

    def _check_graphed(self) -> None:
        """compile_scope ``"model-graphs"``: a step that recomputes nothing, in one process."""
        if self.activation_checkpointing or any(p != "none" for p in self.block_policies or ()):
            raise TightfitError("Plan: compile_scope \"model-graphs\" (CUDA graphs) is for steps that recompute "
                                "nothing; give no checkpointing or block policies")
        if self.world_size > 1 or self.sharding != "none":
            raise TightfitError("Plan: compile_scope \"model-graphs\" (CUDA graphs) is for one process without "
                                "sharding; give compile_scope \"model\" for several")

    def _check_kinds(self) -> None:
        """Refuse fields of the wrong kind (a hand-made plan, or a plan.json edited by hand), one
        line naming the field; whole numbers of another integer type (numpy's) become ints."""
        from .levers.blocks import BLOCK_POLICIES
        from .step import OPTIMIZERS

        def bad(name: str, want: str):
            return TightfitError(f"Plan: {name} {getattr(self, name)!r} is not {want}")

        for name in ("micro_batch", "effective_batch", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                raise bad(name, "a whole number")
            object.__setattr__(self, name, operator.index(value))
        for name in ("activation_checkpointing", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "True or False")
        choices = {"device": ("cpu", "cuda"), "optimizer": OPTIMIZERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise bad(name, "one of " + ", ".join(allowed))
        from .levers.trainable import VALUES, trainable_rule

        if trainable_rule(self.trainable):
            raise bad("trainable", VALUES)
        blocks = self.checkpoint_blocks
        if blocks is not None and not (isinstance(blocks, tuple) and all(
                not isinstance(b, bool) and isinstance(b, int) and b >= 0 for b in blocks)
                and len(set(blocks)) == len(blocks)):
            raise bad("checkpoint_blocks", "a tuple of distinct block indices (whole numbers >= 0)")
        if not (isinstance(self.reasons, tuple) and all(isinstance(r, str) for r in self.reasons)):
            raise bad("reasons", "a tuple of lines (strings)")
        for name, least in (("budget_bytes", 1), ("probe_peak_reserved_bytes", 0),
                            ("predicted_peak_reserved_bytes", 0), ("trainable_params", 0)):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not hasattr(value, "__index__") or operator.index(value) < least:
                raise bad(name, f"None or a whole number >= {least}")
            object.__setattr__(self, name, operator.index(value))
        speed = self.predicted_samples_per_s
        if speed is not None:
            if isinstance(speed, bool) or not isinstance(speed, numbers.Real) or not math.isfinite(speed) or speed < 0:
                raise bad("predicted_samples_per_s", "None or a number >= 0")
            object.__setattr__(self, "predicted_samples_per_s", float(speed))
        policies = self.block_policies
        if policies is not None and not (isinstance(policies, tuple) and all(p in BLOCK_POLICIES for p in policies)):
            raise bad("block_policies", "a tuple of " + "|".join(BLOCK_POLICIES) + ", one per block")

    @property
    def rank_batch(self) -> int:
        """Samples of a full window that one process trains on: ``ceil(effective_batch / world_size)``."""
        return rank_batch(self.effective_batch, self.world_size)

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per full window on each process: ``ceil(rank_batch / micro_batch)``."""
        return accumulation_steps(self.rank_batch, self.micro_batch)

    def checkpointed_blocks(self, n_blocks: int) -> tuple[int, ...]:
        """The indices of the blocks the plan checkpoints, of the model's ``n_blocks`` repeated
        blocks (``checkpoint_blocks`` None with checkpointing on: every block)."""
        if self.checkpoint_blocks is not None:
            return tuple(self.checkpoint_blocks)
        return tuple(range(n_blocks)) if self.activation_checkpointing else ()

    def with_micro_batch(self, micro_batch: int, reason: str | None = None) -> "Plan":
        """A copy with another micro-batch (the effective batch is unchanged)."""
        reasons = self.reasons + ((reason,) if reason else ())
        return replace(self, micro_batch=micro_batch, reasons=reasons)

    def to_dict(self) -> dict:
        """JSON-ready dict; includes the derived ``accumulation_steps`` for readers."""
        d = asdict(self)
        d["reasons"] = list(self.reasons)
        if self.checkpoint_blocks is not None:
            d["checkpoint_blocks"] = list(self.checkpoint_blocks)
        if self.block_policies is not None:
            d["block_policies"] = list(self.block_policies)
        d["accumulation_steps"] = self.accumulation_steps
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Inverse of :meth:`to_dict` (derived keys are ignored).

        Raises:
            TightfitError: on missing or unknown keys.
        """
        if not isinstance(d, dict):
            raise TightfitError(f"malformed plan: expected a JSON object, got {type(d).__name__}")
        d = {k: v for k, v in d.items() if k != "accumulation_steps"}
        for name in ("reasons", "checkpoint_blocks", "block_policies"):  # JSON lists, read as tuples
            value = d.get(name, () if name == "reasons" else None)
            if value is not None and not isinstance(value, (list, tuple)):  # a string would split into letters
                raise TightfitError(f"malformed plan: {name} {value!r} is not a list")
            if value is not None:
                d[name] = tuple(value)
        try:
            return cls(**d)
        except TypeError as e:
            raise TightfitError(f"malformed plan: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise TightfitError(f"malformed plan JSON: {e}") from None


def without_free_blocks(plan: Plan, free: int, n_blocks: int) -> Plan:
    """``plan`` without checkpointing its first ``free`` blocks, which keep no activations for
    backward (frozen, nothing trained before them: checkpointing them recomputes and saves
    nothing); unchanged for a whole-model compiled plan (its graph checkpoints every block) or a
    plan of per-block policies."""
    if not free or not plan.activation_checkpointing or plan.compile_scope or plan.block_policies:
        return plan
    kept = tuple(i for i in plan.checkpointed_blocks(n_blocks) if i >= free)
    return replace(plan, activation_checkpointing=bool(kept),
                   checkpoint_blocks=kept if 0 < len(kept) < n_blocks else None)


def plan_with_blocks(precision: str, micro_batch: int, effective_batch: int, blocks: Sequence[int], n_blocks: int,
                     **fields) -> Plan:
    """The plan that checkpoints ``blocks`` (indices) of the model's ``n_blocks`` repeated blocks:
    checkpointing on if any block is, ``checkpoint_blocks`` None when all (or none) are -- the
    Plan's way of saying "every block". ``fields``: the other :class:`Plan` fields, by name; with
    ``block_policies`` the blocks that recompute (full or selective) are taken from them.

    Raises:
        TightfitError: as :class:`Plan` (unknown precision, a batch size below 1).
    """
    policies = fields.get("block_policies")
    if policies is not None:  # the blocks that recompute, fully or selectively
        blocks = tuple(i for i, p in enumerate(policies) if p in ("full", "selective"))
    partial = 0 < len(blocks) < n_blocks
    return Plan(precision, micro_batch, effective_batch, bool(blocks),
                checkpoint_blocks=tuple(blocks) if partial else None, **fields)
