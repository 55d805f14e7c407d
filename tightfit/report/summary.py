"""The report of a run: the plan as lines, the summary (``summary.json`` and the terminal's
rows) and ``report.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..errors import TightfitError
from ..plan import Plan
from ..units import count_of, format_bytes, format_rate

if TYPE_CHECKING:
    from ..runtime.trainer import TrainResult


def plan_lines(plan: Plan) -> list[str]:
    """The plan as short display lines. A speed says whether it is the search's prediction or,
    for a compiled plan, a measurement (its timing is named by the ``decided by:`` reason)."""
    from ..levers.blocks import describe_policies

    lines = [
        f"device           {plan.device}" + (f", budget {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""),
        f"precision        {plan.precision}" + (" (autocast + dynamic loss scaling)" if plan.precision == "fp16"
                                               else " (autocast)" if plan.precision == "bf16" else ""),
        f"micro-batch      {plan.micro_batch} x {plan.accumulation_steps} accumulation steps"
        + (f" (the last {plan.rank_batch - (plan.accumulation_steps - 1) * plan.micro_batch})"
           if plan.rank_batch % plan.micro_batch else "")
        + (f" x {plan.world_size} ranks ({plan.sharding.upper().replace('-OFFLOAD', ', parameters offloaded')})"
           if plan.world_size > 1 else "")
        + f" = effective batch {plan.effective_batch}",
        "checkpointing    " + ("per block: " + describe_policies(plan.block_policies) if plan.block_policies is not None
                               else ("blocks " + ", ".join(map(str, plan.checkpoint_blocks)) if plan.checkpoint_blocks
                                     else "on (every block)") if plan.activation_checkpointing else "off"),
    ]
    if plan.sharding == "fsdp-offload":  # the reasons say why and what the GPU keeps
        lines.append("offload          parameters, gradients and AdamW state in host memory (FSDP2)")
    if plan.optimizer != "adamw":  # an optimizer lever (the reasons say why and what it costs)
        lines.append(f"optimizer        {plan.optimizer}")
    if plan.trainable_params is not None:
        lines.append(f"trainable        {plan.trainable}: {plan.trainable_params:,} parameters")
    if plan.predicted_samples_per_s and plan.compile:  # no prediction for compiled steps: a timing decided
        lines.append(f"measured         {format_rate(plan.predicted_samples_per_s)} samples/s, compiled"
                     + {"model": " as one whole-model graph",
                        "model-graphs": " as one whole-model graph replayed as CUDA graphs"}.get(plan.compile_scope, "")
                     + " (the timing is named in 'decided by' below)")
    elif plan.predicted_samples_per_s:
        lines.append(f"predicted        {format_rate(plan.predicted_samples_per_s)} samples/s"
                     + (f", peak {format_bytes(plan.predicted_peak_reserved_bytes)} reserved"
                        if plan.predicted_peak_reserved_bytes is not None else ""))
    if plan.probe_peak_reserved_bytes is not None:
        lines.append(f"probe peak       {format_bytes(plan.probe_peak_reserved_bytes)} reserved")
    lines += [f"why: {r}" for r in plan.reasons]
    return lines


@dataclass(frozen=True)
class RunInfo:
    """What was trained, where and how: the header of the report.

    Attributes:
        model: the model folder.
        data: where the data came from.
        n_train, n_eval: training and held-out samples.
        label_names: the classes.
        majority: held-out accuracy of always answering the most common class.
        device_name: ``"CPU"`` or the GPU's name (with ``", memory capped at ..."``).
        budget_bytes: the GPU memory budget applied (None on the CPU, where a ``--budget`` is not applied).
        torch, version: the versions of PyTorch and tightfit.
        command: the command line.
        commands: every session's command line, in order (a resumed run's; empty: ``command`` alone).
        peak_rss_bytes: peak host memory of the process (CPU runs and parameter offload; None on a GPU).
        max_temp_c, max_power_w: the GPU's hottest and most power-hungry readings (None: not sampled).
        input_size: a sample's size as ``tightfit plan`` says it: ``"sequence length 64"`` (tokens)
            or ``"image size 224"`` (pixels a side); empty: not given.
        notes: this session's notes on the data and the options (``note: ...`` on the terminal),
            e.g. held-out samples that also appear among the training samples.
    """

    model: str
    data: str
    n_train: int
    n_eval: int
    label_names: list[str]
    majority: float
    device_name: str
    budget_bytes: int | None
    torch: str
    version: str
    command: str
    commands: tuple[str, ...] = ()
    peak_rss_bytes: int | None = None
    max_temp_c: float | None = None
    max_power_w: float | None = None
    input_size: str = ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunSummary:
    """The end-of-run numbers, as written to ``summary.json`` (its keys are these fields').

    Attributes:
        accuracy, eval_loss: the last held-out evaluation (None: none ran).
        majority_accuracy: held-out accuracy of the most common class.
        samples_per_s, steps, train_samples, train_seconds: the training loop's pace and length.
        planning_seconds: time spent planning (on resume: the first run's); wall_seconds: the whole run's
            time (on resume: every session's up to the checkpoint resumed, then this one's).
        peak_allocated_bytes, peak_reserved_bytes: CUDA peaks (None on the CPU).
        peak_rss_bytes: peak host memory (CPU runs and parameter offload).
        budget_bytes: the memory budget applied, bytes (None on the CPU).
        skipped_steps, oom_recoveries: steps not applied (non-finite) and windows redone after an OOM.
        device, torch, command: where and how it ran.
        commands: every session's command line, in order (one for a run never resumed; None in
            summaries written before it existed).
        plan: the plan in force at the end.
        health: ``{"status", "max_temp_c", "max_power_w"}`` on a GPU, ``{"status": "off (CPU run)"}`` on the CPU.
        speed: predicted, probed and delivered samples/s and the time breakdown
            (:func:`tightfit.report.speed.speed_record`; None in summaries written before it existed).
    """

    accuracy: float | None
    majority_accuracy: float
    eval_loss: float | None
    samples_per_s: float
    steps: int
    train_samples: int
    train_seconds: float
    planning_seconds: float
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_rss_bytes: int | None
    budget_bytes: int | None
    skipped_steps: int
    oom_recoveries: int
    device: str
    torch: str
    plan: Plan
    command: str
    wall_seconds: float
    health: dict
    speed: dict | None = None
    commands: list[str] | None = None

    @classmethod
    def of_run(cls, result: TrainResult, info: RunInfo, planning_seconds: float, wall_seconds: float,
               health_status: str | None, speed: dict | None = None) -> "RunSummary":
        """The summary of a finished run from the trainer's result and the run's info;
        ``health_status`` is the GPU health monitor's (None: no monitor, a CPU run)."""
        health = ({"status": health_status, "max_temp_c": info.max_temp_c, "max_power_w": info.max_power_w}
                  if health_status is not None else {"status": "off (CPU run)"})
        return cls(
            accuracy=result.eval["accuracy"] if result.eval else None, majority_accuracy=info.majority,
            eval_loss=result.eval["loss"] if result.eval else None, samples_per_s=result.samples_per_s,
            steps=result.steps, train_samples=result.samples, train_seconds=result.train_seconds,
            planning_seconds=planning_seconds, peak_allocated_bytes=result.peak_allocated_bytes,
            peak_reserved_bytes=result.peak_reserved_bytes, peak_rss_bytes=info.peak_rss_bytes,
            budget_bytes=info.budget_bytes, skipped_steps=result.skipped_steps, oom_recoveries=result.oom_recoveries,
            device=info.device_name, torch=info.torch, plan=result.plan, command=info.command,
            wall_seconds=wall_seconds, health=health, speed=speed, commands=list(info.commands or (info.command,)))

    def to_dict(self) -> dict:
        """The ``summary.json`` dict (the plan as :meth:`Plan.to_dict`; a non-finite number, e.g. the
        held-out loss of a model gone NaN, as the string ``"nan"`` or ``"inf"``: JSON has none, and
        metrics.jsonl writes them so)."""
        return {f.name: _json_number(getattr(self, f.name)) for f in fields(self)} | {"plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> "RunSummary":
        """Inverse of :meth:`to_dict`.

        Raises:
            TightfitError: a key is missing or the plan is malformed.
        """
        optional = ("speed", "commands")
        missing = [f.name for f in fields(cls) if f.name not in d and f.name not in optional]
        if missing:
            raise TightfitError(f"malformed run summary: no {', '.join(missing)}")
        numbers = {k: float(d[k]) for k in ("accuracy", "eval_loss") if d.get(k) in _NON_FINITE}  # to_dict's strings
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d} | numbers | {"plan": Plan.from_dict(d["plan"])})


_NON_FINITE = ("nan", "inf", "-inf")  # str() of the floats JSON cannot hold


def _json_number(v):
    """``v`` for JSON: a non-finite float as its string (also inside a dict, the ``speed`` record)."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return {k: _json_number(x) for k, x in v.items()} if isinstance(v, dict) else v


def summary_rows(result: TrainResult, info: RunInfo) -> list[tuple[str, str]]:
    """(label, value) rows of the end-of-run summary from the trainer's result and the run's info."""
    rows = []
    if result.eval:
        held_out = result.eval.get("held_out")  # some labelled -100: left out of the accuracy
        counted = count_of(result.eval["samples"], "sample") if held_out is None else \
            f"the {result.eval['samples']} labelled of {held_out} samples"
        rows.append(("held-out accuracy", f"{result.eval['accuracy']:.4f} on {counted} "
                                          f"(majority class {info.majority:.4f})"))
        if not math.isfinite(result.eval["loss"]):
            # its outputs are not finite: the accuracy is argmax over inf/NaN logits, and more training is no cure
            rows.append(("note", "the model's held-out outputs are not finite (its weights diverged): the accuracy "
                                 "means nothing; train again with a lower --lr"))
        elif result.eval["accuracy"] <= info.majority:
            # a short trial often stops here (e.g. --train-samples 1000 --epochs 1 on the default job)
            rows.append(("note", "the model does no better than always answering the most common class: train "
                                 "on more samples or for more epochs"))
        rows.append(("held-out loss", f"{result.eval['loss']:.4f}"))
    rows.append(("training", f"{result.steps} step{'' if result.steps == 1 else 's'}, {result.samples} samples in {result.train_seconds:.1f} s"))
    rows.append(("samples/s", format_rate(result.samples_per_s)))  # as the speed row and the plan's lines show it
    rows.append(("final train loss", f"{result.final_loss:.4f}"))
    if result.peak_reserved_bytes is not None:
        budget = info.budget_bytes
        rows.append(("peak GPU memory", f"{format_bytes(result.peak_allocated_bytes)} allocated, "
                                        f"{format_bytes(result.peak_reserved_bytes)} reserved"
                                        + (f" of a {format_bytes(budget)} budget "
                                           f"({100 * result.peak_reserved_bytes / budget:.0f}%)" if budget else "")))
    if info.peak_rss_bytes:
        ranks = getattr(result.plan, "world_size", 1) or 1  # each rank is a process: this is rank 0's
        rows.append(("peak process memory", format_bytes(info.peak_rss_bytes)
                     + (" (host RSS)" if ranks == 1 else f" (host RSS of rank 0, one of {ranks} processes)")))
    rows.append(("skipped steps", str(result.skipped_steps)))
    rows.append(("OOM recoveries", str(result.oom_recoveries)))
    # this session's CUDA graphs (tightfit.runtime.graphs); a hand-made result may have no such fields
    off = getattr(result, "graphs_off", None)
    if getattr(result, "graphed_steps", 0):
        rows.append(("CUDA graphs", f"{result.graphed_steps:,} steps replayed from {result.step_graphs} captured "
                                    f"step graphs ({format_bytes(result.graph_pool_bytes)} of memory for them at most)"
                                    + (f"; then off: {off}" if off else "")))
    elif off and getattr(getattr(result, "plan", None), "device", None) == "cuda":
        rows.append(("CUDA graphs", f"not used: {off}"))  # what would have made it faster
    if info.max_temp_c is not None:
        rows.append(("GPU max temperature", f"{info.max_temp_c:.0f} C, max power {info.max_power_w:.0f} W"))
    return rows


def _command_lines(info: RunInfo) -> list[str]:
    """The report's command line, or for a resumed run each session's, one line each."""
    if len(info.commands) < 2:
        return [f"- command: `{info.command}`"]
    return ["- commands (one per session):"] + [f"  - `{c}`" for c in info.commands]


def report_markdown(plan: Plan, result: TrainResult, info: RunInfo, speed: dict | None = None) -> str:
    """``report.md``: what ran, the plan and the measured summary; with ``speed``
    (:func:`tightfit.report.speed.speed_record`), the speeds side by side and where the time went."""
    out = ["# tightfit run report", "",
           f"- model: `{info.model}`" + (f", {info.input_size}" if info.input_size else ""), f"- data: `{info.data}` ({info.n_train} training, "
           f"{info.n_eval} held-out samples; {info.label_names})",
           f"- hardware: {info.device_name}", f"- torch {info.torch}, tightfit {info.version}",
           *_command_lines(info), "",
           *(["## Notes", "", *[f"- {n}" for n in info.notes], ""] if info.notes else []),  # what qualifies the figures
           "## Plan", "", "```", *plan_lines(plan), "```", "",
           "## Measured", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in summary_rows(result, info)]
    if speed is not None:
        from .speed import speed_rows

        out += ["", "## Speed: delivered against predicted", "", "| | |", "|---|---|"]
        out += [f"| {k} | {v} |" for k, v in speed_rows(speed)]
    if result.events:
        out += ["", "## Events", ""] + [f"- {e}" for e in result.events]
    return "\n".join(out) + "\n"
