"""A run that stops on non-finite gradients keeps the checkpoints written before the trouble:
resumes that fail the same way do not prune them away, and ``--resume RUN/checkpoints/ckpt-N``
goes back to one of them."""

import json
import math
import random

import torch

from tightfit.runtime.checkpoint import clean_checkpoint_before, list_checkpoints, save_checkpoint, skipped_in_row

WORDS = "film plot actor scene great dull awful superb boring moving script music".split()


def _names(folder):
    return [p.name for p in list_checkpoints(folder)]


def _state(step, skipped):
    return {"step": step, "counters": {"skipped_in_row": skipped}}


def test_pruning_keeps_the_clean_checkpoints_while_nonfinite_steps_go_on(tmp_path):
    model = torch.nn.Linear(3, 2)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, _state(step, 0), keep_last=1)
    assert _names(tmp_path) == ["ckpt-4"]
    save_checkpoint(tmp_path, 7, model, _state(7, 2), keep_last=1)  # a stop after steps 6-7 skipped: 5 applied
    assert _names(tmp_path) == ["ckpt-4", "ckpt-7"]
    assert [skipped_in_row(p) for p in list_checkpoints(tmp_path)] == [0, 2]
    assert clean_checkpoint_before(tmp_path, 5).name == "ckpt-4"
    save_checkpoint(tmp_path, 9, model, _state(9, 2), keep_last=1)  # a resume that failed again
    save_checkpoint(tmp_path, 11, model, _state(11, 2), keep_last=1)  # and again: only the newest such is kept
    assert _names(tmp_path) == ["ckpt-4", "ckpt-11"]
    save_checkpoint(tmp_path, 12, model, _state(12, 0), keep_last=1)  # a resume that trains on: all behind it goes
    assert _names(tmp_path) == ["ckpt-12"]
    save_checkpoint(tmp_path, 4, model, _state(4, 0), keep_last=1)  # a resume from an earlier one: later ones go
    assert _names(tmp_path) == ["ckpt-4"]


def test_a_checkpoint_holding_the_weights_a_stop_holds_is_not_clean(tmp_path):
    """ckpt-4 holds step 4's update, after which steps 5-7 were skipped: the stop's weights, and
    possibly what spoiled them. It is not kept as the one to go back to; ckpt-2 is."""
    model = torch.nn.Linear(3, 2)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, _state(step, 0), keep_last=2)
    save_checkpoint(tmp_path, 6, model, _state(6, 2), keep_last=2)  # a scheduled one inside the run of skips
    save_checkpoint(tmp_path, 7, model, _state(7, 3), keep_last=2)  # the stop
    assert _names(tmp_path) == ["ckpt-2", "ckpt-7"]
    assert clean_checkpoint_before(tmp_path, 4).name == "ckpt-2"
    assert clean_checkpoint_before(tmp_path, 2) is None


def test_a_resume_from_an_earlier_checkpoint_abandons_the_later_ones_at_its_first_write(tmp_path):
    model = torch.nn.Linear(3, 2)
    for step in (2, 3, 5):
        save_checkpoint(tmp_path, step, model, _state(step, 0), keep_last=5)
    save_checkpoint(tmp_path, 4, model, _state(4, 0), keep_last=5, abandoned={3, 4, 5})  # resumed from ckpt-2
    assert _names(tmp_path) == ["ckpt-2", "ckpt-4"]


def test_a_checkpoint_whose_manifest_cannot_be_read_is_not_kept_as_the_one_to_go_back_to(tmp_path):
    """It would not load: counted clean, it pushed out ckpt-2, the last one that does."""
    model = torch.nn.Linear(3, 2)
    for step in (2, 4):
        save_checkpoint(tmp_path, step, model, _state(step, 0), keep_last=2)
    (tmp_path / "ckpt-4" / "manifest.json").write_text("{not json")
    save_checkpoint(tmp_path, 7, model, _state(7, 2), keep_last=1)  # a stop after steps 6-7 skipped
    assert _names(tmp_path) == ["ckpt-2", "ckpt-7"] and skipped_in_row(tmp_path / "ckpt-2") == 0
    assert clean_checkpoint_before(tmp_path, 5).name == "ckpt-2"


def test_a_checkpoint_without_the_count_is_pruned_as_before(tmp_path):
    model = torch.nn.Linear(3, 2)
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, model, {"step": step}, keep_last=2)
    assert _names(tmp_path) == ["ckpt-4", "ckpt-6"] and skipped_in_row(tmp_path / "ckpt-6") == 0


def _inputs(root):
    from conftest import tiny_text_model_folder

    model_dir = tiny_text_model_folder(root, WORDS, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64)
    rng = random.Random(0)
    rows = ["text,label"] + [f"{' '.join(rng.choices(WORDS, k=rng.randint(3, 12)))},{'pos' if i % 2 else 'neg'}"
                             for i in range(160)]
    (root / "data.csv").write_text("\n".join(rows) + "\n")
    return model_dir, root / "data.csv"


def _blow_up_from(monkeypatch, first_bad_step):
    """From training forward ``first_bad_step`` (1-based) on, the first encoder layer's output is inf."""
    from tightfit.api import TrainRecipe

    load = TrainRecipe._load_model
    calls = [0]

    def hook(module, inputs, out):
        if module.training:
            calls[0] += 1
            if calls[0] >= first_bad_step:
                return out * math.inf
        return out

    def patched(self):
        load(self)
        self.model.bert.encoder.layer[0].output.dense.register_forward_hook(hook)

    monkeypatch.setattr(TrainRecipe, "_load_model", patched)


def test_failed_resumes_keep_the_checkpoint_from_before_the_nonfinite_steps(tmp_path, monkeypatch, capsys):
    from tightfit.cli import main

    model_dir, data = _inputs(tmp_path)
    run = tmp_path / "run"
    base = ["--no-progress", "--device", "cpu"]
    with monkeypatch.context() as m:
        _blow_up_from(m, 5)  # steps 1-4 train (micro-batch 16 = batch: one forward a step), then inf
        assert main(["train", "--model", str(model_dir), "--data", str(data), "--batch-size", "16", "--epochs", "2",
                     "--lr", "1e-3", "--seq-len", "16", "--checkpoint-every", "2", "--keep-last", "2",
                     "--max-skipped-steps", "2", "--out", str(run), *base]) == 2
        err = capsys.readouterr().err
        # ckpt-4 holds step 4's update, the last applied: the stop's weights; ckpt-2 is the one before
        assert _names(run / "checkpoints") == ["ckpt-2", "ckpt-6"]
        assert f"go back to ckpt-2, the last checkpoint before step 4's update (the last one applied): tightfit " \
               f"train --resume {run / 'checkpoints' / 'ckpt-2'} --lr <lower>" in err
        _blow_up_from(m, 1)
        assert main(["train", "--resume", str(run), "--lr", "1e-4", "--max-skipped-steps", "3", *base]) == 2
        assert _names(run / "checkpoints") == ["ckpt-2", "ckpt-9"]  # ckpt-8 (inside the skips) and ckpt-6 gone
        assert "go back to ckpt-2, the last checkpoint before step 4's update" in capsys.readouterr().err
    events = [json.loads(line)["message"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["type"] == "event"]
    assert any(e.startswith("3 steps in a row had non-finite gradients") and e.endswith("ckpt-9") for e in events)
    assert main(["train", "--resume", str(run / "checkpoints" / "ckpt-2"), "--lr", "1e-4", *base]) == 0
    said = capsys.readouterr()
    assert "resuming from ckpt-2: the later ckpt-9 is deleted at the resumed run's first checkpoint" in said.out + said.err
    assert _names(run / "checkpoints") == ["ckpt-16", "ckpt-18"]  # 2 epochs of 9 steps
    assert (run / "summary.json").is_file()


def test_bad_resume_paths_get_one_line_and_nothing_before_it(tmp_path, capsys):
    import shutil

    from tightfit.cli import main

    model_dir, data = _inputs(tmp_path)

    def run(out, batch, *extra):
        return main(["train", "--model", str(model_dir), "--data", str(data), "--batch-size", str(batch),
                     "--max-steps", "2", "--lr", "1e-3", "--seq-len", "16", "--checkpoint-every", "1",
                     "--out", str(out), "--no-progress", "--device", "cpu", *extra])

    assert run(tmp_path / "r", 8) == 0 and run(tmp_path / "other", 16) == 0
    (tmp_path / "r" / "summary.json").unlink()  # as if stopped before the end
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "ckpt-1")  # another run's in its place, ckpt-2 after it
    shutil.copytree(tmp_path / "other" / "checkpoints" / "ckpt-1", tmp_path / "r" / "checkpoints" / "ckpt-1")
    before = sorted(str(p) for p in (tmp_path / "r").rglob("*"))
    cases = {
        str(tmp_path / "r" / "checkpoints"): "is the run's checkpoints folder: give the run folder",
        str(tmp_path / "nowhere"): f"--resume {tmp_path / 'nowhere'}: does not exist",
        str(tmp_path / "nowhere" / "checkpoints" / "ckpt-3"): "does not exist",
        str(tmp_path / "r" / "checkpoints" / "ckpt-9"): "does not exist",
        str(tmp_path / "r" / "checkpoints" / "ckpt-1"): "written by a run of effective batch 16",
    }
    capsys.readouterr()
    for path, message in cases.items():
        assert main(["train", "--resume", path, "--lr", "1e-4", "--no-progress"]) == 2, path
        said = capsys.readouterr()
        assert "note:" not in said.out + said.err, (path, said)  # nothing said before the refusal
        assert said.err.count("\n") == 1 and message in said.err, (path, said.err)
    assert sorted(str(p) for p in (tmp_path / "r").rglob("*")) == before


def test_the_trainer_resumed_from_an_earlier_checkpoint_deletes_the_abandoned_ones_at_its_first_write(tmp_path):
    """Checkpoints 1-4, resumed from ckpt-1 for 3 steps with a checkpoint every 3: its one write
    deletes ckpt-2 and ckpt-4 (the abandoned stretch), ckpt-2 though of a step before it."""
    from conftest import SyntheticBatches, tiny_bert

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    def trainer(every, steps=None):
        w = Workload(tiny_bert(0.1, 0), SyntheticBatches(32), SyntheticBatches(8, seed=1), 8)
        return Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, max_steps=steps, lr=1e-3, keep_last=5,
                                                          checkpoint_dir=str(tmp_path), checkpoint_every=every),
                       progress=False)

    trainer(1).fit()
    assert _names(tmp_path) == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
    resumed = trainer(3, steps=3)  # one write, at step 3
    resumed.resume(tmp_path / "ckpt-1")
    resumed.fit()
    assert _names(tmp_path) == ["ckpt-1", "ckpt-3"]


def test_the_python_api_says_how_to_resume_in_its_own_terms(tmp_path, monkeypatch):
    import pytest

    import tightfit
    from tightfit.api import TrainRequest, train

    model_dir, data = _inputs(tmp_path)
    _blow_up_from(monkeypatch, 5)
    run = tmp_path / "run"
    with pytest.raises(tightfit.NonFiniteTrainingError) as e:
        train(TrainRequest(model=str(model_dir), data=str(data), batch_size=16, epochs=2, lr=1e-3, seq_len=16,
                                    checkpoint_every=2, max_skipped_steps=2, out=str(run), progress=False,
                                    device="cpu"))
    said = str(e.value)
    assert "--" not in said and "Try a lower lr (e.g. lr=1e-04)" in said, said
    assert f"continue with: tightfit.api.train(TrainRequest(resume={str(run)!r}, lr=<lower>))" in said
    assert f"tightfit.api.train(TrainRequest(resume={str(run / 'checkpoints' / 'ckpt-2')!r}, lr=<lower>))" in said
    assert e.value.last_update == 4 and e.value.step == 6


def test_a_run_killed_before_its_first_checkpoint_says_how_to_start_again(tmp_path, capsys):
    """A CPU run killed by the kernel left request.json, plan.json and metrics.jsonl: --resume said
    only "no checkpoint to resume from" and --out only "exists and is not empty"."""
    from tightfit.cli import main

    model_dir, data = _inputs(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    for name in ("request.json", "plan.json", "metrics.jsonl"):
        (run / name).write_text("{}\n")
    assert main(["train", "--resume", str(run)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no checkpoint to resume from (the run stopped before its first)" in line and f"delete {run}" in line
    assert main(["train", "--model", str(model_dir), "--data", str(data), "--device", "cpu", "--out", str(run)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "holds a run that stopped before its first checkpoint" in line, line


def test_batchnorm_statistics_gone_non_finite_stop_the_run_with_advice_not_a_bare_refusal(tmp_path):
    """A window whose gradients are finite may still fold inf into BatchNorm's running variance
    (activations past ~1e19: the batch is normalised by its own statistics, so the loss and the
    gradients stay finite). The checkpoint after it is refused, as it must be; the run then stops
    as a run of non-finite steps does -- saying where, what to try and which checkpoint to go
    back to -- not with the bare refusal."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    from tightfit.plan import Plan
    from tightfit.runtime.trainer import NonFiniteTrainingError, TrainConfig, Trainer
    from tightfit.tasks import SequenceClassification
    from tightfit.workload import Workload, collate_as

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.norm, self.head = torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)

        def forward(self, x):
            return SimpleNamespace(logits=self.head(self.norm(self.inp(x))))

    torch.manual_seed(0)
    model = Net()
    forwards = [0]

    def huge_from_the_third_step(module, inputs, out):  # one forward a step: micro-batch = batch
        if module.training:
            forwards[0] += 1
            if forwards[0] >= 3:
                return out * 1e30  # finite; its batch variance (1e60) is not
        return out

    model.inp.register_forward_hook(huge_from_the_third_step)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    w = Workload(model, data, None, effective_batch=8, task=SequenceClassification(),
                 collate_fn=collate_as("x", "labels"))
    config = TrainConfig(epochs=1, lr=1e-3, checkpoint_dir=str(tmp_path), checkpoint_every=2, prefetch=False)
    trainer = Trainer(w, Plan("fp32", micro_batch=8, effective_batch=8, device="cpu"), config, progress=False)
    try:
        trainer.fit()
    except NonFiniteTrainingError as e:
        stop = e
    else:
        raise AssertionError("the run trained on with a non-finite running variance")
    assert stop.step == 4 and stop.checkpoint is None and stop.last_update == 4
    message = str(stop)
    assert "'norm.running_var'" in message and "after step 4" in message and "Try a lower --lr" in message
    assert _names(tmp_path) == ["ckpt-2"]  # the last checkpoint with finite values, in place
