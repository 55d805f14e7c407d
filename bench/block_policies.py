"""Per-block choices on a GPU: what each costs and saves, measured against the prediction, and
tightfit's plan with them against whole-block checkpointing and the no-budget references.

Three parts, written to ``OUT`` as they finish (``block_policies.json`` and ``.md``):

1. ``link``: pinned host <-> device copy bandwidth of 256 MiB (the time model's host link).
2. ``memory``: per workload, training steps of a fixed micro-batch with every block
   ``none`` / ``selective`` / ``full`` / ``offload`` and a mixed choice (half selective, half
   full), each in a fresh process (the estimator predicts a fresh process; ``--jobs`` of them
   share the GPU at once, so their step times are only indicative): the estimator's peak
   allocated/reserved bytes against ``torch.cuda.max_memory_*``.
3. ``speed``: per workload under its budget: tightfit's plan with per-block choices and with
   whole blocks only (``plan_on_gpu(per_block=False)``), each planned and trained for
   ``--steps`` steps, beside the no-budget eager (bf16, checkpointing none/all) and compiled
   (bf16) references of :mod:`tightfit.bench.settings`.

Order: every memory row (about a minute), then the speed parts of BERT-base, ResNet-50 and
ViT-B/16, each started only while ``--minutes`` (default 5) have not run out (BERT-base's
takes about four: two plans with compilation, and the compiled reference).

Usage (repository root, CUDA machine):
    PYTHONPATH=.:$PYTHONPATH python bench/block_policies.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

# (workload of tightfit.bench.workloads, micro-batch of the memory rows, precision)
WORKLOADS = [("bert-base-128@4GiB", 32, "bf16"), ("resnet50-224@4GiB", 32, "bf16"), ("vit-b16-224@10GiB", 32, "bf16")]


def _choices(n: int) -> dict:
    half = n // 2
    return {"none": ("none",) * n, "selective": ("selective",) * n, "full": ("full",) * n,
            "offload": ("offload",) * n, "mixed": ("selective",) * half + ("full",) * (n - half)}


def link() -> dict:
    """Pinned host <-> device bandwidth (bytes/s), the best of 5 copies of 256 MiB each way."""
    import torch

    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = n / best
    return out


def memory_row(workload: str, micro_batch: int, precision: str, choice: str) -> dict:
    """One choice of one workload (run in a fresh process): predicted and measured peaks."""
    import torch

    from tightfit.bench.workloads import get_workload, make_workload
    from tightfit.devices import detect
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.checkpointing import set_activation_checkpointing
    from tightfit.planner.probe import probe_step
    from tightfit.planner.search import estimator_for

    w = get_workload(workload)
    wl = make_workload(w, micro_batch, 4 * micro_batch)
    n = len(find_blocks(wl.model))
    policies = _choices(n)[choice]
    make_batch = lambda mb, size: wl.train.worst_case(mb)  # noqa: E731
    profile = detect()
    est = estimator_for(wl.model, make_batch, w.size, profile, micro_batch, checkpointed_margin=0.0)(
        precision, micro_batch, policies)
    set_activation_checkpointing(wl.model, False, policies=policies)
    pr = probe_step(wl, micro_batch, precision, torch.cuda.get_device_properties(0).total_memory, timed_steps=3)
    return {"workload": workload, "choice": choice, "policies": list(policies), "micro_batch": micro_batch,
            "precision": precision, "predicted_peak_allocated_bytes": est.peak_allocated_bytes,
            "predicted_peak_reserved_bytes": est.peak_reserved_bytes,
            "measured_peak_allocated_bytes": pr.peak_allocated_bytes,
            "measured_peak_reserved_bytes": pr.peak_reserved_bytes, "step_seconds": pr.step_seconds,
            "reserved_error": (est.peak_reserved_bytes / pr.peak_reserved_bytes - 1) if pr.peak_reserved_bytes else None}


def speed(workload: str, steps: int, warmup: int) -> list[dict]:
    """tightfit with and without per-block choices, and the no-budget references."""
    from tightfit.bench import settings
    from tightfit.bench.workloads import get_workload, make_workload
    from tightfit.devices import detect
    from tightfit.planner.gpu import plan_on_gpu

    w = get_workload(workload)
    rows = [dict(r, workload=workload) for r in settings.no_budget(w, steps, warmup, precisions=("bf16",))]
    rows.append(dict(settings.compiled_no_budget(w, steps, warmup), workload=workload))
    for per_block in (True, False):
        settings.cap_memory(w.budget_bytes)
        wl = make_workload(w, w.effective_batch, w.effective_batch * steps)
        t0 = time.perf_counter()
        plan = plan_on_gpu(wl, detect(), w.budget_bytes, w.size, per_block=per_block)
        planning = time.perf_counter() - t0
        row = {"setting": "tightfit per-block" if per_block else "tightfit whole blocks", "workload": workload,
               "planning_seconds": planning, "block_policies": plan.block_policies, "reasons": list(plan.reasons),
               "predicted_samples_per_s": plan.predicted_samples_per_s,
               "predicted_peak_reserved_bytes": plan.predicted_peak_reserved_bytes,
               **settings.timed_run(wl, plan, steps, warmup)}
        rows.append(row)
        del wl
        settings.clean()
        settings.cap_memory(None)
    return rows


def _child(args: list[str]) -> dict | list:
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    p = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env)
    if p.returncode:
        return {"args": args, "error": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _markdown(res: dict) -> str:
    gib = 2 ** 30
    lines = ["# Per-block choices: selective recomputation, offload", "",
             f"host link: H2D {res.get('link', {}).get('h2d_bytes_per_s', 0) / 1e9:.1f} GB/s, "
             f"D2H {res.get('link', {}).get('d2h_bytes_per_s', 0) / 1e9:.1f} GB/s", "",
             "| workload | choice | mb | predicted reserved GiB | measured reserved GiB | error | "
             "predicted allocated GiB | measured allocated GiB | step s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("memory", []):
        if "error" in r:
            lines.append(f"| {r['args']} | error | | | | | | | |")
            continue
        m = r["measured_peak_reserved_bytes"] or 0
        lines.append(f"| {r['workload']} | {r['choice']} | {r['micro_batch']} | "
                     f"{r['predicted_peak_reserved_bytes'] / gib:.3f} | {m / gib:.3f} | "
                     f"{(r['reserved_error'] or 0) * 100:+.1f}% | {r['predicted_peak_allocated_bytes'] / gib:.3f} | "
                     f"{(r['measured_peak_allocated_bytes'] or 0) / gib:.3f} | {r['step_seconds'] or 0:.4f} |")
    lines += ["", "| workload | setting | samples/s | x compiled no-budget | x eager no-budget best | plan | "
              "peak reserved GiB | OOMs |", "|---|---|---|---|---|---|---|---|"]
    for wname, rows in res.get("speed", {}).items():
        if isinstance(rows, dict):
            lines.append(f"| {wname} | error | | | | | | |")
            continue
        comp = max((r["samples_per_s"] for r in rows if r["setting"] == "compiled no budget"), default=float("nan"))
        eager = max((r["samples_per_s"] for r in rows if r["setting"] == "no budget"), default=float("nan"))
        for r in rows:
            plan = (f"{r['precision']}, mb {r['micro_batch']} x {r['accumulation_steps']}, "
                    f"{'compiled, ' if r['compile'] else ''}"
                    + (f"blocks {','.join(p[0] for p in r['block_policies'])}" if r.get("block_policies")
                       else f"{r['checkpointed_blocks']} full"))
            lines.append(f"| {wname} | {r['setting']} | {r['samples_per_s']:.0f} | {r['samples_per_s'] / comp:.2f} | "
                         f"{r['samples_per_s'] / eager:.2f} | {plan} | {r['peak_reserved_bytes'] / gib:.2f} | "
                         f"{r.get('ooms_after_planning', 0)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=5.0, help="skip what would start after this many minutes")
    ap.add_argument("--jobs", type=int, default=5, help="memory rows run at once (default 5)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one part in this fresh process; its JSON on the last line of stdout
        kind, *rest = args.child
        if kind == "link":
            out = link()
        elif kind == "memory":
            out = memory_row(rest[0], int(rest[1]), rest[2], rest[3])
        else:
            out = speed(rest[0], args.steps, args.warmup)
        print(json.dumps(out, default=list))
        return 0
    t0 = time.perf_counter()
    res = {"link": _child(["--child", "link"]), "memory": [], "speed": {}}
    os.makedirs(args.out, exist_ok=True)

    def save():
        with open(os.path.join(args.out, "block_policies.json"), "w") as f:
            json.dump(res, f, indent=1, default=list)
        with open(os.path.join(args.out, "block_policies.md"), "w") as f:
            f.write(_markdown(res))

    late = lambda: time.perf_counter() - t0 > 60 * args.minutes  # noqa: E731
    rows = [["--child", "memory", wname, str(mb), prec, choice] for wname, mb, prec in WORKLOADS
            for choice in ("none", "selective", "full", "offload", "mixed")]
    with ThreadPoolExecutor(args.jobs) as pool:  # peaks are per process: the rows may share the GPU
        res["memory"] = list(pool.map(_child, rows))
    save()
    for wname, _, _ in WORKLOADS:
        if late():
            res["speed"][wname] = {"error": f"skipped: past {args.minutes} minutes"}
            continue
        res["speed"][wname] = _child(["--steps", str(args.steps), "--warmup", str(args.warmup),
                                      "--child", "speed", wname])
        save()
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
