"""GPU bench of the optimizer levers (8-bit AdamW state, AdamW state offloaded to the CPU) on
workloads whose fp32 AdamW state does not fit the budget. Run from the repository root on a
CUDA machine with bitsandbytes, torchao and peft importable:

    OUT=/some/folder python bench/optimizer_levers.py            # all three workloads
    OUT=... BENCH_WORKLOADS=bert-large-128@4GiB python bench/optimizer_levers.py
    OUT=... TF_COMPILE=auto TF_STEPS=300 BENCH_SETTINGS=tightfit,no-budget python bench/optimizer_levers.py

``TF_COMPILE``: the tightfit row's ``--compile`` (default ``off``, to keep the bench short; ``auto``
plans as ``tightfit train`` does); ``TF_STEPS``: its timed steps (default 30); ``TF_PLAN_STEPS``: the
run length, in steps, it is planned for (default ``TF_STEPS``: a longer run may repay more
compilation, e.g. one whole-model graph, while ``TF_STEPS`` of it are timed); ``BENCH_SETTINGS``:
the rows to run, in that order, of ``tightfit, bnb, torchao, offload, no-budget, compiled-no-budget``
(default: all).

Per workload (memory capped with ``torch.cuda.set_per_process_memory_fraction``), rows of
``tightfit bench``'s shape (:mod:`tightfit.bench.settings`):

- ``tightfit``: :func:`tightfit.planner.gpu.plan_on_gpu` (``--optimizer auto``, compilation off
  by default, ``TF_COMPILE``), then ``TF_STEPS`` timed steps;
- ``by hand``: bitsandbytes' AdamW8bit, torchao's AdamW8bit and torchao's CPUOffloadOptimizer, each
  as the library ships it (:data:`BY_HAND_8BIT` swaps the 8-bit one into the runtime), bf16 with
  every block checkpointed at the largest batch whose probe step fits, no accumulation (what a user
  tuning by hand runs), ``STEPS`` timed steps;
- ``no budget``: the effective batch in one bf16 micro-batch (checkpointing none and all), no cap;
  ``compiled no budget``: the same compiled, without checkpointing.

Effective batches: 128 (BERT-large), 64 (the 334M decoder classifier), 4 (the 1.3B decoder LM: with
CPU offload its gradients are freed on the GPU only without accumulation, and 4 x 512 tokens is
the most that fits 11 GiB that way by the estimator: 9.7 GiB, 8 needs 11.6 GiB).

Also measured, for the time model (:mod:`tightfit.planner.cost`): fused CPU AdamW's parameters/s,
pinned host-to-device bandwidth, bitsandbytes' 8-bit step over 200 tensors of 4,096 elements (its
per-tensor cost, ``OPTIMIZER_CALL_S``) and over one of 100M (its parameters/s), and the per-tensor
time of torchao's 8-bit step.
Writes ``optimizer_levers.json`` and ``optimizer_levers.md`` to ``$OUT`` (after every row).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tightfit.runtime.allocator import configure_allocator  # noqa: E402

configure_allocator()  # expandable segments, as tightfit's command line runs

from tightfit.bench import settings as st  # noqa: E402
from tightfit.bench.workloads import BenchWorkload, make_workload  # noqa: E402
from tightfit.devices import detect  # noqa: E402
from tightfit.levers.blocks import find_blocks  # noqa: E402
from tightfit.levers.checkpointing import set_activation_checkpointing  # noqa: E402
from tightfit.plan import Plan  # noqa: E402
from tightfit.planner.bisection import bisect  # noqa: E402
from tightfit.planner.gpu import plan_on_gpu  # noqa: E402
from tightfit.planner.probe import probe_step  # noqa: E402

OUT = Path(os.environ.get("OUT", "bench-out"))
STEPS, WARMUP = 10, 3
TF_STEPS = int(os.environ.get("TF_STEPS", "30"))
TF_PLAN_STEPS = int(os.environ.get("TF_PLAN_STEPS", str(TF_STEPS)))
TF_COMPILE = os.environ.get("TF_COMPILE", "off")


def decoder_folder(root: Path, name: str, width: int, lm: bool, vocab: int = 50257) -> str:
    """A 24-layer GPT-2-style decoder config folder (random weights: only the config is read)."""
    from transformers import GPT2Config

    path = root / name
    GPT2Config(vocab_size=vocab, n_embd=width, n_layer=24, n_head=16, n_positions=1024, num_labels=2, pad_token_id=0,
               architectures=["GPT2LMHeadModel" if lm else "GPT2ForSequenceClassification"]).save_pretrained(path)
    return str(path)


def workloads(root: Path) -> list[BenchWorkload]:
    return [BenchWorkload("bert-large-128@4GiB", "bert-large", 128, "4GiB", 128),
            BenchWorkload("decoder-334m-cls-256@6GiB", decoder_folder(root, "decoder-334m", 1024, False, vocab=30522), 256,
                          "6GiB", 64),
            BenchWorkload("decoder-1.3b-lm-512@11GiB", decoder_folder(root, "decoder-1.3b", 2048, True), 512,
                          "11GiB", 4)]


def _bnb_8bit(params, lr, weight_decay):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)


def _torchao_8bit(params, lr, weight_decay):
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=lr, weight_decay=weight_decay)


# Each library's 8-bit AdamW as it ships (without tightfit's adaptations), for the by-hand rows.
BY_HAND_8BIT = {"bitsandbytes": _bnb_8bit, "torchao": _torchao_8bit}


@contextlib.contextmanager
def eight_bit_from(library: str):
    """Build ``adamw8bit`` with ``library``'s class as it ships while the block runs (the runtime
    builds it through :func:`tightfit.levers.optimizers.adamw_8bit`)."""
    from tightfit.levers import optimizers as lv

    real = lv.adamw_8bit
    lv.adamw_8bit = BY_HAND_8BIT[library]
    try:
        yield
    finally:
        lv.adamw_8bit = real


def by_hand(w: BenchWorkload, optimizer: str, library: str = "torchao") -> dict:
    """The largest batch (no accumulation, bf16, every block checkpointed) that fits with ``optimizer``
    from ``library`` (``adamw8bit``: bitsandbytes or torchao; ``adamw-offload``: torchao)."""
    with eight_bit_from(library) if optimizer == "adamw8bit" else contextlib.nullcontext():
        return _by_hand(w, optimizer, library)


def _by_hand(w: BenchWorkload, optimizer: str, library: str) -> dict:
    st.cap_memory(w.budget_bytes)
    wl = make_workload(w, w.effective_batch, w.effective_batch)
    n = len(find_blocks(wl.model))
    set_activation_checkpointing(wl.model, True, tuple(range(n)))
    t0 = time.perf_counter()
    fits = {}

    def ok(mb: int) -> bool:
        wl.effective_batch = mb  # no accumulation: the batch is the micro-batch
        fits[mb] = probe_step(wl, mb, "bf16", w.budget_bytes, timed_steps=1, optimizer=optimizer).fits
        return fits[mb]

    mb = w.effective_batch if ok(w.effective_batch) else bisect(0, w.effective_batch, ok)
    row = {"setting": f"by hand: {library} {optimizer}", "optimizer": optimizer, "planning_seconds": time.perf_counter() - t0}
    set_activation_checkpointing(wl.model, False, ())
    if mb:
        wl.effective_batch, wl.train.n = mb, mb * STEPS
        plan = Plan("bf16", mb, mb, True, optimizer=optimizer, device="cuda")
        row.update(st.timed_run(wl, plan, STEPS, WARMUP))
    else:
        row["fits"] = False
    del wl
    st.clean()
    return row


def tightfit(w: BenchWorkload) -> dict:
    import resource

    st.cap_memory(w.budget_bytes)
    wl = make_workload(w, w.effective_batch, w.effective_batch * TF_STEPS)
    t0 = time.perf_counter()
    plan = plan_on_gpu(wl, detect(), w.budget_bytes, w.size, compile=TF_COMPILE,
                       run_samples=w.effective_batch * TF_PLAN_STEPS)
    planning = time.perf_counter() - t0
    row = {"setting": "tightfit", "optimizer": plan.optimizer, "planning_seconds": planning,
           "planned_for_steps": TF_PLAN_STEPS, "compile_scope": plan.compile_scope,
           "reasons": list(plan.reasons), "predicted_samples_per_s": plan.predicted_samples_per_s,
           **st.timed_run(wl, plan, TF_STEPS, WARMUP), "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    del wl
    st.clean()
    return row


def _step_seconds(opt, repeat: int = 5) -> float:
    opt.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeat):
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeat


def _grads(shapes) -> list:
    ps = [torch.nn.Parameter(torch.zeros(s, device="cuda")) for s in shapes]
    for q in ps:
        q.grad = torch.ones_like(q)
    return ps


def machine_rates() -> dict:
    """CPU fused AdamW parameters/s, pinned H2D bytes/s; on the GPU, bitsandbytes' 8-bit step
    seconds per tensor (200 tensors of 4,096 elements: launch and sync) and parameters/s (one
    100M tensor), and torchao's 8-bit step seconds per 1M-element tensor."""
    from tightfit.levers.optimizers import adamw_8bit

    n = 100_000_000
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    opt = torch.optim.AdamW([p], fused=True)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(3):
        opt.step()
    cpu_rate = 3 * n / (time.perf_counter() - t0)
    host = torch.empty(256 << 20, dtype=torch.float32, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    link = 5 * host.numel() * 4 / (time.perf_counter() - t0)
    rates = {"cpu_fused_adamw_params_per_s": cpu_rate, "pinned_h2d_bytes_per_s": link}
    small = _step_seconds(adamw_8bit(_grads([4096] * 200), 1e-5, 0.01))
    rates["bnb_adamw8bit_seconds_per_tensor_4096"] = small / 200
    rates["bnb_adamw8bit_params_per_s_100m"] = 100_000_000 / _step_seconds(adamw_8bit(_grads([100_000_000]), 1e-5, 0.01))
    try:
        rates["torchao_adamw8bit_seconds_per_tensor_1m"] = _step_seconds(
            _torchao_8bit(_grads([(1024, 1024)] * 200), 1e-5, 0.01)) / 200
    except Exception as e:  # noqa: BLE001 - the bitsandbytes rates matter more
        rates["torchao_adamw8bit_error"] = repr(e)[:300]
    return rates


def write(results: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "optimizer_levers.json").write_text(json.dumps(results, indent=2, default=str))
    lines = ["| workload | setting | optimizer | batch (micro x accum) | ckpt blocks | samples/s | vs no-budget best "
             "| peak reserved GiB | OOMs after planning | planning s |", "|" + "---|" * 10]
    for name, rows in results["workloads"].items():
        best = max((r.get("samples_per_s") or 0 for r in rows if r["setting"] in ("no budget", "compiled no budget")),
                   default=0)
        for r in rows:
            sps = r.get("samples_per_s")
            head = f"| {name} | {r['setting']} | {r.get('optimizer', 'adamw')} |"
            if not sps:
                lines.append(f"{head} {r.get('error', 'does not fit')[:200]} | | | | | | |")
                continue
            lines.append(f"{head} {r.get('micro_batch')} x {r.get('accumulation_steps')} | "
                         f"{r.get('checkpointed_blocks')} | {sps:.1f} | {sps / best if best else float('nan'):.2f} | "
                         f"{(r.get('peak_reserved_bytes') or 0) / 2**30:.2f} | {r.get('ooms_after_planning')} | "
                         f"{r.get('planning_seconds', 0):.1f} |")
    lines += ["", "machine rates: " + json.dumps(results.get("rates", {}))]
    (OUT / "optimizer_levers.md").write_text("\n".join(lines) + "\n")


# the rows, in the order they run
SETTINGS = ("tightfit", "bnb", "torchao", "offload", "no-budget", "compiled-no-budget")


def run_row(workload: str, setting: str, out: Path) -> None:
    """One row in this process; its rows (a list) written as JSON to ``out``."""
    w = next(w for w in workloads(Path(tempfile.mkdtemp())) if w.name == workload)
    settings = {"tightfit": lambda: [tightfit(w)], "bnb": lambda: [by_hand(w, "adamw8bit", "bitsandbytes")],
                "torchao": lambda: [by_hand(w, "adamw8bit", "torchao")],
                "offload": lambda: [by_hand(w, "adamw-offload", "torchao")],
                "no-budget": lambda: st.no_budget(w, STEPS, WARMUP, precisions=("bf16",)),
                "compiled-no-budget": lambda: [st.compiled_no_budget(w, STEPS, WARMUP)]}
    try:
        rows = settings[setting]()
    except Exception as e:  # keep going: one setting's failure is a result too
        rows = [{"setting": f"error ({setting})", "error": repr(e)[:2000]}]
    out.write_text(json.dumps(rows, default=str))


def main() -> None:
    """Every (workload, setting) row in a process of its own: a setting that leaves memory held
    (a failed plan, a library's hooks) would otherwise shrink the next one's budget."""
    import subprocess

    t_start = time.perf_counter()
    chosen = os.environ.get("BENCH_WORKLOADS")
    wanted = os.environ.get("BENCH_SETTINGS")
    unknown = set(wanted.split(",")) - set(SETTINGS) if wanted else set()
    if unknown:
        raise SystemExit(f"BENCH_SETTINGS: unknown {', '.join(sorted(unknown))} (of {', '.join(SETTINGS)})")
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "workloads": {}}
    try:
        results["rates"] = machine_rates()
    except Exception as e:  # the rows matter more than the rates
        results["rates"] = {"error": repr(e)}
    write(results)
    for w in workloads(Path(tempfile.mkdtemp())):
        if chosen and w.name not in chosen.split(","):
            continue
        rows = results["workloads"].setdefault(w.name, [])
        for name in wanted.split(",") if wanted else SETTINGS:  # in the order asked
            out = Path(tempfile.mkdtemp()) / "rows.json"
            done = subprocess.run([sys.executable, __file__, "--row", w.name, name, str(out)])
            rows += json.loads(out.read_text()) if out.exists() else [
                {"setting": f"error ({name})", "error": f"row process exited {done.returncode}"}]
            write(results)
            print(f"{w.name}: {rows[-1].get('setting')} {rows[-1].get('samples_per_s')} "
                  f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    results["wall_seconds"] = time.perf_counter() - t_start
    write(results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--row"]:
        run_row(sys.argv[2], sys.argv[3], Path(sys.argv[4]))
    else:
        main()
