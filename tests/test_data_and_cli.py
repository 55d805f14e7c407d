"""Bad input: a one-line error, exit code 2, before any training and with nothing written."""

import gzip
import json

import pytest
import torch

from tightfit.cli import main
from tightfit.data import held_out_split, load_text_classification, take
from tightfit.errors import TightfitError


def _csv(tmp_path, text, name="d.csv"):
    f = tmp_path / name
    f.write_text(text)
    return f


def test_string_labels_and_formats(tmp_path):
    f = _csv(tmp_path, "sentence,y\ngood film,pos\nbad film,neg\n\"ok, fine\",pos\n")
    d = load_text_classification(f, "sentence", "y")
    assert d.label_names == ["neg", "pos"] and d.labels == [1, 0, 1] and d.texts[2] == "ok, fine"
    j = tmp_path / "d.jsonl.gz"
    with gzip.open(j, "wt") as g:
        g.write("\n".join(json.dumps({"t": f"x{i}", "l": i % 3 * 5}) for i in range(6)) + "\n")
    d = load_text_classification(j, "t", "l")
    assert d.label_names == ["0", "5", "10"]  # numeric labels sorted as numbers
    assert d.labels == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("content,name,match", [
    ("text,label\na,1\nb\n", "d.csv", "has 1 fields"),
    ('text,label\n"unterminated,1\n', "d.csv", "malformed CSV|fields"),
    ('{"text": "a", "label": 1}\n{"text": \n', "d.jsonl", "line 2 is not valid JSON"),
    ("text,label\na,1\nb,1\n", "d.csv", "1 class"),
    ("text,cls\na,1\nb,0\n", "d.csv", "no column 'label'"),
    ("a b c", "d.parquet", "unknown data format"),
])
def test_bad_data(tmp_path, content, name, match):
    with pytest.raises(TightfitError, match=match):
        load_text_classification(_csv(tmp_path, content, name), "text", "label")


def test_held_out_split_is_fixed_and_disjoint():
    a_train, a_eval = held_out_split(1000)
    b_train, b_eval = held_out_split(1000)
    assert a_eval == b_eval and len(a_eval) == 100
    assert not set(a_train) & set(a_eval) and len(a_train) + len(a_eval) == 1000


@pytest.mark.parametrize("args,match", [
    (["--gpu", "gtx-9999"], "unknown GPU profile"),
    (["--budget", "4GiBB"], "cannot read memory size"),
    (["--data", "/nonexistent/x.csv"], "data file not found"),
    (["--precision", "fp8"], "unknown --precision"),
    (["--model", "/nonexistent/model"], "model folder not found"),
    (["--model", "./nosuch"], r"model folder not found: \./nosuch \("),  # as given (a fresh user saw "nosuch")
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--compile", "maybe"], "unknown --compile"),
    (["--lr", "nan"], "must be positive and finite"),
    (["--lr", "inf"], "--lr must be positive and finite"),
    (["--lr", "-1"], "^tightfit: error: --lr must be positive and finite, not -1.0$"),
    (["--epochs", "0"], "^tightfit: error: --epochs must be positive"),
    (["--train-samples", "0"], "--train-samples must be >= 1"),
    (["--log-every", "0"], "--log-every must be >= 1"),
    (["--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"),
    (["--text-column", "review"], "name columns of a --data file"),
    (["--seq-len", "2000"], "exceeds the model's 512 positions"),
    (["--precision", "bf16", "--device", "cpu"], "needs a CUDA GPU"),
    (["--compile", "on", "--device", "cpu"], "--compile on needs a CUDA GPU"),
])
def test_cli_bad_input_exit_2_and_nothing_written(tmp_path, capsys, args, match):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tightfit: error:") and len(err.splitlines()) == 1
    import re
    assert re.search(match, err), err
    assert not out.exists()


def test_cli_unknown_column(tmp_path, capsys):
    f = _csv(tmp_path, "review,stars\ngreat,5\nawful,1\n")
    out = tmp_path / "run"
    assert main(["train", "--data", str(f), "--text-column", "review", "--label-column", "label",
                 "--out", str(out)]) == 2
    assert "no column 'label'" in capsys.readouterr().err
    assert not out.exists()


def test_blank_rows_skipped_and_bom_read(tmp_path):
    f = tmp_path / "excel.csv"
    f.write_bytes("\ufeffreview,label\ngood,pos\n,neg\nbad,\nawful,neg\n".encode("utf-8"))
    d = load_text_classification(f, "review", "label")
    assert d.texts == ["good", "awful"] and d.label_names == ["neg", "pos"] and d.skipped_blank == 2


def test_rows_labelled_minus_100_are_skipped_as_unlabelled_not_a_class(tmp_path, caplog):
    """-100 is Hugging Face's ignore index: a row so labelled has no label. It was a class "-100",
    trained on and counted in the conflicting-labels note."""
    import logging

    f = tmp_path / "d.csv"
    rows = ["review,label"] + [f"text {i},{i % 2}" for i in range(40)] + ["text 0,-100", "other,-100", "third, -100 "]
    f.write_text("\n".join(rows) + "\n")
    d = load_text_classification(f, "review", "label")
    assert d.label_names == ["0", "1"] and len(d.texts) == 40 and d.skipped_unlabelled == 3 and d.skipped_blank == 0
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--data", str(f), "--text-column", "review", "--max-steps", "1", "--device", "cpu",
                     "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "3 rows labelled -100 (no label, as in Hugging Face's losses) were skipped" in caplog.text
    assert "'-100'" not in caplog.text  # no class of that name, nor a conflict with one


def test_a_subset_of_the_samples_is_the_same_in_every_run():
    """--train-samples / --eval-samples take the same samples in every run and its resume: the
    choice is seeded by itself, whatever the process's random state, and pinned (a change would
    make a resume of an older run refuse its data)."""
    import random

    random.seed(1)
    a = take(list(range(100)), 10)
    random.seed(2)
    assert a == take(list(range(100)), 10) == [15, 25, 30, 33, 40, 53, 54, 58, 60, 74]
    assert take(list(range(100)), None) == take(list(range(100)), 100) == list(range(100))


def test_out_is_a_file(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["train", "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_profile_file_with_wrong_entries(tmp_path, monkeypatch):
    from tightfit.devices import load_profiles
    f = tmp_path / "p.json"
    f.write_text('["my-card"]')
    monkeypatch.setenv("TIGHTFIT_GPU_PROFILES", str(f))
    with pytest.raises(TightfitError, match="malformed GPU profile"):
        load_profiles()


def test_profile_file_with_missing_fields_is_one_line_naming_them(tmp_path, monkeypatch, capsys):
    """A missing field raised a KeyError shown as "malformed GPU profile 'my-card': 'total_bytes'"."""
    import json
    f = tmp_path / "p.json"
    f.write_text(json.dumps([{"key": "my-card", "name": "My Card", "compute_capability": [7, 5], "bf16": False,
                              "fp32_tflops": 6.0, "bf16_tflops": 0.0, "host_link_bytes_per_s": 12e9}]))
    monkeypatch.setenv("TIGHTFIT_GPU_PROFILES", str(f))
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "my-card"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert "malformed GPU profile 'my-card': missing fields total_bytes, fp16_tensor_cores, fp16_tflops" in err, err


def test_written_files_get_the_usual_mode(tmp_path):
    import os
    from tightfit.fileio import atomic_write_text
    atomic_write_text(tmp_path / "a.txt", "x")
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask


def test_precision_the_device_cannot_run_is_refused_before_any_output(tmp_path, capsys):
    assert main(["train", "--precision", "fp16", "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "needs a CUDA GPU" in err


def test_options_written_on_the_command_line_are_known_abbreviated_or_not():
    from tightfit.cli import _given_options, _parser
    p = _parser()
    argv = ["train", "--resume", "run", "--max-sk=20", "--lr", "5e-5", "--batch", "8"]
    p.parse_args(argv)  # argparse accepts these abbreviations
    assert _given_options(p.train_parser, argv) == ("resume", "max_skipped_steps", "lr", "batch_size")


def test_a_python_api_run_records_no_foreign_command_line(monkeypatch):
    import sys
    from tightfit.api import TrainRequest
    monkeypatch.setattr(sys, "argv", ["my_script.py", "--my-flag", "5"])
    assert TrainRequest().run.command == "tightfit.api.train (Python API)"
    monkeypatch.setattr(sys, "argv", ["/home/me/tightfit_myexp.py", "--my-flag", "7"])  # a user's script
    assert TrainRequest().run.command == "tightfit.api.train (Python API)"
    from tightfit.cli import _parser
    args = _parser().parse_args(["train", "--lr", "1e-4"])
    args.command_line = "tightfit train --lr 1e-4"  # as the command line's entry point sets it
    assert TrainRequest.from_args(args).run.command == "tightfit train --lr 1e-4"


def _python_collate(tb, encoded, labels, indices, pad_to=None):
    """The reference: each sample's token lists padded in Python (the collate before the flat tensors)."""
    longest = max(len(encoded["input_ids"][i]) for i in indices)
    length = pad_to or min(tb.seq_len, -(-longest // 8) * 8)
    out = {}
    for k in tb.keys:
        fill = tb.pad_id if k == "input_ids" else 0
        out[k] = torch.tensor([encoded[k][i][:length] + [fill] * (length - len(encoded[k][i][:length]))
                               for i in indices], dtype=torch.long)
    out["labels"] = torch.tensor([labels[i] for i in indices], dtype=torch.long)
    return out


def test_text_batches_collate_exactly_what_padding_each_sample_gives(tmp_path):
    """TextBatches keeps the tokens in flat tensors; its batches equal the token lists padded one by
    one (pad id in input_ids, 0 in the mask and token types, cut at pad_to), for text pairs too."""
    import random

    from transformers import AutoTokenizer

    from conftest import tiny_text_model_folder
    from tightfit.data import TextClassificationData
    from tightfit.workload import TextBatches

    words = ["good", "bad", "film", "plot", "long"]
    tok = AutoTokenizer.from_pretrained(tiny_text_model_folder(tmp_path, words, hidden_size=8, num_hidden_layers=1,
                                                               num_attention_heads=2, intermediate_size=8))
    tok.pad_token_id = 3  # not 0: padding must use it
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 40))) for _ in range(60)]
    labels = [rng.randint(0, 2) for _ in texts]
    tb = TextBatches(tok, TextClassificationData(texts, labels, ["a", "b", "c"], "test"), 24)
    encoded = tok(texts, truncation=True, max_length=24)
    assert tb.keys == ["input_ids", "attention_mask", "token_type_ids"]
    for indices, pad_to in [([0], None), (list(range(60)), None), ([5, 5, 59, 1], None), ([3, 7, 11], 24),
                            ([3, 7, 11], 4), (rng.sample(range(60), 17), None)]:
        got, want = tb.collate(indices, pad_to), _python_collate(tb, encoded, labels, indices, pad_to)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == torch.long and torch.equal(got[k], want[k]), (indices, pad_to, k)
    assert tb[7] == {**{k: encoded[k][7] for k in tb.keys}, "labels": labels[7]}
    assert tb.worst_case(3)["input_ids"].shape == (3, 24)


def test_a_quote_left_open_is_named_by_its_record_and_line(tmp_path):
    from tightfit.data import _read_rows as load_rows

    rows = ["review,sentiment"] + [f"text {i},{'pos' if i % 2 else 'neg'}" for i in range(20)]
    rows += ['"open quote,pos'] + [f"more {i},neg" for i in range(20)]
    path = tmp_path / "quote.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"at record 21, from line 22 \(a quote opened there and never closed\)"):
        load_rows(path)


def test_a_bad_default_data_file_is_named_by_its_variable(tmp_path, monkeypatch):
    from tightfit.data import load_default

    monkeypatch.setenv("TIGHTFIT_DEFAULT_DATA", str(tmp_path / "none.csv"))
    with pytest.raises(TightfitError, match=r"^TIGHTFIT_DEFAULT_DATA=.*none.csv .*give other data with --data\): "):
        load_default()


def test_a_quote_left_open_in_the_header_is_named_as_the_header(tmp_path):
    from tightfit.data import _read_rows

    path = tmp_path / "h.csv"
    path.write_text('"text,label\nsome text,pos\n')
    with pytest.raises(TightfitError, match=r"at the header, from line 1 \(a quote opened there"):
        _read_rows(path)
