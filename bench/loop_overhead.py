"""Where the training loop's own host time goes, on a CUDA GPU (issue 12: the run's steady state
against the plan's probe, for a host-bound step).

    python3 bench/loop_overhead.py OUTDIR [-- tightfit train options]

Default options: the main job at 4 GiB for one epoch without periodic checkpoints
(``--full --budget 4GiB --epochs 1 --checkpoint-every 0``). In one process, the same run is trained
several times through the Python API, each time with one piece of the loop's per-step bookkeeping
replaced by a no-op for this measurement only (they guard OOM redos and the memory report, so a
real run needs them): the allocator's statistics read each step, the RNG capture, the buffer
snapshot, the prefetch thread. The first and last runs are unchanged, to show drift
(``LOOP_VARIANTS``: a comma-separated order of the variants' names instead, e.g. to alternate two). Then each
piece's host cost is timed alone (1,000 calls). Writes ``OUTDIR/loop-overhead.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT = ["--full", "--budget", "4GiB", "--epochs", "1", "--checkpoint-every", "0", "--no-progress"]


def _train(argv: list[str], out: Path) -> dict:
    from tightfit import api
    from tightfit.cli import _parser
    from tightfit.config import TrainRequest

    req = TrainRequest.from_args(_parser().parse_args(["train", *argv, "--out", str(out)]))
    s = api.train(req)
    return {k: s.speed.get(k) for k in ("probed_samples_per_s", "steady_samples_per_s", "whole_run_samples_per_s",
                                         "steady_vs_probed")} | {"steps": s.steps, "train_seconds": s.train_seconds}


def _micro_costs() -> dict:
    import torch

    from tightfit.rng import capture_rng

    dev = torch.device("cuda")
    x = torch.zeros(512, dtype=torch.long, device=dev)

    def timed(fn, n=1000):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e6 * (time.perf_counter() - t0) / n  # microseconds per call

    return {
        "memory_stats_as_nested_dict_us": timed(lambda: torch.cuda.memory_stats_as_nested_dict(dev)),
        "reset_peak_memory_stats_us": timed(lambda: torch.cuda.reset_peak_memory_stats(dev)),
        "max_memory_allocated_us": timed(lambda: torch.cuda.max_memory_allocated(dev)),
        "capture_rng_us": timed(capture_rng),
        "cuda_get_rng_state_all_us": timed(torch.cuda.get_rng_state_all),
        "clone_512_us": timed(lambda: x.clone()),
        "pinned_empty_2_us": timed(lambda: torch.empty(2, pin_memory=True)),
        "event_record_us": timed(lambda: torch.cuda.Event().record()),
    }


def main(outdir: Path, argv: list[str]) -> None:
    import tempfile

    import torch

    from tightfit.runtime import trainer as trainer_module
    from tightfit.runtime.prefetch import Prefetcher

    outdir.mkdir(parents=True, exist_ok=True)
    argv = argv or DEFAULT
    runs = Path(tempfile.mkdtemp(prefix="loop-overhead-"))
    originals = {"record": trainer_module.Trainer._record_memory, "capture": trainer_module.capture_rng,
                 "snapshot": trainer_module.buffer_snapshot, "prefetch": Prefetcher.__init__}
    prefetch_init = originals["prefetch"]

    def patch(what: set) -> None:
        trainer_module.Trainer._record_memory = ((lambda self: self.memory_timeline.append((self.step, 0, 0)))
                                                 if "record" in what else originals["record"])
        trainer_module.capture_rng = (lambda: {}) if "capture" in what else originals["capture"]  # read on an OOM only
        trainer_module.buffer_snapshot = (lambda modules: None) if "snapshot" in what else originals["snapshot"]
        Prefetcher.__init__ = ((lambda self, collate, device, enabled=True: prefetch_init(self, collate, device, False))
                               if "prefetch" in what else prefetch_init)

    known = {"unchanged": set(), "no memory statistics": {"record"}, "no RNG capture": {"capture"},
             "no buffer snapshot": {"snapshot"}, "no prefetch thread": {"prefetch"},
             "none of the three": {"record", "capture", "snapshot"}}
    order = os.environ.get("LOOP_VARIANTS")  # e.g. "unchanged,no prefetch thread,unchanged,no prefetch thread"
    variants = ([(n, known[n]) for n in order.split(",")] if order else
                [*known.items(), ("unchanged again", set())])
    rows = []
    for i, (name, what) in enumerate(variants):
        patch(what)
        row = {"variant": name, **_train(argv, runs / f"run-{i}")}
        rows.append(row)
        print(json.dumps(row), flush=True)
    patch(set())
    micro = _micro_costs()
    result = {"argv": argv, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
              "micro_costs": micro}
    (outdir / "loop-overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# The loop's host overhead ({result['device']}, torch {result['torch']})", "",
             f"`python3 bench/loop_overhead.py OUT -- {' '.join(argv)}`", "",
             "| variant | probed | steady | whole run | steady/probed | train s |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['probed_samples_per_s'] or 0:.0f} | {r['steady_samples_per_s'] or 0:.0f} | "
                     f"{r['whole_run_samples_per_s'] or 0:.0f} | {r['steady_vs_probed'] or 0:.2f} | "
                     f"{r['train_seconds']:.1f} |")
    lines += ["", "Host cost of each call alone (microseconds, mean of 1,000):", ""]
    lines += [f"- {k}: {v:.1f}" for k, v in micro.items()]
    (outdir / "loop-overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    main(Path(args[0]), extra)
