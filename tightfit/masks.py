"""Padding masks handed to Hugging Face encoders in the form that needs no host sync.

A text batch carries a 2-D padding mask ``attention_mask`` ``[B, T]`` (1 on a sample's tokens, 0
on padding). Given that, a transformers (>= 5) encoder with SDPA attention asks, in Python,
whether the mask has any 0 (``masking_utils._ignore_bidirectional_mask_sdpa`` runs
``padding_mask.all()``) so as to drop an all-ones mask and let SDPA use its flash kernel. On a
GPU that question is a device-to-host read: the host waits at every forward until the GPU has
finished all the work queued before it (the previous step included), and the GPU then idles while
the rest of the step is launched — the one sync left in the main job's steady-state step
(bench/results/run-ahead).

transformers takes a 4-D mask as already prepared and passes it to the attention as is
(``masking_utils._preprocess_mask_arguments``). :func:`with_prepared_mask` hands such encoders the
boolean ``[B, 1, T, T]`` view that their own SDPA mask function builds from the 2-D mask
(``sdpa_mask``: ``padding_mask[b, kv]`` expanded over heads and queries, True = attend), made on
the device with no read. The attention sees the same mask values; what is given up is the flash
kernel for a batch without padding, which the 2-D mask would have had: ~3.5% of such a step
(BERT-base, 512 tokens, NVIDIA H200: 79 vs 76 ms; bench/results/final-call), against the read
removed from every padded one (the main job: 1.05x; bench/results/mask-4d). Used wherever
tightfit calls the model on a batch: the tasks' losses and evaluation, the estimator's loss, the
own-loop default loss.
"""

from __future__ import annotations

import sys

import torch

Batch = dict[str, torch.Tensor]

# Encoder-only families whose forward builds one bidirectional padding mask from ``attention_mask``
# and uses it for nothing else (checked in their transformers 5 modeling code; tests/test_masks.py
# compares logits). Not a rule to infer: GPT-2 also imports ``create_bidirectional_mask`` (for
# cross-attention) and is causal; ModernBERT adds a sliding window to its mask.
ENCODERS = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "distilbert", "electra", "albert"})


def hf_model(model: torch.nn.Module):
    """The transformers ``PreTrainedModel`` that ``model`` is, or that it wraps without touching
    the mask: DDP's or DataParallel's ``.module``, ``torch.compile``'s ``_orig_mod``, a peft model
    other than prompt learning (its base model; prompt tuning joins its own positions to the mask).
    None for anything else — a user's own module holding an encoder may use the mask itself (mean
    pooling, say), so it gets the mask it was given. Also what the own loop's label shift reads
    (:func:`tightfit.loop._target_tokens`)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is a dependency; a stripped install still trains plain models
        return None
    for _ in range(8):  # a few layers of wrapping at most
        if isinstance(model, PreTrainedModel):
            return model
        if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
            config = getattr(model, "active_peft_config", None)
            if config is None or getattr(config, "is_prompt_learning", True):
                return None
            model = model.get_base_model()
        elif isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return None
    return None


def takes_prepared_mask(model: torch.nn.Module) -> bool:
    """True when ``model`` is (:func:`hf_model`) a transformers encoder whose padding mask
    :func:`with_prepared_mask` should hand over in 4-D: a family in :data:`ENCODERS`, SDPA
    attention, not configured as a decoder or with cross-attention, and modeling code that builds
    its mask with ``masking_utils.create_bidirectional_mask`` (transformers >= 5, whose mask
    functions take a 4-D mask as prepared). Read at every call (a few attribute reads): the
    attention implementation or the decoder flag may change between calls."""
    hf = hf_model(model)
    config = getattr(hf, "config", None)
    if config is None:
        return False
    modeling = sys.modules.get(type(hf).__module__)
    return bool(getattr(config, "model_type", None) in ENCODERS
                and getattr(config, "_attn_implementation", None) == "sdpa"
                and not getattr(config, "is_decoder", False)
                and not getattr(config, "add_cross_attention", False)
                and getattr(modeling, "create_bidirectional_mask", None) is not None)


def with_prepared_mask(model: torch.nn.Module, batch: Batch) -> Batch:
    """``batch`` (a new dict, the same tensors) with, for an encoder that
    :func:`takes_prepared_mask`, its 2-D ``attention_mask`` ``[B, T]`` replaced by the boolean
    view ``[B, 1, T, T]`` (True where key position ``t`` of sample ``b`` is a token, for every
    query) — the mask transformers' SDPA path would build, made without reading the mask on the
    host. Any other batch is returned as is."""
    mask = batch.get("attention_mask")
    if not (torch.is_tensor(mask) and mask.dim() == 2 and takes_prepared_mask(model)):
        return batch
    length = mask.shape[1]
    return {**batch, "attention_mask": mask.bool()[:, None, None, :].expand(-1, 1, length, -1)}


def model_inputs(model: torch.nn.Module, batch: Batch) -> Batch:
    """The ``forward`` keyword arguments of ``batch`` for ``model``: every field but ``labels``,
    the padding mask as :func:`with_prepared_mask` hands it. The batch itself is not changed."""
    return {k: v for k, v in with_prepared_mask(model, batch).items() if k != "labels"}
