"""Where the search's time goes on this host: `tightfit plan` for one workload under cProfile.

The search runs on the CPU alone (meta-tensor traces of the step), yet it took 25-34 s for
BERT-large at 4 GiB on the 16-core host of an NVIDIA H200 (`bench/results/plan-warm/`) against
13-15 s on a 2-core development host for the same traces. This profiles it where it runs, so
that two hosts can be compared function by function.

Usage (repository root, any machine): ``python bench/search_profile.py OUT_DIR [WORKLOAD]``
(default ``bert-large-128@4GiB``). Writes ``OUT_DIR/search-profile-<workload>.txt``: the wall
seconds without the profiler and with it, the exact traces made, the host (torch, Python, CPU
count, intra-op threads), then the 40 functions with the most cumulative and the most own time.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))


def main(out_dir: str, name: str) -> None:
    import torch

    from plan_time import workloads
    from plan_traces import _calls, _counted, estimate_module
    from tightfit.cli import main as cli

    estimate_module.estimate = _counted
    with tempfile.TemporaryDirectory() as root:
        row = next((w for w in workloads(Path(root)) if w[0] == name), None)
    if row is None:
        raise SystemExit(f"unknown workload {name!r}")
    _, model, size, budget, batch = row
    image = model in ("vit-b16", "resnet50")
    argv = ["plan", "--model", model, "--image-size" if image else "--seq-len", str(size),
            "--batch-size", str(batch), "--budget", budget, "--json"]
    os.environ["TIGHTFIT_CACHE_DIR"] = tempfile.mkdtemp()
    runs = []
    for profiled in (False, True):  # the first also warms imports and the meta-layout cache
        _calls[0] = 0
        profiler = cProfile.Profile() if profiled else None
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            if profiler:
                profiler.enable()
            code = cli(argv)
            if profiler:
                profiler.disable()
        runs.append((time.perf_counter() - t, _calls[0], code))
    out = io.StringIO()
    out.write(f"{' '.join(argv)}\nhost: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
              f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads), Python "
              f"{platform.python_version()}, CUDA available: {torch.cuda.is_available()}\n")
    out.write(f"unprofiled: {runs[0][0]:.1f} s, {runs[0][1]} traces, exit {runs[0][2]}; "
              f"profiled: {runs[1][0]:.1f} s, {runs[1][1]} traces\n\n")
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(40)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"search-profile-{name.replace('@', '-at-')}.txt").write_text(out.getvalue())
    print(out.getvalue()[:600])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench-out", sys.argv[2] if len(sys.argv) > 2 else "bert-large-128@4GiB")
