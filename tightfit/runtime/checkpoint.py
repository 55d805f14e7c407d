"""Training checkpoints for exact resume: atomic folders ``ckpt-<step>/`` holding the model
weights (safetensors) and everything else a resumed run needs (``state.pt``: optimizer, loss
scaler, scheduler, RNG states, data position, the plan in force), loaded with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from ..errors import TightfitError
from ..fileio import atomic_write_dir

_NAME = re.compile(r"^ckpt-(\d+)$")


class NonFiniteCheckpointError(TightfitError):
    """A checkpoint was about to be written with inf/NaN weights."""


def _assert_finite(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise NonFiniteCheckpointError(f"refusing to write a checkpoint: parameter {name!r} holds inf/NaN")


def save_checkpoint(folder: Path, step: int, model: torch.nn.Module, state: dict, keep_last: int = 2) -> Path:
    """Write ``folder/ckpt-<step>`` atomically, then delete all but the newest ``keep_last``.

    Args:
        state: tensors and plain Python values only (so ``weights_only`` loading works).

    Raises:
        NonFiniteCheckpointError: a parameter holds inf/NaN (nothing is written).
    """
    _assert_finite(model)
    target = Path(folder) / f"ckpt-{step}"

    def fill(tmp: Path) -> None:
        save_model(model, str(tmp / "model.safetensors"))  # handles tied weights
        torch.save(state, tmp / "state.pt")

    atomic_write_dir(target, fill)
    for old in list_checkpoints(folder)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return target


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoint folders in ``folder``, oldest first (temporary folders are ignored)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def load_checkpoint(path: Path, model: torch.nn.Module) -> dict:
    """Load weights into ``model`` (in place) and return the saved state dict.

    Raises:
        TightfitError: the folder is incomplete or unreadable.
    """
    path = Path(path)
    if not (path / "model.safetensors").is_file() or not (path / "state.pt").is_file():
        raise TightfitError(f"incomplete checkpoint: {path}")
    load_model(model, str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    return torch.load(path / "state.pt", weights_only=True, map_location="cpu")
