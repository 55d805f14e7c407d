"""Faults found by a fresh user (session of 2026-12-03): repros in /tmp/fresh-user-7."""

import re
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

import tightfit
from tightfit.errors import TightfitError
from tightfit.plan import Plan


# ---------------------------------------------------------------- 1. frozen BatchNorm in a train-mode model
def _frozen_backbone_model():
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU())
    model = torch.nn.Sequential(backbone, torch.nn.Linear(16, 2), torch.nn.Dropout(0.5))
    for p in backbone.parameters():
        p.requires_grad_(False)
    model.train()
    backbone.eval()  # the usual way to freeze a pretrained backbone's BatchNorm statistics
    return model, backbone


def test_train_step_keeps_an_eval_mode_backbone_in_eval_mode():
    model, backbone = _frozen_backbone_model()
    before = backbone[1].running_mean.clone()
    x, y = torch.randn(8, 8) * 3 + 1, torch.randint(0, 2, (8,))
    seen = []  # the dropout's mode in the step
    model[2].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, torch.optim.SGD(model[1].parameters(), lr=0.1),
                              loss=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    step((x, y))
    assert torch.equal(before, backbone[1].running_mean)  # the frozen statistics are untouched
    assert seen == [True, True]  # the head's dropout is on, as the user set it
    assert model.training and not backbone.training  # the modes are given back


def test_train_step_on_a_peft_model_of_an_eval_mode_model_trains_with_dropout_on():
    """peft's wrapper is made in train mode around a model in eval mode (from_pretrained): the mode
    that counts is the wrapped model's, so every module trains (dropout on)."""
    peft = pytest.importorskip("peft")
    from conftest import SyntheticBatches, tiny_bert

    model = peft.get_peft_model(tiny_bert(dropout=0.1).eval(), peft.LoraConfig(r=4, target_modules=["query"]))
    assert model.training and not model.get_base_model().training
    seen = []
    model.get_base_model().bert.encoder.layer[0].register_forward_pre_hook(lambda m, a: seen.append(m.training))
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, lr=1e-3)
    step(SyntheticBatches(8).collate(list(range(8))))
    assert seen == [True, True]
    assert not model.get_base_model().training  # given back


class _Wrapped(torch.nn.Module):
    """The frozen-backbone model with the runtime's interface (``pixel_values`` in, ``.logits`` out)."""

    def __init__(self):
        super().__init__()
        self.net, self.backbone = _frozen_backbone_model()

    def forward(self, pixel_values):
        return SimpleNamespace(logits=self.net(pixel_values))


def _runtime_fit(model, seen):
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    model.net[2].register_forward_pre_hook(lambda m, a: seen.append(m.training) if torch.is_grad_enabled() else None)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 8, generator=g) * 3 + 1, torch.randint(0, 2, (24,), generator=g)
    w = Workload(model, TensorDataset(x[:16], y[:16]), TensorDataset(x[16:], y[16:]), effective_batch=8,
                 task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))
    Trainer(w, Plan("fp32", 4, 8, device="cpu"), TrainConfig(epochs=1, lr=1e-2), progress=False).fit()


def test_runtime_trainer_keeps_an_eval_mode_backbone_in_eval_mode():
    model, seen = _Wrapped(), []
    model.train()
    model.backbone.eval()
    before = model.backbone[1].running_mean.clone()
    _runtime_fit(model, seen)
    assert torch.equal(before, model.backbone[1].running_mean)
    assert seen and all(seen)  # the head's dropout trained on
    assert model.training and not model.backbone.training


def test_runtime_trainer_still_trains_an_eval_mode_model_with_dropout_on():
    model, seen = _Wrapped(), []
    model.eval()  # as from_pretrained returns it: every module trains
    before = model.backbone[1].running_mean.clone()
    _runtime_fit(model, seen)
    assert not torch.equal(before, model.backbone[1].running_mean)  # BatchNorm in train mode
    assert seen and all(seen)
    assert not any(m.training for m in model.modules())  # eval mode given back


# ---------------------------------------------------------------- 2. HF OOM redo: only this call's checkpoints
class _HFRows(torch.utils.data.Dataset):
    """``n`` synthetic padded samples as dicts the HF Trainer's default collator stacks."""

    def __init__(self, n=32, lm=False):
        from conftest import LMBatches, SyntheticBatches

        data = (LMBatches if lm else SyntheticBatches)(n)
        self.batch = data.collate(range(n), pad_to=data.seq_len)

    def __len__(self):
        return len(self.batch["labels"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def _hf_trainer(out, plan, model=None, data=None, **extra):
    from transformers import Trainer, TrainingArguments

    from conftest import tiny_bert
    from tightfit.integrations import hf

    args = TrainingArguments(**{"output_dir": str(out), "learning_rate": 1e-3, "logging_steps": 1,
                                "save_strategy": "no", "report_to": [], "disable_tqdm": True, "seed": 0,
                                **hf.training_arguments(plan), **extra})
    return Trainer(model=model or tiny_bert(dropout=0.0), args=args, train_dataset=data or _HFRows(),
                   callbacks=[hf.TightfitCallback(plan)])


class _OOMAtCall:
    """A forward pre-hook raising a CUDA-style OOM once, at its ``at``-th call."""

    def __init__(self, at):
        self.at, self.calls, self.rows = at, 0, []

    def __call__(self, module, args, kwargs):
        self.calls += 1
        self.rows.append((args[0] if args else kwargs["hidden_states"]).shape[0])
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _stale_checkpoint(out):
    """A checkpoint-50 in ``out`` left by an earlier run."""
    from tightfit.integrations import hf

    earlier = _hf_trainer(out, Plan("fp32", 8, 8), max_steps=1, save_strategy="steps", save_steps=1)
    hf.train(earlier)
    (out / "checkpoint-1").rename(out / "checkpoint-50")


def test_hf_oom_redo_uses_only_a_checkpoint_this_call_wrote(tmp_path):
    from tightfit.integrations import hf

    out = tmp_path / "out"
    _stale_checkpoint(out)
    trainer = _hf_trainer(out, Plan("fp32", 8, 8), max_steps=3, save_strategy="steps", save_steps=1)
    hook = _OOMAtCall(3)  # step 3, after checkpoint-1 and -2 of this call
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
    hf.train(trainer)
    assert trainer.state.global_step == 3
    assert hook.rows == [8, 8, 8, 4, 4]  # step 3 trained again from checkpoint-2, as 2 x 4


def test_hf_oom_redo_with_only_another_runs_checkpoint_stops_and_says_why(tmp_path):
    from tightfit.integrations import hf

    out = tmp_path / "out"
    _stale_checkpoint(out)
    trainer = _hf_trainer(out, Plan("fp32", 8, 8), max_steps=3)  # this call saves nothing
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(_OOMAtCall(2), with_kwargs=True)
    with pytest.raises(TightfitError, match="at step 2 .* no checkpoint .* written by this run"):
        hf.train(trainer)


# ---------------------------------------------------------------- 4. integrations: exact short last window
def test_hf_accumulation_is_exact_on_a_short_last_window(tmp_path):
    """22 samples, effective batch 8: windows of 8, 8 and 6; at micro-batch 4 the last is 4 + 2, whose
    mean the Trainer took as (mean of 4 + mean of 2) / 2."""
    from tightfit.integrations import hf

    weights = {}
    for mb in (8, 4, 2):
        trainer = _hf_trainer(tmp_path / str(mb), Plan("fp32", mb, 8), data=_HFRows(22), num_train_epochs=1,
                              optim="sgd", learning_rate=0.5)
        hf.train(trainer)
        assert trainer.state.global_step == 3
        weights[mb] = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    for mb in (4, 2):
        torch.testing.assert_close(weights[mb], weights[8], rtol=0, atol=1e-5)


class _LitLinear:
    """A Lightning module over a linear classifier, its loss a mean over the micro-batch."""

    @staticmethod
    def make():
        import lightning as L

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.cross_entropy(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.5)

        return Module()


@pytest.mark.parametrize("n", [20, 22])  # a last window of 4 samples (4; 2 + 2) or 6 (4 + 2; 2 + 2 + 2)
def test_lightning_accumulation_is_exact_on_a_short_last_window(n):
    import lightning as L

    from tightfit.integrations.lightning import TightfitCallback, trainer_arguments

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
    weights = {}
    for mb in (8, 4, 2):
        plan = Plan("fp32", mb, 8, device="cpu")
        module = _LitLinear.make()
        trainer = L.Trainer(**trainer_arguments(plan, max_epochs=1, logger=False, enable_checkpointing=False,
                                                enable_progress_bar=False, enable_model_summary=False),
                            callbacks=[TightfitCallback(plan)])
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=mb))
        assert trainer.global_step == 3
        weights[mb] = torch.cat([p.detach().flatten() for p in module.parameters()])
    for mb in (4, 2):
        torch.testing.assert_close(weights[mb], weights[8], rtol=0, atol=1e-6)


# ---------------------------------------------------------------- 3. image data fingerprints relative to the root
@pytest.fixture(scope="module")
def _image_run_inputs(tmp_path_factory):
    """A tiny grey ResNet model folder, a folder of 3 digit classes (8 PNGs each) and a CSV of those
    images' paths (relative to the CSV) and labels."""
    pytest.importorskip("sklearn")
    from PIL import Image
    from transformers import ResNetConfig, ResNetForImageClassification

    from tightfit.images import load_digits

    root = tmp_path_factory.mktemp("f8-images")
    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1],
                                              layer_type="basic", num_labels=3)).save_pretrained(root / "resnet")
    d, rows = load_digits(), ["path,label"]
    for cls in ("0", "1", "7"):
        (root / "imgs" / cls).mkdir(parents=True)
        for n, i in enumerate([i for i, y in enumerate(d.labels) if d.label_names[y] == cls][:8]):
            Image.fromarray(d.images[i]).save(root / "imgs" / cls / f"{n}.png")
            rows.append(f"imgs/{cls}/{n}.png,{cls}")
    (root / "imgs.csv").write_text("\n".join(rows) + "\n")
    return root


def test_image_fingerprint_is_the_same_for_relative_absolute_and_symlinked_data(_image_run_inputs, monkeypatch):
    from tightfit.images import load_image_classification

    root = _image_run_inputs
    (root / "link").unlink(missing_ok=True)
    (root / "link").symlink_to(root)
    monkeypatch.chdir(root)
    for spec in ("imgs", "imgs.csv"):
        prints = {load_image_classification(s).fingerprint()
                  for s in (spec, str(root / spec), str(root / "link" / spec), f"./{spec}/" if spec == "imgs" else spec)}
        assert len(prints) == 1, spec


@pytest.mark.parametrize("data", ["imgs", "imgs.csv"])
def test_an_image_run_started_with_a_relative_data_path_resumes_and_exports(data, _image_run_inputs, tmp_path,
                                                                             monkeypatch, capsys):
    from tightfit.cli import main

    monkeypatch.chdir(_image_run_inputs)
    out = tmp_path / "run"
    assert main(["train", "--data", data, "--model", "resnet", "--image-size", "8", "--max-steps", "2",
                 "--batch-size", "8", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert "already finished at step 2" in capsys.readouterr().out
    assert main(["export", "--int8", str(out), "--out", str(tmp_path / "int8")]) == 0


def test_an_image_run_with_the_fingerprint_of_before_still_resumes(_image_run_inputs, tmp_path, monkeypatch, capsys):
    """A run that recorded the old fingerprint (paths as loaded: absolute ``--data``) is accepted."""
    import json

    from tightfit.cli import main
    from tightfit.data import held_out_split
    from tightfit.images import load_image_classification

    root = _image_run_inputs
    out = tmp_path / "run"
    assert main(["train", "--data", str(root / "imgs"), "--model", str(root / "resnet"), "--image-size", "8",
                 "--max-steps", "2", "--batch-size", "8", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    record = json.loads((out / "request.json").read_text())
    data = load_image_classification(str(root / "imgs"))
    # the same split the run made, fingerprinted the old way
    train_idx, eval_idx = held_out_split(len(data))
    old = f"{data.subset(train_idx).fingerprint(legacy=True)}:{data.subset(eval_idx).fingerprint(legacy=True)}"
    assert old != record["data_fingerprint"]
    (out / "request.json").write_text(json.dumps({**record, "data_fingerprint": old}))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    assert "already finished at step 2" in capsys.readouterr().out


def test_an_image_replaced_by_another_of_the_same_size_is_other_data_on_resume(_image_run_inputs, tmp_path,
                                                                                  capsys):
    """The fingerprint held paths and file sizes: an image replaced by another of the same size (any
    two BMPs of one shape) was resumed on as the same data. It now holds each file's SHA-256; a run
    that recorded the size form is still accepted."""
    import json

    from PIL import Image

    from tightfit.cli import main
    from tightfit.data import held_out_split
    from tightfit.images import load_image_classification

    root, imgs = _image_run_inputs, tmp_path / "imgs"
    for png in sorted((root / "imgs").rglob("*.png")):
        (imgs / png.parent.name).mkdir(parents=True, exist_ok=True)
        Image.open(png).save(imgs / png.parent.name / (png.stem + ".bmp"))
    out = tmp_path / "run"
    assert main(["train", "--data", str(imgs), "--model", str(root / "resnet"), "--image-size", "8",
                 "--max-steps", "2", "--batch-size", "8", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    record = json.loads((out / "request.json").read_text())
    data = load_image_classification(str(imgs))
    train_idx, eval_idx = held_out_split(len(data))
    sized = f"{data.subset(train_idx).fingerprint(sizes=True)}:{data.subset(eval_idx).fingerprint(sizes=True)}"
    assert sized != record["data_fingerprint"]
    (out / "request.json").write_text(json.dumps({**record, "data_fingerprint": sized}))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0  # a run of the size form resumes
    assert "already finished at step 2" in capsys.readouterr().out
    (out / "request.json").write_text(json.dumps(record))
    a, b = imgs / "0" / "0.bmp", imgs / "1" / "0.bmp"
    assert a.stat().st_size == b.stat().st_size and a.read_bytes() != b.read_bytes()
    a.write_bytes(b.read_bytes())  # a "1" drawn in class 0, the file's size unchanged
    assert main(["train", "--resume", str(out), "--no-progress"]) == 2
    assert "the data differ from those the run started with" in capsys.readouterr().err


def _images_gone_at_step(inputs, tmp_path, monkeypatch, step: int, checkpoint_every: int):
    """A copy of the image run's inputs whose every image is moved away when the run logs ``step``
    (whichever the next batch reads is gone); returns the run's argv, its folder and a function that
    puts the images back (and undoes the patch)."""
    import shutil

    from tightfit.report.metrics import MetricsWriter

    imgs, moved, out = tmp_path / "imgs", tmp_path / "moved", tmp_path / "run"
    shutil.copytree(inputs / "imgs", imgs)
    moved.mkdir()
    real = MetricsWriter.__call__

    def delete_all(self, record):
        if record.get("type") == "train" and record["step"] == step:
            for f in imgs.rglob("*.png"):
                f.rename(moved / f"{f.parent.name}-{f.name}")
        return real(self, record)

    def put_back():
        monkeypatch.undo()
        for f in moved.iterdir():
            cls, name = f.name.split("-", 1)
            f.rename(imgs / cls / name)

    monkeypatch.setattr(MetricsWriter, "__call__", delete_all)
    argv = ["train", "--data", str(imgs), "--model", str(inputs / "resnet"), "--image-size", "8", "--max-steps", "4",
            "--batch-size", "8", "--checkpoint-every", str(checkpoint_every), "--log-every", "1", "--out", str(out),
            "--no-progress", "--device", "cpu"]
    return argv, out, put_back


def test_an_image_gone_while_the_run_trains_stops_it_in_one_line_and_it_resumes(_image_run_inputs, tmp_path,
                                                                                    monkeypatch, capsys):
    """Images are read when their batch is made: one deleted while the run trained ended it in a
    FileNotFoundError traceback, with nothing saying how to go on."""
    from tightfit.cli import main

    argv, out, put_back = _images_gone_at_step(_image_run_inputs, tmp_path, monkeypatch, step=2, checkpoint_every=1)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a sample of the data is gone" in err[0] and "Traceback" not in err[0], err
    assert re.search(r"the run is at step [23] of 4", err[0]) and f"tightfit train --resume {out}" in err[0]
    put_back()
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0


def test_an_image_gone_before_the_first_checkpoint_leaves_no_run_folder_so_the_same_command_runs_again(
        _image_run_inputs, tmp_path, monkeypatch, capsys):
    """From a fresh user's trial: an image gone before the run's first checkpoint said "put it back
    and run the same command again", and the same command was then refused: the folder held a run
    that stopped before its first checkpoint. What the run wrote is removed, as a stop before the
    first checkpoint removes it."""
    from tightfit.cli import main

    argv, out, put_back = _images_gone_at_step(_image_run_inputs, tmp_path, monkeypatch, step=1, checkpoint_every=0)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a sample of the data is gone" in err[0] and "run the same command again" in err[0], err
    assert not out.exists()
    put_back()
    assert main(argv) == 0


# ---------------------------------------------------------------- 5, 6. Python API values; --resume with the run's columns
WORDS = "film plot actor scene great dull awful superb boring moving".split()


@pytest.fixture(scope="module")
def _text_inputs(tmp_path_factory):
    """A tiny BERT classifier folder and a CSV of 40 reviews in columns ``review`` and ``sentiment``."""
    from conftest import tiny_text_model_folder

    root = tmp_path_factory.mktemp("f8-text")
    model = tiny_text_model_folder(root, WORDS, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32, max_position_embeddings=64)
    rows = "".join(f"{WORDS[i % 10]} {WORDS[(i * 3) % 10]} film,{'pos' if i % 2 else 'neg'}\n" for i in range(40))
    (root / "reviews.csv").write_text("review,sentiment\n" + rows)
    return model, root / "reviews.csv"


def test_python_api_takes_paths_and_numpy_numbers_as_plain_values(_text_inputs, tmp_path):
    import json
    import pathlib

    import numpy as np

    from tightfit.api import TrainRequest, train

    model, data = _text_inputs
    out = tmp_path / "run"
    req = TrainRequest(model=pathlib.Path(model), data=pathlib.Path(data), out=out, text_column="review",
                       label_column="sentiment", batch_size=np.int64(8), epochs=np.float32(1.0), lr=np.float64(1e-3),
                       max_steps=np.int32(2), seq_len=np.uint8(16), progress=False)
    flat = req.to_flat()
    assert (type(flat["batch_size"]), type(flat["epochs"]), type(flat["lr"]), type(flat["model"]),
            type(flat["out"])) == (int, float, float, str, str)
    train(req)
    record = json.loads((out / "request.json").read_text())
    assert record["batch_size"] == 8 and record["max_steps"] == 2 and record["data"] == str(data.resolve())


def test_a_run_folder_is_not_left_behind_when_the_request_cannot_be_written(_text_inputs, tmp_path, monkeypatch):
    import tightfit.api as api

    def fail(path, obj):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(api, "atomic_write_json", fail)
    model, data = _text_inputs
    out = tmp_path / "run"
    with pytest.raises(TightfitError, match="could not be written: No space left on device; nothing of it is left"):
        api.train(api.TrainRequest(model=str(model), data=str(data), out=str(out), text_column="review",
                                   label_column="sentiment", batch_size=8, max_steps=2, seq_len=16, progress=False))
    assert not out.exists()


def test_resume_with_the_runs_own_columns_is_accepted(_text_inputs, tmp_path, capsys):
    from tightfit.cli import main

    model, data = _text_inputs
    out = tmp_path / "run"
    columns = ["--text-column", "review", "--label-column", "sentiment"]
    assert main(["train", "--data", str(data), "--model", str(model), *columns, "--max-steps", "2", "--batch-size",
                 "8", "--seq-len", "16", "--out", str(out), "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(out), *columns, "--no-progress"]) == 0
    assert "already finished at step 2" in capsys.readouterr().out
    # another column is still refused, in one line
    assert main(["train", "--resume", str(out), "--text-column", "other", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot change --text-column" in err, err


# ---------------------------------------------------------------- 7. int8 export: integrity of model_int8.pt
@pytest.fixture(scope="module")
def _int8_export(_text_inputs, tmp_path_factory):
    """An int8 export of the tiny BERT model folder."""
    from tightfit.export import export_int8

    model, _ = _text_inputs
    out = tmp_path_factory.mktemp("f8-int8") / "int8"
    export_int8(model, out)
    return out


def _copy_of(folder, tmp_path):
    import pathlib
    import shutil

    return pathlib.Path(shutil.copytree(folder, tmp_path / "copy"))


def test_int8_export_records_the_weights_hash_and_a_flipped_byte_is_refused(_int8_export, tmp_path):
    import json

    from tightfit.export import WEIGHTS_FILE, load_int8

    record = json.loads((_int8_export / "export.json").read_text())
    assert record["weights"]["bytes"] == (_int8_export / WEIGHTS_FILE).stat().st_size
    assert len(record["weights"]["sha256"]) == 64
    load_int8(_int8_export)  # intact: loads
    folder = _copy_of(_int8_export, tmp_path)
    data = bytearray((folder / WEIGHTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of a weight
    (folder / WEIGHTS_FILE).write_bytes(bytes(data))
    with pytest.raises(TightfitError, match=f"{WEIGHTS_FILE}: SHA-256 differs"):
        load_int8(folder)


def test_a_truncated_int8_weights_file_is_refused_naming_it(_int8_export, tmp_path):
    import json

    from tightfit.export import WEIGHTS_FILE, load_int8

    folder = _copy_of(_int8_export, tmp_path)
    data = (folder / WEIGHTS_FILE).read_bytes()
    (folder / WEIGHTS_FILE).write_bytes(data[:len(data) // 2])
    with pytest.raises(TightfitError, match=f"{WEIGHTS_FILE}: .* bytes, but the export wrote"):
        load_int8(folder)
    # an export made before the hash was recorded: its size check still refuses it
    record = json.loads((folder / "export.json").read_text())
    del record["weights"]
    (folder / "export.json").write_text(json.dumps(record))
    with pytest.raises(TightfitError, match="bytes, but the export wrote"):
        load_int8(folder)
    # and one without export.json: torch.load's error, named
    (folder / "export.json").unlink()
    with pytest.raises(TightfitError, match=f"{WEIGHTS_FILE}: cannot be read"):
        load_int8(folder)


def test_an_int8_export_whose_config_is_cut_short_is_refused_in_one_line(_int8_export, tmp_path):
    """load_int8 checks the weights file, but read config.json with transformers' AutoConfig: a
    config.json cut short raised its OSError ("not a valid JSON file"), not a TightfitError."""
    from tightfit.export import load_int8

    folder = _copy_of(_int8_export, tmp_path)
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[:len(text) // 2])
    with pytest.raises(TightfitError, match="cannot read the model config in"):
        load_int8(folder)


def test_an_int8_export_of_before_the_hash_still_loads(_int8_export, tmp_path):
    import json

    from tightfit.export import load_int8

    folder = _copy_of(_int8_export, tmp_path)
    record = json.loads((folder / "export.json").read_text())
    del record["weights"]
    (folder / "export.json").write_text(json.dumps(record))
    load_int8(folder)


# ---------------------------------------------------------------- 8. tightfit bench run: --out and --warmup
def _bench_refused(capsys, *argv):
    from tightfit.cli import main

    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--device", "cpu", "--settings", "hf", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tightfit: error: ") and err.count("\n") == 1, err
    return err


def test_bench_run_refuses_a_file_or_unwritable_out_in_one_line(tmp_path, capsys):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert "is a file" in _bench_refused(capsys, "--out", str(a_file))
    assert "not a writable folder" in _bench_refused(capsys, "--out", str(a_file / "sub"))
    assert "not a writable folder" in _bench_refused(capsys, "--out", "/proc/tightfit-bench")
    assert a_file.read_text() == "x"


def test_bench_run_refuses_a_negative_warmup(tmp_path, capsys):
    assert "--warmup must be >= 0" in _bench_refused(capsys, "--out", str(tmp_path / "o"), "--warmup", "-1")
    assert not (tmp_path / "o").exists()
