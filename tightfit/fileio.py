"""Atomic file writes: write to a temporary file in the same folder, fsync, then rename.

A reader (or a resumed run) therefore sees either the old file or the whole new one,
never a half-written one, even if the process is killed mid-write (POSIX ``rename``).
Also output streams whose reader has gone (a closed pipe): discarded, not failing.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file + fsync + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the mode a plain open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 text to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _plain_modes(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes a plain ``mkdir``/``open`` would (temp
    folders and some writers make them private: 0700/0600)."""
    mask = _umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for f in files:
            os.chmod(os.path.join(root, f), 0o666 & ~mask)


def atomic_write_dir(path: str | Path, fill: Callable[[Path], None], replace: bool = True) -> None:
    """Create folder ``path`` atomically: ``fill(tmpdir)`` writes into a sibling temp folder,
    which then replaces ``path`` (an older ``path`` is removed only after ``fill`` succeeded).

    With ``replace=False`` the temp folder takes the place only of a ``path`` that is absent or an
    empty folder, in one rename that the OS refuses over anything else: what another process put
    at ``path`` meanwhile is kept.

    Where ``fill`` fails (or is interrupted), the temp folder is removed, and so are the parents of
    ``path`` made for it, innermost first, each only if still empty: nothing is left behind.

    Raises:
        OSError: with ``replace=False``, ``path`` is a folder that is not empty (``ENOTEMPTY`` or
            ``EEXIST``) or not a folder (``ENOTDIR``); the temp folder is removed.
    """
    path = Path(path)
    made = missing_folders(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = None
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
        fill(tmp)
        _plain_modes(tmp)
        if replace and path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        remove_empty_folders(made)
        raise


def is_leftover(name: str, of: str) -> bool:
    """Whether ``name`` is the temporary that an atomic write of ``of`` (a file's or folder's name in
    the same folder: ``.<of>.<random>.tmp``) left where it was cut short."""
    return name.startswith(f".{of}.") and name.endswith(".tmp") and len(name) > len(of) + len("..tmp")


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first: what making ``path``
    makes, for :func:`remove_empty_folders` where the write it is made for fails."""
    return list(itertools.takewhile(lambda p: not p.exists(), (path, *path.parents)))


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove ``folders`` in order (innermost first: the parents a write made for its folder) while
    each is empty (``rmdir``: never one another process has written in meanwhile); stop at the first
    that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def output_folder(out: str | Path) -> Path:
    """The folder an ``--out`` path names, as the checks must see it. A path with ``..`` is
    resolved (``os.path.realpath``) first: the OS resolves ``runs/new/../full`` only once
    ``runs/new`` exists, so before the run folder is created ``Path("runs/new/../full").exists()``
    is False even when ``runs/full`` holds a run, and a new run or an export would have been
    written into it. Other paths are returned as given (messages keep the user's spelling)."""
    path = Path(out)
    return Path(os.path.realpath(path)) if ".." in path.parts else path


def unwritable_folder(path: str | Path) -> Path | None:
    """Where a folder ``path`` could not be written: the folder itself if it exists, else its
    nearest existing ancestor, when that is not a folder this process can create an entry in;
    None when it can be created (or written) there. The entry is tried for real (an empty
    temporary folder, removed at once): permission bits do not say it for root, nor for ``/proc``
    or a read-only mount."""
    path = Path(path)
    where = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    if not where.is_dir():
        return where
    try:
        os.rmdir(tempfile.mkdtemp(dir=where, prefix=".tightfit-probe-"))
    except OSError:
        return where
    return None


# The disk's write errors: full, over quota, a file-size limit, read-only, failing.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO)


def disk_write_error(e: BaseException) -> str | None:
    """Why a write failed where ``e`` is the disk's, in a few words; None for any other error.
    The writers tightfit uses report it three ways: an ``OSError`` (errno in :data:`DISK_ERRNOS`),
    safetensors' ``SafetensorError`` ("Error while serializing: I/O error: No space left on device
    (os error 28)"), and torch's zip writer's ``RuntimeError`` ("PytorchStreamWriter failed writing
    file", "unexpected pos": ``torch.save``), neither with an errno."""
    text = str(e)
    if isinstance(e, OSError):
        return (e.strerror or text or type(e).__name__) if e.errno in DISK_ERRNOS else None
    if type(e).__name__ == "SafetensorError" and ("I/O error" in text or "os error" in text):
        return text.split("I/O error: ", 1)[-1].splitlines()[0]
    if isinstance(e, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text
                                        or "unexpected pos" in text):
        return text.splitlines()[0]
    return None


def discard_from_now(stream) -> None:
    """Send the rest of what ``stream`` gets (and what it holds buffered) to ``/dev/null``: its
    reader has gone (a closed pipe, ``tightfit train ... | head``), and the command carries on
    rather than failing at its next line. A stream without a file descriptor is left as it is."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass


class UntilClosed:
    """``stream`` (a text stream), discarding what is written once its reader has gone (a closed
    pipe, :func:`discard_from_now`): the trainer's progress bar writes through it, so that
    ``tightfit train ... 2>&1 | head`` trains to the end instead of stopping at the bar's next
    redraw with nothing trained or the steps since the last checkpoint lost."""

    def __init__(self, stream):
        self.stream, self.closed_reader = stream, False

    def write(self, text: str) -> int:
        if not self.closed_reader:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._closed()
        return len(text)

    def flush(self) -> None:
        if not self.closed_reader:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._closed()

    def _closed(self) -> None:
        self.closed_reader = True
        discard_from_now(self.stream)  # later writes (an error line, the flush at exit) too

    def __getattr__(self, name):  # isatty, fileno, encoding: the stream's own
        return getattr(self.stream, name)
