"""The human report of a run: a terminal summary and ``report.md``."""

from __future__ import annotations

from ..plan import Plan
from ..units import format_bytes


def plan_lines(plan: Plan) -> list[str]:
    """The plan as short display lines. A speed says whether it is the search's prediction or,
    for a compiled plan, a measurement (its timing is named by the ``decided by:`` reason)."""
    lines = [
        f"device           {plan.device}" + (f", budget {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""),
        f"precision        {plan.precision}" + (" (autocast + dynamic loss scaling)" if plan.precision == "fp16"
                                               else " (autocast)" if plan.precision == "bf16" else ""),
        f"micro-batch      {plan.micro_batch} x {plan.accumulation_steps} accumulation steps"
        + (f" (the last {plan.effective_batch - (plan.accumulation_steps - 1) * plan.micro_batch})"
           if plan.effective_batch % plan.micro_batch else "")
        + f" = effective batch {plan.effective_batch}",
        "checkpointing    " + (("blocks " + ", ".join(map(str, plan.checkpoint_blocks)) if plan.checkpoint_blocks
                                    else "on (every block)") if plan.activation_checkpointing else "off"),
    ]
    if plan.predicted_samples_per_s and plan.compile:  # no prediction for compiled steps: a timing decided
        lines.append(f"measured         {plan.predicted_samples_per_s:.0f} samples/s, compiled (the timing is "
                     f"named in 'decided by' below)")
    elif plan.predicted_samples_per_s:
        lines.append(f"predicted        {plan.predicted_samples_per_s:.0f} samples/s"
                     + (f", peak {format_bytes(plan.predicted_peak_reserved_bytes)} reserved"
                        if plan.predicted_peak_reserved_bytes is not None else ""))
    if plan.probe_peak_reserved_bytes is not None:
        lines.append(f"probe peak       {format_bytes(plan.probe_peak_reserved_bytes)} reserved")
    lines += [f"why: {r}" for r in plan.reasons]
    return lines


def summary_rows(result, info: dict) -> list[tuple[str, str]]:
    """(label, value) rows of the end-of-run summary from a ``TrainResult`` and run info
    (``majority``, ``budget_bytes``, ``peak_rss_bytes``, ``device_name``, ...)."""
    rows = []
    if result.eval:
        rows.append(("held-out accuracy", f"{result.eval['accuracy']:.4f} on {result.eval['samples']} samples "
                                          f"(majority class {info['majority']:.4f})"))
        rows.append(("held-out loss", f"{result.eval['loss']:.4f}"))
    rows.append(("training", f"{result.steps} steps, {result.samples} samples in {result.train_seconds:.1f} s"))
    rows.append(("samples/s", f"{result.samples_per_s:.1f}"))
    rows.append(("final train loss", f"{result.final_loss:.4f}"))
    if result.peak_reserved_bytes is not None:
        budget = info.get("budget_bytes")
        rows.append(("peak GPU memory", f"{format_bytes(result.peak_allocated_bytes)} allocated, "
                                        f"{format_bytes(result.peak_reserved_bytes)} reserved"
                                        + (f" of a {format_bytes(budget)} budget "
                                           f"({100 * result.peak_reserved_bytes / budget:.0f}%)" if budget else "")))
    if info.get("peak_rss_bytes"):
        rows.append(("peak process memory", format_bytes(info["peak_rss_bytes"]) + " (host RSS)"))
    rows.append(("skipped steps", str(result.skipped_steps)))
    rows.append(("OOM recoveries", str(result.oom_recoveries)))
    if info.get("max_temp_c") is not None:
        rows.append(("GPU max temperature", f"{info['max_temp_c']:.0f} C, max power {info['max_power_w']:.0f} W"))
    return rows


def report_markdown(plan: Plan, result, info: dict) -> str:
    """``report.md``: what ran, the plan and the measured summary."""
    out = ["# tightfit run report", "",
           f"- model: `{info['model']}`", f"- data: `{info['data']}` ({info['n_train']} training, "
           f"{info['n_eval']} held-out samples; {info['label_names']})",
           f"- hardware: {info['device_name']}", f"- torch {info['torch']}, tightfit {info['version']}",
           f"- command: `{info['command']}`", "", "## Plan", "", "```", *plan_lines(plan), "```", "",
           "## Measured", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in summary_rows(result, info)]
    if result.events:
        out += ["", "## Events", ""] + [f"- {e}" for e in result.events]
    return "\n".join(out) + "\n"
