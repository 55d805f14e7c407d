"""Checkpoints of a run on several processes, written and read with
``torch.distributed.checkpoint`` (DCP), so that a run can resume on another number of processes
(2 -> 1 included) and FSDP2's sharded state is never gathered on one rank.

Layout of ``ckpt-<step>/`` (the single-process layout of :mod:`.checkpoint`, with ``dcp/`` in
place of ``model.safetensors``)::

    dcp/            DCP's files: the model's and the optimizer's state dicts, keyed by the
                    parameters' names (``torch.distributed.checkpoint.state_dict.get_state_dict``,
                    which removes the DDP/FSDP wrappers), each rank writing its part
    state.pt        rank 0's trainer state (scheduler, loss scaler, data position, plan, counters)
                    and every rank's RNG states (``rng_by_rank``); ``weights_only`` loadable

DCP reads its ``.metadata`` with ``pickle.load`` and the state's non-tensor items (the optimizer's
``param_groups``) with ``torch.load(weights_only=False)``: either would run any code a rewritten
file holds. Both are checked first here (:func:`_check_metadata`, :func:`_weights_only_planner`), so
that this layout loads no more than ``weights_only`` allows, as the one-process layout does.
    manifest.json   size and SHA-256 of every file above, written last (``layout: "dcp"``)

The folder is written atomically by rank 0 (:func:`tightfit.fileio.atomic_write_dir`): every rank
writes its DCP part into rank 0's temporary folder, whose name rank 0 broadcasts; rank 0 then
writes ``state.pt`` and the manifest and renames the folder. On several machines the run
folder must be on a file system all of them see.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..errors import TightfitError
from ..fileio import atomic_write_dir
from .checkpoint import (MANIFEST, MANIFEST_FORMAT, STATE_FILE, NonFiniteCheckpointError, _fail, _first_line, _fsync,
                         _statistics, prune_checkpoints, read_state, remove_stale_temporaries, sha256_file,
                         streak_record, verify_checkpoint)
from .distributed import World

DCP_DIR = "dcp"


# What DCP's .metadata may name (torch 2.6-2.13 write these): DCP's own metadata classes, torch's
# sizes, dtypes and layouts, and a path (pathlib's, or pathlib._local's under Python 3.13); any
# other global is refused unread.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
                     ("torch.serialization", "_get_layout"), ("collections", "OrderedDict")}


def _metadata_global(module: str, name: str):
    """The object ``module.name`` names in DCP's metadata, or None where the metadata holds no such
    global. A dotted ``name`` (pickle protocol 4 follows it through attributes: ``os.system`` of a
    module that imports ``os``) is never one."""
    import importlib
    import pathlib

    if "." in name or not (module == _METADATA_MODULE or module in ("torch", "pathlib", "pathlib._local")
                           or (module, name) in _METADATA_GLOBALS):
        return None
    try:
        obj = getattr(importlib.import_module(module), name, None)
    except ImportError:  # pathlib._local before Python 3.13
        return None
    if (module, name) in _METADATA_GLOBALS:
        return obj
    if module == _METADATA_MODULE:  # a class DCP's metadata module defines, not one it imports
        return obj if isinstance(obj, type) and obj.__module__ == module else None
    if module == "torch":
        return obj if isinstance(obj, torch.dtype) else None
    return obj if isinstance(obj, type) and issubclass(obj, pathlib.PurePath) else None


def _check_metadata(path: Path, dcp_dir: Path) -> None:
    """Unpickle each ``.metadata`` file of ``dcp_dir`` with only the globals DCP's metadata needs
    (:func:`_metadata_global`; the Python documentation's "Restricting Globals" recipe), before DCP
    unpickles it unrestricted.

    Raises:
        CorruptCheckpointError: a file names another global, or cannot be unpickled.
    """
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            obj = _metadata_global(module, name)
            if obj is None:
                raise pickle.UnpicklingError(f"names {module}.{name}, which DCP's metadata does not hold")
            return obj

    for f in sorted(dcp_dir.glob(".metadata*")):
        try:
            with open(f, "rb") as stream:
                Restricted(stream).load()
        except Exception as e:  # noqa: BLE001 - whatever the unpickler met, the file is not DCP's metadata
            raise _fail(path, f"{DCP_DIR}/{f.name}: {_first_line(e)}") from None


def _weights_only_planner():
    """DCP's default load planner, except that each non-tensor item is first unpickled with
    ``torch.load(weights_only=True)``: one that names anything else is refused (``refused`` says
    which, as DCP wraps the planner's errors in its own)."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        refused: str | None = None

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001 - refused, or not a torch.save stream
                self.refused = f"{read_item.dest_index.fqn}: {_first_line(e)}"
                raise
            value.seek(0)
            super().load_bytes(read_item, value)  # DCP's own, on a stream weights_only has read

    return WeightsOnlyPlanner()


def is_sharded(path: Path) -> bool:
    """Whether checkpoint folder ``path`` was written by :func:`save_sharded`."""
    return (Path(path) / DCP_DIR).is_dir()


def _finite_everywhere(model: torch.nn.Module, world: World) -> bool:
    """Whether every rank's parameters and norm layers' running statistics (a BatchNorm running
    variance that overflowed; other buffers may hold an infinity by design, a -inf attention mask)
    are finite, as one process's checkpoint requires (a collective)."""
    tensors = [*model.parameters(), *(b for _, b in _statistics(model))]
    local = all(bool(torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all()) for t in tensors)
    return world.all_sum([float(not local)])[0] == 0


def _save_planner(model: torch.nn.Module):
    """DCP's save planner; for a model with running statistics (BatchNorm), each tensor that
    several ranks hold is written from the lowest rank: by default DCP takes it from whichever
    rank has written least, and the ranks' statistics differ (DDP broadcasts no buffers here,
    FSDP2 none at all), so a resume mixed rank 0's with another rank's and rank 0's model, saved
    and evaluated, was not the run's. Other models keep DCP's spread of the writes over the ranks."""
    import torch.distributed.checkpoint as dcp

    from ..buffers import running_stat_norms

    return dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=bool(running_stat_norms(model)))


def save_sharded(folder: Path, step: int, model: torch.nn.Module, optimizer, state: dict, world: World,
                 keep_last: int = 2, abandoned=()) -> Path:
    """Write ``folder/ckpt-<step>`` from every rank (a collective: all ranks call it at the same step).

    Args:
        model, optimizer: the wrapped model (DDP or FSDP2) and its optimizer.
        state: this rank's trainer state without model and optimizer (tensors and plain values);
            rank 0's is saved, with the ``rng`` of every rank as ``rng_by_rank``.
        keep_last, abandoned: what pruning keeps (:func:`~.checkpoint.prune_checkpoints`).

    Returns:
        The checkpoint folder.

    Raises:
        NonFiniteCheckpointError: a parameter or a norm layer's running statistic holds inf/NaN on some
            rank (nothing is written).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if not _finite_everywhere(model, world):
        raise NonFiniteCheckpointError("refusing to write a checkpoint: a parameter or a running statistic holds "
                                       "inf/NaN")
    folder, target = Path(folder), Path(folder) / f"ckpt-{step}"
    model_sd, optim_sd = get_state_dict(model, optimizer)
    rngs = world.gather(state.get("rng"))
    if not world.is_main:
        tmp = world.broadcast(None)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(tmp) / DCP_DIR),
                 planner=_save_planner(model))
        world.barrier()
        return target

    remove_stale_temporaries(folder)

    def fill(tmp: Path) -> None:
        world.broadcast(str(tmp))
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR),
                 planner=_save_planner(model))
        torch.save({**state, "rng_by_rank": rngs, "world_size": world.size}, tmp / STATE_FILE)
        files = {}
        for f in sorted([tmp / STATE_FILE, *(tmp / DCP_DIR).iterdir()]):
            _fsync(f)
            files[f.relative_to(tmp).as_posix()] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
        manifest = {"format": MANIFEST_FORMAT, "layout": "dcp", "step": step, "files": files, **streak_record(state)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        _fsync(tmp / MANIFEST)

    atomic_write_dir(target, fill)
    prune_checkpoints(folder, step, keep_last, abandoned)
    world.barrier()
    return target


def load_sharded(path: Path, model: torch.nn.Module, optimizer, world: World, verified: bool = False,
                 state: dict | None = None) -> dict:
    """Verify checkpoint ``path`` (unless ``verified``) and load its model and optimizer state into ``model`` (wrapped
    or not, on any number of processes: DCP reshards) and ``optimizer``; return the saved trainer
    state with ``rng`` set to this rank's RNG states (rank 0's when the world size changed;
    ``rng_of_this_rank`` says which). ``state``: its ``state.pt`` as a caller read it already
    (:func:`~.checkpoint.read_state`), not read again.

    Raises:
        CorruptCheckpointError: the files do not match the manifest, or name objects beyond what
            ``weights_only`` loads (:func:`_check_metadata`, :func:`_weights_only_planner`).
        TightfitError: the state does not fit the model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not verified:  # the caller may have verified it already (read and hashed once)
        verify_checkpoint(path)
    _check_metadata(path, path / DCP_DIR)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    planner = _weights_only_planner()
    try:
        with warnings.catch_warnings():  # one process reading a checkpoint of several: what is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(sd, checkpoint_id=str(path / DCP_DIR), no_dist=not world.distributed, planner=planner)
    except (Exception, CheckpointException) as e:  # DCP wraps the planner's errors in its own types (some BaseException)
        if planner.refused:
            raise _fail(path, f"{DCP_DIR}: {planner.refused}") from None
        # a rank's own error inside DCP's wrapper ("CheckpointException ranks:dict_keys([0])" says nothing)
        cause = next(iter(getattr(e, "failures", {}).values()), e)
        cause = cause[0] if isinstance(cause, tuple) else cause  # (exception, its frames) in torch 2.13
        if isinstance(cause, (OSError, EOFError)):  # the files', not the model's
            raise _fail(path, f"{DCP_DIR}: cannot be read: {_first_line(cause)}") from None
        raise TightfitError(f"checkpoint {path.name} does not fit the model: {_first_line(cause)}") from None
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    state = dict(read_state(path) if state is None else state)  # a caller's, read already: not changed
    rngs = state.pop("rng_by_rank", None) or [state["rng"]]
    state["rng_of_this_rank"] = len(rngs) == world.size  # else rank 0's: Trainer.resume gives each rank its own
    state["rng"] = rngs[world.rank] if state["rng_of_this_rank"] else rngs[0]
    return state


def load_whole_into_sharded(path: Path, model: torch.nn.Module, optimizer, verified: bool = False,
                            state: dict | None = None) -> dict:
    """Load a one-process checkpoint (:mod:`.checkpoint`'s layout: ``model.safetensors`` and the
    optimizer's ``state_dict`` keyed by position) into an FSDP2 ``model`` and its ``optimizer``
    on any number of ranks: each rank reads the whole state and keeps its shard
    (``set_state_dict`` with ``full_state_dict``). Returns the saved trainer state.

    The optimizer's positions are mapped to parameter names through ``optimizer``'s own
    ``param_groups``: the same parameters in the same order as the process that wrote it (the
    optimizer is built over the trainable parameters in ``model.parameters()`` order either way).

    Raises:
        CorruptCheckpointError: verification fails or a file cannot be read.
        TightfitError: the weights or the optimizer state do not fit the model; the checkpoint's
            optimizer is not fp32 AdamW (8-bit, bf16-weight and offloaded state is not by name).
        torch.OutOfMemoryError: (and the other errors :func:`~tightfit.memory.oom.is_oom`
            recognises) propagated unchanged.
    """
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from ..memory.oom import is_oom
    from .checkpoint import MODEL_FILE, _fail, _first_line, check_weights_fit

    path = Path(path)
    if not verified:
        verify_checkpoint(path)
    state = read_state(path) if state is None else state
    kind = state.get("plan", {}).get("optimizer", "adamw")
    if kind != "adamw":  # 8-bit, bf16-weight or offloaded state is laid out per process, not by name
        raise TightfitError(f"checkpoint {path.name} was written by one process with --optimizer {kind}: it resumes "
                            "on one process, or on several with --sharding ddp, not under FSDP2")
    check_weights_fit(path, model)
    try:
        weights = load_file(str(path / MODEL_FILE))
    except Exception as e:
        raise _fail(path, f"{MODEL_FILE}: cannot be loaded: {_first_line(e)}") from None
    saved = state["optimizer"]
    try:
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name = {"state": {order[i]: s for i, s in saved["state"].items()},
                   "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in saved["param_groups"]]}
        # tied weights are stored once (safetensors): their other names are the same parameter, loaded
        # through the first; strict=False for them only, as check_weights_fit refused any other gap
        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=by_name,
                       options=StateDictOptions(full_state_dict=True, strict=False))
    except (KeyError, IndexError, RuntimeError, ValueError) as e:
        if is_oom(e):  # not the checkpoint's fault (torch.OutOfMemoryError is a RuntimeError)
            raise
        raise TightfitError(f"checkpoint {path.name} does not fit the model: {_first_line(e)}") from None
    return state
