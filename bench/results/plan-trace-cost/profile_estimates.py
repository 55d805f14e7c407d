"""A fixed set of exact estimates (BERT-base and BERT-large at seq 128, the kinds of plans the
search traces), timed and profiled in one process: a less noisy measure of a trace's cost than a
whole `tightfit plan`. Usage (repository root): ``python PATH [--profile OUT.prof] [--dump OUT.json]``.
The first estimate of each model is a warm-up (fills the meta-layout cache, as a plan's first does)."""

from __future__ import annotations

import cProfile
import json
import pstats
import sys
import time

from tightfit.memory.estimate import estimate
from tightfit.models import build_model
from tightfit.plan import Plan

CASES = [
    ("bert-base", Plan("bf16", 16, 256), dict(checkpoint_blocks="none")),
    ("bert-base", Plan("bf16", 4, 256), dict(checkpoint_blocks="all")),
    ("bert-base", Plan("bf16", 32, 256, optimizer="adamw8bit"), dict(block_policies=["selective"] * 6 + ["offload"] * 6)),
    ("bert-large", Plan("bf16", 16, 128), dict(checkpoint_blocks="all")),
    ("bert-large", Plan("fp16", 4, 128, optimizer="adamw8bit"), dict(checkpoint_blocks="none")),
    ("bert-large", Plan("bf16", 8, 128), dict(block_policies=["offload"] * 12 + ["full"] * 12)),
]


def run(dump: dict | None = None) -> None:
    models = {}
    for i, (name, plan, kw) in enumerate(CASES):
        if name not in models:
            models[name] = build_model(name)
            model, make_batch = models[name]
            estimate(model, make_batch(2, 128), Plan("bf16", 2, 2), checkpoint_blocks="none")  # warm-up
        model, make_batch = models[name]
        e = estimate(model, make_batch(2, 128), plan, **kw)
        if dump is not None:
            dump[str(i)] = {"peak_allocated": e.peak_allocated_bytes, "peak_reserved": e.peak_reserved_bytes,
                            "breakdown": e.breakdown, "first": e.first_step_peak_reserved_bytes, "extra": e.extra}


if __name__ == "__main__":
    args = sys.argv[1:]
    prof_out = args[args.index("--profile") + 1] if "--profile" in args else None
    dump_out = args[args.index("--dump") + 1] if "--dump" in args else None
    build_model("bert-base"), build_model("bert-large")  # imports outside the timing
    dump = {} if dump_out else None
    t, cpu = time.perf_counter(), time.process_time()
    if prof_out:
        p = cProfile.Profile(time.process_time)  # CPU seconds: the host is shared
        p.enable()
        run(dump)
        p.disable()
        p.dump_stats(prof_out)
        st = pstats.Stats(p)
        print(f"cProfile total {st.total_tt:.2f} s (process CPU time)")
    else:
        run(dump)
    print(f"wall {time.perf_counter() - t:.2f} s, cpu {time.process_time() - cpu:.2f} s")
    if dump_out:
        with open(dump_out, "w") as f:
            json.dump(dump, f, indent=1, sort_keys=True, default=str)
