"""``tightfit plan``'s optimizer line reads as a sentence: "optimizer: adamw (fused, fp32 state):
the plan fits ...", not "optimizer: adamw: (fused, fp32 state): ..."."""

from tightfit.cli import main


def test_the_optimizer_line_of_fp32_adamw_that_stands(capsys):
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("optimizer:"))
    assert line.startswith("optimizer: adamw (fused, fp32 state): the plan fits without accumulation"), line
