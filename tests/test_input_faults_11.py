"""Faults a fresh user found in session 35 (resume of damaged run folders, data, plans), each kept
as a test that fails when the fault comes back."""

import json
import shutil

import pytest

from tightfit.errors import TightfitError


# ---- data


def _stars(n: int) -> list[str]:
    return ["text,stars"] + [f"review {i} of the place,{1 + i % 5}" for i in range(n)]


def test_a_quoted_multi_line_text_with_one_comma_ending_in_a_label_still_loads(tmp_path):
    """'Rating 4,5' inside a correctly quoted text read as a merged record (5 is a label)."""
    from tightfit.data import load_text_classification

    rows = _stars(30)
    rows[1] = '"Review 0: good food\nRating 4,5\nwould come back",1'
    (tmp_path / "stars.csv").write_text("\n".join(rows) + "\n")
    data = load_text_classification(tmp_path / "stars.csv", label_column="stars")
    assert len(data.texts) == 30 and data.texts[0] == "Review 0: good food\nRating 4,5\nwould come back"


def test_a_quote_left_open_over_one_whole_record_is_still_refused(tmp_path):
    """Two columns now need two lines of a field that read as records: the open record's own
    first line and the one record it swallowed whole are two."""
    from tightfit.data import load_text_classification

    rows = _stars(30)
    rows[10] = '"Wow boring from the start,2'
    rows[12] = 'the end",3'
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"record 10 .*unbalanced"):
        load_text_classification(tmp_path / "d.csv", label_column="stars")


# ---- resume of a damaged run folder


def _short_run(tmp_path, steps=6, every=2, keep=5):
    from conftest import tiny_cpu_job

    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", str(steps),
                 "--checkpoint-every", str(every), "--keep-last", str(keep), "--seq-len", "16", "--device", "cpu",
                 "--out", str(run), "--no-progress"]) == 0
    (run / "summary.json").unlink()  # as if stopped after its last checkpoint
    return run, run / "checkpoints"


def test_a_checkpoint_folder_named_for_another_step_is_skipped_not_trusted(tmp_path, caplog):
    """ckpt-50 holding step 6 was resumed from (at step 6), and its first checkpoint then deleted
    the run's intact checkpoints of later steps, and metrics.jsonl was cut back to step 6."""
    import logging

    from tightfit.cli import main

    run, ckpts = _short_run(tmp_path)
    shutil.copytree(ckpts / "ckpt-2", ckpts / "ckpt-50")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "checkpoint ckpt-50 holds step 2, not 50 (renamed or copied from elsewhere); resuming from ckpt-6" \
        in caplog.text
    assert "checkpoints/ckpt-6 at step 6" in caplog.text
    assert (ckpts / "ckpt-6").is_dir() and (ckpts / "ckpt-4").is_dir()
    steps = [json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 4 in steps  # the history up to the checkpoint resumed from is kept


def test_a_run_whose_only_checkpoint_was_displaced_resumes(tmp_path, caplog):
    """The early "no checkpoint to resume from" looked only at ckpt-N folders, before the
    displaced .ckpt-N.old was put back."""
    import logging

    from tightfit.cli import main

    run, ckpts = _short_run(tmp_path, steps=4, every=2, keep=1)
    assert [p.name for p in ckpts.iterdir()] == ["ckpt-4"]
    shutil.move(ckpts / "ckpt-4", ckpts / ".ckpt-4.old")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "note: put back ckpt-4" in caplog.text and "checkpoints/ckpt-4 at step 4" in caplog.text


def test_a_resume_past_a_corrupt_checkpoint_keeps_how_the_session_ended_and_the_fault(tmp_path):
    """The stop events after the checkpoint resumed from were cut from metrics.jsonl and the
    report, and the corrupt checkpoint skipped was only printed."""
    from tightfit.cli import main

    run, ckpts = _short_run(tmp_path)
    with open(run / "metrics.jsonl", "a") as f:  # how the first session ended, after its step-6 checkpoint
        f.write(json.dumps({"type": "event", "step": 6, "message": "stopped by SIGTERM after step 6"}) + "\n")
    with open(ckpts / "ckpt-6" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    report = (run / "report.md").read_text()
    assert "- stopped by SIGTERM after step 6" in report, report
    assert "checkpoint ckpt-6 is corrupt (model.safetensors: truncated" in report
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    messages = [r["message"] for r in events if r.get("type") == "event"]
    assert any(m.startswith("checkpoint ckpt-6 is corrupt") for m in messages)
    assert messages.count("stopped by SIGTERM after step 6") == 1


# ---- plans made or edited by hand

_PLAN = {"precision": "fp32", "micro_batch": 4, "effective_batch": 8}


@pytest.mark.parametrize("fields, says", [
    ({"reasons": None}, "reasons None is not a tuple of lines"),
    ({"reasons": 3}, "reasons 3 is not a list"),
    ({"reasons": "hello"}, "reasons 'hello' is not a list"),
    ({"checkpoint_blocks": 5}, "checkpoint_blocks 5 is not a list"),
    ({"block_policies": "full"}, "block_policies 'full' is not a list"),
    ({"checkpoint_blocks": [0, 0]}, "checkpoint_blocks (0, 0) is not a tuple of distinct block indices"),
    ({"checkpoint_blocks": [0, 1]}, "checkpoint_blocks (0, 1) with activation_checkpointing False"),
    ({"budget_bytes": "4GiB"}, "budget_bytes '4GiB' is not None or a whole number >= 1"),
    ({"budget_bytes": -5}, "budget_bytes -5 is not"),
    ({"budget_bytes": 1.5}, "budget_bytes 1.5 is not"),
    ({"trainable_params": "many"}, "trainable_params 'many' is not"),
    ({"predicted_samples_per_s": "fast"}, "predicted_samples_per_s 'fast' is not None or a number >= 0"),
])
def test_a_plan_field_of_the_wrong_kind_is_one_clear_line(fields, says):
    """reasons None or 3 raised a bare TypeError, "hello" became five reasons, and budgets of
    "4GiB", -5 or 1.5 bytes were taken."""
    from tightfit.plan import Plan

    with pytest.raises(TightfitError) as e:
        Plan.from_dict({**_PLAN, **fields})
    assert says in str(e.value)


def test_a_plan_checkpointing_blocks_the_model_has_not_is_refused():
    """checkpoint_blocks [7, 99] on a 2-block model checkpointed every block; [5] none."""
    from conftest import tiny_bert

    from tightfit.levers.checkpointing import set_activation_checkpointing

    model = tiny_bert(0.1, 0)  # two blocks
    for blocks in ((7, 99), (5,)):
        with pytest.raises(TightfitError, match=r"checkpoints block indices \[.*\] but the model has 2 blocks \(0-1\)"):
            set_activation_checkpointing(model, True, blocks)


def test_a_lora_plan_for_a_model_without_adapters_is_refused():
    """trainable "lora" on a plain model trained every weight, with the memory of a LoRA plan."""
    from conftest import tiny_bert

    from tightfit.loop import TrainStep
    from tightfit.plan import Plan

    with pytest.raises(TightfitError, match="trains LoRA adapters .* but the model has none"):
        TrainStep(Plan("fp32", 4, 8, trainable="lora"), tiny_bert(0.1, 0))


# ---- data, second part


def test_a_csv_with_classic_mac_line_ends_loads(tmp_path):
    """Excel's "CSV (Macintosh)" (lines ended by a CR alone) was 'malformed CSV (... open the file
    in universal-newline mode?)', which a user cannot do."""
    from tightfit.data import load_text_classification

    (tmp_path / "mac.csv").write_bytes("\r".join(_stars(12)).encode() + b"\r")
    assert len(load_text_classification(tmp_path / "mac.csv", label_column="stars").texts) == 12


def test_a_jsonl_label_nan_is_blank_and_a_repeated_key_is_refused(tmp_path):
    """NaN became a class 'nan' (null is skipped as blank); {"label": "pos", "label": "neg"} kept
    the last without a word."""
    from tightfit.data import load_text_classification

    rows = [json.dumps({"text": f"review {i}", "label": ["pos", "neg"][i % 2]}) for i in range(10)]
    (tmp_path / "nan.jsonl").write_text("\n".join(rows + ['{"text": "odd", "label": NaN}']) + "\n")
    data = load_text_classification(tmp_path / "nan.jsonl")
    assert data.label_names == ["neg", "pos"] and data.skipped_blank == 1
    (tmp_path / "twice.jsonl").write_text("\n".join(rows + ['{"text": "odd", "label": "pos", "label": "neg"}']) + "\n")
    with pytest.raises(TightfitError, match=r"line 11 gives the key 'label' twice"):
        load_text_classification(tmp_path / "twice.jsonl")


def test_labels_differing_only_in_case_are_noted(tmp_path, caplog):
    import logging

    from tightfit.data import load_text_classification

    rows = ["text,label"] + [f"review {i},{['pos', 'POS', 'neg'][i % 3]}" for i in range(12)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        data = load_text_classification(tmp_path / "d.csv")
    assert data.label_names == ["POS", "neg", "pos"]
    assert "labels of column 'label' that differ only in case are separate classes: 'POS' and 'pos'" in caplog.text


# ---- second fresh user (docs against behaviour)


def test_bench_refuses_steps_that_leave_no_timed_interval(tmp_path, capsys):
    """--steps 4 with --warmup 3 passed the check and wrote samples/s NaN (not valid JSON)."""
    from tightfit.cli import main

    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--out", str(tmp_path / "o"), "--device", "cpu",
                 "--settings", "hf", "--steps", "4"]) == 2
    assert "--steps and --tightfit-steps must be at least --warmup + 2 (5)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_int8_speed_up_is_shown_with_its_spread_between_rounds():
    """A single median on a busy host printed "4.40x" for a ResNet whose int8 gains nothing."""
    from tightfit.export import report_markdown, speedup_spread

    rounds = [{"fp32": f, "int8": i} for f, i in [(10, 12), (10, 9), (50, 10), (10, 11), (12, 10), (10, 10)]]
    low, high = speedup_spread(rounds)
    assert low < 1 < high
    side = {"size_bytes": 1000, "accuracy": None}
    r = {"source": "m", "kind": "image", "torch": "x", "quantized_engine": "x86", "threads": 2, "held_out_samples": 0,
         "fp32": {**side, "latency_s": {1: 0.0867, 32: 0.0693}}, "int8": {**side, "latency_s": {1: 0.092, 32: 0.0158}},
         "speedup_middle_half": {1: (0.9, 1.1), 32: (0.95, 5.1)}}
    text = report_markdown(r)
    assert "15.8 ms (4.39x, the median round; 0.95-5.10x in the middle half of the rounds: no clear difference" in text
    # the headline is the median round's speed-up, inside the middle half: the ratio of the two median
    # latencies (1.38x) was shown beside a middle half of 0.88-1.34x (fresh user 62)
    r = dict(r, speedup_middle_half={1: (0.9, 1.1), 32: (0.88, 1.34)}, speedup_median={1: 1.0, 32: 1.12})
    assert "15.8 ms (1.12x, the median round; 0.88-1.34x in the middle half" in report_markdown(r)


def test_a_checkpoint_of_a_run_with_another_batch_is_one_line_before_the_plan(tmp_path, capsys):
    """It ended, after the other run's plan was shown, with the trainer's own 'the plan's
    effective_batch 16 differs from the workload's 8: plan for this workload, ...'."""
    from conftest import tiny_cpu_job

    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    common = ["--model", job["model"], "--data", job["data"], "--max-steps", "2", "--checkpoint-every", "2",
              "--seq-len", "16", "--device", "cpu", "--no-progress"]
    assert main(["train", *common, "--batch-size", "8", "--out", str(tmp_path / "run")]) == 0
    assert main(["train", *common, "--batch-size", "4", "--out", str(tmp_path / "other")]) == 0
    (tmp_path / "run" / "summary.json").unlink()
    shutil.copytree(tmp_path / "other" / "checkpoints" / "ckpt-2", tmp_path / "run" / "checkpoints" / "ckpt-9",
                    ignore=shutil.ignore_patterns("manifest.json"))  # an older checkpoint: no step to compare
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "checkpoint ckpt-9 was written by a run of effective batch 4, and this run's is 8" \
        in err[0], err
    assert "plan:" not in captured.out + captured.err


def test_a_resume_says_when_metrics_are_missing_or_a_line_inside_is_damaged(tmp_path, caplog):
    """A deleted metrics.jsonl, or a line damaged in the middle (not cut by a kill at the end),
    lost records without a word."""
    import logging

    from tightfit.cli import main

    run, ckpts = _short_run(tmp_path)
    shutil.rmtree(ckpts / "ckpt-6")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:10]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "note: metrics.jsonl: 1 damaged line (not JSON) dropped: line 3" in caplog.text
    assert "metrics.jsonl: 1 damaged line" in (run / "report.md").read_text()
    (run / "summary.json").unlink()
    shutil.rmtree(ckpts / "ckpt-6")
    (run / "metrics.jsonl").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "note: metrics.jsonl was missing" in caplog.text


def test_estimate_batch_size_checks_and_title_say_what_plan_says(capsys):
    from tightfit.cli import main

    args = ["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "8"]
    assert main([*args, "--batch-size", "0"]) == 2
    assert capsys.readouterr().err.strip() == "tightfit: error: --batch-size must be >= 1"
    assert main([*args, "--batch-size", "30"]) == 0
    assert "micro-batch 8 x 4 accumulation steps (the last 6) (effective batch 30)" in capsys.readouterr().out


def test_a_size_in_bits_is_refused():
    from tightfit.units import parse_size

    with pytest.raises(TightfitError, match="a lower-case b is bits; write bytes, e.g. 4GB or 4GiB"):
        parse_size("4Gb")
    assert parse_size("4gb") == parse_size("4GB") == 4 * 10**9


def test_an_edited_request_json_is_named_when_its_value_is_refused(tmp_path, capsys):
    """It read '--batch-size must be a whole number, not '8' (a str)', a flag the user never gave."""
    from tightfit.cli import main

    run, _ = _short_run(tmp_path)
    request = json.loads((run / "request.json").read_text())
    request["batch_size"] = "8"
    (run / "request.json").write_text(json.dumps(request))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "request.json holds a value tightfit cannot take (edited by hand?)" in err[0], err


@pytest.mark.parametrize("option, says", [(["--planner", "probe"], "--planner probe applies on a GPU"),
                                          (["--sharding", "fsdp"], "--sharding fsdp applies to several processes"),
                                          # found by a fresh user: a GPU temperature to watch on the CPU
                                          (["--cooldown-temp", "90"], "--cooldown-temp applies to a GPU's temperature"),
                                          (["--warn-temp", "80", "--cooldown-temp", "90"],
                                           "--warn-temp/--cooldown-temp apply to a GPU's temperature")])
def test_an_option_without_effect_on_one_cpu_process_gets_a_note(option, says, tmp_path, caplog):
    """--sharding fsdp and --planner probe on a one-process CPU run were taken without a word."""
    import logging

    from conftest import tiny_cpu_job

    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--model", job["model"], "--data", job["data"], "--max-steps", "1", "--seq-len", "16",
                     "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress", *option]) == 0
    assert says in caplog.text and "note: " in caplog.text


def test_a_resume_notes_the_temperatures_only_where_its_command_gives_them(tmp_path, caplog):
    """Every resume of a CPU run said --warn-temp/--cooldown-temp apply to a
    GPU (the resumed request holds every option the run recorded, defaults too, as given)."""
    import logging

    run, _ = _short_run(tmp_path, steps=2, every=1)
    from tightfit.cli import main

    for extra, noted in (([], False), (["--warn-temp", "80"], True)):
        caplog.clear()
        (run / "summary.json").unlink(missing_ok=True)
        with caplog.at_level(logging.INFO, logger="tightfit"):
            assert main(["train", "--resume", str(run), "--no-progress", *extra]) == 0
        assert ("GPU's temperature" in caplog.text) is noted, caplog.text


def test_an_image_csv_row_naming_a_folder_says_so(tmp_path):
    """A path that is a folder read 'image not found'."""
    from tightfit.images import load_image_classification

    (tmp_path / "sub").mkdir()
    (tmp_path / "l.csv").write_text("path,label\nsub,1\n")
    with pytest.raises(TightfitError, match=r"row 1: .*sub is a folder, not an image file"):
        load_image_classification(str(tmp_path / "l.csv"))


def test_skipped_rows_of_an_image_csv_are_named_as_image_paths(tmp_path, caplog):
    import logging

    import numpy as np
    from PIL import Image

    from tightfit.cli import main

    rows = ["path,label"]
    for i in range(24):
        Image.fromarray((np.arange(64).reshape(8, 8) * (i + 1) % 256).astype("uint8")).save(tmp_path / f"{i}.png")
        rows.append(f"{i}.png,{i % 2}")
    rows.append(",1")
    (tmp_path / "l.csv").write_text("\n".join(rows) + "\n")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    from transformers import ResNetConfig, ResNetForImageClassification

    ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1],
                                              layer_type="basic")).save_pretrained(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--model", str(tmp_path / "m"), "--data", str(tmp_path / "l.csv"), "--image-size", "8",
                     "--max-steps", "1", "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert "1 row with a blank image path or label was skipped" in caplog.text


def test_a_note_to_python_callers_names_the_keyword_not_the_flag(tmp_path):
    """From api.train(TrainRequest(eval_samples=20)) the note said '--eval-samples'."""
    from tightfit.data import check_split, held_out_split, load_text_classification

    rows = ["text,label"] + [f"review {i},{i % 2}" for i in range(400)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    data = load_text_classification(tmp_path / "d.csv")
    train_idx, eval_idx = held_out_split(len(data))
    notes = check_split(data, data.subset(train_idx), data.subset(eval_idx[:20]))
    assert any("(eval_samples or more data for a finer measure)" in n for n in notes), notes


# ---- third fresh user (the Python API)


class _Augmented(__import__("torch").utils.data.Dataset):
    """Samples with noise drawn from torch's global generator, as a random augmentation does."""

    def __init__(self):
        import torch

        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 16, generator=g), torch.randint(0, 2, (64,), generator=g)

    def __len__(self):
        return 64

    def __getitem__(self, i):
        import torch

        return {"pixel_values": self.x[i] + 0.1 * torch.randn(16), "labels": self.y[i]}


def _augmented_run(folder=None, resume_from=None, max_steps=None):
    import torch

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.5), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, pixel_values):
            from types import SimpleNamespace

            return SimpleNamespace(logits=self.net(pixel_values))

    records = []
    w = Workload(Wrapped(), _Augmented(), None, 8, task=ImageClassification())
    cfg = TrainConfig(epochs=1, lr=1e-2, seed=3, log_every=1, checkpoint_dir=None if folder is None else str(folder),
                      checkpoint_every=3, keep_last=10, prefetch=True)
    t = Trainer(w, Plan("fp32", 4, 8), cfg, log=records.append, progress=False)
    if resume_from is not None:
        t.resume(resume_from)
    t.fit()
    return {r["step"]: r["loss"] for r in records if r.get("type") == "train"}, t


def test_a_collation_drawing_random_numbers_repeats_and_resumes_exactly_with_prefetch(tmp_path):
    """With prefetch on, the background collation's draws interleaved with the training thread's:
    two identical runs differed in every step, and a resume drifted from the uninterrupted run."""
    first, t = _augmented_run(tmp_path / "a")
    again, _ = _augmented_run()
    assert first == again
    assert any("prefetch off: the data's collation draws random numbers" in e for e in t.result.events)
    resumed, _ = _augmented_run(tmp_path / "b", resume_from=tmp_path / "a" / "ckpt-3")
    assert {s: l for s, l in first.items() if s > 3} == resumed


def test_a_users_batch_type_reaches_their_loss_function():
    """A BatchEncoding or a named tuple reached the loss as a plain dict or tuple:
    'dict' object has no attribute 'input_ids'."""
    from collections import namedtuple

    import torch
    from transformers import BatchEncoding

    from tightfit.loop import _Batch

    ids = torch.zeros(4, 3, dtype=torch.long)
    b = _Batch(BatchEncoding({"input_ids": ids, "labels": ids[:, 0]}))
    part = b.restore({k: v[:2] for k, v in b.as_dict().items()})
    assert isinstance(part, BatchEncoding) and part.input_ids.shape == (2, 3)
    NT = namedtuple("NT", "x y")
    b = _Batch(NT(ids, ids[:, 0]))
    part = b.restore({k: v[:2] for k, v in b.as_dict().items()})
    assert isinstance(part, NT) and part.x.shape == (2, 3)


def test_trainer_resume_refuses_another_effective_batch_and_takes_a_smaller_planned_micro_batch(tmp_path):
    """From Python, a checkpoint of effective batch 16 resumed at 8 trained samples twice; a plan
    of micro-batch 4 resumed at the checkpoint's 8, reported as an OOM recovery."""
    from conftest import SyntheticBatches, tiny_bert

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    def trainer(E, mb, folder=None):
        w = Workload(tiny_bert(0.1, 0), SyntheticBatches(64), None, E)
        cfg = TrainConfig(epochs=1, lr=1e-3, seed=3, checkpoint_dir=None if folder is None else str(folder),
                          checkpoint_every=2, keep_last=10)
        return Trainer(w, Plan("fp32", mb, E), cfg, progress=False)

    trainer(16, 8, tmp_path / "a").fit()
    with pytest.raises(TightfitError, match="ckpt-2 was written by a run of effective batch 16, and this run's is 8"):
        trainer(8, 8).resume(tmp_path / "a" / "ckpt-2")
    t = trainer(16, 4)
    t.resume(tmp_path / "a" / "ckpt-2")
    assert t.micro_batch == 4 and t.plan_in_force() == t.plan


def test_nothing_fits_advice_on_image_size_has_no_placeholder(capsys):
    """'--image-size 1 needs -': ResNet-50 cannot be traced at 1 pixel, and the figure was missing."""
    from tightfit.cli import main

    assert main(["plan", "--model", "resnet50", "--image-size", "224", "--batch-size", "64", "--budget", "520MiB",
                 "--optimizer", "adamw"]) == 2
    err = capsys.readouterr().err
    assert "--image-size" in err and " needs -" not in err
    # the ladder starts where ResNet-50 traces, and names the largest size that fits (a fresh user)
    assert "fits: --image-size 184 at effective batch 64" in err


def test_trainer_inputs_that_cannot_train_are_one_line():
    """effective_batch 2.5 was taken, 0 read 'the plan's effective_batch 1 differs from the
    workload's 0'; an empty training set trained 0 steps without a word; a frozen model raised
    torch's 'optimizer got an empty parameter list'."""
    from conftest import SyntheticBatches, tiny_bert

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    for E in (2.5, 0):
        with pytest.raises(TightfitError, match=f"effective_batch {E!r} is not a whole number >= 1"):
            Workload(tiny_bert(), SyntheticBatches(8), None, E)
    with pytest.raises(TightfitError, match=r"the training data is empty \(0 samples\)"):
        Trainer(Workload(tiny_bert(), SyntheticBatches(0), None, 8), Plan("fp32", 4, 8), TrainConfig(), progress=False)
    # an empty held-out set: its accuracy and loss were NaN, with no word
    with pytest.raises(TightfitError, match=r"the evaluation data is empty \(0 samples\)"):
        Trainer(Workload(tiny_bert(), SyntheticBatches(8), SyntheticBatches(0), 8), Plan("fp32", 4, 8), TrainConfig(),
                progress=False)
    frozen = tiny_bert()
    frozen.requires_grad_(False)
    with pytest.raises(TightfitError, match="no parameter of the model requires grad"):
        Trainer(Workload(frozen, SyntheticBatches(8), None, 8), Plan("fp32", 4, 8), TrainConfig(), progress=False)


def test_a_bf16_card_plans_fp32_where_bf16_fits_nothing(capsys):
    """'nothing fits' on a bf16 card although fp32 fits: autocast saves a 16-bit copy of every
    weight for backward, which at micro-batch 1 costs more than fp32's activations save."""
    from tightfit.cli import main

    assert main(["plan", "--model", "minilm", "--seq-len", "128", "--batch-size", "64", "--budget", "540MiB",
                 "--optimizer", "adamw", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "plan: fp32, micro-batch 1 x 64 accumulation steps" in out
    assert "precision: fp32: bf16 fits nothing in this budget, fp32 does" in out


def test_a_text_column_of_numbers_is_noted(tmp_path, caplog):
    """A JSON Lines file whose text field is a number trained without a word (the number's text)."""
    import json
    import logging

    from tightfit.data import load_text_classification

    lines = [json.dumps({"text": i * 1.5, "label": ["pos", "neg"][i % 2]}) for i in range(12)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        load_text_classification(tmp_path / "d.jsonl")
    assert "12 of 12 texts of column 'text' are numbers (e.g. '0.0')" in caplog.text
    caplog.clear()
    rows = ["text,label"] + [f"review {i},{['pos', 'neg'][i % 2]}" for i in range(12)]  # words: no note
    (tmp_path / "w.csv").write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        load_text_classification(tmp_path / "w.csv")
    assert "are numbers" not in caplog.text


def test_a_resume_drops_a_metrics_line_of_bytes_that_are_not_utf8_as_damaged(tmp_path, caplog):
    """Bytes that are not UTF-8 in metrics.jsonl (one flipped bit on disk) ended the resume with
    a UnicodeDecodeError traceback; such a line is now a damaged line like any other."""
    import logging

    from tightfit.cli import main

    run, ckpts = _short_run(tmp_path)
    shutil.rmtree(ckpts / "ckpt-6")
    data = (run / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    data[2] = b"\xff\xfe" + data[2][2:]
    (run / "metrics.jsonl").write_bytes(b"".join(data))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "note: metrics.jsonl: 1 damaged line (not JSON) dropped: line 3" in caplog.text


def test_a_finished_run_whose_model_is_gone_is_written_again_on_resume(tmp_path, caplog):
    """A finished run whose model/ was deleted said "already finished, nothing written" on resume,
    and the model stayed missing though its last checkpoint held the weights."""
    import logging

    from tightfit.cli import main

    run, _ = _short_run(tmp_path)
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0  # finished again: summary.json back
    weights = sorted((run / "model").glob("*.safetensors"))
    before = [w.read_bytes() for w in weights]
    shutil.rmtree(run / "model")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "lacks the trained model (config.json or its weights): the run is evaluated and its results written " \
           "again" in caplog.text
    assert [w.read_bytes() for w in sorted((run / "model").glob("*.safetensors"))] == before
    assert (run / "model" / "config.json").is_file()
