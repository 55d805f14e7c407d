"""The Python face of ``tightfit train``: validate everything, plan, train, write the run folder.

Order matters: every check that can fail on bad input (sizes, profiles, files, columns, the
budget against the model's state) runs before the run folder is created or the GPU touched.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .data import check_split, held_out_split, load_default, load_text_classification, take
from .devices import DeviceProfile, detect, get_profile
from .errors import TightfitError
from .fileio import atomic_write_dir, atomic_write_json, atomic_write_text
from .plan import PRECISIONS
from .rng import seed_everything
from .units import format_bytes, parse_size

CPU_DEFAULT_TRAIN_SAMPLES = 2000  # keeps the default run under 10 minutes on 2 CPU cores


@dataclass
class TrainRequest:
    """Everything ``tightfit train`` accepts (see ``tightfit train --help``)."""

    model: str | None = None
    data: str | None = None
    text_column: str = "text"
    label_column: str = "label"
    budget: str | None = None
    gpu: str | None = None
    precision: str = "auto"
    checkpointing: str = "auto"
    compile: str = "auto"
    batch_size: int = 32
    epochs: float = 3.0
    max_steps: int | None = None
    lr: float = 5e-5
    seq_len: int = 64
    seed: int = 0
    out: str | None = None
    full: bool = False
    train_samples: int | None = None
    eval_samples: int | None = None
    device: str = "auto"
    log_every: int = 10
    checkpoint_every: int = 100
    keep_last: int = 2
    warn_temp: float = 82.0
    max_skipped_steps: int = 20
    cooldown_temp: float | None = None
    resume: str | None = None
    planner: str = "search"
    progress: bool = True
    command: str = field(default_factory=lambda: " ".join(shlex.quote(a) for a in ["tightfit", *sys.argv[1:]]))


def _say(msg: str = "") -> None:
    print(msg, flush=True)


def resolve_device(req: TrainRequest) -> tuple[str, DeviceProfile | None, int | None, list[str]]:
    """Device, the card profile whose rules apply, and the budget in bytes.

    ``--gpu`` emulates a known card on whatever GPU is present (its budget and precision rules);
    ``--budget`` caps memory at a given size; neither: the local card's own budget.

    Raises:
        TightfitError: unknown profile, unreadable budget, or a budget larger than the card.
    """
    import torch

    notes = []
    profile = get_profile(req.gpu) if req.gpu else None
    budget = parse_size(req.budget) if req.budget else None
    if req.device not in ("auto", "cpu", "cuda"):
        raise TightfitError(f"unknown --device {req.device!r}; use auto, cpu or cuda")
    if req.device == "cuda" and not torch.cuda.is_available():
        raise TightfitError("--device cuda, but no CUDA GPU is visible")
    use_cuda = torch.cuda.is_available() and req.device != "cpu"
    if not use_cuda:
        if profile or budget:
            notes.append("no CUDA GPU in use: --gpu/--budget are checked but training runs on the CPU")
        return "cpu", None, budget or (profile.budget_bytes() if profile else None), notes
    local = detect()
    if profile is None:
        profile = local
    if budget is None:
        budget = profile.budget_bytes()
    if budget > local.total_bytes:
        raise TightfitError(f"budget {format_bytes(budget)} is more than the {format_bytes(local.total_bytes)} "
                            f"of {local.name}")
    return "cuda", profile, budget, notes


def train(req: TrainRequest) -> dict:
    """Run ``tightfit train``: returns the summary dict also written to ``summary.json``.

    Raises:
        TightfitError: bad input (before anything is written), or a run that cannot fit.
    """
    from .runtime.allocator import configure_allocator

    configure_allocator()  # effective only if CUDA has not started yet in this process
    import torch

    t_start = time.perf_counter()
    resume_from, changed = None, {}
    if req.resume:
        req, resume_from, changed = _resume_request(req)
    # ---- validate input: nothing is written and the GPU is untouched until all of this passed
    if req.precision not in ("auto", *PRECISIONS):
        raise TightfitError(f"unknown --precision {req.precision!r}; use auto, fp32, fp16 or bf16")
    if req.planner not in ("search", "probe"):
        raise TightfitError(f"unknown --planner {req.planner!r}; use search or probe")
    if req.checkpointing not in ("auto", "on", "off"):
        raise TightfitError(f"unknown --checkpointing {req.checkpointing!r}; use auto, on or off")
    if req.compile not in ("auto", "on", "off"):
        raise TightfitError(f"unknown --compile {req.compile!r}; use auto, on or off")
    for name in ("batch_size", "seq_len", "log_every", "keep_last", "train_samples", "eval_samples",
                 "max_skipped_steps"):
        if getattr(req, name) is not None and getattr(req, name) < 1:
            raise TightfitError(f"--{name.replace('_', '-')} must be >= 1")
    if req.checkpoint_every < 0:
        raise TightfitError("--checkpoint-every must be >= 0 (0: only at the end)")
    if not (math.isfinite(req.epochs) and math.isfinite(req.lr)) or req.epochs <= 0 or req.lr <= 0 \
            or (req.max_steps is not None and req.max_steps < 1):
        raise TightfitError("--epochs, --lr and --max-steps must be positive and finite")
    if not req.data and (req.text_column, req.label_column) != ("text", "label"):
        raise TightfitError("--text-column and --label-column name columns of a --data file; "
                            "the shipped data has its own")
    device, profile, budget, notes = resolve_device(req)
    if req.compile == "on" and (device != "cuda" or req.planner != "search"):
        raise TightfitError("--compile on needs a CUDA GPU and the search planner")
    if req.precision != "auto":
        from .levers.precision import check_precision

        notes += check_precision(req.precision, profile if device == "cuda" else None)  # raises before any banner
    from .models import check_tokenizer, model_state_bytes, resolve_for_training

    source = resolve_for_training(req.model)  # the registry: a name or a local folder
    if req.data:
        data = load_text_classification(req.data, req.text_column, req.label_column)
    else:
        data = load_default()
    out = Path(req.out) if req.out else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    _check_out(out, resuming=resume_from is not None)

    train_idx, eval_idx = held_out_split(len(data))
    limit = req.train_samples
    if limit is None and device == "cpu" and not req.full and len(train_idx) > CPU_DEFAULT_TRAIN_SAMPLES:
        limit = CPU_DEFAULT_TRAIN_SAMPLES
        notes.append(f"CPU run: training on {limit} of {len(train_idx)} training samples "
                     f"(--full for all, --train-samples N to choose)")
    if data.skipped_blank:
        notes.append(f"{data.skipped_blank} rows with a blank text or label were skipped")
    train_idx = take(train_idx, limit)
    eval_idx = take(eval_idx, req.eval_samples)
    train_data, eval_data = data.subset(train_idx), data.subset(eval_idx)
    notes += check_split(data, train_data, eval_data)

    seed_everything(req.seed)  # before the new head is initialised
    model, tokenizer = source.load_classifier(data.label_names)
    notes += source.training_notes()
    notes += check_tokenizer(model, tokenizer, source.tokenizer_path(), data.texts, req.seq_len)  # and --seq-len
    state = model_state_bytes(model)
    if budget is not None and budget < state["total"]:
        raise TightfitError(
            f"budget {format_bytes(budget)} is below the {format_bytes(state['total'])} that this model's fp32 "
            f"weights ({format_bytes(state['parameters'])}), gradients and AdamW state need")

    from .plan import Plan
    from .planner.probe import plan_first
    from .report.metrics import MetricsWriter, keep_metrics_until
    from .report.summary import plan_lines, report_markdown, summary_rows
    from .runtime.trainer import NonFiniteTrainingError, StoppedError, TrainConfig, Trainer
    from .workload import TextBatches, Workload

    workload = Workload(model, TextBatches(tokenizer, train_data, req.seq_len),
                        TextBatches(tokenizer, eval_data, req.seq_len), req.batch_size)
    device_name = "CPU" if device == "cpu" else torch.cuda.get_device_name(0)
    _say(f"tightfit {__version__}: fine-tuning {source.about} "
         f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters) on {data.source}: "
         f"{len(train_data)} training / {len(eval_data)} held-out samples, classes {data.label_names}")
    for n in notes:
        _say(f"note: {n}")

    # ---- plan (on a GPU: cap the caching allocator at the budget, then probe)
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
        _say(f"device: {device_name}, memory capped at {format_bytes(budget)}"
             + (f" (the {profile.name} profile)" if req.gpu else ""))
        model.to(device)
    t_plan = time.perf_counter()
    if resume_from is None and device == "cuda" and req.planner == "search":
        from .planner.gpu import plan_on_gpu

        plan = plan_on_gpu(workload, profile, budget, req.seq_len, req.precision, req.checkpointing, req.compile)
    elif resume_from is None:
        plan = plan_first(workload, device, profile, budget, req.precision, req.checkpointing)
    else:  # the plan in force when the checkpoint was written (micro-batch after recoveries)
        plan = Plan.from_dict(_checkpoint_state(resume_from)["plan"])
    planning_s = time.perf_counter() - t_plan
    _say("plan:" + (" (from the checkpoint)" if resume_from else ""))
    for line in plan_lines(plan):
        _say(f"  {line}")

    cfg = TrainConfig(epochs=req.epochs, max_steps=req.max_steps, lr=req.lr, seed=req.seed, log_every=req.log_every,
                      checkpoint_dir=str(out / "checkpoints"), checkpoint_every=req.checkpoint_every,
                      keep_last=req.keep_last, warn_temp_c=req.warn_temp, cooldown_temp_c=req.cooldown_temp,
                      max_skipped_steps=req.max_skipped_steps)
    records: list[dict] = []  # what the trainer logs before the metrics file is open
    trainer = Trainer(workload, plan, cfg, log=records.append, progress=req.progress,
                      profile=profile if device == "cuda" else None)
    if resume_from is not None:
        trainer.resume(resume_from)
        if trainer.step >= trainer.total_steps and (out / "summary.json").is_file():
            _say(f"run {out} already finished at step {trainer.step}: nothing to resume (nothing written)")
            return json.loads((out / "summary.json").read_text())
    # ---- from here on the run folder is written
    out.mkdir(parents=True, exist_ok=True)
    if resume_from is None or changed:
        atomic_write_json(out / "request.json", _request_record(req))
    if resume_from is not None:  # drop the records the stopped run wrote after its checkpoint
        keep_metrics_until(out / "metrics.jsonl", trainer.step)
    atomic_write_json(out / "plan.json", plan.to_dict())
    metrics = MetricsWriter(out / "metrics.jsonl")
    metrics({"type": "plan", "step": trainer.step, "planning_seconds": planning_s,
             "resumed_from": str(resume_from) if resume_from else None,
             **({"changed_options": changed} if changed else {}), **plan.to_dict()})
    for record in records:
        metrics(record)
    trainer.log = metrics
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        result = trainer.fit()
    except StoppedError as e:
        resume = f"tightfit train --resume {shlex.quote(str(out))}"
        if isinstance(e, NonFiniteTrainingError):
            resume += " --lr <lower>"
        raise type(e)(f"{e}; " + (f"checkpoint {e.checkpoint} written; continue with: {resume}" if e.checkpoint
                                  else "no checkpoint could be written"), e.step, e.checkpoint) from None
    finally:
        metrics.close()

    def save_model(tmp: Path) -> None:
        trainer.model.to("cpu").save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    atomic_write_dir(out / "model", save_model)
    health = trainer.health
    info = {
        "model": source.location(), "data": data.source, "n_train": len(train_data), "n_eval": len(eval_data),
        "label_names": data.label_names, "majority": eval_data.majority_fraction(), "device_name": device_name
        + (f", memory capped at {format_bytes(budget)}" if device == "cuda" else ""), "budget_bytes": budget,
        "torch": torch.__version__, "version": __version__, "command": req.command,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if device == "cpu" else None,
        "max_temp_c": health.max_temp_c if health else None, "max_power_w": health.max_power_w if health else None,
    }
    final_plan = result.plan
    if final_plan != plan:
        atomic_write_json(out / "plan.json", final_plan.to_dict())
    atomic_write_text(out / "report.md", report_markdown(final_plan, result, info))
    from .report.plots import plot_run

    plot_run(out, trainer.memory_timeline, budget if device == "cuda" else None)
    summary = {
        "accuracy": result.eval["accuracy"] if result.eval else None,
        "majority_accuracy": info["majority"], "eval_loss": result.eval["loss"] if result.eval else None,
        "samples_per_s": result.samples_per_s, "steps": result.steps, "train_samples": result.samples,
        "train_seconds": result.train_seconds, "planning_seconds": planning_s,
        "peak_allocated_bytes": result.peak_allocated_bytes, "peak_reserved_bytes": result.peak_reserved_bytes,
        "peak_rss_bytes": info["peak_rss_bytes"], "budget_bytes": budget, "skipped_steps": result.skipped_steps,
        "oom_recoveries": result.oom_recoveries, "device": info["device_name"], "torch": torch.__version__,
        "plan": final_plan.to_dict(), "command": req.command, "wall_seconds": time.perf_counter() - t_start,
        "health": {"status": health.status, "max_temp_c": health.max_temp_c, "max_power_w": health.max_power_w}
        if health else {"status": "off (CPU run)"},
    }
    atomic_write_json(out / "summary.json", summary)
    _say("summary:")
    for k, v in summary_rows(result, info):
        _say(f"  {k:<20} {v}")
    _say(f"run folder: {out} ({', '.join(sorted(p.name + ('/' if p.is_dir() else '') for p in out.iterdir()))})")
    return summary


def _checkpoint_state(path: Path) -> dict:
    """The saved state of checkpoint ``path`` (verified by :func:`_resume_request`).

    Raises:
        TightfitError: it cannot be loaded (one line).
    """
    from .runtime.checkpoint import read_state

    return read_state(path)


# Options a resumed run may change: they alter neither the plan nor the data order, so the
# steps before the checkpoint stay what they were (--lr rescales the schedule from there on).
RESUME_MAY_CHANGE = ("lr", "max_skipped_steps", "log_every", "warn_temp", "cooldown_temp")


def _request_record(req: TrainRequest) -> dict:
    """The request as written to ``request.json`` (what ``--resume`` starts from)."""
    return {k: v for k, v in vars(req).items() if k not in ("progress", "resume")}


def _resume_request(req: TrainRequest) -> tuple[TrainRequest, Path, dict]:
    """The request a run folder was started with (with the options of :data:`RESUME_MAY_CHANGE`
    given now), its newest intact checkpoint, and ``{option: [old, new]}`` for what changed.
    A newer corrupt checkpoint is skipped with a note (checkpoints are verified against their
    checksums here, before anything is written, about 1 to 2 s per GB); temporary folders of a
    killed checkpoint write are then removed.

    Raises:
        TightfitError: not a tightfit run folder, or no intact checkpoint in it.
    """
    from .runtime.checkpoint import latest_intact_checkpoint, list_checkpoints, remove_stale_temporaries

    run = Path(req.resume)
    if not (run / "request.json").is_file():
        raise TightfitError(f"--resume {run}: not a tightfit run folder (no request.json)")
    if not list_checkpoints(run / "checkpoints"):
        raise TightfitError(f"--resume {run}: no checkpoint to resume from")
    default = TrainRequest()
    given = {k: v for k, v in vars(req).items()
             if k not in ("resume", "progress", "command") and v != getattr(default, k)}
    ignored = [f"--{k.replace('_', '-')}" for k in given if k not in RESUME_MAY_CHANGE]
    if ignored:
        print(f"note: --resume takes the run's own options from {run / 'request.json'}; ignoring {', '.join(ignored)} "
              f"(a resumed run may change only {', '.join('--' + k.replace('_', '-') for k in RESUME_MAY_CHANGE)})",
              flush=True)
    try:
        saved = json.loads((run / "request.json").read_text())
        changed = {k: [saved.get(k), v] for k, v in given.items() if k in RESUME_MAY_CHANGE and saved.get(k) != v}
        resumed = TrainRequest(**{**saved, **{k: new for k, (_, new) in changed.items()}, "out": str(run),
                                  "resume": str(run), "progress": req.progress, "command": req.command})
    except (json.JSONDecodeError, TypeError) as e:
        raise TightfitError(f"--resume {run}: unreadable request.json ({e})") from None
    for k, (old, new) in changed.items():
        print(f"note: --resume with --{k.replace('_', '-')} {new} (the run had {old})", flush=True)
    try:
        point = latest_intact_checkpoint(run / "checkpoints")
    except TightfitError as e:
        raise type(e)(f"--resume {run}: {e}") from None
    for note in point.notes:
        print(f"note: {note}", flush=True)
    for name, size in remove_stale_temporaries(run / "checkpoints"):
        print(f"note: removed {name} ({format_bytes(size)}), left by a checkpoint write that was cut short",
              flush=True)
    return resumed, point.path, changed


def _check_out(out: Path, resuming: bool) -> None:
    """The run folder must be new or empty (or the run being resumed), and creatable.

    Raises:
        TightfitError: it is a file, holds another run, or cannot be created.
    """
    if out.exists() and not out.is_dir():
        raise TightfitError(f"--out {out} is a file, not a folder")
    if not resuming and out.exists() and any(out.iterdir()):
        raise TightfitError(f"output folder {out} exists and is not empty; choose another --out")
    parent = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise TightfitError(f"cannot create the run folder {out}: {parent} is not a writable folder")
