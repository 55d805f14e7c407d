"""An out-of-memory error injected on one rank mid-run, on 2 GPUs (run under torchrun).

Trains BERT-base (random weights, seq 128, synthetic token ids, dropout on) twice with DDP:
``inject``: micro-batch M, and at step K rank 1's forward raises ``torch.OutOfMemoryError`` once;
``switch``: the same run without the error, its micro-batch set to M/2 from step K on (what the
recovery must amount to). Rank 0 writes both runs' losses, the recoveries and the largest
difference of the final weights to ``$OUT/oom.json``.

Usage: torchrun --nproc-per-node 2 bench/multi_gpu_oom.py  (NCCL_NVLS_ENABLE=0 etc. set by the caller)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())

from tightfit.plan import Plan  # noqa: E402
from tightfit.runtime.distributed import World  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tightfit.workload import Workload  # noqa: E402

STEPS, K, M, E, SEQ = 12, 5, 16, 64, 128
SMOKE = os.environ.get("SMOKE") == "1"  # a tiny BERT on the CPU (gloo): checks this script without a GPU
DEVICE = "cpu" if SMOKE else "cuda"


class Tokens:
    """Synthetic classification samples: random token ids, lengths 32..128, random labels."""

    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1000, 30000, (n, SEQ), generator=g)
        self.lengths = torch.randint(32, SEQ + 1, (n,), generator=g).tolist()
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def collate(self, idx, pad_to=None):
        T = pad_to or max(self.lengths[i] for i in idx)
        mask = torch.zeros(len(idx), T, dtype=torch.long)
        for r, i in enumerate(idx):
            mask[r, :self.lengths[i]] = 1
        return {"input_ids": self.ids[list(idx), :T] * mask, "attention_mask": mask, "labels": self.labels[list(idx)]}

    def worst_case(self, n):
        return self.collate([i % len(self) for i in range(n)], pad_to=SEQ)


def run(world, mode):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig(num_hidden_layers=8, hidden_size=32, num_attention_heads=2, intermediate_size=64) if SMOKE
        else BertConfig())
    w = Workload(model, Tokens(STEPS * E), None, E)
    plan = Plan("fp32" if SMOKE else "bf16", M, E, device=DEVICE, world_size=world.size, sharding="ddp")
    t = Trainer(w, plan, TrainConfig(max_steps=STEPS, lr=1e-4, seed=1, log_every=1, grow_back_after=0),
                progress=False, world=world)
    records = []
    t.log = records.append
    if mode == "inject" and world.rank == 1:
        fired = []

        def hook(*a):
            if not fired and t.step == K:
                fired.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected on rank 1)")
        world.unwrap(t.model).bert.encoder.layer[6].register_forward_pre_hook(hook)
    if mode == "switch":
        launch = t._launch

        def switched(window, index):
            if index == K:
                t.micro_batch = M // 2
            return launch(window, index)
        t._launch = switched
    res = t.fit()
    weights = torch.cat([p.detach().float().flatten() for p in world.unwrap(t.model).parameters()])
    return {"losses": [r["loss"] for r in records if r["type"] == "train"], "oom_recoveries": res.oom_recoveries,
            "micro_batch": t.micro_batch, "events": [r["message"] for r in records if r["type"] == "event"]}, weights


def main():
    world = World.from_env(DEVICE)
    a, wa = run(world, "inject")
    b, wb = run(world, "switch")
    recoveries = world.gather(a["oom_recoveries"])
    if world.is_main:
        diff = (wa - wb).abs().max().item()
        out = {"steps": STEPS, "oom_at_step": K + 1, "micro_batch": [M, M // 2], "effective_batch": E,
               "recoveries_per_rank": recoveries, "inject": a, "switch": b,
               "max_abs_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
               "max_abs_weight_diff": diff}
        os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
        with open(os.path.join(os.environ.get("OUT", "."), "oom.json"), "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps({k: v for k, v in out.items() if k not in ("inject", "switch")}))
    world.close()


if __name__ == "__main__":
    main()
