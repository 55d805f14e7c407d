"""Where a tightfit training step's time goes on a fast GPU: tightfit's Trainer against a bare
PyTorch loop (autocast forward, backward, clip, fused AdamW) on the same BERT-base workload.

Run (repository root, a CUDA GPU): ``python3 bench/step_overhead.py OUT.json``
"""

import json
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from conftest import SyntheticBatches  # noqa: E402

from tightfit.levers.checkpointing import set_activation_checkpointing  # noqa: E402
from tightfit.levers.precision import autocast  # noqa: E402
from tightfit.plan import Plan  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tightfit.workload import Workload  # noqa: E402

SEQ, STEPS, WARMUP = 128, 12, 3


class Full(SyntheticBatches):
    def collate(self, indices, pad_to=None):
        return super().collate(indices, pad_to=self.seq_len)


def model():
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(num_labels=2)).cuda()


def trainer_ms(mb, eff, blocks, health=True):
    w = Workload(model(), Full(n=eff * STEPS, seq_len=SEQ, vocab=30000), None, eff)
    plan = Plan("bf16", mb, eff, True, device="cuda", checkpoint_blocks=blocks)
    t = Trainer(w, plan, TrainConfig(epochs=1, max_steps=STEPS, lr=1e-5, checkpoint_dir=None), progress=False)
    if not health:
        t.health = None
    stamps = []
    orig = t.train_step

    def timed(window):
        out = orig(window)
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return out
    t.train_step = timed
    t.fit()
    return 1000 * (stamps[-1] - stamps[WARMUP]) / (len(stamps) - 1 - WARMUP)


def bare_ms(mb, eff, hf_ckpt):
    m = model()
    set_activation_checkpointing(m, True, None if hf_ckpt else tuple(range(12)))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)
    data = Full(n=eff, seq_len=SEQ, vocab=30000)
    batches = [{k: v.cuda() for k, v in data.collate(list(range(i, i + mb))).items()} for i in range(0, eff, mb)]
    stamps = []
    for _ in range(STEPS):
        for b in batches:
            with autocast("bf16", "cuda"):
                loss = m(**b).loss / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        stamps.append(time.perf_counter())
    return 1000 * (stamps[-1] - stamps[WARMUP]) / (len(stamps) - 1 - WARMUP)


def main(out):
    rows = []
    for mb, eff in ((128, 256), (256, 256)):
        rows.append(dict(kind="bare, HF gradient checkpointing", mb=mb, eff=eff, ms=bare_ms(mb, eff, True)))
        rows.append(dict(kind="bare, tightfit block checkpointing", mb=mb, eff=eff, ms=bare_ms(mb, eff, False)))
        rows.append(dict(kind="tightfit Trainer", mb=mb, eff=eff, ms=trainer_ms(mb, eff, tuple(range(12)))))
        rows.append(dict(kind="tightfit Trainer, no NVML", mb=mb, eff=eff,
                         ms=trainer_ms(mb, eff, tuple(range(12)), health=False)))
        for r in rows[-4:]:
            print(json.dumps(r), flush=True)
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
