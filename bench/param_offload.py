"""Parameter offload (``--sharding fsdp-offload``, issue 14): models whose training state fits no
single-GPU plan, trained with FSDP2's CPUOffloadPolicy on one GPU.

For each workload, in one process on the GPU machine: the single-GPU planner's answer at the
budget (its refusal, :func:`tightfit.planner.advice.check_model_state`), then the parameter-offload
plan (:func:`tightfit.planner.sharding.fsdp_plan`, timed), its micro-batch verified by real steps
(:func:`tightfit.planner.fsdp_probe.verify_micro_batch`) and ``STEPS`` optimizer steps trained,
speed over the steps after the first ``WARMUP``.

Usage (repository root, on the GPU machine): ``OUT=dir python bench/param_offload.py [NAME ...]``.
Writes ``OUT/param-offload.json``.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from optimizer_levers import decoder_folder  # noqa: E402
from tightfit.bench import settings as st  # noqa: E402
from tightfit.bench.workloads import BenchWorkload, make_workload  # noqa: E402
from tightfit.config import PlanOptions  # noqa: E402
from tightfit.devices import detect  # noqa: E402
from tightfit.errors import TightfitError  # noqa: E402
from tightfit.planner.advice import check_model_state  # noqa: E402
from tightfit.planner.fsdp_probe import verify_micro_batch  # noqa: E402
from tightfit.planner.sharding import choose_sharding, fsdp_plan, host_state_bytes  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
STEPS, WARMUP = int(os.environ.get("STEPS", "8")), 2


def workloads(root: Path) -> list[BenchWorkload]:
    return [BenchWorkload("decoder-1.3b-lm-512@4GiB", decoder_folder(root, "decoder-1.3b", 2048, True), 512, "4GiB", 32),
            BenchWorkload("decoder-1.3b-lm-512@4GiB-b4", decoder_folder(root, "decoder-1.3b", 2048, True), 512,
                          "4GiB", 4),
            BenchWorkload("bert-large-128@2GiB", "bert-large", 128, "2GiB", 128)]


def row(w: BenchWorkload) -> dict:
    profile = detect()
    st.cap_memory(w.budget_bytes)
    wl = make_workload(w, w.effective_batch, w.effective_batch * (STEPS + 2), device="cpu")
    out = {"workload": w.name, "budget_bytes": w.budget_bytes, "effective_batch": w.effective_batch,
           "parameters": sum(p.numel() for p in wl.model.parameters())}
    try:
        check_model_state(wl.model, w.budget_bytes, "auto", True, profile.host_link_bytes_per_s, profile=profile)
        out["single_gpu"] = "the model state fits a single-GPU plan"
    except TightfitError as e:
        out["single_gpu"] = str(e).split(";")[0]
    recipe = SimpleNamespace(req=SimpleNamespace(planning=PlanOptions()), workload=wl, budget=w.budget_bytes,
                             profile=profile, model=wl.model)
    t0 = time.perf_counter()
    plan = fsdp_plan(recipe, choose_sharding(wl.model, 1, w.budget_bytes, "fsdp-offload", "bf16"), 1)
    out["planning_seconds"] = time.perf_counter() - t0
    out["plan"] = {"precision": plan.precision, "micro_batch": plan.micro_batch,
                   "accumulation_steps": plan.accumulation_steps, "checkpointing": plan.activation_checkpointing,
                   "predicted_peak_reserved_bytes": plan.predicted_peak_reserved_bytes, "reasons": list(plan.reasons)}
    torch.cuda.reset_peak_memory_stats()
    t = Trainer(wl, plan, TrainConfig(epochs=1, max_steps=STEPS, lr=1e-5, checkpoint_dir=None, warmup_ratio=0.0),
                progress=False)
    t0 = time.perf_counter()
    out["verified_micro_batch"] = verify_micro_batch(t)
    out["verify_seconds"] = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    res = t.fit()
    stamps = [end for end, _ in res.step_ends]
    timed = stamps[WARMUP - 1:]
    out.update(samples_per_s=w.effective_batch * (len(timed) - 1) / (timed[-1] - timed[0]), steps=res.steps,
               ooms_after_planning=res.oom_recoveries, peak_reserved_bytes=res.peak_reserved_bytes,
               peak_allocated_bytes=res.peak_allocated_bytes, host_state_bytes=host_state_bytes(wl.model),
               host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               params_on=str(next(t.model.parameters()).device))
    t.world.close()
    del t, wl
    st.clean()
    return out


def main(only: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for w in workloads(Path(root)):
            if only and w.name not in only:
                continue
            rows.append(row(w))
            print(json.dumps(rows[-1]), flush=True)
            (OUT / "param-offload.json").write_text(json.dumps(
                {"command": "python bench/param_offload.py " + " ".join(only), "code": commit,
                 "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
