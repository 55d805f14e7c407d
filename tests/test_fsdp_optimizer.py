"""An optimizer lever asked for under FSDP2 is refused in one line, not silently replaced by fp32
AdamW (the FSDP2 plan shards fp32 AdamW state only); DDP keeps it."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.planner.sharding import plan_for_ranks


@dataclass(frozen=True)
class Workload:
    effective_batch: int


def recipe(sharding, optimizer):
    planning = SimpleNamespace(sharding=sharding, optimizer=optimizer, precision="auto", checkpointing="auto")
    return SimpleNamespace(world=SimpleNamespace(size=2), req=SimpleNamespace(planning=planning), device="cpu",
                           model=torch.nn.Linear(8, 2), budget=None, resume_from=None,
                           workload=Workload(16))


def single(optimizer):
    return lambda: Plan("fp32", 8, 8, device="cpu", optimizer=optimizer)


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw-offload"])
def test_fsdp_refuses_an_optimizer_lever(optimizer):
    with pytest.raises(TightfitError, match=f"--optimizer {optimizer} is not available under FSDP2.*--sharding ddp"):
        plan_for_ranks(recipe("fsdp", optimizer), single(optimizer))


@pytest.mark.parametrize("optimizer", ["auto", "adamw"])
def test_fsdp_plans_fp32_adamw(optimizer):
    plan = plan_for_ranks(recipe("fsdp", optimizer), single("adamw"))
    assert plan.sharding == "fsdp" and plan.optimizer == "adamw"


def test_ddp_keeps_the_8bit_optimizer():
    plan = plan_for_ranks(recipe("ddp", "adamw8bit"), single("adamw8bit"))
    assert plan.sharding == "ddp" and plan.optimizer == "adamw8bit"
