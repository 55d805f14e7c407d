"""``tightfit bench run`` (one workload, on a CUDA GPU), ``tightfit bench report`` and ``tightfit bench --suite
seeds`` (:mod:`tightfit.bench.seeds`)."""

from __future__ import annotations

import platform
import shlex
import time
from pathlib import Path

from .. import __version__
from ..errors import TightfitError
from ..fileio import atomic_write_json, unwritable_folder

ALL_SETTINGS = "no-budget,compiled-no-budget,plain,hf,tightfit"  # what a GPU run compares by default


def add_parser(subparsers) -> None:
    """Add the ``bench`` sub-command to an argparse ``subparsers`` object."""
    from .workloads import WORKLOADS

    p = subparsers.add_parser("bench", help="benchmark tightfit's plan against plain PyTorch and the HF Trainer",
                              description="Measure one workload under its emulated budget, or write the report.")
    p.add_argument("--suite", choices=["seeds"], help="seeds: the 1080 Ti BERT table beside tightfit's plan for that "
                                                      "card, and the ViT-B/16 challenge (CUDA GPU; writes --out)")
    p.add_argument("--out", help="results folder of --suite")
    s = p.add_subparsers(dest="bench_command")
    r = s.add_parser("run", help="measure one workload on a CUDA GPU; writes OUT/<workload>.json")
    r.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    r.add_argument("--out", required=True, help="results folder")
    r.add_argument("--steps", type=int, default=12, help="steps per compared setting (default 12)")
    r.add_argument("--tightfit-steps", type=int, default=300, help="steps of tightfit's run (default 300)")
    r.add_argument("--warmup", type=int, default=3, help="steps left out of samples/s (default 3)")
    r.add_argument("--settings", default=None,
                   help=f"comma-separated subset of {ALL_SETTINGS} (default: all; with --device cpu: hf)")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (default) or cpu: a smoke test of the HF Trainer peer only")
    g = s.add_parser("report", help="write results.md, results.csv and results.png from a results folder")
    g.add_argument("folder")


def _check_out(out: str) -> None:
    """``--out``, a results folder (new, or one holding other results), can be written, before any work.

    Raises:
        TightfitError: empty; an existing file; a folder this process cannot create or write in
            (tried for real: :func:`tightfit.fileio.unwritable_folder`).
    """
    if not str(out).strip():
        raise TightfitError("--out is empty: give a results folder")
    o = Path(out)
    if o.exists() and not o.is_dir():
        raise TightfitError(f"--out {o} is a file; give a results folder")
    blocked = unwritable_folder(o)
    if blocked is not None:
        raise TightfitError(f"cannot write --out {o}: {blocked} is not a writable folder")


def _checked_settings(args) -> list[str]:
    """The settings ``tightfit bench run`` compares, after checking the run's options.

    Raises:
        TightfitError: unknown settings, a negative ``--warmup``, too few steps, an unusable
            ``--out`` (:func:`_check_out`), no CUDA GPU, or a CPU run of other settings.
    """
    import torch

    if args.settings is None:  # the CPU runs the HF Trainer smoke test alone
        args.settings = "hf" if args.device == "cpu" else ALL_SETTINGS
    settings = [s for s in args.settings.split(",") if s]
    unknown = set(settings) - {"no-budget", "compiled-no-budget", "plain", "hf", "tightfit"}
    if unknown:
        raise TightfitError(f"unknown settings: {', '.join(sorted(unknown))}")
    if args.warmup < 0:
        raise TightfitError(f"--warmup must be >= 0 (steps left out of samples/s), not {args.warmup}")
    if min(args.steps, args.tightfit_steps) < args.warmup + 2:  # samples/s spans two steps' ends at least
        raise TightfitError(f"--steps and --tightfit-steps must be at least --warmup + 2 ({args.warmup + 2}): "
                            "samples/s is timed between the ends of the steps after the warm-up")
    _check_out(args.out)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise TightfitError("tightfit bench run needs a CUDA GPU (--device cpu runs the HF Trainer smoke test)")
    if args.device == "cpu" and settings != ["hf"]:
        raise TightfitError("--device cpu runs only --settings hf")
    return settings


def run(args) -> int:
    """Run ``tightfit bench``; returns the exit code.

    Raises:
        TightfitError: no CUDA GPU for ``run``, unknown settings, or no results for ``report``.
    """
    if args.bench_command is None:
        if not args.suite or not args.out:
            raise TightfitError("tightfit bench: give run, report, or --suite seeds --out DIR")
        _check_out(args.out)
        from .seeds import run_seeds

        res = run_seeds(args.out)
        print(f"{args.out}/seeds.md: ViT-B/16 criteria met: {res['vit']['met']}")
        return 0
    if args.suite:
        raise TightfitError("--suite is its own command: tightfit bench --suite seeds --out DIR")
    if args.bench_command == "report":
        from .report import write_report

        for p in write_report(args.folder):
            print(p)
        return 0
    import torch

    from .workloads import get_workload

    settings = _checked_settings(args)
    w = get_workload(args.workload)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    result = {"workload": vars(w), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "tightfit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(),
              # quoted as a shell reads it: "--out my results" was written unquoted, a command that does not re-run
              "command": shlex.join(["tightfit", "bench", "run", "--workload", w.name, "--out", args.out, "--steps",
                                     str(args.steps), "--tightfit-steps", str(args.tightfit_steps), "--warmup",
                                     str(args.warmup), "--settings", args.settings]
                                    + (["--device", "cpu"] if args.device == "cpu" else [])),
              "rows": []}
    path = out / f"{w.name}.json"

    def add(rows):
        result["rows"].extend(rows)
        for r in rows:
            print({k: r.get(k) for k in ("setting", "precision", "checkpointed_blocks", "micro_batch",
                                         "accumulation_steps", "samples_per_s", "peak_reserved_bytes")}, flush=True)
        atomic_write_json(path, result)  # after every setting: a cut-short run keeps what it measured

    from . import peers, settings as st

    t0 = time.perf_counter()
    # tightfit first: a run cut short by a time limit keeps its most important row
    if "tightfit" in settings:
        add([st.tightfit(w, args.tightfit_steps, args.warmup)])
    if "no-budget" in settings:
        add(st.no_budget(w, args.steps, args.warmup))
    if "compiled-no-budget" in settings:
        add([st.compiled_no_budget(w, args.steps, args.warmup)])
    if "hf" in settings:
        precision = "fp32" if args.device == "cpu" else ("bf16" if torch.cuda.get_device_capability() >= (8, 0)
                                                         else "fp16")
        for ck in (False, True):
            if args.device == "cuda":
                st.cap_memory(w.budget_bytes)
            add([peers.hf_trainer(w, precision, ck, w.effective_batch, args.steps, args.warmup, args.device)])
            if args.device == "cuda":
                st.cap_memory(None)
    if "plain" in settings:
        add(st.plain(w, args.steps, args.warmup))
    result["seconds"] = time.perf_counter() - t0
    atomic_write_json(path, result)
    print(path)
    return 0
