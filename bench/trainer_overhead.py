"""Host time the trainer adds to each training step, on a tiny model whose step is cheap.

Times, per optimizer step (median of ``--repeats`` blocks of ``--steps`` steps, same model and
windows, one micro-batch per window as the main job's 32 x 1 plan):

- ``step``: :func:`tightfit.step.training_step` alone, the window collated on the calling thread
  (what the planner's probe times, with the run's windows instead of worst-case ones);
- ``step at fixed length``: the same on windows padded to the full sequence length (the probe's
  worst-case shape), so that a cost of varying shapes (e.g. per-shape kernel plans) shows;
- ``Trainer.train_step``: the runtime's step with its guards (prefetch off, then on);
- ``Trainer loop``: :meth:`Trainer.fit`'s steady state (``step_ends``), the loop's bookkeeping too;

then the cost of each piece of per-step bookkeeping alone (microseconds per call).

    python bench/trainer_overhead.py [--device cpu|cuda] [--steps 200] [--repeats 5]

CPU: fp32; CUDA: bf16 autocast. Prints Markdown tables (bench/results/trainer-overhead/README.md
records them) and, with ``OUT`` set, writes them to ``$OUT/trainer-overhead-<cpu|cuda>.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, ".")
from tightfit.levers.precision import autocast, make_grad_scaler  # noqa: E402
from tightfit.plan import Plan  # noqa: E402
from tightfit.rng import capture_rng  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tightfit.step import in_place_versions  # noqa: E402
from tightfit.step import make_optimizer, module_mode, training_step  # noqa: E402
from tightfit.workload import Workload  # noqa: E402


class Texts:
    """``n`` random token sequences of lengths 3..``seq_len`` with binary labels, padded per batch."""

    def __init__(self, n: int, seq_len: int = 32, vocab: int = 100, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, seq_len + 1, (n,), generator=g).tolist()
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.seq_len = seq_len

    def __len__(self):
        return len(self.lengths)

    def collate(self, indices, pad_to=None):
        T = pad_to or max(self.lengths[i] for i in indices)
        ids = torch.zeros(len(indices), T, dtype=torch.long)
        mask = torch.zeros(len(indices), T, dtype=torch.long)
        for r, i in enumerate(indices):
            L = min(self.lengths[i], T)
            ids[r, :L] = self.ids[i, :L]
            mask[r, :L] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": self.labels[list(indices)]}

    def worst_case(self, n):
        return self.collate([i % len(self) for i in range(n)], pad_to=self.seq_len)


def tiny_model(layers: int, seed: int = 0):
    """A BERT classifier with MiniLM's depth and tiny widths (host-bound step), dropout on."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, num_labels=2, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_step(variants: dict, steps: int, repeats: int, device) -> dict:
    """``{name: seconds per call of fn(i)}`` for ``i < steps``: the median over ``repeats`` blocks,
    the variants' blocks interleaved (a shared machine's drift hits them all alike)."""
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            _sync(device)
            t0 = time.perf_counter()
            for i in range(steps):
                fn(i)
            _sync(device)
            times[k].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def per_call_us(fn, n: int = 2000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    precision = "bf16" if device.type == "cuda" else "fp32"
    mb, n = args.micro_batch, args.steps
    data = Texts(mb * n)
    workload = Workload(tiny_model(args.layers).to(device), data, None, mb)

    def trainer(prefetch: bool) -> Trainer:
        cfg = TrainConfig(epochs=args.repeats + 2, seed=0, lr=1e-4, prefetch=prefetch)
        return Trainer(workload, Plan(precision, mb, mb, device=args.device), cfg, progress=False)

    t = trainer(False)
    windows = [t.window_at(i) for i in range(n)]
    model = workload.model
    model.eval()  # as Hugging Face's from_pretrained returns it: the runtime sets the mode itself

    # the step alone, as the probe runs it (its own optimizer; the mode set once around all steps)
    opt = make_optimizer(model.parameters(), "adamw", device.type, lr=1e-4)
    scaler = make_grad_scaler(precision, device.type)

    def bare(pad_to=None):
        def one(i):
            batch = {k: v.to(device) for k, v in data.collate(windows[i], pad_to=pad_to).items()}
            training_step(model, iter([batch]), workload.loss_sum, workload.count(batch), opt, scaler,
                          lambda: autocast(precision, device.type), None)
        return one

    def trainer_steps(tr: Trainer):
        def one(i):
            if i + 1 < n:  # as the loop schedules the next window before the step
                tr.loader.schedule(i + 1, windows[i + 1], mb)
            tr.step = i
            tr.train_step(windows[i])
        return one

    prefetching = trainer(True)
    for tr in (t, prefetching):  # warm-up: optimizer state, kernels, allocator
        trainer_steps(tr)(0)
    bare()(0)

    model.train()  # as fit() leaves it between steps
    rows = per_step({"step": bare(), "step at fixed length": bare(data.seq_len),
                     "Trainer.train_step, prefetch off": trainer_steps(t),
                     "Trainer.train_step, prefetch on": trainer_steps(prefetching)}, n, args.repeats, device)
    prefetching.loader.close()
    model.eval()
    rows.update(per_step({"Trainer.train_step, prefetch off, model left in eval mode": trainer_steps(t)},
                         n, 1, device))
    for prefetch in (False, True):
        tr = trainer(prefetch)
        tr.total_steps = n * args.repeats
        tr.fit()
        ends = [e for e, _ in tr.result.step_ends]
        ends = ends[10:] if len(ends) > 12 else ends  # steady state: after the first 10 steps
        gaps = [b - a for a, b in zip(ends, ends[1:])]
        rows[f"Trainer loop (fit), prefetch {'on' if prefetch else 'off'}"] = statistics.median(gaps)

    base = rows["step"]
    lines = []
    emit = lines.append  # collected, then printed and written to $OUT
    emit(f"device {device}, torch {torch.__version__}, {args.layers} layers, micro-batch {mb}, "
          f"{n} steps x {args.repeats} blocks (median)\n")
    emit("| per optimizer step | host ms | over the step, ms |\n|---|---|---|")
    for k, v in rows.items():
        emit(f"| {k} | {1e3 * v:.3f} | {1e3 * (v - base):+.3f} |")

    # ---- the pieces alone (microseconds per call)
    model.train()
    modules = list(model.modules())
    pieces = {
        "capture_rng()": capture_rng,
        "walk model.modules() (module_mode's check)": lambda: [m for m in model.modules() if not m.training],
        "check of the listed modules (train_step's check)": lambda: all(m.training for m in modules),
        "in_place_versions (non-fused optimizers only)": lambda: in_place_versions(t.optimizer),
        "set(optimizer.state)": lambda: set(t.optimizer.state),
    }

    def scheduler_step():
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of")
            t.scheduler.step()
    pieces["scheduler.step() inside warnings.catch_warnings"] = scheduler_step
    pieces["scheduler.step() alone"] = t.scheduler.step
    pieces["_train_record (logged steps only)"] = lambda: t._train_record(0, 0.1, True, 1.0, windows[0])
    if device.type == "cuda":
        pieces["_record_memory()"] = t._record_memory
        pieces["torch.cuda.max_memory_allocated"] = lambda: torch.cuda.max_memory_allocated(device)
        pieces["torch.cuda.memory_stats_as_nested_dict"] = lambda: torch.cuda.memory_stats_as_nested_dict(device)
        pieces["torch.cuda.get_rng_state_all"] = torch.cuda.get_rng_state_all
        pieces["torch.cuda.reset_peak_memory_stats"] = lambda: torch.cuda.reset_peak_memory_stats(device)
    t.memory_timeline.append((0, 0, 0))
    if device.type == "cuda":
        t._record_memory()
    t._grad_norm = 1.0
    emit("\n| bookkeeping piece | us per call |\n|---|---|")
    for k, fn in pieces.items():
        emit(f"| {k} | {per_call_us(fn):.1f} |")
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if os.environ.get("OUT"):  # a GPU run's result comes back from $OUT
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], f"trainer-overhead-{device.type}.md"), "w") as f:
            f.write(text)
    if not math.isfinite(base):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
