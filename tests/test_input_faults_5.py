"""Input faults found by a fresh user (items 6 and 13): a GPU profile file's fields of the wrong
type or shape; a unit-less ``--budget`` too large to be meant as GiB; ``--data`` and ``--model``
that exist but are the wrong kind of path; the offload lever's host-link time of "0.00 s"; the
own loop's non-finite advice about texts and labels."""

import json
import re
import sys
from pathlib import Path

import pytest

from tightfit.cli import main

from test_input_faults_3 import CARD, _error_line, _profiles  # one copy of the profile helpers

PLAN = ["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4"]


# ---- 6: compute_capability [9] crashed (IndexError in levers/precision.py), "7.5" and 75 gave
# int()'s and iteration's messages, and "bf16": "no" counted as true: every field is now checked

@pytest.mark.parametrize("field,value,says", [
    ("compute_capability", [9], "compute_capability must be [major, minor] integers"),
    ("compute_capability", "7.5", "compute_capability must be [major, minor] integers"),
    ("compute_capability", 75, "compute_capability must be [major, minor] integers"),
    ("compute_capability", [7, 5, 0], "compute_capability must be [major, minor] integers"),
    ("compute_capability", [7.5, 0], "compute_capability must be [major, minor] integers"),
    ("compute_capability", [7, "5"], "compute_capability must be [major, minor] integers"),
    ("compute_capability", [True, 5], "compute_capability must be [major, minor] integers"),
    ("compute_capability", [-7, 5], "compute_capability must be [major, minor] integers"),
    ("bf16", "no", "bf16 must be true or false"),
    ("bf16", 0, "bf16 must be true or false"),
    ("fp16_tensor_cores", "yes", "fp16_tensor_cores must be true or false"),
    ("fp16_tensor_cores", None, "fp16_tensor_cores must be true or false"),
    ("key", "", "key must be a non-empty string"),
    ("key", 7, "key must be a non-empty string"),
    ("key", "My Card", "key must be lower case with dashes"),  # --gpu looks it up as "my-card": never found
    ("name", ["My", "Card"], "name must be a non-empty string"),
    ("fp32_tflops", "5", "fp32_tflops must be a finite number"),
    ("fp32_tflops", True, "fp32_tflops must be a finite number"),
    ("fp16_tflops", [20], "fp16_tflops must be a finite number"),
    ("bf16_tflops", None, "bf16_tflops must be a finite number"),
    ("bf16_tflops", -1, "bf16_tflops must be zero or more"),
    ("host_link_bytes_per_s", "12e9", "host_link_bytes_per_s must be a finite number"),
    ("host_link_bytes_per_s", 0, "host_link_bytes_per_s must be positive"),  # divided by in the offload line
    ("memory_bytes_per_s", -1, "memory_bytes_per_s must be zero or more"),
    ("memory_bytes_per_s", "fast", "memory_bytes_per_s must be a finite number"),
    ("sm_count", 1.5, "sm_count must be a whole number"),
    ("sm_count", "40", "sm_count must be a whole number"),
    ("sm_count", -1, "sm_count must be a whole number"),
    ("sustained_share", "0.5", "sustained_share must be a finite number"),
    ("sustained_share", 0, "sustained_share must be positive"),
    ("total_bytes", [6], "total_bytes"),
    ("total_bytes", True, "total_bytes"),
])
def test_profile_field_of_the_wrong_type_or_shape_is_one_line_naming_file_card_and_field(
        tmp_path, monkeypatch, capsys, field, value, says):
    monkeypatch.chdir(tmp_path)
    f = _profiles(tmp_path, monkeypatch, {**CARD, field: value})
    gpu = "my-card" if field != "key" else "whatever"  # the file is read, and refused, before the look-up
    assert main([*PLAN, "--gpu", gpu]) == 2
    line = _error_line(capsys)
    key = CARD["key"] if field != "key" else value
    assert f"GPU profile file {f}: " in line and repr(key) in line and says in line, line
    assert "Traceback" not in line and sorted(p.name for p in tmp_path.iterdir()) == ["cards.json"]  # nothing written


def test_a_bad_profile_field_stops_train_before_any_work(tmp_path, monkeypatch, capsys):
    """train checks the card before the data (here missing) and writes no run folder."""
    f = _profiles(tmp_path, monkeypatch, {**CARD, "compute_capability": [9]})
    out = tmp_path / "run"
    assert main(["train", "--gpu", "my-card", "--data", str(tmp_path / "missing.csv"), "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert str(f) in line and "'my-card'" in line and "compute_capability must be [major, minor] integers" in line
    assert "[9]" in line and not out.exists()


def test_a_well_formed_profile_with_its_optional_fields_still_loads(tmp_path, monkeypatch):
    from tightfit.devices import get_profile

    _profiles(tmp_path, monkeypatch, {**CARD, "memory_bytes_per_s": 336e9, "sm_count": 30, "sustained_share": 0.5},
              {**CARD, "key": "my-ampere", "compute_capability": [8, 6], "bf16": True, "bf16_tflops": 20})
    card = get_profile("my-card")
    assert card.compute_capability == (7, 5) and card.sm_count == 30 and card.bf16 is False
    assert get_profile("my-ampere").bf16 is True and get_profile("My_Ampere").compute_capability == (8, 6)


# ---- 13a: --budget 1048575 suggested "1048575GiB or 1048575GB"

@pytest.mark.parametrize("budget", ["1048575", "5000"])
def test_a_unitless_budget_too_large_to_be_gib_is_not_offered_as_gib(budget, capsys):
    assert main([*PLAN, "--budget", budget]) == 2
    line = _error_line(capsys)
    assert line == (f"tightfit: error: --budget {budget} is {budget} bytes, under the smallest budget of 1 MiB "
                    "(1048576 bytes): give at least 1048576 bytes, or a unit, e.g. 6GiB or 512MiB"), line
    assert f"{budget}GiB" not in line


def test_a_small_unitless_budget_is_still_offered_its_unit():
    from tightfit.errors import TightfitError
    from tightfit.units import MiB, parse_budget

    with pytest.raises(TightfitError, match=r"^--budget 24 is 24 bytes: give a unit, e.g. 24GiB or 24GB$"):
        parse_budget("24")
    assert parse_budget(str(MiB)) == MiB


# ---- 13b: --data /dev/null said "data file not found"; --model <a file> said "model folder not found"

def test_data_that_exists_but_is_not_a_regular_file_says_so(tmp_path, capsys):
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null")
    out = tmp_path / "run"
    assert main(["train", "--data", "/dev/null", "--out", str(out)]) == 2
    line = _error_line(capsys)
    assert "/dev/null is not a regular file" in line and "not found" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("command", ["plan", "train"])
def test_model_that_is_a_file_says_it_is_not_a_folder(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = tmp_path / "run"
    extra = ["--seq-len", "16", "--batch-size", "4", "--gpu", "t4"] if command == "plan" else ["--out", str(out)]
    assert main([command, "--model", str(afile), *extra]) == 2
    line = _error_line(capsys)
    assert f"{afile} is not a folder" in line and "not found" not in line, line
    assert not out.exists()


# ---- 13c: the adamw-offload lever line said "about 0.00 s" of host transfer for a small model

def test_offload_lever_line_gives_the_host_transfer_in_a_readable_unit(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import tiny_text_model_folder

    model = tiny_text_model_folder(tmp_path, [f"w{i}" for i in range(20000)], hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    capsys.readouterr()
    assert main(["plan", "--model", str(model), "--seq-len", "16", "--batch-size", "4", "--gpu", "rtx-2060",
                 "--budget", "1MiB"]) == 2
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "--optimizer adamw-offload:" in ln]
    assert line and "0.00 s" not in line[0], err
    # 648,898 weights: 4.95 MiB over the RTX 2060's 12 GB/s, about 0.43 ms
    assert re.search(r"over the host link, about 0\.\d+ ms, plus", line[0]), line[0]


def test_format_seconds_keeps_three_significant_digits():
    from tightfit.units import format_seconds

    assert format_seconds(0.000675) == "0.675 ms" and format_seconds(0.055) == "55 ms"
    assert format_seconds(1.25) == "1.25 s" and format_seconds(250.4) == "250 s"


def test_format_seconds_does_not_print_a_second_in_scientific_notation():
    """0.9996 s (e.g. offloaded AdamW state crossing the host link in the planner's reasons) read
    "1e+03 ms": three significant digits of 999.6 ms round up to 1000, which :.3g writes so."""
    from tightfit.units import format_seconds

    assert [format_seconds(s) for s in (0.9996, 0.9994, 0.00099996, 99.96)] == ["1 s", "999 ms", "1 ms", "100 s"]


# ---- 13d: TrainStep's NonFiniteTrainingError advised checking "the data for broken texts or labels"

def test_own_loop_non_finite_error_advises_about_the_loop_not_texts_and_labels():
    import torch

    import tightfit
    from tightfit import Plan

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, max_skipped_steps=1,
                              loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]) * float("inf"), b[1]))
    with pytest.raises(tightfit.NonFiniteTrainingError) as e:
        step((x, y))
    message = str(e.value)
    assert "texts or labels" not in message and "batches and the loss function" in message, message
    assert "learning rate" in message and "--" not in message
