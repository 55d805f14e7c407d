"""Planning time without a GPU (the search: enumerate and exact traces), with and without the
estimator's meta-layout cache, side by side in one run; each plan in a fresh process (a cold
cache, as a first `tightfit plan` has).

Usage (repository root, any machine): ``python bench/plan_time.py OUT_DIR``. Writes
``OUT_DIR/plan-time.json`` and ``OUT_DIR/plan-time.md``: per workload, seconds and the plan
(which must be the same with and without the cache).
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
from tightfit.memory import meta_cache
meta_cache.enabled = {cache}
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


def plan_once(model: str, size: int, budget: str, batch: int, image: bool, cache: bool) -> dict:
    argv = ["plan", "--model", model, "--image-size" if image else "--seq-len", str(size),
            "--batch-size", str(batch), "--budget", budget, "--json"]
    p = subprocess.run([sys.executable, "-c", RUN.format(cache=cache, argv=argv)], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "TIGHTFIT_CACHE_DIR": tempfile.mkdtemp()})
    seconds = next(float(x.split()[1]) for x in p.stderr.splitlines() if x.startswith("PLAN_SECONDS"))
    out = json.loads(p.stdout)
    best = out["plan"]
    keep = ("precision", "micro_batch", "accumulation_steps", "checkpoint_blocks", "block_policies", "optimizer",
            "predicted_samples_per_s", "predicted_peak_reserved_bytes")
    return {"seconds": seconds, "plan": {k: best.get(k) for k in keep} | {"checkpoint_blocks": out["checkpoint_blocks"]}}


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for name, model, size, budget, batch in workloads(Path(root)):
            image = model in ("vit-b16", "resnet50")
            before = plan_once(model, size, budget, batch, image, cache=False)
            after = plan_once(model, size, budget, batch, image, cache=True)
            rows.append({"workload": name, "without_cache_s": before["seconds"], "with_cache_s": after["seconds"],
                         "same_plan": before["plan"] == after["plan"], "plan": after["plan"]})
            print(json.dumps(rows[-1]), flush=True)
    header = {"command": "python bench/plan_time.py " + out_dir, "commit": commit, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version()}
    (out / "plan-time.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1) + "\n")
    lines = [f"# Planning time on the CPU (no GPU): search and exact traces, {header['cpus']} CPUs, commit {commit}", "",
             f"Command: `{header['command']}`", "",
             "| workload | without the meta-layout cache, s | with it, s | speed-up | same plan |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['without_cache_s']:.1f} | {r['with_cache_s']:.1f} | "
                     f"{r['without_cache_s'] / max(r['with_cache_s'], 1e-9):.2f}x | {'yes' if r['same_plan'] else 'NO'} |")
    (out / "plan-time.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out")
