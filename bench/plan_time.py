"""Planning time without a GPU (the search: enumerate and exact traces), with the exact
estimates traced one by one (``TIGHTFIT_PLAN_WORKERS=0``) and side by side in worker processes
(the default count for this machine, :func:`tightfit.planner.parallel.plan_workers`), side by side
in one run; each plan in a fresh process (a cold meta-layout cache, as a first `tightfit plan` has).

Usage (repository root, any machine): ``python bench/plan_time.py OUT_DIR [WORKLOAD ...]`` (default:
every bench and lever workload). Writes ``OUT_DIR/plan-time.json`` and ``OUT_DIR/plan-time.md``:
per workload, seconds and the plan (which must be the same either way).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from tightfit.bench.workloads import WORKLOADS  # noqa: E402

RUN = """
import json, sys, time
from tightfit.cli import main
t = time.perf_counter()
code = main({argv!r})
sys.stderr.write("PLAN_SECONDS %.2f\\n" % (time.perf_counter() - t))
"""


def workloads(root: Path) -> list[tuple[str, str, int, str, int]]:
    from optimizer_levers import workloads as lever_workloads

    ws = [w for w in WORKLOADS.values() if not w.name.endswith("smoke")] + lever_workloads(root)
    return [(w.name, w.arch, w.size, w.budget, w.effective_batch) for w in ws]
    return rows


def plan_once(model: str, size: int, budget: str, batch: int, image: bool, workers: str | None) -> dict:
    argv = ["plan", "--model", model, "--image-size" if image else "--seq-len", str(size),
            "--batch-size", str(batch), "--budget", budget, "--json"]
    env = {k: v for k, v in os.environ.items() if k != "TIGHTFIT_PLAN_WORKERS"}
    if workers is not None:
        env["TIGHTFIT_PLAN_WORKERS"] = workers
    p = subprocess.run([sys.executable, "-c", RUN.format(argv=argv)], capture_output=True, text=True,
                       cwd=ROOT, env={**env, "TIGHTFIT_CACHE_DIR": tempfile.mkdtemp()})
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{p.stderr[-3000:]}")
    seconds = next(float(x.split()[1]) for x in p.stderr.splitlines() if x.startswith("PLAN_SECONDS"))
    out = json.loads(p.stdout)
    best = out["plan"]
    keep = ("precision", "micro_batch", "accumulation_steps", "checkpoint_blocks", "block_policies", "optimizer",
            "predicted_samples_per_s", "predicted_peak_reserved_bytes")
    return {"seconds": seconds, "plan": {k: best.get(k) for k in keep} | {"checkpoint_blocks": out["checkpoint_blocks"]}}


def main(out_dir: str, only: list[str]) -> None:
    from tightfit.planner.parallel import plan_workers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, model, size, budget, batch in workloads(Path(root)):
            if only and name not in only:
                continue
            image = model in ("vit-b16", "resnet50")
            before = plan_once(model, size, budget, batch, image, workers="0")
            after = plan_once(model, size, budget, batch, image, workers=None)
            rows.append({"workload": name, "alone_s": before["seconds"], "workers_s": after["seconds"],
                         "same_plan": before["plan"] == after["plan"], "plan": after["plan"]})
            print(json.dumps(rows[-1]), flush=True)
    header = {"command": " ".join(["python bench/plan_time.py", out_dir, *only]), "commit": commit,
              "workers": plan_workers(), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version()}
    (out / "plan-time.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    lines = [f"# Planning time on the CPU (no GPU): search and exact traces, {header['cpus']} CPUs, commit {commit}", "",
             f"Command: `{header['command']}`", "",
             f"| workload | traced one by one, s | {header['workers']} worker processes, s | speed-up | same plan |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['alone_s']:.1f} | {r['workers_s']:.1f} | "
                     f"{r['alone_s'] / max(r['workers_s'], 1e-9):.2f}x | {'yes' if r['same_plan'] else 'NO'} |")
    (out / "plan-time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out", sys.argv[2:])
