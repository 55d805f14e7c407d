"""Peak memory of the planner's own probe steps for BERT-large (every block checkpointed, bf16,
8-bit AdamW, effective batch 256: each probe runs two micro-batches, the second with the window's
gradients held), inside the real ``tightfit train`` path: capped at the budget, then uncapped.
The numbers to hold the estimator's accumulation trace to.

    PYTHONPATH=. python bench/probe_memory.py train --model bert-large --seq-len 128 --budget 4GiB \
        --batch-size 256 --compile off --train-samples 12800 --replan --no-progress --out /tmp/x

(It replaces the GPU planner by the probes and exits before training.)"""
import sys, torch
import tightfit.planner.gpu as g
from tightfit.planner.probe import probe_step
from tightfit.levers.checkpointing import set_activation_checkpointing
G = 2**30

def diag(workload, profile, budget, seq_len, *a, **k):
    model = workload.model
    print("model dtype", next(model.parameters()).dtype, "allocated GiB", torch.cuda.memory_allocated() / G,
          "params", sum(p.numel() for p in model.parameters()), "budget GiB", budget / G, flush=True)
    b = workload.train.worst_case(4)
    print({k: (tuple(v.shape), v.dtype) for k, v in b.items()}, "eb", workload.effective_batch, flush=True)
    set_activation_checkpointing(model, True, tuple(range(24)), None)
    for opt in ("adamw8bit",):
        for mb in (16, 24, 32):
            pr = probe_step(workload, mb, "bf16", budget, timed_steps=2, optimizer=opt)
            print(opt, mb, "fits", pr.fits, "peak reserved", pr.peak_reserved_bytes and pr.peak_reserved_bytes / G,
                  "alloc", pr.peak_allocated_bytes and pr.peak_allocated_bytes / G, "after: alloc",
                  torch.cuda.memory_allocated() / G, "reserved", torch.cuda.memory_reserved() / G, flush=True)
    torch.cuda.set_per_process_memory_fraction(1.0)
    for mb in (16, 32, 64):
        pr = probe_step(workload, mb, "bf16", 2**40, timed_steps=2, optimizer="adamw8bit")
        print("uncapped", mb, "peak reserved", pr.peak_reserved_bytes / G, "alloc", pr.peak_allocated_bytes / G, flush=True)
    sys.exit(0)

g.plan_on_gpu = diag
from tightfit.cli import main
sys.exit(main(sys.argv[1:]))
