"""``tightfit train`` on images (CPU): scikit-learn's digits, a folder of class folders and a CSV
of paths, with tiny transformers ResNet/ViT classifiers saved as model folders; the checks that
refuse bad image input before any work."""

import json
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")  # the `images` extra

from tightfit.cli import main  # noqa: E402
from tightfit.errors import TightfitError  # noqa: E402
from tightfit.images import (ImageSamples, load_digits, load_image_classification,  # noqa: E402
                             pixel_values)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny ResNet (BatchNorm, grey input) and a tiny ViT (16 px, dropout 0.1) model folder."""
    from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification

    root = tmp_path_factory.mktemp("image-models")
    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                              layer_type="basic", num_labels=2)).save_pretrained(root / "resnet")
    ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.1,
                                        num_labels=2)).save_pretrained(root / "vit")
    return root


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Three digit classes as PNG files, 12 each: ``root/<class>/<n>.png``."""
    from PIL import Image

    root = tmp_path_factory.mktemp("pngs")
    d = load_digits()
    for cls in ("0", "1", "7"):
        (root / cls).mkdir()
        idx = [i for i, y in enumerate(d.labels) if d.label_names[y] == cls][:12]
        for n, i in enumerate(idx):
            Image.fromarray(d.images[i]).save(root / cls / f"{n}.png")
    return root


def _train(argv, out):
    return main(["train", *argv, "--out", str(out), "--no-progress", "--device", "cpu", "--checkpoint-every", "0"])


def test_digits_train_above_chance_in_train_mode(models, tmp_path, capsys, monkeypatch):
    """Two epochs of a tiny ResNet on digits reach well above chance (0.10; majority 0.13): a fault that
    shuffles labels against images stays near chance. Every training forward runs in train mode, and
    BatchNorm's running statistics are learnt (they stay at their initial 0/1 when training runs in eval
    mode); evaluation runs in eval mode."""
    import transformers

    modes = []
    real_forward = transformers.ResNetForImageClassification.forward

    def spy(self, *a, **k):
        modes.append((self.training, torch.is_grad_enabled()))
        return real_forward(self, *a, **k)

    monkeypatch.setattr(transformers.ResNetForImageClassification, "forward", spy)
    out = tmp_path / "run"
    assert _train(["--data", "digits", "--model", str(models / "resnet"), "--image-size", "16", "--epochs", "2",
                   "--batch-size", "32", "--lr", "3e-3"], out) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] >= 0.6, summary
    assert "held-out accuracy" in capsys.readouterr().out
    assert all(training for training, grad in modes if grad) and any(grad for _, grad in modes)
    assert not any(training for training, grad in modes if not grad)  # evaluation in eval mode
    from safetensors.torch import load_file
    weights = load_file(out / "model" / "model.safetensors")
    means = [v for k, v in weights.items() if k.endswith("running_mean")]
    assert means and all(v.abs().sum() > 0 for v in means)
    pre = json.loads((out / "model" / "tightfit_images.json").read_text())
    assert pre["image_size"] == 16 and pre["num_channels"] == 1 and pre["label_names"][3] == "3"


def test_vit_on_an_image_folder_and_a_csv(models, image_folder, tmp_path):
    """A ViT (3 channels, dropout) trains on PNG class folders and on a CSV of relative paths; the
    run folder is the text runs' (plan, metrics, report, model)."""
    out = tmp_path / "folder-run"
    assert _train(["--data", str(image_folder), "--model", str(models / "vit"), "--max-steps", "2",
                   "--batch-size", "8"], out) == 0
    assert {"plan.json", "metrics.jsonl", "report.md", "summary.json", "model"} <= {p.name for p in out.iterdir()}
    ev = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["type"] == "eval" and 0 <= r["accuracy"] <= 1 for r in ev)
    csv = image_folder / "list.csv"
    rows = [f"{p.relative_to(image_folder)},{p.parent.name}" for p in sorted(image_folder.rglob("*.png"))]
    csv.write_text("file,digit\n" + "\n".join(rows) + "\n")
    data = load_image_classification(str(csv), "digit", "file")
    assert data.label_names == ["0", "1", "7"] and len(data) == 36
    assert _train(["--data", str(csv), "--image-column", "file", "--label-column", "digit", "--model",
                   str(models / "vit"), "--max-steps", "1", "--batch-size", "8"], tmp_path / "csv-run") == 0


def test_pixel_values_shape_and_range():
    grey = np.array([[0, 255], [255, 0]], dtype=np.uint8)
    x = pixel_values(grey, 6, 3)
    assert x.shape == (3, 6, 6) and x.dtype == torch.float32 and -1 <= x.min() < x.max() <= 1
    assert torch.equal(x[0], x[2])  # grey repeated into RGB
    rgb = np.zeros((4, 4, 3), dtype=np.uint8)
    assert pixel_values(rgb, 4, 1).shape == (1, 4, 4)
    d = load_digits()
    pv, y = ImageSamples(d, 8, 1)[5]
    assert pv.shape == (1, 8, 8) and int(y) == d.labels[5]


def _bad(argv, tmp_path, capsys, message):
    out = tmp_path / "run"
    assert _train(argv, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tightfit: error:") and message in err[0], err
    assert not out.exists()


def test_empty_folder_is_refused(models, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    _bad(["--data", str(tmp_path / "empty"), "--model", str(models / "resnet")], tmp_path, capsys, "no class folders")


def test_one_class_is_refused(models, tmp_path, capsys, image_folder):
    import shutil
    root = tmp_path / "one"
    shutil.copytree(image_folder / "7", root / "7")
    _bad(["--data", str(root), "--model", str(models / "resnet")], tmp_path, capsys, "need at least 2")


def test_a_class_folder_without_images_is_refused_not_dropped(tmp_path, image_folder):
    """A class folder holding no image (here a text file) was left out of the classes without a word."""
    import shutil

    from tightfit.errors import TightfitError
    from tightfit.images import load_image_classification

    root = tmp_path / "three"
    shutil.copytree(image_folder, root)
    (root / "green").mkdir()
    (root / "green" / "readme.txt").write_text("no images here")
    with pytest.raises(TightfitError, match=r"class folder 'green' holds no image \(") as e:
        load_image_classification(str(root))
    assert "\n" not in str(e.value)


def test_unreadable_image_is_refused(models, tmp_path, capsys, image_folder):
    import shutil
    root = tmp_path / "broken"
    shutil.copytree(image_folder, root, ignore=shutil.ignore_patterns("*.csv"))
    (root / "1" / "3.png").write_bytes(b"\x89PNG\r\n\x1a\nnot an image")
    _bad(["--data", str(root), "--model", str(models / "resnet")], tmp_path, capsys, "3.png: not a readable image")


def test_csv_without_the_path_column_is_refused(models, tmp_path, capsys):
    (tmp_path / "l.csv").write_text("image,label\na.png,1\n")
    _bad(["--data", str(tmp_path / "l.csv"), "--model", str(models / "resnet")], tmp_path, capsys,
         "no column 'path' (--image-column)")


def test_images_with_a_text_model_and_an_image_model_without_data(models, tmp_path, capsys):
    _bad(["--data", "digits"], tmp_path, capsys, "is a text model")
    _bad(["--model", "resnet50"], tmp_path, capsys, "give --data")
    _bad(["--data", "digits", "--model", str(models / "vit"), "--image-size", "32"], tmp_path, capsys,
         "takes 16 x 16 images")


def test_missing_image_in_csv_is_refused(tmp_path):
    (tmp_path / "l.csv").write_text("path,label\nnope.png,1\n")
    with pytest.raises(TightfitError, match="image not found"):
        load_image_classification(str(tmp_path / "l.csv"))


def test_digits_file_without_scikit_learn_is_the_same(monkeypatch):
    from pathlib import Path
    monkeypatch.setenv("TIGHTFIT_DIGITS", str(Path(__file__).parents[1] / "bench" / "data" / "digits.csv.gz"))
    from_file = load_digits()
    monkeypatch.delenv("TIGHTFIT_DIGITS")
    from_sklearn = load_digits()
    assert from_file.labels == from_sklearn.labels
    assert all(np.array_equal(a, b) for a, b in zip(from_file.images, from_sklearn.images))


def test_resume_of_an_image_run_finds_its_recipe_and_data(models, tmp_path, capsys):
    """``--resume`` reads the run's own options (an image model, digits): the image recipe, the same
    images (fingerprint checked), and a finished run is left as it is."""
    out = tmp_path / "run"
    assert _train(["--data", "digits", "--model", str(models / "resnet"), "--image-size", "8", "--max-steps", "2",
                   "--batch-size", "16", "--eval-samples", "20"], out) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert "already finished at step 2" in capsys.readouterr().out
    # one of its checkpoints named (as a stop on non-finite gradients advises): the same recipe and
    # device, from the run folder above it
    from tightfit.cli import _parser
    from tightfit.runtime.launch import device_of

    (out / "summary.json").unlink()  # as if stopped before the end
    ckpt = out / "checkpoints" / "ckpt-2"  # the last: the resumed run evaluates and finishes
    assert device_of(_parser().parse_args(["train", "--resume", str(ckpt)])) == "cpu"
    assert main(["train", "--resume", str(ckpt), "--no-progress"]) == 0
    assert (out / "summary.json").is_file()


@pytest.mark.gpu
def test_digits_on_the_gpu_under_a_budget(models, tmp_path):
    """The image recipe on a CUDA GPU: planned under a 2 GiB budget, trained, above chance."""
    out = tmp_path / "run"
    assert main(["train", "--data", "digits", "--model", str(models / "resnet"), "--image-size", "16", "--epochs", "2",
                 "--batch-size", "32", "--lr", "3e-3", "--budget", "2GiB", "--compile", "off", "--out", str(out),
                 "--no-progress", "--checkpoint-every", "0"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["accuracy"] >= 0.6 and s["peak_reserved_bytes"] <= 2 * 2**30 and s["device"] != "CPU", s


def test_8bit_state_and_two_ranks_train_an_image_model_and_save_it(models, tmp_path):
    """8-bit AdamW's learning rate goes into the metrics record as a JSON number (torchao's, used
    before, kept it as a tensor), and under DDP the model is saved out of its wrapper: both used to
    crash a finished run."""
    import json

    base = ["--data", "digits", "--model", str(models / "resnet"), "--image-size", "8", "--max-steps", "3",
            "--batch-size", "16", "--eval-samples", "20", "--log-every", "1"]
    pytest.importorskip("bitsandbytes")
    assert _train(base + ["--optimizer", "adamw8bit"], tmp_path / "8bit") == 0
    assert all(isinstance(json.loads(line)["lr"], float)
               for line in (tmp_path / "8bit" / "metrics.jsonl").read_text().splitlines() if '"lr"' in line)
    assert _train(base + ["--gpus", "2"], tmp_path / "ddp") == 0
    assert (tmp_path / "ddp" / "model" / "config.json").exists()


_SIZE_ARGS = {"train": ["--data", "digits", "--device", "cpu", "--no-progress"],
              "plan": ["--batch-size", "8", "--budget", "4GiB", "--json"],
              "estimate": ["--micro-batch", "2", "--precision", "fp32", "--json"]}


@pytest.mark.parametrize("command", ["train", "plan", "estimate"])
def test_vit_image_size_is_checked_alike_by_train_plan_and_estimate(command, tmp_path, capsys, monkeypatch):
    """`plan` and `estimate` of vit-b16 refused every --image-size but 224 (the model was built for
    224, then traced at the size asked), while `train` built it for the size: one check
    (:meth:`ModelEntry.fit_image_size`) for all three, a whole number of 16 px patches, refused in
    one line before any image is read."""
    import tightfit.image_train as image_train

    def no_work(*a, **k):
        raise AssertionError("images read")

    monkeypatch.setattr(image_train, "load_image_classification", no_work)
    out = ["--out", str(tmp_path / "run")] if command == "train" else []
    assert main([command, "--model", "vit-b16", "--image-size", "100", *_SIZE_ARGS[command], *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tightfit: error: --image-size 100: vit-b16 cuts images into 16 x 16 patches; use a multiple "
                   "of 16, e.g. 96 or 112"], err
    assert not (tmp_path / "run").exists()
    if command != "train":  # train built it for the size asked already; plan and estimate now do
        assert main([command, "--model", "vit-b16", "--image-size", "160", *_SIZE_ARGS[command]]) == 0
        assert json.loads(capsys.readouterr().out)


def _wide_grey(mode, value):
    """A 6 x 6 PIL image of one ``value`` in a wide grey ``mode`` (16-bit integer, 32-bit integer or float)."""
    from PIL import Image

    if mode == "F":
        return Image.fromarray(np.full((6, 6), value, np.float32))
    if mode == "I":
        return Image.fromarray(np.full((6, 6), value, np.int32))
    dtype = {"I;16": "<u2", "I;16L": "<u2", "I;16B": ">u2"}[mode]
    return Image.frombytes(mode, (6, 6), np.full((6, 6), value, dtype).tobytes())


@pytest.mark.parametrize("mode,dark,bright", [("I;16", 10000, 50000), ("I;16L", 10000, 50000),
                                              ("I;16B", 10000, 50000), ("I", 10000, 50000), ("F", 0.15, 0.75)])
def test_16_bit_and_float_grey_images_keep_their_levels(mode, dark, bright, tmp_path):
    """16-bit (and 32-bit integer, and float) grey images went through PIL's ``convert("L")``, which
    clips: every pixel became 255 and a dark class could not be told from a bright one. They are
    scaled to 0-255 from their own range (16-bit: / 257; float: x 255)."""
    root = tmp_path / "wide"
    for cls, value in (("dark", dark), ("bright", bright)):
        (root / cls).mkdir(parents=True)
        for n in range(3):
            _wide_grey(mode, value).save(root / cls / f"{n}.{'png' if mode == 'I;16' else 'tif'}")
    from PIL import Image

    with Image.open(next((root / "dark").iterdir())) as im:  # the file really is a wide grey image
        assert im.mode in ("I;16", "I;16L", "I;16B", "I", "F"), im.mode
    data = load_image_classification(str(root))
    samples = ImageSamples(data, 6, 1)
    means = {data.label_names[int(y)]: float(x.mean()) for x, y in (samples[i] for i in range(len(data)))}
    expect = {"dark": dark / 65535 if mode != "F" else dark, "bright": bright / 65535 if mode != "F" else bright}
    for cls, level in expect.items():  # pixel_values is (x / 255 - 0.5) / 0.5
        assert means[cls] == pytest.approx(2 * level - 1, abs=0.01), (cls, means)


def test_float_image_outside_0_1_is_refused_before_any_work(models, tmp_path, capsys):
    root = tmp_path / "float"
    for cls, value in (("a", 0.2), ("b", 0.6)):
        (root / cls).mkdir(parents=True)
        for n in range(12):  # enough rows to train on
            _wide_grey("F", value).save(root / cls / f"{n}.tif")
    _wide_grey("F", 200.0).save(root / "b" / "3.tif")
    _bad(["--data", str(root), "--model", str(models / "resnet")], tmp_path, capsys,
         "3.tif: a float image with values outside [0, 1]")


def test_32_bit_integer_image_of_8_bit_levels_is_refused_before_any_work(models, tmp_path, capsys):
    """A 32-bit integer grey image holding 0-255 (what PIL's convert("I") makes of a photo) was read
    as 16-bit: 200 became 1 of 255, a nearly black image, without a word."""
    root = tmp_path / "int32"
    for cls, value in (("a", 10000), ("b", 50000)):
        (root / cls).mkdir(parents=True)
        for n in range(12):
            _wide_grey("I", value).save(root / cls / f"{n}.tif")
    _wide_grey("I", 200).save(root / "b" / "3.tif")
    _bad(["--data", str(root), "--model", str(models / "resnet")], tmp_path, capsys,
         "3.tif: a 32-bit integer image with values 0-200")


def test_a_dark_16_bit_pgm_is_read_as_16_bit_not_refused(tmp_path):
    """Pillow opens a 16-bit PGM as mode "I", as it does a 32-bit integer TIFF: a dark one (no level
    above 255) is 16-bit all the same, read as such, not refused as 8-bit levels in 32 bits."""
    from PIL import Image

    from tightfit.images import load_image

    Image.fromarray(np.full((6, 6), 200, np.uint16)).save(tmp_path / "dark.pgm")
    with Image.open(tmp_path / "dark.pgm") as im:
        assert im.mode == "I"
    assert load_image(str(tmp_path / "dark.pgm")).max() == round(200 / 257)


def test_jsonl_list_with_integer_label_0_keeps_those_rows(image_folder, tmp_path):
    """``str(0 or "")`` made every JSONL row of label 0 (a JSON number) blank: those rows were dropped,
    leaving one class. Only a missing, null or empty value is blank."""
    rows = [{"path": str(p), "label": int(p.parent.name == "1")} for p in sorted(image_folder.rglob("*.png"))
            if p.parent.name in ("0", "1")]
    rows.append({"path": str(rows[0]["path"]), "label": None})  # blank: skipped
    rows.append({"path": "", "label": 1})  # blank: skipped
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_image_classification(str(tmp_path / "l.jsonl"))
    assert data.label_names == ["0", "1"] and len(data) == 24 and data.skipped_blank == 2
    assert sorted(data.labels) == [0] * 12 + [1] * 12
    rows.append({"path": str(rows[0]["path"]), "label": -100})  # no label (the ignore index): skipped, no class
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_image_classification(str(tmp_path / "l.jsonl"))
    assert (data.label_names, len(data), data.skipped_blank, data.skipped_unlabelled) == (["0", "1"], 24, 2, 1)


def test_a_list_label_written_as_two_numbers_is_refused_and_a_minus_minus_label_is_a_name(image_folder, tmp_path):
    """JSONL labels 1 and 1.0 (a column that became floats in some rows) were two classes, the
    model an output too many (a text list refuses them); a label ``--1`` passed the digit test of
    the numeric sort and crashed ``int()`` with a traceback."""
    paths = sorted(image_folder.rglob("*.png"))
    rows = [{"path": str(p), "label": 1.0 if p.parent.name == "7" else int(p.parent.name == "1")} for p in paths]
    rows[0]["label"] = 1
    (tmp_path / "l.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TightfitError, match=r"labels '1' and '1.0' are the same number written two ways in column "
                                            r"'label'"):
        load_image_classification(str(tmp_path / "l.jsonl"))
    (tmp_path / "l.csv").write_text("path,label\n" + "".join(f"{p},{'--1' if p.parent.name == '7' else '2'}\n"
                                                              for p in paths))
    assert load_image_classification(str(tmp_path / "l.csv")).label_names == ["--1", "2"]


def test_truncated_jpeg_is_refused_before_any_work(models, tmp_path, capsys):
    """``Image.verify()`` does not decode JPEG data: a JPEG cut short passed the up-front check and
    crashed training with a traceback, after the run folder was started. Every image is decoded."""
    from PIL import Image

    root, rng = tmp_path / "trunc", np.random.default_rng(0)
    for cls in "ab":
        (root / cls).mkdir(parents=True)
        for n in range(12):  # enough rows to train on
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(root / cls / f"{n}.jpg", quality=90)
    whole = (root / "a" / "0.jpg").read_bytes()
    (root / "a" / "0.jpg").write_bytes(whole[:len(whole) // 2])
    _bad(["--data", str(root), "--model", str(models / "resnet"), "--max-steps", "2"], tmp_path, capsys,
         "0.jpg: not a readable image")


@pytest.mark.parametrize("option", [["--image-column", "file"], ["--label-column", "digit"]])
@pytest.mark.parametrize("data", ["digits", "folder"])
def test_list_column_options_with_digits_or_a_class_folder_are_refused(option, data, models, image_folder, tmp_path,
                                                                       capsys):
    """``--image-column`` and ``--label-column`` name columns of a CSV/JSONL list: with digits or a
    class folder they were silently ignored."""
    spec = "digits" if data == "digits" else str(image_folder)
    _bad(["--data", spec, "--model", str(models / "resnet"), *option], tmp_path, capsys,
         f"{option[0]} does not apply")


def test_an_epoch_ending_in_a_one_sample_window_of_a_batchnorm_model_is_refused_before_planning(models, tmp_path,
                                                                                                   capsys):
    """1,617 training digits at batch 16: each epoch's last window holds one sample, which the
    ResNet's BatchNorm cannot train on. The run died there (torch's 'Expected more than 1 value per
    channel'), after planning and a whole epoch; it is one line before planning now, nothing written."""
    _bad(["--data", "digits", "--model", str(models / "resnet"), "--image-size", "8", "--batch-size", "16",
          "--epochs", "1"], tmp_path, capsys,
         "BatchNorm layers cannot train on a micro-batch of 1 sample, and the last window of each epoch holds 1 "
         "sample (1617 training samples, effective batch 16); choose another --batch-size (or drop a sample)")
    # at batch 1 every window holds one sample: dropping one cannot help, only a larger batch (a fresh user)
    _bad(["--data", "digits", "--model", str(models / "resnet"), "--image-size", "8", "--batch-size", "1",
          "--epochs", "1"], tmp_path, capsys, "choose a --batch-size of at least 2")


def test_a_folder_saved_by_tightfit_keeps_the_side_it_was_trained_at(models, tmp_path):
    """A ResNet's config names no image size: fine-tuning a tightfit run's ``model/`` without
    ``--image-size`` took 224 x 224 images after training at 16 (4.4 times the pixels per side, another
    model's input); the side of its ``tightfit_images.json`` is now the default, ``--image-size`` still
    wins, and a record naming no usable side falls back to 224."""
    from tightfit.images import PREPROCESSING_FILE, preprocessing_record
    from tightfit.models import DEFAULT_IMAGE_SIZE, resolve
    folder = tmp_path / "model"
    shutil.copytree(models / "resnet", folder)
    entry = resolve(str(folder))
    config = entry.load_config()[1]
    assert entry.fit_image_size(config, None) == DEFAULT_IMAGE_SIZE  # not saved by tightfit
    (folder / PREPROCESSING_FILE).write_text(json.dumps(preprocessing_record(16, 1, ["0", "1"])))
    assert entry.fit_image_size(config, None) == 16
    assert entry.fit_image_size(config, 32) == 32
    for bad in ('{"image_size": "16"}', '[16]', '{"image_size": true}', "not json"):
        (folder / PREPROCESSING_FILE).write_text(bad)
        assert entry.fit_image_size(config, None) == DEFAULT_IMAGE_SIZE


def test_a_convolutional_model_whose_config_names_an_image_side_takes_another(models, tmp_path, capsys):
    """ConvNeXt's (MobileNet's, EfficientNet's) config names an ``image_size`` it has no position
    embeddings for: any other --image-size was refused "(its position embeddings)", forcing 224
    (600 for EfficientNet's default). Only a folder whose weights hold position embeddings (the
    ViT's) is held to its side."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    torch.manual_seed(0)
    ConvNextForImageClassification(ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2,
                                                  num_labels=2)).save_pretrained(tmp_path / "convnext")
    assert main(["plan", "--model", str(tmp_path / "convnext"), "--image-size", "32", "--batch-size", "8",
                 "--gpu", "t4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["micro_batch"] >= 1
    assert main(["plan", "--model", str(models / "vit"), "--image-size", "32", "--batch-size", "8", "--gpu", "t4"]) == 2
    assert "takes 16 x 16 images (its position embeddings)" in capsys.readouterr().err


def test_digits_with_a_folder_named_digits_here_is_refused(models, image_folder, tmp_path, capsys, monkeypatch):
    """``--data digits`` trained on scikit-learn's digits without a word while ./digits held the user's images."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(image_folder, tmp_path / "digits")
    _bad(["--data", "digits", "--model", str(models / "resnet"), "--image-size", "8"], tmp_path, capsys,
         "--data digits names scikit-learn's digits, but this folder also holds a folder named digits: give "
         "--data ./digits for the folder")
    assert load_image_classification("./digits").label_names == ["0", "1", "7"]


def test_a_model_sized_by_its_image_side_without_position_embeddings_is_held_to_it(tmp_path, capsys):
    """LeViT's attention biases are sized by its config's image side, with no weight named as a
    position embedding: another --image-size was taken (after the ConvNeXt fix) and the forward
    failed mid-run ("The size of tensor a (9) must match ..."). One forward on meta tensors at the
    size asked now decides, in one line before any image is read."""
    from transformers import LevitConfig, LevitForImageClassification

    torch.manual_seed(0)
    LevitForImageClassification(LevitConfig(image_size=64, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2],
                                            depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=2)
                                ).save_pretrained(tmp_path / "levit")
    capsys.readouterr()  # save_pretrained's progress bar
    args = ["plan", "--model", str(tmp_path / "levit"), "--batch-size", "8", "--gpu", "t4"]
    assert main([*args, "--image-size", "48"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--image-size 48: the model in" in err[0] and "use --image-size 64" in err[0], err
    assert main([*args, "--image-size", "64", "--json"]) == 0


def test_attention_keeps_cudnn_for_images_and_a_text_run_trains_without_it(models, tmp_path, monkeypatch):
    """A text run's micro-batches are padded to their longest text, so each new length is a new
    shape, for which cuDNN's attention builds a graph (115-175 ms per eager step at a new shape on
    an H100); a text run's api.train runs without cuDNN's kernels (seen here while the trainer
    trains; planning and evaluation are inside the same block), and the setting is put back after.
    An image run's shapes are fixed: PyTorch's choice stays."""
    from conftest import tiny_cpu_job

    from tightfit import api
    from tightfit.config import TrainRequest
    from tightfit.runtime.trainer import Trainer

    seen = []
    fit = Trainer.fit
    monkeypatch.setattr(Trainer, "fit", lambda self: (seen.append(torch.backends.cuda.cudnn_sdp_enabled()), fit(self))[1])
    assert torch.backends.cuda.cudnn_sdp_enabled()
    (tmp_path / "text").mkdir()
    api.train(TrainRequest(**tiny_cpu_job(tmp_path / "text"), max_steps=1, out=str(tmp_path / "text-run")))
    assert _train(["--data", "digits", "--model", str(models / "resnet"), "--image-size", "16", "--max-steps", "1",
                   "--device", "cpu", "--out", str(tmp_path / "image-run")], tmp_path / "image-run") == 0
    assert seen == [False, True] and torch.backends.cuda.cudnn_sdp_enabled()


def test_overlapping_runs_leave_the_attention_setting_as_they_found_it():
    """The cuDNN attention setting is the process's: two text runs overlapping in threads (the
    review's case) turned it back on under the second and left it off after both. Counted now:
    off while any is inside, put back when the last leaves, whatever the order."""
    from tightfit.levers.attention import without_cudnn_attention

    assert torch.backends.cuda.cudnn_sdp_enabled()
    first, second = without_cudnn_attention(), without_cudnn_attention()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first run ends while the second trains
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    second.__exit__(None, None, None)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with without_cudnn_attention(False):
        assert torch.backends.cuda.cudnn_sdp_enabled()

