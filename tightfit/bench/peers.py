"""The peer: Hugging Face Trainer with ``auto_find_batch_size`` under the same budget.

The Trainer starts at a batch and, on every out-of-memory error, restarts its loop with 0.9x
the batch (Accelerate's ``find_executable_batch_size``). Recorded: the batch it settles on,
samples/s over the steps after the first ``warmup`` at that batch, planning time (from
``train()`` until the first step at the final batch, trial OOMs included), restarts after the
first completed step (an OOM after "planning"), and peak reserved memory.
"""

from __future__ import annotations

import gc
import tempfile
import time

import torch

from ..models import build_model
from .settings import speed_after_warmup
from .workloads import BenchWorkload, ZooSamples


def hf_trainer(w: BenchWorkload, precision: str, checkpointing: bool, start_batch: int, steps: int,
               warmup: int, device: str = "cuda") -> dict:
    """One HF Trainer run with ``auto_find_batch_size`` (fp16/bf16 autocast, gradient checkpointing
    on or off), capped at the workload's budget by the caller."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from ..integrations.hf import checkpointing_field

    torch.manual_seed(0)
    model, make_batch = build_model(w.arch, device="cpu")
    setting = {"setting": "HF Trainer auto_find_batch_size", "precision": precision,
               "checkpointed_blocks": "all" if checkpointing else 0, "start_batch": start_batch}
    if checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        return {**setting, "fits": False, "error": f"{type(model).__name__} does not support gradient checkpointing"}
    stamps = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            stamps.append((time.perf_counter(), trainer._train_batch_size))

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=start_batch, auto_find_batch_size=True,
            max_steps=steps, learning_rate=1e-5, bf16=precision == "bf16", fp16=precision == "fp16",
            **{checkpointing_field(): checkpointing}, report_to=[], save_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, use_cpu=device == "cpu")
        trainer = Trainer(model=model, args=args, train_dataset=ZooSamples(make_batch, w.size, start_batch * (steps + 1)),
                          callbacks=[Clock()])
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        trainer.train()
    final = stamps[-1][1]
    at_final = [s for s in stamps if s[1] == final]
    # as tightfit's rows count (it left out one step more); None (JSON null, not NaN) when fewer
    # than two steps at the final batch follow the warm-up
    speed = speed_after_warmup([t for t, _ in at_final], warmup, final)
    row = {**setting, "micro_batch": final, "effective_batch": final, "accumulation_steps": 1, "samples_per_s": speed,
           "planning_seconds": at_final[0][0] - t0,
           "ooms_after_planning": sum(1 for a, b in zip(stamps, stamps[1:]) if b[1] != a[1]),
           "steps": len(at_final),
           "peak_reserved_bytes": torch.cuda.max_memory_reserved() if device == "cuda" else None}
    del trainer, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row
