"""Capture and restore every random number generator a training step draws from
(Python, NumPy, torch CPU and CUDA), so that a redone or resumed step draws the same numbers."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng() -> dict:
    """RNG states as a dict of tensors and plain Python values (loadable with
    ``torch.load(weights_only=True)``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Inverse of :func:`capture_rng`."""
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per device the writer saw: a run resumed with fewer visible devices (a
        # 2-GPU checkpoint resumed under CUDA_VISIBLE_DEVICES=0) restores those it has
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and all CUDA devices) from any whole number.

    torch takes seeds in [-2**63, 2**64-1] and reads a negative one modulo 2**64, so passing it
    ``seed % 2**64`` seeds it exactly as ``seed`` would there, and a derived seed beyond that range
    (a rank's ``seed + 1_000_003 * rank``) does not overflow.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**64)
