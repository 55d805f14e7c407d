"""Faults a careful user of the Python API finds (session 37): a TrainStep call that fails for
another reason than memory is undone before the error propagates, BatchNorm's one-sample
micro-batch is refused before any work, and an optimizer or loss that cannot work is refused
when the step is made."""

import re
from types import SimpleNamespace

import pytest
import torch

from tightfit import TrainStep
from tightfit.errors import TightfitError
from tightfit.plan import Plan


def _bn_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.2),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def _data(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def test_a_step_that_fails_mid_window_is_undone_so_a_loop_that_skips_the_batch_goes_on_clean():
    """A bad label in the second micro-batch: the first one's gradient, BatchNorm statistics and
    random numbers had stayed, and the next step applied them on top of its own."""
    x, y = _data()
    bad = y.clone()
    bad[20] = 7  # no such class: cross-entropy raises in the second micro-batch of 16

    def run(with_failure: bool):
        m = _bn_model()
        s = TrainStep(Plan("fp32", 16, 32), m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), loss=_loss)
        torch.manual_seed(5)  # dropout's stream
        if with_failure:
            with pytest.raises(IndexError):
                s((x, bad))
            assert all(p.grad is None for p in m.parameters())
        outs = [s((x, y)).loss for _ in range(2)]
        return outs, [p.detach().clone() for p in m.parameters()], m[1].running_mean.clone(), \
            int(m[1].num_batches_tracked)

    clean, failed = run(False), run(True)
    assert clean[0] == failed[0]
    assert all(torch.equal(a, b) for a, b in zip(clean[1], failed[1]))
    assert torch.equal(clean[2], failed[2]) and clean[3] == failed[3] == 4


def test_a_one_sample_micro_batch_that_batchnorm_cannot_train_on_is_said_and_undone():
    m = _bn_model()
    s = TrainStep(Plan("fp32", 16, 32), m, torch.optim.SGD(m.parameters(), lr=0.1), loss=_loss)
    before = [p.detach().clone() for p in m.parameters()]
    x, y = _data(17)  # an epoch's last batch of 17: 16 + 1
    with pytest.raises(TightfitError, match=r"a batch of 17 samples, split as 16\+1, gives the model's BatchNorm "
                                            r"layers a micro-batch of 1 sample.*drop_last=True"):
        s((x, y))
    assert int(m[1].num_batches_tracked) == 0 and all(torch.equal(a, p) for a, p in zip(before, m.parameters()))
    assert all(p.grad is None for p in m.parameters())
    s(_data(18))  # 16 + 2 trains
    m[1].eval()  # BatchNorm frozen by the caller (a train-mode model keeps its parts' modes)
    s(_data(17))


def _conv_bn(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 3))


def test_batchnorm_over_feature_maps_trains_on_one_sample_in_the_step_and_the_trainer():
    """BatchNorm2d normalises one image over its H x W values: an epoch's last batch of 17 at
    micro-batch 16 trains (the one-sample refusal had counted every BatchNorm layer)."""
    from torch.utils.data import TensorDataset

    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    m = _conv_bn()
    s = TrainStep(Plan("fp32", 16, 32), m, torch.optim.SGD(m.parameters(), lr=0.1),
                  loss=lambda mm, b: torch.nn.functional.cross_entropy(mm(b[0]), b[1]))
    assert s((torch.randn(17, 3, 8, 8), torch.randint(0, 3, (17,)))).accumulation_steps == 2
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(30, 3, 8, 8, generator=g), torch.randint(0, 3, (30,), generator=g))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _conv_bn()

        def forward(self, pixel_values, labels=None):
            return SimpleNamespace(logits=self.net(pixel_values))

    w = Workload(Net(), data, None, 10, task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))
    assert Trainer(w, Plan("fp32", 3, 10), TrainConfig(epochs=1), progress=False).fit().steps == 3  # 3+3+3+1
def test_an_optimizer_that_is_none_or_over_another_model_and_a_loss_that_is_none_are_refused():
    m, other = _bn_model(), _bn_model(1)
    plan = Plan("fp32", 16, 32)
    with pytest.raises(TightfitError, match="optimizer must be a torch.optim.Optimizer over the model's parameters"):
        TrainStep(plan, m, "adamw", loss=_loss)
    with pytest.raises(TightfitError, match="the optimizer updates none of the model's trainable parameters"):
        TrainStep(plan, m, torch.optim.AdamW(other.parameters()), loss=_loss)
    with pytest.raises(TightfitError, match="loss must be a function"):
        TrainStep(plan, m, torch.optim.AdamW(m.parameters()), loss="x")
    TrainStep(plan, m, torch.optim.AdamW(m[4].parameters()), loss=_loss)  # a part of the model: yours to choose
    frozen = _bn_model().requires_grad_(False)  # nothing for the plan's optimizer to update: one line, not torch's
    with pytest.raises(TightfitError, match="the model has no trainable parameters"):
        TrainStep(plan, frozen, loss=_loss)
    # state offloaded to the host: host copies in the groups, the model's parameters as param_d2h_map's keys
    offloaded = SimpleNamespace(param_groups=[{"params": [p.detach().clone() for p in m.parameters()]}],
                                param_d2h_map={p: None for p in m.parameters()}, step=lambda: None)
    TrainStep(plan, m, offloaded, loss=_loss)


def test_plan_and_train_refuse_checkpointing_on_for_a_model_with_nothing_to_checkpoint(tmp_path, capsys):
    """`tightfit plan --checkpointing on` printed "checkpointing 0 of 0 blocks" for a model that
    has no repeated blocks (ALBERT shares one layer), where `estimate` and `tightfit.plan` refuse."""
    from transformers import AlbertConfig, AlbertForSequenceClassification, BertTokenizerFast

    from tightfit.cli import main

    folder = tmp_path / "albert"
    AlbertForSequenceClassification(AlbertConfig(
        vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, num_labels=2)).save_pretrained(folder)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad"]) + "\n")
    BertTokenizerFast(vocab=str(tmp_path / "vocab.txt")).save_pretrained(folder)
    (tmp_path / "data.csv").write_text("text,label\n" + "good,pos\nbad,neg\n" * 12)
    for command in (["plan", "--model", str(folder), "--seq-len", "32", "--batch-size", "8", "--gpu", "t4"],
                    ["train", "--model", str(folder), "--data", str(tmp_path / "data.csv"), "--seq-len", "32",
                     "--batch-size", "8", "--device", "cpu",
                     "--train-samples", "16", "--out", str(tmp_path / "run")]):
        assert main(command + ["--checkpointing", "on"]) == 2
        err = capsys.readouterr().err
        assert "--checkpointing on: AlbertForSequenceClassification has no repeated blocks to checkpoint" in err, err
    assert not (tmp_path / "run").exists()


def test_an_error_after_a_fused_optimizers_step_keeps_the_state_that_step_wrote():
    """A step post-hook raising after fused AdamW wrote the update: the moments and step count
    it wrote stay beside the weights it changed (review: they had been deleted)."""
    m = _bn_model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1, fused=True)  # no snapshot taken: the step's writes are not seen
    raised = []

    def once(optimizer, args, kwargs):
        if not raised:
            raised.append(1)
            raise RuntimeError("a hook of yours")

    opt.register_step_post_hook(once)
    s = TrainStep(Plan("fp32", 16, 32), m, opt, loss=_loss)
    with pytest.raises(RuntimeError, match="a hook of yours"):
        s(_data())
    assert len(opt.state) == len(list(m.parameters())) and all(int(st["step"]) == 1 for st in opt.state.values())


@pytest.mark.parametrize("make", ["xz", "latin-1"])
def test_data_in_another_encoding_or_compression_is_said_as_such(tmp_path, capsys, make):
    """An .xz file and a Latin-1 CSV gave "cannot read ('utf-8' codec can't decode byte 0xfd ...)"."""
    import lzma

    from tightfit.cli import main

    text = "text,label\nbon café,pos\nmauvais,neg\n" * 4
    path = tmp_path / ("d.csv.xz" if make == "xz" else "d.csv")
    path.write_bytes(lzma.compress(text.encode()) if make == "xz" else text.encode("latin-1"))
    assert main(["train", "--data", str(path), "--max-steps", "1", "--device", "cpu", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "cannot read as UTF-8 text" in err and "save it as UTF-8 .csv, .tsv or .jsonl" in err, err
    assert not (tmp_path / "r").exists()


def test_peft_s_conv1d_note_is_not_printed_by_the_command_line():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tightfit", "plan", "--model", "gpt2", "--seq-len", "16", "--batch-size",
                           "2", "--budget", "4GiB", "--trainable", "lora"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fan_in_fan_out" not in done.stderr, done.stderr[-2000:]


def test_a_resume_may_repeat_what_the_runs_auto_options_became(tmp_path, capsys):
    """A run started with --device and --precision auto used cpu and fp32 (plan.json): repeating
    those on --resume was refused as a change, while a spelled-out default was accepted."""
    from conftest import tiny_cpu_job

    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "4",
                 "--checkpoint-every", "2", "--seq-len", "16", "--out", str(run), "--no-progress"]) == 0
    (run / "summary.json").unlink()  # as if stopped after its last checkpoint
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--precision", "fp16", "--no-progress"]) == 2
    assert "it cannot change --precision" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--checkpointing", "on", "--no-progress"]) == 2  # it ran with none
    assert "it cannot change --checkpointing" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--device", "cpu", "--precision", "fp32", "--checkpointing", "off",
                 "--no-progress"]) == 0


def test_nothing_fits_names_lora_where_its_model_state_would_fit(capsys):
    """LoRA is never chosen for you, but where nothing fits and it would, the error says so: minilm
    at 200 MiB was refused with every optimizer lever, and planned with --trainable lora."""
    from tightfit.cli import main

    args = ["plan", "--model", "minilm", "--seq-len", "64", "--batch-size", "32", "--budget", "200MiB"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(r"not searched: LoRA \(--trainable lora: .*\): its model state with fp32 AdamW, [\d.]+ MiB, is under "
                     r"the 190.00 MiB a step may hold; plan it with --trainable lora", err), err
    assert main(args + ["--trainable", "lora"]) == 0
    assert main(args[:-1] + ["60MiB"]) == 2  # below even LoRA's model state: refused before any search, said so
    err = capsys.readouterr().err
    said = re.search(r"LoRA .*its model state with fp32 AdamW, ([\d.]+ MiB), is over the 57.00 MiB a step may hold$",
                     err.strip(), re.M)  # the line of parameter offload may follow
    assert said, err
    # the figure is the one LoRA's own plan refuses with (the adapters' weights counted)
    assert main(args[:-1] + ["60MiB", "--trainable", "lora", "--optimizer", "adamw"]) == 2
    err = capsys.readouterr().err
    assert f"is below the {said.group(1)} of model state that fp32 AdamW needs" in err, (said.group(1), err)


class _AuxNet(torch.nn.Module):
    """Conv, BatchNorm2d over 4 x 4 maps, a head; in training only, an auxiliary head that pools
    to 1 x 1 before its BatchNorm (torchvision's Inception3 has one); ``keyword``: the main
    BatchNorm called as ``bn(input=x)``."""

    def __init__(self, aux: bool, keyword: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.head = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.Linear(8, 3)
        self.aux = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                                       torch.nn.Linear(8, 3)) if aux else None
        self.keyword = keyword

    def forward(self, pixel_values, labels=None):
        h = self.conv(pixel_values)
        h = self.bn(input=h) if self.keyword else self.bn(h)
        logits = self.head(h.mean((2, 3)))
        if self.training and self.aux is not None:
            logits = logits + 0.3 * self.aux(h)
        return SimpleNamespace(logits=logits)


@pytest.mark.parametrize("aux, keyword, refused", [(True, False, True), (False, True, False)])
def test_the_trainers_batchnorm_check_runs_the_training_forward(aux, keyword, refused):
    """The one-sample check ran its forward in eval mode: an auxiliary head that runs only in
    training went unseen (the run died at the epoch's 1-sample window), and a BatchNorm called by
    keyword was refused (its hook read the positional input)."""
    from torch.utils.data import TensorDataset

    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(9, 3, 4, 4, generator=g), torch.randint(0, 3, (9,), generator=g))
    w = Workload(_AuxNet(aux, keyword), data, None, 4, task=ImageClassification(),
                 collate_fn=collate_as("pixel_values", "labels"))
    before = [b.clone() for b in w.model.buffers()]
    if refused:
        with pytest.raises(TightfitError, match="the last window of each epoch holds 1 sample"):
            Trainer(w, Plan("fp32", 4, 4), TrainConfig(epochs=1), progress=False)
        assert all(torch.equal(a, b) for a, b in zip(before, w.model.buffers()))  # the check's forward left no trace
    else:
        assert Trainer(w, Plan("fp32", 4, 4), TrainConfig(epochs=1), progress=False).fit().steps == 3


def test_trainstep_says_batchnorms_one_sample_error_whatever_wraps_it_and_advises_by_the_batch():
    """torch.compile raises BatchNorm's ValueError as its own RuntimeError; a full batch split
    4+4+1 cannot be helped by drop_last."""
    m = _bn_model()

    def loss(model, batch):
        if batch[0].shape[0] == 1:
            raise RuntimeError("TorchRuntimeError: ... Expected more than 1 value per channel when training ...")
        return _loss(model, batch)

    s = TrainStep(Plan("fp32", 4, 9), m, torch.optim.SGD(m.parameters(), lr=0.1), loss=loss)
    with pytest.raises(TightfitError, match=r"split as 4\+4\+1.*plan another effective batch"):
        s(_data(9))
    with pytest.raises(TightfitError, match=r"split as 4\+1.*drop_last=True"):
        s(_data(5))


@pytest.mark.parametrize("options, message", [
    ({"optimizer": "adamw8bit-bf16"}, r"^optimizer='adamw8bit-bf16' trains under bf16 autocast, which tightfit runs on a "
                                      r"CUDA GPU only$"),
    ({"optimizer": "adamw-offload"}, r"^optimizer='adamw-offload' needs one CUDA GPU"),
    ({"precision": "fp16"}, r"^precision='fp16' needs a CUDA GPU; on the CPU use fp32$"),
    ({"compile": "on"}, r"^compile='on' needs a CUDA GPU and the search planner$"),
])
def test_a_request_for_the_cpu_refuses_gpu_only_choices_when_made(options, message):
    """device="cpu" is known when the request is made: what it cannot run is refused then, as the
    command line refuses it before loading anything."""
    from tightfit.api import TrainRequest
    from tightfit.errors import TightfitError

    with pytest.raises(TightfitError, match=message):
        TrainRequest(device="cpu", **options)
    TrainRequest(**options)  # device auto: decided once the machine is known


def test_the_default_seq_len_too_long_for_the_model_is_said_as_the_default_with_what_fits(tmp_path, capsys):
    from conftest import tiny_text_model_folder

    from tightfit.cli import main

    model = tiny_text_model_folder(tmp_path, ["good", "bad"], hidden_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=16)
    data = tmp_path / "d.csv"
    data.write_text("text,label\n" + "".join(f"{'good' if i % 2 else 'bad'},{i % 2}\n" for i in range(40)))
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--model", str(model), "--data", str(data), "--out", str(out), "--device", "cpu",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: the default --seq-len \d+ exceeds the model's 16 positions: give --seq-len 16 or "
                     r"less\n$", err), err
    assert not out.exists()


def test_gpus_on_the_cpu_beyond_its_cores_is_refused_before_any_process_starts():
    import os

    from tightfit.runtime.launch import launch

    with pytest.raises(TightfitError, match=rf"^--gpus {10**6} with --device cpu starts {10**6} processes, more than "
                                            rf"this machine's {os.cpu_count()} CPU cores$"):
        launch(10**6, "cpu", ["train", "--device", "cpu"])


@pytest.mark.parametrize("model", [None, "bert", object()])
def test_train_step_refuses_a_model_that_is_not_a_module_in_one_line(model):
    """`TrainStep(plan, None)` raised AttributeError ('NoneType' object has no attribute 'parameters')."""
    with pytest.raises(TightfitError, match=r"^TrainStep\(plan, model, optimizer\): model must be a torch.nn.Module, "
                                            rf"got {type(model).__name__}$"):
        TrainStep(Plan("fp32", 4, 8), model)


def test_the_python_api_names_the_levers_of_a_budget_too_small_as_its_own_arguments(tmp_path):
    """`tightfit.api.train(TrainRequest(budget="1MiB"))` said "--optimizer adamw8bit" and
    "--trainable lora", flags of the command line, where the request takes optimizer= and trainable=."""
    import random

    from conftest import tiny_text_model_folder
    from tightfit.api import TrainRequest, train

    words = "film plot actor scene great dull awful superb".split()
    model = tiny_text_model_folder(tmp_path, words, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=256, max_position_embeddings=64)  # 4 MiB of model state
    rng = random.Random(0)
    (tmp_path / "d.csv").write_text("text,label\n" + "".join(f"{' '.join(rng.choices(words, k=5))},{i % 2}\n"
                                                             for i in range(40)))
    with pytest.raises(TightfitError) as e:
        train(TrainRequest(model=str(model), data=str(tmp_path / "d.csv"), budget="1MiB", device="cpu",
                           out=str(tmp_path / "run"), max_steps=1))
    text = str(e.value)
    assert "optimizer='adamw8bit'" in text and "trainable='lora'" in text, text
    assert "--optimizer" not in text and "--trainable" not in text, text
    assert not (tmp_path / "run").exists()


def test_wrong_types_at_the_python_entry_points_get_one_line():
    """A fresh user's tries: train() of a dict, plan() of a model name, a loss that is a number
    raised AttributeError and TypeError from inside."""
    import tightfit
    from tightfit.api import train

    with pytest.raises(TightfitError, match="takes a TrainRequest.*got dict"):
        train({"batch_size": 32})
    batch = {"x": torch.ones(4, 3), "labels": torch.zeros(4, dtype=torch.long)}
    with pytest.raises(TightfitError, match="model must be a torch.nn.Module.*got str"):
        tightfit.plan("bert", batch, 4, device="cpu")
    with pytest.raises(TightfitError, match="loss must be a function.*got int"):
        tightfit.plan(torch.nn.Linear(3, 2), batch, 4, loss=3, device="cpu")


def test_a_model_whose_forward_takes_no_labels_is_told_to_pass_a_loss():
    """tightfit.plan without loss= calls model(**batch): a plain module whose forward takes (x)
    raised a raw TypeError from inside torch."""
    import tightfit

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.linear(x)

    batch = {"x": torch.ones(4, 3), "labels": torch.zeros(4, dtype=torch.long)}
    with pytest.raises(TightfitError, match=r"unexpected keyword argument 'labels': without loss= the model is called"):
        tightfit.plan(Net(), batch, 4, device="cpu")
    plan = tightfit.plan(Net(), batch, 4, device="cpu",
                         loss=lambda m, b: torch.nn.functional.cross_entropy(m(b["x"]), b["labels"]))
    assert plan.micro_batch == 4
