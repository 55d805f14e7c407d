"""Labelled images: scikit-learn's digits, a folder of class folders, or a CSV of paths and labels.

``--data`` for an image model is one of

- ``digits``: scikit-learn's 1,797 handwritten digits (8x8 grey levels 0-16, 10 classes), read
  offline (``sklearn.datasets.load_digits``; where scikit-learn is not installed, the same
  ``digits.csv.gz`` named by ``TIGHTFIT_DIGITS``);
- a folder with one subfolder per class, each holding that class's images (PNG, JPEG, BMP, GIF,
  WebP, TIFF: :data:`IMAGE_SUFFIXES`; nested folders included; other files are skipped with a note,
  and a FIFO, socket or device named as an image is refused);
- a CSV/TSV/JSONL file with a column of image paths (``--image-column``, default ``path``; relative
  to the file's folder) and a column of labels (``--label-column``); these two options apply to
  such a list only (given with ``digits`` or a folder they are refused).

Every image is opened and decoded here (:func:`_check_image`: one full decode per image), before
any model is built or anything written, so that an unreadable or truncated file stops the run with
one line. Grey images of 16 bits (or float, in [0, 1]) are scaled to 0-255 (:func:`load_image`).
Images become ``pixel_values`` by :func:`pixel_values`: grey or RGB as the model's
``num_channels`` wants, resized (bilinear, antialiased) to ``size x size`` and scaled to
``[-1, 1]`` (mean 0.5, std 0.5 per channel); the same preprocessing is recorded beside a trained
model (:func:`preprocessing_record`).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import logging
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import (_check_numbers_written_once, _is_int, _missing, _note_case_twins, _note_labels_in_two_cases,
                   _one_number_twice, _read_rows, _shown_column, majority_fraction, unlabelled)
from .config import option_given, option_name
from .errors import TightfitError
from .units import count_of

log = logging.getLogger(__name__)

DIGITS = "digits"
IMAGE_SUFFIXES = (".png", ".apng", ".jpg", ".jpeg", ".jpe", ".jfif", ".bmp", ".gif", ".webp", ".tif", ".tiff")
MEAN, STD = 0.5, 0.5  # pixel_values = (x / 255 - MEAN) / STD, per channel: [-1, 1]
PREPROCESSING_FILE = "tightfit_images.json"


@dataclass(frozen=True)
class ImageClassificationData:
    """Images with integer labels (the interface of :class:`tightfit.data.TextClassificationData`:
    ``subset``, ``fingerprint``, ``majority_fraction``, ``label_names``, ``source``).

    Attributes:
        images: per sample, a file path (str) or a uint8 array ``[H, W]`` (grey) / ``[H, W, 3]``.
        labels: class index per sample, in ``range(len(label_names))``.
        label_names: class names, index = label id.
        source: where the data came from (for reports).
        skipped_blank: rows of a CSV dropped for a blank path or label.
        root: the folder image paths are taken relative to in :meth:`fingerprint` (the class
            folders' folder, or a CSV's folder); None for pixels in memory (digits).
        digests: per sample, the SHA-256 of its file's bytes (:func:`_check_image`), or empty for
            pixels in memory: what :meth:`contents` compares.
        skipped_header: rows of a CSV/TSV dropped for repeating its header (lists joined with both headers).
        skipped_unlabelled: rows of a CSV dropped for the label -100 (:func:`tightfit.data.unlabelled`).
    """

    SAMPLE_FIELD = "image path"  # what a skipped row lacked, in the note that counts them
    SAMPLE_KIND = "image"  # what one sample is, in notes
    COPIES = "among the training samples as the same image file, byte for byte (files repeated in the data)"
    CHANGED = "other images (files, order or labels)"  # how data can differ, when a resume or export finds it has
    SAME = "byte for byte the same"  # _two_labels: how two copies of a sample named differently are alike

    images: list
    labels: list[int]
    label_names: list[str]
    source: str
    skipped_blank: int = 0
    root: str | None = None
    digests: tuple = ()
    skipped_header: int = 0
    skipped_unlabelled: int = 0

    def __len__(self) -> int:
        return len(self.images)

    @property
    def ROWS(self) -> tuple[str, str]:
        """What :func:`tightfit.data.check_split`'s refusals call a sample and ask of the classes: a
        folder's (:attr:`source` is its :attr:`root`) are images and subfolders, a list's rows and a
        label column."""
        if self.root is not None and self.source == self.root:
            return "images", "is each subfolder a class?"
        return "rows", "is the label column the label?"

    def subset(self, indices) -> "ImageClassificationData":
        idx = list(indices)
        return ImageClassificationData([self.images[i] for i in idx], [self.labels[i] for i in idx],
                                       self.label_names, self.source, root=self.root,
                                       digests=tuple(self.digests[i] for i in idx) if self.digests else ())

    def contents(self) -> list:
        """Per sample, what a copy of it shares (:func:`tightfit.data.check_split`): its file's
        bytes (their SHA-256: a file listed twice, or a copy under another name), or its pixels."""
        return list(self.digests) if self.digests else [(a.shape, np.ascontiguousarray(a).tobytes()) for a in self.images]

    def sample_name(self, i: int) -> str:
        """Sample ``i`` as a note names it: its path (relative to :attr:`root`), or its index."""
        image = self.images[i]
        return _under(image, self.root) if isinstance(image, str) else f"sample {i}"

    def fingerprint(self, legacy: bool = False, sizes: bool = False) -> str:
        """SHA-256 (hex) of the class names, labels and images (pixels, or paths and the SHA-256 of
        each file's bytes, :attr:`digests`), in order: a resumed run checks that it continues on the
        samples it started with, an export that it measures the held-out samples the run kept. A
        path is taken relative to :attr:`root` (one outside it, such as an absolute path in a CSV,
        as written), so that ``--data`` given relative, absolute or through a symlink gives one
        fingerprint.

        Args:
            sizes: the form runs recorded before the files' contents were in it (paths and file
                sizes: an image replaced by another of the same size, as every BMP or uncompressed
                TIFF of one shape is, went unnoticed); ``legacy``: the form before that (paths as
                loaded, not relative to the root, and sizes). Both to accept such a run's
                fingerprint when it is resumed or exported.
        """
        h = hashlib.sha256(repr(self.label_names).encode())
        for i, (image, label) in enumerate(zip(self.images, self.labels)):
            h.update(f"{label}\t".encode())
            if isinstance(image, str):
                name = image if legacy else _under(image, self.root)
                what = os.path.getsize(image) if legacy or sizes or not self.digests else self.digests[i]
                h.update(f"{name}\t{what}\n".encode())
            else:
                h.update(np.ascontiguousarray(image).tobytes())
        return h.hexdigest()

    def majority_fraction(self) -> float:
        """Share of the most frequent class (the accuracy of always guessing it)."""
        return majority_fraction(self.labels, len(self.label_names))


def _under(path: str, root: str | None) -> str:
    """``path`` relative to ``root`` (normalised, "/"-separated) when it lies under it as written, else as written."""
    if root is None:
        return path
    try:
        if os.path.commonpath([path, root]) != os.path.normpath(root):
            return path
    except ValueError:  # one absolute, one relative (or other drives)
        return path
    return Path(os.path.relpath(path, root)).as_posix()


def legacy_fingerprints(*parts) -> list[str]:
    """The fingerprints runs recorded before the files' contents were in them, and before paths were
    taken relative to the data root (:meth:`ImageClassificationData.fingerprint`), of ``parts``
    (e.g. the training and the held-out split) joined by ":" as the run records them: two for image
    data of files, else none (text data and digits did not change)."""
    if not parts or not all(isinstance(p, ImageClassificationData) and p.root is not None for p in parts):
        return []
    return [":".join(p.fingerprint(sizes=True) for p in parts), ":".join(p.fingerprint(legacy=True) for p in parts)]


def is_image_data(spec: str | None) -> bool:
    """Whether ``--data`` names images without knowing the model: ``digits`` or a folder."""
    return spec == DIGITS or (spec is not None and Path(spec).is_dir())


def check_data_name(spec: str | None) -> None:
    """Refuse ``--data digits`` where the working folder holds a file or folder named ``digits``:
    the name would win without a word (names come first, as for ``--model``: ``./digits`` is the
    folder). A run's recorded ``--data`` is not checked again (its folders are absolute paths).

    Raises:
        TightfitError: ``spec`` is ``digits`` and ``./digits`` exists.
    """
    if spec == DIGITS and os.path.lexists(DIGITS):
        what = "folder" if os.path.isdir(DIGITS) else "file"
        raise TightfitError(f"{option_given('data', DIGITS)} names scikit-learn's digits, but this folder also holds a "
                            f"{what} named digits: give {option_given('data', './digits')} for the {what}, or run "
                            "from another folder for scikit-learn's digits")


def load_image_classification(spec: str, label_column: str = "label", image_column: str = "path") -> ImageClassificationData:
    """The labelled images ``--data`` names (see the module docstring), every image checked.

    Raises:
        TightfitError: missing path; an empty folder or one without class folders; a class folder
            without images; fewer than two classes; a file that is not a readable image; a CSV
            without the columns or with a path that does not exist.
    """
    if spec == DIGITS:
        return load_digits()
    path = Path(spec)
    if path.is_dir():
        return _load_folder(path)
    if not path.is_file():
        raise TightfitError(f"image data not found: {path} (give digits, a folder with one subfolder per class, "
                            "or a CSV of image paths and labels)")
    return _load_csv(path, label_column, image_column)


def load_digits() -> ImageClassificationData:
    """scikit-learn's digits: 1,797 images of 8x8 grey levels 0-16 (stored as uint8 0-255), 10
    classes ``0``-``9``; from ``sklearn.datasets.load_digits`` or, without scikit-learn, from the
    file ``TIGHTFIT_DIGITS`` names (scikit-learn's ``digits.csv.gz``: 64 pixels and the label per row).

    Raises:
        TightfitError: neither scikit-learn nor a readable ``TIGHTFIT_DIGITS`` file.
    """
    env = os.environ.get("TIGHTFIT_DIGITS")
    if env:
        try:
            with gzip.open(env, "rt") if env.endswith(".gz") else open(env) as f:
                table = np.loadtxt(f, delimiter=",")
        except (OSError, ValueError, EOFError, zlib.error) as e:  # gzip's for a file cut short or damaged
            raise TightfitError(f"TIGHTFIT_DIGITS={env}: cannot read ({e})") from None
        pixels, target = table[:, :-1], table[:, -1].astype(int)
    elif importlib.util.find_spec("sklearn") is not None:
        from sklearn.datasets import load_digits as sk_digits

        d = sk_digits()
        pixels, target = d.data, d.target
    else:
        raise TightfitError(f"{option_given('data', 'digits')} needs scikit-learn: pip install 'tightfit[images]' "
                            "(or TIGHTFIT_DIGITS=path/to/digits.csv.gz)")
    images = list(np.rint(pixels.reshape(-1, 8, 8) * (255 / 16)).astype(np.uint8))
    return ImageClassificationData(images, [int(t) for t in target], [str(i) for i in range(10)], DIGITS)


# how a file-like object in memory prints: PIL names the one it read, where the path says which file
_IN_MEMORY = re.compile(r" <_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def _pil_error(e: BaseException) -> str:
    """``"Type: first line"`` of an error PIL raised decoding an image, without the in-memory copy
    it names (``<_io.BytesIO object at 0x7f...>``, an address that says nothing of the file)."""
    why = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {_IN_MEMORY.sub('', why)}"


def _check_image(path: Path) -> bytes:
    """Open and decode one image file whole, as training will (:func:`load_image`), so that a file
    cut short or corrupt stops the run here, not mid-training. ``Image.verify()`` alone does not
    decode JPEG data: a truncated JPEG passes it. The cost is one full decode per image up front
    (about a millisecond for a small PNG/JPEG, tens of milliseconds for a large photo: seconds for
    thousands of images); the decoded pixels are not kept.

    Returns:
        The SHA-256 of the file's bytes (read once, then decoded from memory), by which a file
        listed twice or copied is found among the training and held-out samples.

    Raises:
        TightfitError: PIL cannot read or decode it (an empty file said as such; one of more
            pixels than PIL opens, with its size); a float image with values outside [0, 1].
    """
    from PIL import Image

    data = None
    try:
        data = path.read_bytes()  # read once: hashed, then decoded from memory
        load_image(io.BytesIO(data), str(path))
    except TightfitError:
        raise
    except Exception as e:  # PIL raises many types (UnidentifiedImageError, SyntaxError, OSError, ...)
        if data == b"":  # a download or copy that failed: PIL only says it cannot identify it
            raise TightfitError(f"{path}: not a readable image (an empty file, 0 bytes)") from None
        if isinstance(e, Image.DecompressionBombError):  # PIL's words: "could be decompression bomb DOS attack"
            pixels = re.search(r"\((\d+) pixels\)", str(e))
            size = f"{int(pixels[1]):,} pixels" if pixels else "too many pixels"
            raise TightfitError(f"{path}: an image of {size}, more than the {2 * Image.MAX_IMAGE_PIXELS:,} PIL "
                                "opens (its guard against decompression bombs); resize it: tightfit resizes every "
                                f"image to {option_name('image_size')} anyway") from None
        raise TightfitError(f"{path}: not a readable image ({_pil_error(e)})") from None
    return hashlib.sha256(data).digest()


def _finish(paths: list[str], raw_labels: list[str], source: str, skipped: int = 0,
            root: str | None = None, label_column: str | None = None, headers: int = 0,
            unlabelled_rows: int = 0) -> ImageClassificationData:
    """Check every image, number the classes (numerically when all are integers); ``root``: see
    :class:`ImageClassificationData`; ``label_column``: a list's, None for a folder's class folders;
    ``headers``: a list's rows left out for repeating its header; ``unlabelled_rows``: for the label -100.
    Either's class names are checked as a text list's labels are: one number written two ways
    (``1`` and ``01``, ``1`` and ``1.0``) is refused (two classes, the model an output too many),
    names that differ only in case (``Cat`` and ``cat``) are noted."""
    if not paths:
        raise TightfitError(f"{source}: no images")
    names = sorted(set(raw_labels))
    if label_column is not None:
        _check_numbers_written_once(Path(source), label_column, names)
        _note_labels_in_two_cases(Path(source), label_column, names)
    else:
        pair = _one_number_twice(names)
        if pair:
            raise TightfitError(f"{source}: class folders {pair[0]!r} and {pair[1]!r} are the same number written two "
                                "ways; as classes they would be apart: give each class one folder")
        _note_case_twins(Path(source), "class folders", names)
    if all(_is_int(n) for n in names):  # as text labels are sorted ("--1" passed a digit test, then failed int())
        names = sorted(names, key=int)
    if len(names) < 2:
        raise TightfitError(f"{source}: {len(names)} class ({', '.join(names)}); need at least 2")
    digests = tuple(_check_image(Path(p)) for p in paths)
    index = {n: i for i, n in enumerate(names)}
    return ImageClassificationData(paths, [index[x] for x in raw_labels], names, source, skipped, root, digests,
                                  skipped_header=headers, skipped_unlabelled=unlabelled_rows)


def _paths_under(folder: Path) -> list[Path]:
    """Every path under ``folder``, as ``folder.rglob("*")`` lists them, and those inside linked
    folders too: ``rglob`` does not enter a link to a folder, so the images of a class's linked
    subfolder were left out without a word. A folder reached twice (a link to a folder already
    listed, or up to its own parent) is entered once, under the name the walk meets first: folders
    are walked by name, not in the filesystem's own order (which a copy onto another disk changes)."""
    seen, paths, todo = set(), [], [folder]
    while todo:
        d = todo.pop()
        if os.path.realpath(d) in seen:
            continue
        seen.add(os.path.realpath(d))
        for p in sorted(d.iterdir()):
            paths.append(p)
            if p.is_dir():
                todo.append(p)
    return paths


def _not_a_file(path: Path) -> str:
    """What ``path`` (after links), which exists and is neither a file nor a folder, is, in words."""
    mode = path.stat().st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _load_folder(root: Path) -> ImageClassificationData:
    """``root/<class>/**/<image>``: the class is the name of the first-level folder; hidden files
    and folders (a name starting with ".") are left out; other entries that are not samples (beside
    the class folders, or without an image ending in them: files, and FIFOs, sockets, devices or
    links to nothing) are skipped with one note that counts them.

    Raises:
        TightfitError: no class folder, a class folder without images, a link to no file, or
            something with an image ending that is not a file (a FIFO, a socket, a device)."""
    visible = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    classes = [p for p in visible if p.is_dir()]
    if not classes:
        raise TightfitError(f"{root}: no class folders (put each class's images in a subfolder named after it)")
    skipped = [p for p in visible if not p.is_dir()]  # beside the class folders: no class
    paths, labels = [], []
    for c in classes:
        # hidden files and folders (.ipynb_checkpoints copies, ._ files) are not samples: copies of
        # training images would also land in the held-out split
        found = sorted(f for f in _paths_under(c) if not any(part.startswith(".") for part in f.relative_to(c).parts))
        # not only regular files: a FIFO or socket in a class folder was dropped without a word
        skipped += [f for f in found if f.suffix.lower() not in IMAGE_SUFFIXES and not f.is_dir()]
        found = [f for f in found if f.suffix.lower() in IMAGE_SUFFIXES]
        broken = next((f for f in found if f.is_symlink() and not f.exists()), None)
        if broken is not None:  # dropping it would train on fewer images without a word
            raise TightfitError(f"{broken}: a link to {os.readlink(broken)}, which does not exist")
        special = next((f for f in found if not f.is_file() and not f.is_dir()), None)
        if special is not None:  # named as an image, but no image: as a link to nothing (reading a FIFO would hang)
            raise TightfitError(f"{special}: {_not_a_file(special)}, not an image file; replace it with the image "
                                "or move it out of the class folder")
        files = [f for f in found if f.is_file()]
        if not files:  # dropping it would train on the other classes without a word
            raise TightfitError(f"{root}: class folder {c.name!r} holds no image ({', '.join(sorted(IMAGE_SUFFIXES))}); "
                                f"add its images or move the folder out")
        paths += [str(f) for f in files]
        labels += [c.name] * len(files)
    if skipped:  # said, as an empty class folder is refused: e.g. photos beside the class folders, or .heic
        log.warning(f"note: {root}: {count_of(len(skipped), 'file')} skipped, outside the class folders or without "
                    f"an image ending ({', '.join(sorted(IMAGE_SUFFIXES))}): e.g. {_under(str(skipped[0]), str(root))}")
    return _finish(paths, labels, str(root), root=str(root))


def _cell(path: Path, n: int, row: dict, column: str) -> str:
    """Row ``n``'s value of ``column`` as text: "" (blank) only when missing, null or NaN (JSONL) or
    empty -- a JSONL number 0 is the label (or path) ``"0"``.

    Raises:
        TightfitError: a JSONL list or object (``str()`` would make ``"['a']"`` a class or a path).
    """
    value = row.get(column)
    if _missing(value):  # NaN too: a text list's NaN label is blank, not a class 'nan'
        return ""
    if isinstance(value, (list, dict)):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise TightfitError(f"{path}: row {n}: {column!r} is {shown}; paths and labels must be strings or numbers")
    return str(value).strip()


def _load_csv(path: Path, label_column: str, image_column: str) -> ImageClassificationData:
    """A CSV/TSV of image paths (relative to the file's folder) and labels."""
    rows, headers = _read_rows(path)
    if not rows:
        raise TightfitError(f"{path}: no rows")
    columns = set().union(*(r.keys() for r in rows[:100]))
    from .config import option_name

    for col, option in ((image_column, "image_column"), (label_column, "label_column")):
        if col not in columns:  # the option as its user named it (--image-column, or image_column=)
            raise TightfitError(f"{path}: no column {col!r} ({option_name(option)}); columns are: "
                                f"{', '.join(sorted(_shown_column(c) for c in columns))}")
    paths, labels, blank, ignored = [], [], 0, 0
    for n, r in enumerate(rows, 1):
        if n - 1 in headers:  # counted (len(headers)) and said, as blank rows are
            continue
        file, label = _cell(path, n, r, image_column), _cell(path, n, r, label_column)
        if not file or not label:
            blank += 1
            continue
        if unlabelled(label):
            ignored += 1
            continue
        p = Path(file) if Path(file).is_absolute() else path.parent / file
        if p.is_dir():
            raise TightfitError(f"{path}: row {n}: {p} is a folder, not an image file")
        if not p.is_file():
            raise TightfitError(f"{path}: row {n}: image not found: {p}")
        if p.resolve() == path.resolve():  # else "not a readable image", which reads as if the list were broken
            raise TightfitError(f"{path}: row {n}: {file} is this list itself, not an image file")
        paths.append(str(p))
        labels.append(label)
    return _finish(paths, labels, str(path), blank, root=str(path.parent), label_column=label_column,
                   headers=len(headers), unlabelled_rows=ignored)


# PIL modes of one grey channel wider than 8 bits, and the value that becomes 255: PIL's
# convert("L") clips them (every 16-bit level above 255 became white). "I" (32-bit integer) is
# how Pillow before 10 opened 16-bit PNGs, so it is read as 16-bit too.
_WIDE_GREY = {"I;16": 65535, "I;16B": 65535, "I;16L": 65535, "I;16N": 65535, "I": 65535, "F": 1.0}


def _sixteen_bit_file(im) -> bool:
    """Whether an open PIL image of mode ``I`` was stored with 16 bits per sample: Pillow opens a
    16-bit PGM and a signed 16-bit TIFF as ``I`` too, and a dark one is 16-bit all the same."""
    if im.format == "PPM":
        return True  # a PGM wider than 8 bits (maxval > 255) is 16-bit
    if im.format == "TIFF":
        bits = im.tag_v2.get(258)  # BitsPerSample
        return (bits[0] if isinstance(bits, tuple) else bits) == 16
    return False


def load_image(image, name: str | None = None) -> np.ndarray:
    """One sample's pixels (``image``: a file's path, an open binary file -- ``name`` names it in
    errors -- or pixels, returned as they are): uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` (RGB; other modes converted),
    turned as displayed (the EXIF orientation applied) and with transparent parts shown over white.

    Grey images wider than 8 bits are scaled to 0-255 from their own range, rounded: 16-bit
    integers (PIL modes ``I;16``, ``I;16B``, ``I;16L``, and ``I``) as ``v / 257`` (65535 -> 255);
    float images (``F``) as ``v * 255``, for values in [0, 1] only.

    Raises:
        TightfitError: a float image with a value outside [0, 1] (or not a number), or a 32-bit
            integer image with a value outside 0-65535, or one stored with 32 bits and none above 255
            (8-bit levels: as 16-bit they would be nearly black): no one scale is right for them.
        Exception: whatever PIL raises for a file it cannot open or decode (:func:`_check_image`
            turns it into a TightfitError before any work).
    """
    if not isinstance(image, (str, io.IOBase)):  # pixels already (digits)
        return image
    from PIL import Image, ImageOps

    if isinstance(image, (str, os.PathLike)):
        # decoded from memory, as _check_image decodes it: opened by path, Pillow memory-maps an
        # uncompressed grey TIFF and lays it out at its turned size before turning it (orientation
        # 5-8): the image came out scrambled in training after it had passed the check
        name, image = name or str(image), io.BytesIO(Path(image).read_bytes())
    with Image.open(image) as im:
        # as displayed: a camera's portrait photo is stored sideways with an EXIF orientation
        # (transformers' image loading applies it too)
        ImageOps.exif_transpose(im, in_place=True)
        top = _WIDE_GREY.get(im.mode)
        grey = im.mode in ("1", "L", "LA", "La")
        if top is None and ("A" in im.getbands() or "a" in im.getbands() or "transparency" in im.info):
            # as displayed, over white (as transformers' convert_to_rgb does): convert() drops the
            # alpha and keeps whatever colour is stored under a transparent pixel (black, or any
            # palette entry), so two images that look the same gave different pixels
            white = Image.new("RGBA", im.size, (255, 255, 255, 255))
            return np.array(Image.alpha_composite(white, im.convert("RGBA")).convert("L" if grey else "RGB"))
        if top is None:
            return np.array(im.convert("L" if grey else "RGB"))
        x = np.asarray(im).astype(np.float64)  # any byte order (I;16B) to native
        sixteen = _sixteen_bit_file(im)
    if x.ndim != 2:
        raise TightfitError(f"{name or image}: a {im.mode} image of shape {x.shape}: expected one grey channel")
    if not (np.isfinite(x).all() and x.min(initial=0) >= 0 and x.max(initial=0) <= top):
        what = "a float image with values outside [0, 1]" if im.mode == "F" else \
            "a 32-bit integer image with values outside 0-65535"
        raise TightfitError(f"{name or image}: {what} (min {x.min():g}, max {x.max():g}); tightfit reads float images as "
                            "0-1 and integer ones as 16-bit: convert it to 8- or 16-bit")
    if im.mode == "I" and not sixteen and 0 < x.max(initial=0) <= 255:  # 8-bit levels (PIL's convert("I") of a photo)
        raise TightfitError(f"{name or image}: a 32-bit integer image with values 0-{x.max():g}: read as 16-bit, as "
                            "tightfit reads such images, it would be nearly black; convert it to 8- or 16-bit")
    return np.rint(x * (255 / top)).astype(np.uint8)


def pixel_values(image: np.ndarray, size: int, channels: int) -> torch.Tensor:
    """The model's input for one image: fp32 ``[channels, size, size]`` in ``[-1, 1]``.

    Args:
        image: uint8 ``[H, W]`` or ``[H, W, 3]``.
        size: the side in pixels (bilinear, antialiased resize, ``torch.nn.functional.interpolate``).
        channels: 1 (grey: RGB averaged with ITU-R 601 luma weights) or 3 (grey repeated).
    """
    x = torch.from_numpy(np.ascontiguousarray(image)).float() / 255
    x = x[None] if x.ndim == 2 else x.permute(2, 0, 1)  # [C, H, W]
    if channels == 1 and x.shape[0] == 3:
        x = (x * torch.tensor([0.299, 0.587, 0.114])[:, None, None]).sum(0, keepdim=True)
    elif channels != x.shape[0]:
        x = x.expand(channels, -1, -1)
    if tuple(x.shape[1:]) != (size, size):
        x = torch.nn.functional.interpolate(x[None], size=(size, size), mode="bilinear", antialias=True,
                                            align_corners=False)[0]
    return (x - MEAN) / STD


class ImageSamples(torch.utils.data.Dataset):
    """A map-style dataset of ``(pixel_values [C, size, size] fp32, label int64 [])`` samples,
    decoded on access (collate with ``tightfit.workload.collate_as("pixel_values", "labels")``).

    Args:
        data: the images and labels.
        size: image side in pixels.
        channels: the model's input channels (1 or 3).
    """

    def __init__(self, data: ImageClassificationData, size: int, channels: int):
        self.data, self.size, self.channels = data, size, channels

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``i``, its file decoded now.

        Raises:
            OSError: its file is gone (``FileNotFoundError``, as raised), or no longer a readable
                image (``errno`` None, ``filename`` the path): rewritten since it was checked before
                training (:func:`_check_image`); the run says either in one line
                (:meth:`tightfit.api.TrainRecipe.missing_sample`).
        """
        path = self.data.images[i]
        try:
            image = load_image(path)
        except TightfitError:
            raise
        except Exception as e:  # PIL raises many types (UnidentifiedImageError, SyntaxError, OSError, ...)
            if not isinstance(path, str) or getattr(e, "filename", None) is not None:  # a file gone names itself
                raise
            raise OSError(None, _pil_error(e), path) from e
        return pixel_values(image, self.size, self.channels), torch.tensor(self.data.labels[i], dtype=torch.long)


def trained_image_size(folder) -> int | None:
    """The image side (pixels) ``tightfit train`` recorded in model ``folder``'s
    :data:`PREPROCESSING_FILE`; None without one, or with one that names no usable side."""
    import json

    try:
        side = json.loads((Path(folder) / PREPROCESSING_FILE).read_text()).get("image_size")
    except (OSError, ValueError, AttributeError):  # none, unreadable or not an object: not tightfit's
        return None
    return side if isinstance(side, int) and not isinstance(side, bool) and side > 0 else None


def preprocessing_record(size: int, channels: int, label_names: list[str]) -> dict[str, Any]:
    """What :func:`pixel_values` does, as written beside a trained model (:data:`PREPROCESSING_FILE`)."""
    return {"image_size": size, "num_channels": channels, "mean": MEAN, "std": STD, "resize": "bilinear, antialiased",
            "scale": "pixel / 255", "label_names": list(label_names)}
