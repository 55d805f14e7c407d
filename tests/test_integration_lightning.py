"""tightfit with Lightning (:mod:`tightfit.integrations.lightning`): real ``lightning.Trainer.fit`` runs on the CPU."""

import logging

import pytest
import torch

import tightfit
from conftest import SyntheticBatches, count_forwards, shipped_model_reviews, tiny_bert
from tightfit import Plan, TightfitError

tl = pytest.importorskip("tightfit.integrations.lightning")
import lightning as L  # noqa: E402

from tightfit.levers.checkpointing import hf_hook_active  # noqa: E402
from tightfit.runtime.trainer import NonFiniteTrainingError  # noqa: E402


class _Classifier(L.LightningModule):
    """A tiny BERT classifier as a LightningModule (dropout on)."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.bert = tiny_bert(dropout=dropout)
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        return self.bert(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _loader(micro_batch, n=32):
    rows = SyntheticBatches(n).worst_case(n)
    data = [{k: v[i] for k, v in rows.items()} for i in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=micro_batch)


def _fit(plan, module=None, steps=3, callback=None, micro_batch=None, **override):
    module = module or _Classifier()
    cb = callback or tl.TightfitCallback(plan)
    trainer = L.Trainer(**{**tl.trainer_arguments(plan), "max_steps": steps, "logger": False,
                           "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                           "callbacks": [cb], **override})
    trainer.fit(module, _loader(micro_batch or plan.micro_batch))
    return trainer, module, cb


def test_plan_becomes_trainer_arguments():
    kw = tl.trainer_arguments(Plan("bf16", 4, 32, device="cuda"))
    assert kw["accumulate_grad_batches"] == 8 and kw["precision"] == "bf16-mixed" and kw["accelerator"] == "gpu"
    assert "gradient_clip_val" not in kw and "devices" not in kw  # clipping and devices stay the user's
    assert tl.trainer_arguments(Plan("fp16", 4, 4, device="cuda"))["precision"] == "16-mixed"
    with pytest.raises(TightfitError, match="must be a tightfit.Plan"):
        tl.TightfitCallback("4GiB")


def test_the_callback_refuses_an_fp16_plan_for_the_cpu_as_the_arguments_do():
    """The arguments' refusal of an fp16 CPU plan left the callback: a Trainer made by hand with fp16 on
    the CPU was then trained in another precision without a word (the Hugging Face Trainer: fp32) or
    told to use the arguments that refuse the plan (Lightning). The callback refuses it as they do."""
    with pytest.raises(TightfitError, match=r"^TightfitCallback\(plan\): an fp16 plan for the CPU \(plan.device='cpu'\)"):
        tl.TightfitCallback(Plan("fp16", 4, 8))
    tl.TightfitCallback(Plan("bf16", 4, 8))  # real bf16 autocast on the CPU
    tl.TightfitCallback(Plan("fp16", 4, 8, device="cuda"))


def test_an_fp16_plan_for_the_cpu_is_refused_not_trained_as_bf16():
    """``precision="16-mixed"`` was returned for an fp16 CPU plan: Lightning then trains it as
    ``bf16-mixed`` (its own warning: no fp16 AMP on the CPU), and the callback told the user to make the
    Trainer with trainer_arguments(plan), which they had. It is now refused in one line, as TrainStep
    and the HF integration refuse it; bf16-mixed on the CPU is real bf16 autocast and stays."""
    with pytest.raises(TightfitError) as e:
        tl.trainer_arguments(Plan("fp16", 4, 8))
    assert "an fp16 plan for the CPU" in str(e.value) and "as 'bf16-mixed'" in str(e.value)
    assert "\n" not in str(e.value)
    assert tl.trainer_arguments(Plan("bf16", 4, 8))["precision"] == "bf16-mixed"


def test_trainer_arguments_take_yours_and_refuse_what_the_plan_sets_otherwise(caplog):
    plan = Plan("bf16", 4, 32, device="cuda")
    kw = tl.trainer_arguments(plan, max_epochs=2, devices=4, precision="bf16", accelerator="auto")
    assert kw["max_epochs"] == 2 and kw["devices"] == 4 and kw["precision"] == "bf16-mixed"
    assert kw["accelerator"] == "auto"  # runs the plan's GPU
    # the refusal names your value as yours, by its Trainer argument, and what the plan chose, in one line
    with pytest.raises(TightfitError) as e:
        tl.trainer_arguments(plan, accumulate_grad_batches=1, precision="32-true")
    assert "your accumulate_grad_batches=1 (the plan chose 8), precision='32-true' (the plan chose 'bf16-mixed'); " \
           "the plan sets them: delete them" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "the plan sets accumulate_grad_batches" not in str(e.value)
    with pytest.raises(TightfitError, match="accelerator='cpu'"):
        tl.trainer_arguments(plan, accelerator="cpu")
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        kw = tl.trainer_arguments(Plan("fp32", 12, 40))
    assert kw["accumulate_grad_batches"] == 4 and "12 x 4 = 48 samples (the plan's: 40)" in caplog.text


def test_auto_accelerator_runs_a_cpu_plan_on_the_cpu():
    """``accelerator="auto"`` was kept for a CUDA plan but refused for a CPU plan ("the plan chose
    'cpu'"): "auto" leaves the choice to the plan, so a CPU plan runs on the CPU (``"cpu"``: Lightning's
    own "auto" would take a GPU where one is visible). A GPU accelerator stays refused."""
    plan = Plan("fp32", 4, 8, device="cpu")
    assert tl.trainer_arguments(plan, accelerator="auto")["accelerator"] == "cpu"
    assert tl.trainer_arguments(plan, accelerator="cpu")["accelerator"] == "cpu"
    with pytest.raises(TightfitError, match="accelerator='gpu' \\(the plan chose 'cpu'\\)"):
        tl.trainer_arguments(plan, accelerator="gpu")


def test_real_fit_runs_the_plans_accumulation():
    module = _Classifier()
    plan = tightfit.plan(module.bert, SyntheticBatches(8).worst_case(8), effective_batch=8, device="cpu")
    plan = plan.with_micro_batch(4)  # 4 x 2, as a GPU plan would accumulate
    trainer, module, cb = _fit(plan, module)
    assert trainer.global_step == 3 and module.batches == 6 and trainer.accumulate_grad_batches == 2
    assert cb.events == [] and cb.summary()["health"].startswith("off")


def test_callback_sets_accumulation_and_checkpointing_and_warns_on_precision_and_batch(caplog):
    plan = Plan("bf16", 4, 8, activation_checkpointing=True)
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        trainer, module, cb = _fit(plan, steps=1, micro_batch=8, accumulate_grad_batches=1, precision="32-true")
    assert trainer.accumulate_grad_batches == 2 and module.batches == 2
    assert hf_hook_active(module.bert)  # the model's own (non-reentrant) hook
    assert any("your Trainer's accumulate_grad_batches=1 replaced by the plan's 2" in e for e in cb.events)
    assert any("your Trainer runs precision='32-true', the plan chose 'bf16-mixed'" in e for e in cb.events)
    assert any("your training loader's batch_size=8, the plan chose micro-batch 4: each optimizer step trains on "
               "8 x 2 = 16 samples (the plan's effective batch: 8)" in e for e in cb.events)
    assert "tightfit: your Trainer's accumulate_grad_batches" in caplog.text


class _ManualClassifier(_Classifier):
    """The classifier under manual optimization: one optimizer step per training batch."""

    def __init__(self):
        super().__init__(dropout=0.0)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        self.batches += 1
        optimizer = self.optimizers()
        self.manual_backward(self.bert(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()


def test_manual_optimization_is_not_told_the_plans_accumulation_was_set(caplog):
    """Under manual optimization Lightning accumulates nothing (and refuses accumulate_grad_batches
    above 1 when the Trainer is made with it): the callback set the plan's 2 anyway and said "replaced by the
    plan's 2", while each batch of 4 took its own optimizer step (an effective batch of 4, not 8). It
    now leaves the Trainer's 1 and says the plan's accumulation is the training_step's to do."""
    plan = Plan("fp32", 4, 8)
    with caplog.at_level(logging.WARNING, logger="tightfit"):  # the Trainer made without accumulation, as Lightning asks
        trainer, module, cb = _fit(plan, _ManualClassifier(), steps=2, accumulate_grad_batches=1)
    assert trainer.accumulate_grad_batches == 1 and trainer.global_step == 2 and module.batches == 2
    assert not any("replaced by the plan's" in e for e in cb.events), cb.events
    assert len(cb.events) == 1 and "manual optimization" in cb.events[0], cb.events
    assert "every 2 training batches" in cb.events[0] and "effective batch of 8" in cb.events[0], cb.events


def test_a_fit_with_a_plan_without_checkpointing_turns_an_earlier_plans_off():
    _, module, _ = _fit(Plan("fp32", 4, 4, activation_checkpointing=True), steps=1)
    assert hf_hook_active(module.bert)
    _fit(Plan("fp32", 4, 4), module, steps=1)
    assert not hf_hook_active(module.bert)


def test_your_own_checkpointing_turned_off_by_a_plan_without_it_is_said():
    module = _Classifier()
    module.bert.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, module, cb = _fit(Plan("fp32", 4, 4), module, steps=1)
    assert not hf_hook_active(module.bert)
    assert len(cb.events) == 1 and "activation checkpointing" in cb.events[0], cb.events
    assert "checkpointing='on'" in cb.events[0], cb.events


def test_non_finite_steps_are_skipped_then_fit_stops():
    module = _Classifier()
    start = [p.detach().clone() for p in module.parameters()]
    module.bert.classifier.weight.register_hook(lambda g: g * float("nan"))
    cb = tl.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=2)
    with pytest.raises(NonFiniteTrainingError, match="2 steps in a row"):
        _fit(Plan("fp32", 8, 8), module, steps=5, callback=cb)
    assert cb.skipped_steps == 2
    for a, b in zip(module.parameters(), start):  # neither step applied (no weight decay, no AdamW state)
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_finite_gradients_whose_norm_overflows_are_a_skipped_step(clip):
    """Gradients of 1e20 are finite but their norm overflows fp32: the callback checked each tensor
    only, and the optimizer applied the step (clipped: zeros, with AdamW's moments moving the weights;
    unclipped: 1e20 into AdamW's moments), its step counted and nothing reported. As in tightfit's
    own runtime, the step is skipped."""

    class Snapshots(_Classifier):
        weights = []

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.weights.append([p.detach().clone() for p in self.parameters()])

    module = Snapshots(dropout=0.0)
    backwards = []

    def overflow_in_step_2(g):
        backwards.append(1)
        return torch.full_like(g, 1e20) if len(backwards) == 2 else g

    module.bert.classifier.weight.register_hook(overflow_in_step_2)
    trainer, module, cb = _fit(Plan("fp32", 8, 8), module, steps=3, gradient_clip_val=clip)
    assert cb.skipped_steps == 1 and cb.events == ["step 2: non-finite gradients, update skipped"], cb.events
    for a, b in zip(module.weights[1], module.weights[0]):  # step 2 left every weight as it was
        assert torch.equal(a, b)
    assert {int(s["step"]) for s in trainer.optimizers[0].state.values()} == {2}


def test_a_16_mixed_step_skipped_for_a_norm_that_overflows_backs_off_the_loss_scale():
    """16-mixed: a step whose gradients the scaler's unscale_ found finite but whose norm overflows was
    skipped by dropping the gradients, so the scaler stepped on nothing and counted a clean step: the
    scale stayed where it overflowed (2**16, not 2**15). The scaler now skips it as it skips an inf
    gradient. Lightning has no fp16 scaler on the CPU: a real torch.amp.GradScaler is given to its
    MixedPrecision plugin (fp16 autocast runs on the CPU)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class Scales(_Classifier):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.scales.append(self.trainer.precision_plugin.scaler.get_scale())
            self.weights.append([p.detach().clone() for p in self.parameters()])

    def run(gradient):
        module = Scales(dropout=0.0)
        module.scales, module.weights, backwards = [], [], []

        def in_step_2(g):
            backwards.append(1)
            return torch.full_like(g, gradient) if len(backwards) == 2 else g

        module.bert.classifier.weight.register_hook(in_step_2)
        plan = Plan("fp16", 8, 8, device="cuda")
        plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0 ** 16))
        _, module, cb = _fit(plan, module, steps=3, accelerator="cpu", precision=None, plugins=[plugin])
        return module, cb

    own, own_cb = run(float("inf"))  # the scaler's own overflow path: unscale_ finds the inf
    module, cb = run(1e30)  # finite; unscaled, 1.5e25: its norm overflows fp32
    assert cb.skipped_steps == own_cb.skipped_steps == 1, (cb.events, own_cb.events)
    assert module.scales == own.scales == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15], module.scales
    for a, b in zip(module.weights[1], module.weights[0]):  # step 2 left every weight as it was
        assert torch.equal(a, b)


def test_a_trainer_without_the_plans_fp16_drops_non_finite_gradients_and_advises_for_its_own_precision():
    """A Trainer made at 32-true for an fp16 plan (setup warns): the callback went by the plan's
    precision, left the non-finite gradients to a loss scaler the Trainer did not have, and the
    optimizer applied them (NaN weights); its advice then was to try fp32, which the run was. It now
    goes by the Trainer's precision plugin: the gradients are dropped, the advice is fp32's."""
    module = _Classifier()
    start = [p.detach().clone() for p in module.parameters()]
    module.bert.classifier.weight.register_hook(lambda g: g * float("nan"))
    plan = Plan("fp16", 8, 8, device="cuda")
    cb = tl.TightfitCallback(plan, max_skipped_steps=2)
    with pytest.raises(NonFiniteTrainingError, match="2 steps in a row") as e:
        _fit(plan, module, steps=5, callback=cb, accelerator="cpu", precision="32-true")
    for a, b in zip(module.parameters(), start):
        assert torch.equal(a, b)
    assert "precision is not the cause" in str(e.value), str(e.value)


def test_a_skipped_step_puts_the_buffers_back_as_the_window_found_them():
    """The skipped step's forwards had updated the model's buffers (BatchNorm's statistics: NaN for
    good after an inf); the callback now puts them back with the gradients it drops."""
    module = _Classifier()
    head = module.bert.classifier
    count_forwards(head)
    head.weight.register_hook(lambda g: g * float("nan"))
    cb = tl.TightfitCallback(Plan("fp32", 4, 8), max_skipped_steps=2)
    with pytest.raises(NonFiniteTrainingError):
        _fit(Plan("fp32", 4, 8), module, steps=5, callback=cb)
    assert cb.skipped_steps == 2 and int(head.seen) == 0


def test_a_second_fit_counts_its_own_non_finite_steps_in_a_row():
    module = _Classifier()
    module.bert.classifier.weight.register_hook(lambda g: g * float("nan"))
    cb = tl.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=2)
    for fits in (1, 2):  # the same callback in a second Trainer: again 2 skipped steps before it stops
        with pytest.raises(NonFiniteTrainingError, match="2 steps in a row"):
            _fit(Plan("fp32", 8, 8), module, steps=5, callback=cb)
        assert cb.skipped_steps == 2 * fits


def _out_of_memory_in_every_forward(module):
    def oom(m, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    module.bert.bert.encoder.layer[0].register_forward_pre_hook(oom, with_kwargs=True)


def test_oom_names_the_micro_batch_that_keeps_the_effective_batch():
    module = _Classifier()

    _out_of_memory_in_every_forward(module)
    cb = tl.TightfitCallback(Plan("fp32", 8, 16))
    with pytest.raises(torch.OutOfMemoryError):
        _fit(Plan("fp32", 8, 16), module, callback=cb)
    assert any("out of memory at micro-batch 8 x 2" in e and "plan.with_micro_batch(4) (4 x 4:" in e
               for e in cb.events), cb.events


def test_the_oom_advice_is_a_plan_that_the_arguments_and_the_callback_take():
    """The advice after an OOM at 8 x 2 (plan 8 x 2 = 16) was "fit again with DataLoader(batch_size=4)
    and accumulate_grad_batches=4": trainer_arguments(plan) refuses that accumulation (the plan chose
    2), and on a Trainer made with it by hand the callback's setup puts the plan's 2 back, training
    4 x 2, half the effective batch. It now names the plan to fit with, plan.with_micro_batch(4),
    which trainer_arguments, the callback and the loader take as they are: 4 x 4, nothing said."""
    plan = Plan("fp32", 8, 16)
    with pytest.raises(TightfitError, match="your accumulate_grad_batches=4 \\(the plan chose 2\\)"):
        tl.trainer_arguments(plan, accumulate_grad_batches=4)  # what the old advice had the user do
    module = _Classifier()
    _out_of_memory_in_every_forward(module)
    cb = tl.TightfitCallback(plan)
    with pytest.raises(torch.OutOfMemoryError):
        _fit(plan, module, callback=cb)
    advice = [e for e in cb.events if "out of memory at micro-batch 8 x 2" in e]
    assert advice and ("fit again with plan = plan.with_micro_batch(4) (4 x 4: the plan's effective batch of 16) "
                       "in trainer_arguments(plan), TightfitCallback(plan) and DataLoader(batch_size=plan.micro_batch)"
                       ) in advice[0], advice
    again = plan.with_micro_batch(4)
    trainer, module, cb = _fit(again, steps=2)
    assert (trainer.accumulate_grad_batches, module.batches, cb.events) == (4, 8, [])


def test_oom_advice_keeps_the_plans_effective_batch_when_the_loader_differed():
    """The loader ran 10 x 2 (effective 20) where the plan says 6 x 2 (12): the advice after an
    OOM keeps the plan's 12, not the loader's 20."""
    module = _Classifier()

    _out_of_memory_in_every_forward(module)
    cb = tl.TightfitCallback(Plan("fp32", 6, 12))
    with pytest.raises(torch.OutOfMemoryError):
        _fit(Plan("fp32", 6, 12), module, callback=cb, micro_batch=10)
    advice = [e for e in cb.events if "out of memory at micro-batch 10 x 2" in e]
    assert advice and "plan.with_micro_batch(4) (4 x 3:" in advice[0], advice
    assert "effective batch of 12" in advice[0]


class _OOMInValidation(_Classifier):
    def validation_step(self, batch, batch_idx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB (injected, in validation)")


@pytest.mark.parametrize("sanity", [2, 0])
def test_oom_in_validation_names_the_validation_loader_not_the_training_batch(sanity):
    cb = tl.TightfitCallback(Plan("fp32", 8, 16))
    with pytest.raises(torch.OutOfMemoryError):
        trainer = L.Trainer(**{**tl.trainer_arguments(Plan("fp32", 8, 16)), "max_steps": 2, "logger": False,
                               "enable_checkpointing": False, "enable_progress_bar": False,
                               "enable_model_summary": False, "callbacks": [cb], "num_sanity_val_steps": sanity,
                               "val_check_interval": 2})
        trainer.fit(_OOMInValidation(), _loader(8), _loader(32))
    assert len(cb.events) == 1 and "validation, not in a training step" in cb.events[0], cb.events
    assert ("sanity check" in cb.events[0]) == bool(sanity)


@pytest.mark.parametrize("bad, words", [(dict(max_skipped_steps=0), "max_skipped_steps must be >= 1"),
                                        (dict(max_skipped_steps=2.5), "max_skipped_steps must be a whole number")])
def test_the_callback_refuses_bad_guard_options(bad, words):
    with pytest.raises(TightfitError, match=words):
        tl.TightfitCallback(Plan("fp32", 8, 8), **bad)


@pytest.mark.gpu
def test_callback_records_each_steps_memory_on_the_gpu():
    module = _Classifier()
    try:
        plan = tightfit.plan(module.bert, SyntheticBatches(8).worst_case(8), effective_batch=8, budget="2GiB")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the plan capped this process; the other tests run uncapped
    trainer, module, cb = _fit(plan, module, steps=2)
    assert plan.device == "cuda" and trainer.global_step == 2
    assert [s for s, _, _ in cb.memory_timeline] == [1, 2] and cb.summary()["peak_reserved_bytes"] > 0


def test_shipped_model_trains_with_lightning():
    """A real ``Trainer.fit`` of the shipped MiniLM, planned by tightfit, with the callback."""
    from transformers import AutoModelForSequenceClassification

    path, enc, labels = shipped_model_reviews()
    torch.manual_seed(0)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    module = Module()
    plan = tightfit.plan(module.model, {**enc, "labels": labels}, effective_batch=8)
    rows = [{**{k: v[i] for k, v in enc.items()}, "labels": labels[i]} for i in range(len(labels))]
    before = [p.detach().clone() for p in module.model.parameters()]
    cb = tl.TightfitCallback(plan)
    trainer = L.Trainer(**tl.trainer_arguments(plan), max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=plan.micro_batch))
    assert trainer.global_step == 2 and cb.events == []
    assert any(not torch.equal(a, b) for a, b in zip(module.model.parameters(), before))  # it trained


def test_manual_optimization_is_not_told_an_effective_batch_of_lightnings_accumulation(caplog):
    """Under manual optimization Lightning's accumulate_grad_batches is 1 whatever the training_step
    does: a loader of 8 for the plan's 4 x 2 was told "each optimizer step trains on 8 x 1 = 8
    samples (the plan's effective batch: 8)", as if it matched, and an OOM was told to fit again with
    accumulate_grad_batches=4, which Lightning refuses there. Both now leave the accumulation to the
    training_step, which is what decides it."""
    plan = Plan("fp32", 4, 8)
    trainer, module, cb = _fit(plan, _ManualClassifier(), steps=1, micro_batch=8, accumulate_grad_batches=1)
    said = [e for e in cb.events if "batch_size=8" in e]
    assert said and "8 x 1" not in said[0] and "your training_step decides" in said[0], cb.events
    assert "(the plan's: 4 x 2)" in said[0], said
    module = _ManualClassifier()
    _out_of_memory_in_every_forward(module)
    cb = tl.TightfitCallback(plan)
    with pytest.raises(torch.OutOfMemoryError):
        _fit(plan, module, callback=cb, micro_batch=8, accumulate_grad_batches=1)
    advice = [e for e in cb.events if "out of memory at micro-batch 8" in e]
    assert advice and "accumulate_grad_batches" not in advice[0], cb.events
    assert "plan.with_micro_batch(4)" in advice[0] and "stepped every 2 training batches" in advice[0], advice


def test_the_skipped_step_counts_survive_a_resume_from_the_trainers_checkpoint(tmp_path):
    """The callback's counts of skipped steps were not in Lightning's checkpoints: a ``fit(ckpt_path=...)``
    started them at 0, so a run stopping after 3 non-finite steps in a row went on for 3 more after a
    resume (TrainStep.state_dict keeps them). They are now the callback's ``state_dict``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def fit(steps, cb, ckpt_path=None):
        module = _Classifier()
        module.bert.classifier.weight.register_hook(lambda g: g * float("nan"))
        saves = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
        trainer = L.Trainer(**{**tl.trainer_arguments(plan), "max_steps": steps, "logger": False,
                               "enable_progress_bar": False, "enable_model_summary": False, "callbacks": [cb, saves]})
        trainer.fit(module, _loader(plan.micro_batch), ckpt_path=ckpt_path)
        return trainer

    plan = Plan("fp32", 8, 8)
    first = tl.TightfitCallback(plan, max_skipped_steps=3)
    fit(2, first)
    assert first.skipped_steps == 2
    saved = torch.load(tmp_path / "epoch=0-step=2.ckpt", weights_only=True)["callbacks"]
    assert saved[next(k for k in saved if "TightfitCallback" in k)] == {"skipped_steps": 2, "skipped_in_row": 2}
    resumed = tl.TightfitCallback(plan, max_skipped_steps=3)  # a new process: a new callback
    with pytest.raises(NonFiniteTrainingError, match="3 steps in a row"):
        fit(4, resumed, ckpt_path=tmp_path / "epoch=0-step=2.ckpt")
    assert resumed.skipped_steps == 3
    # state loaded outside a fit (Lightning restores callbacks for validate/test(ckpt_path=...) too) does
    # not carry into a later fresh fit, which starts its own count in a row (it stopped at its first step)
    validated = tl.TightfitCallback(plan, max_skipped_steps=3)
    validated.load_state_dict(saved[next(k for k in saved if "TightfitCallback" in k)])
    fit(2, validated)
    assert validated._skipped_in_row == 2


def test_a_lora_plan_for_a_module_without_adapters_is_refused_and_one_with_them_trains():
    """Found by a review: a LoRA (or freezing) plan trained a module without adapters whole. A
    LightningModule holding the LoRA-wrapped model it was planned for trains."""
    from tightfit.levers.lora import apply_lora

    plan = Plan("fp32", 4, 8, trainable="lora", device="cpu")
    with pytest.raises(TightfitError, match="the plan trains LoRA adapters"):
        _fit(plan, steps=1)
    module = _Classifier(dropout=0.0)
    module.bert = apply_lora(module.bert)
    _fit(plan, module=module, steps=1)
    assert module.batches == 2


def test_a_several_process_plan_is_compared_per_process_and_fsdp_is_noted(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="tightfit"):
        tl.trainer_arguments(Plan("bf16", 4, 16, world_size=2, sharding="fsdp", device="cuda"))
    assert "effective batch" not in caplog.text and "shards the model with FSDP2" in caplog.text
    caplog.clear()  # a strategy that replicates does not silence it; one that shards does (a review of the change)
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        tl.trainer_arguments(Plan("bf16", 4, 16, world_size=2, sharding="fsdp", device="cuda"), strategy="ddp")
    assert "shards the model with FSDP2" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        tl.trainer_arguments(Plan("bf16", 4, 16, world_size=2, sharding="fsdp", device="cuda"), strategy="fsdp")
    assert "FSDP2" not in caplog.text


def test_a_lora_plan_is_checked_against_the_model_however_deep_the_module_holds_it():
    """Found by a review of the change: only the module and its children were checked."""
    from tightfit.integrations import check_trainable
    from tightfit.levers.lora import apply_lora

    outer = torch.nn.Module()
    outer.net = torch.nn.Module()
    outer.net.backbone = apply_lora(tiny_bert())
    check_trainable("lora", outer, "the TightfitCallback")
    with pytest.raises(TightfitError, match="the TightfitCallback: the plan trains LoRA adapters"):
        check_trainable("lora", _Classifier(), "the TightfitCallback")
