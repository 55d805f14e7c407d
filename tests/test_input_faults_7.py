"""Faults found by reading and trying the code (session of 2026-12-02, second)."""

import pytest
import torch

from tightfit.devices import get_profile, load_profiles
from tightfit.errors import TightfitError
from tightfit.workload import Workload


class _Blockless(torch.nn.Module):
    """One linear layer: no repeated blocks, no Hugging Face checkpointing hook."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


def test_a_gpu_plan_for_a_model_with_nothing_to_checkpoint_says_nothing_fits(monkeypatch):
    """``checkpointing="auto"`` on the GPU for a model without blocks: when nothing fits without
    checkpointing, the planner says "nothing fits" (a TightfitError), not the checkpointing
    lever's raw ValueError for a model it cannot checkpoint."""
    import tightfit.planner.probe as probe

    monkeypatch.setattr(probe, "largest_micro_batch", lambda *a, **k: None)  # nothing fits
    data = [{"x": torch.randn(4), "labels": torch.tensor(0)} for _ in range(8)]
    w = Workload(_Blockless(), data, None, 4)
    profile = get_profile(next(iter(load_profiles())))
    with pytest.raises(TightfitError, match="nothing fits"):
        probe.plan_first(w, "cuda", profile, 1 << 30, precision="fp32", checkpointing="auto")
