"""In-process A/B: HEAD's meta_cache+tracker (A) against the working tree's (B), alternating per
estimate so that the host's load hits both alike. Usage (repository root): python bench/results/plan-trace-cost/ab_estimator.py MODEL ROUNDS"""
import importlib.util, sys, time, statistics, subprocess
import tightfit.memory as tm
import tightfit.memory.estimate as E
from tightfit.models import build_model
from tightfit.plan import Plan

def load(name, src):
    spec = importlib.util.spec_from_loader("tightfit.memory." + name, loader=None)
    mod = importlib.util.module_from_spec(spec); mod.__package__ = "tightfit.memory"
    sys.modules["tightfit.memory." + name] = mod
    exec(compile(src, f"<{name}>", "exec"), mod.__dict__)
    return mod

show = lambda p: subprocess.run(["git", "-C", "/work/main", "show", "HEAD:" + p], capture_output=True, text=True).stdout
a_mc = load("_a_meta_cache", show("tightfit/memory/meta_cache.py"))
a_tr = load("_a_tracker", show("tightfit/memory/tracker.py").replace("from . import meta_cache", "from . import _a_meta_cache as meta_cache"))
A, B = a_tr.AllocationTracker, E.AllocationTracker
name = sys.argv[1]; rounds = int(sys.argv[2])
m, mb = build_model(name); b = mb(2, 128)
plans = [(Plan("bf16", 8, 128), dict(checkpoint_blocks="none")), (Plan("bf16", 16, 128), dict(checkpoint_blocks="all")),
         (Plan("fp16", 8, 128, optimizer="adamw8bit"), dict(block_policies=["selective", "offload", "full", "none"] * (len(E.find_blocks(m)) // 4)))]
res = {"A": [], "B": []}
outs = {"A": [], "B": []}
for tag, cls in (("A", A), ("B", B)):
    E.AllocationTracker = cls
    for p, kw in plans: E.estimate(m, b, p, **kw)  # warm-up both caches
for r in range(rounds):
    for tag, cls in ((("A", A), ("B", B)) if r % 2 == 0 else (("B", B), ("A", A))):
        E.AllocationTracker = cls
        t = time.process_time()
        o = [E.estimate(m, b, p, **kw) for p, kw in plans]
        res[tag].append(time.process_time() - t)
        if r == 0: outs[tag] = [(e.peak_allocated_bytes, e.peak_reserved_bytes, e.breakdown, e.extra) for e in o]
assert outs["A"] == outs["B"], "estimates differ"
ratios = [b / a for a, b in zip(res["A"], res["B"])]
print(f"{name}: A min {min(res['A']):.3f} med {statistics.median(res['A']):.3f} | B min {min(res['B']):.3f} med {statistics.median(res['B']):.3f} | B/A median ratio {statistics.median(ratios):.3f} (per 3 estimates, CPU s)")
