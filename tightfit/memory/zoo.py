"""The built-in architectures for memory estimates and measurements: the one model registry of
:mod:`tightfit.models`, seen from the memory side.

``build_model(name_or_path, device="meta")`` builds a registry name (``minilm``, ``bert-base``,
``bert-large``, ``gpt2``, ``vit-b16``, ``resnet50``) or a local Hugging Face folder's config with
its task's head and random weights (memory does not depend on their values; on ``meta`` even
BERT-large takes no memory), and returns ``(model, make_batch)``. Heads: sequence classification
with 2 labels for the BERTs, image classification (the config default of 2 labels) for ViT-B/16
and ResNet-50, causal language modelling for GPT-2.
"""

from __future__ import annotations

from ..models import REGISTRY, BatchMaker, build_model

__all__ = ["BatchMaker", "REGISTRY", "build_model"]
