"""``tightfit plan``'s optimizer line reads as a sentence: "optimizer: adamw (fused, fp32 state):
the plan fits ...", not "optimizer: adamw: (fused, fp32 state): ..."."""

import json

from tightfit.cli import main


def test_the_optimizer_line_of_fp32_adamw_that_stands(capsys):
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("optimizer:"))
    assert line.startswith("optimizer: adamw (fused, fp32 state): the plan fits without accumulation"), line


def test_the_optimizer_line_and_the_breakdown_show_one_optimizer_state(capsys):
    """The optimizer line priced the state from the parameter count (173.29 MiB) while the
    breakdown showed the traced state, with its step tensors and block rounding (173.35 MiB)."""
    import re

    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    line = re.search(r"optimizer state on the GPU ([\d.]+ \w+)", out)
    row = re.search(r"^  optimizer_state +([\d.]+ \w+)", out, re.M)
    assert line and row and line.group(1) == row.group(1), out


def test_a_checkpointed_plan_shows_the_estimators_margin_on_its_own_line(capsys):
    """The margin was folded into allocator_overhead, so `tightfit estimate` of the same step
    showed a smaller overhead with no word why."""
    import json

    argv = ["plan", "--model", "minilm", "--seq-len", "128", "--batch-size", "256", "--budget", "1GiB",
            "--checkpointing", "on", "--optimizer", "adamw"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith("estimator_margin"))
    assert "kept free for the estimator's error" in line, line
    assert main(argv + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["breakdown"]["estimator_margin"] > 0
    assert sum(d["breakdown"].values()) == d["predicted_peak_bytes"]


def test_plan_warns_of_fp16_on_a_card_without_tensor_cores(capsys):
    """`tightfit train` noted it; `tightfit plan` said nothing while predicting 1/60 of fp32's speed."""
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "gtx-1080-ti",
                 "--precision", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "runs fp16 at 1/64 of its fp32 rate" in out
    # with the prefix every note has, on the command line as in `tightfit train`
    assert out.splitlines()[0].startswith("note: NVIDIA GeForce GTX 1080 Ti runs fp16 at 1/64"), out
    # `tightfit estimate` of the same step notes it too (it said nothing)
    assert main(["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "4", "--gpu", "gtx-1080-ti",
                 "--precision", "fp16"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("note: NVIDIA GeForce GTX 1080 Ti runs fp16 at 1/64"), out
    assert main(["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "4", "--gpu", "gtx-1080-ti",
                 "--precision", "fp16", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["peak_reserved_bytes"] > 0 and "runs fp16 at 1/64" in captured.err


def test_the_text_says_how_many_runners_up_it_leaves_to_the_json(capsys):
    """The text showed 8 runners-up and stopped; --json had 63."""
    import json

    from tightfit.cli import main

    args = ["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "256", "--gpu", "gtx-1650-ti"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    listed = len(json.loads(capsys.readouterr().out)["runners_up"])
    assert listed > 8 and f"... {listed - 8} more (--json lists them all)" in text, listed


def test_low_speeds_keep_three_significant_digits():
    """A 1.3B model's runner-ups at 1.77 and 1.78 samples/s read apart, not both "2"."""
    from tightfit.units import format_rate

    assert [format_rate(x) for x in (1.774, 1.776, 19.44, 99.94, 100.4, 2153.2)] == \
        ["1.77", "1.78", "19.4", "99.9", "100", "2153"]


def test_the_run_s_plan_lines_keep_three_significant_digits_of_a_low_speed():
    """`tightfit train`'s plan (and report.md) showed a predicted 0.42 samples/s as "0 samples/s"
    and 1.77 as "2": `tightfit plan` kept three digits, the run's own plan lines rounded to whole ones."""
    from dataclasses import replace

    from tightfit.plan import Plan
    from tightfit.report.summary import plan_lines

    plan = Plan("bf16", 1, 8, device="cuda", predicted_samples_per_s=0.42, predicted_peak_reserved_bytes=10 * 2**30)
    assert "predicted        0.42 samples/s, peak 10.00 GiB reserved" in plan_lines(plan)
    assert any(line.startswith("measured         1.77 samples/s, compiled")
               for line in plan_lines(replace(plan, compile=True, predicted_samples_per_s=1.774)))
    assert "predicted        2153 samples/s, peak 10.00 GiB reserved" in plan_lines(
        replace(plan, predicted_samples_per_s=2153.2))


def test_the_plan_says_whether_the_run_would_replay_cuda_graphs(capsys):
    """A plain plan of one micro-batch per step: the run captures its steps, and its peak adds
    the graphs' memory (which the prediction leaves out); an fp16 plan: not used, and why."""
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CUDA graphs:"))
    assert "captures these steps and replays them" in line and "the prediction above leaves out" in line
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB",
                 "--precision", "fp16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CUDA graphs:"))
    assert line == "CUDA graphs: not used: fp16's loss scaler keeps per-step state on the host"
    # --json says the same for scripts: graphs_off null where the run would capture the steps
    args = ["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB", "--json"]
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["graphs_off"] is None
    assert main(args + ["--precision", "fp16"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs_off"] == "fp16's loss scaler keeps per-step state on the host"


def test_a_parameter_offload_plan_says_it_replays_no_cuda_graphs(capsys):
    args = ["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "32", "--budget", "600MiB"]
    assert main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CUDA graphs:"))
    assert line == "CUDA graphs: not used: parameter offload (FSDP2) brings the parameters from host memory at every step"
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["graphs_off"].startswith("parameter offload (FSDP2)")
