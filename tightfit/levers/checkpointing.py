"""Activation checkpointing: recompute each transformer block's activations during backward.

Uses the model's own Hugging Face hook (``gradient_checkpointing_enable``) with the
non-reentrant ``torch.utils.checkpoint`` (it works when a block's inputs do not require grad,
e.g. frozen embeddings, and restores the RNG state so dropout masks are recomputed identically).
The KV cache is turned off, as caching conflicts with recomputation in training.
"""

from __future__ import annotations

import torch


def set_activation_checkpointing(model: torch.nn.Module, enabled: bool, blocks=None) -> None:
    """Turn activation checkpointing on or off.

    Args:
        model: a Hugging Face ``PreTrainedModel`` (or any model with repeated blocks when
            ``blocks`` selects some of them).
        enabled: checkpoint or not.
        blocks: indices of the repeated blocks (:func:`tightfit.levers.blocks.find_blocks`) to
            checkpoint; None or all of them: the model's own Hugging Face hook, or tightfit's
            block wrappers for a model without one (e.g. ResNet).

    Raises:
        ValueError: if ``enabled`` and the model does not support gradient checkpointing.
    """
    from .blocks import apply_checkpointing, find_blocks

    own_hook = getattr(model, "supports_gradient_checkpointing", False)
    if enabled and not own_hook and find_blocks(model):  # e.g. ResNet: wrap the blocks ourselves
        blocks = tuple(range(len(find_blocks(model)))) if blocks is None else blocks
    if blocks is not None:
        apply_checkpointing(model, ())  # unwrap any subset from an earlier choice
        if enabled and (len(tuple(blocks)) < len(find_blocks(model)) or not own_hook):
            if own_hook:
                set_activation_checkpointing(model, False)
            apply_checkpointing(model, tuple(blocks))  # non-reentrant, RNG-preserving
            if getattr(getattr(model, "config", None), "use_cache", None):
                model.config.use_cache = False
            return
    if not enabled:
        if find_blocks(model):
            apply_checkpointing(model, ())  # unwrap tightfit's block wrappers, if any
        if getattr(model, _name(model, "is_activation_checkpointing", "is_gradient_checkpointing"), False):
            getattr(model, _name(model, "activation_checkpointing_disable", "gradient_checkpointing_disable"))()
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(type(model), "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(model, "config", None) is not None and hasattr(model.config, "use_cache"):
        model.config.use_cache = False


def _name(model, new: str, old: str) -> str:
    # transformers renamed gradient_* to activation_* (the old names warn, and go in v6)
    return new if hasattr(type(model), new) else old
