"""``tightfit train --gpus N``: the same command on N processes, started by PyTorch's own
launcher (``torch.distributed.run``, what ``torchrun`` runs) on this machine; each process then
joins the process group (:mod:`tightfit.runtime.distributed`)."""

from __future__ import annotations

import logging
import os

from ..errors import TightfitError, signal_exit_code
from .distributed import NO_MULTICAST_ENV

_log = logging.getLogger(__name__)

# The command as the user gave it (``--gpus N`` included), for the processes started to record in
# the run (report.md, summary.json, request.json): their own argv has no ``--gpus``.
COMMAND_ENV = "TIGHTFIT_LAUNCHED_COMMAND"

# How long torch.distributed.run waits, after passing a SIGINT/SIGTERM on, for the processes to
# finish their step and write their stop checkpoint before it kills them (SIGKILL). torch's own
# default is 30 s: less than one step of a long accumulation window or the write of a large
# checkpoint, and the killed ranks then leave no stop checkpoint and no resume command. One process
# waits for its stop as long as it takes; TORCH_ELASTIC_SHUTDOWN_TIMEOUT (or --shutdown-timeout of a
# torchrun started by hand) still sets it.
STOP_GRACE_S = 3600


def strip_gpus(argv: list[str]) -> list[str]:
    """``argv`` without ``--gpus N`` / ``--gpus=N`` (the processes started must not start more)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--gpus":
            skip = True
            continue
        if a.startswith("--gpus="):
            continue
        out.append(a)
    return out


def device_of(args) -> str:
    """The ``--device`` of a ``train`` command line; for ``--resume DIR``, the run's own."""
    if getattr(args, "resume", None):
        import json

        from .checkpoint import resume_target

        try:  # the run folder, also of a checkpoint given (RUN/checkpoints/ckpt-N)
            return json.loads((resume_target(args.resume)[0] / "request.json").read_text()).get("device", "auto")
        except (OSError, ValueError):
            return args.device  # the resume itself reports the unreadable folder
    return args.device


def launch(n: int, device: str, argv: list[str], command_line: str | None = None) -> int:
    """Run ``tightfit <argv>`` (``argv`` without ``--gpus``) on ``n`` local processes through
    ``torch.distributed.run`` (standalone rendezvous on this machine), NVLink multicast off.
    ``command_line``: the command as given, which the processes record (:data:`COMMAND_ENV`).

    Returns:
        0 when every process finished; otherwise the first failed process's exit code (2 for a
        bad input, 130 for Ctrl-C, 143 for SIGTERM). 128 plus the signal's number also when this
        launcher is sent SIGINT or SIGTERM: torch.distributed.run passes the signal on to every
        process (which stop at a step boundary, write a checkpoint and say how to resume) and then
        raises ``SignalException``.

    Raises:
        TightfitError: ``n`` below 1, or more than the visible GPUs (on the CPU: than its cores),
            before anything starts.
    """
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if n < 1:
        raise TightfitError(f"--gpus must be at least 1, not {n}")
    if device != "cpu":
        visible = torch.cuda.device_count()
        if n > visible:
            raise TightfitError(f"--gpus {n}, but {visible} GPU{'s' if visible != 1 else ''} visible "
                                "(--device cpu runs the processes on the CPU)")
    elif n > (os.cpu_count() or 1):  # each process a whole copy of the model: more than the cores only thrashes
        raise TightfitError(f"--gpus {n} with --device cpu starts {n} processes, more than this machine's "
                            f"{os.cpu_count() or 1} CPU cores")
    os.environ.update(NO_MULTICAST_ENV)
    if command_line:
        os.environ[COMMAND_ENV] = command_line
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several processes, said once
    parser = get_args_parser()
    grace = []  # where torch.distributed.run has the option (older ones kill the processes after 30 s)
    if any("--shutdown-timeout" in a.option_strings for a in parser._actions) and not any(
            k in os.environ for k in ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "PET_SHUTDOWN_TIMEOUT")):
        grace = [f"--shutdown-timeout={STOP_GRACE_S}"]
    args = parser.parse_args(["--standalone", f"--nproc-per-node={n}", *grace, "--module", "tightfit",
                              *strip_gpus(argv)])
    _log.info(f"tightfit: starting {n} processes (torch.distributed.run)")
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        # bad input first; then SIGTERM's 143 over Ctrl-C's 130: a rank stopped by the others' stop vote
        # knows no signal (130), and the rank the scheduler's SIGTERM reached may not fail first
        order = (2, signal_exit_code("SIGTERM"), signal_exit_code("SIGINT"))
        return next((c for want in order for c in codes if c == want), codes[0] if codes and codes[0] > 0 else 1)
    except SignalException as e:  # Ctrl-C or SIGTERM here: the processes have stopped as asked; no traceback
        return signal_exit_code(getattr(getattr(e, "sigval", None), "name", None))
    return 0


def resume_processes(world_size: int) -> str:
    """What the ``--resume`` command a run prints adds so that it continues on as many processes as
    it ran on (only then is the continuation exact: docs/distributed.md): nothing for one process,
    `` --gpus N` when all ``N`` ran on this machine, else a reminder to start it with torchrun again."""
    if world_size <= 1:
        return ""
    if int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) == world_size:
        return f" --gpus {world_size}"
    return f" (started with torchrun as before, on {world_size} processes, to continue exactly)"
