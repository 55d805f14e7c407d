"""Faults two fresh users found (session 34): `tightfit estimate` without the plan's gradient
accumulation, resume with another model's checkpoint, Plan fields of the wrong kind, NaN budgets,
resumed reports without metrics.jsonl, data files (an open CSV quote, TSV quoting, upper-case
suffixes, one number written two ways as labels), a checkpoint left only as ``.ckpt-N.old``."""

import json
import logging

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


def test_resume_with_another_models_checkpoint_is_one_line_before_any_plan(tmp_path, capsys):
    """A checkpoint copied from a run of another model: the error was torch's first line, ending in
    a colon, after the plan of the other model had been printed."""
    import shutil

    from conftest import tiny_cpu_job, tiny_text_model_folder

    job = tiny_cpu_job(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    other_model = tiny_text_model_folder(other, ["good", "bad", "great", "awful", "fine", "film", "plot"], hidden_size=48, num_hidden_layers=3,
                                         num_attention_heads=2, intermediate_size=64, max_position_embeddings=64)
    runs = {}
    for name, model in (("mine", job["model"]), ("theirs", str(other_model))):
        runs[name] = tmp_path / name
        assert main(["train", "--model", model, "--data", job["data"], "--batch-size", "8", "--max-steps", "2",
                     "--checkpoint-every", "2", "--seq-len", "16", "--device", "cpu", "--out", str(runs[name]),
                     "--no-progress"]) == 0
    (runs["mine"] / "summary.json").unlink()  # as if stopped after its checkpoint
    mine = runs["mine"] / "checkpoints" / "ckpt-2"
    shutil.rmtree(mine)
    shutil.copytree(runs["theirs"] / "checkpoints" / "ckpt-2", mine)
    capsys.readouterr()
    assert main(["train", "--resume", str(runs["mine"]), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "plan:" not in captured.out + captured.err
    err = _error_of(captured.err)
    assert err.startswith("tightfit: error: checkpoint ckpt-2 holds another model's weights: "), err
    assert "bert.embeddings.word_embeddings.weight" in err and "[12, 48] saved, [12, 32] here" in err, err
    assert not err.endswith(":")


def _error_of(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if not x.startswith("note:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("fields, says", [
    (dict(device="gpu"), "device 'gpu'"),
    (dict(optimizer="sgdx"), "optimizer 'sgdx'"),
    (dict(trainable="half"), "trainable 'half'"),
    (dict(micro_batch=True), "micro_batch True"),
    (dict(micro_batch=4.5), "micro_batch 4.5"),
    (dict(effective_batch="16"), "effective_batch '16'"),
    (dict(checkpoint_blocks="01"), "checkpoint_blocks '01'"),
    (dict(checkpoint_blocks=(0, -1)), "checkpoint_blocks (0, -1)"),
    (dict(block_policies=("none", "some")), "block_policies ('none', 'some')"),
    (dict(activation_checkpointing="yes"), "activation_checkpointing 'yes'"),
    (dict(compile=1), "compile 1"),
])
def test_a_plan_with_a_field_of_the_wrong_kind_is_refused(fields, says):
    """These were accepted; micro_batch 4.5 made accumulation_steps the float 8.0."""
    from tightfit import Plan, TightfitError

    with pytest.raises(TightfitError, match="^Plan: ") as e:
        Plan(**{"precision": "fp32", "micro_batch": 4, "effective_batch": 16, **fields})
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["[]", "null", "3", '"plan"'])
def test_plan_json_that_is_not_an_object_is_a_malformed_plan(text):
    from tightfit import Plan, TightfitError

    with pytest.raises(TightfitError, match="malformed plan: expected a JSON object"):
        Plan.from_json(text)


def test_numpy_integers_are_whole_numbers_for_a_plan():
    import numpy as np

    from tightfit import Plan

    p = Plan("fp32", np.int64(4), np.int64(16))
    assert p.accumulation_steps == 4 and type(p.micro_batch) is int


@pytest.mark.parametrize("budget", [float("nan"), float("inf")])
def test_a_budget_of_nan_or_inf_bytes_is_refused_without_suggesting_nangib(budget):
    from tightfit.errors import TightfitError
    from tightfit.units import parse_budget

    with pytest.raises(TightfitError, match="memory size must be a finite number of bytes") as e:
        parse_budget(budget)
    assert "GiB" not in str(e.value)


# ---- session 34, second fresh user: data files


def _labelled(n: int, sep: str) -> list[str]:
    return [f"text{sep}label"] + [f"review number {i} was fine{sep}{'pos' if i % 2 else 'neg'}" for i in range(n)]


@pytest.mark.parametrize("name, sep", [("merge.csv", ","), ("merge.tsv", "\t")])
def test_an_unbalanced_quote_does_not_merge_rows_silently(tmp_path, name, sep):
    """A text opening a quote it never closes swallowed the next rows, labels and all, into one
    sample (100 rows read as 65), without a word."""
    from tightfit.data import load_text_classification
    from tightfit.errors import TightfitError

    rows = _labelled(100, sep)
    rows[10] = f'"Wow boring from the start{sep}neg'
    rows[45] = f'the end"{sep}pos'
    (tmp_path / name).write_text("\n".join(rows) + "\n")
    if sep == "\t":  # TSV has no quoting: the quotes are the texts' own characters
        data = load_text_classification(tmp_path / name)
        assert len(data.texts) == 100 and data.texts[9] == '"Wow boring from the start'
        return
    with pytest.raises(TightfitError, match=r"record 10 .*unbalanced"):
        load_text_classification(tmp_path / name)


def test_a_csv_text_with_real_line_breaks_still_loads(tmp_path):
    from tightfit.data import load_text_classification

    rows = _labelled(20, ",")
    rows[5] = '"a review\nover two lines, with a comma",pos'
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    assert load_text_classification(tmp_path / "d.csv").texts[4] == "a review\nover two lines, with a comma"


def test_upper_case_compressed_suffixes_are_decompressed(tmp_path):
    import gzip

    from tightfit.data import load_text_classification

    with gzip.open(tmp_path / "D.CSV.GZ", "wt") as f:
        f.write("\n".join(_labelled(20, ",")) + "\n")
    assert len(load_text_classification(tmp_path / "D.CSV.GZ").texts) == 20


@pytest.mark.parametrize("labels, named", [(["0", "1", "01"], "'01' and '1'"), (["0", "1", "1.0"], "'1' and '1.0'")])
def test_one_number_written_two_ways_is_not_two_classes_silently(tmp_path, labels, named):
    """Labels 1 and 01 (or 1 and 1.0) became separate classes, and the model a third output."""
    from tightfit.data import load_text_classification
    from tightfit.errors import TightfitError

    rows = ["text,label"] + [f"review {i},{labels[i % 3]}" for i in range(30)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=f"labels {named} are the same number written two ways"):
        load_text_classification(tmp_path / "d.csv")


def test_a_resume_puts_back_a_checkpoint_a_cut_short_replacement_left_as_old(tmp_path, caplog):
    """Killed between atomic_write_dir's two renames, ckpt-N exists only as .ckpt-N.old: the
    resume deleted it as stale and went back to an older checkpoint."""
    import shutil

    from conftest import tiny_cpu_job

    job = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "4",
                 "--checkpoint-every", "2", "--seq-len", "16", "--device", "cpu", "--out", str(run),
                 "--no-progress"]) == 0
    (run / "summary.json").unlink()
    ckpts = run / "checkpoints"
    shutil.move(ckpts / "ckpt-4", ckpts / ".ckpt-4.old")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tightfit"):
        assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "note: put back ckpt-4, displaced by a checkpoint write that was cut short" in caplog.text
    assert "checkpoints/ckpt-4 at step 4" in caplog.text  # not back at step 2
    assert (ckpts / "ckpt-4").is_dir() and not (ckpts / ".ckpt-4.old").exists()


def test_a_jsonl_row_without_a_key_names_the_key(tmp_path):
    from tightfit.data import load_text_classification
    from tightfit.errors import TightfitError

    rows = [json.dumps({"text": f"review {i}", "label": i % 2}) for i in range(10)] + [json.dumps({"text": "no label"})]
    (tmp_path / "d.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(TightfitError, match=r"row 11 has no 'label' key$"):
        load_text_classification(tmp_path / "d.jsonl")


def test_counts_of_one_are_singular():
    from tightfit.units import count_of

    assert count_of(1, "held-out sample") == "1 held-out sample" and count_of(2, "row") == "2 rows"


def test_the_report_of_a_twice_resumed_run_keeps_the_earlier_sessions_events(tmp_path, capsys):
    """report.md listed only the last session's events: how the run was stopped and resumed
    before (in metrics.jsonl) was missing from it."""
    import shutil

    from conftest import tiny_cpu_job

    job = tiny_cpu_job(tmp_path)
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "6",
                 "--checkpoint-every", "2", "--keep-last", "5", "--seq-len", "16", "--device", "cpu", "--out", str(run),
                 "--no-progress"]) == 0
    for kept, lr in ((2, ["--lr", "0.001"]), (4, [])):  # stopped after step `kept`'s checkpoint, twice
        (run / "summary.json").unlink()
        for later in range(kept + 2, 7, 2):
            shutil.rmtree(ckpts / f"ckpt-{later}")
        capsys.readouterr()
        assert main(["train", "--resume", str(run), *lr, "--no-progress"]) == 0
        if lr:  # the changed option is said once on screen (it was said twice: fresh user 62)
            shown = "".join(capsys.readouterr())
            assert shown.count("--lr 0.001") == 1, shown
    report = (run / "report.md").read_text()
    assert "- options given anew: --lr 0.001 (was 5e-05)" in report  # the second session's
    # the recorded command names the resume that changed --lr (it had the first session's alone,
    # while request.json held the new --lr: fresh user 62)
    request = json.loads((run / "request.json").read_text())
    assert request["lr"] == 0.001 and request["command"].endswith("--no-progress (resumed as: tightfit train --resume "
                                                                  f"{run} --lr 0.001 --no-progress)"), request["command"]
    # the report names each session's own command, the resume that changed --lr among them
    first = request["command"].removesuffix(f" (resumed as: tightfit train --resume {run} --lr 0.001 --no-progress)")
    assert f"- commands (one per session):\n  - `{first}`\n  - `tightfit train --resume {run} --lr 0.001 " \
           f"--no-progress`\n  - `tightfit train --resume {run} --no-progress`\n" in report, report
    assert report.count("- resumed from ") == 2, report
    events = json.loads((run / "summary.json").read_text()).get("events")
    assert events is None or sum(e.startswith("resumed from ") for e in events) == 2


def test_a_column_name_with_a_leading_space_is_shown_quoted(tmp_path):
    from tightfit.data import load_text_classification
    from tightfit.errors import TightfitError

    (tmp_path / "d.csv").write_text("text, label\n" + "".join(f"review {i},{i % 2}\n" for i in range(10)))
    with pytest.raises(TightfitError, match=r"columns are: ' label', text$"):
        load_text_classification(tmp_path / "d.csv")


def test_a_json_array_file_is_told_to_be_json_lines(tmp_path):
    from tightfit.data import load_text_classification
    from tightfit.errors import TightfitError

    (tmp_path / "d.json").write_text(json.dumps([{"text": "a", "label": 0}, {"text": "b", "label": 1}]))
    with pytest.raises(TightfitError, match=r"line 1 is not a JSON object \(JSON Lines: one object per line"):
        load_text_classification(tmp_path / "d.json")
