"""Would CUDA graphs pay for tightfit's host-bound eager steps? (issue 12: "CUDA graphs where
shapes are static and they pay"; issue 17: small micro-batches bound by their launches.)

A feasibility measurement, not a lever: the same micro-batch step in three forms, each in its own
process, with dropout on and bf16 autocast:

- ``eager``: forward and loss under autocast, ``backward``, ``clip_grad_norm_`` (foreach), fused
  AdamW, ``zero_grad(set_to_none=True)`` -- the shape of ``tightfit.step``'s step;
- ``graphed``: forward and backward replayed by ``torch.cuda.make_graphed_callables`` (one graph
  each, autocast's cast cache off as it asks), clipping and fused AdamW eager;
- ``whole``: forward, backward, clipping and fused AdamW (``capturable=True``) captured as one
  ``torch.cuda.graph`` and replayed (the ceiling: nothing left on the host but the batch copy).

Each form first runs ``EQUAL_STEPS`` steps from the same seed and weights (weights, optimizer
state and the CUDA generator restored after any warm-up or capture) and records the losses and
the final weights' checksum, so that the forms' numerics and dropout streams can be compared;
then times ``TIMED_STEPS`` steps (wall clock, one sync at the end). Peak reserved memory is read
at the end (a graph's private pool counts in it).

Usage (repository root, CUDA machine)::

    python3 bench/cuda_graphs.py OUT [WORKLOAD ...]

WORKLOAD is ``model:micro_batch:seq`` (default: ``minilm:32:64``, the main job's step, and
``bert-base:43:128``, a 4 GiB accumulation micro-batch of BERT-base). Writes
``OUT/cuda-graphs.json`` and ``.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FORMS = ("eager", "graphed", "whole")
EQUAL_STEPS = 6
WARM_STEPS = 5
TIMED_STEPS = 40
SEED = 0


def _one(name: str, mb: int, seq: int, form: str) -> dict:
    import torch
    import torch.nn.functional as F

    from tightfit.masks import with_prepared_mask
    from tightfit.models import build_model

    torch.manual_seed(SEED)
    model, make_batch = build_model(name, device="cuda")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = make_batch(mb, seq, device="cuda")
    batch["attention_mask"][: mb // 2, seq // 2:] = 0  # padding in half the samples, as real text has
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True, capturable=form == "whole")

    def loss_of(ids, mask, labels, cache=True):
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=cache):
            inputs = with_prepared_mask(model, {"input_ids": ids, "attention_mask": mask})
            logits = model(**inputs).logits
        return F.cross_entropy(logits.float(), labels)

    weights0 = [p.detach().clone() for p in params]

    def restore():  # same weights, fresh optimizer state, same generator: the forms start alike
        with torch.no_grad():
            for p, w in zip(params, weights0):
                p.copy_(w)
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    v.zero_()
        torch.manual_seed(SEED + 1)

    if form == "eager":
        def step():
            loss = loss_of(ids, mask, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()
    elif form == "graphed":
        class LossModule(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, ids, mask, labels):
                return loss_of(ids, mask, labels, cache=False)

        graphed = torch.cuda.make_graphed_callables(LossModule(), (ids, mask, labels))

        def step():
            loss = graphed(ids, mask, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach().clone()  # the graph's static output: the next replay overwrites it
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph's docs ask
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                loss_of(ids, mask, labels, cache=False).backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        opt.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = loss_of(ids, mask, labels, cache=False)
            static_loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            opt.step()

        def step():
            graph.replay()  # the grads are overwritten by the replayed backward (captured from None)
            return static_loss.detach().clone()

    restore()
    losses = [step() for _ in range(EQUAL_STEPS)]
    torch.cuda.synchronize()
    checksum = float(sum(p.detach().double().sum() for p in params))
    for _ in range(WARM_STEPS):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"model": name, "micro_batch": mb, "seq": seq, "form": form,
            "losses": [float(x) for x in losses], "weights_checksum": checksum,
            "step_ms": 1e3 * seconds / TIMED_STEPS, "samples_per_s": mb * TIMED_STEPS / seconds,
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def main(out: str, workloads: list[str]) -> None:
    Path(out).mkdir(parents=True, exist_ok=True)
    rows = []
    for w in workloads:
        name, mb, seq = w.split(":")
        for form in FORMS:
            r = subprocess.run([sys.executable, __file__, "--one", name, mb, seq, form], capture_output=True,
                               text=True, timeout=300)
            line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            row = json.loads(line[-1]) if r.returncode == 0 and line else \
                {"model": name, "micro_batch": int(mb), "seq": int(seq), "form": form,
                 "error": (r.stderr.strip().splitlines() or ["?"])[-1][:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (Path(out) / "cuda-graphs.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| model | micro-batch x seq | form | step ms | samples/s | vs eager | peak reserved MiB | "
             "losses equal to eager | weights checksum |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['micro_batch']} x {r['seq']} | {r['form']} | error: {r['error']} |")
            continue
        eager = next((e for e in rows if e["model"] == r["model"] and e["micro_batch"] == r["micro_batch"]
                      and e["form"] == "eager" and "error" not in e), None)
        same = "-" if eager is None else str(r["losses"] == eager["losses"])
        ratio = "-" if eager is None else f"{r['samples_per_s'] / eager['samples_per_s']:.2f}"
        lines.append(f"| {r['model']} | {r['micro_batch']} x {r['seq']} | {r['form']} | {r['step_ms']:.2f} | "
                     f"{r['samples_per_s']:,.0f} | {ratio} | {r['peak_reserved_bytes'] / 2**20:,.0f} | {same} | "
                     f"{r['weights_checksum']:.6f} |")
    (Path(out) / "cuda-graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1] == "--one":
        print(json.dumps(_one(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
    else:
        main(sys.argv[1], sys.argv[2:] or ["minilm:32:64", "bert-base:43:128"])
