"""Faults a careful user found (review helpers, 2026-12-07, left from the last session): each
reproduced, then fixed."""

import json

from conftest import tiny_cpu_job


def _train_args(job, out):
    return ["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "1",
            "--seq-len", "16", "--out", str(out), "--no-progress"]


def test_a_cpu_run_says_its_budget_is_not_applied_rather_than_checked(tmp_path, caplog):
    """On the CPU a --budget of 1e23 GiB was taken with the note that --gpu/--budget 'are
    checked': without --gpu there is no card to check it against, and it caps nothing."""
    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    with caplog.at_level("INFO", logger="tightfit"):
        assert main(_train_args(job, tmp_path / "a") + ["--budget", "1e23GiB"]) == 0
    notes = [r.getMessage() for r in caplog.records if "no CUDA GPU in use" in r.getMessage()]
    assert notes and "--budget caps a GPU's memory and is not applied (checked only against the model state)" \
        in notes[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="tightfit"):
        assert main(_train_args(job, tmp_path / "b") + ["--gpu", "gtx-1650-ti", "--budget", "3GiB"]) == 0
    notes = [r.getMessage() for r in caplog.records if "no CUDA GPU in use" in r.getMessage()]
    assert notes and "--gpu/--budget are checked against the NVIDIA GeForce GTX 1650 Ti's memory" in notes[0]


def _tiny_resnet(folder):
    """A ResNet whose last maps are 1 x 1 at 8 pixels: its BatchNorm cannot train on one sample."""
    import torch
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                              layer_type="basic", num_labels=3)).save_pretrained(folder)
    return str(folder)


def test_a_model_that_cannot_train_on_one_sample_is_planned_from_micro_batch_2(tmp_path, capsys):
    """ResNet-50 at 32 pixels (CIFAR-sized) planned at 350 and 600 MiB but stopped at 400 MiB with
    "cannot trace resnet50 at size 32: Expected more than 1 value per channel": the search's exact
    trace of micro-batch 1, made only to see whether anything fits, met BatchNorm's refusal of
    one sample. The search now starts at micro-batch 2 for such a model: a tight budget gets the
    nothing-fits answer at micro-batch 2, a larger one its plan; never a micro-batch of 1."""
    from tightfit.cli import main
    from tightfit.planner.search import refuses_one_sample_step
    from tightfit.models import build_model

    model = _tiny_resnet(tmp_path / "resnet")
    built, make_batch = build_model(model, image_size=8)
    assert refuses_one_sample_step(built, make_batch, 8)
    assert not refuses_one_sample_step(*build_model(model, image_size=32), 32)  # 2 x 2 maps: one sample trains
    args = ["plan", "--model", model, "--image-size", "8", "--batch-size", "64", "--budget"]
    capsys.readouterr()
    assert main(args + ["86MiB"]) == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "micro-batch 2," in err and "cannot trace" not in err, err
    assert main(args + ["90MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["micro_batch"] == 64
    # frozen first blocks are found by a forward too: of two samples, not one (a third helper's find)
    assert main(args + ["1GiB", "--trainable", "frozen-1", "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["plan"]["micro_batch"] == 64


def test_frozen_n_freezes_what_lies_between_the_blocks_too(tmp_path):
    """A ResNet of basic layers repeats the conv layers inside each residual layer, and each
    layer's shortcut is registered beside them: ``frozen-4`` of its 4 blocks said "the first 4
    of 4 blocks frozen" yet left stage 2's shortcut convolution and its BatchNorm training in the
    middle of the frozen network (frozen-N should train only what comes after the blocks)."""
    import torch

    from tightfit.levers.freezing import apply_freezing
    from tightfit.models import build_model

    folder = _tiny_resnet(tmp_path / "resnet")
    model, _ = build_model(folder, image_size=8, device="cpu")
    apply_freezing(model, "frozen-4")
    assert [k for k, p in model.named_parameters() if p.requires_grad] == ["classifier.1.weight", "classifier.1.bias"]
    assert not [k for k, m in model.named_modules() if isinstance(m, torch.nn.BatchNorm2d) and m.training]
    model, _ = build_model(folder, image_size=8, device="cpu")
    apply_freezing(model, "frozen-3")  # the last conv layer's block trains, and what comes after it
    shortcut = model.resnet.encoder.stages[1].layers[0].shortcut
    assert not any(p.requires_grad for p in shortcut.parameters()) and not shortcut.normalization.training
