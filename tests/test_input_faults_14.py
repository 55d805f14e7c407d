"""Faults a reviewer found (session 38): huge batch sizes, estimates of blocks that do not exist,
a budget above a card's usable memory, and rounded sizes that contradict their message."""

import pytest
import torch

from conftest import tiny_bert, tiny_text_model_folder
from tightfit.cli import main
from tightfit.errors import TightfitError


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return str(tiny_text_model_folder(tmp_path_factory.mktemp("tiny"), ["good", "bad", "film"], hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                      max_position_embeddings=64))


def _error(capsys, argv) -> str:
    """The one error line of ``tightfit argv``, which must exit with 2."""
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("tightfit: error:")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.parametrize("argv", [
    ["plan", "--seq-len", "32", "--batch-size", str(10**30), "--budget", "4GiB"],
    ["estimate", "--seq-len", "32", "--micro-batch", str(10**19)],
    ["estimate", "--seq-len", "32", "--micro-batch", str(10**400)],
    ["estimate", "--seq-len", "32", "--micro-batch", str(10**15)],
    ["estimate", "--seq-len", "32", "--micro-batch", "1", "--batch-size", str(10**19)],
])
def test_a_huge_batch_is_refused_in_one_line(capsys, tiny_folder, argv):
    """--batch-size 10**30 died in a TypeError deep in the search, --micro-batch 10**400 in an
    OverflowError, 10**15 blamed the sequence length."""
    flag = "--micro-batch" if "--micro-batch" in argv and int(argv[argv.index("--micro-batch") + 1]) > 1 \
        else "--batch-size"
    line = _error(capsys, [argv[0], "--model", tiny_folder, *argv[1:]])
    assert f"{flag} must be at most 2147483647" in line


def test_a_huge_batch_is_refused_by_the_python_api():
    import tightfit
    from tightfit.api import TrainRequest
    from tightfit.plan import Plan

    b = {"input_ids": torch.ones(4, 8, dtype=torch.long), "labels": torch.zeros(4, dtype=torch.long)}
    with pytest.raises(TightfitError, match="effective_batch must be at most 2147483647"):
        tightfit.plan(tiny_bert(), b, effective_batch=10**30, device="cpu")
    with pytest.raises(TightfitError, match="batch_size must be at most 2147483647"):
        TrainRequest(batch_size=10**400)
    with pytest.raises(TightfitError, match="at most 2147483647"):
        Plan("fp32", 10**16, 10**16)
    assert Plan("fp32", 2**31 - 1, 2**31 - 1).micro_batch == 2**31 - 1  # the bound itself is taken


def test_a_budget_above_the_cards_usable_memory_is_lowered_alike_by_plan_and_train(capsys, tiny_folder,
                                                                                   monkeypatch):
    """`tightfit plan --gpu gtx-1650-ti --budget 4GiB` planned for the 3.34 GiB usable on the card
    while `tightfit train` and tightfit.plan() (resolve_device) planned for 4 GiB."""
    from types import SimpleNamespace

    import tightfit.api as api
    from tightfit.config import PlanOptions
    from tightfit.devices import get_profile

    usable = get_profile("gtx-1650-ti").budget_bytes()
    assert main(["plan", "--model", tiny_folder, "--seq-len", "32", "--batch-size", "8", "--gpu", "gtx-1650-ti",
                 "--budget", "4GiB", "--json"]) == 0
    out = capsys.readouterr()
    import json
    assert json.loads(out.out)["budget_bytes"] == usable and "usable on the" in out.err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a large local card
    monkeypatch.setattr(api, "detect", lambda: SimpleNamespace(name="NVIDIA H200", total_bytes=140 << 30))
    device, _, budget, notes = api.resolve_device(PlanOptions(gpu="gtx-1650-ti", budget="4GiB"))
    assert (device, budget) == ("cuda", usable)
    assert notes == [f"budget 4.00 GiB is more than the 3.34 GiB usable on the NVIDIA GeForce GTX 1650 Ti; "
                     f"planning for 3.34 GiB"]
    assert api.resolve_device(PlanOptions(gpu="gtx-1650-ti", budget="3GiB"))[2] == 3 << 30  # within: as given
    with pytest.raises(TightfitError, match="more than the 4.00 GiB of the NVIDIA GeForce GTX 1650 Ti"):
        api.resolve_device(PlanOptions(gpu="gtx-1650-ti", budget="5GiB"))


@pytest.mark.parametrize("blocks, message", [((5,), r"block indices \[5\] out of range: the model has 2 blocks"),
                                             ((-1,), r"block indices \[-1\] out of range"),
                                             ((0, 7), r"block indices \[7\] out of range"),
                                             ((1.5,), "must be whole numbers"),
                                             (3, "must be a collection of whole numbers")])
def test_the_estimate_refuses_block_indices_the_model_does_not_have(blocks, message):
    """checkpoint_blocks=(5,) of a 2-block model traced no checkpointing, (0, 7) traced [0]."""
    from tightfit.memory.estimate import estimate
    from tightfit.plan import Plan

    b = {"input_ids": torch.ones(2, 8, dtype=torch.long), "labels": torch.zeros(2, dtype=torch.long)}
    with pytest.raises(TightfitError, match=message):
        estimate(tiny_bert(), b, Plan("fp32", 2, 2), checkpoint_blocks=blocks)
    assert estimate(tiny_bert(), b, Plan("fp32", 2, 2), checkpoint_blocks=(1, 0)).plan["checkpoint_blocks"] == [0, 1]


def test_two_sizes_that_differ_never_read_the_same_in_one_message(tmp_path, capsys):
    """`tightfit plan --budget 2833818` said "model state ... alone, 2.57 MiB, is over the 2.57 MiB a
    step may hold"; where two compared sizes round alike, both are shown in bytes."""
    from tightfit.units import format_bytes_pair

    assert format_bytes_pair(2692128, 2692127.1) == ("2,692,128 B", "2,692,127.1 B")
    assert format_bytes_pair(3 << 20, 1 << 30) == ("3.00 MiB", "1.00 GiB")  # apart: as format_bytes shows them
    assert format_bytes_pair(1 << 30, 1 << 30) == ("1.00 GiB", "1.00 GiB")  # equal: nothing to tell apart
    folder = tiny_text_model_folder(tmp_path, ["good", "bad"], hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=128, max_position_embeddings=64)
    from transformers import AutoModelForSequenceClassification

    need = 16 * sum(p.numel() for p in AutoModelForSequenceClassification.from_pretrained(folder).parameters())
    budget = int(need / 0.95)  # planned against 95% of it: just under the model state
    line = _error(capsys, ["plan", "--model", str(folder), "--seq-len", "32", "--batch-size", "16",
                           "--budget", str(budget)])
    assert f"alone, {need:,} B, is over the {budget * 0.95:,.1f} B a step may hold" in line, line


def test_plan_and_estimate_take_trains_default_size_when_none_is_given(capsys):
    """`tightfit plan --model minilm --batch-size 32` refused ("one of the arguments --seq-len
    --image-size is required") where `tightfit train` takes 64 tokens by default; an image model
    takes its own side. A size of the other kind is still refused in one line."""
    from tightfit.cli import main

    assert main(["plan", "--model", "minilm", "--batch-size", "32", "--budget", "4GiB"]) == 0
    assert "minilm, sequence length 64, effective batch 32" in capsys.readouterr().out
    assert main(["estimate", "--model", "resnet50", "--micro-batch", "2"]) == 0
    capsys.readouterr()
    assert main(["estimate", "--model", "resnet50", "--micro-batch", "2", "--seq-len", "3"]) == 2
    assert capsys.readouterr().err.strip() == "tightfit: error: resnet50 takes images: give --image-size, not --seq-len"


def test_a_cpu_runs_summary_says_no_budget_was_applied(tmp_path):
    """A --budget given to a CPU run is checked, not applied: summary.json said budget_bytes 4 GiB
    at the top while its plan said none and the report "no GPU budget applies" (a fresh user's
    finding). The request keeps what was asked."""
    import json

    from conftest import tiny_cpu_job
    from tightfit import api

    out = tmp_path / "run"
    api.train(api.TrainRequest(**tiny_cpu_job(tmp_path), budget="4GiB", max_steps=1, checkpoint_every=0,
                               out=str(out)))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["budget_bytes"] is None and summary["plan"]["budget_bytes"] is None
    assert json.loads((out / "request.json").read_text())["budget"] == "4GiB"
