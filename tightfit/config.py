"""The options of ``tightfit train``, defined once: a tree of frozen dataclasses.

Each option is a dataclass field made by :func:`option`: its default, its help text and its
checks live there and nowhere else. From the tree come

- the ``tightfit train`` argument parser (:func:`add_train_arguments`: flag, type, default and
  help of every option, grouped as the tree is),
- the Python API's request (:class:`TrainRequest`, built from flat keywords such as
  ``TrainRequest(model=..., batch_size=16, lr=1e-4)``),
- ``request.json`` (:meth:`TrainRequest.to_flat`, the flat ``{option: value}`` dict that
  ``--resume`` reads back),
- the runtime's settings (``tightfit.runtime.trainer.TrainConfig`` extends :class:`TrainOptions`).

Every group checks its values in ``__post_init__`` (like :class:`tightfit.plan.Plan`) and raises
:class:`TightfitError` with a one-line message naming the option (:func:`option_name`: its flag,
``--batch-size``, on the command line; its keyword, ``batch_size``, from the Python API), so a bad
value is refused when the request is made, before anything is loaded or written.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import os
import typing
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

from .errors import TightfitError
from .plan import MAX_BATCH, OPTIMIZER_CHOICES, PRECISIONS


def option(default: Any = MISSING, help: str = "", *, key: str | None = None, flag: str | None = None,
           metavar: str | None = None, minimum: float | None = None, below: str = "",
           choices: tuple[str, ...] | None = None, rule: Any = None, cli: bool = True,
           default_factory: Any = MISSING) -> Any:
    """A dataclass field that is an option.

    Args:
        default: the option's default (the one place it is written).
        help: the ``--help`` text; ``{default}`` in it is replaced by the default as shown.
        key: the option's flat name (TrainRequest keyword, ``request.json`` key, ``--flag``)
            when it differs from the field's name.
        flag: the command-line flag when it is not ``--`` + the key with dashes.
        metavar: the name of the value in ``--help``.
        minimum: the smallest value allowed (None values pass: "not given").
        below: appended to the message of a value below ``minimum``.
        choices: the values allowed; the message lists them.
        rule: ``value -> None`` (a good value) or the rest of the message after the option's
            name (``"must be positive and finite, not -1"``); called for numbers only (None passes).
        cli: False for options the Python API takes but the command line does not.
        default_factory: instead of ``default``, for computed defaults.

    Returns:
        A :func:`dataclasses.field` carrying this in its metadata.
    """
    meta = {"help": help, "key": key, "flag": flag, "metavar": metavar, "minimum": minimum, "below": below,
            "choices": choices, "rule": rule, "cli": cli}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_key(f: Field) -> str:
    """The flat name of option field ``f``: its TrainRequest keyword and ``request.json`` key."""
    return f.metadata.get("key") or f.name


def option_flag(f: Field) -> str:
    """The command-line flag of option field ``f``, e.g. ``--batch-size``; the field's name for
    options the command line does not take (used in messages)."""
    if not f.metadata.get("cli", True):
        return f.name
    return f.metadata.get("flag") or "--" + option_key(f).replace("_", "-")


# Which names the checks' messages use: the command line's flags (--batch-size) while cli_names()
# is in force (the tightfit command, TrainRequest.from_args), else the Python API's keywords
# (batch_size): each user is told the name they typed. A context variable, not an argument,
# because the checks run deep inside dataclass construction and the run (the data's columns).
_CLI_NAMES: contextvars.ContextVar[bool] = contextvars.ContextVar("tightfit_cli_names", default=False)


@contextlib.contextmanager
def cli_names():
    """Within this block, option checks name the command line's flags (``--batch-size``) rather
    than the Python API's keywords (``batch_size``). Entered by :func:`tightfit.cli.main` and
    :meth:`TrainRequest.from_args`."""
    token = _CLI_NAMES.set(True)
    try:
        yield
    finally:
        _CLI_NAMES.reset(token)


def option_name(f: Field | str) -> str:
    """How a message names option ``f`` (its field, or its flat name such as ``"text_column"``):
    its flag within :func:`cli_names` (``--text-column``), else its keyword (``text_column``).

    Raises:
        KeyError: a flat name that is no option of :class:`TrainRequest`.
    """
    if isinstance(f, str):
        f = _FIELD_OF[f]
    return option_flag(f) if _CLI_NAMES.get() else option_key(f)


def names_flags() -> bool:
    """Whether messages now name the command line's flags (within :func:`cli_names`)."""
    return _CLI_NAMES.get()


def option_given(f: Field | str, value: Any) -> str:
    """An option with the value its user gave, as they would have written it: ``--device cuda``
    within :func:`cli_names`, else ``device='cuda'``."""
    return f"{option_name(f)} {value}" if _CLI_NAMES.get() else f"{option_name(f)}={value!r}"


def option_value(f: Field | str, value: Any) -> str:
    """An option given a value, as its user wrote it: ``--precision 'fp8'`` within
    :func:`cli_names`, else ``precision='fp8'``."""
    return f"{option_name(f)} {value!r}" if _CLI_NAMES.get() else f"{option_name(f)}={value!r}"


def _one_of(choices: tuple[str, ...]) -> str:
    """``"auto, on or off"``."""
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The annotations of dataclass ``cls``, resolved (``int | None``, not the string)."""
    return typing.get_type_hints(cls)


def plain_value(value: Any) -> Any:
    """``value`` as the plain Python type ``request.json`` and the messages take: a path object
    (``os.PathLike``, e.g. ``pathlib.Path``) as its ``str``; a NumPy (or other non-builtin) integer
    as ``int`` and real number as ``float`` (``np.int64(8)`` -> ``8``); ``bool``, ``None`` and
    everything else unchanged (the checks then judge it)."""
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        return path if isinstance(path, str) else value
    if value is None or isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def check_value(f: Field, value: Any, hint: Any = None, called: str | None = None) -> None:
    """Check one option's value against its field's type ``hint`` (numeric options: a whole
    number for ``int``, any real number for ``float``, None only where the hint allows it; a
    switch: True or False), ``choices``, ``minimum`` and ``rule``. Messages name the option as
    :func:`option_name` does, or as ``called`` (a keyword of another function, e.g. ``TrainStep``'s
    ``warn_temp_c``).

    Raises:
        TightfitError: ``--batch-size must be a whole number, not '32' (a str)``,
            ``unknown --precision 'fp8'; use auto, fp32, fp16 or bf16``, ``--batch-size must be >= 1``
            (from the Python API: ``batch_size must be >= 1``, ``unknown precision='fp8'; ...``).
    """
    kinds = typing.get_args(hint) or (hint,)
    name = called or option_name(f)
    if f.metadata and (int in kinds or float in kinds):  # the Python API and request.json are not typed by argparse
        whole = int in kinds
        number = isinstance(value, numbers.Integral if whole else numbers.Real) and not isinstance(value, bool)
        if not number and not (value is None and type(None) in kinds):  # a bool is an int, but True is no size
            shown = "None" if value is None else f"{value!r} (a {type(value).__name__})"
            raise TightfitError(f"{name} must be {'a whole number' if whole else 'a number'}, not {shown}")
    if f.metadata and hint is bool and not isinstance(value, bool):  # TrainRequest(full="no") read as true
        raise TightfitError(f"{name} must be True or False, not {value!r} (a {type(value).__name__})")
    choices, minimum, rule = f.metadata.get("choices"), f.metadata.get("minimum"), f.metadata.get("rule")
    if choices and value not in choices:
        given = f"{called}={value!r}" if called else option_value(f, value)
        raise TightfitError(f"unknown {given}; use {_one_of(choices)}")
    if minimum is not None and value is not None and value < minimum:
        raise TightfitError(f"{name} must be >= {minimum}{f.metadata.get('below', '')}")
    problem = rule(value) if rule is not None and value is not None else None
    if problem:
        raise TightfitError(f"{name} {problem}")


def check_guard_options(max_skipped_steps: Any, warn_temp_c: Any) -> None:
    """Check the guards' two options as ``tightfit train`` checks them (``max_skipped_steps`` a
    whole number >= 1, ``warn_temp_c`` a number), named as the keywords of the callbacks and
    ``TrainStep`` that take them.

    Raises:
        TightfitError: one line naming the keyword.
    """
    check_option(TrainOptions, "max_skipped_steps", max_skipped_steps, called="max_skipped_steps")
    check_option(TrainOptions, "warn_temp_c", warn_temp_c, called="warn_temp_c")


def check_option(group: type, name: str, value: Any, called: str | None = None) -> None:
    """Check ``value`` as option ``name`` of ``group`` (for commands that share an option); messages
    name it ``called`` where given (the keyword of the function that takes it).

    Raises:
        TightfitError: as :func:`check_value`.
    """
    check_value(next(f for f in fields(group) if f.name == name), value, _hints(group)[name], called)


@dataclass(frozen=True)
class _Options:
    """Base of the option groups: makes every field a plain value (:func:`plain_value`) and checks
    it on construction."""

    def __post_init__(self):
        hints = _hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            plain = plain_value(value)
            if plain is not value:
                object.__setattr__(self, f.name, plain)  # frozen: set once, here
            check_value(f, plain, hints[f.name])
        self._check_together()

    def _check_together(self) -> None:
        """Checks that involve several options of the group (none by default)."""

    def _name(self, name: str) -> str:
        """How a message names this group's field ``name`` (:func:`option_name`)."""
        return option_name(next(f for f in fields(self) if f.name == name))


# The largest --image-size: by tightfit's own estimate (`tightfit estimate --model resnet50
# --image-size 4096 --micro-batch 1`) one sample then needs ~27 GiB of activations (1.6 GiB at
# 1024, 62 MiB at 224), and the cost grows with the area; image classifiers train at 224-512 px,
# so a larger side is a typo that would otherwise be found only by the OOM killer mid-run.
MAX_IMAGE_SIZE = 4096
# Seeds torch.manual_seed takes (it reads them as int64 or uint64); NumPy's and Python's take any.
SEED_RANGE = (-2**63, 2**64 - 1)
# The most epochs: each epoch is at least one optimizer step, and a run of a billion steps would
# not end (at a millisecond a step, 11 days); --epochs 1e308 overflowed the step count to inf.
MAX_EPOCHS = 1e9


def _beyond_float(value: float) -> bool:
    """An int too large for a float (``float(10**400)`` raises OverflowError, so the run would die
    at its first use)."""
    if not isinstance(value, numbers.Integral):
        return False
    try:
        float(value)
    except OverflowError:
        return True
    return False


def _finite(value: float) -> bool:
    """Not inf or NaN, and (an int) not beyond the range of a float (``math.isfinite`` overflows
    on ints above 1e308)."""
    return not _beyond_float(value) if isinstance(value, numbers.Integral) else math.isfinite(value)


def _number(value: float) -> str:
    """``value`` for a message: as written, but an int of 20 digits or more as ``about 10**400``
    (not 400 digits on one line), with ``(more than a float holds)`` where it is beyond a float."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or abs(value) < 10**20:
        return str(value)
    shown = f"about {'-' if value < 0 else ''}10**{int(math.log10(abs(value)))}"
    return shown + (" (more than a float holds)" if _beyond_float(value) else "")


def _positive_finite(value: float) -> str | None:
    """``rule`` of a length or rate: > 0 and finite (NaN fails too)."""
    return None if _finite(value) and value > 0 else f"must be positive and finite, not {_number(value)}"


def _epochs(value: float) -> str | None:
    """``rule`` of ``epochs``: positive, finite and at most :data:`MAX_EPOCHS`."""
    if value > MAX_EPOCHS and (_finite(value) or _beyond_float(value)):  # inf and NaN: not positive and finite
        return (f"must be at most {_shown(MAX_EPOCHS)}: each epoch is at least one optimizer step, and a run of "
                f"billions of steps would not end; not {_epochs_shown(value)}")
    return _positive_finite(value)


def _epochs_shown(value: float) -> str:
    """An ``epochs`` above :data:`MAX_EPOCHS` for its message: a float in the fewest digits that
    give it back (``2e+09``, and ``1000000001``, not ``1e+09``, which reads as the limit), an int
    as :func:`_number` shows it (``about 10**400``)."""
    if isinstance(value, float) and math.isfinite(value):
        return next((f"{value:.{digits}g}" for digits in range(6, 18) if float(f"{value:.{digits}g}") == value),
                    repr(value))
    return _number(value).removesuffix(" (more than a float holds)")  # the limit already says why


# ``--trainable`` (tightfit.levers.trainable): what the run trains; never chosen by tightfit
_TRAINABLE_HELP = ("all|lora|frozen-embeddings|frozen-N: train every parameter; LoRA adapters (rank 8) on the blocks' "
                   "linear layers and the head, the rest frozen; every parameter but the input layers (embeddings); "
                   "or but the input layers and the first N blocks")


def _trainable_rule(value) -> str | None:
    """``rule`` of ``trainable``: :func:`tightfit.levers.trainable.trainable_rule` (imported on
    use: the levers import this module)."""
    from .levers.trainable import trainable_rule

    return trainable_rule(value)


_IMAGE_DATA = "digits, a folder with one subfolder per class, or a CSV of image paths and labels"


def _is_image_model(model: str | None) -> bool:
    """Whether ``--model`` names an image classifier (a registry name, or a folder whose
    ``config.json`` says so; imported on use: :mod:`tightfit.models` imports this module). A model
    that cannot be resolved counts as text: its own error comes when it is loaded."""
    from .models import resolve

    try:
        entry = resolve(model)
        return (entry.task if entry.task is not None else entry.load_config()[0]).kind == "image"
    except TightfitError:
        return False


def _known_card(value) -> str | None:
    """``rule`` of ``gpu``: a card profile :func:`tightfit.devices.get_profile` knows (the built-in
    ones and ``TIGHTFIT_GPU_PROFILES``'), checked when the request is made, not at training."""
    from .devices import get_profile

    if not isinstance(value, str):
        return f"must be a card profile's name, not {value!r}"
    try:
        get_profile(value)
    except TightfitError as e:
        return f"names no known card: {e}"
    return None


def _clip_norm(value: float) -> str | None:
    """``rule`` of ``max_grad_norm``: > 0 and finite; None (no clipping) passes before the rule.
    A negative norm would flip the gradients (ascent), 0 zero them and NaN poison them."""
    if _finite(value) and value > 0:
        return None
    return f"must be positive and finite, or None for no clipping, not {_number(value)}"


def _weight_decay(value: float) -> str | None:
    """``rule`` of ``weight_decay``: finite and >= 0 (negative decay grows the weights)."""
    return None if _finite(value) and value >= 0 else f"must be finite and >= 0, not {_number(value)}"


def _temperature(value: float) -> str | None:
    """``rule`` of ``warn_temp`` and ``cooldown_temp``: a GPU temperature in deg C, between 0 and
    150 (NaN fails too); None (``cooldown_temp``: never pause) passes before the rule."""
    return None if 0 < value < 150 else f"must be a GPU temperature in deg C between 0 and 150, not {value}"


def _ratio(value: float) -> str | None:
    """``rule`` of ``warmup_ratio``: a share of the steps, in [0, 1] (above 1 the learning rate
    never reaches its peak)."""
    return None if 0 <= value <= 1 else f"must be between 0 and 1 (a share of the optimizer steps), not {value}"


def _seed(value: int) -> str | None:
    """``rule`` of ``seed``: within :data:`SEED_RANGE`."""
    low, high = SEED_RANGE
    return None if low <= value <= high else f"must be between -2**63 and 2**64-1 (the seeds torch takes), not {value}"


def _batch(value: int) -> str | None:
    """``rule`` of ``batch_size`` (and of ``--micro-batch``, ``effective_batch``): at most
    :data:`tightfit.plan.MAX_BATCH` samples."""
    if value <= MAX_BATCH:
        return None
    return f"must be at most {MAX_BATCH} (2**31 - 1) samples, not {_number(value)}"


def _image_size(value: int) -> str | None:
    """``rule`` of ``image_size``: at most :data:`MAX_IMAGE_SIZE`."""
    if value <= MAX_IMAGE_SIZE:
        return None
    return (f"must be at most {MAX_IMAGE_SIZE} pixels (one sample of ResNet-50 then needs ~27 GiB of activations), "
            f"not {value}")


@dataclass(frozen=True)
class WorkloadOptions(_Options):
    """What is trained: the model, the data, and how it is cut into samples and batches.

    Attributes:
        model: a local Hugging Face model folder (None: the shipped all-MiniLM-L6-v2).
        data: a CSV/TSV/JSONL file (None: the shipped Rotten Tomatoes reviews).
        text_column, label_column: the data file's columns.
        batch_size: the effective batch: samples per optimizer step, at most
            :data:`tightfit.plan.MAX_BATCH`.
        seq_len: tokens per text; longer texts are truncated.
        image_column: the CSV column of image paths (image models).
        image_size: image side in pixels (image models; None: the model's), at most
            :data:`MAX_IMAGE_SIZE`.
        trainable: ``all`` parameters; ``lora``: LoRA adapters on the blocks' linear layers and
            the head, everything else frozen; ``frozen-embeddings``: all but the input layers;
            ``frozen-N``: all but the input layers and the first N blocks
            (:mod:`tightfit.levers.trainable`; each changes what is learned, never chosen by tightfit).
    """

    model: str | None = option(None, "minilm, bert-base, bert-large (random weights, MiniLM's tokenizer), the image "
                                     "models resnet50, vit-b16 (random weights), or a local Hugging Face model folder "
                                     "(default: the shipped all-MiniLM-L6-v2)")
    data: str | None = option(None, "CSV/TSV/JSONL file, optionally .gz/.bz2 (default: Rotten Tomatoes reviews); "
                                    "for an image model: digits, a folder of class folders, or a CSV of paths and labels")
    text_column: str = option("text", "column holding the text (default: {default})")
    label_column: str = option("label", "column holding the label; strings allowed (default: {default})")
    batch_size: int = option(32, "effective batch: samples per optimizer step (default: {default})", minimum=1,
                             rule=_batch)
    seq_len: int = option(64, "maximum tokens per text (default: {default})", minimum=1)
    image_column: str = option("path", "image models: the CSV column holding image paths (default: {default})")
    image_size: int | None = option(None, "image models: image side in pixels (default: the size a model folder "
                                          "saved by tightfit was trained at, else the model's, 224 for ResNet; at most "
                                          f"{MAX_IMAGE_SIZE})", minimum=1, rule=_image_size)
    trainable: str = option("all", _TRAINABLE_HELP + " (default: {default})", rule=_trainable_rule)

    def _check_together(self) -> None:
        """``--model`` and ``--data``, when given, are not empty (``""`` would silently become the
        shipped model or data); the label column is not also the text or image column. (That columns are named only for a data file is checked by
        :meth:`check_columns`, once a resumed run's own ``--data`` is known.)"""
        for name, value, what, default in (
                ("model", self.model, "a model name or folder", "the shipped all-MiniLM-L6-v2"),
                ("data", self.data, "the data file", "the shipped Rotten Tomatoes reviews")):
            if value is not None and not str(value).strip():
                flag = self._name(name)
                if name == "data" and _is_image_model(self.model):  # no shipped images: leaving it out is refused
                    raise TightfitError(f"{flag} is empty: give the images ({_IMAGE_DATA})")
                raise TightfitError(f"{flag} is empty: give {what}, or leave {flag} out for {default}")
        for other in ("text_column", "image_column"):  # the label would be the input: a model that learns nothing
            if getattr(self, other) == self.label_column:
                raise TightfitError(f"{self._name(other)} and {self._name('label_column')} name the same column "
                                    f"{self.label_column!r}: the label would be the input; name the column "
                                    f"that holds the {other.split('_')[0]}")

    def check_columns(self) -> None:
        """Columns are named only for a ``--data`` file: :class:`TrainRequest` checks this for a new
        run, ``--resume`` after taking the run's own options from its ``request.json`` (the run's
        ``--data``, not given again, is the file they name).

        Raises:
            TightfitError: ``--text-column``, ``--label-column`` or ``--image-column`` other than
                the default without ``--data``.
        """
        if not self.data and (self.text_column, self.label_column, self.image_column) != ("text", "label", "path"):
            raise TightfitError(f"{self._name('text_column')}, {self._name('label_column')} and "
                                f"{self._name('image_column')} name columns of a {self._name('data')} file; "
                                "the shipped data has its own")


@dataclass(frozen=True)
class PlanOptions(_Options):
    """Where the run trains and what the planner may choose.

    Attributes:
        budget: GPU memory the run may use, e.g. ``"4GiB"`` (None: the card's).
        gpu: a known card's profile key whose budget and precision rules apply.
        precision: ``auto`` (from the card), ``fp32``, ``fp16`` or ``bf16``.
        checkpointing: activation checkpointing, ``auto``, ``on`` or ``off``.
        compile: ``torch.compile``, ``auto``, ``on`` or ``off``.
        device: ``auto`` (the GPU if there is one), ``cpu`` or ``cuda``.
        planner: on a GPU, ``search`` or ``probe``.
        replan: ignore a cached plan of the same job (:mod:`tightfit.planner.cache`).
        sharding: on several ranks, ``auto``, ``ddp`` or ``fsdp``; on one or several,
            ``fsdp-offload``: parameters, gradients and AdamW state in host memory
            (:mod:`tightfit.planner.sharding`).
        optimizer: ``auto`` (fp32 AdamW state first, then 8-bit or CPU-offloaded state where
            that fits or is faster), ``adamw``, ``adamw8bit``, ``adamw-offload`` or ``adamw8bit-bf16``.
    """

    budget: str | None = option(None, "GPU memory the run may use, e.g. 4GiB, 11GB (default: the card's)")
    gpu: str | None = option(None, "plan for a known card, e.g. gtx-1650-ti, gtx-1080-ti, rtx-3060 "
                                   "(its budget and precision rules)", rule=_known_card)
    precision: str = option("auto", "auto|fp32|fp16|bf16 (default: {default}, from the card)",
                            choices=("auto", *PRECISIONS))
    checkpointing: str = option("auto", "activation checkpointing: auto|on|off (default: {default})",
                                choices=("auto", "on", "off"))
    compile: str = option("auto", "torch.compile: auto|on|off (default: {default}: on a GPU, kept if the "
                                  "planner's compiled probe steps are faster)", choices=("auto", "on", "off"))
    device: str = option("auto", "auto|cuda|cpu (default: {default}: the GPU if there is one)",
                         choices=("auto", "cpu", "cuda"))
    sharding: str = option("auto", "auto|ddp|fsdp on several GPUs (torchrun / --gpus); fsdp-offload on one or "
                                   "several: parameters, gradients and AdamW state in host memory (default: "
                                   "{default}: one GPU alone, offloading parameters only when nothing else fits; "
                                   "several: DDP when the replicated state fits, else FSDP2)",
                           choices=("auto", "ddp", "fsdp", "fsdp-offload"))
    planner: str = option("search", "on a GPU: search (predict, then verify the best with real steps) or probe "
                                    "(largest micro-batch by probing; default: search)", choices=("search", "probe"))
    replan: bool = option(False, "plan afresh even if this job's plan is in the plan cache "
                                 "($TIGHTFIT_CACHE_DIR or ~/.cache/tightfit)")
    optimizer: str = option("auto", "auto|adamw|adamw8bit|adamw-offload|adamw8bit-bf16: AdamW with fp32 state, "
                                    "8-bit state, state on the CPU, or bf16 weights with 8-bit state and stochastically "
                                    "rounded updates (bitsandbytes, torchao; default: {default}, the levers only where fp32 "
                                    "state fits nothing or they are predicted faster)", choices=OPTIMIZER_CHOICES)

    def check_for_device(self, device: str, distributed: bool = False) -> None:
        """Refuse the choices that ``device`` (``"cpu"`` or ``"cuda"``, as resolved) cannot run:
        on the CPU fp16/bf16, ``compile on``, CPU offload and bf16 weights; offload on several
        processes too; parameter offload (``sharding="fsdp-offload"``) with fp16 or an optimizer
        lever (checked first: they are refused whatever the device), and on the CPU.

        Raises:
            TightfitError: one line naming the option as its user gave it.
        """
        if self.compile == "on" and (device != "cuda" or self.planner != "search"):
            raise TightfitError(f"{option_given('compile', 'on')} needs a CUDA GPU and the search planner")
        if self.optimizer == "adamw-offload" and (device != "cuda" or distributed):
            raise TightfitError(f"{option_given('optimizer', 'adamw-offload')} needs one CUDA GPU (torchao offloads "
                                "one GPU's state)")
        from .levers.optimizers import BF16_WEIGHTS

        if self.optimizer in BF16_WEIGHTS and device != "cuda":
            raise TightfitError(f"{option_given('optimizer', self.optimizer)} trains under bf16 autocast, which "
                                "tightfit runs on a CUDA GPU only")
        if self.sharding == "fsdp-offload" and self.optimizer not in ("auto", "adamw"):
            raise TightfitError(f"{option_given('sharding', 'fsdp-offload')} keeps fp32 AdamW state in host memory: "
                                f"{option_given('optimizer', self.optimizer)} does not go with it")
        if self.sharding == "fsdp-offload" and self.precision == "fp16":
            raise TightfitError(f"{option_given('sharding', 'fsdp-offload')} trains in bf16 or fp32: the loss "
                                f"scaler of {option_given('precision', 'fp16')} does not unscale gradients in host "
                                "memory")
        if self.sharding == "fsdp-offload" and device != "cuda":
            raise TightfitError(f"{option_given('sharding', 'fsdp-offload')} needs a CUDA GPU (it streams the "
                                "parameters from host memory to the GPU)")
        if self.precision in ("fp16", "bf16") and device != "cuda":
            raise TightfitError(f"{option_given('precision', self.precision)} needs a CUDA GPU; on the CPU use fp32")

    def _check_together(self) -> None:
        """``budget``, when given, reads as a memory size (:func:`~tightfit.units.parse_budget`): the
        Python API refuses a bad one when the request is made, naming its keyword; an optimizer
        keeping bf16 weights (``adamw8bit-bf16``) goes with precision ``bf16`` or ``auto`` only."""
        from .levers.optimizers import check_precision

        check_precision(self.optimizer, self.precision)  # the planner's own check
        if self.device == "cpu":  # asked for: refused now, as a GPU-only choice is on a machine without one
            self.check_for_device("cpu")
        if self.budget is None:
            return
        from .units import parse_budget

        try:
            parse_budget(self.budget)
        except TightfitError as e:
            flag, message = self._name("budget"), str(e)
            raise TightfitError(message.replace("--budget", flag, 1) if "--budget" in message
                                else f"{option_given('budget', self.budget)}: {message}") from None


@dataclass(frozen=True)
class TrainOptions(_Options):
    """How the model is trained: length, optimizer and schedule, logging, checkpoints, guards.

    Attributes:
        epochs: passes over the training samples; fractions allowed; at most :data:`MAX_EPOCHS`.
        max_steps: stop after this many optimizer steps (None: run all epochs).
        lr: peak learning rate of AdamW (linear warm-up, then linear decay to 0).
        weight_decay: AdamW's decoupled weight decay (finite, >= 0).
        warmup_ratio: share of steps with linear warm-up, in [0, 1].
        max_grad_norm: clip the global gradient norm to this, positive and finite (None: no clipping).
        seed: seed of the sample order, dropout and the new head, in :data:`SEED_RANGE`.
        log_every: write a metrics line every this many optimizer steps.
        checkpoint_every: write a checkpoint every this many steps (and at the end); 0: only at the end;
            None: every 100 steps where the loop is held by checkpoints within 2% of the training
            time (:mod:`tightfit.runtime.checkpoint_schedule`).
        keep_last: keep this many newest checkpoints.
        max_skipped_steps: stop after this many non-finite steps in a row.
        grow_back_after: after an OOM recovery, try doubling the micro-batch again after this
            many clean windows (0: never).
        warn_temp_c: warn when the GPU reaches this temperature (deg C); option ``warn_temp``.
        cooldown_temp_c: pause between steps while the GPU is at or above this temperature, until
            it is 5 deg C below (None: never pause); a pause that cannot cool it that far ends the
            pauses for the session; option ``cooldown_temp``.
        cuda_graphs: ``auto``: on a CUDA GPU, replay the steps of a plain eager plan (fused AdamW,
            one micro-batch per step, no compilation, recomputation or loss scaling) as CUDA
            graphs, one per batch shape, where memory allows (:mod:`tightfit.runtime.graphs`), and,
            with ``TIGHTFIT_PLAN_CUDA_GRAPHS=1`` (:data:`tightfit.planner.gpu.GRAPHS_ENV`), let the GPU
            planner choose a compiled model replayed as CUDA graphs
            (:data:`tightfit.levers.compile.GRAPHED`); ``off``: never (a resumed plan replayed so
            runs compiled without graphs).
        deterministic: plan, train and evaluate with deterministic kernels
            (:func:`tightfit.runtime.determinism.deterministic_kernels`), so that two runs, and a
            resumed run and the uninterrupted one, agree bit for bit also where a compiled model
            would add with atomic operations (a text model compiled as one graph).
    """

    epochs: float = option(3.0, "passes over the training data; fractions allowed (default: {default})",
                           rule=_epochs)
    max_steps: int | None = option(None, "stop after this many optimizer steps", rule=_positive_finite)
    lr: float = option(5e-5, "peak learning rate, warm-up then linear decay (default: {default})",
                       rule=_positive_finite)
    weight_decay: float = option(0.01, cli=False, rule=_weight_decay)
    warmup_ratio: float = option(0.1, cli=False, rule=_ratio)
    max_grad_norm: float | None = option(1.0, cli=False, rule=_clip_norm)
    seed: int = option(0, "seed of sample order, dropout and the new head (default: {default})", rule=_seed)
    log_every: int = option(10, "optimizer steps between metrics lines (default: {default})", minimum=1)
    checkpoint_every: int | None = option(None, "write a resumable checkpoint every N optimizer steps and at the "
                                                "end; 0: only at the end (default: every 100 steps where "
                                                "checkpoints stay within 2%% of the training time)",
                                          minimum=0, below=" (0: only at the end)")
    keep_last: int = option(2, "checkpoints to keep (default: {default})", minimum=1)
    max_skipped_steps: int = option(20, "stop after this many non-finite (skipped) steps in a row "
                                        "(default: {default})", minimum=1)
    grow_back_after: int = option(100, cli=False, minimum=0, below=" (0: never)")
    warn_temp_c: float = option(82.0, "warn at this GPU temperature, deg C (default: {default})", key="warn_temp",
                                rule=_temperature)
    cooldown_temp_c: float | None = option(None, "pause between steps while the GPU is this hot (deg C)",
                                           key="cooldown_temp", rule=_temperature)
    cuda_graphs: str = option("auto", "replay steps as CUDA graphs: auto|off (default: {default}: an eager "
                                      "step of one micro-batch; with TIGHTFIT_PLAN_CUDA_GRAPHS=1 also a compiled "
                                      "plan where the planner finds it faster)", choices=("auto", "off"))
    deterministic: bool = option(False, "deterministic kernels (torch.use_deterministic_algorithms): runs, and a "
                                        "resumed run and the uninterrupted one, agree bit for bit also where a "
                                        "compiled step would add with atomic operations")


# What a request made in Python records as its command: the command line records its own
# (TrainRequest.from_args), and any other program's arguments are not tightfit's (a script named
# tightfit_x.py was once recorded as `tightfit <its arguments>`).
PYTHON_API_COMMAND = "tightfit.api.train (Python API)"


@dataclass(frozen=True)
class RunOptions(_Options):
    """The run folder, how much data is used, and how the run reports.

    Attributes:
        out: the run folder (None: ``runs/<date-time>``).
        resume: a run folder to continue from its newest intact checkpoint, or one of its
            checkpoints (``RUN/checkpoints/ckpt-<step>``) to continue from.
        full: on the CPU, train on all training samples (default: a subset); not with ``train_samples``.
        train_samples, eval_samples: use this many training / held-out samples.
        progress: show a progress bar.
        command: the command line recorded in the report.
    """

    out: str | None = option(None, "run folder (default: runs/<date-time>); must not exist or be empty")
    resume: str | None = option(None, "continue the run in DIR from its newest checkpoint, or from the checkpoint "
                                      "DIR/checkpoints/ckpt-N given (its other options are taken from "
                                      "DIR/request.json)", metavar="DIR")
    full: bool = option(False, "on the CPU, train on all training samples (default: a subset)")
    train_samples: int | None = option(None, "train on this many training samples (fixed random subset; not with "
                                             "--full)", minimum=1)
    eval_samples: int | None = option(None, "evaluate on this many held-out samples (default: all)", minimum=1)
    progress: bool = option(True, "no progress bar", flag="--no-progress")
    command: str = option(PYTHON_API_COMMAND, cli=False)
    # flat names of the options given: the command line's flags, or TrainRequest's keywords (a
    # resumed run takes these anew even when a value equals the default; see TrainRequest)
    given: tuple = option((), cli=False)

    def _check_together(self) -> None:
        """``--resume``, when given, is not empty (``""`` would silently start a new run);
        ``--full`` and ``--train-samples`` both say how many samples to train on: one of them."""
        if self.resume is not None and not str(self.resume).strip():
            flag = self._name("resume")
            raise TightfitError(f"{flag} is empty: give the run folder to continue, or leave {flag} out for a new run")
        if self.full and self.train_samples is not None:
            n = "N" if _CLI_NAMES.get() else str(self.train_samples)  # the Python API's: the value given
            given = f"{self._name('train_samples')} N" if _CLI_NAMES.get() else f"train_samples={n}"
            full = self._name("full") if _CLI_NAMES.get() else "full=True"
            raise TightfitError(f"{full} trains on all training samples; {given} chooses {n}: give one")


def saved_options(saved: dict) -> dict:
    """A run's ``request.json`` options as this version reads them (``--resume`` and ``export``):
    a run saved before ``--full`` with ``--train-samples`` was refused holds both, and trained on
    ``--train-samples``, so ``full`` is dropped; one saved before an empty ``--model`` or ``--data``
    was refused trained on the shipped one, which None names. ``saved`` is not modified."""
    if saved.get("full") and saved.get("train_samples") is not None:
        saved = {**saved, "full": False}
    empty = [k for k in ("model", "data") if isinstance(saved.get(k), str) and not saved[k].strip()]
    return {**saved, **dict.fromkeys(empty)} if empty else saved

# The tree's groups: (attribute of TrainRequest, class, title in --help).
GROUPS: tuple[tuple[str, type, str], ...] = (
    ("workload", WorkloadOptions, "what to train"),
    ("planning", PlanOptions, "device and plan"),
    ("training", TrainOptions, "training"),
    ("run", RunOptions, "run folder and data size"),
)
# Flat option name -> (group attribute, field name), e.g. "warn_temp" -> ("training", "warn_temp_c").
_FLAT: dict[str, tuple[str, str]] = {option_key(f): (attr, f.name) for attr, cls, _ in GROUPS for f in fields(cls)}
# Flat option name -> its field (option_name("text_column")).
_FIELD_OF: dict[str, Field] = {option_key(f): f for _, cls, _ in GROUPS for f in fields(cls)}


def _did_you_mean(key: str) -> str:
    """The keyword meant by a flag's name written as a keyword (``no_progress``: ``progress=False``),
    or the nearest keywords, for :class:`TrainRequest`'s TypeError; "" where none is near."""
    import difflib

    if key.startswith("no_") and key[3:] in _FLAT and option_flag(_FIELD_OF[key[3:]]) == "--" + key.replace("_", "-"):
        return f": {option_flag(_FIELD_OF[key[3:]])} is {key[3:]}=False"  # a flag that exists (--no-progress)
    near = difflib.get_close_matches(key, list(_FLAT), n=3)
    return f" (did you mean {' or '.join(near)}?)" if near else f" (the keywords: {', '.join(sorted(_FLAT))})"


@dataclass(frozen=True, init=False)
class TrainRequest:
    """Everything ``tightfit train`` accepts (see ``tightfit train --help``) but ``--gpus``, which
    starts processes (in Python: ``torchrun --nproc-per-node N your_script.py``, each calling
    :func:`tightfit.api.train`; docs/distributed.md), as a tree of groups.

    Made from flat keywords, as on the command line (``TrainRequest(model="m", batch_size=16,
    warn_temp=80)``), or from whole groups (``TrainRequest(training=TrainOptions(lr=1e-4))``),
    or both (flat keywords then change the given groups). Path objects and NumPy numbers are taken
    as ``str``, ``int`` and ``float`` (:func:`plain_value`). Unknown keywords raise ``TypeError``,
    bad values :class:`TightfitError` naming the keyword (``batch_size must be >= 1``; made by
    :meth:`from_args`, the flag: ``--batch-size must be >= 1``).

    The request records which options were given in ``run.given`` (flat names), for ``resume``:
    every flat keyword passed, even at its default value; of a group passed whole, the ``given``
    of a :class:`RunOptions` and the options that differ from their defaults (a group's own
    constructor cannot tell a default passed from one left out). ``given=`` passed explicitly
    (:meth:`from_args`: the flags on the command line) is taken as is. Copies keep it
    (``dataclasses.replace`` passes the run group whole; :meth:`with_options` adds its keywords).

    Attributes:
        workload: :class:`WorkloadOptions`.
        planning: :class:`PlanOptions`.
        training: :class:`TrainOptions`.
        run: :class:`RunOptions`.
    """

    workload: WorkloadOptions
    planning: PlanOptions
    training: TrainOptions
    run: RunOptions

    def __init__(self, **options: Any):
        flat: dict[str, dict[str, Any]] = {attr: {} for attr, _, _ in GROUPS}
        groups = {attr: options.pop(attr) for attr, _, _ in GROUPS if attr in options}
        for key, value in options.items():
            if key not in _FLAT:
                raise TypeError(f"TrainRequest() got an unexpected keyword argument {key!r}{_did_you_mean(key)}")
            attr, name = _FLAT[key]
            flat[attr][name] = value
        if "given" not in options:  # recorded here: a value equal to its default was given all the same
            flat["run"]["given"] = _given(options, groups)
        for attr, cls, _ in GROUPS:
            group = groups.get(attr)
            group = cls(**flat[attr]) if group is None else replace(group, **flat[attr])
            object.__setattr__(self, attr, group)
        if self.run.resume is None:  # a resumed run's --data comes from its request.json: checked there
            self.workload.check_columns()

    def to_flat(self) -> dict[str, Any]:
        """``{option: value}`` with the flat names (the keywords of the constructor)."""
        return {option_key(f): getattr(getattr(self, attr), f.name) for attr, cls, _ in GROUPS for f in fields(cls)}

    def with_options(self, **options: Any) -> "TrainRequest":
        """A copy with some options (flat names) changed; those count as given (``run.given``)."""
        given = (*self.run.given, *(k for k in options if k not in self.run.given))
        return TrainRequest(**{**self.to_flat(), "given": given, **options})

    @classmethod
    def from_args(cls, args) -> "TrainRequest":
        """The request from an ``argparse`` namespace made by :func:`add_train_arguments`.

        Raises:
            TightfitError: a bad value, named by its flag (``--batch-size must be >= 1``).
        """
        options = {option_key(f): getattr(args, option_key(f))
                   for _, group, _ in GROUPS for f in fields(group) if f.metadata.get("cli", True)}
        extra = {"command": args.command_line} if getattr(args, "command_line", None) else {}
        with cli_names():  # the values came from the command line: its messages name flags
            return cls(**options, given=tuple(getattr(args, "given_options", ())), **extra)


def _given(options: dict[str, Any], groups: dict[str, Any]) -> tuple[str, ...]:
    """The flat names of the options a :class:`TrainRequest` is given: the flat keywords
    ``options``, and of each group in ``groups`` (``{"training": TrainOptions(...)}``) a run
    group's ``given`` and the options that differ from their defaults; in the order of the tree."""
    named = set(options)
    for group in groups.values():
        default = type(group)()
        named.update(getattr(group, "given", ()))
        named.update(option_key(f) for f in fields(group) if f.name != "given"
                     and getattr(group, f.name) != getattr(default, f.name))
    return tuple(k for k in _FLAT if k in named)


def _shown(value: Any) -> str:
    """A default as ``--help`` shows it: ``3`` for 3.0, ``5e-5`` for 5e-05."""
    if isinstance(value, float):
        text = f"{value:g}"
        mantissa, _, exponent = text.partition("e")
        return f"{mantissa}e{int(exponent)}" if exponent else text
    return str(value)


def _argument(group, f: Field, hints: dict) -> None:
    """Add option field ``f`` to an argparse group: flag, type from the annotation, default, help."""
    kind = typing.get_args(hints[f.name]) or (hints[f.name],)
    kind = next(t for t in kind if t is not type(None))
    kw: dict[str, Any] = {"dest": option_key(f), "default": f.default,
                          "help": f.metadata["help"].format(default=_shown(f.default))}
    if kind is bool:
        kw["action"] = "store_false" if f.default else "store_true"
    elif kind is not str:
        kw["type"] = kind
    if f.metadata.get("metavar"):
        kw["metavar"] = f.metadata["metavar"]
    group.add_argument(option_flag(f), **kw)


def add_train_arguments(parser) -> None:
    """Add every command-line option of :class:`TrainRequest` to ``parser``, one argument group
    per option group."""
    for _, cls, title in GROUPS:
        group, hints = parser.add_argument_group(title), typing.get_type_hints(cls)
        for f in fields(cls):
            if f.metadata.get("cli", True):
                _argument(group, f, hints)
