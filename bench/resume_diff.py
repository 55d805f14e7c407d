"""Where a compiled run resumed from its step-2 checkpoint parts from the uninterrupted one
(tests/test_gpu.py's ``_fit_scoped``: tiny BERT, dropout 0.1, fp32, 4 x 4 accumulation, a
checkpoint every 2 steps, compiled and recorded before training). For each compile scope: the
losses of steps 3-N, and per checkpoint the weights' and state's largest difference, the resumed
run's and a second uninterrupted run's (the run-to-run noise) against the first.
A name ``SCOPE+det`` runs with ``torch.use_deterministic_algorithms(True, warn_only=True)``.
Usage (repository root, CUDA): PYTHONPATH=.:tests python bench/resume_diff.py OUT [SCOPE[+det] ...]
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_gpu import _fit_scoped  # noqa: E402


def _diff(a: dict, b: dict) -> dict:
    out = {}
    for k in a:
        if not torch.equal(a[k], b[k]):
            out[k] = float((a[k].double() - b[k].double()).abs().max())
    return out


def main(out: str, scopes: list[str], steps: int = 8) -> None:
    os.makedirs(out, exist_ok=True)
    report = {}
    for name in scopes:
        scope = name.split("+")[0]
        scope = None if scope == "blocks" else scope
        # "+det": with torch.use_deterministic_algorithms (TorchInductor then avoids atomic adds)
        torch.use_deterministic_algorithms(name.endswith("+det"), warn_only=True)
        torch._dynamo.reset()
        full, fl = _fit_scoped(scope, folder=f"{out}/{name}/full", max_steps=steps)
        torch._dynamo.reset()
        again, al = _fit_scoped(scope, folder=f"{out}/{name}/again", max_steps=steps)  # run-to-run noise
        torch._dynamo.reset()
        res, rl = _fit_scoped(scope, folder=f"{out}/{name}/resumed", max_steps=steps,
                              resume=f"{out}/{name}/full/ckpt-2")
        torch._dynamo.reset()
        r = {"losses (full, again, resumed)": {k: (fl[k], al.get(k), rl.get(k)) for k in fl if k > 2}}
        for s in range(4, steps + 1, 2):
            a = load_file(f"{out}/{name}/full/ckpt-{s}/model.safetensors")
            b = load_file(f"{out}/{name}/resumed/ckpt-{s}/model.safetensors")
            r[f"ckpt-{s} weights"] = _diff(a, b)
            r[f"ckpt-{s} weights, again"] = _diff(a, load_file(f"{out}/{name}/again/ckpt-{s}/model.safetensors"))
            try:
                a = load_file(f"{out}/{name}/full/ckpt-{s}/state.safetensors")
                b = load_file(f"{out}/{name}/resumed/ckpt-{s}/state.safetensors")
                r[f"ckpt-{s} state"] = _diff(a, b)
            except Exception as e:  # noqa: BLE001
                r[f"ckpt-{s} state"] = repr(e)[:200]
        r["final weights"] = _diff(full.model.state_dict(), res.model.state_dict())
        r["final weights, again"] = _diff(full.model.state_dict(), again.model.state_dict())
        report[name] = r
        torch.use_deterministic_algorithms(False)
        print(name, json.dumps(r, indent=1, default=str)[:4000], flush=True)
    with open(f"{out}/resume_diff.json", "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["blocks", "model", "model-graphs"])
