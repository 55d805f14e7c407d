"""Activation checkpointing: recompute each transformer block's activations during backward.

Uses the model's own Hugging Face hook (``gradient_checkpointing_enable``) with the
non-reentrant ``torch.utils.checkpoint`` (it works when a block's inputs do not require grad,
e.g. frozen embeddings, and restores the RNG state so dropout masks are recomputed identically).
The KV cache is turned off, as caching conflicts with recomputation in training.
"""

from __future__ import annotations

import torch


def set_activation_checkpointing(model: torch.nn.Module, enabled: bool) -> None:
    """Turn activation checkpointing on or off for a Hugging Face ``PreTrainedModel``.

    Raises:
        ValueError: if ``enabled`` and the model does not support gradient checkpointing.
    """
    if not enabled:
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
