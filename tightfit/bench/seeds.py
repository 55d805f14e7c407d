"""``tightfit bench --suite seeds``: the two examples the project started from, measured.

1. **The GTX 1080 Ti table** -- BERT-base fine-tuning on an 11 GB card, three hand-made
   configurations (FP32 at batch 8; FP16 with gradient accumulation to an effective batch of 32;
   FP16 with activation checkpointing at batch 16), each run for real under the card's budget
   (:meth:`tightfit.devices.DeviceProfile.budget_bytes` of the ``gtx-1080-ti`` profile, emulated with
   ``torch.cuda.set_per_process_memory_fraction``) and also predicted without a GPU by tightfit's
   estimator; beside them tightfit's own plan for that card at effective batch 32: predicted
   (``tightfit plan``, no GPU) and planned on the GPU (real probe steps under the budget, the
   card's precision rules), then run. ``torch.compile`` is off in these plans: Triton, its GPU
   backend, does not run on the 1080 Ti's compute capability 6.1. Samples are random token ids at
   the full sequence length (memory and speed do not depend on their values).
2. **The ViT-Base challenge** -- ViT-B/16 at 224 px, effective batch >= 16, under 10 GiB, with
   less than 2 points of held-out accuracy lost against the fp32 run of the same data and seed:
   ``tightfit train`` twice on scikit-learn's digits upscaled to 224 px (3 channels; 1,617
   training / 180 held-out images, the fixed split), from the same random initialisation (no
   ViT weights are available offline): once in fp32 without a budget or checkpointing, once as
   tightfit plans it under the budget.

Speed is the GPU's own (an H200 is far faster than a 1080 Ti); memory behaviour is the emulated
card's. Writes ``seeds.json`` (after each part), ``seeds.md`` and two charts into the output folder.
"""

from __future__ import annotations

import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import __version__
from ..errors import TightfitError
from ..fileio import atomic_write_bytes, atomic_write_json, atomic_write_text
from ..units import format_bytes, parse_size

# The 1080 Ti table: (name, precision, micro-batch, effective batch, activation checkpointing).
ARTICLE_ROWS = (
    ("FP32, batch 8", "fp32", 8, 8, False),
    ("FP16 + gradient accumulation, effective batch 32", "fp16", 8, 32, False),
    ("FP16 + activation checkpointing, batch 16", "fp16", 16, 16, True),
)
ACCURACY_LOSS_LIMIT = 0.02  # the challenge: less than 2 points below fp32


@dataclass(frozen=True)
class SeedsConfig:
    """What the suite runs (defaults: the articles' settings; the CPU smoke test shrinks them).

    Attributes:
        bert: model for the 1080 Ti table (registry name or folder; random weights from its config).
        seq_len: tokens per sample (512: at 128 all three configurations fit with room to spare).
        bert_steps, warmup: optimizer steps per row, and how many of the first are left out of it/s.
        card: the profile whose budget and precision rules the table is run under.
        vit: model of the challenge (registry name or image-classifier folder).
        image_size: side in pixels; vit_budget: the challenge's budget; vit_batch: effective batch.
        vit_epochs, vit_lr: the fine-tune's length and peak learning rate (AdamW, warm-up, decay).
        device: ``cuda``, or ``cpu`` for the smoke test (no budgets, no GPU planning).
    """

    bert: str = "bert-base"
    seq_len: int = 512
    bert_steps: int = 20
    warmup: int = 3
    card: str = "gtx-1080-ti"
    vit: str = "vit-b16"
    image_size: int = 224
    vit_budget: str = "10GiB"
    vit_batch: int = 16
    vit_epochs: float = 12.0
    vit_lr: float = 1e-4
    device: str = "cuda"


def _predicted(model, make_batch, cfg: SeedsConfig, card, precision: str, micro: int, effective: int,
               checkpointing: bool) -> dict:
    """tightfit's estimate (no GPU) of one configuration's peak memory on ``card``."""
    from ..levers.blocks import find_blocks
    from ..planner.search import estimator_for

    blocks = tuple(range(len(find_blocks(model)))) if checkpointing else ()
    est = estimator_for(model, make_batch, cfg.seq_len, card, effective)(precision, micro, blocks)
    return {"predicted_peak_reserved_bytes": est.peak_reserved_bytes,
            "predicted_peak_allocated_bytes": est.peak_allocated_bytes}


def _measured(cfg: SeedsConfig, budget: int, effective_batch: int, plan_for) -> dict:
    """One configuration run for ``cfg.bert_steps`` optimizer steps of ``effective_batch`` samples
    under ``budget`` (CUDA) or on the CPU; ``plan_for(workload)`` gives its plan. Peak memory, it/s
    (optimizer steps per second) and samples/s after the warm-up."""
    from .settings import cap_memory, clean, timed_run
    from .workloads import BenchWorkload, make_workload

    cuda = cfg.device == "cuda"
    if cuda:
        cap_memory(budget)
    w = BenchWorkload("seeds-bert", cfg.bert, cfg.seq_len, str(budget), effective_batch)
    wl = make_workload(w, effective_batch, effective_batch * cfg.bert_steps, device=cfg.device)
    plan = plan_for(wl)
    row = timed_run(wl, plan, cfg.bert_steps, cfg.warmup)
    row["it_per_s"] = row["samples_per_s"] / plan.effective_batch
    row["reasons"] = list(plan.reasons)
    del wl
    if cuda:
        clean()
        cap_memory(None)
    return row


def bert_table(cfg: SeedsConfig) -> dict:
    """The 1080 Ti table: each article row predicted and measured, and tightfit's plan for the card."""
    from ..devices import get_profile
    from ..models import build_model
    from ..plan import Plan
    from ..planner.search import estimator_for, search

    card = get_profile(cfg.card)
    budget = card.budget_bytes()
    model, make_batch = build_model(cfg.bert)  # meta: shapes only, for the estimator
    rows = []
    for name, prec, micro, eff, ck in ARTICLE_ROWS:
        def fixed(wl, prec=prec, micro=micro, eff=eff, ck=ck):
            return Plan(prec, micro, eff, ck, device=cfg.device, reasons=("as in the 1080 Ti table",))
        row = {"setting": name, **_predicted(model, make_batch, cfg, card, prec, micro, eff, ck)}
        row.update(_measured(cfg, budget, eff, fixed))
        rows.append(row)
    t0 = time.perf_counter()
    result = search(model, make_batch, cfg.seq_len, 32, card, budget,
                    estimator_for(model, make_batch, cfg.seq_len, card, 32))
    predicted_plan = result.to_plan("cuda")
    rows.append({"setting": "tightfit plan, predicted (no GPU)", "precision": predicted_plan.precision,
                 "micro_batch": predicted_plan.micro_batch, "accumulation_steps": predicted_plan.accumulation_steps,
                 "effective_batch": 32, "checkpointed_blocks": len(predicted_plan.checkpoint_blocks or ())
                 if predicted_plan.checkpoint_blocks is not None else
                 (result.n_blocks if predicted_plan.activation_checkpointing else 0),
                 "predicted_peak_reserved_bytes": predicted_plan.predicted_peak_reserved_bytes,
                 "predicted_samples_per_s_on_card": predicted_plan.predicted_samples_per_s,
                 "planning_seconds": time.perf_counter() - t0, "reasons": list(predicted_plan.reasons)})

    def planned(wl):
        if cfg.device != "cuda":
            from ..planner.probe import plan_first

            return plan_first(wl, "cpu", None, None)
        from ..planner.gpu import plan_on_gpu

        return plan_on_gpu(wl, card, budget, cfg.seq_len, compile="off")

    t0 = time.perf_counter()
    w32 = _measured(cfg, budget, 32, planned)
    rows.append({"setting": "tightfit plan, planned on the GPU and run", **w32,
                 "planning_and_run_seconds": time.perf_counter() - t0})
    return {"card": card.name, "budget_bytes": budget, "seq_len": cfg.seq_len, "model": cfg.bert, "rows": rows}


def vit_challenge(cfg: SeedsConfig, work: Path) -> dict:
    """ViT-B/16 on digits at ``cfg.image_size`` px: ``tightfit train`` in fp32 (no budget, no
    checkpointing, no compilation) and as planned under ``cfg.vit_budget``, same data and seed."""
    from ..api import train
    from ..config import TrainRequest

    common = dict(model=cfg.vit, data="digits", image_size=cfg.image_size, batch_size=cfg.vit_batch,
                  epochs=cfg.vit_epochs, lr=cfg.vit_lr, seed=0, checkpoint_every=0, keep_last=1, progress=False,
                  device=cfg.device, log_every=50)
    runs = {}
    for name, extra in (("fp32", dict(precision="fp32", checkpointing="off", compile="off")),
                        ("tightfit", dict(budget=cfg.vit_budget) if cfg.device == "cuda" else {})):
        if cfg.device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        s = train(TrainRequest(**common, **extra, out=str(work / name)))
        runs[name] = {"accuracy": s.accuracy, "majority_accuracy": s.majority_accuracy,
                      "peak_reserved_bytes": s.peak_reserved_bytes, "peak_allocated_bytes": s.peak_allocated_bytes,
                      "samples_per_s": s.samples_per_s, "steps": s.steps, "planning_seconds": s.planning_seconds,
                      "oom_recoveries": s.oom_recoveries, "wall_seconds": time.perf_counter() - t0,
                      "plan": s.plan.to_dict()}
        if cfg.device == "cuda":
            torch._dynamo.reset()
    loss = runs["fp32"]["accuracy"] - runs["tightfit"]["accuracy"]
    budget = parse_size(cfg.vit_budget)
    peak = runs["tightfit"]["peak_reserved_bytes"]
    eff = runs["tightfit"]["plan"]["effective_batch"]
    return {"model": cfg.vit, "image_size": cfg.image_size, "budget_bytes": budget, "runs": runs,
            "accuracy_loss": loss,
            "met": {"effective batch >= 16": eff >= 16,
                    f"peak reserved under {cfg.vit_budget}": peak is not None and peak <= budget,
                    "accuracy loss < 2 points": loss < ACCURACY_LOSS_LIMIT}}


def _part(fn, *args) -> dict:
    """``fn(*args)``; an error is recorded (``{"error": ...}``, traceback on stderr) rather than
    raised, so that an unattended run still reports the other part."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 -- any failure of one part is reported, the other part still runs
        import sys
        import traceback

        traceback.print_exc(file=sys.stderr)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def run_seeds(out: str | Path, cfg: SeedsConfig = SeedsConfig()) -> dict:
    """Run both parts, writing ``seeds.json`` after each, then ``seeds.md``, ``seeds-bert.png`` and
    ``seeds-vit.png`` into ``out``. Returns the results.

    Raises:
        TightfitError: ``cfg.device`` is ``cuda`` and no CUDA GPU is visible.
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TightfitError("tightfit bench --suite seeds needs a CUDA GPU")
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"config": asdict(cfg), "device": torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu",
           "tightfit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    t0 = time.perf_counter()
    res["bert"] = _part(bert_table, cfg)
    atomic_write_json(out / "seeds.json", res)
    with tempfile.TemporaryDirectory(prefix="tightfit-seeds-") as work:
        res["vit"] = _part(vit_challenge, cfg, Path(work))
    res["seconds"] = time.perf_counter() - t0
    atomic_write_json(out / "seeds.json", res)
    write_seeds_report(out, res)
    return res


def _gib(v) -> str:
    return "" if v is None else format_bytes(v)


def _num(v, fmt="{:,.1f}") -> str:
    return "" if v is None else fmt.format(v)


def markdown(res: dict) -> str:
    """The suite's report: the 1080 Ti table with tightfit's plan, and the ViT-B/16 challenge."""
    b, v = res["bert"], res["vit"]
    lines = ["# tightfit bench --suite seeds", "",
             f"{res['device']}, torch {res['torch']}, transformers {res['transformers']}. Speed is this GPU's; memory "
             "is capped to the emulated card's budget.", ""]
    lines += _bert_lines(res, b) if "error" not in b else ["## BERT fine-tuning on a GTX 1080 Ti budget", "",
                                                            f"Not completed: {b['error']}"]
    lines += _vit_lines(res, v) if "error" not in v else ["", "## ViT-B/16 challenge", "", f"Not completed: {v['error']}"]
    return "\n".join(lines) + "\n"


def _bert_lines(res: dict, b: dict) -> list[str]:
    """The 1080 Ti table's section of :func:`markdown`."""
    lines = [f"## BERT fine-tuning on a {b['card']} ({_gib(b['budget_bytes'])} budget)", "",
             f"{b['model']} (random weights), sequence length {b['seq_len']}, AdamW; each row "
             f"{res['config']['bert_steps']} optimizer steps, it/s (optimizer steps per second) and samples/s after {res['config']['warmup']} warm-up "
             "steps. Predicted: tightfit's estimate without a GPU.", "",
             "| configuration | precision | micro-batch x accumulation | checkpointing | predicted peak reserved | "
             "peak reserved | peak allocated | it/s | samples/s | OOM recoveries |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in b["rows"]:
        ck = r.get("checkpointed_blocks")
        lines.append(f"| {r['setting']} | {r.get('precision', '')} | {r.get('micro_batch', '')} x "
                     f"{r.get('accumulation_steps', '')} | {'' if ck is None else ('off' if ck == 0 else f'{ck} blocks')} | "
                     f"{_gib(r.get('predicted_peak_reserved_bytes'))} | {_gib(r.get('peak_reserved_bytes'))} | "
                     f"{_gib(r.get('peak_allocated_bytes'))} | {_num(r.get('it_per_s'), '{:.2f}')} | "
                     f"{_num(r.get('samples_per_s'))} | {r.get('ooms_after_planning', '')} |")
    for r in b["rows"]:
        if r["setting"].startswith("tightfit"):
            lines += ["", f"Why ({r['setting']}):"] + [f"- {x}" for x in r.get("reasons", [])]
    return lines


def _vit_lines(res: dict, v: dict) -> list[str]:
    """The ViT-B/16 challenge's section of :func:`markdown`."""
    lines = []
    f, t = v["runs"]["fp32"], v["runs"]["tightfit"]
    lines += ["", f"## ViT-B/16 challenge: {v['image_size']} px, effective batch >= 16, under {_gib(v['budget_bytes'])}, "
                  "< 2 points accuracy loss against fp32", "",
              f"{v['model']} from its config with random weights (no pretrained ViT weights are available offline), "
              f"fine-tuned by `tightfit train` on scikit-learn's digits upscaled to {v['image_size']} px (3 channels, "
              f"fixed 10% held-out split), seed 0, {res['config']['vit_epochs']:g} epochs, lr {res['config']['vit_lr']:g}.", "",
              "| run | precision | micro-batch x accumulation = effective | checkpointing | compiled | held-out accuracy | "
              "peak reserved | samples/s | OOM recoveries |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in (("fp32, no budget", f), (f"tightfit, {_gib(v['budget_bytes'])} budget", t)):
        p = r["plan"]
        ck = "off" if not p["activation_checkpointing"] else \
            (f"{len(p['checkpoint_blocks'])} blocks" if p.get("checkpoint_blocks") is not None else "all blocks")
        lines.append(f"| {name} | {p['precision']} | {p['micro_batch']} x {p['accumulation_steps']} = "
                     f"{p['effective_batch']} | {ck} | {'yes' if p.get('compile') else 'no'} | {_num(r['accuracy'], '{:.4f}')} | "
                     f"{_gib(r['peak_reserved_bytes'])} | {_num(r['samples_per_s'])} | {r['oom_recoveries']} |")
    lines += ["", f"Accuracy loss: {100 * v['accuracy_loss']:.2f} points (majority class: {f['majority_accuracy']:.4f}).", "",
              "| criterion | met |", "|---|---|"]
    lines += [f"| {k} | {'yes' if ok else 'no'} |" for k, ok in v["met"].items()]
    lines += ["", "tightfit's plan:"] + [f"- {x}" for x in t["plan"].get("reasons", [])]
    return lines


def _charts(res: dict) -> tuple[bytes | None, bytes | None]:
    """Two PNGs: the 1080 Ti rows' peak memory (predicted and measured, against the budget) and
    samples/s; the ViT runs' accuracy and peak memory."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.tight_layout()
        fig.savefig(buf, format="png", dpi=110)
        plt.close(fig)
        return buf.getvalue()

    gib = 2 ** 30
    bert_png = vit_png = None
    if "error" not in res["bert"]:
        bert_png = png(_bert_figure(plt, res, gib))
    if "error" not in res["vit"]:
        vit_png = png(_vit_figure(plt, res, gib))
    return bert_png, vit_png


def _bert_figure(plt, res: dict, gib: int):
    """The 1080 Ti rows: peak reserved (predicted, measured, budget) and samples/s."""
    rows = res["bert"]["rows"]
    short = {"tightfit plan, predicted (no GPU)": "tightfit plan\npredicted", "FP32, batch 8": "FP32\nbatch 8",
             "FP16 + gradient accumulation, effective batch 32": "FP16 + accumulation\neffective batch 32",
             "FP16 + activation checkpointing, batch 16": "FP16 + checkpointing\nbatch 16",
             "tightfit plan, planned on the GPU and run": "tightfit plan\nplanned and run"}
    names = [short.get(r["setting"], r["setting"]) for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(15, 4.8))
    x = range(len(rows))
    a1.bar([i - 0.2 for i in x], [(r.get("predicted_peak_reserved_bytes") or 0) / gib for r in rows], 0.4,
           label="predicted (no GPU)")
    a1.bar([i + 0.2 for i in x], [(r.get("peak_reserved_bytes") or 0) / gib for r in rows], 0.4, label="measured")
    a1.axhline(res["bert"]["budget_bytes"] / gib, color="red", ls="--", lw=1, label="budget")
    a1.set_ylabel("peak reserved (GiB)")
    a1.set_xticks(list(x), names, fontsize=7)
    a1.legend(fontsize=8)
    a2.bar(list(x), [r.get("samples_per_s") or 0 for r in rows])
    a2.set_ylabel("samples/s (this GPU)")
    a2.set_xticks(list(x), names, fontsize=7)
    fig.suptitle(f"BERT fine-tuning under the {res['bert']['card']} budget")
    return fig


def _vit_figure(plt, res: dict, gib: int):
    """The ViT runs: held-out accuracy, and peak reserved against the budget."""
    v = res["vit"]
    fig, (b1, b2) = plt.subplots(1, 2, figsize=(9, 4))
    labels = ["fp32", "tightfit"]
    b1.bar(labels, [v["runs"][k]["accuracy"] for k in labels])
    b1.set_ylabel("held-out accuracy")
    b1.set_ylim(0, 1)
    b2.bar(labels, [(v["runs"][k]["peak_reserved_bytes"] or 0) / gib for k in labels])
    b2.axhline(v["budget_bytes"] / gib, color="red", ls="--", lw=1, label="budget")
    b2.set_ylabel("peak reserved (GiB)")
    b2.legend(fontsize=8)
    fig.suptitle(f"{v['model']} at {v['image_size']} px on digits")
    return fig


def write_seeds_report(out: str | Path, res: dict) -> list[Path]:
    """Write ``seeds.md``, ``seeds-bert.png`` and ``seeds-vit.png`` for the results ``res``."""
    out = Path(out)
    atomic_write_text(out / "seeds.md", markdown(res))
    written = [out / "seeds.md"]
    for name, data in zip(("seeds-bert.png", "seeds-vit.png"), _charts(res)):
        if data is not None:  # None: that part did not complete
            atomic_write_bytes(out / name, data)
            written.append(out / name)
    return written
