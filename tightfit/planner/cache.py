"""The plan cache: a second run of the same job takes its plan from disk and starts training at once.

A plan depends only on what the planner saw: the model's structure (its config and its
parameters' names, shapes, dtypes and ``requires_grad``; not the weights' values), the shapes of
a worst-case batch (the sequence length or the image size), the effective batch, the run's
length in samples (it decides whether compilation can repay its cost), the planning options
(precision, checkpointing, compile, planner), the card (name and total memory, and the profile's
rates: a custom profile's speeds change the time model) and the budget, the versions of torch and
tightfit, which optimizer-lever libraries are installed (a lever installed later is searched) and the
host's memory in GiB and the run's processes on it (offloaded state and activations are held to
each one's share), and the CUDA allocator's configuration (the probes measure its peaks). :func:`plan_key` hashes exactly those with SHA-256;
:func:`load_plan` and :func:`store_plan` read and write ``<cache>/plans/<key>.json``
atomically (:mod:`tightfit.fileio`), where ``<cache>`` is ``$TIGHTFIT_CACHE_DIR`` or
``~/.cache/tightfit``. A cache entry that cannot be read is ignored (and replanned), never an
error: the cache only saves time. The host memory free is not in the key (it moves from run to
run): a cached ``adamw-offload`` plan whose pinned state the memory free now would not hold is
planned anew (:func:`host_changed`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from .. import __version__
from ..fileio import atomic_write_json
from ..plan import Plan

_log = logging.getLogger(__name__)

# raised when what a cached plan holds changes meaning (its reasons' wording, the time model behind
# its choice) within one tightfit version: entries of another format are planned anew. 2: the
# planner's stage times without a second "planning took"; adamw8bit-bf16 timed per call, not per tensor.
# 3: a text run's probes without cuDNN's attention kernels (levers/attention.py); the compiled stage's
# line with each probe's speed; the plan found written as the headline writes its rate.
CACHE_FORMAT = "tightfit-plan-cache/3"


def cache_dir() -> Path:
    """The cache folder: ``$TIGHTFIT_CACHE_DIR``, else ``~/.cache/tightfit``."""
    env = os.environ.get("TIGHTFIT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tightfit"


def model_structure(model: torch.nn.Module) -> dict:
    """What of ``model`` a plan depends on, JSON-ready: its class, its config (a Hugging Face
    ``config.to_dict()`` where it has one, minus the name or path it was loaded from, plus its
    attention implementation) and, per parameter and buffer, name, shape, dtype and
    ``requires_grad``. No weight values."""
    config = getattr(model, "config", None)
    conf = None
    if config is not None and hasattr(config, "to_dict"):
        conf = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        # not in to_dict(), yet a config.json's "attn_implementation": "eager" holds every T x T
        # attention matrix that sdpa does not: another plan
        conf["attn_implementation"] = getattr(config, "_attn_implementation", None)
    return {
        "class": f"{type(model).__module__}.{type(model).__qualname__}",
        "config": conf,
        "parameters": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
    }


def batch_shapes(batch: dict) -> dict:
    """``{key: [shape, dtype]}`` of a batch of tensors (a worst-case batch: sequence length, image size)."""
    return {k: [list(v.shape), str(v.dtype)] for k, v in sorted(batch.items()) if torch.is_tensor(v)}


def plan_key(model: torch.nn.Module, worst_case: dict, effective_batch: int, options: dict, card: str,
             total_bytes: int, budget_bytes: int, run_samples: int | None, profile: dict | None = None) -> str:
    """SHA-256 (hex) of everything the plan depends on (see the module doc).

    Args:
        model: the model as planned (on any device).
        worst_case: a worst-case batch of one sample (its shapes: sequence length, image size).
        effective_batch: samples per optimizer step.
        options: the planning options that change the plan (precision, checkpointing, compile, planner).
        card: the card's name; ``total_bytes``: its memory; ``budget_bytes``: the budget, bytes.
        run_samples: samples the run will train on (None: unknown, or not deciding: a run that compiles nothing).
        profile: the card profile's fields (``dataclasses.asdict`` of a
            :class:`~tightfit.devices.DeviceProfile`; None: the name alone).
    """
    from ..levers.optimizers import total_host_bytes
    from ..memory.allocator import ALLOC_CONF, ALLOC_CONF_ANY_DEVICE
    from .optimizers import _ranks_on_this_host

    from ..levers.blocks import find_blocks

    key = {"format": CACHE_FORMAT, "model": model_structure(model), "batch": batch_shapes(worst_case),
           # a plan's checkpointed blocks are indices into these: another tightfit's way of finding them
           # (an encoder-decoder's encoder layers counted since) must not read an old plan's indices
           "blocks": [type(b).__qualname__ for b in find_blocks(model)],
           "effective_batch": effective_batch, "options": dict(sorted(options.items())), "card": card,
           "total_bytes": total_bytes, "budget_bytes": budget_bytes, "run_samples": run_samples,
           "torch": torch.__version__, "tightfit": __version__, "profile": profile, "levers": lever_libraries(),
           "host_gib": round(total_host_bytes() / 2**30),  # offloaded state and activations are held to it
           "ranks_on_host": _ranks_on_this_host(),  # ... shared by this run's processes on the host (DDP)
           # the probes' peaks are the allocator's: expandable_segments:False or another split size reserve otherwise
           "allocator": [os.environ.get(name) for name in (ALLOC_CONF, ALLOC_CONF_ANY_DEVICE)]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def lever_libraries() -> dict[str, str | None]:
    """``{distribution: version or None}`` of the optimizer levers' libraries (bitsandbytes,
    torchao): which the planner can choose from."""
    from importlib import metadata

    from ..levers.optimizers import LEVER_LIBRARY

    versions = {}
    for name in sorted(set(LEVER_LIBRARY.values())):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _path(key: str, folder: Path | None) -> Path:
    return (folder or cache_dir()) / "plans" / f"{key}.json"


def load_plan(key: str, folder: Path | None = None) -> tuple[Plan, dict] | None:
    """The cached plan of ``key`` and its record (``planning_seconds``, ``created``, ``path``,
    ``timings``), or None when there is none or it cannot be read (logged at debug level)."""
    path = _path(key, folder)
    try:  # is_file() too: a cache folder that cannot be searched (permissions, a name too long) raises
        if not path.is_file():
            return None
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry.get("format") != CACHE_FORMAT or entry.get("key") != key:
            return None
        return Plan.from_dict(entry["plan"]), {"planning_seconds": float(entry.get("planning_seconds", 0.0)),
                                               "created": entry.get("created", ""), "path": str(path),
                                               "timings": dict(entry.get("timings") or {})}
    except Exception as e:  # a damaged entry only costs a fresh plan
        _log.debug("plan cache entry %s unreadable: %s", path, e)
        return None


def store_plan(key: str, plan: Plan, planning_seconds: float, folder: Path | None = None,
               timings: dict | None = None) -> Path | None:
    """Write ``plan`` under ``key`` atomically, with the planner's ``timings`` (its stage times
    and the speeds it predicted and probed). Returns the path, or None when the cache folder
    cannot be written (logged; the run goes on)."""
    path = _path(key, folder)
    try:
        atomic_write_json(path, {"format": CACHE_FORMAT, "key": key, "planning_seconds": planning_seconds,
                                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "timings": dict(timings or {}), "plan": plan.to_dict()})
    except OSError as e:
        _log.warning("tightfit: note: the plan could not be cached in %s (%s)", path.parent, e)
        return None
    return path


def host_changed(plan: Plan, model: torch.nn.Module) -> str | None:
    """Why the cached ``plan`` may not hold on this host now (None: it holds): the key has the
    host's total memory, but the planner sized ``adamw-offload`` to the memory available then;
    its pinned state is checked against what is available now. (Offloaded activations are not:
    the plan does not keep their bytes, and a run short of pinned memory for them meets an
    out-of-memory error, redone with a smaller micro-batch.)"""
    from ..levers.optimizers import available_host_bytes, offload_host_bytes, pinned_shortfall

    if plan.optimizer == "adamw-offload":
        need = offload_host_bytes([p.numel() for p in model.parameters() if p.requires_grad])
        short = pinned_shortfall(need, available_host_bytes())
        if short:
            return f"its optimizer adamw-offload {short} now"
    return None


def from_cache_reason(record: dict) -> str:
    """The reason line of a plan taken from the cache."""
    return (f"plan from the cache ({record['path']}, planned {record['created']} in "
            f"{record['planning_seconds']:.1f} s); --replan plans afresh")
