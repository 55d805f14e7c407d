"""How long the first ``adamw8bit-bf16`` step compiles, cold, and how fast later steps run, for
the shapes the compiled update is specialised to: one graph per parameter shape (``static``, as
torchao compiles it: ``dynamic=False``) or every tensor flattened to 1-D with the size dynamic
(``flat-dynamic``: one graph per state kind). The first step's compilation is paid inside
planning, by the first probe that steps the optimizer, in every process whose compiler cache is
cold.

Each variant runs in a fresh process with its own empty TorchInductor cache
(``TORCHINDUCTOR_CACHE_DIR``), over BERT-large's 393 bf16 tensors with random bf16 gradients:
the first step's wall time, the median of 10 later steps, and a SHA-256 of the weights after 3
steps (equal hashes: the same weights bit for bit, stochastic rounding draws included).
``static`` is tightfit's update (``tightfit.levers.optimizers._compiled_update``, bit-identical
to torchao's own step); ``flat-dynamic`` is written here.

    OUT=folder python3 bench/optimizer_compile_time.py
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
OUT = Path(os.environ.get("OUT", "bench-out"))
VARIANTS = ("static", "flat-dynamic")


def flat_dynamic_update():
    """The update with every tensor flattened to 1-D and the size dynamic (one graph per state
    kind), as tightfit compiled it at d1d2723 (measured: a colder first step, a slower steady step
    and other weights on the GPU than torchao's own step, so tightfit went back to ``static``)."""
    import torch
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    def plain(p, grad, step, codes1, scale1, qmap1, signed1, codes2, scale2, qmap2, signed2, *rest):
        single_param_adam(p, grad, step, OptimState8bit(codes1, scale1, qmap1, signed1),
                          OptimState8bit(codes2, scale2, qmap2, signed2), None, *rest)

    compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=True)
    compiled_plain = torch.compile(plain, fullgraph=True, dynamic=True)

    def update(p, grad, step, m1, m2, m3, *rest):
        if m3 is None and type(m1) is OptimState8bit and type(m2) is OptimState8bit:
            return compiled_plain(p.view(-1), grad.view(-1), step, m1.codes.view(-1), m1.scale, m1.qmap, m1.signed,
                                  m2.codes.view(-1), m2.scale, m2.qmap, m2.signed, *rest)
        return compiled(p.view(-1), grad.view(-1), step, m1.view(-1), m2.view(-1), m3, *rest)

    return lambda: update


def one(variant: str) -> dict:
    import torch

    from tightfit.levers import optimizers
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from optimizer_dispatch import params_and_grads

    if variant == "flat-dynamic":
        optimizers._compiled_update = flat_dynamic_update()
    ps, grads = params_and_grads()
    opt = optimizers.adamw_8bit_bf16(ps, 1e-4, 0.01)
    for p, g in zip(ps, grads):
        p.grad = g
    torch.manual_seed(123)
    times = []
    for i in range(13):
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if i == 2:
            digest = hashlib.sha256()
            for p in ps:
                digest.update(p.detach().view(torch.int16).cpu().numpy().tobytes())
    return {"variant": variant, "first_step_s": times[0], "step_ms": statistics.median(times[3:]) * 1e3,
            "tensors": len(ps), "weights_sha256_after_3_steps": digest.hexdigest()}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2])))
        return
    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    for v in VARIANTS:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            r = subprocess.run([sys.executable, __file__, "--one", v], env=env, capture_output=True, text=True)
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        rows.append(json.loads(line[-1]) if line else {"variant": v, "error": r.stderr[-2000:]})
        print(rows[-1], flush=True)
    (OUT / "optimizer_compile_time.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
