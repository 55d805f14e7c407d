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


def test_a_budget_on_the_cpu_is_checked_on_several_ranks_as_on_one():
    """`tightfit train --gpus 2 --device cpu --budget 1MiB` trained, while one process refuses the
    same budget for the model state: the ranks' plan now checks it as a GPU's would be."""
    r = replace_budget(recipe("auto", "auto"), 64)  # bytes: below even the sharded state
    with pytest.raises(TightfitError, match="per rank even sharded over 2 ranks, more than the 64 B budget"):
        plan_for_ranks(r, single("adamw"))
    assert plan_for_ranks(replace_budget(recipe("auto", "auto"), 1 << 30), single("adamw")).sharding == "ddp"


def replace_budget(r, budget):
    r.budget = budget
    return r
