"""``tightfit export --int8``: a trained classifier quantized for CPU inference, with its report.

Dynamic int8 quantization (``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear``,
``torch.qint8`` weights, activations quantized per batch at run time) of a run folder's model (or
of a Hugging Face model folder). The report compares the int8 model with the fp32 one: the saved
size, the CPU latency at batch 1 and 32, and -- for a run folder -- the accuracy on the run's own
held-out samples (the fixed split the run evaluated on).

Saved format: ``config.json`` (and the tokenizer or the image preprocessing) plus ``model_int8.pt``,
the quantized model's ``state_dict`` written by ``torch.save``. It is read back by
:func:`load_int8` with ``torch.load(weights_only=True)`` -- only tensors, dtypes and tuples, no
pickled code -- into the architecture built from ``config.json`` and quantized the same way. A
TorchScript or ``torch.export`` program would carry the code too, but TorchScript is deprecated
and the exporter does not take the quantized Linear's packed weights; a state dict keeps the load
safe and the model an ordinary transformers module. The folder is written atomically.

Dynamic quantization is for inference on the CPU: its kernels (fbgemm/x86, qnnpack) have no CUDA
version and it has no backward; asking for either is refused before any work.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shlex
import statistics
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import TightfitError
from .fileio import atomic_write_dir, disk_write_error, output_folder, unwritable_folder
from .units import count_of, format_bytes

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model_int8.pt"
LATENCY_BATCHES = (1, 32)
LATENCY_REPEATS = 10  # timed rounds per batch size (after 2 warm-up calls); the median round is reported
EVAL_BATCH = 64
BARE_SEQ_LEN = 128  # tokens per random text when a bare model folder (no data) is timed

CUDA_REFUSAL = ("int8 dynamic quantization (torch.ao quantize_dynamic) runs on the CPU only: its quantized Linear "
                "kernels (fbgemm, qnnpack) have no CUDA version; export with --device cpu for CPU inference")
TRAIN_REFUSAL = ("--int8 is for CPU inference, not training (dynamic int8 quantization has no backward): train in "
                 "fp32/fp16/bf16, then run: tightfit export --int8 RUN_FOLDER --out DIR")


@contextmanager
def _quiet_quantization():
    """torch.ao.quantization warns that it is deprecated (torchao is its successor) at every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*torch.ao.quantization.*")
        warnings.filterwarnings("ignore", category=UserWarning, message=".*quantize_per_tensor.*")
        warnings.filterwarnings("ignore", category=UserWarning, message=".*TypedStorage is deprecated.*")
        yield


def quantize(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` dynamically quantized to int8 weights
    (``torch.ao.quantization.quantize_dynamic``), in eval mode, on the CPU; ``model`` is unchanged."""
    with _quiet_quantization():
        return torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).cpu().eval(), {torch.nn.Linear},
                                                      dtype=torch.qint8)


@dataclass
class _Source:
    """What is exported: the fp32 model folder, its task kind, and the run folder (if any)."""

    model_dir: Path
    kind: str  # "text" or "image"
    run: Path | None


def _weights_files(model_dir: Path) -> list[Path]:
    """The fp32 weights files of a model folder: safetensors, or PyTorch's bin files."""
    return list(model_dir.glob("*.safetensors")) or list(model_dir.glob("*.bin"))


def _source(path: str) -> _Source:
    """A run folder (``request.json`` and ``model/``) or a model folder (``config.json``).

    Raises:
        TightfitError: neither (a file; a run still training; a run that has not finished, also one
            whose model/ a resume from an earlier checkpoint has not yet replaced: what to run first);
            a model that is not a sequence or image classifier; a model folder without a weights file.
    """
    from .models import _folder_config, _task_of_config
    from .runtime.checkpoint import has_checkpoint

    p = Path(path)
    if (p / "request.json").is_file() and (p / "model" / "config.json").is_file() \
            and ((p / "summary.json").is_file() or not has_checkpoint(p / "checkpoints")):
        # a finished run (summary.json is written last), or a model/ without a checkpoint to finish it from
        run, model_dir = p, p / "model"
    elif (p / "config.json").is_file():
        run, model_dir = None, p
    elif (p / "request.json").is_file() and (p / "summary.json").is_file() and (p / "model").is_dir():
        # finished (summary.json is written last), but its model/ lost a file: resuming does nothing
        raise TightfitError(f"{p / 'model'}: no config.json (the finished run's model folder is incomplete): "
                            "restore it, or train again and export the new run")
    elif (p / "request.json").is_file():  # a run stopped before it wrote its model, or still training
        from .api import run_folder_in_use

        # a model/ without summary.json: a finish that a resume from an earlier checkpoint abandoned
        # (model/ is replaced when it finishes again), or a run stopped while it finished
        why = ("its model/ is from an earlier finish, or was written as it stopped" if (p / "model").is_dir()
               else "no model/ yet")
        if run_folder_in_use(p):  # "resume it first" was said there, and --resume refuses a run being written
            raise TightfitError(f"{p}: the run is still training (a tightfit train writes it; {why}): export "
                                "it once it has ended")
        if has_checkpoint(p / "checkpoints"):
            raise TightfitError(f"{p}: the run has not finished ({why}): run tightfit train --resume "
                                f"{shlex.quote(str(p))} first, then export it")
        raise TightfitError(f"{p}: the run has not finished (no model/ yet) and has no checkpoint to resume from: "
                            "train it again, then export the new run")
    elif p.is_dir():
        raise TightfitError(f"{p}: neither a tightfit run folder (request.json, model/) nor a model folder (config.json)")
    elif p.exists():
        raise TightfitError(f"{p} is a file, not a run or model folder: give the folder tightfit train wrote "
                            "(--out), or a model folder")
    else:
        raise TightfitError(f"{p}: no such run or model folder")
    kind = _task_of_config(_folder_config(model_dir)).kind
    if kind not in ("text", "image"):
        raise TightfitError(f"{model_dir}: a {kind} model; tightfit export --int8 takes text or image classifiers")
    if not _weights_files(model_dir):
        raise TightfitError(f"{model_dir}: config.json but no weights file (*.safetensors or *.bin) to export")
    return _Source(model_dir, kind, run)


def _run_data_folder(src: _Source) -> Path | None:
    """The image folder a run trained on (``request.json``'s ``data``, saved as an absolute path,
    where that is a folder), resolved; None for a model folder, a data file, the built-in
    ``digits`` or a ``request.json`` that cannot be read (refused, named, by :func:`_held_out`)."""
    if src.run is None:
        return None
    try:
        data = json.loads((src.run / "request.json").read_text()).get("data")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(data, str) or not os.path.isabs(data) or not os.path.isdir(data):
        return None
    return Path(os.path.realpath(data))


def _out_folder(out: str | Path) -> Path:
    """The folder an export writes: ``--out`` as :func:`~tightfit.fileio.output_folder` reads it,
    or, where that is a symbolic link, the folder it points to. The export's folder is renamed
    into place: renamed onto the link, it replaced the link, left the folder it named empty and
    the link behind as a hidden ``.<name>.old``."""
    o = output_folder(out)
    return Path(os.path.realpath(o)) if o.is_symlink() else o


def check_request(source: str, out: str, device: str = "cpu") -> _Source:
    """Every check of an export, before any work: CPU only, the source, an empty output folder.

    Raises:
        TightfitError: ``device`` is not ``cpu``; a bad source; ``out`` is a file, or a folder
            that is not empty, or inside the run or model folder it exports, or cannot be written where it is.
    """
    if device != "cpu":
        raise TightfitError(CUDA_REFUSAL)
    src = _source(source)
    if not str(out).strip():
        raise TightfitError("--out is empty: give a new or empty folder")
    o = _out_folder(out)
    if o.exists() and not o.is_dir():
        raise TightfitError(f"--out {o} is a file; give a new or empty folder")
    if o.exists() and any(o.iterdir()):
        raise TightfitError(f"--out {o} exists and is not an empty folder; choose another")
    where = Path(os.path.realpath(o.absolute()))  # the folder as the OS will write it
    if o.exists() and where == Path(os.path.realpath(os.getcwd())):
        # the export is filled beside --out and renamed onto it: onto the working folder that crashed
        # after all the work (--out .: "Device or resource busy") or left the shell in a removed folder
        raise TightfitError(f"--out {o} is the working folder; give a new folder (e.g. --out int8), or run the "
                            "export from another folder")
    model_dir = Path(os.path.realpath(src.model_dir))
    if where.is_relative_to(model_dir):
        # the export would become part of the model folder it reads (a later export or
        # from_pretrained of that folder would find its files beside the model's)
        raise TightfitError(f"--out {o} is inside the model folder {src.model_dir} it exports; choose a folder outside it")
    from .api import enclosing_run_folder

    run = enclosing_run_folder(where)  # (--out itself a run folder is not empty: refused above)
    if run is not None:  # as `train` refuses an --out inside a run folder
        raise TightfitError(f"--out {o} is inside the run folder {run}; choose a folder outside it")
    data = _run_data_folder(src)
    if data is not None and where.is_relative_to(data):
        # its folder would be a class folder without images: the run's held-out samples could no
        # longer be rebuilt (a later export refused), nor the run resumed or trained again on its data
        raise TightfitError(f"--out {o} is inside the data folder {data} the run trained on: its files would become "
                            "part of the data; choose a folder outside it")
    # atomic_write_dir fills a temporary sibling of --out and renames it: written in its parent
    blocked = unwritable_folder(o.absolute().parent)
    if blocked is not None:
        raise TightfitError(f"cannot create --out {o}: {blocked} is not a writable folder")
    return src


def _load_fp32(src: _Source) -> torch.nn.Module:
    """The fp32 model of ``src``, in eval mode.

    Raises:
        TightfitError: its files cannot be read (e.g. a truncated weights file), in one line.
    """
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    from .models import _load_errors, _one_line, _quiet_transformers

    _quiet_transformers()
    cls = AutoModelForImageClassification if src.kind == "image" else AutoModelForSequenceClassification
    try:
        return cls.from_pretrained(src.model_dir, dtype=torch.float32).eval()
    except _load_errors() as e:
        raise TightfitError(f"cannot load the model from {src.model_dir}: {_one_line(e)}") from None


def _held_out(src: _Source):
    """The run's held-out samples as a batch source (``collate(indices)``, ``len``) and its task;
    ``(None, task)`` for a bare model folder.

    Raises:
        TightfitError: the run's ``request.json``, tokenizer or image preprocessing file cannot be
            read (naming it); its data cannot be read or differ from those it trained on.
    """
    from .tasks import ImageClassification, SequenceClassification

    task = ImageClassification() if src.kind == "image" else SequenceClassification()
    if src.run is None:
        return None, task
    from .config import TrainRequest, saved_options
    from .image_train import recipe_class
    from .images import is_image_data, legacy_fingerprints
    from .models import _load_errors, _one_line

    try:  # as --resume reads it: a file cut short or edited is one line, not a traceback
        saved = saved_options(json.loads((src.run / "request.json").read_text()))
        fingerprint = saved.pop("data_fingerprint", None)
    except (ValueError, TypeError, AttributeError, OSError) as e:  # e.g. a list, not an object
        raise TightfitError(f"export {src.run}: unreadable request.json ({_one_line(e)})") from None
    if src.kind == "image" and is_image_data(saved.get("data")):
        # columns of a list file: ignored for digits or a folder, and a run saved before train refused
        # them there may hold them (recipe_class refuses them now)
        for k in ("image_column", "label_column"):
            saved.pop(k, None)
    # the trained folder stands for the model the run started from (moved or deleted since, perhaps):
    # the same architecture, tokenizer and image side, which are all the split needs
    try:
        req = TrainRequest(**{**saved, "model": str(src.model_dir), "out": str(src.run), "progress": False})
    except TypeError as e:  # an option this version does not know
        raise TightfitError(f"export {src.run}: unreadable request.json ({_one_line(e)})") from None
    recipe = recipe_class(req)(req)
    try:
        recipe._load_data()  # the run's data and its fixed held-out split, as the run made them
    except TightfitError as e:  # moved or deleted since the run
        raise TightfitError(f"export {src.run}: the run's data cannot be read ({e}), so its held-out samples cannot "
                            f"be rebuilt; put the run's data back, or export the model folder ({src.model_dir}) "
                            "without a held-out measure") from None
    recipe._split_data()
    eval_data = recipe.eval_data
    # the held-out half of "<train>:<held-out>" (as --resume checks both): what export measures on
    held_out = fingerprint.rpartition(":")[2] if fingerprint is not None else None
    if held_out is not None and held_out not in (recipe.eval_data.fingerprint(),
                                                 *legacy_fingerprints(eval_data)):
        raise TightfitError(f"export {src.run}: the data differ from those the run trained on "
                            f"({recipe.data.source}: {recipe.data.CHANGED}), so its held-out samples "
                            "cannot be rebuilt; put the run's data back, or export the model folder "
                            f"({src.model_dir}) without a held-out measure")
    if src.kind == "image":
        from .images import PREPROCESSING_FILE, ImageSamples
        from .workload import DatasetBatches, collate_as

        try:
            pre = json.loads((src.model_dir / PREPROCESSING_FILE).read_text())
            size, channels = pre["image_size"], pre["num_channels"]
        except (ValueError, TypeError, KeyError, OSError) as e:  # missing, cut short, edited
            raise TightfitError(f"export {src.run}: cannot read {src.model_dir / PREPROCESSING_FILE}, the image "
                                f"side the model was trained at ({_one_line(e)})") from None
        return DatasetBatches(ImageSamples(eval_data, size, channels), collate_as("pixel_values", "labels")), task
    from transformers import AutoTokenizer

    from .workload import TextBatches

    try:
        tokenizer = AutoTokenizer.from_pretrained(src.model_dir)
    except _load_errors() as e:
        raise TightfitError(f"export {src.run}: cannot load the tokenizer from {src.model_dir}: {_one_line(e)}") \
            from None
    return TextBatches(tokenizer, eval_data, req.workload.seq_len), task


def _example_batch(src: _Source, model: torch.nn.Module, held_out, n: int) -> dict:
    """``n`` held-out samples (cycled), or random inputs for a bare folder: token ids ``[n, 128]``
    (at most the model's positions) or images of the side the folder's preprocessing file records
    (as trained), else the config's ``image_size``, else 224 (ResNet's config has none)."""
    if held_out is not None:
        batch = held_out.collate([i % len(held_out) for i in range(n)])
    else:
        from .images import trained_image_size
        from .models import batch_maker
        from .tasks import ImageClassification, SequenceClassification, max_positions

        task = ImageClassification() if src.kind == "image" else SequenceClassification()
        size = (trained_image_size(src.model_dir) or getattr(model.config, "image_size", None) or 224) \
            if src.kind == "image" else \
            min(BARE_SEQ_LEN, max_positions(model.config) or BARE_SEQ_LEN)
        torch.manual_seed(0)
        batch = batch_maker(task, model.config)(n, size, device="cpu")
    return {k: v for k, v in batch.items() if k != "labels"}


def cpu_latency(models: dict, inputs: dict, repeats: int = LATENCY_REPEATS, rounds: list | None = None) -> dict:
    """Median wall time (seconds) of ``model(**inputs)`` for each of ``models`` (name -> module)
    on the CPU under ``torch.inference_mode``, over ``repeats`` calls each after 2 warm-up calls.

    The models take turns call by call, so that a load on the host that comes and goes slows
    both alike: timed one after the other, a fresh user's contended 2-core host showed an int8
    ResNet head 128x "faster" than fp32 one run and 0.99x the next. ``rounds``: a list that gets
    each round's times (``{name: seconds}``), for the spread of a ratio between the models."""
    times = {name: [] for name in models}
    with torch.inference_mode(), _quiet_quantization():
        for i in range(repeats + 2):
            for name, model in models.items():
                t = time.perf_counter()
                model(**inputs)
                if i >= 2:
                    times[name].append(time.perf_counter() - t)
    if rounds is not None:
        rounds += [dict(zip(times, ts)) for ts in zip(*times.values())]
    return {name: statistics.median(t) for name, t in times.items()}


def speedup_spread(rounds: list[dict], base: str = "fp32", other: str = "int8") -> tuple[float, float]:
    """The middle half (first and third quartiles) of ``base / other`` over the rounds of
    :func:`cpu_latency`: how far one timing's speed-up can be trusted on a busy host."""
    ratios = sorted(r[base] / r[other] for r in rounds)
    if len(ratios) < 4:
        return ratios[0], ratios[-1]
    q = statistics.quantiles(ratios, n=4)
    return q[0], q[2]


def _accuracy(model, task, held_out) -> float | None:
    if held_out is None:
        return None
    from .tasks import evaluate_batches

    n = len(held_out)
    batches = (held_out.collate(list(range(i, min(n, i + EVAL_BATCH)))) for i in range(0, n, EVAL_BATCH))
    with torch.inference_mode(), _quiet_quantization():
        return evaluate_batches(task, model, batches)["accuracy"]


def _weights_record(path: Path) -> dict:
    """What :func:`export_int8` records of the weights file in ``export.json``: ``{"file", "bytes",
    "sha256"}``."""
    from .runtime.checkpoint import sha256_file

    return {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _check_weights(folder: Path) -> None:
    """Check ``folder``'s weights file against ``export.json``: its size and SHA-256 (exports
    before the hash was recorded: the size of the int8 model there only; no ``export.json``:
    nothing to check against).

    Raises:
        TightfitError: ``export.json`` unreadable; the weights file's size or hash differ (naming
            the file: truncated, or changed since the export).
    """
    record_file, weights = folder / "export.json", folder / WEIGHTS_FILE
    if not record_file.is_file():
        return
    try:
        record = json.loads(record_file.read_text())
        expected = record.get("weights") or {"bytes": record["int8"]["size_bytes"]}
        size, digest = int(expected["bytes"]), expected.get("sha256")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise TightfitError(f"{record_file}: unreadable ({type(e).__name__}: {e}); it records the size and "
                            f"SHA-256 of {WEIGHTS_FILE}") from None
    actual = weights.stat().st_size
    if actual != size:
        raise TightfitError(f"{weights}: {actual:,} bytes, but the export wrote {size:,} (export.json): the file is "
                            f"truncated or changed; export again")
    if digest is not None:
        from .runtime.checkpoint import sha256_file

        if sha256_file(weights) != digest:
            raise TightfitError(f"{weights}: SHA-256 differs from the one the export recorded (export.json): the "
                                f"file is corrupt or changed; export again")


def load_int8(folder: str | Path) -> torch.nn.Module:
    """The int8 model saved by :func:`export_int8`: the architecture of ``folder/config.json``,
    quantized as at export, with the weights of ``model_int8.pt`` read by
    ``torch.load(weights_only=True)``; in eval mode, on the CPU. The weights file is first checked
    against the size and SHA-256 that ``export.json`` records (an export made before the hash was
    recorded: against its size only).

    Raises:
        TightfitError: not an export folder; a ``config.json`` that cannot be read (cut short,
            edited); a weights file whose size or SHA-256 differ from ``export.json``'s, or that
            ``torch.load`` cannot read (truncated, corrupt), naming it; weights that do not match
            the config.
    """
    from transformers import AutoModelForImageClassification, AutoModelForSequenceClassification

    from .models import _folder_config, _quiet_transformers, _task_of_config

    folder = Path(folder)
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / "config.json").is_file():
        raise TightfitError(f"{folder}: not an int8 export (no {WEIGHTS_FILE} and config.json)")
    _quiet_transformers()
    config = _folder_config(folder)  # a config.json cut short: one line (transformers raises OSError)
    cls = AutoModelForImageClassification if _task_of_config(config).kind == "image" else \
        AutoModelForSequenceClassification
    _check_weights(folder)
    with torch.random.fork_rng(devices=[]):  # its random initial weights, replaced below, leave the caller's stream
        model = quantize(cls.from_config(config))
    with _quiet_quantization():
        try:
            state = torch.load(folder / WEIGHTS_FILE, weights_only=True, map_location="cpu")
        except Exception as e:  # a file cut short or corrupt: OSError, RuntimeError, UnpicklingError, ...
            from .runtime.checkpoint import torch_load_error

            raise TightfitError(f"{folder / WEIGHTS_FILE}: cannot be read ({type(e).__name__}: "
                                f"{torch_load_error(e)}); export again") from None
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise TightfitError(f"{folder / WEIGHTS_FILE}: weights do not match config.json ({str(e).splitlines()[0]})") \
                from None
    # a quantized Linear takes its packed weights without a shape check (seen: a config.json
    # edited to 5 labels loaded a head that printed out_features=5 and gave 2 logits)
    for name, m in model.named_modules():
        if isinstance(m, torch.ao.nn.quantized.dynamic.Linear) and \
                tuple(m.weight().shape) != (m.out_features, m.in_features):
            raise TightfitError(f"{folder / WEIGHTS_FILE}: weights do not match config.json ({name}: "
                                f"{tuple(m.weight().shape)} packed for a {m.in_features} -> {m.out_features} layer)")
    return model.eval()


class _ByteCount:
    """A write-only stream that keeps nothing and counts the bytes written to it (``bytes``)."""

    def __init__(self):
        self.bytes = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.bytes += n
        return n

    def flush(self) -> None:
        pass


def _fp32_size(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s ``state_dict`` (the fp32 model) saved as the int8 one is
    (``torch.save``), counted as written, nothing kept in memory or on disk. Not the source's
    weights files: those may hold fp16 or bf16 weights (most Hugging Face folders do), half the
    fp32 size, which the report showed as the fp32 model's."""
    counted = _ByteCount()
    torch.save(model.state_dict(), counted)
    return counted.bytes


def export_int8(source: str | Path, out: str | Path, device: str = "cpu") -> dict:
    """Quantize ``source``'s model to int8 for CPU inference, save it in ``out`` and report.

    Args:
        source: a ``tightfit train`` run folder or a Hugging Face classifier folder.
        out: the output folder (new or empty), written atomically: ``config.json``, the tokenizer
            (text) or ``tightfit_images.json`` (images), :data:`WEIGHTS_FILE`, ``report.md``,
            ``export.json``.
        device: must be ``"cpu"``.

    Returns:
        The numbers of the report: ``{"fp32": {...}, "int8": {...}, ...}`` with per model
        ``size_bytes``, ``latency_s`` (``{batch: seconds}``: the round of the median speed-up,
        :func:`cpu_latency`'s rounds) and ``accuracy`` (None without held-out data).

    Raises:
        TightfitError: as :func:`check_request`, before any work; ``out`` filled by another
            process while the export ran (kept as it is, nothing written); the disk full or failing
            while it was written (nothing left of it).
    """
    src = check_request(str(source), str(out), device)
    fp32 = _load_fp32(src)
    held_out, task = _held_out(src)
    int8 = quantize(fp32)
    result = {"source": str(source), "kind": src.kind, "held_out_samples": len(held_out) if held_out else 0,
              "torch": torch.__version__, "quantized_engine": torch.backends.quantized.engine,
              "threads": torch.get_num_threads()}
    latency, spread, median, shapes = {"fp32": {}, "int8": {}}, {}, {}, {}
    for b in LATENCY_BATCHES:  # side by side, call by call (cpu_latency)
        rounds = []
        batch = _example_batch(src, fp32, held_out, b)
        # what was timed: a run's held-out texts are as long as they are, a bare folder's BARE_SEQ_LEN
        shapes[b] = list(next(iter(batch.values())).shape)
        cpu_latency({"fp32": fp32, "int8": int8}, batch, rounds=rounds)
        spread[b] = speedup_spread(rounds)
        # the round of the median speed-up, its two times shown with it: the two models' own median
        # times can disagree with it on a busy host (10.5 and 3.8 ms beside a median round's 0.88x)
        middle = sorted(rounds, key=lambda r: r["fp32"] / r["int8"])[(len(rounds) - 1) // 2]  # the lower, if even
        for name in latency:
            latency[name][b] = middle[name]
        median[b] = middle["fp32"] / middle["int8"]
    result["speedup_middle_half"], result["speedup_median"] = spread, median
    result["latency_inputs"] = {"from": "held-out samples" if held_out is not None else "random inputs",
                                "shape": shapes}

    from .models import _tokenizer_files

    # the tokenizer's files by the names tightfit reads a tokenizer from: bpe.codes (PhoBERT, BERTweet) or
    # *.tiktoken have none of the suffixes below, and the export's tokenizer could not be loaded without them
    tokenizer = set(_tokenizer_files(src.model_dir))

    def fill(folder: Path) -> None:
        fp32.config.save_pretrained(folder)
        for f in src.model_dir.iterdir():  # the tokenizer or the image preprocessing, as trained
            if f.is_file() and (f.suffix in (".json", ".txt", ".model") or f.name in tokenizer) \
                    and f.name not in ("config.json",) and not f.name.endswith(".index.json"):
                (folder / f.name).write_bytes(f.read_bytes())
        with _quiet_quantization():
            torch.save(int8.state_dict(), folder / WEIGHTS_FILE)
        result["weights"] = _weights_record(folder / WEIGHTS_FILE)  # export.json's: load_int8 checks the file
        # accuracy after the weights are written: the int8 figure is that of the model read back;
        # the report too is written before the folder is renamed into place, so that an
        # interrupted export leaves no --out at all (a half-written one blocked the re-run)
        loaded = load_int8(folder)
        result["fp32"] = {"size_bytes": _fp32_size(fp32), "latency_s": latency["fp32"],
                          "accuracy": _accuracy(fp32, task, held_out)}
        result["int8"] = {"size_bytes": (folder / WEIGHTS_FILE).stat().st_size, "latency_s": latency["int8"],
                          "accuracy": _accuracy(loaded, task, held_out)}
        (folder / "report.md").write_text(report_markdown(result))
        (folder / "export.json").write_text(json.dumps(result, indent=2) + "\n")

    try:
        # --out was new or empty when checked; a folder filled since (another export, a run given the same --out)
        # is kept, not replaced with this export
        atomic_write_dir(_out_folder(out), fill, replace=False)
    except Exception as e:  # noqa: BLE001 - a full disk (torch's zip writer raises no OSError) or a filled --out
        why = disk_write_error(e)
        if why is not None:  # nothing was renamed into place: atomic_write_dir removed its temporary folder
            raise TightfitError(f"the export to {out} could not be written: {why}; nothing of it is left: make room, "
                                "then export again") from None
        if not isinstance(e, OSError) or e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
            raise
        raise TightfitError(f"--out {out} was filled while the export ran (another command writing there?); it is "
                            "left as it is and the export was not written: export again to a new or empty folder") \
            from None
    return result


def report_markdown(r: dict) -> str:
    """The export's table: size, CPU latency at each batch and held-out accuracy, fp32 against int8."""
    def acc(v):
        return "not measured (no held-out data: export a run folder)" if v is None else f"{v:.4f}"

    rows = [("saved size", format_bytes(r["fp32"]["size_bytes"]), format_bytes(r["int8"]["size_bytes"]))]
    for b in LATENCY_BATCHES:
        f, i = r["fp32"]["latency_s"][b], r["int8"]["latency_s"][b]
        low, high = (r.get("speedup_middle_half") or {}).get(b, (None, None))
        # the speed-up of the median round, which lies inside the middle half (the ratio of the two
        # median latencies need not: 1.38x was shown beside a middle half of 0.88-1.34x)
        ratio = (r.get("speedup_median") or {}).get(b, f / i)
        spread = "" if low is None else (f", the median round; {low:.2f}-{high:.2f}x in the middle half of the rounds"
                                         + (": no clear difference on this host" if low <= 1 <= high else ""))
        rows.append((f"CPU latency, batch {b}", f"{f * 1e3:.1f} ms", f"{i * 1e3:.1f} ms ({ratio:.2f}x{spread})"))
    measured = f" ({count_of(r['held_out_samples'], 'sample')})" if r["held_out_samples"] else ""
    rows.append((f"held-out accuracy{measured}", acc(r["fp32"]["accuracy"]), acc(r["int8"]["accuracy"])))
    lines = ["# tightfit export --int8", "",
             f"{r['source']} ({r['kind']} classifier): every nn.Linear dynamically quantized to int8 "
             f"(torch.ao.quantization.quantize_dynamic, qint8 weights, activations quantized per batch), "
             f"torch {r['torch']}, engine {r['quantized_engine']}, {r['threads']} CPU threads; latency: {LATENCY_REPEATS} "
             f"rounds after 2 warm-up calls, the two models taking turns call by call; shown: the round of the "
             f"median speed-up.", "",
             "| | fp32 | int8 |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    timed = r.get("latency_inputs")
    if timed:  # latencies of two exports compare only at the same input shapes
        lines += ["", f"Latency inputs: {timed['from']}, "
                      + "; ".join(f"batch {b}: {' x '.join(map(str, shape))}" for b, shape in timed["shape"].items())
                      + (" (token ids: samples x tokens)" if r["kind"] == "text" else " (samples x channels x height x "
                         "width)") + "."]
    lines += ["", f"Load: `tightfit.export.load_int8(folder)` (weights read with torch.load(weights_only=True)); "
                  "CPU inference only."]
    return "\n".join(lines) + "\n"
