"""Faults a careful user found in the image path and in loading a model folder: a head kept under
other class names, EXIF orientation, hidden files, channel counts, dangling links."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from tightfit.cli import main  # noqa: E402
from tightfit.errors import TightfitError  # noqa: E402
from tightfit.images import load_image, load_image_classification  # noqa: E402


def _resnet_folder(path, channels=1, labels=("cat", "dog", "eel")):
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    id2label = dict(enumerate(labels))
    ResNetForImageClassification(ResNetConfig(
        num_channels=channels, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=len(labels), id2label=id2label, label2id={v: k for k, v in id2label.items()})).save_pretrained(path)
    return path


def _head(model):
    return [p.detach().clone() for n, p in model.named_parameters() if n.startswith("classifier")]


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_folder_head_of_as_many_other_classes_is_new_and_seeded_and_one_of_the_same_classes_is_kept(tmp_path):
    """from_pretrained(ignore_mismatched_sizes=True) replaced only a head of another shape: the
    same images under permuted class names kept the old head (0.0 held-out accuracy)."""
    from safetensors.torch import load_file

    from tightfit.image_train import load_image_classifier
    from tightfit.models import resolve

    folder = _resnet_folder(tmp_path / "m")
    stored = load_file(folder / "model.safetensors")
    saved = [stored["classifier.1.weight"], stored["classifier.1.bias"]]  # named_parameters' order
    entry = resolve(str(folder))

    def head(labels, seed):
        torch.manual_seed(seed)
        return _head(load_image_classifier(entry, labels, 16)[0])

    assert _same(head(["cat", "dog", "eel"], 0), saved)  # the classes it was trained on: training goes on
    new = head(["ant", "bee", "cow"], 0)
    assert not any(torch.equal(a, b) for a, b in zip(new, saved) if a.abs().sum() > 0)
    assert _same(head(["ant", "bee", "cow"], 0), new) and not _same(head(["ant", "bee", "cow"], 1), new)
    assert not _same(head(["dog", "cat", "eel"], 0), saved)  # the same names in another order are other classes


def test_a_text_folder_head_of_as_many_other_classes_is_new(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    from tightfit.models import default_model_path, load_classifier

    id2label = {0: "neg", 1: "pos"}
    torch.manual_seed(0)
    BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, num_labels=2, id2label=id2label,
                                             label2id={"neg": 0, "pos": 1})).save_pretrained(tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (default_model_path() / f).exists():
            shutil.copy(default_model_path() / f, tmp_path / "m" / f)
    kept = _head(load_classifier(tmp_path / "m", ["neg", "pos"])[0])
    assert not _same(_head(load_classifier(tmp_path / "m", ["pos", "neg"])[0]), kept)


def test_a_run_says_whether_the_model_folders_head_was_kept_or_replaced(tmp_path, caplog):
    """Training on from a folder with a classification head: kept for the same classes, replaced
    for other names, another order or another number of classes; both trained without a word, and
    only the first losses told them apart (a fresh user's finding). A base model (no head), or a
    head with transformers' default class names (LABEL_0, ...: never trained on named classes),
    says nothing. `tightfit train` shows the note and records it with the run's notes."""
    import logging

    from transformers import BertConfig, BertForSequenceClassification, BertModel

    from tightfit.models import default_model_path, load_classifier

    def folder(name, model):
        model.save_pretrained(tmp_path / name)
        for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            if (default_model_path() / f).exists():
                shutil.copy(default_model_path() / f, tmp_path / name / f)
        return tmp_path / name

    config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    headed = folder("m", BertForSequenceClassification(BertConfig(**config, num_labels=2, id2label={0: "neg", 1: "pos"},
                                                                  label2id={"neg": 0, "pos": 1})))
    base = folder("base", BertModel(BertConfig(**config)))
    unnamed = folder("unnamed", BertForSequenceClassification(BertConfig(**config, num_labels=2)))  # LABEL_0, LABEL_1

    def notes(path, labels):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tightfit.models"):
            load_classifier(path, labels)
        return [r.getMessage() for r in caplog.records if r.name == "tightfit.models"]

    assert notes(headed, ["neg", "pos"]) == [f"note: the classification head of {headed} (2 classes: neg, pos) is "
                                             "kept: the data's classes are the same, so training goes on from it"]
    assert notes(headed, ["pos", "neg"]) == [f"note: the classification head of {headed} (2 classes: neg, pos) is "
                                             "replaced by a new one for the data's classes (pos, neg): other names or "
                                             "another order"]
    assert notes(headed, ["a", "b", "c"]) == [f"note: the classification head of {headed} (2 classes: neg, pos) is "
                                              "replaced by a new one for the data's 3 classes"]
    assert notes(base, ["neg", "pos"]) == [] and notes(unnamed, ["neg", "pos"]) == []  # no head, or never trained on named classes


def test_exif_orientation_is_applied(tmp_path):
    img = Image.fromarray(np.zeros((20, 40, 3), dtype=np.uint8))  # stored 40 wide, 20 high
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned a quarter: 20 wide, 40 high
    img.save(tmp_path / "photo.jpg", exif=exif)
    assert load_image(str(tmp_path / "photo.jpg")).shape == (40, 20, 3)


@pytest.mark.parametrize("mode", ["L", "I;16"])
def test_an_uncompressed_grey_tiff_turned_by_its_orientation_is_read_in_training_as_checked(mode, tmp_path):
    """Opened by its path, Pillow memory-maps an uncompressed grey TIFF at its turned size before
    turning it (orientation 5-8): training got a scrambled image, while the up-front check, which
    decodes the file's bytes, saw it right. Both decode from memory now."""
    import io

    bar = np.zeros((20, 30), dtype=np.uint8)
    bar[2:5, 3:25] = 255  # a horizontal bar, stored 30 wide and 20 high
    exif = Image.Exif()
    exif[0x0112] = 6  # displayed turned a quarter clockwise: a vertical bar
    img = Image.fromarray(bar) if mode == "L" else Image.frombytes(mode, (30, 20), (bar.astype("<u2") * 257).tobytes())
    img.save(tmp_path / "bar.tif", exif=exif)
    shown = np.rot90(bar, -1)  # 20 wide, 30 high
    assert np.array_equal(load_image(io.BytesIO((tmp_path / "bar.tif").read_bytes())), shown)  # as checked
    assert np.array_equal(load_image(str(tmp_path / "bar.tif")), shown)  # as ImageSamples reads it in training


def test_transparent_parts_are_white_whatever_colour_is_stored_under_them(tmp_path):
    """A black mark on a transparent background: the colour stored under the transparent pixels
    (black, white, a palette entry of red) became the background, so images that look the same
    gave other pixels. They are shown over white, as transformers' convert_to_rgb shows them."""
    mark = np.zeros((8, 8, 4), dtype=np.uint8)
    mark[2:6, 3:5, 3] = 255  # opaque black; elsewhere transparent black
    under_white = mark.copy()
    under_white[..., :3][mark[..., 3] == 0] = 255
    Image.fromarray(mark, "RGBA").save(tmp_path / "black.png")
    Image.fromarray(under_white, "RGBA").save(tmp_path / "white.png")
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([255, 0, 0, 0, 0, 0] + [0] * 762)  # 0: red, shown transparent; 1: black
    palette.paste(1, (3, 2, 5, 6))
    palette.save(tmp_path / "palette.png", transparency=0)
    grey = np.zeros((8, 8, 2), dtype=np.uint8)
    grey[2:6, 3:5, 1] = 255
    Image.fromarray(grey, "LA").save(tmp_path / "grey.png")
    shown = np.full((8, 8, 3), 255, dtype=np.uint8)
    shown[2:6, 3:5] = 0
    for name in ("black", "white", "palette"):
        assert np.array_equal(load_image(str(tmp_path / f"{name}.png")), shown), name
    assert np.array_equal(load_image(str(tmp_path / "grey.png")), shown[..., 0])  # grey stays grey


def _train_once(capsys, root, folder, out):
    """``tightfit train`` of the ResNet in ``folder`` on the images under ``root``, one step on the
    CPU into ``out``: its exit code and the lines it wrote to stderr."""
    capsys.readouterr()
    code = main(["train", "--data", str(root), "--model", str(folder), "--image-size", "8", "--out", str(out),
                 "--device", "cpu", "--no-progress", "--max-steps", "1"])
    return code, capsys.readouterr().err.strip().splitlines()


def _folder(root, n=10):
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(np.full((8, 8), 25 * i, dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def test_hidden_files_and_folders_in_a_class_folder_are_not_samples(tmp_path):
    root = _folder(tmp_path / "data")
    (root / "a" / ".ipynb_checkpoints").mkdir()
    shutil.copy(root / "a" / "0.png", root / "a" / ".ipynb_checkpoints" / "0-checkpoint.png")
    shutil.copy(root / "b" / "1.png", root / "b" / ".hidden.png")
    data = load_image_classification(str(root))
    assert len(data) == 20 and not any("/." in p for p in data.images)


def test_a_link_to_no_file_is_refused_not_dropped(tmp_path):
    root = _folder(tmp_path / "data")
    os.symlink(tmp_path / "nowhere.png", root / "a" / "z.png")
    with pytest.raises(TightfitError, match=r"z.png: a link to .*nowhere.png, which does not exist"):
        load_image_classification(str(root))


def test_a_fifo_or_socket_in_a_class_folder_is_noted_and_one_named_as_an_image_is_refused(tmp_path, caplog, capsys):
    """A FIFO or a socket in a class folder was dropped without a word (only regular files were
    counted in the note of skipped files), and so was one named as an image (z.png): fewer samples
    than the folder shows. Without an image ending it is counted in the note; with one it is refused
    in one line before anything is written, as a link to nothing is (reading a FIFO would wait)."""
    import socket

    root = _folder(tmp_path / "data")
    os.mkfifo(root / "a" / "pipe")
    listener = socket.socket(socket.AF_UNIX)
    try:
        listener.bind(str(root / "b" / "listener"))
        with caplog.at_level("WARNING", logger="tightfit"):
            data = load_image_classification(str(root))
    finally:
        listener.close()
    assert len(data) == 20
    notes = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith(f"note: {root}: 2 files skipped, outside the class folders or "
                                                   "without an image ending (") and notes[0].endswith("e.g. a/pipe"), notes

    os.mkfifo(root / "b" / "z.png")
    folder, out = _resnet_folder(tmp_path / "resnet"), tmp_path / "run"
    code, err = _train_once(capsys, root, folder, out)
    assert code == 2 and err == [f"tightfit: error: {root / 'b' / 'z.png'}: a named pipe (FIFO), not an image file; "
                                 "replace it with the image or move it out of the class folder"], (code, err)
    assert not out.exists()


def test_images_in_a_linked_subfolder_of_a_class_are_that_classs_and_a_link_up_is_entered_once(tmp_path):
    """``rglob`` does not enter a link to a folder: the 10 images of class a's linked subfolder were
    left out without a word (not even in the note of skipped files)."""
    root = _folder(tmp_path / "data")
    _folder(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere" / "a", root / "a" / "more")
    os.symlink(root / "b", root / "b" / "loop")  # back up to itself: entered once
    data = load_image_classification(str(root))
    assert len(data) == 30 and data.labels.count(data.label_names.index("a")) == 20
    assert sum("more" in p for p in data.images) == 10 and not any("loop" in p for p in data.images)


def test_a_model_of_four_input_channels_is_refused_in_one_line(tmp_path, capsys):
    folder = _resnet_folder(tmp_path / "m4", channels=4, labels=("a", "b"))
    root = _folder(tmp_path / "data")
    out = tmp_path / "run"
    code = main(["train", "--data", str(root), "--model", str(folder), "--image-size", "8", "--out", str(out),
                 "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "takes 4 input channels" in err[0], err
    assert not out.exists()
    assert json.loads((folder / "config.json").read_text())["num_channels"] == 4


def test_a_clip_head_of_as_many_other_classes_is_new(tmp_path):
    """CLIP's base_model_prefix ("clip") names no child of its image classifier: the head is found
    by which parameters change shape with the number of classes."""
    from transformers import CLIPConfig, CLIPForImageClassification

    from tightfit.image_train import load_image_classifier
    from tightfit.models import resolve

    id2label = {0: "cat", 1: "dog", 2: "eel"}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    model = CLIPForImageClassification(CLIPConfig(vision_config=vision, num_labels=3, id2label=id2label,
                                                  label2id={v: k for k, v in id2label.items()}))
    with torch.no_grad():
        model.classifier.weight.fill_(0.5)
    model.save_pretrained(tmp_path / "clip")
    entry = resolve(str(tmp_path / "clip"))
    kept = load_image_classifier(entry, ["cat", "dog", "eel"], 32)[0]
    assert torch.all(kept.classifier.weight == 0.5)
    new = load_image_classifier(entry, ["dog", "cat", "eel"], 32)[0]
    assert not torch.any(new.classifier.weight == 0.5)
    assert torch.equal(new.vision_model.embeddings.patch_embedding.weight, kept.vision_model.embeddings.patch_embedding.weight)


def test_an_out_inside_the_data_folder_is_refused(tmp_path, capsys):
    """Its files (loss.png) became samples of a class of its own, and the run, whose data then
    changed, could not be resumed."""
    folder = _resnet_folder(tmp_path / "m", labels=("a", "b"))
    root = _folder(tmp_path / "data")
    capsys.readouterr()  # saving the model folder printed its progress
    code = main(["train", "--data", str(root), "--model", str(folder), "--image-size", "8", "--out",
                 str(root / "run"), "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is inside the data folder" in err[0], err
    assert sorted(p.name for p in root.iterdir()) == ["a", "b"]


def _distinct_folder(root, n):
    """Classes a and b of ``n`` images each, no two alike."""
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def _split_notes(data):
    from tightfit.data import check_split, held_out_split

    train, held = held_out_split(len(data))
    return check_split(data, data.subset(train), data.subset(held)), train, held


def test_held_out_images_that_are_also_training_images_are_noted(tmp_path):
    """A list naming each of 36 images twice: all 7 held-out samples were training samples too, and
    the run said nothing (text runs note it); a copy under another name is the same image."""
    root = _distinct_folder(tmp_path / "data", 18)
    rows = [f"{c}/{i}.png,{c}" for c in ("a", "b") for i in range(18)]
    (root / "dup.csv").write_text("path,label\n" + "\n".join(rows * 2) + "\n")
    data = load_image_classification(str(root / "dup.csv"))
    notes, train, held = _split_notes(data)
    seen = {data.images[i] for i in train}
    copies = sum(data.images[i] in seen for i in held)
    assert copies > 0
    assert [n for n in notes if "also appear" in n] == [
        f"{copies} held-out samples ({copies / len(held):.1%}) also appear among the training samples as the same image "
        "file, byte for byte (files repeated in the data): the held-out accuracy counts them as unseen"]
    assert not [n for n in _split_notes(load_image_classification(str(root)))[0] if "also appear" in n]
    (root / "c").mkdir()  # copies under other names: a's images, once more as class c
    for i in range(18):
        shutil.copy(root / "a" / f"{i}.png", root / "c" / f"copy{i}.png")
    notes = _split_notes(load_image_classification(str(root)))[0]
    assert [n for n in notes if "also appear" in n]
    assert [n for n in notes if "labels" in n] == [
        "18 images are in the data under two or more labels (e.g. a/0.png as 'a' and c/copy0.png, byte for byte the "
        "same, as 'c'): the model is taught both; correct the labels if one is wrong"]


def test_an_image_listed_under_two_labels_is_noted(tmp_path):
    root = _distinct_folder(tmp_path / "data", 10)
    rows = [f"{c}/{i}.png,{c}" for c in ("a", "b") for i in range(10)] + ["a/3.png,b"]
    (root / "l.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    notes = _split_notes(load_image_classification(str(root / "l.csv")))[0]
    assert [n for n in notes if "labels" in n] == [
        "1 image is in the data under two or more labels (e.g. a/3.png as 'a' and as 'b'): the model is taught both; "
        "correct the labels if one is wrong"]


def test_files_the_folder_loader_skips_are_noted_and_jfif_jpe_are_images(tmp_path, caplog):
    """Images beside the class folders and JPEGs named .jfif/.jpe were dropped without a word (an
    empty class folder is refused for the same reason: fewer samples than the folder shows)."""
    root = _distinct_folder(tmp_path / "data", 10)
    shutil.copy(root / "a" / "0.png", root / "stray.png")
    Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8)).save(root / "a" / "photo.jfif", format="JPEG")
    Image.fromarray(np.ones((16, 16, 3), dtype=np.uint8)).save(root / "b" / "photo.jpe", format="JPEG")
    (root / "b" / "phone.heic").write_bytes(b"not read")
    with caplog.at_level("WARNING", logger="tightfit"):
        data = load_image_classification(str(root))
    assert len(data) == 22 and {os.path.basename(p) for p in data.images} >= {"photo.jfif", "photo.jpe"}
    notes = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith(f"note: {root}: 2 files skipped, outside the class folders or "
                                                   "without an image ending (") and notes[0].endswith("e.g. stray.png")


def test_a_full_out_folder_and_a_model_of_four_channels_are_refused_before_any_image_is_decoded(tmp_path, capsys,
                                                                                                monkeypatch):
    """A non-empty --out was refused only after every image had been decoded (14.9 s for 120 large
    JPEGs); so was a model of 4 input channels."""
    import tightfit.images

    decoded = []
    monkeypatch.setattr(tightfit.images, "load_image", lambda image: decoded.append(image))
    root = _folder(tmp_path / "data")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    cases = ((_resnet_folder(tmp_path / "m", labels=("a", "b")), tmp_path / "full", "exists and is not empty"),
             (_resnet_folder(tmp_path / "m4", channels=4, labels=("a", "b")), tmp_path / "run", "takes 4 input channels"))
    capsys.readouterr()  # the folders' saving
    for folder, out, message in cases:
        code = main(["train", "--data", str(root), "--model", str(folder), "--image-size", "8", "--out", str(out),
                     "--no-progress", "--device", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
        assert decoded == []


def test_an_empty_file_and_a_file_of_another_kind_are_named_without_the_in_memory_copy(tmp_path):
    """PIL names what it read, and the file is decoded from memory: an empty file or a text file
    named .png was refused as "cannot identify image file <_io.BytesIO object at 0x7f...>"."""
    root = _folder(tmp_path / "data")
    (root / "a" / "empty.png").write_bytes(b"")
    with pytest.raises(TightfitError, match=r"empty.png: not a readable image \(an empty file, 0 bytes\)$"):
        load_image_classification(str(root))
    (root / "a" / "empty.png").write_text("not an image")
    with pytest.raises(TightfitError) as e:
        load_image_classification(str(root))
    assert str(e.value).endswith("empty.png: not a readable image (UnidentifiedImageError: cannot identify image file)")


def test_too_few_images_of_a_class_folder_are_refused_in_its_own_words(tmp_path):
    """A folder of class folders has no rows and no label column: its refusal asked "is the label
    column the label?" of 21 images in 15 class folders. A list of images keeps the list's words."""
    from tightfit.data import check_split, held_out_split

    root = tmp_path / "data"
    for c in range(15):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(2 if c < 6 else 1):
            Image.fromarray(np.full((8, 8), 15 * c + i, dtype=np.uint8)).save(root / f"c{c}" / f"{i}.png")
    data = load_image_classification(str(root))
    train, held_out = (data.subset(i) for i in held_out_split(len(data)))
    with pytest.raises(TightfitError, match=r"15 classes among 21 images \(1.4 per class\).*is each subfolder a class\? "
                                            r"\(need at least 2 images per class on average\)$"):
        check_split(data, train, held_out)
    small = data.subset(range(4))
    with pytest.raises(TightfitError, match=r": 4 usable images are too few"):
        check_split(small, *(small.subset(i) for i in held_out_split(4)))
    (root / "list.csv").write_text("path,label\n" + "".join(f"{p},{data.label_names[y]}\n" for p, y in
                                                            zip(data.images, data.labels)))
    listed = load_image_classification(str(root / "list.csv"))
    with pytest.raises(TightfitError, match=r"among 21 rows .*is the label column the label\?"):
        check_split(listed, *(listed.subset(i) for i in held_out_split(len(listed))))


def test_an_image_rewritten_while_the_run_trains_stops_it_in_one_line_and_it_resumes_once_restored(tmp_path, monkeypatch,
                                                                                                     capsys):
    """Images are read when their batch is made: one rewritten as a file PIL cannot read while the
    run trained (a sync or copy in progress) ended it in an UnidentifiedImageError traceback naming
    "<_io.BytesIO object at 0x7f...>", not the file; one deleted is said in one line already."""
    import re

    from tightfit.report.metrics import MetricsWriter

    root = _folder(tmp_path / "data")
    model = _resnet_folder(tmp_path / "m", labels=("a", "b"))
    kept = {f: f.read_bytes() for f in root.rglob("*.png")}
    real = MetricsWriter.__call__

    def rewrite_all_at_step_2(self, record):  # every image: whichever the next batch reads is unreadable
        if record.get("type") == "train" and record["step"] == 2:
            for f in kept:
                f.write_bytes(b"partly copied")
        return real(self, record)

    monkeypatch.setattr(MetricsWriter, "__call__", rewrite_all_at_step_2)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--data", str(root), "--model", str(model), "--image-size", "8", "--max-steps", "4",
                 "--batch-size", "8", "--checkpoint-every", "1", "--log-every", "1", "--out", str(out),
                 "--no-progress", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0] and "BytesIO" not in err[0], err
    assert re.search(r"\.png: a sample of the data can no longer be read \(UnidentifiedImageError: cannot identify "
                     r"image file\), changed while the run read it; the run is at step [23] of 4; restore it as it "
                     r"was, then continue from the newest checkpoint: tightfit train --resume ", err[0]), err
    monkeypatch.undo()
    for f, data in kept.items():
        f.write_bytes(data)
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0


# ---- a later tester's faults: advice fit for text given for images, PIL's own words

@pytest.mark.parametrize("model", ["resnet50", "folder"])
def test_an_empty_data_with_an_image_model_asks_for_images_not_to_leave_it_out(tmp_path, capsys, model):
    """``--data ""`` with an image model said "leave --data out for the shipped Rotten Tomatoes
    reviews", which that model refuses."""
    model = str(_resnet_folder(tmp_path / "m")) if model == "folder" else model
    capsys.readouterr()
    assert main(["train", "--model", model, "--data", "", "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["tightfit: error: --data is empty: give the images (digits, a folder with one subfolder per class, "
                   "or a CSV of image paths and labels)"], err
    assert not (tmp_path / "run").exists()


def test_one_training_sample_of_a_batchnorm_model_asks_for_more_samples_not_another_batch(tmp_path, capsys):
    """``--train-samples 1`` with a BatchNorm model said "choose another --batch-size (or drop a
    sample)": every window then holds the one sample, so only more samples can help."""
    root = _folder(tmp_path / "data")
    model = str(_resnet_folder(tmp_path / "m", labels=("a", "b")))
    capsys.readouterr()
    assert main(["train", "--data", str(root), "--model", model, "--image-size", "8", "--train-samples", "1",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tightfit: error: the model's BatchNorm layers cannot train on a "
                                               "micro-batch of 1 sample"), err
    assert err[0].endswith("; train on at least 2 samples (--train-samples 2 or more)"), err
    assert main(["train", "--data", str(root), "--model", model, "--image-size", "8", "--train-samples", "2",
                 "--epochs", "1", "--device", "cpu", "--no-progress", "--out", str(tmp_path / "run")]) == 0


def test_resume_and_export_with_other_images_say_images_not_rows(tmp_path, capsys):
    """A resume or export finding the images changed said "other rows, order or labels", the words
    of a data file; a folder of images has images."""
    root = _folder(tmp_path / "data")
    model = str(_resnet_folder(tmp_path / "m", labels=("a", "b")))
    out = tmp_path / "run"
    assert main(["train", "--data", str(root), "--model", model, "--image-size", "8", "--max-steps", "2",
                 "--checkpoint-every", "1", "--device", "cpu", "--no-progress", "--out", str(out)]) == 0
    for f in (root / "a").glob("*.png"):  # every image of a class renamed: the held-out ones too
        f.rename(f.with_name("z" + f.name))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"({root}: other images (files, order or labels)); resume with the same data" in err[0], err
    assert main(["export", "--int8", str(out), "--out", str(tmp_path / "int8")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"({root}: other images (files, order or labels)), so its held-out" in err[0], err


def test_a_large_image_is_taken_quietly_and_one_too_large_for_pil_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                                         capsys, recwarn):
    """An image above PIL's MAX_IMAGE_PIXELS (~89M) printed PIL's two-line DecompressionBombWarning
    to stderr; one above twice that (~179M) was refused in PIL's words ("could be decompression
    bomb DOS attack"). PIL's limit is lowered here, so that small images stand for large ones."""
    from PIL import Image as PILImage

    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)
    root = _folder(tmp_path / "data")
    Image.fromarray(np.zeros((40, 40), dtype=np.uint8)).save(root / "a" / "large.png")  # 1,600 pixels: PIL warns
    model = str(_resnet_folder(tmp_path / "m", labels=("a", "b")))
    capsys.readouterr()
    run = ["train", "--data", str(root), "--model", model, "--image-size", "8", "--max-steps", "1", "--device", "cpu",
           "--no-progress"]
    assert main([*run, "--out", str(tmp_path / "run")]) == 0
    assert "decompression bomb" not in capsys.readouterr().err
    assert not [w for w in recwarn if "decompression bomb" in str(w.message)]
    Image.fromarray(np.zeros((50, 50), dtype=np.uint8)).save(root / "b" / "huge.png")  # 2,500: PIL refuses it
    assert main([*run, "--out", str(tmp_path / "run2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tightfit: error: {root / 'b' / 'huge.png'}: an image of 2,500 pixels, more than the 2,000 PIL opens "
                   "(its guard against decompression bombs); resize it: tightfit resizes every image to --image-size "
                   "anyway"], err


def test_estimate_and_the_run_report_state_the_image_size(tmp_path, capsys):
    """``tightfit plan`` named the image size ("resnet50, image size 224, ..."), ``estimate``'s
    header and ``report.md`` did not (nor a text model's sequence length)."""
    assert main(["estimate", "--model", "resnet50", "--micro-batch", "2", "--image-size", "64"]) == 0
    assert capsys.readouterr().out.startswith("resnet50, image size 64, micro-batch 2, fp32,")
    assert main(["estimate", "--model", "minilm", "--micro-batch", "2", "--seq-len", "32"]) == 0
    assert capsys.readouterr().out.startswith("minilm, sequence length 32, micro-batch 2, fp32,")
    root = _folder(tmp_path / "data")
    model = str(_resnet_folder(tmp_path / "m", labels=("a", "b")))
    assert main(["train", "--data", str(root), "--model", model, "--image-size", "8", "--max-steps", "1",
                 "--device", "cpu", "--no-progress", "--out", str(tmp_path / "run")]) == 0
    assert f"- model: `{model}`, image size 8\n" in (tmp_path / "run" / "report.md").read_text()


def test_an_image_that_cannot_be_read_for_another_reason_is_not_called_changed(tmp_path):
    """A denied permission, a failing disk or too many open files on a data image were told as a
    file 'changed while the run read it; restore it as it was': only a file gone (ENOENT) or no
    longer decoding (tightfit.images.ImageSamples' own error, errno None) is; others stay as raised."""
    import errno
    from types import SimpleNamespace

    from tightfit.api import TrainRecipe

    image = str(tmp_path / "a.png")
    recipe = SimpleNamespace(train_data=SimpleNamespace(images=[image]), eval_data=SimpleNamespace(images=[]),
                             out=tmp_path, trainer=SimpleNamespace(step=2, total_steps=4),
                             resume_command=lambda: "tightfit train --resume run", _resumable=lambda: False)
    for code in (errno.EACCES, errno.EIO, errno.EMFILE):
        assert TrainRecipe.missing_sample(recipe, OSError(code, os.strerror(code), image)) is None
    gone = TrainRecipe.missing_sample(recipe, OSError(errno.ENOENT, "No such file or directory", image))
    assert "is gone (deleted or moved while the run read it)" in str(gone)
    changed = TrainRecipe.missing_sample(recipe, OSError(None, "UnidentifiedImageError: cannot identify", image))
    assert "changed while the run read it; the run is at step 2 of 4" in str(changed)


def test_a_file_that_cannot_be_read_keeps_its_name_in_the_error(tmp_path):
    """The error's text had every ' None' cut out where the file could not be read at all (the
    in-memory copy it strips, never made, printed as None): 'a None.png' became 'a.png'."""
    from tightfit.images import _check_image

    folder = tmp_path / "a None.png"  # a folder: read_bytes fails before any decoding
    folder.mkdir()
    with pytest.raises(TightfitError) as info:
        _check_image(folder)
    assert str(info.value).count("a None.png") == 2, str(info.value)  # the path, and the OSError's own text


def test_a_jsonl_nan_in_an_image_list_is_blank_not_a_class(tmp_path):
    """An image list's JSON Lines label NaN (json.dumps of a float('nan'): a missing label) became a
    class 'nan' of those images; a text list's NaN label is blank. It is skipped as blank, as null is,
    and a path NaN too (it was looked for as the file 'nan')."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(30):
        Image.fromarray((rng.random((8, 8, 3)) * 255).astype(np.uint8)).save(tmp_path / f"{i}.png")
        rows.append(json.dumps({"path": f"{i}.png", "label": "ab"[i % 2] if i % 7 else float("nan")}))
    rows.append(json.dumps({"path": float("nan"), "label": "a"}))
    (tmp_path / "list.jsonl").write_text("\n".join(rows) + "\n")
    data = load_image_classification(str(tmp_path / "list.jsonl"))
    assert (data.label_names, len(data), data.skipped_blank) == (["a", "b"], 25, 6)


def test_a_digits_file_cut_short_or_damaged_is_one_line(tmp_path, monkeypatch):
    """TIGHTFIT_DIGITS naming a digits.csv.gz cut short (a copy stopped midway) ended in gzip's
    EOFError traceback, one damaged inside its compressed data in zlib.error: neither is an OSError."""
    import gzip

    from tightfit.images import load_digits

    raw = gzip.compress("\n".join(",".join(["0"] * 64 + [str(i % 10)]) for i in range(2000)).encode())
    damaged = bytearray(raw)
    damaged[20:60] = bytes(b ^ 0x55 for b in damaged[20:60])
    for name, content in (("cut.csv.gz", raw[:len(raw) // 2]), ("damaged.csv.gz", bytes(damaged))):
        (tmp_path / name).write_bytes(content)
        monkeypatch.setenv("TIGHTFIT_DIGITS", str(tmp_path / name))
        with pytest.raises(TightfitError, match=f"TIGHTFIT_DIGITS=.*{name}: cannot read"):
            load_digits()


def test_a_folder_linked_twice_in_a_class_is_listed_alike_whatever_order_the_filesystem_lists(tmp_path, monkeypatch):
    """A class's subfolder reached twice (``real/`` and a link ``alias -> real``) is entered once,
    under the name met first: that was the name the filesystem listed last (its own order, which a
    copy of the data onto another disk changes), so the images' paths, the fingerprint a resume and an
    export compare, and their order in the split could change with it. The folders are walked by name."""
    from pathlib import Path

    root = _folder(tmp_path / "data")
    (root / "a" / "real").mkdir()
    for i in range(3):
        Image.fromarray(np.full((8, 8, 3), 200 + i, np.uint8)).save(root / "a" / "real" / f"x{i}.png")
    os.symlink("real", root / "a" / "alias")
    listed = Path.iterdir
    first = load_image_classification(str(root))
    monkeypatch.setattr(Path, "iterdir", lambda self: iter(sorted(listed(self), reverse=True)))
    second = load_image_classification(str(root))
    assert first.images == second.images and first.fingerprint() == second.fingerprint()
    assert len(first) == 23


def test_an_image_list_given_through_a_link_resumes_and_exports_reading_the_images_it_trained_on(tmp_path, capsys):
    """photos/list.csv, a link to a list kept elsewhere, names images relative to photos/ (where the
    run read them); request.json recorded the link resolved (lists/list.csv), so --resume and export
    looked for the images beside that file: 'the run's data cannot be read (... image not found)'.
    The data path is recorded absolute, not resolved."""
    photos, lists = tmp_path / "photos", tmp_path / "lists"
    photos.mkdir()
    lists.mkdir()
    rows = ["path,label"]
    for i in range(30):
        Image.fromarray(np.full((8, 8), 8 * i, dtype=np.uint8)).save(photos / f"{i}.png")
        rows.append(f"{i}.png,{'ab'[i % 2]}")
    (lists / "list.csv").write_text("\n".join(rows) + "\n")
    os.symlink(lists / "list.csv", photos / "list.csv")
    folder, out = _resnet_folder(tmp_path / "m", labels=("a", "b")), tmp_path / "run"
    assert main(["train", "--data", str(photos / "list.csv"), "--model", str(folder), "--image-size", "8",
                 "--max-steps", "1", "--batch-size", "8", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    assert json.loads((out / "request.json").read_text())["data"] == str(photos / "list.csv")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert "already finished at step 1" in capsys.readouterr().out
    assert main(["export", "--int8", str(out), "--out", str(tmp_path / "int8")]) == 0


def _named_folder(root, classes, n=6):
    """One class folder per name of ``classes``, each of ``n`` distinct grey images."""
    for k, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(np.full((8, 8), 10 * i + k, dtype=np.uint8)).save(root / cls / f"{i}.png")
    return root


def test_class_folders_that_differ_only_in_case_are_noted_as_a_text_lists_labels_are(tmp_path, caplog):
    """``Cat/`` and ``cat/`` became two classes without a word, where a text list's labels ``pos``
    and ``POS`` are noted (they stay apart: case can be meaningful); an image list's labels too."""
    root = _named_folder(tmp_path / "data", ("Cat", "cat", "dog"))
    with caplog.at_level("WARNING", logger="tightfit"):
        data = load_image_classification(str(root))
    assert data.label_names == ["Cat", "cat", "dog"]
    notes = [r.getMessage() for r in caplog.records if "differ only in case" in r.getMessage()]
    assert notes == [f"note: {root}: class folders that differ only in case are separate classes: 'Cat' and 'cat'"]

    caplog.clear()
    (tmp_path / "l.csv").write_text("path,label\n" + "".join(f"{p},{p.parent.name}\n" for p in sorted(root.rglob("*.png"))))
    with caplog.at_level("WARNING", logger="tightfit"):
        assert load_image_classification(str(tmp_path / "l.csv")).label_names == ["Cat", "cat", "dog"]
    notes = [r.getMessage() for r in caplog.records if "differ only in case" in r.getMessage()]
    assert notes == [f"note: {tmp_path / 'l.csv'}: labels of column 'label' that differ only in case are separate "
                     "classes: 'Cat' and 'cat'"]


def test_class_folders_that_are_one_number_written_two_ways_are_refused_in_one_line(tmp_path, capsys):
    """``1/`` and ``01/`` became two classes (the model an output too many), where a text list's or
    an image list's labels ``1`` and ``01`` are refused: refused alike, before any image is decoded."""
    root = _named_folder(tmp_path / "data", ("01", "1", "2"))
    with pytest.raises(TightfitError, match=r"class folders '01' and '1' are the same number written two ways"):
        load_image_classification(str(root))
    folder, out = _resnet_folder(tmp_path / "m", labels=("a", "b", "c")), tmp_path / "run"
    code, err = _train_once(capsys, root, folder, out)
    assert code == 2 and err == [f"tightfit: error: {root}: class folders '01' and '1' are the same number written "
                                 "two ways; as classes they would be apart: give each class one folder"], (code, err)
    assert not out.exists()

    (tmp_path / "l.csv").write_text("path,label\n" + "".join(f"{p},{p.parent.name}\n" for p in sorted(root.rglob("*.png"))))
    with pytest.raises(TightfitError, match=r"labels '01' and '1' are the same number written two ways in column "
                                            r"'label'"):
        load_image_classification(str(tmp_path / "l.csv"))


def test_a_row_of_an_image_list_that_repeats_the_header_is_skipped_and_counted(tmp_path):
    """Two lists joined with both headers: the second header's row was an image ``path`` not found
    (refused, naming a row the user did not think of as data). It is skipped and counted, as a
    text list's is; in a TSV too."""
    root = _named_folder(tmp_path / "data", ("a", "b"))
    rows = [f"{p},{p.parent.name}" for p in sorted(root.rglob("*.png"))]
    (tmp_path / "l.csv").write_text("\n".join(["path,label"] + rows[:5] + ["path,label"] + rows[5:]) + "\n")
    data = load_image_classification(str(tmp_path / "l.csv"))
    assert (data.label_names, len(data), data.skipped_header, data.skipped_blank) == (["a", "b"], 12, 1, 0)
    (tmp_path / "l.tsv").write_text("".join(f"{r.replace(',', chr(9))}\n" for r in ["path,label"] + rows
                                            + ["path,label"]))
    data = load_image_classification(str(tmp_path / "l.tsv"))
    assert (data.label_names, len(data), data.skipped_header) == (["a", "b"], 12, 1)
    rows.insert(7, "gone.png,a")  # record 9, after the header's row: an error names the file's own record
    (tmp_path / "l.csv").write_text("\n".join(["path,label"] + rows[:5] + ["path,label"] + rows[5:]) + "\n")
    with pytest.raises(TightfitError, match=r"l.csv: row 9: image not found: .*gone.png$"):
        load_image_classification(str(tmp_path / "l.csv"))


def test_the_loaders_notes_are_shown_once_and_recorded_in_the_runs_report(tmp_path, capsys):
    """From a fresh user's trial: a folder's skipped files and its class folders that differ only
    in case were noted on screen while the images were read, and not in report.md's notes, which
    hold the notes on a list's blank rows (the README: "the notes it printed on the data")."""
    root = _folder(tmp_path / "data")
    (root / "README.txt").write_text("about the images")
    (root / "A").mkdir()
    for i in range(10):
        shutil.copy(root / "a" / f"{i}.png", root / "A" / f"{i}.png")
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--data", str(root), "--model", str(_resnet_folder(tmp_path / "m", labels=("A", "a", "b"))),
                 "--image-size", "8", "--out", str(out), "--device", "cpu", "--no-progress", "--max-steps", "1"]) == 0
    shown = capsys.readouterr().out
    skipped = f"{root}: 1 file skipped, outside the class folders or without an image ending"
    case = f"{root}: class folders that differ only in case are separate classes: 'A' and 'a'"
    assert shown.count(skipped) == 1 and shown.count(case) == 1, shown
    notes = (out / "report.md").read_text().split("## Notes", 1)[1]
    assert f"- {skipped}" in notes and f"- {case}" in notes, notes
