"""Per-block choices are shown as runs of blocks ("0-22 full, 23 selective"), not one word per
block: BERT-large's 24 blocks made the plan line a list of 24 words."""

from tightfit.levers.blocks import describe_policies
from tightfit.plan import Plan
from tightfit.report.summary import plan_lines


def test_runs_of_blocks_name_their_first_and_last_index():
    assert describe_policies(("full",) * 23 + ("selective",)) == "0-22 full, 23 selective"
    assert describe_policies(("none", "offload", "offload", "none")) == "0 none, 1-2 offload, 3 none"
    assert describe_policies(("full",)) == "0 full"


def test_the_run_summary_shows_runs_of_blocks():
    plan = Plan("bf16", 16, 256, device="cuda", activation_checkpointing=True,
                block_policies=("full",) * 23 + ("selective",))
    line = next(x for x in plan_lines(plan) if x.startswith("checkpointing"))
    assert line.endswith("per block: 0-22 full, 23 selective"), line
