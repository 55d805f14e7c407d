"""The benchmark's tables: per workload, every setting's samples/s, memory and planning time,
and tightfit's ratios against the planner issue's targets; Markdown, CSV and a PNG chart."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
from pathlib import Path

from ..fileio import atomic_write_bytes, atomic_write_text
from ..units import format_bytes, format_rate

log = logging.getLogger(__name__)

COLUMNS = ("workload", "setting", "precision", "compile", "checkpointed_blocks", "micro_batch", "accumulation_steps",
           "effective_batch", "samples_per_s", "peak_reserved_bytes", "ooms_after_planning", "planning_seconds",
           "steps", "fits")

# Targets of the planner issue: (workload, ratio name, target).
TARGETS = [
    ("bert-base-128@4GiB", "vs no-budget best", 0.80),
    ("bert-base-128@4GiB", "vs best HF Trainer", 1.25),
    ("bert-base-128@11GiB", "vs no-budget best", 0.95),
    ("resnet50-224@4GiB", "vs no-budget best", 0.80),
]


def _best(rows, setting):
    rows = [r for r in rows if r["setting"].startswith(setting) and r.get("samples_per_s")
            and not math.isnan(r["samples_per_s"])]
    return max(rows, key=lambda r: r["samples_per_s"]) if rows else None


def ratios(rows: list[dict]) -> dict:
    """tightfit's samples/s over the no-budget best (eager, as the planner issue measures it), the
    best HF Trainer, the best plain configuration and -- for reference, not a target -- the compiled
    no-budget run, of one workload's rows (NaN where a setting is missing)."""
    tf = _best(rows, "tightfit")
    out = {}
    for name, setting in (("vs no-budget best", "no budget"), ("vs best HF Trainer", "HF Trainer"),
                          ("vs best plain PyTorch", "plain"), ("vs compiled no-budget", "compiled no budget")):
        ref = _best(rows, setting)
        out[name] = tf["samples_per_s"] / ref["samples_per_s"] if tf and ref else math.nan
    return out


_WORKLOAD_KEYS = ("name", "arch", "size", "budget", "effective_batch")  # of every result's "workload"


def load(folder: str | Path) -> list[dict]:
    """Every ``<workload>.json`` written by ``tightfit bench run`` in ``folder``.

    Raises:
        TightfitError: ``folder`` is not a folder, or a JSON file in it is not a benchmark result
            (not an object with ``workload`` and ``rows``, or without what the report reads of them).
    """
    from ..errors import TightfitError

    folder = Path(folder)
    if not folder.is_dir():
        raise TightfitError(f"{folder} is a file, not a folder of benchmark results (give the folder that holds it)"
                            if folder.exists() else f"benchmark results folder not found: {folder}")
    results = []
    for p in sorted(folder.glob("*.json")):
        try:
            res = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TightfitError(f"{p}: not valid JSON ({e})") from None
        if not (isinstance(res, dict) and isinstance(res.get("rows"), list) and isinstance(res.get("workload"), dict)):
            raise TightfitError(f"{p}: not a result of tightfit bench run (no workload and rows)")
        # what the tables read: a result edited by hand or written by another tool that lacks one
        # ended in a KeyError's traceback
        lacking = [f"workload.{k}" for k in _WORKLOAD_KEYS if k not in res["workload"]] + \
            [k for k in ("device", "torch") if k not in res] + \
            [f"rows[{i}].setting" for i, r in enumerate(res["rows"])
             if not (isinstance(r, dict) and "setting" in r)][:1]
        # the Targets table reads these of tightfit's measured rows
        lacking += [f"rows[{i}].{k}" for i, r in enumerate(res["rows"]) if isinstance(r, dict)
                    and str(r.get("setting", "")).startswith("tightfit") and r.get("samples_per_s")
                    for k in ("steps", "ooms_after_planning", "planning_seconds") if k not in r][:1]
        if lacking:
            raise TightfitError(f"{p}: not a result of tightfit bench run (it lacks {', '.join(lacking)})")
        results.append(res)
    return results


def _fmt(v, key):
    if v is None or v == "":
        return ""
    if key == "peak_reserved_bytes":
        return format_bytes(v)
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if key == "planning_seconds":
            return f"{v:,.1f}"
        # a rate under 100 keeps three significant digits (1.40 and 1.85 samples/s read "1" and "2")
        return format_rate(v) if key == "samples_per_s" and abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def markdown(results: list[dict]) -> str:
    """Per workload a table of settings and tightfit's ratios, then the targets."""
    out = []
    for res in results:
        rows = res["rows"]
        out.append(f"## {res['workload']['name']}\n")
        out.append(f"{res['workload']['arch']}, size {res['workload']['size']}, budget {res['workload']['budget']}, "
                   f"effective batch {res['workload']['effective_batch']}; {res['device']}, torch {res['torch']}\n")
        keys = ("setting", "precision", "compile", "checkpointed_blocks", "micro_batch", "accumulation_steps", "samples_per_s",
                "peak_reserved_bytes", "ooms_after_planning", "planning_seconds")
        out.append("| " + " | ".join(k.replace("_", " ") for k in keys) + " |")
        out.append("|" + "---|" * len(keys))
        for r in rows:
            r = dict(r, samples_per_s=r.get("samples_per_s") if r.get("fits", True) else None)
            cells = [_fmt(r.get(k), k) for k in keys]
            if not r.get("fits", True):
                cells[keys.index("samples_per_s")] = r.get("error") or "does not fit at batch 1"
            out.append("| " + " | ".join(cells) + " |")
        measured = {k: v for k, v in ratios(rows).items() if not math.isnan(v)}
        out.append(("\ntightfit: " + ", ".join(f"{k} **{v:.2f}**" for k, v in measured.items()) if measured
                    else "\ntightfit: not measured in this run") + "\n")
    out.append("## Targets\n")
    out.append("| workload | ratio | target | measured | met |")
    out.append("|---|---|---|---|---|")
    for res in results:
        name = res["workload"]["name"]
        rs = ratios(res["rows"])
        targets = [(n, t) for w, n, t in TARGETS if w == name] + [("vs best plain PyTorch", 1.10)]
        for n, t in targets:
            v = rs.get(n, math.nan)
            out.append(f"| {name} | {n} | ≥ {t:.2f} | " + ("not measured | — |" if math.isnan(v) else
                                                          f"{v:.2f} | {'yes' if v >= t else 'no'} |"))
        tf = _best(res["rows"], "tightfit")
        if tf:
            out.append(f"| {name} | OOMs after planning ({tf['steps']} steps) | 0 | {tf['ooms_after_planning']} | "
                       f"{'yes' if tf['ooms_after_planning'] == 0 else 'no'} |")
            out.append(f"| {name} | planning seconds | ≤ 30 | {tf['planning_seconds']:.1f} | "
                       f"{'yes' if tf['planning_seconds'] <= 30 else 'no'} |")
    return "\n".join(out) + "\n"


def to_csv(results: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    for res in results:
        for r in res["rows"]:
            w.writerow({"workload": res["workload"]["name"], **r})
    return buf.getvalue()


def chart(results: list[dict]) -> bytes:
    """A PNG: per workload, samples/s of the best of each setting relative to the no-budget best."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = ("tightfit", "plain", "HF Trainer")
    names = [r["workload"]["name"] for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / len(settings)
    for i, s in enumerate(settings):
        vals = []
        for res in results:
            ref, best = _best(res["rows"], "no budget"), _best(res["rows"], s)
            vals.append(best["samples_per_s"] / ref["samples_per_s"] if ref and best else 0)
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=s)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks([j + width for j in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("samples/s / no-budget best")
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()


def write_report(folder: str | Path) -> list[Path]:
    """Write ``results.md``, ``results.csv`` and ``results.png`` (without matplotlib: not drawn, with a
    note) for the JSON files in ``folder``; returns the files written.

    Raises:
        TightfitError: no results in ``folder`` (:func:`load`'s errors), or a ``folder`` this
            process cannot write in (a read-only mount), before anything is drawn or written.
    """
    from ..errors import TightfitError
    from ..fileio import unwritable_folder

    results = load(folder)
    if not results:
        raise TightfitError(f"no benchmark results (*.json) in {folder}")
    folder = Path(folder)
    if unwritable_folder(folder) is not None:  # results read from a read-only copy: OSError's traceback before
        raise TightfitError(f"cannot write the report into {folder}: not a writable folder (results.md, results.csv "
                            "and results.png go beside the results); copy the results to a folder you can write")
    atomic_write_text(folder / "results.md", "# tightfit bench\n\n" + markdown(results))
    atomic_write_text(folder / "results.csv", to_csv(results))
    written = [folder / "results.md", folder / "results.csv"]
    try:  # optional (the plots extra), as a run's plots are
        import matplotlib  # noqa: F401
    except ImportError:
        log.warning("note: results.png not drawn: matplotlib is not installed (pip install 'tightfit[plots]')")
        return written
    atomic_write_bytes(folder / "results.png", chart(results))
    return written + [folder / "results.png"]
