"""Training checkpoints for exact resume: atomic folders ``ckpt-<step>/`` holding the model
weights (``model.safetensors``), everything else a resumed run needs (``state.pt``: optimizer, loss
scaler, scheduler, RNG states, data position, the plan in force; loaded with
``torch.load(weights_only=True)``; its tensors' bytes in ``state.safetensors``, written without
holding the GIL: :mod:`.state_tensors`), and ``manifest.json``: the byte size and SHA-256 of each of
those files, written last.

A checkpoint is verified against its manifest before it is loaded, so a truncated or overwritten
file is found before anything is read into the model; :func:`latest_intact_checkpoint` skips a
corrupt newest checkpoint for the previous intact one. Checkpoints written by tightfit before
manifests existed are accepted: their safetensors header must cover the whole file and
``state.pt``'s zip records must pass their CRC-32 checks (so truncation, and damage inside
``state.pt``, are still found), but bytes overwritten inside their weights cannot be detected;
resuming from one says so. (A checkpoint of today's whose manifest was deleted is checked alike,
its ``state.safetensors`` by its header only, and its state read whole.) Temporary folders left
by a checkpoint write that was killed (``.ckpt-<step>.*.tmp``, ``.ckpt-<step>.old``), and the
temporary file of a ``times.json`` write cut short inside a checkpoint
(``ckpt-<step>/.times.json.*.tmp``), are removed before the next checkpoint is written, and on
resume (:func:`remove_stale_temporaries`).

Once a checkpoint is in place, ``times.json`` beside its files records the run's checkpoint times
including its own write (:func:`write_checkpoint_times`), which ``state.pt``, taken before the
write, cannot hold. It is not in the manifest: a checkpoint without it (an older tightfit's, or
one whose writer was killed just after the rename) is whole, and resumes with its state's times.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_model

from ..errors import TightfitError
from ..fileio import atomic_write_dir, atomic_write_json, is_leftover
from ..memory.oom import is_oom
from .state_tensors import join_state, map_tensors, split_state

_NAME = re.compile(r"^ckpt-(\d+)$")
_STALE = re.compile(r"^\.ckpt-\d+\.(?:.+\.tmp|old)$")  # atomic_write_dir's temporary / displaced folders
MODEL_FILE, STATE_FILE, MANIFEST = "model.safetensors", "state.pt", "manifest.json"
# the state's tensors, apart from its structure in STATE_FILE (.state_tensors says why); absent from
# checkpoints of tightfit before it
STATE_TENSORS = "state.safetensors"
# In the checkpoints folder, while a resume from an earlier checkpoint has not yet written one of
# its own: the later checkpoints it leaves behind (mark_abandoned), which a resume of the run skips.
ABANDONED = "abandoned.json"
TIMES = "times.json"  # in a checkpoint folder, after it is in place: write_checkpoint_times
# the format written: /2 since state.safetensors (an older tightfit, which reads /1 only, refuses it
# in one line instead of loading state.pt's placeholders); both are read
MANIFEST_FORMAT = "tightfit-checkpoint/2"
READABLE_FORMATS = ("tightfit-checkpoint/1", MANIFEST_FORMAT)
_CHUNK = 1 << 20  # bytes read at a time when hashing


class NonFiniteCheckpointError(TightfitError):
    """A checkpoint was about to be written with inf/NaN weights."""


def write_failure(e: BaseException, step: int, folder) -> "CheckpointWriteError | None":
    """``e``, raised while ``ckpt-<step>`` was written into ``folder``, as a
    :class:`CheckpointWriteError` where it is the disk's (a full disk, a file-size limit, an I/O
    error: an ``OSError``, torch's zip writer's ``RuntimeError`` about its stream, safetensors'
    serialisation error, or DCP's ``CheckpointException``, which gathers every rank's write
    failures); None for anything else (a fault to raise as it is)."""
    from ..fileio import disk_write_error

    why, text = disk_write_error(e), str(e)
    if why is None:  # any OSError while a checkpoint is written (a permission changed, say), DCP's gathered ones
        if not (isinstance(e, OSError) or type(e).__name__ in ("SafetensorError", "CheckpointException")):
            return None
        why = e.strerror if isinstance(e, OSError) and e.strerror else (text.splitlines()[0] if text else type(e).__name__)
    return CheckpointWriteError(f"checkpoint ckpt-{step} could not be written: {why}", folder)


class CheckpointWriteError(TightfitError):
    """A checkpoint could not be written (a full disk, a file-size limit, an I/O error); the
    checkpoints already in place are untouched and the run resumes from the newest of them.

    Attributes:
        folder: the checkpoints folder.
    """

    def __init__(self, message: str, folder):
        super().__init__(message)
        self.folder = Path(folder)


class CorruptCheckpointError(TightfitError):
    """A checkpoint's files do not match its manifest, or cannot be read (the message names the
    checkpoint, the file and what is wrong)."""


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, and one line for each thing worth saying about the
    choice (a newer checkpoint skipped as corrupt, a checkpoint without checksums)."""

    path: Path
    notes: tuple[str, ...] = ()


def _assert_finite(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise NonFiniteCheckpointError(f"refusing to write a checkpoint: parameter {name!r} holds inf/NaN")
    for name, b in _statistics(model):
        if not bool(torch.isfinite(b).all()):
            raise NonFiniteCheckpointError(f"refusing to write a checkpoint: buffer {name!r} holds inf/NaN")


def _statistics(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the running statistics of the model's norm layers (BatchNorm's mean and
    variance): a model's other buffers may hold an infinity by design (a -inf attention mask)."""
    from ..buffers import is_running_stat_norm

    return [(f"{prefix}.{name}" if prefix else name, b) for prefix, m in model.named_modules()
            if is_running_stat_norm(m) for name, b in m.named_buffers(recurse=False) if b.is_floating_point()]


def sha256_file(path: Path) -> str:
    """SHA-256 of a file's bytes as hex, read in 1 MiB chunks (memory stays flat).

    Takes about 1 to 2 s per GB on a current x86 CPU (hashlib uses the SHA extensions where the
    CPU has them; 0.7 GB/s measured on a 2-core cloud VM).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Snapshot:
    """A checkpoint's content copied off the model at a step boundary, ready to be written by
    :func:`write_snapshot` on any thread while training goes on.

    Attributes:
        weights: the model's state dict without duplicate (tied) entries, CPU tensors (pinned
            where the model is on CUDA); ``shared``: ``{dropped name: kept name}`` for the tied ones.
        state: :func:`save_checkpoint`'s ``state`` with every tensor copied to the CPU.
        ready: a CUDA event recorded after the copies (None on the CPU): the writer waits on it.
        nbytes: host bytes held by the copies (weights and state: for AdamW about 3x the
            fp32 weights).
    """

    weights: dict
    shared: dict
    state: dict
    ready: object = None
    nbytes: int = 0


class _HostBuffers:
    """Reusable host buffers for snapshots, by name: pinned memory is slow to allocate, and one
    set bounds the host memory of checkpointing to one copy of the model and its state."""

    def __init__(self):
        self._buffers: dict = {}

    def copy(self, name, t: torch.Tensor, pin: bool) -> torch.Tensor:
        if t.requires_grad:  # (a state_dict's tensors come detached: no op for them)
            t = t.detach()
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        buf.copy_(t, non_blocking=pin)
        return buf


def check_finite(model: torch.nn.Module) -> None:
    """One device sync for all parameters and BatchNorm's running statistics: their total 2-norm
    (``torch.nn.utils.get_total_norm``, a few multi-tensor kernels where a per-tensor
    ``isfinite().all()`` launched five per tensor, about 500 for MiniLM) is finite unless one holds
    inf/NaN or the sum of squares overflows (a finite weight above ~1e19); then the slow per-tensor
    walk names a culprit, or finds none and lets the checkpoint be written.

    Raises:
        NonFiniteCheckpointError: a parameter or running statistic holds inf/NaN.
    """
    # detached: torch's foreach kernels take plain tensors only (a Parameter is norm'd one by one)
    tensors = [p.detach() for p in model.parameters() if p.numel()] + [b for _, b in _statistics(model) if b.numel()]
    if tensors and not bool(torch.isfinite(torch.nn.utils.get_total_norm(tensors))):
        _assert_finite(model)


def frozen_entries(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as it is now, for a snapshot copied later while the model is used
    without training (evaluated): the parameters by reference (nothing but a step changes them),
    the buffers cloned on their device (a forward in eval mode may write a buffer: a counter, an
    average, a cache), in stream order."""
    return {name: t.detach() if isinstance(t, torch.nn.Parameter) else t.detach().clone()
            for name, t in model.state_dict(keep_vars=True).items()}


def take_snapshot(model: torch.nn.Module, state: dict, buffers: _HostBuffers | None = None, pin: bool = True,
                  check: bool = True, entries: dict[str, torch.Tensor] | None = None) -> Snapshot:
    """Copy ``model``'s weights and ``state``'s tensors to host memory now (asynchronously from
    CUDA into pinned buffers, in stream order, so the next step's updates cannot reach them).

    Args:
        buffers: host buffers to reuse (the previous snapshot from them must be written first);
            None: fresh ones.
        pin: copy from CUDA into pinned buffers, asynchronously; False: into pageable ones, each
            copy waiting for the device (no pinning: for a snapshot taken once nothing trains).
        check: refuse non-finite weights first (False: the caller checked them).
        entries: ``model``'s state dict as the caller took it (:func:`frozen_entries`); None: taken now.

    Raises:
        NonFiniteCheckpointError: a parameter holds inf/NaN (nothing is copied).
    """
    if check:
        check_finite(model)
    buffers = buffers or _HostBuffers()
    on_cuda = any(p.is_cuda for p in model.parameters())
    weights, shared, seen = {}, {}, {}
    for name, t in (model.state_dict() if entries is None else entries).items():
        where = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and where in seen:  # a tied weight: written once, as safetensors' save_model does
            shared[name] = seen[where]
            continue
        seen[where] = name
        weights[name] = buffers.copy(("w", name), t, pin and t.is_cuda)
    copies: list[torch.Tensor] = []

    def host(t: torch.Tensor) -> torch.Tensor:  # each plain tensor, a subclass's (torchao's) inner ones too
        copies.append(buffers.copy(("s", len(copies)), t, pin and t.is_cuda))  # CPU state too (offloaded): no new memory
        return copies[-1]

    host_state = map_tensors(state, host)
    ready = None
    if on_cuda:
        ready = torch.cuda.Event()
        ready.record()
    nbytes = sum(t.numel() * t.element_size() for t in (*weights.values(), *copies))
    return Snapshot(weights, shared, host_state, ready, nbytes)


def write_snapshot(folder: Path, step: int, snap: Snapshot, keep_last: int = 2, abandoned=()) -> Path:
    """Write ``snap`` as ``folder/ckpt-<step>`` atomically with its manifest (written last), then
    delete the checkpoints the run no longer needs (:func:`prune_checkpoints`, with ``keep_last``
    and ``abandoned``). Temporary folders of an earlier, killed write are removed first. Safe to
    run on a background thread; hashing costs about 1 to 2 s per GB (:func:`sha256_file`). The
    weights and the state's tensors (``state.safetensors``, :mod:`.state_tensors`) are written by
    safetensors, which holds no GIL while it writes, then synced and hashed on two more threads
    while ``state.pt``, the state's structure, is written.

    Returns:
        The checkpoint's folder.
    """
    from safetensors.torch import save_file

    if snap.ready is not None:
        snap.ready.synchronize()  # the copies into host memory are done
    folder = Path(folder)
    remove_stale_temporaries(folder)
    target = folder / f"ckpt-{step}"

    def record(path: Path) -> dict:
        _fsync(path)  # on disk before the folder's rename makes it a checkpoint
        return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}

    def fill(tmp: Path) -> None:
        # every tensor's bytes through safetensors, which writes without holding the GIL that the
        # training loop needs; torch.save only writes the state's structure (.state_tensors)
        structure, tensors = split_state(snap.state)
        save_file(snap.weights, str(tmp / MODEL_FILE), metadata=dict(snap.shared) or None)
        # the safetensors files are synced and hashed (hashlib releases the GIL) side by side while
        # the state's structure is written
        with ThreadPoolExecutor(2, thread_name_prefix="tightfit-checkpoint-hash") as hasher:
            weights = hasher.submit(record, tmp / MODEL_FILE)
            save_file(tensors, str(tmp / STATE_TENSORS))
            state_tensors = hasher.submit(record, tmp / STATE_TENSORS)
            torch.save(structure, tmp / STATE_FILE)
            files = {STATE_FILE: record(tmp / STATE_FILE)}
            files = {MODEL_FILE: weights.result(), **files, STATE_TENSORS: state_tensors.result()}
        manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files, **streak_record(snap.state)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _fsync(tmp / MANIFEST)

    atomic_write_dir(target, fill)
    prune_checkpoints(folder, step, keep_last, abandoned)
    return target


def write_checkpoint_times(path: Path, held: float, writing: float) -> None:
    """Record in checkpoint folder ``path``, once it is in place, the run's checkpoint times so far
    (seconds: ``held``, the loop held by checkpoints; ``writing``, checkpoints written) including its
    own write, which its ``state.pt`` cannot hold (taken before it); written atomically as
    ``TIMES``, not listed in the manifest. A resume reads them with :func:`checkpoint_times`.

    Raises:
        OSError: it could not be written (the checkpoint is whole without it).
    """
    atomic_write_json(Path(path) / TIMES, {"checkpoint_seconds": held, "checkpoint_write_seconds": writing})


def checkpoint_times(path: Path) -> tuple[float, float] | None:
    """The ``(checkpoint_seconds, checkpoint_write_seconds)`` that :func:`write_checkpoint_times`
    recorded beside checkpoint ``path``; None where there is none (an older tightfit's checkpoint,
    a kill before it was written) or it cannot be read: the counters of its state stand then."""
    try:
        record = json.loads((Path(path) / TIMES).read_text(encoding="utf-8"))
        times = (float(record["checkpoint_seconds"]), float(record["checkpoint_write_seconds"]))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return times if all(math.isfinite(t) and t >= 0 for t in times) else None


def streak_record(state: dict) -> dict:
    """The manifest's ``skipped_in_row`` (optimizer steps skipped as non-finite in a row when
    the checkpoint was taken) and ``last_update`` (the step whose update was the last applied),
    from the trainer's ``state["counters"]``; ``{}`` for a state without them.
    :func:`clean_checkpoints` reads them."""
    counters = state.get("counters") if isinstance(state, dict) else None
    if not isinstance(counters, dict):
        return {}
    return {k: int(counters[k]) for k in ("skipped_in_row", "last_update") if k in counters}


def _streak(path: Path) -> tuple[int, int] | None:
    """``(skipped_in_row, last_update)`` of checkpoint ``path``'s manifest: ``(0, step)`` where it
    records none (an older tightfit's checkpoint, with or without a manifest: pruned as before);
    None where its manifest is there but cannot be read (the checkpoint would not load either)."""
    step = checkpoint_step(path)
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.exists():
        return 0, step
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        n = int(manifest.get("skipped_in_row", 0))
        return n, int(manifest.get("last_update", step - n))
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError, OverflowError):  # 1e400: int(inf)
        return None


def skipped_in_row(path: Path) -> int | None:
    """The ``skipped_in_row`` of checkpoint ``path``'s manifest (0 where it records none; None
    where the manifest cannot be read)."""
    streak = _streak(path)
    return streak[0] if streak else None


def clean_checkpoints(paths: list[Path]) -> list[Path]:
    """The *clean* ones of checkpoint folders ``paths`` (oldest first): taken with no non-finite
    step pending (:func:`skipped_in_row` 0) and not holding the weights of an update that a run
    of non-finite steps followed. A checkpoint ``ckpt-S`` taken after skipped steps holds the
    weights of the last update applied, of step ``last_update``; every checkpoint from that step
    to ``S`` holds them too (a skipped step changes no weight), and that update may be what
    spoiled them, so none of those is clean. Nor is one whose manifest cannot be read: pruning
    must not keep it in place of one that loads."""
    records = [(p, checkpoint_step(p), *(_streak(p) or (None, None))) for p in paths]
    suspect = [(last, s) for _, s, n, last in records if n]
    return [p for p, s, n, _ in records if n == 0 and not any(lo <= s <= hi for lo, hi in suspect)]


def prune_checkpoints(folder: Path, step: int, keep_last: int, abandoned=()) -> list[Path]:
    """Delete the checkpoints of ``folder`` that the run no longer needs after writing ``ckpt-<step>``.

    Kept: the newest ``keep_last`` clean checkpoints (:func:`clean_checkpoints`), and the newest
    other one if it is newer than them (e.g. the one a stop on non-finite gradients wrote). So a
    run that stops on non-finite gradients, and resumes that fail the same way, keep the last
    checkpoints taken before the trouble (``--resume RUN/checkpoints/ckpt-N`` goes back to one)
    and hold at most ``keep_last + 1`` checkpoints. Deleted: the others up to ``step``, every
    checkpoint of a later step, and those of steps in ``abandoned`` other than ``step`` (a resume
    from an earlier checkpoint passes the later ones it found: the abandoned stretch of the run).

    Returns:
        The folders deleted.
    """
    ckpts = list_checkpoints(folder)
    upto = [p for p in ckpts if checkpoint_step(p) == step or (
        checkpoint_step(p) < step and checkpoint_step(p) not in abandoned)]
    clean = clean_checkpoints(upto)
    kept = set(clean[-keep_last:]) if keep_last > 0 else set(clean)
    newest_clean = checkpoint_step(clean[-1]) if clean else -1
    others = [p for p in upto if p not in clean and checkpoint_step(p) > newest_clean]
    kept |= set(others[-1:])
    gone = [p for p in ckpts if p not in kept]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    (Path(folder) / ABANDONED).unlink(missing_ok=True)  # what a resume left behind is gone now
    return gone


def _identity(path: Path) -> str:
    """What tells checkpoint ``path`` from another of the same step: its manifest's hash (the
    weights' and state's checksums). Every checkpoint written now has a manifest, so one without
    (an older tightfit's) is the same one it was: ``"no manifest"``, whatever a copy did to it."""
    try:
        return hashlib.sha256((Path(path) / MANIFEST).read_bytes()).hexdigest()
    except OSError:
        return "no manifest"


def mark_abandoned(folder: Path, step: int) -> None:
    """Record (``ABANDONED``, written atomically) the checkpoints of ``folder`` later than ``step``,
    which a resume from ``ckpt-<step>`` leaves behind: until this run writes a checkpoint of its
    own (which deletes them, :func:`prune_checkpoints`), a resume of the run must not take them
    for its newest (the run's records and options are this resume's from now on). Removes the
    record where there are none."""
    later = [p for p in list_checkpoints(folder) if checkpoint_step(p) > step]
    if later:
        atomic_write_json(Path(folder) / ABANDONED, {"resumed_from": step,
                                                     "checkpoints": {p.name: _identity(p) for p in later}})
    else:
        (Path(folder) / ABANDONED).unlink(missing_ok=True)


def abandoned_checkpoints(folder: Path) -> tuple[set[str], int | None]:
    """The names of the checkpoints in ``folder`` that :func:`mark_abandoned` recorded and that
    are still those (the same manifest), and the step resumed from; ``(set(), None)`` without a
    readable record."""
    try:
        record = json.loads((Path(folder) / ABANDONED).read_text(encoding="utf-8"))
        marked, step = dict(record["checkpoints"]), int(record["resumed_from"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
        return set(), None
    return {name for name, ident in marked.items() if (Path(folder) / name).is_dir()
            and _identity(Path(folder) / name) == ident}, step


def clean_checkpoint_before(folder: Path, step: int) -> Path | None:
    """The newest clean checkpoint of ``folder`` (:func:`clean_checkpoints`) of a step before
    ``step``, or None; not verified."""
    clean = [p for p in clean_checkpoints(list_checkpoints(folder)) if checkpoint_step(p) < step]  # judged by all
    return clean[-1] if clean else None


def save_checkpoint(folder: Path, step: int, model: torch.nn.Module, state: dict, keep_last: int = 2,
                    abandoned=()) -> Path:
    """Write ``folder/ckpt-<step>`` now: :func:`take_snapshot` then :func:`write_snapshot` on
    this thread (:class:`tightfit.runtime.async_checkpoint.CheckpointWriter` writes in the
    background instead).

    Args:
        state: tensors and plain Python values only (so ``weights_only`` loading works).

    Raises:
        NonFiniteCheckpointError: a parameter holds inf/NaN (nothing is written).
    """
    return write_snapshot(folder, step, take_snapshot(model, state), keep_last, abandoned)


def checkpoint_step(path: Path) -> int:
    """The step of checkpoint folder ``path`` (``ckpt-<step>``), from its name."""
    return int(_NAME.match(Path(path).name).group(1))


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint folder's name, ``ckpt-<step>``."""
    return bool(_NAME.match(name))


def resume_target(path) -> tuple[Path, Path | None]:
    """What ``--resume PATH`` names: ``(run folder, None)`` for a run folder (its newest intact
    checkpoint is taken), ``(run folder, checkpoint)`` for one of its checkpoints,
    ``RUN/checkpoints/ckpt-<step>``."""
    path = Path(path)
    if is_checkpoint_name(path.name) and path.parent.name == "checkpoints":
        return path.parent.parent, path
    return path, None


def has_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a checkpoint to resume from: a ``ckpt-<step>`` folder, or one
    displaced by a write cut short (:func:`displaced_checkpoints`); none is verified."""
    return bool(list_checkpoints(folder) or displaced_checkpoints(folder))


def list_checkpoints(folder: Path) -> list[Path]:
    """Checkpoint folders in ``folder``, oldest first (temporary folders are ignored; nothing is
    verified: see :func:`latest_intact_checkpoint`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def displaced_checkpoints(folder: Path) -> list[tuple[Path, str]]:
    """Checkpoints that a replacement cut short left only as ``.ckpt-<step>.old``
    (:func:`tightfit.fileio.atomic_write_dir` renames the old folder away, then the new one in:
    a kill between the two leaves no ``ckpt-<step>``): ``(folder found, name to put back)``.
    A run with only those still has a checkpoint to resume from (:func:`restore_displaced`)."""
    folder = Path(folder)
    found = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else ():
        m = re.match(r"^\.(ckpt-\d+)\.old$", p.name)
        if m and p.is_dir() and not p.is_symlink() and not (folder / m.group(1)).exists():
            found.append((p, m.group(1)))
    return found


def restore_displaced(folder: Path) -> list[str]:
    """Put back the :func:`displaced_checkpoints` of ``folder`` under their names, so that they
    are not removed as stale. Call it before choosing a checkpoint, where no other process writes
    into ``folder``.

    Returns:
        The names of the checkpoints put back.
    """
    restored = []
    for p, name in displaced_checkpoints(folder):
        os.replace(p, Path(folder) / name)
        restored.append(name)
    return restored


def remove_stale_temporaries(folder: Path) -> list[tuple[str, int]]:
    """Delete the temporary folders that a killed checkpoint write left in ``folder``
    (``.ckpt-<step>.<random>.tmp``, and ``.ckpt-<step>.old`` from a replacement cut short), and
    the temporary files of writes cut short there: ``abandoned.json``'s, and ``times.json``'s
    inside a checkpoint in place (``ckpt-<step>/.times.json.<random>.tmp``).

    Call it only where no other process writes checkpoints into ``folder`` (a run has one writer;
    its writer thread writes a checkpoint's ``times.json`` before it starts the next checkpoint).

    Returns:
        ``(name, bytes)`` of each folder or file removed (a checkpoint's file: ``ckpt-<step>/<name>``).
    """
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        if _STALE.match(p.name) and p.is_dir() and not p.is_symlink():
            size = sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
            shutil.rmtree(p, ignore_errors=True)
            removed.append((p.name, size))
        elif is_leftover(p.name, ABANDONED) and p.is_file():  # mark_abandoned's, cut short
            removed.append(_unlink(p, p.name))
        elif _NAME.match(p.name) and p.is_dir() and not p.is_symlink():  # times.json: written after the rename
            for q in sorted(q for q in p.iterdir() if is_leftover(q.name, TIMES) and q.is_file()):
                removed.append(_unlink(q, f"{p.name}/{q.name}"))
    return removed


def _unlink(path: Path, name: str) -> tuple[str, int]:
    """Delete file ``path``; ``(name, its bytes)`` for :func:`remove_stale_temporaries`' list."""
    size = path.stat().st_size
    path.unlink(missing_ok=True)
    return name, size


def _fail(path: Path, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {path.name} is corrupt ({what})")


def torch_load_error(e: BaseException) -> str:
    """One plain line for an error of ``torch.load(weights_only=True)``: where it refused an object
    of the file (a pickled function or class: not only tensors), what it refused (torch's
    ``WeightsUnpickler error`` line, whose first line is a bold-printed "you have two options" that
    does not say them); else the error's first line (:func:`_first_line`)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    refused = re.search(r"WeightsUnpickler error: ([^\n]*?)(?: was not an allowed global by default|\.(?:\s|$)|\n|$)",
                        text)
    if refused:
        return f"it holds something torch.load(weights_only=True) refuses to run: {refused.group(1).strip()}"[:200]
    # a global of a module torch blocks outright (os.system: posix), worded otherwise and without that line
    blocked = re.search(r"Trying to load unsupported GLOBAL (\S+) whose module (\S+) is blocked", text)
    if blocked:
        return (f"it holds something torch.load(weights_only=True) refuses to run: GLOBAL {blocked.group(1)} "
                f"(module {blocked.group(2)} is blocked)")[:200]
    return _first_line(e)  # the error itself: one with no message is named by its type (EOFError), not "str"


def _first_line(e: BaseException | str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # terminal escape codes (torch's bold) are no text
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def verify_checkpoint(path: Path) -> bool:
    """Check that checkpoint folder ``path`` is whole and unchanged since it was written.

    With a manifest: its files are listed (the weights, ``state.pt``, and ``state.safetensors``
    where there is one), and each has the byte size and SHA-256 recorded there (about 1 to 2 s
    per GB of checkpoint). Without one (written by tightfit before manifests):
    the safetensors header must describe exactly the file's length, and every record of
    ``state.pt`` (a zip archive) must pass its CRC-32 check.

    Returns:
        True if the files were checksummed against a manifest, False for a checkpoint without
        one (only truncation and damage inside ``state.pt`` can be found then).

    Raises:
        TightfitError: ``path`` does not exist, or is a folder of checkpoints (``ckpt-N`` inside).
        CorruptCheckpointError: a file is missing, truncated, of the wrong size, fails its
            checksum, or the manifest is unreadable; the message names the file and the fault.
            Also a manifest whose step is not the folder's (``ckpt-50`` holding step 6: a resume
            from it would go back to step 6 and delete the run's checkpoints of later steps).
    """
    path = Path(path)
    if not path.exists():  # a typo, not damage
        raise TightfitError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CorruptCheckpointError(f"checkpoint {path} is not a folder")
    inside = list_checkpoints(path)
    if inside and not (path / MODEL_FILE).exists():  # the run's checkpoints folder, not one checkpoint
        raise TightfitError(f"{path} is a folder of checkpoints, not one: give one of them, e.g. the newest, "
                            f"{inside[-1]}")
    if not (path / MANIFEST).exists():
        _verify_structure(path)
        return False
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ValueError(f"not a JSON object but a {type(manifest).__name__} (a manifest is an object)")
        files = manifest["files"]
        if manifest.get("format") not in READABLE_FORMATS or not isinstance(files, dict):
            raise ValueError(f"not a {' or '.join(READABLE_FORMATS)} manifest")
        expected = {name: (int(v["bytes"]), str(v["sha256"])) for name, v in files.items()}
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError,
            OverflowError) as e:  # OverflowError: JSON's Infinity or 1e400, which int() refuses
        raise _fail(path, f"{MANIFEST}: unreadable: {_first_line(e)}") from None
    named = _NAME.match(path.name)
    if named and manifest.get("step") != int(named.group(1)):  # copied or renamed: not this step's state
        raise CorruptCheckpointError(f"checkpoint {path.name} holds step {manifest.get('step')!r}, not "
                                     f"{named.group(1)} (renamed or copied from elsewhere)")
    sharded = manifest.get("layout") == "dcp"  # written by runtime/sharded_checkpoint.py: dcp/ for the weights
    for name in (STATE_FILE,) if sharded else (MODEL_FILE, STATE_FILE):
        if name not in expected:
            raise _fail(path, f"{MANIFEST}: does not list {name}")
    if (path / STATE_TENSORS).exists() and STATE_TENSORS not in expected:  # read by read_state: checked too
        raise _fail(path, f"{MANIFEST}: does not list {STATE_TENSORS}")
    for name, (size, digest) in expected.items():
        inner = name[4:] if sharded and name.startswith("dcp/") else name  # DCP's own files (".metadata")
        if "/" in inner or "\\" in inner or inner in ("", ".", "..") or (inner == name and name.startswith(".")):
            raise _fail(path, f"{MANIFEST}: lists {name!r}, not a file of the checkpoint")
        f = path / name
        if not f.is_file():
            raise _fail(path, f"{name}: missing")
        actual = f.stat().st_size
        if actual < size:
            raise _fail(path, f"{name}: truncated, {actual} of {size} bytes")
        if actual != size:
            raise _fail(path, f"{name}: {actual} bytes, {size} expected")
        try:
            ok = sha256_file(f) == digest
        except OSError as e:
            raise _fail(path, f"{name}: unreadable: {_first_line(e)}") from None
        if not ok:
            raise _fail(path, f"{name}: checksum mismatch")
    return True


def _verify_structure(path: Path) -> None:
    """The checks possible without a manifest (see :func:`verify_checkpoint`)."""
    for name in (MODEL_FILE, STATE_FILE):
        if not (path / name).is_file():
            raise _fail(path, f"{name}: missing")
    for name in (MODEL_FILE, STATE_TENSORS) if (path / STATE_TENSORS).exists() else (MODEL_FILE,):
        try:
            with safe_open(str(path / name), framework="pt") as f:
                f.keys()
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise _fail(path, f"{name}: {_first_line(e)}") from None
    try:
        with zipfile.ZipFile(path / STATE_FILE) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise _fail(path, f"{STATE_FILE}: {_first_line(e)}") from None
    if bad is not None:
        raise _fail(path, f"{STATE_FILE}: record {bad} fails its CRC check")
    if not (path / STATE_TENSORS).exists():  # an older tightfit's state.pt holds its tensors; one that
        read_state(path)  # refers to a missing state.safetensors (a manifest deleted) is refused here


def latest_intact_checkpoint(folder: Path) -> ResumePoint:
    """The newest checkpoint in ``folder`` that passes :func:`verify_checkpoint` and that no resume
    from an earlier one left behind (:func:`mark_abandoned`), with a note for each newer one
    skipped (e.g. ``checkpoint ckpt-40 is corrupt (model.safetensors: checksum mismatch);
    resuming from ckpt-20``) and for a checkpoint without checksums.

    Verifies newest first and stops at the first intact one: about 1 to 2 s per GB checked.

    Raises:
        TightfitError: ``folder`` holds no checkpoint.
        CorruptCheckpointError: no checkpoint in it is intact (one line naming each fault).
    """
    ckpts = list_checkpoints(folder)
    if not ckpts:
        raise TightfitError("no checkpoint to resume from")
    faults = []
    left, resumed_from = abandoned_checkpoints(folder)
    for path in reversed(ckpts):
        if path.name in left:  # the run's records and options are those of the resume from an earlier one
            faults.append(f"checkpoint {path.name} was left behind by a resume from ckpt-{resumed_from}")
            continue
        try:
            point = resume_point(path)
        except CorruptCheckpointError as e:
            faults.append(str(e))
            continue
        return ResumePoint(path, tuple(f"{fault}; resuming from {path.name}" for fault in faults) + point.notes)
    raise CorruptCheckpointError("no intact checkpoint to resume from: " + "; ".join(faults))


def resume_point(path: Path) -> ResumePoint:
    """Checkpoint ``path`` after :func:`verify_checkpoint`, with a note if it has no manifest.

    Raises:
        TightfitError: ``path`` does not exist.
        CorruptCheckpointError: it is not intact (one line naming the fault).
    """
    if verify_checkpoint(path):
        return ResumePoint(Path(path), ())
    # state.safetensors came after manifests: a checkpoint with one lost its manifest (deleted, copied without it)
    why = "lost: this tightfit writes one" if (Path(path) / STATE_TENSORS).exists() else "written by an older tightfit"
    return ResumePoint(Path(path), (f"checkpoint {Path(path).name} has no {MANIFEST} ({why}): "
                                    f"checked for truncation only, its weights carry no checksum",))


def read_state(path: Path) -> dict:
    """The saved state of checkpoint folder ``path`` (``state.pt`` with its tensors from
    ``state.safetensors``, or an older tightfit's ``state.pt`` holding them itself), its tensors on
    the CPU, not verified.

    Raises:
        CorruptCheckpointError: the file is missing or cannot be loaded (one line).
    """
    from ..levers.optimizers import allow_state_classes

    path = Path(path)
    for attempt in range(2):
        try:
            structure = torch.load(path / STATE_FILE, weights_only=True, map_location="cpu")
            break
        except Exception as e:  # torch.load raises OSError, RuntimeError, UnpicklingError, EOFError, ...
            if attempt or not allow_state_classes(e):  # torchao's 8-bit state, before torchao was imported
                raise _fail(path, f"{STATE_FILE}: cannot be loaded: {torch_load_error(e)}") from None
    tensors = None
    if (path / STATE_TENSORS).exists():
        try:
            # copied out of the file's memory map, which a tensor kept in the optimizer would hold
            # open for the rest of the run (the file's disk space with it, after its checkpoint is pruned)
            with safe_open(str(path / STATE_TENSORS), framework="pt", device="cpu") as f:
                tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise _fail(path, f"{STATE_TENSORS}: cannot be loaded: {_first_line(e)}") from None
    try:
        return join_state(structure, tensors)
    except ValueError as e:
        if tensors is None:
            raise _fail(path, f"{STATE_TENSORS}: missing ({STATE_FILE} refers to its tensors)") from None
        raise _fail(path, f"{STATE_TENSORS}: does not match {STATE_FILE}: {e}") from None


# what Trainer.resume reads of state.pt (Trainer.state_dict writes it): name -> type
_STATE_KEYS = {"step": int, "micro_batch": int, "plan": dict, "scheduler": dict, "scaler": dict, "counters": dict}
_COUNTERS = ("samples", "skipped_steps", "oom_recoveries", "train_seconds", "final_loss", "skipped_in_row",
             "clean_windows")


def check_training_state(path: Path, state, sharded: bool) -> None:
    """Refuse a ``state.pt`` (as :func:`read_state` read it) that is not a tightfit run's trainer
    state, before anything of it is loaded: one its manifest matches (rewritten with it, or written
    by another program) would otherwise fail part-way through the resume with a traceback, after
    the weights were loaded. ``sharded``: the checkpoint is of several processes
    (:mod:`.sharded_checkpoint`: the optimizer's state is in ``dcp/``, not in ``state.pt``).

    Raises:
        CorruptCheckpointError: one line naming the first thing missing or of the wrong type.
    """
    if not isinstance(state, dict):
        what = f"a {type(state).__name__}, not a dict"
    else:
        what = next((f"{key!r} missing or not {kind.__name__}" for key, kind in _STATE_KEYS.items()
                     if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool)), None)
        if what is None and not sharded and not isinstance(state.get("optimizer"), dict):
            what = "'optimizer' missing or not dict"
        if what is None and not ("rng" in state or "rng_by_rank" in state):
            what = "no RNG states"
        if what is None and (state["step"] < 0 or state["micro_batch"] < 1):
            what = f"step {state['step']}, micro-batch {state['micro_batch']}"
        if what is None and (missing := [k for k in _COUNTERS if k not in state["counters"]]):
            what = f"counters without {missing[0]!r}"
    if what:
        raise _fail(Path(path), f"{STATE_FILE}: not the state of a tightfit run: {what}")


def check_trained_parameters(path: Path, saved_optimizer, optimizer) -> None:
    """Refuse a checkpoint whose optimizer state is over other parameters than ``optimizer``'s,
    before anything is loaded: written with other parameters trained (another ``--trainable``, or
    a classifier head that an earlier tightfit's LoRA left frozen), its ``load_state_dict`` would
    fail part-way with torch's ``ValueError``. Compares the tensors per parameter group; an
    optimizer whose state dict has another shape (torchao's CPU offload) is not compared.

    Raises:
        TightfitError: the groups or their sizes differ, in one line saying what to do.
    """
    try:
        saved = [len(g["params"]) for g in saved_optimizer["param_groups"]]
        mine = [len(g["params"]) for g in optimizer.param_groups]
    except (TypeError, KeyError, AttributeError):
        return
    if saved != mine:
        raise TightfitError(
            f"checkpoint {Path(path).name}: its optimizer state is over {sum(saved)} parameter tensors in "
            f"{len(saved)} group(s), and this run trains {sum(mine)} in {len(mine)}: it was written with other "
            "parameters trained (another --trainable, or a classifier head that an earlier tightfit's LoRA left "
            "frozen); resume with what it was written with, or start a new run")


def weights_mismatch(path: Path, model: torch.nn.Module) -> str | None:
    """How the weights in checkpoint folder ``path`` differ from ``model``'s state dict, in one
    line (names and shapes only, from the safetensors header: no tensor is read), or None when
    every name and shape agrees. Tied weights, written once, are known by the file's metadata.

    Raises:
        CorruptCheckpointError: the weights file's header cannot be read.
    """
    try:
        with safe_open(str(Path(path) / MODEL_FILE), framework="pt") as f:
            saved = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
            tied = f.metadata() or {}
    except Exception as e:  # SafetensorError, OSError
        raise _fail(Path(path), f"{MODEL_FILE}: cannot be read: {_first_line(e)}") from None
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    shapes = [k for k in ours if k in saved and saved[k] != ours[k]]
    missing = [k for k in ours if k not in saved and k not in tied]
    unknown = [k for k in saved if k not in ours]
    if not (shapes or missing or unknown):
        return None
    parts = []
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} of its {len(saved)} tensors have other shapes (first: {k}: {saved[k]} saved, "
                     f"{ours[k]} here)")
    if unknown:
        parts.append(f"{len(unknown)} are not in this model (first: {unknown[0]})")
    if missing:
        parts.append(f"{len(missing)} of this model's are missing (first: {missing[0]})")
    return "; ".join(parts)


def check_weights_fit(path: Path, model: torch.nn.Module) -> None:
    """Refuse checkpoint ``path`` for ``model`` when its weights are another model's
    (:func:`weights_mismatch`), before any of them is loaded.

    Raises:
        TightfitError: one line naming the first difference.
        CorruptCheckpointError: the weights file's header cannot be read.
    """
    why = weights_mismatch(path, model)
    if why:
        raise TightfitError(f"checkpoint {Path(path).name} holds another model's weights: {why}")


def load_checkpoint(path: Path, model: torch.nn.Module, verified: bool = False, state: dict | None = None) -> dict:
    """Verify checkpoint ``path`` (:func:`verify_checkpoint`, about 1 to 2 s per GB), load its
    weights into ``model`` (in place) and return the saved state dict.

    Args:
        verified: the caller has just verified ``path`` (e.g. :func:`latest_intact_checkpoint`):
            it is not hashed again.
        state: its state as the caller already read it (:func:`read_state`): not read again.

    Raises:
        CorruptCheckpointError: verification fails, or safetensors / ``torch.load`` cannot read a
            file (one line naming the file).
        TightfitError: the weights do not fit ``model`` (another architecture: :func:`check_weights_fit`).
        torch.OutOfMemoryError: (and the other errors :func:`~tightfit.memory.oom.is_oom`
            recognises) loading the weights ran out of memory; propagated unchanged.
    """
    path = Path(path)
    if not verified:
        verify_checkpoint(path)
    check_weights_fit(path, model)
    try:
        load_model(model, str(path / MODEL_FILE), device=str(next(model.parameters()).device))
    except Exception as e:
        if is_oom(e):  # not the checkpoint's fault: propagates unchanged
            raise
        if isinstance(e, RuntimeError):  # torch's load_state_dict: missing/unexpected keys, shapes
            raise TightfitError(f"checkpoint {path.name} does not fit the model: {_first_line(e)}") from None
        raise _fail(path, f"{MODEL_FILE}: cannot be loaded: {_first_line(e)}") from None  # SafetensorError, OSError
    return read_state(path) if state is None else state
