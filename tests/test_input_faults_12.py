"""Faults a careful user of the Python API finds (session 36): the runtime's own settings are
checked like the options, and a max_steps the epochs cut is said where it was asked for."""

import re
import warnings

import pytest
import torch

from conftest import SyntheticBatches, tiny_bert
from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload


@pytest.mark.parametrize("field, value, says", [
    ("prefetch", "no", "prefetch must be True or False, not 'no' (a str)"),
    ("background_checkpoints", 3, "background_checkpoints must be True or False"),
    ("cooldown_max_s", -1, "cooldown_max_s must be positive and finite"),
    ("cooldown_max_s", "60", "cooldown_max_s must be a number"),
    ("checkpoint_dir", 5, "checkpoint_dir must be a folder path"),
])
def test_the_runtime_settings_of_a_train_config_are_checked(field, value, says):
    """`TrainConfig(prefetch="no")` was taken as true (a non-empty string), and a number as the
    checkpoint folder failed only at the first checkpoint."""
    with pytest.raises(TightfitError, match=re.escape(says)):
        TrainConfig(**{field: value})


def test_a_max_steps_beyond_the_epochs_is_said_to_a_python_caller():
    """24 samples at effective batch 8 are 3 steps an epoch: max_steps=10 trains 3, and said so."""
    w = Workload(tiny_bert(), SyntheticBatches(24), None, 8)
    with pytest.warns(UserWarning, match=r"max_steps=10 is more than the 3 optimizer steps of 1 epoch\(s\): training 3"):
        t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, max_steps=10), progress=False)
    assert t.total_steps == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the epochs: no warning
        Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, max_steps=2), progress=False)


def _bn_workload(n, effective_batch):
    """Linear, BatchNorm, ReLU, Linear over ``n`` 8-feature samples (an image task, flattened)."""
    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import collate_as
    from test_input_faults_6 import _BN

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 1, 2, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return Workload(_BN(image=True), TensorDataset(x, y), None, effective_batch, task=ImageClassification(),
                    collate_fn=collate_as("pixel_values", "labels"))


@pytest.mark.parametrize("n, effective_batch, micro_batch, says", [
    (25, 8, 8, "the last window of each epoch holds 1 sample (25 training samples, effective batch 8)"),
    (30, 10, 3, "micro-batch 3 splits each window of 10 samples as 3+3+3+1"),
    (29, 8, 4, "micro-batch 4 splits the last window of 5 samples as 4+1"),
    (1, 1, 1, "the last window of each epoch holds 1 sample (1 training sample, effective batch 1)"),  # not "samples"
])
def test_a_run_that_would_give_batchnorm_one_sample_is_refused_before_training(n, effective_batch, micro_batch, says):
    """BatchNorm cannot train on one sample: the run died at that micro-batch, mid-epoch or at the
    epoch's last window, with torch's 'Expected more than 1 value per channel when training'."""
    w = _bn_workload(n, effective_batch)
    with pytest.raises(TightfitError, match=re.escape(says)):
        Trainer(w, Plan("fp32", micro_batch, effective_batch), TrainConfig(epochs=1), progress=False)
    w.model.seq[1].eval()  # BatchNorm frozen (in eval mode, the model in train mode): it trains
    assert Trainer(w, Plan("fp32", micro_batch, effective_batch), TrainConfig(epochs=1), progress=False).fit().steps


def test_a_batchnorm_run_of_no_one_sample_micro_batch_trains():
    w = _bn_workload(26, 8)  # 8, 8, 8, then 2
    assert Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False).fit().steps == 4


def test_an_epochs_last_window_of_one_sample_is_no_fault_where_the_run_stops_before_it():
    w = _bn_workload(25, 8)  # 3 windows of 8, then 1
    assert Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, max_steps=3), progress=False).fit().steps == 3


def test_estimate_checks_a_plan_of_any_budget_and_of_lora_as_plan_does(tmp_path, capsys):
    """`tightfit estimate` had no --budget (its verdict only against a --gpu card's whole memory)
    and no --trainable: a plan of `tightfit plan --budget 4GiB --trainable lora` could not be
    checked. Its verdict and peak now agree with the plan's own trace of the same step."""
    import json

    from tightfit.cli import main

    base = ["estimate", "--model", "minilm", "--seq-len", "32", "--micro-batch", "8", "--batch-size", "16",
            "--precision", "bf16", "--json"]
    assert main(["plan", "--model", "minilm", "--seq-len", "32", "--batch-size", "16", "--budget", "300MiB",
                 "--precision", "bf16", "--trainable", "lora", "--optimizer", "adamw", "--checkpointing", "off",
                 "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    mb = planned["plan"]["micro_batch"]
    args = base[:6] + [str(mb)] + base[7:] + ["--budget", "300MiB"]
    assert main(args + ["--trainable", "lora"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert lora["peak_reserved_bytes"] == planned["predicted_peak_bytes"]
    assert lora["budget_bytes"] == 300 * 2**20 and lora["fits"] is True
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out)
    assert full["peak_reserved_bytes"] > lora["peak_reserved_bytes"]  # every gradient and AdamW state
    assert main(args[:-2] + ["--budget", "99TiB"]) == 2
    assert "is more than the" in capsys.readouterr().err


def test_a_trainer_made_by_hand_trains_alike_at_each_run_of_one_seed():
    """TrainConfig(seed=...) seeds dropout, as documented: a Trainer made by hand (not through
    tightfit train) drew its dropout masks from whatever state the caller's generator was in, and two
    runs of the same config ended 4e-4 apart (fresh user 61). Dropout 0.2 on."""
    def run(seed, noise):
        w = Workload(tiny_bert(dropout=0.2), SyntheticBatches(24), None, 8)
        torch.manual_seed(noise)  # the caller's own use of the generator before the run
        Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, seed=seed), progress=False).fit()
        return [p.detach().clone() for p in w.model.parameters()]

    a, b, c = run(0, 1), run(0, 2), run(1, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


# ---- resume of a checkpoint that is not this run's (fresh user 61)

def _dropout_run(tmp_path, resume=None, **config):
    w = Workload(tiny_bert(dropout=0.1), SyntheticBatches(40), None, 8)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
                                                   **config), progress=False)
    if resume is not None:
        t.resume(resume)
    return t


def test_a_resume_past_the_runs_end_or_of_another_order_is_refused(tmp_path):
    """A checkpoint at step 10 resumed by a run of 5 steps trained nothing and reported 10 steps;
    one of another seed or sample count trained part of an epoch in another order (samples twice,
    others never). Each is one line now; the run's own checkpoint resumes."""
    _dropout_run(tmp_path, epochs=2, keep_last=10).fit()  # 5 steps an epoch: ckpt-2 ... ckpt-10
    ck = tmp_path / "ck"
    with pytest.raises(TightfitError, match="ckpt-10 is at step 10, past this run's 5 steps"):
        _dropout_run(tmp_path / "b", resume=ck / "ckpt-10", epochs=1)
    with pytest.raises(TightfitError, match="written by a run of seed 0, and this run's is 7"):
        _dropout_run(tmp_path / "c", resume=ck / "ckpt-6", epochs=2, seed=7)
    w = Workload(tiny_bert(dropout=0.1), SyntheticBatches(48), None, 8)
    with pytest.raises(TightfitError, match="written by a run of training samples 40, and this run's is 48"):
        Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=2), progress=False).resume(ck / "ckpt-6")
    assert _dropout_run(tmp_path / "d", resume=ck / "ckpt-6", epochs=2).fit().steps == 10


def test_a_refused_resume_leaves_the_trainer_as_it_was(tmp_path):
    """The refusals came after the checkpoint's weights (and, for one past the run's end, its
    optimizer state and schedule) were loaded: a caller that went on with a fresh start after the
    error (``try: t.resume(ck) except TightfitError: pass``) trained from another run's weights,
    at the learning rate of its step 10, 0."""
    _dropout_run(tmp_path, epochs=2, keep_last=10).fit()
    ck = tmp_path / "ck"
    for folder, checkpoint, config in (("b", "ckpt-10", dict(epochs=1)), ("c", "ckpt-6", dict(epochs=2, seed=7))):
        t = _dropout_run(tmp_path / folder, **config)
        before = [p.detach().clone() for p in t.model.parameters()]
        lr = t.optimizer.param_groups[0]["lr"]
        with pytest.raises(TightfitError, match="past this run's|written by a run of seed"):
            t.resume(ck / checkpoint)
        assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))
        assert not t.optimizer.state and t.optimizer.param_groups[0]["lr"] == lr and t.scheduler.last_epoch == 0
        assert t.step == 0


def test_a_checkpoint_of_other_trained_parameters_is_refused_before_anything_is_loaded(tmp_path):
    """A checkpoint written with other parameters trained (another --trainable; a LoRA run of an
    earlier tightfit, whose DistilBERT head layer stayed frozen) failed part-way through the
    resume, its weights loaded, in torch's ValueError 'loaded state dict contains a parameter group
    that doesn't match the size of optimizer's group'."""
    _dropout_run(tmp_path, epochs=1).fit()
    w = Workload(tiny_bert(dropout=0.1), SyntheticBatches(40), None, 8)
    w.model.bert.embeddings.word_embeddings.weight.requires_grad_(False)  # one tensor fewer trained
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1), progress=False)
    before = [p.detach().clone() for p in t.model.parameters()]
    with pytest.raises(TightfitError, match=r"ckpt-4: its optimizer state is over (\d+) parameter tensors in 1 "
                                            r"group\(s\), and this run trains \d+ in 1"):
        t.resume(tmp_path / "ck" / "ckpt-4")
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))  # nothing loaded


def test_a_resumed_run_reports_the_peaks_of_its_earlier_sessions_too(tmp_path, monkeypatch):
    """The summary after a resume gave this session's peak memory only (the fresh user's run: 810
    MiB of host memory, where the sessions before the resume had reached 1.3 GiB); a budget check
    against it would miss the earlier peaks. The checkpoint carries the run's peaks so far."""
    import resource
    import types

    real = resource.getrusage
    huge = types.SimpleNamespace(ru_maxrss=50 * 2**20)  # KiB: 50 GiB, more than this process will reach
    monkeypatch.setattr(resource, "getrusage", lambda who: huge)
    t = _dropout_run(tmp_path, epochs=1)
    t._peaks = (3 * 2**30, 4 * 2**30)  # what a GPU session's steps would have recorded
    t.fit()
    monkeypatch.setattr(resource, "getrusage", real)
    resumed = _dropout_run(tmp_path / "b", resume=tmp_path / "ck" / "ckpt-4", epochs=1)
    assert resumed.peak_rss_bytes() == 50 * 2**30
    assert resumed._peaks == (3 * 2**30, 4 * 2**30)


def test_a_resumed_run_reports_the_hottest_gpu_reading_of_its_earlier_sessions_too(tmp_path):
    """As the peaks above: the summary's "GPU max temperature ..., max power ..." (and summary.json's
    health) after a resume gave this session's readings only; a session that ran at 86 C before
    the resume was reported at the resumed session's 70 C. The checkpoint carries the run's
    hottest and most power-hungry readings so far."""
    import types

    def monitor(temp, power):  # a GPU's health monitor, as far as the loop and the report read it
        return types.SimpleNamespace(max_temp_c=temp, max_power_w=power, available=False, status="on",
                                     sample=lambda force=False: None)

    t = _dropout_run(tmp_path, epochs=1)
    t.health = monitor(86.0, 240.0)
    t.fit()
    resumed = _dropout_run(tmp_path / "b", resume=tmp_path / "ck" / "ckpt-4", epochs=1)
    resumed.health = monitor(70.0, 250.0)  # this session's own readings
    assert resumed.health_maxima() == (86.0, 250.0)
    resumed.health = None  # a session without readings (NVML off): the earlier ones stand
    assert resumed.health_maxima() == (86.0, 240.0)
    assert _dropout_run(tmp_path / "c", epochs=1).health_maxima() == (None, None)  # a CPU run: none


def test_resuming_from_the_checkpoints_folder_or_a_missing_one_says_so(tmp_path):
    """The run's checkpoints folder was called a corrupt checkpoint ('model.safetensors: missing'),
    and a mistyped ckpt-99 'not a folder'."""
    _dropout_run(tmp_path, epochs=1).fit()
    ck = tmp_path / "ck"
    with pytest.raises(TightfitError, match=re.escape(f"{ck} is a folder of checkpoints, not one: give one of them, "
                                                      f"e.g. the newest, {ck / 'ckpt-5'}")):
        _dropout_run(tmp_path / "b", resume=ck, epochs=1)
    with pytest.raises(TightfitError, match=re.escape(f"checkpoint {ck / 'ckpt-99'} does not exist")):
        _dropout_run(tmp_path / "c", resume=ck / "ckpt-99", epochs=1)


@pytest.mark.parametrize("budget", ["1KiB", "0.5MiB", "1000000B"])
def test_a_budget_under_1_mib_is_refused_whatever_its_unit(capsys, budget):
    """`--budget 1048575` was refused as under the smallest budget of 1 MiB, but `--budget 1KiB`
    went on to the planner and a long 'below the model state' message (fresh user 62)."""
    from tightfit.cli import main

    assert main(["plan", "--model", "minilm", "--seq-len", "32", "--batch-size", "32", "--budget", budget]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "under the smallest budget of 1 MiB" in err, err


def test_labels_written_differently_but_read_as_one_class_are_noted(tmp_path, caplog):
    """' pos', 'pos ' and 'pos' trained as one class, and JSON 1 and "1" too, without a word, while
    1 and 1.0 are refused (fresh user 62). They stay one class, and the note says which."""
    import json
    import logging

    from tightfit.data import load_text_classification

    rows = ["text,label"] + [f"review {i},{['pos', ' pos', 'pos ', 'neg'][i % 4]}" for i in range(12)]
    (tmp_path / "d.csv").write_text("\n".join(rows) + "\n")
    with caplog.at_level(logging.WARNING):
        data = load_text_classification(tmp_path / "d.csv")
    assert data.label_names == ["neg", "pos"]
    assert "read as one class (spaces around a label dropped, a number and its string one label): " \
           "' pos', 'pos ', 'pos' as 'pos'" in caplog.text, caplog.text
    caplog.clear()
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"t {i}", "label": [1, "1", 0][i % 3]}) + "\n"
                                              for i in range(9)))
    with caplog.at_level(logging.WARNING):
        assert load_text_classification(tmp_path / "d.jsonl").label_names == ["0", "1"]
    assert "'1', 1 as '1'" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_text_classification(_plain(tmp_path))
    assert "read as one class" not in caplog.text


def _plain(tmp_path):
    (tmp_path / "p.csv").write_text("text,label\n" + "".join(f"r {i},{['a', 'b'][i % 2]}\n" for i in range(6)))
    return tmp_path / "p.csv"


def test_train_step_refuses_an_lr_that_your_own_optimizer_would_ignore():
    """TrainStep(plan, model, SGD(lr=0), lr=1.0) trained at SGD's lr 0 without a word (fresh user 61)."""
    import tightfit

    model = torch.nn.Linear(4, 2)
    with pytest.raises(TightfitError, match=r"lr=1.0 is for the optimizer TrainStep makes; yours keeps its own"):
        tightfit.TrainStep(Plan("fp32", 4, 4), model, torch.optim.SGD(model.parameters(), lr=0.0), lr=1.0)
    step = tightfit.TrainStep(Plan("fp32", 4, 4), model)  # its own AdamW at tightfit train's default
    assert step.optimizer.param_groups[0]["lr"] == 5e-5


@pytest.mark.parametrize("labels, says", [
    (lambda y: y.float(), "labels must be class ids, int64 [B]; the batches' are float32 [B] (e.g. labels.long()"),
    (lambda y: y[:, None], "the batches' are int64 [B, 1] (e.g. labels.squeeze(1)"),
])
def test_labels_that_are_no_class_ids_are_refused_when_the_workload_is_made(labels, says):
    """Float or [B, 1] labels for ImageClassification failed in cross-entropy at the first step of
    fit(), as torch's RuntimeError (fresh user 61)."""
    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import collate_as

    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    with pytest.raises(TightfitError, match=re.escape(says)):
        Workload(torch.nn.Linear(8, 3), TensorDataset(x, labels(y)), None, 2, task=ImageClassification(),
                 collate_fn=collate_as("pixel_values", "labels"))
    Workload(torch.nn.Linear(8, 3), TensorDataset(x, y), None, 2, task=ImageClassification(),
             collate_fn=collate_as("pixel_values", "labels"))  # class ids: made


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8])
def test_class_ids_of_a_narrower_integer_type_are_refused_when_the_workload_is_made(dtype):
    """int32 labels (torch.from_numpy of a numpy int32 array) passed the check, which took any
    integer type, and failed in cross-entropy at the first step of fit() as torch's RuntimeError
    ("expected target dtype to be Long or Byte, but got Int"). uint8, which cross-entropy takes, is kept."""
    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import collate_as

    x, y = torch.randn(6, 8), torch.randint(0, 3, (6,))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(TightfitError, match=re.escape(f"int64 [B]; the batches' are {name} [B] (e.g. labels.long()")):
        Workload(torch.nn.Linear(8, 3), TensorDataset(x, y.to(dtype)), None, 2, task=ImageClassification(),
                 collate_fn=collate_as("pixel_values", "labels"))
    Workload(torch.nn.Linear(8, 3), TensorDataset(x, y.to(torch.uint8)), None, 2, task=ImageClassification(),
             collate_fn=collate_as("pixel_values", "labels"))  # cross-entropy takes Byte class ids


CLASS_IDS = "labels must be class ids in [0, 2) (the model's num_labels), or -100 to leave a sample out"


class _Samples(torch.utils.data.Dataset):
    """Token ids [8] and a class id per sample, read one by one (not a TensorDataset: no label set
    to scan when the workload is made)."""

    def __init__(self, labels):
        self.ids, self.labels = torch.randint(1, 50, (len(labels), 8)), labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


def test_class_ids_past_the_models_classes_are_refused_on_the_host():
    """A 2-class model trained on labels 0..2 failed at the first step of fit() with torch's
    "IndexError: Target 2 is out of bounds" (on a GPU, a device-side assert that ends the CUDA
    context: nothing after it works, not even a checkpoint). The dtype check read the first sample only."""
    from torch.utils.data import TensorDataset

    from tightfit.workload import collate_as

    x, y = torch.randint(1, 50, (16, 8)), torch.arange(16) % 3
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; sample 2 is labelled 2 (")):
        Workload(tiny_bert(), TensorDataset(x, y), None, 8, collate_fn=collate_as("input_ids", "labels"))
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; sample 2 is labelled -1 (")):  # eval data too
        Workload(tiny_bert(), TensorDataset(x, y % 2), TensorDataset(x, torch.where(y == 2, -1, 0)), 8,
                 collate_fn=collate_as("input_ids", "labels"))
    # samples read one by one: the first one passes; the batch that holds sample 2 is refused when
    # collated on the host, before it is copied to the device
    w = Workload(tiny_bert(), _Samples(y), None, 8, collate_fn=collate_as("input_ids", "labels"))
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; sample 2 is labelled 2 (")):
        w.train.collate([0, 1, 2])
    for prefetch in (True, False):
        with pytest.raises(TightfitError, match=re.escape(CLASS_IDS)):
            Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, prefetch=prefetch), progress=False).fit()


def test_ignored_labels_and_models_of_unknown_classes_still_train():
    """-100 (cross-entropy's ignore_index) leaves a sample out and stays allowed; a model that is
    no Hugging Face classifier has no known number of classes, and its labels are not checked
    against one."""
    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import collate_as

    x, y = torch.randint(1, 50, (16, 8)), torch.where(torch.arange(16) % 3 == 2, -100, torch.arange(16) % 2)
    w = Workload(tiny_bert(), TensorDataset(x, y), TensorDataset(x, y), 8, collate_fn=collate_as("input_ids", "labels"))
    result = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1), progress=False).fit()
    assert result.steps == 2 and result.eval["samples"] == 11
    # a plain module: its 3 outputs are not read from a config, so labels 0..2 are not refused
    Workload(torch.nn.Linear(8, 3), TensorDataset(torch.randn(6, 8), torch.arange(6) % 3), None, 2,
             task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))
