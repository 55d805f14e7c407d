"""How much a background checkpoint write slows a training loop bound by its host (issue 12).

    python3 bench/checkpoint_gil.py OUTDIR

A main thread launches small tensor ops in a loop (what an eager step of a small model does: the
GIL held between kernel launches) while a second thread writes a checkpoint of a 23M-parameter
model with AdamW state over and over, each way in turn: ``torch.save`` of the whole state (how
tightfit wrote ``state.pt`` before ``state.safetensors``), ``safetensors.torch.save_file`` of the
same tensors, and tightfit's :func:`~tightfit.runtime.checkpoint.write_snapshot` as it is now.
Reports the main thread's ops/s during each write against alone (1.0: not slowed). Writes
``OUTDIR/checkpoint-gil.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tightfit.runtime.checkpoint import _HostBuffers, take_snapshot, write_snapshot  # noqa: E402


def _ops_per_s(seconds: float, x: torch.Tensor) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            x.add(1.0)
        n += 100
    return n / (time.perf_counter() - t0)


def _during(write, x: torch.Tensor, seconds: float = 3.0) -> tuple[float, int]:
    """The main thread's ops/s while ``write`` runs again and again on another thread, and the writes done."""
    stop, done = threading.Event(), [0]

    def loop():
        while not stop.is_set():
            write()
            done[0] += 1

    th = threading.Thread(target=loop)
    th.start()
    time.sleep(0.2)
    rate = _ops_per_s(seconds, x)
    stop.set()
    th.join()
    return rate, done[0]


def main(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(22)])  # 23.1M parameters
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = {"step": 1, "optimizer": opt.state_dict()}
    tensors = {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-gil-"))
    x = torch.randn(8, 8)
    step = [0]

    snap = take_snapshot(model, state, _HostBuffers())  # taken on the loop's thread in a run, before the write

    def tightfit_write():
        step[0] += 1
        write_snapshot(folder / "ckpts", step[0], snap, keep_last=1)

    ways = {"torch.save of the whole state (state.pt before)": lambda: torch.save(state, folder / "s.pt"),
            "safetensors save_file of the same tensors": lambda: save_file(tensors, str(folder / "s.safetensors")),
            "tightfit write_snapshot (weights, state.pt, state.safetensors)": tightfit_write}
    alone = _ops_per_s(2.0, x)
    rows = []
    for name, write in ways.items():
        rate, writes = _during(write, x)
        rows.append({"write": name, "ops_per_s": rate, "vs_alone": rate / alone, "writes": writes})
        print(json.dumps(rows[-1]), flush=True)
    alone_after = _ops_per_s(2.0, x)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    result = {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "commit": commit,
              "alone_ops_per_s": alone, "alone_after_ops_per_s": alone_after, "rows": rows}
    (outdir / "checkpoint-gil.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# A host-bound loop during a background checkpoint write ({os.cpu_count()} CPUs, torch {torch.__version__}, "
             f"tightfit {commit})", "", "`python3 bench/checkpoint_gil.py OUT`", "",
             f"Main thread alone: {alone:,.0f} small ops/s (after: {alone_after:,.0f}).", "",
             "| written on another thread, again and again | main thread vs alone | writes |", "|---|---|---|"]
    lines += [f"| {r['write']} | {r['vs_alone']:.2f} | {r['writes']} |" for r in rows]
    (outdir / "checkpoint-gil.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
