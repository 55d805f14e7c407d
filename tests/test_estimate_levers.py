"""``tightfit estimate`` with the optimizer levers: its help names them, the gradients it reports
are in the weights' dtype (bf16 under ``adamw8bit-bf16``), and a precision or card that bf16
weights cannot train with is refused in one line whose advice the command accepts; a plan's
per-block choices (--block-policies) are estimated as the plan predicted them."""

import pytest

from tightfit.cli import main

ARGS = ["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "2"]


def test_the_help_names_every_optimizer_the_command_accepts(capsys):
    from tightfit.step import OPTIMIZERS

    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for kind in OPTIMIZERS:
        assert kind in text, kind


def test_bf16_weights_report_their_gradients_in_bf16(capsys):
    """MiniLM at micro-batch 2 holds every gradient at the peak: in bf16 (2 B per weight) that is
    all of them, so no note says that only some are held (it said so, comparing them with the
    fp32 gradients' bytes)."""
    import json

    from tightfit.levers.optimizers import trainable_gradient_bytes
    from tightfit.models import build_model
    model = build_model("minilm")[0]
    fp32 = trainable_gradient_bytes(model)
    assert trainable_gradient_bytes(model, "adamw8bit-bf16") == fp32 // 2
    assert main([*ARGS, "--precision", "bf16", "--optimizer", "adamw8bit-bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["breakdown"]["gradients"] >= fp32 // 2 and d["notes"] == [], d["notes"]


@pytest.mark.parametrize("extra, says", [
    ([], "not --precision fp32: use --precision bf16"),  # estimate's default precision is fp32; it has no "auto"
    (["--precision", "bf16", "--gpu", "gtx-1650-ti"], "use --optimizer adamw8bit or adamw-offload"),
])
def test_bf16_weights_refused_with_advice_the_command_accepts(capsys, extra, says):
    assert main([*ARGS, "--optimizer", "adamw8bit-bf16", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "adamw8bit-bf16" in err and says in err and "or auto" not in err, err


def test_a_plans_per_block_policies_are_estimated_as_the_plan_predicted_them(capsys):
    """A plan of per-block choices ("blocks 0-0 full, 1-5 selective") could not be checked with
    `tightfit estimate`, whose --checkpointing names recomputed blocks only: --block-policies takes
    them as `tightfit plan` prints them, or one word per block as its --json lists them, and the
    estimate plus the estimator's margin is the plan's predicted peak."""
    import json

    from tightfit.planner.margins import estimator_margin_bytes

    policies = ["full"] + ["selective"] * 5
    BIG = ["estimate", "--model", "minilm", "--seq-len", "128", "--micro-batch", "32"]  # activations to tell apart
    assert main([*BIG, "--budget", "1GiB", "--block-policies", "0 full, 1-5 selective", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert main([*BIG, "--budget", "1GiB", "--block-policies", ",".join(policies), "--json"]) == 0
    words = json.loads(capsys.readouterr().out)
    assert main([*BIG, "--budget", "1GiB", "--block-policies", "blocks 0 full, 1-5 selective", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)  # the plan's line as printed, "blocks" and all
    assert main([*BIG, "--budget", "1GiB", "--block-policies", " ".join(policies), "--json"]) == 0
    spaced = json.loads(capsys.readouterr().out)  # the words apart by spaces (a fresh user's first try)
    assert main([*BIG, "--budget", "1GiB", "--block-policies", json.dumps(policies), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)  # the --json list pasted as it is
    assert runs == words == line == spaced == listed and runs["plan"]["block_policies"] == policies
    assert main([*BIG, "--budget", "1GiB", "--checkpointing", "0,1,2,3,4,5", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert runs["peak_reserved_bytes"] != full["peak_reserved_bytes"]  # selective keeps more than full
    assert runs["estimator_margin_bytes"] == estimator_margin_bytes(runs["peak_reserved_bytes"], True) > 0


@pytest.mark.parametrize("spec, says", [
    ("full,none", "2 block policies for a model with 6 blocks"),
    ("0-4 full", "block 5 has none"),
    ("0-5 full, 5 none", "block 5 is given twice"),
    ("0-6 full", "are not among the model's 6"),
    ("0-5 fast", "unknown block policy 'fast'"),
    ("all", "unknown policy 'all'"),
    ("full full fulll none none none", "unknown policy 'fulll'"),
    ("full, 1-5 selective", "'full' is a policy without its blocks"),
    ("5-3 full", "runs backwards; write 3-5"),
])
def test_bad_block_policies_are_refused_in_one_line(capsys, spec, says):
    assert main([*ARGS, "--block-policies", spec]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and says in err, err


def test_block_policies_and_checkpointing_are_not_given_together(capsys):
    assert main([*ARGS, "--block-policies", "0-5 full", "--checkpointing", "all"]) == 2
    assert "not both" in capsys.readouterr().err


def test_estimate_without_model_and_micro_batch_traces_the_main_jobs_step(capsys):
    """`tightfit plan --gpu X` plans the main job with no model and batch given; estimate refused
    the same ("the following arguments are required: --model, --micro-batch"): it now traces the
    main job's model at its effective batch, as the plan of it predicts."""
    import json

    assert main(["estimate", "--gpu", "gtx-1650-ti", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["micro_batch"] == 32 and d["plan"]["effective_batch"] == 32
    assert main(["plan", "--gpu", "gtx-1650-ti", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    planned = planned.get("plan", planned)
    assert planned["micro_batch"] == 32 and planned["precision"] == d["plan"]["precision"] == "fp32"
    assert planned["predicted_peak_reserved_bytes"] == d["peak_reserved_bytes"]  # nothing checkpointed: no margin


def test_estimate_with_a_batch_size_below_32_and_no_micro_batch_takes_it_whole(capsys):
    """The default micro-batch (32, the main job's) refused --batch-size 16 given alone: "--batch-size
    16 is below --micro-batch 32", a flag the user never gave. Without --micro-batch the step is the
    whole effective batch, as tightfit plan plans one that fits."""
    import json

    assert main(["estimate", "--seq-len", "16", "--batch-size", "16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["micro_batch"] == 16 and d["plan"]["effective_batch"] == 16
