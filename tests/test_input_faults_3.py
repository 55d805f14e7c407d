"""Input faults found by a fresh user: a GPU profile file's bad size, repeated key and built-in
key; a GPT-2 classifier folder without a padding token; ``tightfit export`` given an unfinished
run, a file, or a file as ``--out``."""

import json
from pathlib import Path

import pytest

from tightfit.cli import main
from tightfit.errors import TightfitError

CARD = {"key": "my-card", "name": "My Card", "total_bytes": "6GiB", "compute_capability": [7, 5],
        "fp16_tensor_cores": True, "bf16": False, "fp32_tflops": 5, "fp16_tflops": 20, "bf16_tflops": 0,
        "host_link_bytes_per_s": 12e9}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tightfit: error: "), err
    return err[0]


def _profiles(tmp_path, monkeypatch, *cards):
    f = tmp_path / "cards.json"
    f.write_text(json.dumps(list(cards)))
    monkeypatch.setenv("TIGHTFIT_GPU_PROFILES", str(f))
    return f


# ---- 1a: a bad total_bytes said "memory size must be positive, got '0'": no file, key or field

@pytest.mark.parametrize("size", ["0", -5, "6 parsecs", "200MiB", "501MiB"])  # under 1 MiB after the CUDA context
def test_profile_size_error_names_the_file_the_key_and_the_field(tmp_path, monkeypatch, capsys, size):
    f = _profiles(tmp_path, monkeypatch, {**CARD, "total_bytes": size})
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "my-card"]) == 2
    line = _error_line(capsys)
    assert str(f) in line and "'my-card'" in line and "total_bytes" in line, line


# ---- 1b: a key listed twice was accepted (the last one silently won)

def test_profile_file_listing_a_key_twice_is_refused(tmp_path, monkeypatch):
    from tightfit.devices import load_profiles

    f = _profiles(tmp_path, monkeypatch, CARD, {**CARD, "total_bytes": "8GiB"})
    with pytest.raises(TightfitError, match=f"GPU profile file {f}: .*'my-card' .*twice"):
        load_profiles()


# ---- 1c: a profile keyed like a built-in replaced it without a word

def test_profile_replacing_a_built_in_is_noted_by_plan_and_train(tmp_path, monkeypatch, capsys):
    from tightfit.devices import get_profile

    f = _profiles(tmp_path, monkeypatch, {**CARD, "key": "t4", "total_bytes": "16GiB"})
    assert get_profile("t4").total_bytes == 16 * 2**30  # replacing is allowed: to correct a built-in card
    note = f"note: GPU profile 't4' in {f} replaces the built-in NVIDIA Tesla T4"
    # both stop on a later check: the note comes before it
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "t4",
                 "--budget", "20GiB"]) == 2
    out, err = capsys.readouterr()
    assert note in out and "is more than the 16.00 GiB of the My Card" in err, (out, err)
    assert main(["train", "--gpu", "t4", "--data", str(tmp_path / "missing.csv"), "--out", str(tmp_path / "r")]) == 2
    out, err = capsys.readouterr()
    assert note in out and "missing.csv" in err, (out, err)
    (tmp_path / "same.json").write_text(json.dumps([get_profile("rtx-2060").to_dict()]))
    monkeypatch.setenv("TIGHTFIT_GPU_PROFILES", str(tmp_path / "same.json"))
    get_profile("rtx-2060")  # the built-in's own facts: nothing replaced, nothing to say
    assert "note:" not in capsys.readouterr().out


def test_a_json_command_keeps_its_notes_off_stdout(tmp_path, monkeypatch, capsys):
    """With --json the note of a replaced built-in card came before the JSON on stdout."""
    f = _profiles(tmp_path, monkeypatch, {**CARD, "key": "t4", "total_bytes": "16GiB"})
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "t4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["plan"]["micro_batch"] >= 1  # stdout is the JSON alone
    assert f"note: GPU profile 't4' in {f} replaces the built-in NVIDIA Tesla T4" in err


@pytest.mark.parametrize("command", [["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "2"],
                                     ["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4",
                                      "--gpu", "t4"]])
def test_an_unknown_option_points_to_the_sub_commands_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command, "--bogus", "4GiB"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"unrecognized arguments: --bogus 4GiB (see tightfit {command[0]} --help)"), err


# ---- 2: a GPT-2 classifier folder without pad_token_id could not be traced at micro-batch > 1

def _gpt2_classifier(path, **config):
    from transformers import GPT2Config, GPT2ForSequenceClassification

    GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=500, n_positions=64,
                                             **config)).save_pretrained(path)
    return str(path)


def test_gpt2_classifier_without_pad_token_is_estimated_and_planned(tmp_path, capsys):
    from tightfit.models import build_model

    folder = _gpt2_classifier(tmp_path / "gpt2tiny")
    assert main(["estimate", "--model", folder, "--seq-len", "32", "--micro-batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "note: config.json sets no pad_token_id: padding with the end-of-sequence token (id 50256)" in out
    assert "peak reserved" in out
    model, make_batch = build_model(folder)  # what `tightfit plan` traces
    assert model.config.pad_token_id == 50256 and make_batch.notes
    assert main(["plan", "--model", folder, "--seq-len", "32", "--batch-size", "4", "--gpu", "t4"]) == 0
    assert "note: config.json sets no pad_token_id" in capsys.readouterr().out  # plan says so too


def test_gpt2_classifier_without_pad_or_eos_token_is_refused_in_one_line(tmp_path, capsys):
    folder = _gpt2_classifier(tmp_path / "gpt2tiny", bos_token_id=None, eos_token_id=None)
    capsys.readouterr()
    assert main(["estimate", "--model", folder, "--seq-len", "32", "--micro-batch", "2"]) == 2
    line = _error_line(capsys)
    assert line.endswith("(config.json sets neither pad_token_id nor eos_token_id: set pad_token_id in "
                         "config.json)"), line
    assert main(["plan", "--model", folder, "--seq-len", "32", "--batch-size", "4", "--gpu", "t4"]) == 2
    assert _error_line(capsys).endswith("set pad_token_id in config.json)")


# ---- 3: tightfit export's messages for an unfinished run, a file, and a file as --out

def test_export_of_an_unfinished_run_says_to_resume_it(tmp_path, capsys):
    run = tmp_path / "dbl"
    (run / "checkpoints" / "ckpt-10").mkdir(parents=True)
    (run / "request.json").write_text("{}")
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert f"{run}: the run has not finished (no model/ yet): run tightfit train --resume {run} first" in line, line
    (run / "checkpoints" / "ckpt-10").rmdir()  # nothing to resume from
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert "the run has not finished (no model/ yet) and has no checkpoint to resume from" in line, line



def test_export_of_a_run_still_training_does_not_say_to_resume_it(tmp_path, capsys):
    """A run still training has no model/ yet either: export said to resume it first, which
    --resume refuses while another tightfit run writes the folder (its lock)."""
    from tightfit.api import _hold_run_folder, _release_run_folders

    run = tmp_path / "live"
    (run / "checkpoints" / "ckpt-10").mkdir(parents=True)
    (run / "request.json").write_text("{}")
    owner = object()  # the training run, holding its folder's lock
    _hold_run_folder(run, owner)
    try:
        assert main(["export", "--int8", str(run), "--out", str(tmp_path / "o")]) == 2
        line = _error_line(capsys)
        assert "the run is still training" in line and "--resume" not in line, line
    finally:
        _release_run_folders(owner)
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "o")]) == 2  # ended: resume it
    assert "run tightfit train --resume" in _error_line(capsys)
    assert not (tmp_path / "o").exists()

def test_export_of_a_file_says_it_is_a_file(tmp_path, capsys):
    f = tmp_path / "reviews.csv"
    f.write_text("text,label\n")
    assert main(["export", "--int8", str(f), "--out", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert f"{f} is a file, not a run or model folder" in line, line


def test_export_out_that_is_a_file_says_so(tmp_path, capsys):
    from transformers import BertConfig, BertForSequenceClassification

    model = tmp_path / "model"
    BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=8)).save_pretrained(model)
    afile = tmp_path / "afile"
    afile.write_text("x")
    capsys.readouterr()  # transformers' "Writing model shards" progress bar
    assert main(["export", "--int8", str(model), "--out", str(afile)]) == 2
    assert f"--out {afile} is a file; give a new or empty folder" in _error_line(capsys)


@pytest.mark.parametrize("command", [["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4"],
                                     ["train", "--data", "missing.csv"]])
def test_a_budget_without_a_unit_below_a_mebibyte_is_refused(command, capsys):
    """`--budget 4` planned for 4 bytes and answered with the long below-the-model-state message."""
    assert main([*command, "--budget", "4"]) == 2
    assert _error_line(capsys) == "tightfit: error: --budget 4 is 4 bytes: give a unit, e.g. 4GiB or 4GB"


def test_a_budget_in_bytes_still_reads_as_bytes():
    from tightfit.units import GiB, parse_budget

    assert parse_budget(str(4 * GiB)) == parse_budget("4GiB") == parse_budget(4 * GiB) == 4 * GiB


def test_a_budget_in_bytes_may_be_written_with_an_exponent(capsys):
    """`--budget 1e9` was "cannot read memory size": bytes are often written so (the API took 4e9 as a float)."""
    from tightfit.units import parse_budget

    assert parse_budget("1e9") == parse_budget(1e9) == 10**9
    assert parse_budget("4e9") == parse_budget(" 4E+9 ") == parse_budget("4e9B") == 4 * 10**9
    assert parse_budget("2.5e9") == 2_500_000_000
    with pytest.raises(TightfitError, match="^memory size must be a finite number of bytes"):
        parse_budget("1e308GiB")  # past a float once in bytes: int(inf) raised OverflowError
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1e9",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["budget_bytes"] == 10**9


@pytest.mark.parametrize("budget, message", [
    ("1.5e0", "memory size '1.5e0' is a fraction of a byte: write a unit, e.g. 1.5GiB"),
    ("-1e9", "memory size must be positive, got '-1e9'"),
    ("0e0", "memory size must be positive, got '0e0'"),
    ("1e999", "memory size must be a finite number of bytes, got '1e999'"),  # past a float: int(inf) raised
    ("nan", "cannot read memory size 'nan': write a number and a unit, e.g. 4GiB, 11GB, 512MiB"),
])
@pytest.mark.parametrize("command", [["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4"],
                                     ["train", "--data", "missing.csv"]])
def test_a_budget_with_an_exponent_that_is_no_whole_positive_bytes_is_refused(command, budget, message, capsys):
    assert main([*command, f"--budget={budget}"]) == 2
    assert _error_line(capsys) == f"tightfit: error: --budget {budget}: {message}"


# ---- fresh-user trial (stop 27): silent caps and an empty --out

def _tiny_model_and_data(tmp_path):
    """A one-layer BERT folder and a CSV of 40 two-word texts (36 training samples after the split)."""
    from conftest import tiny_text_model_folder
    from test_resume import WORDS

    model = tiny_text_model_folder(tmp_path, WORDS, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=16, max_position_embeddings=32)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"{WORDS[i % 12]} {WORDS[(i * 5) % 12]},{'ab'[i % 2]}\n"
                                             for i in range(40)))
    return model, data


def test_caps_of_max_steps_and_sample_counts_are_noted_and_an_empty_out_is_refused(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    model, data = _tiny_model_and_data(tmp_path)
    common = ["train", "--model", str(model), "--data", str(data), "--seq-len", "16", "--batch-size", "8",
              "--device", "cpu", "--no-progress", "--checkpoint-every", "0"]
    assert main([*common, "--max-steps", "100", "--epochs", "1", "--train-samples", "5000", "--eval-samples", "900",
                 "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "--max-steps 100 is more than the 5 optimizer steps of 1 epoch(s): training 5" in out, out
    assert "--train-samples 5000 is more than the 36 training samples of the split: using all 36" in out, out
    assert "--eval-samples 900 is more than the 4 held-out samples of the split" in out, out
    before = set((Path.cwd() / "runs").glob("*"))
    assert main([*common, "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err and set((Path.cwd() / "runs").glob("*")) == before


def test_a_negative_value_after_its_option_gets_the_options_own_message(capsys):
    """``--budget -1GiB`` said "argument --budget: expected one argument" (argparse took the value
    for an option); ``--budget=-1GiB`` already said what is wrong."""
    args = ["plan", "--model", "minilm", "--seq-len", "64", "--batch-size", "4"]
    assert main([*args, "--budget", "-1GiB"]) == 2
    spaced = capsys.readouterr().err
    assert main([*args, "--budget=-1GiB"]) == 2
    assert spaced == capsys.readouterr().err and "must be positive" in spaced, spaced


def test_the_levers_in_a_nothing_fits_message_add_up(tmp_path, capsys):
    """"over by 345.64 MiB", then "saves 129.29 MiB, still 216.53 MiB over": the saving came from the
    nominal 6 B per parameter and the rest from the lever's traced state. Each line must add up."""
    import re

    from tightfit.units import parse_size

    assert main(["train", "--budget", "1MiB", "--max-steps", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    over = parse_size(re.search(r", by ([\d.]+ \w+);", err).group(1).replace(" ", ""))
    lines = re.findall(r"saves ([\d.]+ \w+), still ([\d.]+ \w+) over", err)
    assert lines, err
    for saved, still in lines:
        total = parse_size(saved.replace(" ", "")) + parse_size(still.replace(" ", ""))
        assert abs(total - over) <= 0.011 * 2**20, (saved, still, err)  # to the shown 0.01 MiB


@pytest.mark.parametrize("command", [["plan", "--batch-size", "4", "--budget", "4GiB"], ["estimate", "--micro-batch", "4"]])
def test_plan_and_estimate_refuse_a_sequence_too_short_for_text(capsys, command):
    """`tightfit plan --seq-len 1` planned normally where `tightfit train` refuses it."""
    assert main([*command, "--model", "minilm", "--seq-len", "1"]) == 2
    assert "--seq-len 1 leaves 0 tokens of text after the 2 special tokens ([CLS], [SEP]); use at least 8" \
        in capsys.readouterr().err
    assert main([*command, "--model", "gpt2", "--seq-len", "1"]) == 2  # no tokenizer: text after none
    assert "--seq-len 1 leaves no room for text: use at least 6" in capsys.readouterr().err


# ---- tester's faults: empty options, negative values argparse took for options, an absurd card,
# plan/estimate taking a --seq-len train refuses, and a note suggesting --eval-samples in vain

@pytest.mark.parametrize("option,message", [
    ("--model", "--model is empty: give a model name or folder, or leave --model out for the shipped all-MiniLM-L6-v2"),
    ("--data", "--data is empty: give the data file, or leave --data out for the shipped Rotten Tomatoes reviews"),
    ("--resume", "--resume is empty: give the run folder to continue, or leave --resume out for a new run")])
def test_an_empty_model_data_or_resume_is_refused(tmp_path, monkeypatch, capsys, option, message):
    """``--model ""`` and ``--data ""`` trained the shipped model and data, ``--resume ""`` started a
    new run: each silently, as if the option had been left out."""
    monkeypatch.chdir(tmp_path)
    quick = ["--device", "cpu", "--max-steps", "1", "--train-samples", "8", "--eval-samples", "8"]  # were it taken
    assert main(["train", option, "", *quick, "--out", str(tmp_path / "run")]) == 2
    assert _error_line(capsys) == f"tightfit: error: {message}"
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.parametrize("command", [["plan", "--seq-len", "16", "--batch-size", "4", "--gpu", "t4"],
                                     ["estimate", "--seq-len", "16", "--micro-batch", "2"]])
def test_plan_and_estimate_refuse_an_empty_model(capsys, command):
    """``tightfit plan --model ""`` planned minilm."""
    assert main([*command, "--model", ""]) == 2
    assert _error_line(capsys).startswith("tightfit: error: --model is empty: give one of minilm, bert-base")


def test_a_run_saved_with_an_empty_model_or_data_reads_as_the_shipped_ones():
    """Runs started before ``""`` was refused trained on the shipped model and data: --resume and
    export read them as None (the shipped ones), not as the now refused ``""``."""
    from tightfit.config import TrainRequest, saved_options

    saved = saved_options({"model": "", "data": " ", "lr": 1e-4})
    assert saved == {"model": None, "data": None, "lr": 1e-4}
    TrainRequest(**saved)  # accepted


@pytest.mark.parametrize("command,option,value,message", [
    (["plan", "--model", "minilm", "--seq-len", "64", "--batch-size", "4"], "--budget", "-.5GiB", "must be positive"),
    (["train"], "--lr", "-inf", "--lr must be positive and finite, not -inf"),
    (["train"], "--lr", "-nan", "--lr must be positive and finite, not nan"),
    (["train"], "--warn-temp", "-Infinity", "--warn-temp must be a GPU temperature")])
def test_a_negative_fraction_or_infinity_after_its_option_gets_the_options_own_message(
        capsys, command, option, value, message):
    """``--budget -.5GiB`` and ``--lr -inf`` still said "expected one argument": only ``-<digit>``
    was attached to its option."""
    assert main([*command, option, value]) == 2
    spaced = _error_line(capsys)
    assert main([*command, f"{option}={value}"]) == 2
    assert spaced == _error_line(capsys) and message in spaced, spaced


def test_a_value_like_a_negative_number_is_not_attached_to_a_switch_or_taken_from_help(capsys):
    """Only an option that takes a value takes one: ``--full -inf`` is an unknown argument, not
    ``--full=-inf``; ``-h`` after a switch is still the help."""
    from tightfit.cli import _negative_values_attached

    switches = {"--full", "--help"}
    assert _negative_values_attached(["train", "--full", "-inf", "--lr", "-inf", "--budget", "-.5GiB"], switches) \
        == ["train", "--full", "-inf", "--lr=-inf", "--budget=-.5GiB"]
    assert _negative_values_attached(["--lr", "-h", "--", "-1"], switches) == ["--lr", "-h", "--", "-1"]
    with pytest.raises(SystemExit) as e:
        main(["train", "--full", "-h"])
    assert e.value.code == 0 and "usage: tightfit train" in capsys.readouterr().out


@pytest.mark.parametrize("size", [1e30, "2048TiB"])
def test_a_profile_with_more_memory_than_any_gpu_is_refused(tmp_path, monkeypatch, capsys, size):
    """A card of 1e30 bytes was accepted and planned for."""
    f = _profiles(tmp_path, monkeypatch, {**CARD, "total_bytes": size})
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "my-card"]) == 2
    line = _error_line(capsys)
    assert str(f) in line and "'my-card'" in line and "is more than 1 PiB, far beyond any GPU's memory" in line, line


@pytest.mark.parametrize("model", ["minilm", "bert-base", "bert-large"])
@pytest.mark.parametrize("seq_len", [6, 7])
def test_plan_and_estimate_refuse_the_seq_len_train_refuses_for_bert(tmp_path, capsys, model, seq_len):
    """``--seq-len 6`` or ``7`` was planned for BERT models, which train refuses: [CLS] and [SEP]
    leave 4 or 5 tokens of text. Both now say what train says."""
    said = (f"--seq-len {seq_len} leaves {seq_len - 2} tokens of text after the 2 special tokens ([CLS], [SEP]); "
            "use at least 8")
    assert main(["plan", "--model", model, "--seq-len", str(seq_len), "--batch-size", "4", "--gpu", "t4"]) == 2
    assert _error_line(capsys) == f"tightfit: error: {said}"
    assert main(["estimate", "--model", model, "--seq-len", str(seq_len), "--micro-batch", "2"]) == 2
    assert _error_line(capsys) == f"tightfit: error: {said}"
    if model == "minilm":
        assert main(["train", "--seq-len", str(seq_len), "--device", "cpu", "--out", str(tmp_path / "r")]) == 2
        assert _error_line(capsys) == f"tightfit: error: {said}"


def test_plan_takes_seq_len_8_for_bert_and_6_where_train_adds_no_special_tokens(capsys):
    assert main(["plan", "--model", "bert-base", "--seq-len", "8", "--batch-size", "4", "--gpu", "t4"]) == 0
    assert main(["plan", "--model", "gpt2", "--seq-len", "6", "--batch-size", "4", "--gpu", "t4"]) == 0


def test_the_held_out_note_suggests_eval_samples_only_when_it_left_some_out():
    """"accuracy on 4 held-out samples ... (--eval-samples or more data ...)" when all 4 of the
    split were already used: --eval-samples could give no more."""
    from tightfit import data as tdata
    from tightfit.data import TextClassificationData, held_out_split

    data = TextClassificationData([f"text {i}" for i in range(100)], [i % 2 for i in range(100)], ["a", "b"], "x")
    train_idx, eval_idx = held_out_split(len(data))
    assert len(eval_idx) == 10
    every = tdata.check_split(data, data.subset(train_idx), data.subset(eval_idx))
    assert every == ["accuracy on 10 held-out samples moves in steps of 10% (more data for a finer measure)"]
    from tightfit.config import cli_names

    with cli_names():  # as the command line says it (Python callers read eval_samples)
        some = tdata.check_split(data, data.subset(train_idx), data.subset(eval_idx[:4]))
    assert some == ["accuracy on 4 held-out samples moves in steps of 25% (--eval-samples or more data for a "
                    "finer measure)"]


def test_a_batch_size_above_the_training_samples_plans_and_reports_the_batch_it_trains(tmp_path, capsys):
    """--batch-size 100000 over 36 training samples: every step sees the 36, and the plan block,
    plan.json and summary.json say 36 (they said 100000)."""
    import json

    from tightfit.cli import main

    model, data = _tiny_model_and_data(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--seq-len", "16", "--batch-size", "100000",
                 "--device", "cpu", "--no-progress", "--epochs", "2", "--out", str(run)]) == 0
    out = capsys.readouterr().out
    assert "--batch-size 100000 is more than the 36 training samples: the effective batch is 36" in out, out
    assert "effective batch 36" in out and "100000 x" not in out, out
    assert json.loads((run / "plan.json").read_text())["effective_batch"] == 36
    summary = json.loads((run / "summary.json").read_text())
    assert summary["plan"]["effective_batch"] == 36 and summary["steps"] == 2, summary


def test_a_size_too_small_for_a_float_says_it_rounds_to_zero():
    """1e-400 was refused as 'must be positive', which it is as written: a float holds it as 0."""
    from tightfit.units import parse_size

    with pytest.raises(TightfitError, match=r"^memory size must be positive, got '1e-400' \(it rounds to 0\)$"):
        parse_size("1e-400")
    with pytest.raises(TightfitError, match=r"^memory size must be positive, got '0e5'$"):
        parse_size("0e5")


def test_a_fraction_of_an_epoch_rounded_up_to_a_whole_effective_batch_is_noted(tmp_path, capsys):
    """From a fresh user's trial: --epochs 0.05 of 100 samples at batch 32 trained one step of 32
    samples (0.32 epochs, six times what was asked) without a word. Noted where the whole
    effective batches train more than a tenth more than asked; not where they train about that."""
    import sys

    from tightfit.runtime.trainer import rounded_epochs_note

    sys.path.insert(0, str(Path(__file__).parent))
    model, data = _tiny_model_and_data(tmp_path)  # 36 training samples
    common = ["train", "--model", str(model), "--data", str(data), "--seq-len", "16", "--batch-size", "8",
              "--device", "cpu", "--no-progress", "--checkpoint-every", "0"]
    assert main([*common, "--epochs", "0.1", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert ("0.1 epoch(s) of 36 training samples trains 1 optimizer step (5 per epoch, each of the effective batch 8 "
            "but an epoch's last): 8 samples (0.222 epochs), where 0.1 x 36 samples is 3.6") in out, out
    assert rounded_epochs_note(1.5, 100, 32, 6) is None  # 164 trained for 150 asked
    assert rounded_epochs_note(2, 100, 32, 8) is None  # whole epochs: their last windows are short
    assert "1 optimizer step (4 per epoch" in rounded_epochs_note(0.05, 100, 32, 1)
    # no step rounded: 0.75 of 4 steps is 3 whole windows, 96 samples where 75 would be (from a review)
    assert "3 optimizer steps (4 per epoch, each of the effective batch 32 but an epoch's last): 96 samples" in \
        rounded_epochs_note(0.75, 100, 32, 3)
    # with --max-steps above the epochs' steps, both notes (from a review: the rounding went unsaid)
    assert main([*common, "--epochs", "0.1", "--max-steps", "5", "--out", str(tmp_path / "run2")]) == 0
    out = capsys.readouterr().out
    assert "--max-steps 5 is more than the 1 optimizer steps" in out and "trains 1 optimizer step (5 per" in out, out


def test_a_fraction_of_an_epoch_is_not_rounded_up_by_a_floats_last_digit():
    """From a review: 0.07 x 100 steps is 7.000000000000001 in floats, and ceil made it 8 steps
    (in the trainer and in the command's counts alike). A real fraction of a step still rounds up,
    and any positive length trains at least one step."""
    from tightfit.runtime.trainer import epoch_steps

    assert epoch_steps(0.07, 100, 1) == 7 and epoch_steps(0.07, 1000, 10) == 7
    assert epoch_steps(0.071, 100, 1) == 8 and epoch_steps(1.5, 100, 32) == 6
    assert epoch_steps(1e-12, 100, 32) == 1 and epoch_steps(0, 100, 32) == 0
