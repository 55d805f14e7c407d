"""Faults found by a fresh user (report 6): the Python API's resume ignored a new value equal to its
default; the own loop's causal-LM label shift missed wrapped models and a micro-batch without
targets made the loss NaN; an OOM redo kept the buffers (BatchNorm's statistics) of the failed
attempt; ``plan(checkpointing="on")`` took a model with nothing to checkpoint; the Trainer took a
Plan of another effective batch than its Workload; negative seeds shuffled as their positives."""

import logging
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import tightfit
from conftest import assert_same_params, params_of, tiny_bert, tiny_gpt2, tiny_text_model_folder
from tightfit import Plan
from tightfit.api import TrainRecipe, TrainRequest, _resume_request
from tightfit.cli import main
from tightfit.errors import TightfitError
from tightfit.runtime.trainer import TrainConfig, Trainer, epoch_order


# ---- 1: TrainRequest(resume=DIR, lr=5e-5) kept the run's lr (5e-5 is the default, taken as "not
# given"), and batch_size=32 (the default) was accepted and trained at the run's 16

@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """A finished 1-step run (``--lr 1e-3 --batch-size 4``) with its checkpoint."""
    root = tmp_path_factory.mktemp("short")
    model = tiny_text_model_folder(root, ["good", "bad"], hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64)
    data = root / "d.csv"
    data.write_text("text,label\n" + "".join(f"{' '.join([('good' if i % 2 else 'bad')] * (1 + i % 7))},{i % 2}\n"
                                             for i in range(40)))
    run = root / "run"
    assert main(["train", "--model", str(model), "--data", str(data), "--batch-size", "4", "--max-steps", "1",
                 "--lr", "1e-3", "--seq-len", "16", "--out", str(run), "--no-progress", "--device", "cpu"]) == 0
    return run


def test_the_python_resume_takes_a_new_value_equal_to_its_default_as_the_command_line_does(short_run, caplog):
    run = str(short_run)
    req, _, changed, _, _ = _resume_request(TrainRequest(resume=run, lr=5e-5))
    assert changed == {"lr": [1e-3, 5e-5]} and req.training.lr == 5e-5
    with caplog.at_level(logging.WARNING, logger="tightfit"):  # the note: once setup's checks have passed
        TrainRecipe(TrainRequest(resume=run, lr=5e-5, progress=False)).setup()
    assert "note: resume with lr=5e-05 (the run had 0.001)" in caplog.text, caplog.text
    with pytest.raises(TightfitError) as e:
        _resume_request(TrainRequest(resume=run, batch_size=32))  # the default; the run trained at 4
    assert "cannot change batch_size " in str(e.value) and "\n" not in str(e.value) and "--" not in str(e.value)
    _, _, changed, _, _ = _resume_request(TrainRequest(resume=run, batch_size=4, lr=1e-3))  # the run's own values
    assert changed == {}
    _, _, changed, _, _ = _resume_request(TrainRequest(resume=run, progress=False))  # only what was given counts
    assert changed == {}


def test_a_request_knows_the_keywords_it_was_given_through_copies():
    req = TrainRequest(resume="r", lr=5e-5, seed=0)
    assert set(req.run.given) == {"resume", "lr", "seed"}
    assert set(replace(req).run.given) == {"resume", "lr", "seed"}  # lr and seed at their defaults still count
    assert set(replace(req, training=replace(req.training, epochs=4)).run.given) == {"resume", "lr", "seed", "epochs"}
    assert set(req.with_options(epochs=3).run.given) == {"resume", "lr", "seed", "epochs"}
    from tightfit.config import TrainOptions
    whole = TrainRequest(training=TrainOptions(lr=1e-4), batch_size=32)  # a group given whole: what differs
    assert set(whole.run.given) == {"lr", "batch_size"}


# ---- 2: the causal-LM label shift was decided on type(model).__name__: a peft, compiled or
# DataParallel-wrapped GPT-2 counted labels[:, 0:] and the gradient depended on the micro-batch

def _lm_batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (4, 8), generator=g)
    labels = ids.clone()
    labels[0, 2:] = -100  # sample 0: 1 target after the shift
    labels[2, 5:] = -100
    return {"input_ids": ids, "labels": labels}


def test_a_wrapped_causal_lm_counts_the_shifted_targets():
    from tightfit.loop import _Batch, _target_tokens

    b = _lm_batch()
    expected = int((b["labels"][:, 1:] != -100).sum())
    wrapped = [tiny_gpt2(), torch.compile(tiny_gpt2()), torch.nn.DataParallel(tiny_gpt2())]
    try:
        from peft import LoraConfig, get_peft_model
        wrapped.append(get_peft_model(tiny_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], lora_dropout=0.0)))
    except ImportError:
        pass
    for model in wrapped:
        assert int(_target_tokens(model, _Batch(b), None)(b)) == expected, type(model).__name__


class _Holder(torch.nn.Module):
    """A user's own module around a causal LM, returning its output (loss included)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, **batch):
        return self.lm(**batch)


def test_a_causal_lm_held_by_the_users_own_module_steps_the_same_at_every_micro_batch():
    """Weighted by unshifted target counts (sample 0: 2 labels, 1 target), the micro-batches of a
    causal LM inside the user's own module gave another gradient at micro-batch 1 than at 4."""
    from tightfit.loop import _Batch, _target_tokens

    b = _lm_batch()
    assert int(_target_tokens(_Holder(tiny_gpt2()), _Batch(b), None)(b)) == int((b["labels"][:, 1:] != -100).sum())

    def run(micro_batch):
        model = _Holder(tiny_gpt2(dropout=0.0))
        out = tightfit.TrainStep(Plan("fp32", micro_batch, 4), model, lr=1e-2)(_lm_batch())
        return out, params_of(model)

    (o4, w4), (o1, w1) = run(4), run(1)
    assert o1.loss == pytest.approx(o4.loss, rel=1e-5) and o1.grad_norm == pytest.approx(o4.grad_norm, rel=1e-5)
    for n in w4:
        torch.testing.assert_close(w1[n], w4[n], rtol=1e-4, atol=2e-5)


def test_a_peft_causal_lm_steps_the_same_at_every_micro_batch():
    peft = pytest.importorskip("peft")

    def run(micro_batch):
        model = peft.get_peft_model(tiny_gpt2(dropout=0.0), peft.LoraConfig(
            r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False))
        out = tightfit.TrainStep(Plan("fp32", micro_batch, 4), model, lr=1e-2)(_lm_batch())
        return out, [p.detach().clone() for p in model.parameters() if p.requires_grad]

    (o4, w4), (o1, w1) = run(4), run(1)
    assert o4.grad_norm == pytest.approx(o1.grad_norm, rel=1e-5) and o4.loss == pytest.approx(o1.loss, rel=1e-5)
    for a, b in zip(w4, w1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---- 3: a micro-batch without targets made HF's mean loss NaN, and NaN * 0 reported loss=nan

def test_a_micro_batch_without_targets_adds_nothing_to_the_loss():
    batch = _lm_batch()
    batch["labels"][1] = -100  # the second micro-batch at micro-batch 1 has no targets
    outs = []
    for micro_batch in (4, 1):
        model = tiny_gpt2(dropout=0.0)
        outs.append((tightfit.TrainStep(Plan("fp32", micro_batch, 4), model, lr=1e-2)(batch), params_of(model)))
    (o4, w4), (o1, w1) = outs
    assert o1.stepped and o1.loss == pytest.approx(o4.loss, rel=1e-5), (o1.loss, o4.loss)
    for n in w4:  # the same update, to rounding (AdamW at lr 1e-2 moves near-zero gradients by ~lr)
        torch.testing.assert_close(w1[n], w4[n], rtol=1e-4, atol=2e-5)
        assert torch.isfinite(w1[n]).all()


# ---- 4: an OOM redo kept the buffers the failed attempt's forward changed (BatchNorm's running
# mean and variance, num_batches_tracked): after it, state differed from the smaller micro-batch's

class _BN(torch.nn.Module):
    """Linear, BatchNorm, ReLU, Linear; ``oom_rows``: raise a CUDA-style OOM once, after the
    BatchNorm ran, on the first forward of that many rows."""

    def __init__(self, oom_rows=None, image=False):
        super().__init__()
        torch.manual_seed(0)
        self.seq = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 3))
        self.oom_rows, self.fired, self.image = oom_rows, 0, image

    def forward(self, x=None, pixel_values=None):
        x = pixel_values.flatten(1) if self.image else x
        hidden = self.seq[:3](x)
        if not self.fired and x.shape[0] == self.oom_rows:
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        out = self.seq[3](hidden)
        return SimpleNamespace(logits=out) if self.image else out


def _buffers(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def test_an_oom_redo_in_the_users_loop_gives_back_the_buffers():
    data = [(torch.randn(8, 8, generator=torch.Generator().manual_seed(s)) * 3 + 1,
             torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])) for s in range(3)]
    ce = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    runs = []
    for micro_batch, oom_rows in ((4, None), (8, 8)):
        model = _BN(oom_rows)
        step = tightfit.TrainStep(Plan("fp32", micro_batch, 8), model, loss=ce, lr=1e-2)
        runs.append(([step(b).loss for b in data], params_of(model), _buffers(model), step))
    (ref_l, ref_w, ref_b, _), (l, w, b, step) = runs
    assert step.oom_recoveries == 1 and step.micro_batch == 4
    assert l == ref_l
    assert_same_params(w, ref_w)
    assert_same_params(b, ref_b)  # running mean, variance and num_batches_tracked


def _bn_workload(oom_rows=None):
    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 1, 2, 4, generator=g) * 3 + 1, torch.randint(0, 3, (32,), generator=g)
    return Workload(_BN(oom_rows, image=True), TensorDataset(x[:24], y[:24]), TensorDataset(x[24:], y[24:]), 8,
                    task=ImageClassification(), collate_fn=collate_as("pixel_values", "labels"))


def test_an_oom_redo_in_the_runtime_gives_back_the_buffers():
    runs = []
    for micro_batch, oom_rows in ((4, None), (8, 8)):
        w = _bn_workload(oom_rows)
        t = Trainer(w, Plan("fp32", micro_batch, 8), TrainConfig(epochs=1, lr=1e-2, seed=3, grow_back_after=0,
                                                                  log_every=1), progress=False)
        torch.manual_seed(11)
        res = t.fit()
        runs.append((res, params_of(w.model), _buffers(w.model)))
    (_, ref_w, ref_b), (res, w, b) = runs
    assert res.oom_recoveries == 1 and res.plan.micro_batch == 4
    assert_same_params(w, ref_w)
    assert_same_params(b, ref_b)


def test_buffers_above_the_snapshot_bound_are_not_copied(monkeypatch):
    import tightfit.buffers as buffers

    model = _BN()
    assert [n for _, n, _ in buffers.buffer_snapshot(model.modules())] == ["running_mean", "running_var",
                                                                        "num_batches_tracked"]
    monkeypatch.setattr(buffers, "BUFFER_SNAPSHOT_BYTES", 64)
    assert buffers.buffer_snapshot(model.modules()) is None  # 16 + 16 floats and an int: 136 bytes


# ---- 5: plan(checkpointing="on") took a model with nothing to checkpoint; TrainStep then raised ValueError

def test_checkpointing_on_for_a_model_with_nothing_to_checkpoint_is_refused_by_plan():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    xy = (torch.randn(10, 8), torch.randint(0, 3, (10,)))
    ce = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    with pytest.raises(TightfitError) as e:
        tightfit.plan(Net(), xy, loss=ce, checkpointing="on", device="cpu")
    assert str(e.value).startswith("checkpointing='on': Net has no repeated blocks") and "\n" not in str(e.value)
    assert tightfit.plan(Net(), xy, loss=ce, checkpointing="auto", device="cpu").activation_checkpointing is False
    bert = tiny_bert()
    from conftest import SyntheticBatches
    assert tightfit.plan(bert, SyntheticBatches(4).collate(range(4)), checkpointing="on",
                         device="cpu").activation_checkpointing


# ---- 6: Trainer took a Plan of effective batch 32 with a Workload of 64: trained 64-sample windows,
# reported the plan's numbers

def test_the_trainer_refuses_a_plan_of_another_effective_batch(make_workload):
    w = make_workload(n=24, effective_batch=8)
    with pytest.raises(TightfitError) as e:
        Trainer(w, Plan("fp32", 4, 16), TrainConfig(epochs=1), progress=False)
    assert str(e.value) == ("the plan's effective_batch 16 differs from the workload's 8: plan for this workload, "
                            "or give both the same effective_batch")
    Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False)  # the same: taken


# ---- 7: random.Random seeds from abs(): seed -5 shuffled epoch 0 as seed 5 did

def test_a_negative_seed_has_its_own_order_and_other_seeds_keep_theirs():
    def before(n, seed, epoch):  # the order every run with a seed >= 0 has had
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        return order

    for seed in (0, 1, 5, 2**64 - 1):
        for epoch in (0, 1, 7):
            assert epoch_order(50, seed, epoch) == before(50, seed, epoch)
    orders = {tuple(epoch_order(50, seed, epoch)) for seed in (-5, 5, -1, 1, 0, -2**63) for epoch in (0, 1)}
    assert len(orders) == 12  # each seed and epoch its own order
