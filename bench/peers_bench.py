"""HF Trainer with ``auto_find_batch_size`` under an emulated small-card budget: the peer that
tightfit's plan is compared with (``bench/planner_bench.py`` measures tightfit and plain PyTorch).

For each workload and each of (fp16 or bf16) x gradient checkpointing off/on, the Trainer
starts at ``--start-batch`` and, on every out-of-memory error, restarts its loop with 0.9x the
batch (Accelerate's ``find_executable_batch_size``). Recorded: the batch it settles on, samples/s
over the steps after the first ``--warmup`` at that batch, planning time (from ``train()`` until
the first step at the final batch, trial OOMs included), restarts after the first completed
step (an OOM after "planning"), and peak reserved memory.

Run (repository root, a CUDA GPU; transformers and accelerate installed):
    python3 bench/peers_bench.py --out peers.json --workload bert-base-128@4GiB [--workload ...]
Workloads: see ``WORKLOADS``. ``--device cpu --steps 3`` runs a smoke test without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time

import torch

sys.path.insert(0, ".")
from tightfit.memory.zoo import build_model  # noqa: E402
from tightfit.units import parse_size  # noqa: E402

# name -> (architecture, sequence length or image size, budget)
WORKLOADS = {
    "bert-base-128@4GiB": ("bert-base", 128, "4GiB"),
    "bert-base-128@11GiB": ("bert-base", 128, "11GiB"),
    "bert-base-512@11GiB": ("bert-base", 512, "11GiB"),
    "bert-large-128@11GiB": ("bert-large", 128, "11GiB"),
    "vit-b16-224@10GiB": ("vit-b16", 224, "10GiB"),
    "resnet50-224@4GiB": ("resnet50", 224, "4GiB"),
    "minilm-16@smoke": ("minilm", 16, None),
}


class Samples(torch.utils.data.Dataset):
    """``n`` random samples of the architecture's input, one dict each (CPU tensors)."""

    def __init__(self, make_batch, size, n):
        self.batch = make_batch(n, size, device="cpu")
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def run_trainer(arch, size, budget, precision, checkpointing, start_batch, steps, warmup, device):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model, make_batch = build_model(arch, device="cpu")
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append((time.perf_counter(), trainer._train_batch_size, state.global_step))

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=start_batch, auto_find_batch_size=True,
            max_steps=steps, learning_rate=1e-5, bf16=precision == "bf16", fp16=precision == "fp16",
            gradient_checkpointing=checkpointing, report_to=[], save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, use_cpu=device == "cpu")
        trainer = Trainer(model=model, args=args, train_dataset=Samples(make_batch, size, start_batch * (steps + 1)),
                          callbacks=[Clock()])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.train()
    final = stamps[-1][1]
    at_final = [s for s in stamps if s[1] == final]
    restarts_after_first_step = sum(1 for a, b in zip(stamps, stamps[1:]) if b[1] != a[1])
    timed = at_final[warmup:]
    speed = (final * (len(timed) - 1) / (timed[-1][0] - timed[0][0])) if len(timed) > 1 else float("nan")
    row = {"precision": precision, "gradient_checkpointing": checkpointing, "start_batch": start_batch,
           "final_batch": final, "samples_per_s": speed, "planning_seconds": at_final[0][0] - t0,
           "ooms_after_first_step": restarts_after_first_step, "steps_at_final_batch": len(at_final),
           "peak_reserved_bytes": torch.cuda.max_memory_reserved() if device == "cuda" else None, "budget": budget}
    del trainer, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workload", action="append", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--start-batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = ap.parse_args(argv)
    rows = []
    for name in a.workload:
        arch, size, budget = WORKLOADS[name]
        precisions = ["fp32"] if a.device == "cpu" else (
            ["bf16"] if torch.cuda.get_device_capability() >= (8, 0) else ["fp16"])
        if a.device == "cuda" and budget:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(parse_size(budget) / total)
        for precision in precisions:
            for ck in (False, True):
                row = {"workload": name, **run_trainer(arch, size, budget, precision, ck, a.start_batch, a.steps,
                                                       a.warmup, a.device)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        if a.device == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0)
    import transformers
    out = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "command": "python3 bench/peers_bench.py " + " ".join(argv or sys.argv[1:]),
           "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
