"""GPU idle time between training steps with a slow data pipeline, with and without prefetch.

Workload: BERT-base (random weights, 110M parameters), sequence length 128, bf16 autocast,
micro-batch 32. The data pipeline is made slow by sleeping ``delay`` ms in every collate call
(a stand-in for tokenisation or image decoding). GPU idle time between steps is measured with
CUDA events: one recorded on the compute stream when a step's work has been queued to the end,
one when the next step's first work is queued; their elapsed time is the gap in which the GPU
had nothing to do.

Run (repository root, a CUDA GPU): ``python3 bench/prefetch_idle.py OUT.json``
"""

import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
sys.path.insert(0, "tests")
from conftest import SyntheticBatches  # noqa: E402

from tightfit.plan import Plan  # noqa: E402
from tightfit.runtime.trainer import TrainConfig, Trainer  # noqa: E402
from tightfit.workload import Workload  # noqa: E402


class SlowBatches(SyntheticBatches):
    def __init__(self, delay_s, **kw):
        super().__init__(**kw)
        self.delay_s = delay_s

    def collate(self, indices, pad_to=None):
        time.sleep(self.delay_s)
        return super().collate(indices, pad_to=pad_to or self.seq_len)


class TimedTrainer(Trainer):
    """Records CUDA events at the start and end of every optimizer step."""

    def _launch(self, window, index):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        out = super()._launch(window, index)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.events.append((start, end, time.perf_counter()))
        return out


def run(delay_ms, prefetch, effective_batch, steps=40, warmup=5):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(num_labels=2))
    data = SlowBatches(delay_ms / 1000, n=effective_batch * (steps + 1), seq_len=128, vocab=30000)
    w = Workload(model, data, None, effective_batch)
    t = TimedTrainer(w, Plan("bf16", 32, effective_batch, device="cuda"),
                     TrainConfig(epochs=1, max_steps=steps, lr=1e-5, prefetch=prefetch), progress=False)
    t.events = []
    t.fit()
    torch.cuda.synchronize()
    ev = t.events[warmup:]
    gaps = [a[1].elapsed_time(b[0]) for a, b in zip(ev, ev[1:])]  # ms the GPU waited between steps
    busy = [s.elapsed_time(e) for s, e, _ in ev]
    wall = [(b[2] - a[2]) * 1000 for a, b in zip(ev, ev[1:])]
    del t, model
    torch.cuda.empty_cache()
    return {"delay_ms_per_micro_batch": delay_ms, "prefetch": prefetch, "effective_batch": effective_batch,
            "micro_batch": 32, "steps_timed": len(gaps), "gpu_idle_ms_between_steps_median": statistics.median(gaps),
            "step_span_ms_median": statistics.median(busy), "step_wall_ms_median": statistics.median(wall)}


if __name__ == "__main__":
    rows = []
    for eff in (32, 128):
        for delay in (0, 20):
            for prefetch in (False, True):
                r = run(delay, prefetch, eff)
                print(json.dumps(r), flush=True)
                rows.append(r)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python3 bench/prefetch_idle.py OUT.json", "rows": rows}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=2)
