"""tightfit's plan against plain-PyTorch configurations and the no-budget best, side by side.

Workload: BERT-base (random weights, 110M parameters), sequence length 128, AdamW, every
sample at the full length. Under an emulated budget (``set_per_process_memory_fraction``):
- tightfit: ``plan_on_gpu`` (search, then verified by real steps), effective batch 256;
- plain PyTorch: fp32/fp16/bf16 x checkpointing none/all, each at the largest batch that fits
  (found by probe steps, no accumulation: what a user tuning by hand would run);
and with no budget: the same six configurations at batch 256 (the best is the reference).
Each configuration trains ``STEPS`` steps with tightfit's runtime; samples/s counts the steps
after the first ``WARMUP`` (first allocations, cuBLAS heuristics), timed with a CUDA sync.

Run (repository root, a CUDA GPU): ``python3 bench/planner_bench.py OUT.json [BUDGET_GIB]``
"""

import gc
import json
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from conftest import SyntheticBatches  # noqa: E402

from tightfit.devices import detect  # noqa: E402
from tightfit.levers.checkpointing import set_activation_checkpointing  # noqa: E402
from tightfit.plan import Plan  # noqa: E402
from tightfit.planner.gpu import plan_on_gpu  # noqa: E402
from tightfit.planner.probe import largest_micro_batch  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tightfit.workload import Workload  # noqa: E402

STEPS = 16
WARMUP = 4
SEQ = 128


class Full(SyntheticBatches):
    def collate(self, indices, pad_to=None):
        return super().collate(indices, pad_to=self.seq_len)


def workload(effective_batch):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2)).cuda()
    return Workload(model, Full(n=effective_batch * STEPS, seq_len=SEQ, vocab=30000), None, effective_batch)


def clean():
    gc.collect()
    torch.cuda.empty_cache()


class TimedTrainer(Trainer):
    def train_step(self, window):
        out = super().train_step(window)
        torch.cuda.synchronize()
        self.stamps.append((time.perf_counter(), len(window)))
        return out


def train(w, plan):
    torch.cuda.reset_peak_memory_stats()
    t = TimedTrainer(w, plan, TrainConfig(epochs=1, max_steps=STEPS, lr=1e-5, checkpoint_dir=None), progress=False)
    t.stamps = []
    res = t.fit()
    timed = t.stamps[WARMUP - 1:]
    speed = sum(n for _, n in timed[1:]) / (timed[-1][0] - timed[0][0])
    return {"samples_per_s": speed, "peak_reserved_bytes": res.peak_reserved_bytes,
            "oom_recoveries": res.oom_recoveries, "micro_batch": plan.micro_batch,
            "accumulation_steps": plan.accumulation_steps, "precision": plan.precision,
            "checkpointing": list(plan.checkpoint_blocks) if plan.checkpoint_blocks else plan.activation_checkpointing}


def main(out_path, budget_gib):
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    # no budget: the reference
    for prec in ("fp32", "fp16", "bf16"):
        for ck in (False, True):
            w = workload(256)
            r = train(w, Plan(prec, 256, 256, ck, device="cuda"))
            rows.append({"setting": "no budget", **r})
            print(json.dumps(rows[-1]), flush=True)
            del w
            clean()
    budget = int(budget_gib * 2**30)
    torch.cuda.set_per_process_memory_fraction(budget / total)
    # plain PyTorch at the largest batch that fits
    for prec in ("fp32", "fp16", "bf16"):
        for ck in (False, True):
            w = workload(512)
            set_activation_checkpointing(w.model, ck)
            t0 = time.perf_counter()
            best = largest_micro_batch(w, prec, budget, 512)
            search_s = time.perf_counter() - t0
            set_activation_checkpointing(w.model, False)
            if best is None:
                rows.append({"setting": f"plain {budget_gib} GiB", "precision": prec, "checkpointing": ck,
                             "fits": False})
                continue
            mb = best.micro_batch
            w2 = Workload(w.model, Full(n=mb * STEPS, seq_len=SEQ, vocab=30000), None, mb)
            r = train(w2, Plan(prec, mb, mb, ck, device="cuda"))
            rows.append({"setting": f"plain {budget_gib} GiB", "search_seconds": search_s, **r})
            print(json.dumps(rows[-1]), flush=True)
            del w, w2
            clean()
    # tightfit
    w = workload(256)
    t0 = time.perf_counter()
    plan = plan_on_gpu(w, detect(), budget, SEQ)
    planning_s = time.perf_counter() - t0
    r = train(w, plan)
    rows.append({"setting": f"tightfit {budget_gib} GiB", "planning_seconds": planning_s, "reasons": list(plan.reasons),
                 "predicted_samples_per_s": plan.predicted_samples_per_s, **r})
    print(json.dumps(rows[-1]), flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "budget_gib": budget_gib,
           "command": f"python3 bench/planner_bench.py OUT.json {budget_gib}", "steps": STEPS, "warmup": WARMUP,
           "rows": rows}
    with open(out_path, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 4.0)
