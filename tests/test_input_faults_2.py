"""Input that a fresh user found answered wrongly: a CSV header that repeats a column name (a false
field-count error), list- or dict-valued JSONL labels and texts (stringified into classes such as
"['pos']"), --full with --train-samples (one silently won), and Python API options of the wrong
type (a raw TypeError)."""

import json

import pytest

from tightfit.api import _resume_request, train
from tightfit.cli import main
from tightfit.config import TrainRequest
from tightfit.data import load_text_classification
from tightfit.errors import TightfitError

WORDS = "film plot actor scene great dull awful superb boring moving".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from conftest import tiny_text_model_folder

    return tiny_text_model_folder(tmp_path_factory.mktemp("tiny"), WORDS, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)


def _rows(n=40):
    return [(f"{WORDS[i % len(WORDS)]} {WORDS[(i * 3) % len(WORDS)]} film", "pos" if i % 2 else "neg")
            for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _one_error_line(capsys, argv):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("tightfit: error: ") and err.count("\n") == 1, err
    return err


# ---------------------------------------------------------------- 1: a header that repeats a column name
def test_csv_header_repeating_a_column_is_named(model_dir, tmp_path, capsys):
    data = tmp_path / "dup3.csv"
    data.write_text("review,sentiment,review\n" + "".join(f"{t},{y},{t}\n" for t, y in _rows()))
    err = _one_error_line(capsys, ["train", "--data", str(data), "--model", str(model_dir), "--device", "cpu",
                                   "--text-column", "review", "--label-column", "sentiment",
                                   "--out", str(tmp_path / "run")])
    assert "dup3.csv" in err and "repeats the column name 'review'" in err and "fields" not in err
    assert not (tmp_path / "run").exists()


def test_tsv_header_repeating_a_column_is_named(tmp_path):
    data = tmp_path / "dup.tsv"
    data.write_text("text\tlabel\tlabel\n" + "".join(f"{t}\t{y}\t{y}\n" for t, y in _rows()))
    with pytest.raises(TightfitError, match=r"repeats the column name 'label' \(columns 2 and 3\)"):
        load_text_classification(data)


# ---------------------------------------------------------------- 2: list/dict values in a JSONL column
@pytest.mark.parametrize("wrap, kind", [(lambda y: [y], "a list"), (lambda y: {"class": y}, "a dict")])
def test_jsonl_label_holding_a_list_or_dict_is_refused(tmp_path, wrap, kind):
    data = _write_jsonl(tmp_path / "labels.jsonl", [{"review": t, "sentiment": wrap(y)} for t, y in _rows()])
    with pytest.raises(TightfitError) as e:
        load_text_classification(data, "review", "sentiment")
    msg = str(e.value)
    assert "labels.jsonl" in msg and f"label column 'sentiment' holds {kind} (" in msg and "in row 1" in msg
    assert "labels must be strings or numbers" in msg and "\n" not in msg


def test_jsonl_text_holding_a_list_is_refused(tmp_path):
    data = _write_jsonl(tmp_path / "texts.jsonl", [{"review": [t], "sentiment": y} for t, y in _rows()])
    with pytest.raises(TightfitError, match=r"texts.jsonl: text column 'review' holds a list \(.*\) in row 1; "
                                            r"texts must be strings"):
        load_text_classification(data, "review", "sentiment")


def test_jsonl_list_label_is_one_line_from_the_command_line(model_dir, tmp_path, capsys):
    data = _write_jsonl(tmp_path / "labels.jsonl", [{"review": t, "sentiment": [y]} for t, y in _rows()])
    err = _one_error_line(capsys, ["train", "--data", str(data), "--model", str(model_dir), "--device", "cpu",
                                   "--text-column", "review", "--label-column", "sentiment",
                                   "--out", str(tmp_path / "run")])
    assert "label column 'sentiment' holds a list (['neg'])" in err


@pytest.mark.parametrize("label, names", [(lambda i: i % 2 + 0.5, ["0.5", "1.5"]),
                                          (lambda i: bool(i % 2), ["False", "True"]),
                                          (lambda i: i % 2, ["0", "1"])])
def test_jsonl_number_and_bool_labels_still_load(tmp_path, label, names):
    data = _write_jsonl(tmp_path / "ok.jsonl", [{"text": t, "label": label(i)} for i, (t, _) in enumerate(_rows())])
    assert load_text_classification(data).label_names == names


# ---------------------------------------------------------------- 3: --full with --train-samples
FULL_AND_N = "--full trains on all training samples; --train-samples N chooses N: give one"


def test_full_with_train_samples_is_refused_before_any_work(tmp_path, capsys):
    err = _one_error_line(capsys, ["train", "--full", "--train-samples", "200", "--model", str(tmp_path / "none"),
                                   "--out", str(tmp_path / "run")])
    assert err == f"tightfit: error: {FULL_AND_N}\n"  # before the missing model folder is noticed
    with pytest.raises(TightfitError, match=r"^full=True trains on all training samples; train_samples=200 chooses 200"):
        TrainRequest(full=True, train_samples=200)  # the Python API names its keywords, not the flags


def test_full_with_eval_samples_is_accepted():
    req = TrainRequest(full=True, eval_samples=50)
    assert (req.run.full, req.run.train_samples, req.run.eval_samples) == (True, None, 50)


def test_resume_of_a_run_started_with_full_and_train_samples(tmp_path, monkeypatch):
    """A run folder written before the pair was refused resumes as it trained: on --train-samples."""
    from tightfit.runtime import checkpoint

    run = tmp_path / "run"
    (run / "checkpoints" / "ckpt-2").mkdir(parents=True)
    record = {**TrainRequest(train_samples=200).to_flat(), "full": True}
    record = {k: v for k, v in record.items() if k not in ("progress", "resume", "given")}
    (run / "request.json").write_text(json.dumps({**record, "data_fingerprint": "x"}))
    monkeypatch.setattr(checkpoint, "latest_intact_checkpoint",
                        lambda folder: checkpoint.ResumePoint(folder / "ckpt-2"))
    resumed, point, changed, fingerprint, _ = _resume_request(TrainRequest(resume=str(run)))
    assert (resumed.run.full, resumed.run.train_samples, changed, fingerprint) == (False, 200, {}, "x")


# ---------------------------------------------------------------- 4: API options of the wrong type
# (named by the Python API's keywords since the fresh user's report 3, item 7; the command line
# names its flags: tests/test_input_faults_4.py)
@pytest.mark.parametrize("options, message", [
    ({"batch_size": "32"}, "batch_size must be a whole number, not '32' (a str)"),
    ({"seq_len": 64.5}, "seq_len must be a whole number, not 64.5 (a float)"),
    ({"batch_size": True}, "batch_size must be a whole number, not True (a bool)"),
    ({"batch_size": None}, "batch_size must be a whole number, not None"),
    ({"image_size": "16"}, "image_size must be a whole number, not '16' (a str)"),
    ({"max_steps": "5"}, "max_steps must be a whole number, not '5' (a str)"),
    ({"seed": "1"}, "seed must be a whole number, not '1' (a str)"),
    ({"log_every": 2.0}, "log_every must be a whole number, not 2.0 (a float)"),
    ({"train_samples": "200"}, "train_samples must be a whole number, not '200' (a str)"),
    ({"epochs": "3"}, "epochs must be a number, not '3' (a str)"),
    ({"lr": "1e-4"}, "lr must be a number, not '1e-4' (a str)"),
    ({"warn_temp": "80"}, "warn_temp must be a number, not '80' (a str)"),
    ({"weight_decay": "0.1"}, "weight_decay must be a number, not '0.1' (a str)"),
    ({"max_grad_norm": [1.0]}, "max_grad_norm must be a number, not [1.0] (a list)"),
])
def test_numeric_options_of_the_wrong_type_are_named(options, message):
    with pytest.raises(TightfitError) as e:
        TrainRequest(**options)
    assert str(e.value) == message


def test_api_batch_size_as_a_string_is_a_tightfit_error(tmp_path):
    with pytest.raises(TightfitError, match="^batch_size must be a whole number"):
        train(TrainRequest(model="tinybert", data="reviews.csv", text_column="review", label_column="sentiment",
                           batch_size="32", out=str(tmp_path / "x")))


def test_numbers_of_the_other_kind_that_fit_are_accepted():
    req = TrainRequest(epochs=2, lr=1, warn_temp=80, max_grad_norm=None, max_steps=None, image_size=None)
    assert (req.training.epochs, req.training.lr, req.training.warn_temp_c) == (2, 1, 80)


@pytest.mark.parametrize("options, flag", [({"full": "no"}, "full"), ({"progress": 0}, "progress"),
                                           ({"replan": "yes"}, "replan")])
def test_switches_of_the_wrong_type_are_named(options, flag):
    """`TrainRequest(full="no")` trained on all samples: any non-empty string is true."""
    with pytest.raises(TightfitError, match=f"^{flag} must be True or False, not "):
        TrainRequest(**options)
    TrainRequest(**{k: False for k in options})
