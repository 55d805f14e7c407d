"""The 8-bit optimizer lever with and without bitsandbytes' device sync after every tensor's
update (:data:`tightfit.levers.optimizers.SKIP_PER_TENSOR_SYNC`), side by side in one process:
training steps of tightfit's probe (:func:`tightfit.planner.probe.run_probe_steps`: forward,
backward and the optimizer step, each step synchronised with the device, the median of the timed
steps), alternating the two settings REPEATS times per workload.

Workloads (random weights, the bench's random samples at full length, bf16 autocast):
BERT-base seq 128 at micro-batch 256 with 11 of 12 blocks checkpointed (the plan tightfit makes
for it at 4 GiB, ``../results/runner-up-optimizer/``), and BERT-large seq 128 at micro-batch 64,
every block checkpointed (393 parameter tensors).

    OUT=folder python bench/optimizer_sync.py

Writes ``$OUT/optimizer_sync.json`` and prints a Markdown table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tightfit.bench.workloads import BenchWorkload, make_workload  # noqa: E402
from tightfit.levers import optimizers as lv  # noqa: E402
from tightfit.levers.checkpointing import set_activation_checkpointing  # noqa: E402
from tightfit.planner.probe import run_probe_steps  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
REPEATS, TIMED = 3, 10
CASES = [("bert-base", 256, 11), ("bert-large", 64, 24)]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for arch, mb, blocks in CASES:
        w = make_workload(BenchWorkload(f"{arch}-128", arch, 128, "139GiB", mb), mb, 4 * mb)
        set_activation_checkpointing(w.model, True, tuple(range(blocks)))
        tensors = sum(1 for p in w.model.parameters() if p.requires_grad)
        times = {True: [], False: []}
        for _ in range(REPEATS):
            for skip in (True, False):
                lv.SKIP_PER_TENSOR_SYNC = skip
                seconds, _ = run_probe_steps(w, mb, "bf16", "adamw8bit", timed_steps=TIMED)
                times[skip].append(seconds)
        lv.SKIP_PER_TENSOR_SYNC = True
        row = {"workload": f"{arch} seq 128, micro-batch {mb}, {blocks} blocks checkpointed", "tensors": tensors,
               "with_syncs_s": times[False], "without_syncs_s": times[True]}
        row["speedup"] = statistics.median(times[False]) / statistics.median(times[True])
        rows.append(row)
        del w
        torch.cuda.empty_cache()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "bitsandbytes": __import__("bitsandbytes").__version__, "repeats": REPEATS, "timed_steps": TIMED}
    (OUT / "optimizer_sync.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    print("| workload | tensors | step with the library's syncs (ms) | without (ms) | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        a, b = statistics.median(r["with_syncs_s"]) * 1e3, statistics.median(r["without_syncs_s"]) * 1e3
        print(f"| {r['workload']} | {r['tensors']} | {a:.1f} | {b:.1f} | {r['speedup']:.3f}x |")


if __name__ == "__main__":
    main()
