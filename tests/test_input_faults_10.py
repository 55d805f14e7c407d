"""Faults a fresh user found (session 34): `tightfit estimate` judged a micro-batch without the
plan's gradient accumulation, so it said "fits" for steps the plan could not run."""

import json

import pytest

from tightfit.cli import main

ARGS = ["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "2"]


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_estimate_traces_the_accumulation_of_the_effective_batch_as_the_planner_does(capsys):
    """With accumulation every gradient is held while the next micro-batch runs: more memory than
    one micro-batch per step. The estimate must be the planner's for the same plan."""
    from tightfit.memory.estimate import estimate
    from tightfit.models import build_model
    from tightfit.plan import Plan

    assert main([*ARGS, "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main([*ARGS, "--batch-size", "8", "--json"]) == 0
    window = json.loads(capsys.readouterr().out)
    model, make_batch = build_model("minilm")
    planned = estimate(model, make_batch(1, 16), Plan("fp32", 2, 8, device="cuda"))
    assert window["peak_reserved_bytes"] == planned.peak_reserved_bytes > alone["peak_reserved_bytes"]
    assert window["plan"]["accumulation_steps"] == 4 and alone["plan"]["accumulation_steps"] == 1
    assert main([*ARGS, "--batch-size", "8"]) == 0
    assert "micro-batch 2 x 4 accumulation steps (effective batch 8)" in capsys.readouterr().out


def test_estimate_refuses_an_effective_batch_below_the_micro_batch(capsys):
    assert main([*ARGS, "--batch-size", "1"]) == 2
    assert _error(capsys) == ("tightfit: error: --batch-size 1 is below --micro-batch 2: the effective batch is "
                              "the samples of one optimizer step, one or more micro-batches")
