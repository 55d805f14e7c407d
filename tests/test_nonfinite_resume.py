"""A run that stops on non-finite gradients keeps the checkpoints written before the trouble:
resumes that fail the same way do not prune them away, and ``--resume RUN/checkpoints/ckpt-N``
goes back to one of them."""

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
    save_checkpoint(tmp_path, 6, model, _state(6, 2), keep_last=1)  # the stop after two skipped steps
    save_checkpoint(tmp_path, 8, model, _state(8, 2), keep_last=1)  # a resume that failed again
    assert _names(tmp_path) == ["ckpt-4", "ckpt-6", "ckpt-8"]
    assert [skipped_in_row(p) for p in list_checkpoints(tmp_path)] == [0, 2, 2]
    assert clean_checkpoint_before(tmp_path, 8).name == "ckpt-4"
    save_checkpoint(tmp_path, 10, model, _state(10, 0), keep_last=1)  # a resume that trains on: all behind it goes
    assert _names(tmp_path) == ["ckpt-10"]
    save_checkpoint(tmp_path, 4, model, _state(4, 0), keep_last=1)  # a resume from an earlier one: later ones go
    assert _names(tmp_path) == ["ckpt-4"]


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
                     "--lr", "1e-3", "--seq-len", "16", "--checkpoint-every", "2", "--keep-last", "1",
                     "--max-skipped-steps", "2", "--out", str(run), *base]) == 2
        err = capsys.readouterr().err
        assert _names(run / "checkpoints") == ["ckpt-4", "ckpt-6"]
        assert f"go back to ckpt-4, the last checkpoint before the non-finite steps: tightfit train --resume " \
               f"{run / 'checkpoints' / 'ckpt-4'}" in err
        _blow_up_from(m, 1)
        assert main(["train", "--resume", str(run), "--lr", "1e-4", *base]) == 2  # fails again
        assert _names(run / "checkpoints") == ["ckpt-4", "ckpt-6", "ckpt-8"]  # keep-last 1 kept ckpt-4
    capsys.readouterr()
    assert main(["train", "--resume", str(run / "checkpoints" / "ckpt-4"), "--lr", "1e-4", *base]) == 0
    said = capsys.readouterr()
    assert "resuming from ckpt-4: the later ckpt-6, ckpt-8 will be deleted" in said.out + said.err
    assert _names(run / "checkpoints") == ["ckpt-18"]  # 2 epochs of 9 steps
    assert (run / "summary.json").is_file()

