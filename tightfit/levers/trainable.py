"""What a run trains (``--trainable``), in one place for every face (``train``, ``plan``,
``estimate``, the Python API): every parameter (``all``), every parameter but the frozen input
layers or the first blocks too (``frozen-embeddings``, ``frozen-N``: :mod:`.freezing`), or LoRA
adapters and the head (``lora``: :mod:`.lora`). tightfit never chooses one of them by itself:
each changes what is learned, so the accuracy.
"""

from __future__ import annotations

import torch

from .freezing import MARK, apply_freezing, check_frozen, frozen_blocks

VALUES = "all, lora, frozen-embeddings or frozen-N"  # as messages list them


def trainable_rule(value) -> str | None:
    """``rule`` of the ``trainable`` option (:func:`tightfit.config.option`): None for a value
    of :data:`VALUES`, else the rest of the message."""
    if value in ("all", "lora") or frozen_blocks(value) is not None:
        return None
    return f"must be {VALUES} (N >= 1 blocks frozen besides the input layers), not {value!r}"


def apply_trainable(model: torch.nn.Module, trainable: str) -> tuple[torch.nn.Module, str | None]:
    """``model`` set up to train what ``trainable`` says, and the line that says what trains
    (None for ``all``): LoRA wraps it (:func:`.lora.apply_lora`, a new module), freezing works
    in place (:func:`.freezing.apply_freezing`).

    Raises:
        TightfitError: an unknown value, peft missing for LoRA, a model freezing or LoRA cannot
            apply to (the message says why).
    """
    from ..errors import TightfitError

    problem = trainable_rule(trainable)
    if problem:
        raise TightfitError(f"trainable {problem}")
    if trainable == "all":
        return model, None
    if trainable == "lora":
        from .lora import apply_lora, trainable_note

        model = apply_lora(model)
        return model, trainable_note(model)
    return model, apply_freezing(model, trainable)


def trainable_count(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameters of ``model``."""
    ps = list(model.parameters())
    return sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)


def trainable_fields(model: torch.nn.Module) -> dict:
    """What ``model`` trains, as the :class:`~tightfit.plan.Plan` fields ``trainable`` (``"lora"``
    when it has adapters; for a model :func:`apply_trainable` froze, the freezing that holds now,
    :func:`.freezing.frozen_label`; else ``"all"``) and
    ``trainable_params`` (the parameters that require grad): the one place a plan learns them,
    for every face that shows it."""
    from .freezing import frozen_label
    from .lora import has_adapters

    # A model tightfit froze is labelled by what is frozen now: unfrozen since (gradual
    # unfreezing), or frozen again with another value, it trains what requires grad.
    mark = getattr(model, MARK, None) and frozen_label(model)
    kind = "lora" if has_adapters(model) else mark or "all"
    return {"trainable": kind, "trainable_params": trainable_count(model)[0]}


def check_trainable(trainable: str, model: torch.nn.Module) -> None:
    """Refuse a plan made for ``trainable`` for a model not set up that way (LoRA adapters
    missing, parameters the plan froze requiring grad): its step would hold gradients and state
    the plan left out.

    Raises:
        TightfitError: one line saying what to do.
    """
    from .lora import check_adapters

    check_adapters(trainable, model)
    check_frozen(trainable, model)
