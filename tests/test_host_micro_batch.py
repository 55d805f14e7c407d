"""On the CPU a large effective batch is split into micro-batches that fit half the host's
available memory (`tightfit train --batch-size 2000` on the CPU held 24 GB and was killed by the
kernel, with no message)."""

from types import SimpleNamespace

import torch

from conftest import tiny_bert
from tightfit.planner.host import HOST_SHARE, host_micro_batch
from tightfit.planner.probe import plan_first


def _workload(E):
    def worst(n):
        return {"input_ids": torch.ones(n, 32, dtype=torch.long), "attention_mask": torch.ones(n, 32, dtype=torch.long),
                "labels": torch.zeros(n, dtype=torch.long)}
    return SimpleNamespace(model=tiny_bert(), effective_batch=E, train=SimpleNamespace(worst_case=worst))


def test_a_batch_over_half_the_host_memory_is_split_with_accumulation(monkeypatch):
    import tightfit.levers.optimizers as lv

    w = _workload(2000)
    mb, why = host_micro_batch(w, "fp32", False, available_bytes=200 << 20)
    assert 1 <= mb < 2000 and "gradient accumulation" in why and "200.00 MiB available" in why
    more, _ = host_micro_batch(w, "fp32", False, available_bytes=400 << 20)
    assert mb < more  # twice the memory: a larger micro-batch
    assert host_micro_batch(w, "fp32", False, available_bytes=64 << 30) == (2000, None)
    monkeypatch.setattr(lv, "available_host_bytes", lambda: 200 << 20)  # what a CPU run's plan sees
    plan = plan_first(w, "cpu", None, None)
    assert (plan.micro_batch, plan.effective_batch) == (mb, 2000) and plan.accumulation_steps > 1
    assert plan.reasons[0] == why and HOST_SHARE == 0.5


def test_a_small_batch_is_not_traced_and_an_untraceable_model_keeps_the_whole_batch():
    w = _workload(16)
    w.train.worst_case = None  # not called: nothing traced up to 16 samples
    mb, why = host_micro_batch(w, "fp32", False, available_bytes=1)
    assert mb == 16 and why.endswith("(a batch of up to 16 samples; its host memory is not estimated)")  # not "it fits"

    class Opaque(torch.nn.Module):  # its forward leaves the tensors for numpy: the tracer cannot follow
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x, labels=None):
            return torch.from_numpy(self.lin(x).detach().numpy())

    w = SimpleNamespace(model=Opaque(), effective_batch=64,
                        train=SimpleNamespace(worst_case=lambda n: {"x": torch.ones(n, 4), "labels": torch.zeros(n)}))
    mb, why = host_micro_batch(w, "fp32", False, available_bytes=1)
    assert mb == 64 and "could not be estimated" in why


def test_a_loss_of_ones_own_is_not_estimated_and_says_so_in_plain_words():
    """tightfit.plan(..., loss=...) on the CPU with a tuple batch (the README's own loop): the host
    estimate is not made (the estimator traces logits with the task's loss), and the reason says
    so instead of the tracer's TypeError."""
    import tightfit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    batch = (torch.randn(4, 8), torch.randint(0, 2, (4,)))
    plan = tightfit.plan(model, batch, effective_batch=64, device="cpu",
                         loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    assert plan.micro_batch == 64
    assert plan.reasons[0].startswith("CPU: the whole effective batch in one micro-batch; its host memory is not "
                                      "estimated"), plan.reasons
    assert "Error" not in plan.reasons[0]


def test_plan_without_a_loss_of_ones_own_estimates_the_host_memory_and_splits(monkeypatch):
    """tightfit.plan() on the CPU with the model's own loss (no loss=): the host memory is estimated
    and a batch over half of it is split with accumulation (it was taken for a loss of the user's
    own, never estimated, so 200000 samples went into one micro-batch)."""
    import tightfit
    import tightfit.levers.optimizers as lv

    monkeypatch.setattr(lv, "available_host_bytes", lambda: 200 << 20)
    b = {"input_ids": torch.ones(8, 32, dtype=torch.long), "attention_mask": torch.ones(8, 32, dtype=torch.long),
         "labels": torch.zeros(8, dtype=torch.long)}
    plan = tightfit.plan(tiny_bert(), b, effective_batch=2000, device="cpu")
    assert plan.micro_batch < 2000 and plan.accumulation_steps > 1
    assert "gradient accumulation" in plan.reasons[0] and "not estimated" not in plan.reasons[0], plan.reasons
