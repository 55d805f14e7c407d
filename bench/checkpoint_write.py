"""Where a background checkpoint write's time goes (issue 12: checkpoints off the critical path).

    python3 bench/checkpoint_write.py OUTDIR [--params N]

Builds a model of about N parameters (default 22.7M, the main job's MiniLM) with AdamW state on
the GPU (or the CPU when there is none), takes tightfit's snapshot of it
(:func:`~tightfit.runtime.checkpoint.take_snapshot`) and times, 3 times each: the snapshot (finite
check, device-to-host copies, sync), the whole background write
(:func:`~tightfit.runtime.checkpoint.write_snapshot`), and its parts one by one (safetensors'
``save_file`` of weights and of state, ``fsync``, SHA-256 of each file, ``torch.save`` of the
structure), plus SHA-256 of bytes in memory. Writes ``OUTDIR/checkpoint-write.json`` and ``.md``.
"""

from __future__ import annotations

import hashlib
import shutil
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tightfit.runtime.checkpoint import (  # noqa: E402
    _fsync, _HostBuffers, sha256_file, take_snapshot, write_snapshot)
from tightfit.runtime.state_tensors import split_state  # noqa: E402


def _timed(fn, n=3):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main(outdir: Path, params: int = 22_700_000) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    width = 384
    layers = max(1, params // (width * width * 12))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width * 12 // 2) if i % 2 == 0 else
                                  torch.nn.Linear(width * 12 // 2, width) for i in range(2 * layers)]).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev == "cuda")
    model(torch.randn(8, width, device=dev)).sum().backward()
    opt.step()
    state = {"optimizer": opt.state_dict(), "step": 1}
    n = sum(p.numel() for p in model.parameters())
    buffers = _HostBuffers()
    t0 = time.perf_counter()
    first = take_snapshot(model, state, buffers)  # the buffers made once, as in a run
    if first.ready is not None:
        first.ready.synchronize()
    first_seconds = time.perf_counter() - t0

    def snap():
        s = take_snapshot(model, state, buffers)
        if s.ready is not None:
            s.ready.synchronize()
        return s

    rows = {"first snapshot (host buffers allocated)": first_seconds,
            "snapshot (finite check, copies, sync)": _timed(snap)}
    s = snap()
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=outdir))
    rows["write_snapshot (whole background write)"] = _timed(lambda: write_snapshot(tmp, 1, s, keep_last=1))
    structure, tensors = split_state(s.state)
    w, st = tmp / "w.safetensors", tmp / "s.safetensors"
    rows["save_file weights"] = _timed(lambda: save_file(s.weights, str(w)))
    rows["save_file state"] = _timed(lambda: save_file(tensors, str(st)))
    rows["fsync weights"] = _timed(lambda: (save_file(s.weights, str(w)), _fsync(w))) - rows["save_file weights"]
    rows["sha256 weights file"] = _timed(lambda: sha256_file(w))
    rows["sha256 state file"] = _timed(lambda: sha256_file(st))
    rows["torch.save structure"] = _timed(lambda: torch.save(structure, tmp / "structure.pt"))
    data = w.read_bytes()
    rows["sha256 weights bytes in memory"] = _timed(lambda: hashlib.sha256(data).hexdigest())
    sizes = {"weights_bytes": w.stat().st_size, "state_bytes": st.stat().st_size}
    shutil.rmtree(tmp)
    result = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "parameters": n,
              "torch": torch.__version__, **sizes, "seconds": rows,
              "sha256_gb_per_s": len(data) / rows["sha256 weights bytes in memory"] / 1e9}
    (outdir / "checkpoint-write.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# checkpoint write breakdown: {result['device']}, {n / 1e6:.1f}M parameters + AdamW state",
             f"weights {sizes['weights_bytes'] / 2**20:.0f} MiB, state {sizes['state_bytes'] / 2**20:.0f} MiB; "
             f"SHA-256 in memory {result['sha256_gb_per_s']:.2f} GB/s", "", "| part | seconds (median of 3) |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in rows.items()]
    (outdir / "checkpoint-write.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 22_700_000)
