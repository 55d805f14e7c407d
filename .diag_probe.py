"""Diagnose the 8-bit probe gap: probes of BERT-large (all blocks checkpointed, bf16, adamw8bit) as the
planner runs them, inside the real train path, with the allocator capped (4 GiB) and, after, uncapped."""
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
