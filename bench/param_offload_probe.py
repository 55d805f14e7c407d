"""Exploratory: FSDP2 with CPUOffloadPolicy on one rank (parameter offload), the 1.3B decoder LM at
a capped budget. Prints step times, peaks and the CPU optimizer step's time per setting."""
import json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(os.environ.get("OUT", "/tmp/out")); out.mkdir(parents=True, exist_ok=True)
budget = float(sys.argv[1]) * 2**30
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(budget / total)
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29561")
dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import GPT2Config, GPT2LMHeadModel

rows = []
def log(**kw):
    print(json.dumps(kw), flush=True); rows.append(kw)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))

def build(mp_bf16, width=2048, layers=24):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=50257, n_embd=width, n_layer=layers, n_head=16, n_positions=1024, use_cache=False)
    m = GPT2LMHeadModel(cfg)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp_bf16 else MixedPrecisionPolicy()
    for b in m.transformer.h:
        fully_shard(b, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=mp)
    fully_shard(m, offload_policy=CPUOffloadPolicy(pin_memory=True), mp_policy=mp)
    return m

for mp_bf16 in (True, False):
    t0 = time.perf_counter()
    model = build(mp_bf16)
    log(event="built", mp_bf16=mp_bf16, s=time.perf_counter() - t0,
        param_device=str(next(model.parameters()).device), ptype=type(next(model.parameters())).__name__,
        cuda_alloc=torch.cuda.memory_allocated())
    for fused in (True, False):
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused, foreach=None if fused else True)
        except Exception as e:
            log(event="opt-fail", fused=fused, err=repr(e)[:300]); continue
        for mb in (1, 2, 4, 8, 16):
            try:
                times, opts = [], []
                for i in range(4):
                    torch.cuda.synchronize(); t = time.perf_counter()
                    x = torch.randint(0, 50257, (mb, 512), device="cuda")
                    ctx = torch.autocast("cuda", torch.bfloat16) if not mp_bf16 else torch.autocast("cuda", enabled=False)
                    with ctx:
                        loss = model(input_ids=x, labels=x).loss
                    loss.backward()
                    torch.cuda.synchronize(); t1 = time.perf_counter()
                    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    finite = bool(torch.isfinite(norm).item())
                    opt.step(); opt.zero_grad(set_to_none=True)
                    torch.cuda.synchronize(); t2 = time.perf_counter()
                    times.append(t2 - t); opts.append(t2 - t1)
                log(event="step", mp_bf16=mp_bf16, fused=fused, mb=mb, step_s=min(times[1:]), opt_s=min(opts[1:]),
                    samples_per_s=mb / min(times[1:]), loss=float(loss), finite=finite,
                    peak_alloc=torch.cuda.max_memory_allocated(), peak_reserved=torch.cuda.max_memory_reserved(),
                    norm_type=type(norm).__name__)
            except torch.OutOfMemoryError as e:
                log(event="oom", mp_bf16=mp_bf16, fused=fused, mb=mb)
                opt.zero_grad(set_to_none=True); torch.cuda.empty_cache(); break
            except Exception as e:
                import traceback; traceback.print_exc()
                log(event="error", mp_bf16=mp_bf16, fused=fused, mb=mb, err=repr(e)[:500]); break
            torch.cuda.reset_peak_memory_stats()
        # state dict (DCP) save time once
        if fused:
            try:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict
                t = time.perf_counter()
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"/tmp/ckpt-{mp_bf16}")
                log(event="dcp-save", mp_bf16=mp_bf16, s=time.perf_counter() - t)
            except Exception as e:
                log(event="dcp-fail", err=repr(e)[:300])
        del opt
    del model
    torch.cuda.empty_cache()
dist.destroy_process_group()
