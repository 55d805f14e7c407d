"""The command line: ``tightfit train``, ``estimate``, ``plan``, ``bench``, ``export`` and ``doctor``.

User errors (:class:`TightfitError`) print one line ``tightfit: error: ...`` on stderr and exit with 2.
The library's messages (``logging.getLogger("tightfit")``) are printed on stdout, one plain line each
(on stderr for a ``--json`` command, whose stdout is the JSON alone).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shlex
import signal
import sys
import warnings

from .errors import Terminated, TightfitError, signal_exit_code
from .fileio import discard_from_now


def _train_parser(sub):
    """Add ``tightfit train`` (its options come from :mod:`tightfit.config`) and return its parser."""
    from .config import add_train_arguments

    p = sub.add_parser("train", help="fine-tune a text or image classifier under a GPU memory budget",
                       description="Fine-tune a Hugging Face model on labelled text or images under a GPU memory budget. "
                                   "With no arguments: the shipped MiniLM on Rotten Tomatoes fresh/rotten reviews.")
    add_train_arguments(p)
    # not an option of training: refused with one line that says where int8 belongs (tightfit export)
    p.add_argument("--int8", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, default=1, metavar="N",
                   help="train on N GPUs of this machine: starts N processes with torch.distributed.run, as "
                        "`torchrun --nproc-per-node N -m tightfit train ...` does (with --device cpu: N processes "
                        "on the CPU); see docs/distributed.md for several machines")
    return p


def _export_parser(sub) -> None:
    """Add ``tightfit export``."""
    p = sub.add_parser("export", help="quantize a trained model to int8 for CPU inference, with a size/latency/"
                                      "accuracy report",
                       description="Dynamic int8 quantization (torch.ao) of a run folder's model (or a Hugging Face "
                                   "classifier folder) for CPU inference; writes the model and report.md into --out.")
    p.add_argument("source", metavar="RUN_FOLDER_OR_MODEL", help="a tightfit train run folder or a model folder")
    p.add_argument("--int8", action="store_true", required=True, help="dynamic int8 quantization of every Linear layer")
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="inference device: cpu (the only one int8 dynamic quantization runs on)")


def _given_options(train_parser, argv: list[str]) -> tuple[str, ...]:
    """Flat names (``lr``, ``max_skipped_steps``) of the ``train`` options written in ``argv``,
    abbreviations included (a unique prefix of a flag, as argparse accepts it)."""
    flags = {s: a.dest for a in train_parser._actions for s in a.option_strings if s.startswith("--")}
    given = []
    for token in argv:
        name = token.split("=", 1)[0]
        matches = [f for f in flags if f == name] or [f for f in flags if name.startswith("--") and f.startswith(name)]
        if len(matches) == 1:
            given.append(flags[matches[0]])
    return tuple(dict.fromkeys(given))


class _ConsoleHandler(logging.Handler):
    """Prints each of tightfit's log messages as one plain line on the current ``sys.stdout``
    (or ``sys.stderr`` with ``to_stderr``; looked up at each message, so a redirected stream is
    followed), above a running progress bar (``tqdm.write``), flushed. Once the reader of a pipe
    has gone (``tightfit train ... | head -2``), the rest of the messages are discarded and the
    command carries on: a run keeps training and its folder holds everything, rather than
    stopping at the next message with the steps since its last checkpoint lost."""

    to_stderr = False

    def emit(self, record: logging.LogRecord) -> None:
        """Write the record's message and a newline."""
        from tqdm import tqdm

        stream = sys.stderr if self.to_stderr else sys.stdout
        try:
            tqdm.write(self.format(record), file=stream)
            stream.flush()
        except BrokenPipeError:
            discard_from_now(stream)


def log_to_console(to_stderr: bool = False) -> None:
    """Print the ``tightfit`` logger's messages (INFO and above) on stdout, as the command line
    does, or on stderr with ``to_stderr`` (a ``--json`` command: its stdout is the JSON alone);
    calling it again adds no second handler."""
    logger = logging.getLogger("tightfit")
    logger.setLevel(logging.INFO)
    handler = next((h for h in logger.handlers if isinstance(h, _ConsoleHandler)), None)
    if handler is None:
        handler = _ConsoleHandler()
        logger.addHandler(handler)
    handler.to_stderr = to_stderr


# Loggers of libraries imported on the way (transformers imports torchao whenever it is
# installed, peft imports bitsandbytes) that warn at import time about their own build (e.g.
# bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community", a logging warning; transformers
# 5.25 imports the kernels package, which warns "Skipping publisher trust check ..." offline):
# noise on the command line's stderr, where an error is one line. Their errors still show.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes", "kernels")


def quiet_import_warnings() -> None:
    """Raise :data:`QUIET_LOGGERS` to ERROR and ignore peft's Conv1D note and PIL's warning on a
    large image (called by the command line, not by the library)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # peft's note on GPT-2's Conv1D layers, which it handles itself (--trainable lora)
    warnings.filterwarnings("ignore", message=".*fan_in_fan_out is set to False.*", category=UserWarning)
    # PIL's DecompressionBombWarning (a RuntimeWarning), two raw lines for an image of 89M-179M
    # pixels: the user chose their images, and larger ones are refused in one line (images._check_image)
    warnings.filterwarnings("ignore", message=r"Image size \(\d+ pixels\) exceeds limit", category=RuntimeWarning)


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line ``tightfit: error: ...`` and exit code 2, like every other bad input."""

    def error(self, message: str):
        """Exit with 2 after one line on stderr."""
        self.exit(2, f"tightfit: error: {message} (see {self.prog} --help)\n")


def _parser() -> _Parser:
    """The ``tightfit`` parser with its sub-commands."""
    from . import __version__
    from .bench.cli import add_parser as add_bench_parser
    from .memory.cli import add_parser as add_estimate_parser
    from .planner.cli import add_parser as add_plan_parser

    parser = _Parser(prog="tightfit", description="Train PyTorch models on GPUs with little memory.")
    parser.add_argument("--version", action="version", version=f"tightfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.subcommands = sub
    parser.train_parser = _train_parser(sub)
    add_estimate_parser(sub)
    add_plan_parser(sub)
    add_bench_parser(sub)
    _export_parser(sub)
    sub.add_parser("doctor", help="show the GPU(s), driver, CUDA, capabilities and which techniques help")
    return parser


def _run(args) -> int:
    """Run the sub-command ``args.command``. Returns the exit code.

    Raises:
        TightfitError: bad input, or a run that cannot be done or was stopped.
    """
    if args.command == "doctor":
        from .doctor import doctor_report

        print(doctor_report())
        return 0
    if args.command == "plan":
        from .planner.cli import run as run_plan

        return run_plan(args)
    if args.command == "bench":
        from .bench.cli import run as run_bench

        return run_bench(args)
    if args.command == "estimate":
        from .memory.cli import run as run_estimate

        return run_estimate(args)
    if args.command == "export":
        from .export import export_int8, report_markdown

        print(report_markdown(export_int8(args.source, args.out, args.device)), end="")
        print(f"written: {args.out}")
        return 0
    if args.command == "train":
        if args.int8:
            from .export import TRAIN_REFUSAL

            raise TightfitError(TRAIN_REFUSAL)
        from .api import TrainRequest, train

        if args.gpus != 1 and "LOCAL_RANK" not in os.environ:  # --gpus N: torchrun starts N of this command
            from .runtime.launch import device_of, launch

            TrainRequest.from_args(args)  # the options' own checks: one line here, before any process starts
            return launch(args.gpus, device_of(args), args.argv, args.command_line)

        train(TrainRequest.from_args(args))
        return 0
    return 1


# A value after an option that argparse takes for an option (it reads only -1 and -.5 as numbers):
# -1GiB, -.5GiB, -inf, -nan. No option of tightfit looks like that (its one short option is -h).
_NEGATIVE_VALUE = re.compile(r"-(\.?\d|inf|nan)", re.IGNORECASE)


def _switches(parser: argparse.ArgumentParser) -> set[str]:
    """The long options of ``parser`` and of its sub-commands, at any depth, that take no value
    (``--full``, ``--json``, ``--help``)."""
    found = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _switches(sub)
        elif action.nargs == 0:
            found.update(s for s in action.option_strings if s.startswith("--"))
    return found


def _negative_values_attached(argv: list[str], switches: set[str] = frozenset()) -> list[str]:
    """``--budget -1GiB`` as ``--budget=-1GiB`` (also ``-.5GiB``, ``-inf``, ``-nan``): argparse takes
    a value that starts with ``-`` and is not a plain number for an option ("expected one
    argument"), so that the option's own check, which says what is wrong with the value, never
    ran. Only after a long option that takes a value: not after ``--``, nor after one of
    ``switches`` (options that take none) or an abbreviation of one."""
    out = []
    for a in argv:
        prev = out[-1] if out else ""
        takes_value = prev.startswith("--") and "=" not in prev and not any(s.startswith(prev) for s in switches)
        if takes_value and _NEGATIVE_VALUE.match(a):
            out[-1] = f"{prev}={a}"
        else:
            out.append(a)
    return out


def _interrupt(signum, frame):
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tightfit`` command. Returns the exit code."""
    old_sigterm = None
    try:
        parser = _parser()
        argv = sys.argv[1:] if argv is None else argv
        args, extra = parser.parse_known_args(_negative_values_attached(argv, _switches(parser)))
        if extra:  # refused by the sub-command, so that its hint names its own --help
            parser.subcommands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        args.argv = argv
        if args.command == "train":
            args.given_options = _given_options(parser.train_parser, argv)
            args.command_line = " ".join(shlex.quote(a) for a in ["tightfit", *argv])
            if "LOCAL_RANK" in os.environ:  # a process of --gpus N: the command as the user gave it
                from .runtime.launch import COMMAND_ENV

                args.command_line = os.environ.get(COMMAND_ENV) or args.command_line
        # SIGTERM stops like Ctrl-C (outside train's loop, which stops at a step boundary): what a
        # command was writing is cleaned up (an export's temporary folder), nothing is half-written.
        # Unless the process was started with it ignored: then it stays so, as Python leaves SIGINT.
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
            old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        from .runtime.allocator import configure_allocator

        configure_allocator()  # before anything touches CUDA
        quiet_import_warnings()
        log_to_console(to_stderr=bool(getattr(args, "json", False)))  # --json: stdout is the JSON alone
        from .config import cli_names

        with cli_names():  # the checks' messages name this command's flags, not the Python API's keywords
            return _run(args)
    except TightfitError as e:
        from .runtime.trainer import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):  # asked for: not an error, but not a finished run
            if os.environ.get("RANK", "0") == "0":  # every rank stops at the same step: rank 0 says so
                print(f"tightfit: {e}", file=sys.stderr)
            return signal_exit_code(e.signal_name)  # 130 for Ctrl-C, 143 for SIGTERM
        if not getattr(e, "every_rank", False) or os.environ.get("RANK", "0") == "0":
            try:
                print(f"tightfit: error: {e}", file=sys.stderr)
            except BrokenPipeError:  # stderr piped into a reader that stopped: still bad input, still 2
                discard_from_now(sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # outside the training loop (loading, planning): nothing was half-written
        terminated = isinstance(e, Terminated)
        if os.environ.get("RANK", "0") == "0":  # the signal reaches every rank: rank 0 says so
            print(f"tightfit: {'terminated (SIGTERM)' if terminated else 'interrupted'}", file=sys.stderr)
        return signal_exit_code("SIGTERM" if terminated else "SIGINT")
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        discard_from_now(sys.stdout)  # no second error at exit
        return 0
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a peer's exit seen from a collective
        from .runtime.distributed import lost_a_peer

        if not lost_a_peer(e):
            raise
        # another process of the run failed first and said why (one line): not this one's traceback too
        print(f"tightfit: process {os.environ.get('RANK', '?')} stopped: another process of the run ended first",
              file=sys.stderr)
        return 1
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)


if __name__ == "__main__":
    sys.exit(main())
