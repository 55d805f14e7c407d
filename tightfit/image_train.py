"""``tightfit train`` on images: the recipe of :class:`tightfit.api.TrainRecipe` with image data
(:mod:`tightfit.images`) and an image classifier (transformers' ``ResNetForImageClassification``,
``ViTForImageClassification`` or any ``AutoModelForImageClassification`` folder) in place of text
and a tokenizer. The plan, the guards, the run folder and the report are the text recipe's.

A run is an image run when its model is an image model (a registry name such as ``resnet50`` or
``vit-b16``, or a folder whose ``config.json`` names an ``...ForImageClassification``
architecture); image data (``digits`` or a folder) with a text model is refused with one line.
"""

from __future__ import annotations

import json
from pathlib import Path

from .api import TrainRecipe
from .config import TrainRequest, option_given, option_name
from .errors import TightfitError
from .fileio import atomic_write_json
from .images import PREPROCESSING_FILE, ImageSamples, is_image_data, load_image_classification, preprocessing_record
from .models import ModelEntry, resolve
from .rng import seed_everything


def _model_and_data(req: TrainRequest) -> tuple[str | None, str | None]:
    """``(--model, --data)`` of the run: for ``--resume``, those of the run being resumed (read
    leniently: the text recipe reports an unreadable run folder)."""
    model, data = req.workload.model, req.workload.data
    if req.run.resume:
        try:
            from .runtime.checkpoint import resume_target

            saved = json.loads((resume_target(req.run.resume)[0] / "request.json").read_text())
            model, data = saved.get("model"), saved.get("data")
        except (OSError, ValueError, AttributeError):
            pass
    return model, data


def is_image_model(entry: ModelEntry) -> bool:
    """Whether ``entry`` classifies images (registry task, or the folder's ``config.json``).

    Raises:
        TightfitError: a folder's config cannot be read.
    """
    return (entry.task.kind if entry.task is not None else entry.load_config()[0].kind) == "image"


def recipe_class(req: TrainRequest) -> type[TrainRecipe]:
    """:class:`ImageTrainRecipe` for an image model, :class:`tightfit.api.TrainRecipe` otherwise.

    Raises:
        TightfitError: image data (``digits`` or a folder) with a text model; ``--image-column`` or
            ``--label-column`` with ``digits`` or a folder; an unknown model.
    """
    model, data = _model_and_data(req)
    image = is_image_model(resolve(model))
    _refuse_options_of_the_other_kind(req, model, image)
    if image:
        _refuse_list_columns_without_a_list(req, data)
        return ImageTrainRecipe
    if is_image_data(data):
        what = "digits, images" if data == "digits" else "a folder, read as images (one subfolder per class)"
        raise TightfitError(f"{option_given('data', data)} is {what}, but {model or 'the default model'} is a text model: "
                            f"give an image model ({option_given('model', 'resnet50')}, {option_given('model', 'vit-b16')}, "
                            "or a folder of an image classifier), "
                            "or for text one CSV, TSV or JSONL file")
    return TrainRecipe


def _refuse_options_of_the_other_kind(req: TrainRequest, model: str | None, image: bool) -> None:
    """Text options with an image model, or image options with a text model, are refused (they
    would be ignored), as ``tightfit plan`` refuses them.

    Raises:
        TightfitError: such an option differs from its default.
    """
    from .config import WorkloadOptions

    w, default = req.workload, WorkloadOptions()
    other = ("seq_len", "text_column") if image else ("image_size", "image_column")
    given = [option_name(k) for k in other if getattr(w, k) != getattr(default, k)]
    if given and not req.run.resume:
        kind, takes = ("an image model", "images") if image else ("a text model", "text")
        raise TightfitError(f"{' and '.join(given)} {'do' if len(given) > 1 else 'does'} not apply: "
                            f"{model or 'the default model'} is {kind} and takes {takes}")


def _refuse_list_columns_without_a_list(req: TrainRequest, data: str | None) -> None:
    """``--image-column`` and ``--label-column`` name columns of a CSV/TSV/JSONL list of images:
    with ``digits`` or a class folder they would be ignored, so they are refused.

    Raises:
        TightfitError: such an option differs from its default and ``--data`` is not a list file.
    """
    from .config import WorkloadOptions

    w, default = req.workload, WorkloadOptions()
    given = [option_name(k) for k in ("image_column", "label_column") if getattr(w, k) != getattr(default, k)]
    if given and is_image_data(data) and not req.run.resume:
        what = "digits" if data == "digits" else "a folder of class folders"
        raise TightfitError(f"{' and '.join(given)} {'do' if len(given) > 1 else 'does'} not apply: "
                            f"{option_given('data', data)} is {what}, not a CSV/TSV/JSONL list of image paths and "
                            "labels (the classes are its " + ("digits" if data == "digits" else "subfolders' names")
                            + ")")


def input_channels(entry: ModelEntry, config) -> int:
    """The input channels of ``entry`` (its ``config``'s ``num_channels``, 3 where it names none).

    Raises:
        TightfitError: other than 1 or 3 (:func:`tightfit.images.pixel_values` makes grey or RGB input only).
    """
    channels = int(getattr(config, "num_channels", 3))
    if channels not in (1, 3):
        raise TightfitError(f"{entry.folder or entry.name}: the model takes {channels} input channels; tightfit "
                            "trains image models of 1 (grey) or 3 (RGB) channels")
    return channels


def load_image_classifier(entry: ModelEntry, label_names: list[str], image_size: int | None):
    """``(model, size, channels)``: ``entry`` as an image classifier for ``label_names`` in fp32 --
    a folder's weights with a new head (kept where it was trained on ``label_names``:
    :func:`tightfit.models.new_head`), or random weights from the registry's config (from the
    global torch RNG; the caller seeds it) -- the image side it takes, and its input channels.

    Args:
        entry: an image model of the registry or a folder.
        label_names: the classes (the head's outputs).
        image_size: ``--image-size`` (None: the config's ``image_size``, else
            :data:`tightfit.models.DEFAULT_IMAGE_SIZE`), checked by :meth:`ModelEntry.fit_image_size`.

    Raises:
        TightfitError: the folder cannot be loaded or lacks most of its weights; an image size the
            model cannot take (:meth:`ModelEntry.fit_image_size`); input channels other than 1 or 3.
    """
    import torch
    from transformers import AutoModelForImageClassification

    from .models import _check_loaded_weights, _load_errors, _one_line, _quiet_transformers, new_head

    _quiet_transformers()
    _, config = entry.load_config()
    size = entry.fit_image_size(config, image_size)  # a registry architecture's config: built for this size
    channels = input_channels(entry, config)
    id2label = dict(enumerate(label_names))
    labels = dict(num_labels=len(label_names), id2label=id2label, label2id={v: k for k, v in id2label.items()})
    if entry.folder is None:  # a registry architecture: random weights
        for k, v in labels.items():
            setattr(config, k, v)
        model = AutoModelForImageClassification.from_config(config).float()
    else:
        try:
            model, info = AutoModelForImageClassification.from_pretrained(
                entry.folder, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True, **labels)
        except _load_errors() as e:
            raise TightfitError(f"cannot load the model from {entry.folder}: {_one_line(e)}") from None
        _check_loaded_weights(model, info, entry.folder)
        new_head(model, info, entry.folder, label_names)
    return model, size, channels


def _check_trainable_before_data(config, trainable: str) -> None:
    """Refuse a ``--trainable`` the model cannot take (``frozen-N`` above its repeated blocks, LoRA
    without linear layers in them) from its config alone, on a model built on the meta device (no
    memory, no weights), before every image is decoded: the same checks
    :func:`tightfit.levers.trainable.apply_trainable` makes on the real model later.

    Raises:
        TightfitError: as :func:`tightfit.levers.freezing.frozen_parameters` or
            :func:`tightfit.levers.lora.lora_targets`.
    """
    import torch
    from transformers import AutoModelForImageClassification

    from .levers.freezing import frozen_blocks, frozen_parameters
    from .levers.lora import lora_targets

    if trainable == "all" or (trainable != "lora" and frozen_blocks(trainable) is None):
        return
    with torch.device("meta"):
        model = AutoModelForImageClassification.from_config(config)
    if trainable == "lora":
        lora_targets(model)
    else:
        frozen_parameters(model, trainable)


class ImageTrainRecipe(TrainRecipe):
    """``tightfit train`` for an image model: image data, an image classifier, the same plan,
    guards, run folder and report as :class:`tightfit.api.TrainRecipe`. The run folder's
    ``model/`` holds the weights (safetensors), ``config.json`` and :data:`PREPROCESSING_FILE`
    (how images become ``pixel_values``). Its batches have one shape (but an epoch's short last
    micro-batch): attention keeps PyTorch's kernels (:mod:`tightfit.levers.attention`)."""

    VARYING_SHAPES = False

    def _load_data(self) -> None:
        """The image model's registry entry and the labelled images (every image checked)."""
        w = self.req.workload
        self.source = resolve(w.model)
        if not w.data:
            raise TightfitError(f"{self.source.name} is an image model: give {option_name('data')} (digits, a folder "
                                "with one "
                                "subfolder per class, or a CSV of image paths and labels)")
        config = self.source.load_config()[1]  # the model's checks before the images are read (each decoded)
        self.source.fit_image_size(config, w.image_size)
        input_channels(self.source, config)
        _check_trainable_before_data(config, w.trainable)
        self.data = load_image_classification(w.data, w.label_column, w.image_column)

    def _load_model(self) -> None:
        """The classifier (seeded head), the budget checked against its state, and the workload."""
        from .tasks import ImageClassification
        from .workload import DatasetBatches, Workload, collate_as

        seed_everything(self.req.training.seed)  # before the new head (or the whole model) is initialised
        self.model, self.image_size, self.channels = load_image_classifier(self.source, self.data.label_names,
                                                                           self.req.workload.image_size)
        if self.source.folder is None:
            self.notes.append(f"{self.source.name}: no pretrained weights are shipped: training from random weights")
        self._apply_trainable()
        self._check_budget()
        collate = collate_as("pixel_values", "labels")

        def batches(data):
            samples = ImageSamples(data, self.image_size, self.channels)
            # every image has the same shape: any n samples are the worst case (no scan that decodes them all)
            return DatasetBatches(samples, collate, worst_case=lambda n: collate([samples[0]] * n))

        self.workload = Workload(self.model, batches(self.train_data), batches(self.eval_data),
                                 self.effective_batch(), task=ImageClassification())

    def input_size(self) -> int:
        """The image side in pixels (the planner's size of a sample)."""
        return self.image_size

    def _save_model(self, folder: Path) -> None:
        """The trained weights (:meth:`_save_weights`: unwrapped from DDP/FSDP2, LoRA merged),
        ``config.json`` and the preprocessing."""
        self._save_weights(folder)
        atomic_write_json(folder / PREPROCESSING_FILE,
                          preprocessing_record(self.image_size, self.channels, self.data.label_names))
