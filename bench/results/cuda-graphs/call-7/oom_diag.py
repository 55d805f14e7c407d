"""Usage: oom_diag.py auto|off [MiB held before]. tests/test_gpu.py's OOM-recovery scenario with --cuda-graphs auto and off, each in a fresh
process: the recovered run's and the reference run's losses, micro-batches and events."""
import gc, json, sys
import torch
sys.path.insert(0, "tests")
from test_gpu import _bert_base_workload
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.units import GiB

graphs = sys.argv[1]
ballast = torch.empty(int(sys.argv[2]) << 20 if len(sys.argv) > 2 else 0, dtype=torch.uint8, device="cuda")  # memory an earlier test left
torch.cuda.set_per_process_memory_fraction(3 * GiB / torch.cuda.get_device_properties(0).total_memory)

def losses(mb):
    w = _bert_base_workload(n=192, dropout=0.1)
    w.model.eval()
    log = []
    t = Trainer(w, Plan("fp32", mb, 64, device="cuda"),
                TrainConfig(epochs=1, lr=1e-5, grow_back_after=0, log_every=1, cuda_graphs=graphs),
                log=log.append, progress=False)
    res = t.fit()
    out = [r["loss"] for r in log if r["type"] == "train"]
    ev = [f'{r["step"]}: {r["message"]}' for r in log if r["type"] == "event"]
    del t, w
    gc.collect(); torch.cuda.empty_cache()
    return res, out, ev

res, rec, ev = losses(64)
ref_res, ref, ev2 = losses(res.plan.micro_batch)
print(json.dumps({"graphs": graphs, "recovered": rec, "micro_batch": res.plan.micro_batch,
                  "oom_recoveries": res.oom_recoveries, "graphed": res.graphed_steps, "events": ev,
                  "reference": ref, "ref_graphed": ref_res.graphed_steps, "ref_events": ev2,
                  "allocated_after": torch.cuda.memory_allocated()}, indent=1))
