"""The command line: ``tightfit train``, ``tightfit estimate`` and ``tightfit doctor``.

User errors (:class:`TightfitError`) print one line ``tightfit: error: ...`` and exit with 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from .errors import TightfitError


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a text classifier under a GPU memory budget",
                       description="Fine-tune a Hugging Face model on labelled text under a GPU memory budget. "
                                   "With no arguments: the shipped MiniLM on Rotten Tomatoes fresh/rotten reviews.")
    p.add_argument("--model", help="local Hugging Face model folder (default: the shipped all-MiniLM-L6-v2)")
    p.add_argument("--data", help="CSV/TSV/JSONL file, optionally .gz/.bz2 (default: Rotten Tomatoes reviews)")
    p.add_argument("--text-column", default="text", help="column holding the text (default: text)")
    p.add_argument("--label-column", default="label", help="column holding the label; strings allowed (default: label)")
    p.add_argument("--budget", help="GPU memory the run may use, e.g. 4GiB, 11GB (default: the card's)")
    p.add_argument("--gpu", help="plan for a known card, e.g. gtx-1650-ti, gtx-1080-ti, rtx-3060 "
                                 "(its budget and precision rules)")
    p.add_argument("--precision", default="auto", help="auto|fp32|fp16|bf16 (default: auto, from the card)")
    p.add_argument("--checkpointing", default="auto", help="activation checkpointing: auto|on|off (default: auto)")
    p.add_argument("--compile", default="auto", help="torch.compile: auto|on|off (default: auto: on a GPU, kept "
                   "if the planner's compiled probe steps are faster)")
    p.add_argument("--batch-size", type=int, default=32, help="effective batch: samples per optimizer step (default: 32)")
    p.add_argument("--epochs", type=float, default=3.0, help="passes over the training data; fractions allowed (default: 3)")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate, warm-up then linear decay (default: 5e-5)")
    p.add_argument("--seq-len", type=int, default=64, help="maximum tokens per text (default: 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of sample order, dropout and the new head (default: 0)")
    p.add_argument("--out", help="run folder (default: runs/<date-time>); must not exist or be empty")
    p.add_argument("--full", action="store_true", help="on the CPU, train on all training samples (default: a subset)")
    p.add_argument("--train-samples", type=int, help="train on this many training samples (fixed random subset)")
    p.add_argument("--eval-samples", type=int, help="evaluate on this many held-out samples (default: all)")
    p.add_argument("--device", default="auto", help="auto|cuda|cpu (default: auto: the GPU if there is one)")
    p.add_argument("--log-every", type=int, default=10, help="optimizer steps between metrics lines (default: 10)")
    p.add_argument("--checkpoint-every", type=int, default=100,
                   help="write a resumable checkpoint every N optimizer steps and at the end; 0: only at the end (default: 100)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep (default: 2)")
    p.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint "
                                                   "(its other options are taken from DIR/request.json)")
    p.add_argument("--max-skipped-steps", type=int, default=20,
                   help="stop after this many non-finite (skipped) steps in a row (default: 20)")
    p.add_argument("--warn-temp", type=float, default=82.0, help="warn at this GPU temperature, deg C (default: 82)")
    p.add_argument("--cooldown-temp", type=float, help="pause between steps while the GPU is this hot (deg C)")
    p.add_argument("--planner", default="search", help="on a GPU: search (predict, then verify the best with "
                                                       "real steps) or probe (largest micro-batch by probing)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line ``tightfit: error: ...`` and exit code 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"tightfit: error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tightfit`` command. Returns the exit code."""
    parser = _Parser(prog="tightfit", description="Train PyTorch models on GPUs with little memory.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"tightfit {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    from .memory.cli import add_parser as add_estimate_parser

    add_estimate_parser(sub)
    from .planner.cli import add_parser as add_plan_parser

    add_plan_parser(sub)
    from .bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)
    sub.add_parser("doctor", help="show the GPU(s), driver, CUDA, capabilities and which techniques help")
    args = parser.parse_args(argv)
    from .runtime.allocator import configure_allocator

    configure_allocator()  # before anything touches CUDA
    try:
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
        if args.command == "train":
            from .api import TrainRequest, train

            fields = {k: v for k, v in vars(args).items() if k not in ("command", "no_progress")}
            train(TrainRequest(**fields, progress=not args.no_progress))
            return 0
    except TightfitError as e:
        from .runtime.trainer import TrainingInterrupted

        if isinstance(e, TrainingInterrupted):  # asked for: not an error, but not a finished run
            print(f"tightfit: {e}", file=sys.stderr)
            return 130
        print(f"tightfit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside the training loop (loading, planning): nothing was half-written
        print("tightfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into e.g. `head`, which stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
