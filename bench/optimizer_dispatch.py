"""The host cost of torchao's 8-bit AdamW with bf16 stochastic rounding (``adamw8bit-bf16``) over
BERT-large's bf16 parameters, and of calling torchao's own per-parameter update fewer times.

bench/step_breakdown.py found the step host-bound: ~240 ms of host time per optimizer step for
~8 ms of GPU work (torchao calls ``torch.compile(single_param_adam)`` once per parameter, 393
calls). Variants, each over a fresh copy of the state, the math always torchao's
``single_param_adam``:
- ``shipped``: ``torchao.optim.AdamW8bit(bf16_stochastic_round=True).step()``;
- ``one-wrapper``: the same loop calling one compiled function made once (tightfit's lever at 80a7e70);
- ``grouped``: one compiled call per group of parameters of the same shape and state kind
  (a loop over the group inside the compiled function);
- ``plain-inputs``: the one-wrapper loop, but the compiled function takes the 8-bit state's
  plain tensors (codes, scales, maps) and wraps them in torchao's ``OptimState8bit`` inside, so
  that no tensor subclass crosses the compiled function's boundary (each call otherwise
  flattens and rebuilds the subclasses in Python; tightfit's lever since the session of 2026-12-02).
Each: the first step's wall time (compilation), then the median of 10 steps (wall, synced), and
whether the weights after 3 steps equal the shipped optimizer's (same seeds for the stochastic
rounding: equal only if the random draws are made in the same order).

    OUT=folder python3 bench/optimizer_dispatch.py [--skip-shipped] [--grouped] [--profile]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))


def params_and_grads():
    from tightfit.models import build_model

    torch.manual_seed(0)
    model, _ = build_model("bert-large", device="cpu")
    ps = [p.detach().to("cuda", torch.bfloat16).requires_grad_() for p in model.parameters()]
    g = torch.Generator(device="cuda").manual_seed(1)
    grads = [torch.randn(p.shape, device="cuda", generator=g, dtype=torch.float32).mul_(1e-3).bfloat16() for p in ps]
    return ps, grads


def grouped_class():
    from torchao.optim import AdamW8bit
    from torchao.optim.adam import single_param_adam

    def many(ps, grads, steps, m1, m2, lr, b1, b2, wd, eps, is_adamw, sr):
        for i in range(len(ps)):
            single_param_adam(ps[i], grads[i], steps[i], m1[i], m2[i], None, lr, b1, b2, wd, eps, is_adamw, sr)

    compiled = torch.compile(many, fullgraph=True, dynamic=False)

    class Grouped(AdamW8bit):
        @torch.no_grad()
        def step(self, closure=None):
            with torch._dynamo.utils.disable_cache_limit():
                for group in self.param_groups:
                    kinds = {}
                    for p in group["params"]:
                        if p.grad is None:
                            continue
                        state = self.state[p]
                        if len(state) == 0:
                            state["step"] = torch.tensor(0.0)
                            state["exp_avg"] = self._new_buffer(p, True)
                            state["exp_avg_sq"] = self._new_buffer(p, False)
                        state["step"] += 1
                        kinds.setdefault((tuple(p.shape), type(state["exp_avg"])), []).append(p)
                    for ps in kinds.values():
                        st = [self.state[p] for p in ps]
                        compiled([p.detach() for p in ps], [p.grad for p in ps], [s["step"] for s in st],
                                 [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st], group["lr"],
                                 group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"], True,
                                 self.bf16_stochastic_round)

    return Grouped


def one_wrapper_class():
    """tightfit's ``adamw8bit-bf16`` loop as of 80a7e70: torchao's update compiled once, called
    with the 8-bit moments as torchao's ``OptimState8bit`` subclass (the measured run at 80a7e70
    timed a copy of that loop written here before the lever took it)."""
    from torchao.optim.adam import single_param_adam

    from tightfit.levers import optimizers

    compiled = torch.compile(single_param_adam, fullgraph=True, dynamic=False)
    base = optimizers._bf16_class()

    class OneWrapper(base):
        def step(self, closure=None):
            saved = optimizers._compiled_update
            optimizers._compiled_update = lambda: compiled
            try:
                return super().step(closure)
            finally:
                optimizers._compiled_update = saved

    return OneWrapper


def plain_inputs_class():
    """tightfit's ``adamw8bit-bf16`` class now: one compiled update taking the 8-bit moments'
    plain tensors (``tightfit.levers.optimizers._compiled_update``)."""
    from tightfit.levers.optimizers import _bf16_class

    return _bf16_class()


def profile_step(cls, out_name):
    """Host time of one step by operator (torch.profiler, self CPU time), written to OUT."""
    ps, grads = params_and_grads()
    opt = cls(ps, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=True)
    for p, g in zip(ps, grads):
        p.grad = g
    for _ in range(2):
        opt.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (OUT / out_name).write_text(table)
    print(table, flush=True)


def run(name, cls, reference=None):
    ps, grads = params_and_grads()
    opt = cls(ps, lr=1e-4, weight_decay=0.01, bf16_stochastic_round=True)
    for p, g in zip(ps, grads):
        p.grad = g
    times = []
    torch.manual_seed(123)
    for i in range(13):
        torch.cuda.synchronize()
        t = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if i == 2:
            after3 = [p.detach().clone() for p in ps]
    same = None if reference is None else all(torch.equal(a, b) for a, b in zip(after3, reference))
    close = None if reference is None else max(float((a.float() - b.float()).abs().max()) for a, b in zip(after3, reference))
    row = {"variant": name, "first_step_s": times[0], "step_ms": statistics.median(times[3:]) * 1e3,
           "tensors": len(ps), "same_weights_after_3_steps_as_shipped": same, "max_abs_diff_vs_shipped": close}
    print(row, flush=True)
    return row, after3


def main() -> None:
    from torchao.optim import AdamW8bit

    OUT.mkdir(parents=True, exist_ok=True)
    rows = []
    # --skip-shipped: the one-wrapper class is the reference (bit-identical to the shipped step,
    # bench/results/optimizer-dispatch; the shipped first step compiles for ~45 s)
    variants = [("one-wrapper", one_wrapper_class), ("plain-inputs", plain_inputs_class)]
    if "--skip-shipped" in sys.argv:
        row, ref = run("one-wrapper", one_wrapper_class())
        rows.append(row)
        variants = variants[1:]
    else:
        row, ref = run("shipped", AdamW8bit)
        rows.append(row)
    if "--grouped" in sys.argv:
        variants.append(("grouped", grouped_class))
    for name, make in variants:
        try:
            rows.append(run(name, make(), ref)[0])
        except Exception as e:  # noqa: BLE001
            rows.append({"variant": name, "error": repr(e)[:500]})
            print(rows[-1], flush=True)
    if "--profile" in sys.argv:
        profile_step(one_wrapper_class(), "profile_one_wrapper.txt")
        profile_step(plain_inputs_class(), "profile_plain_inputs.txt")
    (OUT / "optimizer_dispatch.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    print("| variant | first step s | step ms | same weights as shipped |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r.get('first_step_s', float('nan')):.1f} | {r.get('step_ms', float('nan')):.1f} | "
              f"{r.get('same_weights_after_3_steps_as_shipped', r.get('error', ''))} |")


if __name__ == "__main__":
    main()
