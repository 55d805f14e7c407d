"""Input faults found by a fresh user (report 3): ``max_grad_norm`` negative, 0 or NaN (gradient
ascent, frozen or NaN weights); the other Python-only training options unchecked; a ``--seed``
torch cannot take and a huge ``--epochs`` (tracebacks); the Python API's errors naming the command
line's flags; no upper bound on ``--image-size`` (the process OOM-killed after writing a run folder)."""

import math

import pytest
import torch

import tightfit
from tightfit import Plan
from tightfit.api import TrainRequest, train
from tightfit.cli import main
from tightfit.errors import TightfitError


def _error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tightfit: error: "), err
    return lines[0]


def _refused(tmp_path, capsys, *options) -> str:
    """``tightfit train OPTIONS``: exit code 2, one line on stderr, nothing written."""
    out = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "no-model"), "--out", str(out), *options]) == 2
    line = _error_line(capsys)
    assert not out.exists() and not list(tmp_path.iterdir()), list(tmp_path.iterdir())
    return line


# ---- 1: max_grad_norm negative (gradient ascent), 0 (frozen) or NaN (NaN weights) was accepted

@pytest.mark.parametrize("norm", [-1.0, 0, 0.0, math.nan, math.inf, -math.inf])
def test_a_bad_max_grad_norm_is_refused_by_the_request_and_the_config(norm):
    from tightfit.runtime.trainer import TrainConfig

    message = r"^max_grad_norm must be positive and finite, or None for no clipping, not "
    with pytest.raises(TightfitError, match=message):
        TrainRequest(max_grad_norm=norm)
    with pytest.raises(TightfitError, match=message):
        TrainConfig(max_grad_norm=norm)


@pytest.mark.parametrize("norm", [-1.0, 0, math.nan, math.inf])
def test_a_bad_max_grad_norm_is_refused_by_train_step_before_any_work(norm):
    model = torch.nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TightfitError, match=r"^max_grad_norm must be positive and finite, or None"):
        tightfit.TrainStep(Plan("fp32", 4, 8), model, torch.optim.SGD(model.parameters(), lr=0.1),
                           loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), max_grad_norm=norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for good in (None, 1.0, 1, 1e-3):  # None: measure only; a positive number: clip
        tightfit.TrainStep(Plan("fp32", 4, 8), model, max_grad_norm=good)


@pytest.mark.parametrize("options, message", [
    ({"grow_back_after": -1}, "^grow_back_after must be >= 0 "),
    ({"max_skipped_steps": 0}, "^max_skipped_steps must be >= 1"),
    ({"lr": -1.0}, "^lr must be positive and finite"),
])
def test_train_step_checks_its_other_options_as_train_does(options, message):
    with pytest.raises(TightfitError, match=message):
        tightfit.TrainStep(Plan("fp32", 4, 8), torch.nn.Linear(4, 2), **options)


# ---- 2: warmup_ratio, weight_decay and grow_back_after unchecked (weight_decay=nan: torch's ValueError)

@pytest.mark.parametrize("options, message", [
    ({"warmup_ratio": 5.0}, r"^warmup_ratio must be between 0 and 1 \(a share of the optimizer steps\), not 5.0$"),
    ({"warmup_ratio": -0.5}, r"^warmup_ratio must be between 0 and 1 "),
    ({"warmup_ratio": math.nan}, r"^warmup_ratio must be between 0 and 1 "),
    ({"weight_decay": math.nan}, r"^weight_decay must be finite and >= 0, not nan$"),
    ({"weight_decay": -1}, r"^weight_decay must be finite and >= 0, not -1$"),
    ({"weight_decay": math.inf}, r"^weight_decay must be finite and >= 0, not inf$"),
    ({"grow_back_after": -1}, r"^grow_back_after must be >= 0 \(0: never\)$"),
])
def test_python_only_training_options_are_checked(options, message):
    from tightfit.runtime.trainer import TrainConfig

    with pytest.raises(TightfitError, match=message):
        TrainRequest(**options)
    with pytest.raises(TightfitError, match=message):
        TrainConfig(**options)


def test_python_only_training_options_at_their_limits_are_accepted():
    req = TrainRequest(warmup_ratio=0, weight_decay=0, grow_back_after=0, max_grad_norm=None)
    assert (req.training.warmup_ratio, req.training.weight_decay, req.training.grow_back_after) == (0, 0, 0)
    assert TrainRequest(warmup_ratio=1.0).training.warmup_ratio == 1.0


# ---- 4: a seed torch.manual_seed cannot take gave a traceback (exit 1)

@pytest.mark.parametrize("seed", [str(2**64), str(-2**63 - 1), "99999999999999999999999"])
def test_an_out_of_range_seed_is_refused_in_one_line(tmp_path, capsys, seed):
    line = _refused(tmp_path, capsys, "--seed", seed)
    assert line == f"tightfit: error: --seed must be between -2**63 and 2**64-1 (the seeds torch takes), not {seed}"
    with pytest.raises(TightfitError, match=r"^seed must be between -2\*\*63 and 2\*\*64-1"):
        TrainRequest(seed=int(seed))


def test_the_seeds_at_the_ends_of_the_range_seed_everything():
    from tightfit.rng import seed_everything

    for seed in (-2**63, 2**64 - 1):
        TrainRequest(seed=seed)
        seed_everything(seed)
    seed_everything(2**64 - 1 + 1_000_003)  # a rank's seed derived from the largest: no overflow
    seed_everything(-5)
    a = torch.rand(3)
    torch.manual_seed(-5)  # torch's own reading of a negative seed: unchanged
    assert torch.equal(a, torch.rand(3))


# ---- 5: a huge --epochs gave OverflowError (float infinity to int)

@pytest.mark.parametrize("epochs, shown", [("1e308", "1e+308"), ("2e9", "2e+09")])
def test_a_huge_epochs_is_refused_in_one_line(tmp_path, capsys, epochs, shown):
    line = _refused(tmp_path, capsys, "--epochs", epochs)
    assert line == ("tightfit: error: --epochs must be at most 1e9: each epoch is at least one optimizer step, "
                    f"and a run of billions of steps would not end; not {shown}")
    with pytest.raises(TightfitError, match="^epochs must be at most 1e9"):
        TrainRequest(epochs=float(epochs))
    with pytest.raises(TightfitError, match=r"^epochs must be at most 1e9.*not about 10\*\*400$"):
        TrainRequest(epochs=10**400)  # an int too large for a float: no OverflowError from the check either
    assert TrainRequest(epochs=1e9).training.epochs == 1e9


# ---- 7: the Python API's errors named the command line's flags

@pytest.mark.parametrize("options, python, cli", [
    ({"batch_size": 0}, "batch_size must be >= 1", "--batch-size must be >= 1"),
    ({"lr": "1e-3"}, "lr must be a number, not '1e-3' (a str)", None),
    ({"precision": "fp8"}, "unknown precision='fp8'; use auto, fp32, fp16 or bf16",
     "unknown --precision 'fp8'; use auto, fp32, fp16 or bf16"),
    ({"full": True, "train_samples": 10}, "full=True trains on all training samples; train_samples=10 chooses 10: "
                                          "give one",
     "--full trains on all training samples; --train-samples N chooses N: give one"),
    ({"warn_temp": 200}, "warn_temp must be a GPU temperature in deg C between 0 and 150, not 200",
     "--warn-temp must be a GPU temperature in deg C between 0 and 150, not 200.0"),  # argparse made it a float
    ({"model": " "}, "model is empty: give a model name or folder, or leave model out for the shipped "
                     "all-MiniLM-L6-v2", "--model is empty: give a model name or folder, or leave --model out for the "
                                         "shipped all-MiniLM-L6-v2"),
    ({"text_column": "t"}, "text_column, label_column and image_column name columns of a data file; the shipped "
                           "data has its own", "--text-column, --label-column and --image-column name columns of a "
                                               "--data file; the shipped data has its own"),
])
def test_python_api_errors_name_keywords_and_the_command_line_flags(tmp_path, capsys, options, python, cli):
    with pytest.raises(TightfitError) as e:
        TrainRequest(**options)
    assert str(e.value) == python
    if cli is not None:  # the same value from the command line: its flag
        argv = []
        for key, value in options.items():
            argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
        assert _refused(tmp_path, capsys, *argv) == f"tightfit: error: {cli}"


def test_an_unknown_column_is_named_as_its_user_gave_it(tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"t{i},{i % 2}\n" for i in range(8)))
    with pytest.raises(TightfitError, match=r"no column 'nope' \(text_column\); columns are") as e:
        train(TrainRequest(data=str(data), text_column="nope", out=str(tmp_path / "r"), progress=False))
    assert "--" not in str(e.value)
    assert main(["train", "--data", str(data), "--text-column", "nope", "--out", str(tmp_path / "r2")]) == 2
    assert "no column 'nope' (--text-column); columns are" in _error_line(capsys)


def test_errors_raised_while_a_run_is_set_up_name_the_python_arguments_too(tmp_path, capsys):
    """Past the option checks (the run folder, --resume, the device): from Python the argument and
    its value as written in Python, from the command line the flag."""
    a_file = tmp_path / "f"
    a_file.write_text("x")
    cases = [(dict(out=str(a_file)), f"out='{a_file}' is a file, not a folder", ["--out", str(a_file)],
              f"--out {a_file} is a file, not a folder"),
             (dict(resume=str(tmp_path)), f"resume='{tmp_path}': not a tightfit run folder (no request.json)",
              ["--resume", str(tmp_path)], f"--resume {tmp_path}: not a tightfit run folder (no request.json)")]
    if not torch.cuda.is_available():
        cases.append((dict(device="cuda", out=str(tmp_path / "r")), "device='cuda', but no CUDA GPU is visible",
                      ["--device", "cuda", "--out", str(tmp_path / "r")], "--device cuda, but no CUDA GPU is visible"))
    for options, python, argv, cli in cases:
        with pytest.raises(TightfitError) as e:
            train(TrainRequest(progress=False, **options))
        assert str(e.value) == python
        assert main(["train", "--no-progress", *argv]) == 2
        assert _error_line(capsys) == f"tightfit: error: {cli}"


# ---- 11: no upper bound on --image-size (20000 px: OOM-killed after writing a run folder)

def test_an_image_size_above_the_bound_is_refused_before_any_work(tmp_path, capsys):
    line = _refused(tmp_path, capsys, "--data", "digits", "--image-size", "20000")
    assert line.startswith("tightfit: error: --image-size must be at most 4096 pixels"), line
    assert line.endswith("not 20000"), line
    with pytest.raises(TightfitError, match="^image_size must be at most 4096 pixels"):
        TrainRequest(image_size=4097)
    assert TrainRequest(image_size=4096).workload.image_size == 4096


def test_plan_refuses_the_image_size_train_refuses(capsys):
    assert main(["plan", "--model", "resnet50", "--image-size", "20000", "--batch-size", "4", "--gpu", "t4"]) == 2
    assert _error_line(capsys).startswith("tightfit: error: --image-size must be at most 4096 pixels")


# ---- review 5: errors of a run still named the command line's flags from the Python API

def _both_faces(tmp_path, capsys, options, python, argv, cli):
    """``train(TrainRequest(**options))`` raises ``python``; ``tightfit train ARGV`` says ``cli``."""
    with pytest.raises(TightfitError) as e:
        train(TrainRequest(progress=False, device="cpu", **options))
    assert str(e.value) == python
    capsys.readouterr()
    assert main(["train", "--no-progress", "--device", "cpu", *argv]) == 2
    assert _error_line(capsys) == f"tightfit: error: {cli}"


def test_the_run_folder_and_data_errors_name_the_python_arguments(tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    _both_faces(tmp_path, capsys, dict(out=str(full)),
                f"output folder {full} exists and is not empty; choose another out", ["--out", str(full)],
                f"output folder {full} exists and is not empty; choose another --out")
    # through a folder that does not exist yet ("new/.." resolves only once "new" exists): refused too
    through = str(tmp_path / "new" / ".." / "full")
    _both_faces(tmp_path, capsys, dict(out=through),
                f"output folder {full} exists and is not empty; choose another out", ["--out", through],
                f"output folder {full} exists and is not empty; choose another --out")
    assert (full / "x").read_text() == "x" and not (tmp_path / "new").exists()
    images = tmp_path / "images"
    images.mkdir()
    _both_faces(tmp_path, capsys, dict(data=str(images), out=str(tmp_path / "r1")),
                f"data='{images}' is a folder, read as images (one subfolder per class), but the default model is "
                "a text model: give an image model (model='resnet50', model='vit-b16', or a folder of an image "
                "classifier), or for text one CSV, TSV or JSONL file",
                ["--data", str(images), "--out", str(tmp_path / "r1")],
                f"--data {images} is a folder, read as images (one subfolder per class), but the default model is "
                "a text model: give an image model (--model resnet50, --model vit-b16, or a folder of an image "
                "classifier), or for text one CSV, TSV or JSONL file")
    _both_faces(tmp_path, capsys, dict(data="/dev/null", out=str(tmp_path / "r2")),
                "/dev/null is not a regular file; data takes one CSV, TSV or JSONL file",
                ["--data", "/dev/null", "--out", str(tmp_path / "r2")],
                "/dev/null is not a regular file; --data takes one CSV, TSV or JSONL file")
    _both_faces(tmp_path, capsys, dict(model="resnet50", out=str(tmp_path / "r3")),
                "resnet50 is an image model: give data (digits, a folder with one subfolder per class, or a CSV "
                "of image paths and labels)", ["--model", "resnet50", "--out", str(tmp_path / "r3")],
                "resnet50 is an image model: give --data (digits, a folder with one subfolder per class, or a CSV "
                "of image paths and labels)")


def test_the_seq_len_and_precision_errors_name_the_python_arguments(tmp_path, capsys):
    from conftest import tiny_text_model_folder

    model = tiny_text_model_folder(tmp_path, ["good", "bad"], hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"{' '.join([('good' if i % 2 else 'bad')] * (1 + i % 7))},{i % 2}\n" for i in range(40)))
    common = dict(model=str(model), data=str(data))
    argv = ["--model", str(model), "--data", str(data)]
    for i, (options, python, flags, cli) in enumerate([
            (dict(seq_len=100), "seq_len=100 exceeds the model's 64 positions: give seq_len=64 or less",
             ["--seq-len", "100"], "--seq-len 100 exceeds the model's 64 positions: give --seq-len 64 or less"),
            (dict(seq_len=3), "seq_len=3 leaves 1 token of text after the 2 special tokens ([CLS], [SEP]); use at "
                              "least 8", ["--seq-len", "3"],
             "--seq-len 3 leaves 1 token of text after the 2 special tokens ([CLS], [SEP]); use at least 8"),
            (dict(precision="bf16"), "precision='bf16' needs a CUDA GPU; on the CPU use fp32", ["--precision", "bf16"],
             "--precision bf16 needs a CUDA GPU; on the CPU use fp32")]):
        out = str(tmp_path / f"r{i}")
        _both_faces(tmp_path, capsys, {**common, **options, "out": out}, python, [*argv, *flags, "--out", out], cli)


def test_the_resume_refusal_and_note_name_the_python_arguments(tmp_path, capsys, caplog):
    import logging

    from conftest import tiny_text_model_folder
    from tightfit.api import TrainRecipe, _resume_request

    model = tiny_text_model_folder(tmp_path, ["good", "bad"], hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"{' '.join([('good' if i % 2 else 'bad')] * (1 + i % 7))},{i % 2}\n" for i in range(40)))
    run = tmp_path / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--batch-size", "4", "--max-steps", "1",
                 "--lr", "1e-3", "--seq-len", "16", "--out", str(run), "--no-progress", "--device", "cpu"]) == 0
    with pytest.raises(TightfitError) as e:
        train(TrainRequest(resume=str(run), epochs=5, progress=False))
    assert str(e.value).startswith(f"resume='{run}' continues the run with the options it was started with "), e.value
    assert "cannot change epochs " in str(e.value) and "--" not in str(e.value)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--epochs", "5", "--no-progress"]) == 2
    assert _error_line(capsys).startswith(f"tightfit: error: --resume {run} continues the run with the options ")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        _resume_request(TrainRequest(resume=str(run), lr=1e-4))
        assert "note:" not in caplog.text  # shown once the run's checks have passed (setup), not before
        TrainRecipe(TrainRequest(resume=str(run), lr=1e-4, progress=False)).setup()  # checks and plans; writes nothing
    assert "note: resume with lr=0.0001 (the run had 0.001)" in caplog.text, caplog.text
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--lr", "1e-4", "--no-progress"]) == 0
    assert "note: --resume with --lr 0.0001 (the run had 0.001)" in capsys.readouterr().out


# ---- review 6: option checks let ints beyond a float through; TrainStep took any warn_temp_c

@pytest.mark.parametrize("name", ["lr", "max_grad_norm", "max_steps", "weight_decay"])
def test_an_int_too_large_for_a_float_is_refused_in_one_line(name):
    from tightfit.runtime.trainer import TrainConfig

    for make in (TrainRequest, TrainConfig):
        with pytest.raises(TightfitError) as e:
            make(**{name: 10**400})
        assert str(e.value).startswith(f"{name} must be "), e.value
        assert str(e.value).endswith("not about 10**400 (more than a float holds)"), e.value
    with pytest.raises(TightfitError, match=r"^epochs must be at most 1e9.*not about 10\*\*400$"):
        TrainRequest(epochs=10**400)
    assert TrainRequest(**{name: 10**20}).to_flat()[name] == 10**20  # large but a float holds it


@pytest.mark.parametrize("options, message", [
    ({"lr": 10**400}, r"^lr must be positive and finite, not about 10\*\*400 \(more than a float holds\)$"),
    ({"max_grad_norm": 10**400}, r"^max_grad_norm must be positive and finite, or None for no clipping, not about "
                                 r"10\*\*400 \(more than a float holds\)$"),
    ({"warn_temp_c": 500}, r"^warn_temp_c must be a GPU temperature in deg C between 0 and 150, not 500$"),
    ({"warn_temp_c": math.nan}, r"^warn_temp_c must be a GPU temperature in deg C between 0 and 150, not nan$"),
])
def test_train_step_refuses_a_huge_int_and_a_bad_warn_temp(options, message):
    with pytest.raises(TightfitError, match=message):
        tightfit.TrainStep(Plan("fp32", 4, 8), torch.nn.Linear(4, 2), **options)
    tightfit.TrainStep(Plan("fp32", 4, 8), torch.nn.Linear(4, 2), warn_temp_c=90)


def test_an_epochs_just_above_the_limit_is_shown_with_its_digits(tmp_path, capsys):
    line = _refused(tmp_path, capsys, "--epochs", "1000000001")
    assert line.endswith("would not end; not 1000000001"), line
    with pytest.raises(TightfitError, match=r"would not end; not 1000000000.5$"):
        TrainRequest(epochs=1e9 + 0.5)
    with pytest.raises(TightfitError, match=r"would not end; not 1000000001$"):
        TrainRequest(epochs=1_000_000_001)
