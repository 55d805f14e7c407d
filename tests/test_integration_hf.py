"""tightfit with the Hugging Face Trainer (:mod:`tightfit.integrations.hf`): real ``Trainer.train()`` runs on the CPU."""

import logging

import pytest
import torch

import tightfit
from conftest import SyntheticBatches, count_forwards, shipped_model_reviews, tiny_bert
from tightfit import Plan, TightfitError

hf = pytest.importorskip("tightfit.integrations.hf")
from transformers import Trainer, TrainingArguments  # noqa: E402

from tightfit.runtime.trainer import NonFiniteTrainingError  # noqa: E402


class _Rows(torch.utils.data.Dataset):
    """``n`` synthetic samples padded to one length, as dicts the Trainer's default collator stacks."""

    def __init__(self, n=32):
        self.batch = SyntheticBatches(n).worst_case(n)

    def __len__(self):
        return len(self.batch["labels"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def _trainer(tmp_path, plan, steps=3, dropout=0.1, callback=None, eval_dataset=None, **extra):
    model = tiny_bert(dropout=dropout)
    args = TrainingArguments(**{"output_dir": str(tmp_path / "out"), "max_steps": steps, "learning_rate": 1e-3,
                                "logging_steps": 1, "save_strategy": "no", "report_to": [], "disable_tqdm": True,
                                "seed": 0, **hf.training_arguments(plan), **extra})
    return Trainer(model=model, args=args, train_dataset=_Rows(), eval_dataset=eval_dataset,
                   callbacks=[callback or hf.TightfitCallback(plan)])


# transformers 5.x (5.24 here; not yet 5.17) renamed gradient_checkpointing* to activation_checkpointing*
_CKPT = ("activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
         else "gradient_checkpointing")


def _weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_plan_becomes_training_arguments():
    kw = hf.training_arguments(Plan("fp16", 4, 32, activation_checkpointing=True, device="cuda"))
    assert kw["per_device_train_batch_size"] == 4 and kw["gradient_accumulation_steps"] == 8
    assert kw["fp16"] and not kw["bf16"] and kw[_CKPT]
    assert kw[f"{_CKPT}_kwargs"] == {"use_reentrant": False}
    assert "optim" not in kw and not kw["auto_find_batch_size"] and not kw["use_cpu"]
    kw = hf.training_arguments(Plan("bf16", 8, 8, device="cuda"))
    assert kw["bf16"] and not kw["fp16"] and kw["gradient_accumulation_steps"] == 1 and not kw[_CKPT]
    with pytest.raises(TightfitError, match="must be a tightfit.Plan"):
        hf.training_arguments({"micro_batch": 4})


def test_the_callback_refuses_an_fp16_plan_for_the_cpu_as_the_arguments_do():
    """The arguments' refusal of an fp16 CPU plan left the callback: a Trainer made by hand with fp16 on
    the CPU was then trained in another precision without a word (the Hugging Face Trainer: fp32) or
    told to use the arguments that refuse the plan (Lightning). The callback refuses it as they do."""
    with pytest.raises(TightfitError, match=r"^TightfitCallback\(plan\): an fp16 plan for the CPU \(plan.device='cpu'\)"):
        hf.TightfitCallback(Plan("fp16", 4, 8))
    hf.TightfitCallback(Plan("bf16", 4, 8))  # real bf16 autocast on the CPU
    hf.TightfitCallback(Plan("fp16", 4, 8, device="cuda"))


def test_an_fp16_plan_for_the_cpu_is_refused_not_trained_in_fp32():
    """``fp16=True, use_cpu=True`` was returned for an fp16 CPU plan, and the Trainer then trained in
    fp32 (accelerate has no fp16 autocast or scaler on the CPU: native_amp False) without a word,
    where TrainStep refuses the same plan. It is now refused in one line; bf16 on the CPU is real
    bf16 autocast in the Trainer and stays."""
    with pytest.raises(TightfitError) as e:
        hf.training_arguments(Plan("fp16", 4, 8), output_dir="out")
    assert "an fp16 plan for the CPU" in str(e.value) and "in fp32 without a word" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(TightfitError, match="needs a CUDA GPU"):  # TrainStep's refusal of the same plan
        tightfit.TrainStep(Plan("fp16", 4, 8), torch.nn.Linear(2, 2), loss=lambda m, b: m(b[0]).mean())
    kw = hf.training_arguments(Plan("bf16", 4, 8))
    assert kw["bf16"] and kw["use_cpu"]


def test_training_arguments_take_yours_and_refuse_what_the_plan_sets_otherwise():
    plan = Plan("fp32", 4, 16)
    kw = hf.training_arguments(plan, output_dir="out", learning_rate=1e-4, max_grad_norm=0.5, optim="adamw_torch",
                               per_device_train_batch_size=4)  # the plan's own value: allowed
    assert kw["output_dir"] == "out" and kw["learning_rate"] == 1e-4 and kw["optim"] == "adamw_torch"
    assert kw["max_grad_norm"] == 0.5 and kw["gradient_accumulation_steps"] == 4
    assert "max_grad_norm" not in hf.training_arguments(plan)  # the Trainer's own clipping, untouched
    # the refusal names your value as yours, by its TrainingArguments name, and what the plan chose, in one line
    with pytest.raises(TightfitError) as e:
        hf.training_arguments(plan, output_dir="out", per_device_train_batch_size=16, fp16=True)
    assert "your per_device_train_batch_size=16 (the plan chose 4), fp16=True (the plan chose False); " \
           "the plan sets them: delete them" in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "the plan sets per_device_train_batch_size" not in str(e.value)
    # the old name is the same argument, and the refusal names it as you wrote it
    with pytest.raises(TightfitError, match=r"your gradient_checkpointing=True \(the plan chose False\)"):
        hf.training_arguments(plan, gradient_checkpointing=True)


def test_uneven_plan_notes_the_trainers_effective_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        kw = hf.training_arguments(Plan("fp32", 4, 10))
    assert kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"] == 12
    assert "4 x 3 = 12 samples (the plan's: 10)" in caplog.text


def test_callback_names_your_training_arguments_and_what_the_plan_chose():
    cb = hf.TightfitCallback(Plan("bf16", 4, 16, device="cuda"))
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             report_to=[], use_cpu=True)
    cb._check_arguments(args, None)
    assert cb.events == ["your TrainingArguments run per_device_train_batch_size=8, the plan chose 4",
                         "your TrainingArguments run gradient_accumulation_steps=2, the plan chose 4",
                         "your TrainingArguments run fp16=False, bf16=False, the plan chose bf16=True"], cb.events


def test_real_trainer_runs_the_plan_with_the_callback(tmp_path):
    plan = tightfit.plan(tiny_bert(), _Rows().batch, effective_batch=8, device="cpu")
    plan = plan.with_micro_batch(4)  # as a GPU plan would accumulate: 4 x 2
    cb = hf.TightfitCallback(plan)
    trainer = _trainer(tmp_path, plan, callback=cb)
    out = hf.train(trainer)
    assert trainer.state.global_step == 3 and out.global_step == 3
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.args.per_device_train_batch_size == 4
    assert cb.events == [] and cb.skipped_steps == 0  # arguments as planned, every step finite
    assert cb.summary()["health"].startswith("off")


class _OOMAt:
    """A forward pre-hook raising a CUDA-style OOM once, when ``when(rows)`` holds for its input."""

    def __init__(self, when):
        self.when, self.fired, self.calls, self.rows = when, 0, 0, []

    def __call__(self, module, args, kwargs):
        self.calls += 1
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
        self.rows.append(rows)
        if not self.fired and self.when(self.calls, rows):
            self.fired += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def test_oom_before_the_first_step_trains_again_at_half_the_micro_batch_same_effective_batch(tmp_path):
    ref = _trainer(tmp_path / "ref", Plan("fp32", 4, 8))
    hf.train(ref)  # the same loss scaling as the redo (see the split test below)
    trainer = _trainer(tmp_path / "oom", Plan("fp32", 8, 8))
    hook = _OOMAt(lambda calls, rows: rows == 8)
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
    hf.train(trainer)
    assert hook.fired == 1 and trainer.state.global_step == 3
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    for a, b in zip(_weights(trainer), _weights(ref)):  # dropout on: same data order and masks as the reference
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_oom_after_a_step_resumes_from_the_newest_checkpoint(tmp_path, caplog):
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=3, save_strategy="steps", save_steps=1)
    hook = _OOMAt(lambda calls, rows: calls == 3)  # the third forward: step 3, after two checkpoints
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
    with caplog.at_level("WARNING"):
        hf.train(trainer)
    # the returned loss is the resumed run's (step 3 only), and the user is told so
    assert any("checkpoint-2" in r.message and "training_loss" in r.message and "after that checkpoint" in r.message
               for r in caplog.records)
    assert hook.fired == 1 and trainer.state.global_step == 3
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    # 2 steps of 8, the failed forward, then only step 3 again from checkpoint-2, as 2 micro-batches of 4
    assert hook.calls == 2 + 1 + 2 and hook.rows == [8, 8, 8, 4, 4]
    assert (tmp_path / "out" / "checkpoint-3").is_dir()


def test_a_resumed_run_trains_on_at_the_micro_batch_its_checkpoint_was_written_at(tmp_path):
    """A run redone at 4 x 2 after an OOM at 8 x 1 stops (killed) after step 3; resumed from its
    checkpoint with the plan's arguments (8 x 1), it went back to the per-device batch that had run
    out of memory (its checkpoints even recorded 8: the Trainer keeps the resumed checkpoint's
    ``train_batch_size``), drew other dropout masks than the run that went on, and on the card would
    have run out of memory again. It trains on at 4 x 2, as the uninterrupted run did."""
    from transformers import TrainerCallback

    class StopAfter3(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    def run(path, stop=False, oom=True):
        cb = hf.TightfitCallback(Plan("fp32", 8, 8))
        trainer = _trainer(path, Plan("fp32", 8, 8), steps=4, callback=cb, save_strategy="steps", save_steps=1)
        if stop:
            trainer.add_callback(StopAfter3())
        hook = _OOMAt(lambda calls, rows: oom and calls == 3)  # step 3, after two checkpoints
        trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
        return trainer, hook, cb

    uninterrupted, _, _ = run(tmp_path / "a")
    hf.train(uninterrupted)
    stopped, _, _ = run(tmp_path / "b", stop=True)
    hf.train(stopped)
    assert stopped.state.global_step == 3 and stopped.args.per_device_train_batch_size == 4
    # a run no TightfitCallback with a plan watches keeps the per-device batch its arguments give
    import shutil

    shutil.copytree(tmp_path / "b", tmp_path / "c")
    plain = _trainer(tmp_path / "c", Plan("fp32", 8, 8), steps=4, callback=hf.TightfitCallback(None),
                     save_strategy="steps", save_steps=1)
    hf.train(plain, resume_from_checkpoint=True)
    assert plain.state.global_step == 4 and plain.args.per_device_train_batch_size == 8
    resumed, hook, cb = run(tmp_path / "b", oom=False)
    hf.train(resumed, resume_from_checkpoint=True)
    assert hook.rows == [4, 4] and resumed.state.global_step == 4  # step 4 only, at the redo's batch
    assert (resumed.args.per_device_train_batch_size, resumed.args.gradient_accumulation_steps) == (4, 2)
    assert cb.events == [] and (cb.plan.micro_batch, cb.plan.accumulation_steps) == (4, 2)
    for a, b in zip(_weights(resumed), _weights(uninterrupted)):  # dropout on: the same masks
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_oom_redo_from_a_checkpoint_does_not_count_the_failed_attempts_evaluations(tmp_path):
    """Early stopping keeps its count of evaluations without improvement in the callback object: the
    redo from checkpoint-2 went on with the count of the failed attempt's evaluation after step 3,
    which it counted again, and stopped at step 3 where the run without the OOM stops at step 4."""
    from transformers import EarlyStoppingCallback

    def run(path, oom_at=None):
        trainer = _trainer(path, Plan("fp32", 8, 8), steps=8, dropout=0.0, save_strategy="steps", save_steps=2,
                           eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                           metric_for_best_model="same", eval_dataset=_Rows(8))
        trainer.compute_metrics = lambda prediction: {"same": 1.0}  # never improves
        trainer.add_callback(EarlyStoppingCallback(early_stopping_patience=3))
        hook = _OOMAt(lambda calls, rows: calls == oom_at)

        def training_only(module, args, kwargs):
            if module.training:
                hook(module, args, kwargs)

        trainer.model.bert.encoder.layer[1].register_forward_pre_hook(training_only, with_kwargs=True)
        hf.train(trainer)
        return trainer, hook

    planned, _ = run(tmp_path / "a")
    redone, hook = run(tmp_path / "b", oom_at=4)  # step 4, after checkpoint-2 and the evaluation of step 3
    assert hook.fired == 1 and redone.args.per_device_train_batch_size == 4
    assert planned.state.global_step == redone.state.global_step == 4


@pytest.mark.parametrize("oom_in_step, max_skipped", [(3, 2), (4, 20)])
def test_an_oom_redo_from_a_checkpoint_goes_on_with_its_count_of_skipped_steps(tmp_path, oom_in_step, max_skipped):
    """Steps 2 and 3 have non-finite gradients; checkpoint-2 is written after the first. The redo from
    it started a new count of skipped steps in a row (with 2 allowed, the run without the OOM stops at
    step 3; the redo trained on to step 5) and counted step 3's skip a second time (3 skipped steps
    for 2)."""
    cb = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=max_skipped)
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=5, dropout=0.0, callback=cb, save_strategy="steps",
                       save_steps=2)
    hook = _OOMAt(lambda calls, rows: calls == oom_in_step)
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
    trainer.model.classifier.weight.register_hook(lambda g: g * float("nan") if trainer.state.global_step in (1, 2)
                                                  else g)
    if max_skipped == 2:
        with pytest.raises(NonFiniteTrainingError, match="2 steps in a row"):
            hf.train(trainer)
    else:
        hf.train(trainer)
    assert hook.fired == 1 and trainer.args.per_device_train_batch_size == 4
    assert trainer.state.global_step == (3 if max_skipped == 2 else 5) and cb.skipped_steps == 2


def test_the_skipped_step_counts_survive_a_resume_from_the_trainers_checkpoint(tmp_path):
    """The callback's counts of skipped steps were not in the Trainer's checkpoints: a run resumed
    with ``resume_from_checkpoint`` (a new process, a new callback) started them at 0, so a run that
    stops after 3 non-finite steps in a row went on for 3 more (TrainStep.state_dict keeps them). They
    are now in the checkpoint's trainer_state.json, read back when the Trainer resumes."""
    import json

    def run(steps, cb, **resume):
        trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=steps, dropout=0.0, callback=cb,
                           save_strategy="steps", save_steps=1)
        trainer.model.classifier.weight.register_hook(lambda g: g * float("nan"))
        hf.train(trainer, **resume)
        return trainer

    first = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=3)
    run(2, first)
    assert first.skipped_steps == 2
    checkpoint = tmp_path / "out" / "checkpoint-2"
    with open(checkpoint / "trainer_state.json") as f:
        assert json.load(f)["stateful_callbacks"]["tightfit.TightfitCallback"] == {"skipped_steps": 2,
                                                                                   "skipped_in_row": 2}
    resumed = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=3)
    with pytest.raises(NonFiniteTrainingError, match="3 steps in a row"):
        run(4, resumed, resume_from_checkpoint=str(checkpoint))
    assert resumed.skipped_steps == 3
    fresh = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=3)  # a new run without a checkpoint: its own
    run(2, fresh)
    assert fresh.skipped_steps == 2 and fresh.stop_reason is None


def test_oom_after_a_step_without_a_checkpoint_stops_and_says_why(tmp_path):
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8))
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(_OOMAt(lambda calls, rows: calls == 2),
                                                                   with_kwargs=True)
    with pytest.raises(TightfitError, match="at step 2 .* no checkpoint"):
        hf.train(trainer)


def test_smaller_micro_batch_keeps_the_effective_batch():
    assert hf.smaller_micro_batch(8, 1) == (4, 2)
    assert hf.smaller_micro_batch(6, 2) == (3, 4)
    assert hf.smaller_micro_batch(5, 2) == (2, 5)
    assert hf.smaller_micro_batch(2, 3) == (1, 6)


def test_non_finite_step_is_skipped_then_a_run_of_them_stops_training(tmp_path):
    cb = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=2)
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=5, callback=cb)
    start = _weights(trainer)
    w = trainer.model.classifier.weight
    w.register_hook(lambda g: g * float("nan"))  # every step's gradient is NaN
    with pytest.raises(NonFiniteTrainingError, match="2 steps in a row had non-finite gradients") as e:
        hf.train(trainer)
    assert "--" not in str(e.value) and "learning rate" in str(e.value)  # the API's words, not the CLI's flags
    assert cb.skipped_steps == 2 and trainer.state.global_step == 2
    for a, b in zip(_weights(trainer), start):  # neither step was applied: no weight decay, no AdamW state
        assert torch.equal(a, b)


def test_finite_gradients_whose_norm_overflows_are_a_skipped_step(tmp_path):
    """Gradients of 1e20 are finite but their norm overflows fp32: the Trainer's clipping made them
    zeros, which passed the callback's check, and the optimizer applied the step (AdamW's moments
    moved the weights, its step counted) with nothing reported. As in tightfit's own runtime, the
    step is skipped."""
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        weights = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.weights[state.global_step] = [p.detach().clone() for p in model.parameters()]

    cb = hf.TightfitCallback(Plan("fp32", 8, 8))
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=3, dropout=0.0, callback=cb)
    trainer.add_callback(snapshots := Snapshots())
    backwards = []

    def overflow_in_step_2(g):
        backwards.append(1)
        return torch.full_like(g, 1e20) if len(backwards) == 2 else g

    trainer.model.classifier.weight.register_hook(overflow_in_step_2)
    hf.train(trainer)
    assert cb.skipped_steps == 1 and cb.events == ["step 2: non-finite gradients, update skipped"], cb.events
    for a, b in zip(snapshots.weights[2], snapshots.weights[1]):  # step 2 left every weight as it was
        assert torch.equal(a, b)
    assert {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()} == {2}
    assert "clip_grad_norm_" not in vars(trainer.accelerator)  # nothing of hf.train's left on the trainer


def _fp16_loss_scaler_on_the_cpu(trainer, init_scale=2.0 ** 16):
    """A real ``torch.amp.GradScaler`` where accelerate keeps its fp16 one on a GPU (it has none on the
    CPU): the Trainer's backward scales the loss by it, its clipping unscales the gradients
    (``unscale_gradients``), and ``AcceleratedOptimizer.step`` steps and updates it; ``args.fp16``
    as the Trainer's fp16 arguments set it. The forward stays fp32 (no fp16 autocast on the CPU)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    accelerator = trainer.accelerator
    accelerator.scaler = scaler
    accelerator.unscale_gradients = lambda optimizer=None: [scaler.unscale_(o.optimizer)
                                                            for o in accelerator._optimizers]
    trainer.args.fp16 = True
    return scaler


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_an_fp16_step_skipped_for_a_norm_that_overflows_backs_off_the_loss_scale(tmp_path, max_grad_norm):
    """fp16: a step whose gradients the scaler's unscale_ found finite but whose norm overflows was
    skipped by dropping the gradients, so the scaler stepped on nothing and counted a clean step: the
    scale was not backed off (2**16 after it, not 2**15), and the next steps overflowed again at it.
    Now the scaler skips the step as it skips an inf gradient: the same scale after it as after an
    inf gradient (clipped or not: max_grad_norm=0 measures the norm unclipped), the weights as they were."""
    from transformers import TrainerCallback

    class Scales(TrainerCallback):
        def __init__(self, scaler):
            self.scaler, self.scales, self.weights = scaler, {}, {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.scales[state.global_step] = self.scaler.get_scale()
            self.weights[state.global_step] = [p.detach().clone() for p in model.parameters()]

    def run(gradient):
        cb = hf.TightfitCallback()  # no plan: an fp16 plan for the CPU is refused
        trainer = _trainer(tmp_path / str(gradient), Plan("fp32", 8, 8), steps=3, dropout=0.0, callback=cb,
                           max_grad_norm=max_grad_norm)
        trainer.add_callback(seen := Scales(_fp16_loss_scaler_on_the_cpu(trainer)))
        backwards = []

        def in_step_2(g):
            backwards.append(1)
            return torch.full_like(g, gradient) if len(backwards) == 2 else g

        trainer.model.classifier.weight.register_hook(in_step_2)
        hf.train(trainer)
        return cb, seen

    own, own_seen = run(float("inf"))  # the scaler's own overflow path: unscale_ finds the inf
    cb, seen = run(1e30)  # finite; unscaled, 1.5e25: its norm overflows fp32
    assert cb.skipped_steps == own.skipped_steps == 1, (cb.events, own.events)
    assert seen.scales == own_seen.scales == {1: 2.0 ** 16, 2: 2.0 ** 15, 3: 2.0 ** 15}, seen.scales
    for a, b in zip(seen.weights[2], seen.weights[1]):  # step 2 left every weight as it was
        assert torch.equal(a, b)
    assert all(bool(torch.isfinite(p).all()) for p in seen.weights[3])


def test_an_fp16_run_without_a_loss_scaler_has_its_non_finite_steps_dropped(tmp_path):
    """fp16=True with no scaler to skip the step (the Trainer runs fp16 on the CPU in fp32, without
    one; a callback without a plan does not refuse it): the callback left the non-finite gradients to
    a loss scaler that was not there, and the optimizer applied them (NaN weights). It drops them now."""
    cb = hf.TightfitCallback(max_skipped_steps=2)
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=5, callback=cb, fp16=True)
    assert trainer.accelerator.scaler is None
    start = _weights(trainer)
    trainer.model.classifier.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(NonFiniteTrainingError, match="2 steps in a row"):
        hf.train(trainer)
    for a, b in zip(_weights(trainer), start):
        assert torch.equal(a, b)


def test_a_skipped_step_puts_the_buffers_back_as_the_window_found_them(tmp_path):
    """The skipped step's forwards had updated the model's buffers (BatchNorm's statistics: NaN for
    good after an inf); the callback now puts them back with the gradients it drops."""
    cb = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=2)
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=5, callback=cb)
    head = trainer.model.classifier
    count_forwards(head)
    head.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(NonFiniteTrainingError):
        hf.train(trainer)
    assert cb.skipped_steps == 2 and int(head.seen) == 0


def test_a_clean_train_after_a_stopped_one_does_not_raise_the_old_stop(tmp_path):
    # the advice after a stop ("try a lower learning rate") invites a second train() on the same Trainer
    cb = hf.TightfitCallback(Plan("fp32", 8, 8), max_skipped_steps=2)
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), steps=4, callback=cb)
    nan = trainer.model.classifier.weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(NonFiniteTrainingError):
        hf.train(trainer)
    nan.remove()  # the cause is fixed: the next train has finite steps only
    hf.train(trainer)
    assert cb.stop_reason is None and cb.skipped_steps == 2 and trainer.state.global_step == 4


def test_shipped_model_trains_with_the_trainer(tmp_path):
    from transformers import AutoModelForSequenceClassification

    path, enc, labels = shipped_model_reviews()
    rows = [{**{k: v[i] for k, v in enc.items()}, "labels": labels[i]} for i in range(len(labels))]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    plan = tightfit.plan(model, {**enc, "labels": labels}, effective_batch=8)
    cb = hf.TightfitCallback(plan)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, report_to=[], save_strategy="no",
                             disable_tqdm=True, **hf.training_arguments(plan))
    out = hf.train(Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb]))
    assert out.global_step == 2 and cb.events == []


@pytest.mark.gpu
def test_callback_reports_each_steps_memory_on_the_gpu(tmp_path):
    model = tiny_bert(dropout=0.1)
    try:
        plan = tightfit.plan(model, {k: v[:8] for k, v in _Rows().batch.items()},
                             effective_batch=8, budget="2GiB")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)  # the plan capped this process; the other tests run uncapped
    cb = hf.TightfitCallback(plan)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, report_to=[], save_strategy="no",
                             disable_tqdm=True, **hf.training_arguments(plan))
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(), callbacks=[cb])
    hf.train(trainer)
    assert plan.device == "cuda" and len(cb.memory_timeline) == 2 and cb.summary()["peak_reserved_bytes"] > 0
    assert any("peak_allocated_bytes" in r for r in trainer.state.log_history)


def test_memory_peaks_reach_the_trainers_log_history_not_only_the_printed_line():
    """The Trainer records a copy of the logs before ``on_log``: the callback's additions must land
    in ``state.log_history`` too (found on the GPU, where peaks exist)."""
    from types import SimpleNamespace

    cb = hf.TightfitCallback(Plan("fp32", 8, 8))
    cb.memory_timeline.append((1, 1000, 2000))  # as on CUDA after one optimizer step
    logs = {"loss": 0.5}
    state = SimpleNamespace(log_history=[{**logs, "step": 1}])
    cb.on_log(None, state, None, logs=logs)
    assert state.log_history[-1]["peak_allocated_bytes"] == 1000
    assert state.log_history[-1]["peak_reserved_bytes"] == 2000


def _logged(trainer):
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def test_micro_batch_splits_of_one_effective_batch_log_the_same_loss_and_gradient(tmp_path):
    """BERT's forward takes ``**kwargs`` but its loss ignores ``num_items_in_batch``: left to itself the
    Trainer neither passes a count the loss uses nor divides by the accumulation steps, so the loss and
    gradient grow with them (transformers#37766). Through :func:`hf.train` every split of the effective
    batch is one batch of it."""
    logged = {}
    for mb in (8, 4, 2):
        trainer = _trainer(tmp_path / str(mb), Plan("fp32", mb, 8), dropout=0.0)
        hf.train(trainer)
        logged[mb] = _logged(trainer)
        assert len(logged[mb]) == 3
    for mb in (4, 2):
        torch.testing.assert_close(logged[mb], logged[8], rtol=1e-4, atol=1e-6)


def test_a_micro_batch_without_labelled_items_adds_nothing_to_the_logged_loss(tmp_path):
    """A sample whose label is ignored (-100) alone in its micro-batch: the model's mean over no item
    is 0/0 = NaN; the window's logged loss and train_loss are still the one batch's. Dropout off:
    eight micro-batches of one draw other masks than one batch of eight."""
    logged, final = {}, {}
    for mb in (8, 1):
        trainer = _trainer(tmp_path / str(mb), Plan("fp32", mb, 8), steps=2, dropout=0.0, logging_nan_inf_filter=False)
        rows = trainer.train_dataset
        rows.batch["labels"][::2] = -100  # half the samples labelled
        out = hf.train(trainer)
        logged[mb], final[mb] = _logged(trainer), out.training_loss
    assert all(torch.isfinite(torch.tensor(x)).all() for x in logged[1])
    torch.testing.assert_close(logged[1], logged[8], rtol=1e-4, atol=1e-6)
    assert final[1] == pytest.approx(final[8], rel=1e-4)


def test_oom_redo_keeps_the_loss_scale_of_the_planned_micro_batch(tmp_path):
    ref = _trainer(tmp_path / "ref", Plan("fp32", 8, 8), dropout=0.0)
    hf.train(ref)
    trainer = _trainer(tmp_path / "oom", Plan("fp32", 8, 8), dropout=0.0)
    hook = _OOMAt(lambda calls, rows: rows == 8)
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
    hf.train(trainer)
    assert hook.fired == 1 and trainer.args.gradient_accumulation_steps == 2
    torch.testing.assert_close(_logged(trainer), _logged(ref), rtol=1e-4, atol=1e-6)


class _LMRows(_Rows):
    """Causal-LM rows of different lengths (padding labelled -100), from conftest's LMBatches."""

    def __init__(self, n=32):
        from conftest import LMBatches

        data = LMBatches(n)
        self.batch = data.collate(range(n), pad_to=data.seq_len)


def _trained_gpt2(tmp_path, mb, rows, steps):
    """hf.train of conftest's tiny GPT-2 (no dropout) on ``rows``, micro-batch ``mb`` of 8; the trainer."""
    from conftest import tiny_gpt2

    plan = Plan("fp32", mb, 8)
    args = TrainingArguments(output_dir=str(tmp_path / str(mb)), max_steps=steps, learning_rate=1e-3, logging_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True, seed=0, **hf.training_arguments(plan))
    trainer = Trainer(model=tiny_gpt2(dropout=0.0), args=args, train_dataset=rows, callbacks=[hf.TightfitCallback(plan)])
    hf.train(trainer)
    return trainer


def test_loss_that_uses_the_item_count_keeps_the_trainers_handling(tmp_path):
    """GPT-2's LM loss divides by ``num_items_in_batch`` (the window's target tokens): kept, so padded
    samples of different lengths weigh per token across the window, as in tightfit's own runtime."""
    logged = {}
    for mb in (8, 2):
        trainer = _trained_gpt2(tmp_path, mb, _LMRows(), steps=2)
        assert trainer.model_accepts_loss_kwargs
        logged[mb] = _logged(trainer)
    torch.testing.assert_close(logged[2], logged[8], rtol=1e-4, atol=1e-6)


def test_a_causal_lm_whose_loss_type_names_no_loss_trains_on_its_mean_over_target_tokens(tmp_path):
    """transformers 5.25's Trainer counts GPT-2's labels unshifted (GPT2LMHeadModel's loss_type names
    no causal LM loss) while its loss shifts them: each window's loss came out scaled by targets /
    (targets + rows), 0.85 for these rows. Through hf.train the logged loss and the step are those
    of the model's own mean over its target tokens, as TrainStep takes it, at every split."""
    from conftest import tiny_gpt2

    rows = _LMRows(8)
    assert (rows.batch["labels"] == -100).any()  # rows of different lengths
    with torch.no_grad():
        mean = float(tiny_gpt2(dropout=0.0)(**rows.batch).loss)  # the model's own mean over its target tokens
    for mb in (8, 2):
        logged = _logged(_trained_gpt2(tmp_path, mb, rows, steps=1))
        assert abs(logged[0][0] - mean) < 1e-4 * mean, (mb, logged, mean)


def test_callback_does_not_warn_about_the_oom_redos_own_micro_batch(tmp_path):
    cb = hf.TightfitCallback(Plan("fp32", 8, 8))
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), callback=cb)
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(_OOMAt(lambda calls, rows: rows == 8),
                                                                   with_kwargs=True)
    hf.train(trainer)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 2)
    assert cb.events == [], cb.events
    assert (cb.plan.micro_batch, cb.plan.accumulation_steps) == (4, 2)  # the plan in force after the redo


def test_which_losses_use_the_trainers_item_count():
    from conftest import tiny_gpt2

    class Wrapped(type(tiny_bert())):  # a forward of its own that calls BERT's
        def forward(self, **kw):
            return super().forward(**kw)

    assert hf.loss_uses_item_count(tiny_bert()) is False  # CrossEntropyLoss(), the count dropped
    assert hf.loss_uses_item_count(Wrapped(tiny_bert().config)) is False
    assert hf.loss_uses_item_count(tiny_gpt2()) is True  # self.loss_function(..., **kwargs)
    assert hf.loss_uses_item_count(torch.nn.Linear(2, 2)) is None  # no **kwargs: the Trainer passes nothing


def test_callback_under_a_plain_train_says_the_trainer_scales_the_loss_by_the_accumulation(tmp_path):
    cb = hf.TightfitCallback(Plan("fp32", 4, 8))
    trainer = _trainer(tmp_path, Plan("fp32", 4, 8), steps=1, callback=cb)
    trainer.train()
    assert len(cb.events) == 1 and "2 (gradient_accumulation_steps) times" in cb.events[0], cb.events
    assert "hf.train(trainer)" in cb.events[0]



def test_oom_in_evaluation_is_not_redone_as_a_training_oom(tmp_path):
    """An OOM raised by evaluation inside ``trainer.train()`` was taken for a training OOM: the training
    micro-batch was halved again and again (retrained from checkpoints), ending in a wrong diagnosis with
    ``trainer.args`` changed. It is refused in one line naming evaluation and its batch size; the
    arguments and the callbacks' plan are the user's."""
    plan = Plan("fp32", 8, 8)
    cb = hf.TightfitCallback(plan)
    trainer = _trainer(tmp_path, plan, steps=6, callback=cb, save_strategy="steps", save_steps=1,
                       eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=16, eval_dataset=_Rows(16))
    rows = []

    def evaluation_oom(module, args, kwargs):  # evaluation's batch of 16 does not fit; training's 8 does
        rows.append((module.training, args[0].shape[0] if args else kwargs["hidden_states"].shape[0]))
        if not module.training and rows[-1][1] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected, evaluation)")

    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(evaluation_oom, with_kwargs=True)
    with pytest.raises(TightfitError) as e:
        hf.train(trainer)
    msg = str(e.value)
    assert "out of memory in evaluation" in msg and "per_device_eval_batch_size=16" in msg and "\n" not in msg, msg
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
    assert [r for training, r in rows if training] == [8, 8]  # two steps at the planned batch, never redone
    assert trainer.state.global_step == 2
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (8, 1)
    assert trainer.args.per_device_eval_batch_size == 16
    assert cb.plan is plan and "evaluate" not in vars(trainer)  # nothing of hf.train's left on the trainer


def test_failed_oom_redo_leaves_the_users_arguments(tmp_path):
    """A redo that fails (out of memory down to a per-device batch of 1) leaves ``trainer.args`` and the
    callbacks' plan as the user gave them, not at the last batch tried."""
    plan = Plan("fp32", 4, 4)
    cb = hf.TightfitCallback(plan)
    trainer = _trainer(tmp_path, plan, callback=cb)

    def always_oom(module, args, kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(always_oom, with_kwargs=True)
    with pytest.raises(TightfitError, match="per-device batch of 1"):
        hf.train(trainer)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (4, 1)
    assert trainer._train_batch_size == 4 and cb.plan is plan


@pytest.mark.parametrize("divides", [True, False])
def test_your_compute_loss_that_divides_by_the_item_count_is_left_to_do_so(tmp_path, divides, caplog):
    """transformers' documented custom loss: ``compute_loss(..., num_items_in_batch)`` sums and
    divides by the window's count. hf.train took the count away from it (a TypeError, or a mean
    weighed wrongly on a short last window). One that takes the keyword but returns a mean (the
    Trainer passes the keyword to every override) still needs the Trainer's division."""
    import torch.nn.functional as F

    class Dividing(Trainer):  # tightfit reads the body: one class per kind of loss
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            loss = F.cross_entropy(out.logits, labels, reduction="sum") / num_items_in_batch
            return (loss, out) if return_outputs else loss

    class Mean(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            loss = F.cross_entropy(out.logits, labels)
            return (loss, out) if return_outputs else loss

    Yours = Dividing if divides else Mean

    weights = {}
    for mb in (8, 4):
        plan = Plan("fp32", mb, 8)
        args = TrainingArguments(output_dir=str(tmp_path / str(mb)), num_train_epochs=1, learning_rate=1e-2,
                                 save_strategy="no", report_to=[], disable_tqdm=True, seed=0, optim="sgd",
                                 **hf.training_arguments(plan))
        rows = _Rows(22) if divides else _Rows(16)  # a mean is exact only where micro-batches hold as many
        t = Yours(model=tiny_bert(), args=args, train_dataset=rows, callbacks=[hf.TightfitCallback(plan)])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tightfit"):
            hf.train(t)  # 22 samples: a short last window of 6 (4 + 2 at micro-batch 4)
        weights[mb] = _weights(t)
        # a mean divided by the accumulation steps is one batch only for equal micro-batches: said, as a
        # warning (it was an INFO line claiming one batch of the effective size, seen by a fresh user)
        warned = "only where its micro-batches hold as many labelled items" in caplog.text
        assert warned == (not divides and mb == 4), caplog.text
        assert not warned or "have your compute_loss divide its sum by num_items_in_batch" in caplog.text
    for a, b in zip(weights[4], weights[8]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_oom_inside_the_first_optimizer_step_after_it_wrote_stops_instead_of_redoing(tmp_path):
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), dropout=0.0)
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    real, fired = torch._foreach_sqrt, []

    def sqrt_once(*a, **k):  # AdamW has applied weight decay and moved its moments by now
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        return real(*a, **k)

    torch._foreach_sqrt = sqrt_once
    try:
        with pytest.raises(TightfitError, match="first optimizer step after it had updated"):
            hf.train(trainer)
    finally:
        torch._foreach_sqrt = real
    assert fired


def test_oom_before_the_first_step_redoes_with_a_fresh_optimizer(tmp_path):
    """The Trainer keeps the optimizer it made for its next train(): the redo must not inherit
    what the failed attempt's optimizer holds."""
    from transformers import TrainerCallback

    class OOMBeforeTheFirstUpdate(TrainerCallback):
        failed = None

        def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
            if self.failed is None:
                self.failed = getattr(optimizer, "optimizer", optimizer)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    trainer = _trainer(tmp_path, Plan("fp32", 8, 8))
    cb = OOMBeforeTheFirstUpdate()
    trainer.add_callback(cb)
    hf.train(trainer)
    assert cb.failed is not None and getattr(trainer.optimizer, "optimizer", trainer.optimizer) is not cb.failed
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {3} and trainer.state.global_step == 3


def test_oom_with_drop_last_is_not_redone_on_other_samples(tmp_path):
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8), dataloader_drop_last=True)
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(_OOMAt(lambda calls, rows: rows == 8),
                                                                   with_kwargs=True)
    with pytest.raises(TightfitError, match="dataloader_drop_last=True"):
        hf.train(trainer)
    assert trainer.args.per_device_train_batch_size == 8  # yours, as before the call


def test_oom_under_several_processes_is_not_redone_by_one_process_alone(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, Plan("fp32", 8, 8))
    monkeypatch.setattr(type(trainer.args), "world_size", property(lambda self: 2))  # as under torchrun
    hook = _OOMAt(lambda calls, rows: rows == 8)
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(hook, with_kwargs=True)
    with pytest.raises(TightfitError, match="on one of 2 processes: a redo by this process alone"):
        hf.train(trainer)
    assert hook.fired == 1 and hook.rows.count(4) == 0  # no pass at the smaller batch was run
    assert trainer.args.per_device_train_batch_size == 8


@pytest.mark.parametrize("bad, words", [({"micro_batch": 4}, "plan must be a tightfit.Plan"),
                                        (dict(max_skipped_steps=0), "max_skipped_steps must be >= 1"),
                                        (dict(max_skipped_steps="20"), "max_skipped_steps must be a whole number"),
                                        (dict(warn_temp_c="hot"), "warn_temp_c must be a number")])
def test_the_callback_refuses_bad_arguments_in_one_line(bad, words):
    with pytest.raises(TightfitError, match=words):
        if "micro_batch" in bad:
            hf.TightfitCallback(bad)
        else:
            hf.TightfitCallback(Plan("fp32", 8, 8), **bad)
    with pytest.raises(TightfitError, match="trainer must be a transformers.Trainer"):
        hf.train(object())


def test_an_oom_redo_from_the_start_leaves_batchnorm_statistics_as_a_run_at_the_smaller_batch(tmp_path):
    """hf.train redid the first step at 4 x 4 after an OOM at 8 x 2 with the RNG put back but not
    the buffers: BatchNorm kept the failed attempt's updates (10 batches counted against 8)."""
    from transformers import ResNetConfig, ResNetForImageClassification, Trainer, TrainingArguments

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 16, 16, generator=g), torch.randint(0, 3, (32,), generator=g)
    data = [{"pixel_values": x[i], "labels": int(y[i])} for i in range(32)]

    def run(micro_batch, oom_at=None):
        torch.manual_seed(0)
        model = ResNetForImageClassification(config)
        plan = Plan("fp32", micro_batch, 16, False, device="cpu")
        args = TrainingArguments(**hf.training_arguments(plan, output_dir=str(tmp_path / "out"), max_steps=2,
                                                         report_to=[], save_strategy="no", disable_tqdm=True,
                                                         logging_strategy="no"))
        calls = [0]

        def hook(module, inputs, output):
            calls[0] += 1
            if calls[0] == oom_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        model.resnet.embedder.register_forward_hook(hook)
        hf.train(Trainer(model=model, args=args, train_dataset=data, callbacks=[hf.TightfitCallback(plan)]))
        return model.state_dict()

    ref, redone = run(4), run(8, oom_at=2)  # the OOM in the first step's second micro-batch
    for name in ref:
        torch.testing.assert_close(redone[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_checkpointing_plan_runs_on_a_model_without_hugging_faces_hook_and_keeps_batchnorm(tmp_path):
    """The Trainer checkpoints through the model's Hugging Face hook: a ResNet has none (the
    Trainer raised transformers' ValueError), and where a model with BatchNorm has one its
    recomputation updates the statistics twice. hf.train runs tightfit's block wrappers there."""
    from transformers import ResNetConfig, ResNetForImageClassification, Trainer, TrainingArguments

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 3, (8,), generator=g)
    data = [{"pixel_values": x[i], "labels": int(y[i])} for i in range(8)]

    def run(checkpointing):
        torch.manual_seed(0)
        model = ResNetForImageClassification(config)
        plan = Plan("fp32", 8, 8, checkpointing, device="cpu")
        args = TrainingArguments(**hf.training_arguments(plan, output_dir=str(tmp_path / "out"), max_steps=1,
                                                         report_to=[], save_strategy="no", disable_tqdm=True,
                                                         logging_strategy="no"))
        hf.train(Trainer(model=model, args=args, train_dataset=data, callbacks=[hf.TightfitCallback(plan)]))
        return model.state_dict()

    ref, checkpointed = run(False), run(True)
    for name in ref:
        torch.testing.assert_close(checkpointed[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)


class _ClassifierOnACausalLM(torch.nn.Module):
    """A user's classifier on a causal LM's last hidden state: class-id labels ``[B]``, the loss
    their mean (a module holding a ``...ForCausalLM``, whose token labels hf.train shifts)."""

    def __init__(self):
        from conftest import tiny_gpt2

        super().__init__()
        self.lm = tiny_gpt2(dropout=0.0)
        torch.manual_seed(1)
        self.head = torch.nn.Linear(self.lm.config.n_embd, 2)

    def forward(self, input_ids, attention_mask, labels=None):
        h = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states[-1]
        logits = self.head(h[:, 0])
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


def test_class_labels_of_a_model_holding_a_causal_lm_are_not_shifted(tmp_path):
    """Found by a review: the labelled items of each micro-batch were counted from the second
    sample on for any model holding a causal LM, class ids too: a window of 10 as 4+4+2 weighed
    its micro-batches 3:3:1, and at micro-batch 1 every step counted 0 items (NaN, skipped)."""

    def run(n, mb, effective, steps):
        rows = _Rows(n)
        plan = Plan("fp32", mb, effective)
        args = TrainingArguments(output_dir=str(tmp_path / f"{mb}"), max_steps=steps, learning_rate=1e-2,
                                 logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                                 optim="sgd", **hf.training_arguments(plan))
        cb = hf.TightfitCallback(plan)
        trainer = Trainer(model=_ClassifierOnACausalLM(), args=args, train_dataset=rows, callbacks=[cb])
        hf.train(trainer)
        return _logged(trainer), cb.skipped_steps

    whole, _ = run(10, 10, 10, 1)
    split, _ = run(10, 4, 12, 1)  # the Trainer's window of 12 holds the 10 rows as 4+4+2
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)
    logged, skipped = run(8, 1, 8, 2)
    assert skipped == 0 and all(torch.isfinite(torch.tensor(x)).all() for x in logged), logged


def test_a_label_smoothed_causal_lm_trains_on_its_mean_over_target_tokens(tmp_path):
    """Found by a review: with label smoothing the Trainer's count of GPT-2's labels, unshifted,
    was left as it was (scaling the loss by targets / (targets + rows)) at every split."""
    from conftest import tiny_gpt2
    from transformers.trainer_pt_utils import LabelSmoother

    rows = _LMRows(8)
    with torch.no_grad():
        out = tiny_gpt2(dropout=0.0)(input_ids=rows.batch["input_ids"], attention_mask=rows.batch["attention_mask"])
        mean = float(LabelSmoother(0.1)(out, rows.batch["labels"], shift_labels=True))  # over the target tokens
    for mb in (8, 2):
        plan = Plan("fp32", mb, 8)
        args = TrainingArguments(output_dir=str(tmp_path / str(mb)), max_steps=1, learning_rate=1e-3, logging_steps=1,
                                 save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                                 label_smoothing_factor=0.1, **hf.training_arguments(plan))
        trainer = Trainer(model=tiny_gpt2(dropout=0.0), args=args, train_dataset=rows,
                          callbacks=[hf.TightfitCallback(plan)])
        hf.train(trainer)
        logged = _logged(trainer)
        assert abs(logged[0][0] - mean) < 1e-4 * mean, (mb, logged, mean)


@pytest.mark.parametrize("policies", [("offload", "offload"), ("selective", "none")])
def test_a_plans_per_block_policies_run_under_hf_train_and_a_plain_train_is_told(tmp_path, policies):
    """Found by a review: a plan offloading (or selectively recomputing) its blocks' activations
    trained with none of it under hf.train (the Trainer's flag off, its hook unable to), without
    a word; Lightning's callback applies them."""
    from tightfit.levers.blocks import block_policy, find_blocks
    from tightfit.plan import plan_with_blocks

    plan = plan_with_blocks("fp32", 4, 8, (), 2, block_policies=policies, device="cpu")
    trainer = _trainer(tmp_path / "hf", plan, steps=1)
    hf.train(trainer)
    assert [block_policy(b) for b in find_blocks(trainer.model)] == list(policies)
    cb = hf.TightfitCallback(plan)
    _trainer(tmp_path / "plain", plan, steps=1, callback=cb).train()
    assert any("run only under hf.train(trainer)" in e for e in cb.events), cb.events


def test_a_lora_plan_for_a_model_without_adapters_is_refused_and_a_plain_train_is_told(tmp_path):
    """Found by a review: a LoRA (or freezing) plan trained a model without adapters whole under
    the Trainer, with the gradients and state the plan left out, without a word."""
    plan = Plan("fp32", 4, 8, trainable="lora", device="cpu")
    with pytest.raises(TightfitError, match=r"^hf.train\(trainer\): the plan trains LoRA adapters"):
        hf.train(_trainer(tmp_path / "hf", plan, steps=1))
    cb = hf.TightfitCallback(plan)
    _trainer(tmp_path / "plain", plan, steps=1, callback=cb).train()
    assert any("the plan trains LoRA adapters" in e for e in cb.events), cb.events


def test_a_several_process_plan_is_compared_per_process_and_fsdp_is_noted(caplog):
    """Found by a review: a plan for 2 processes (16 = 2 x 4 x 2) was noted as 'the Trainer's
    effective batch is 4 x 2 = 8 (the plan's: 16)'; an FSDP2 plan became DDP without a word."""
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        hf.training_arguments(Plan("bf16", 4, 16, world_size=2, sharding="ddp", device="cuda"), output_dir="x")
    assert "effective batch" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="tightfit"):  # 10 samples a step for 9 (a review of the change)
        hf.training_arguments(Plan("bf16", 5, 9, world_size=2, sharding="ddp", device="cuda"), output_dir="x")
    assert "effective batch is 5 x 1 x 2 processes = 10 samples (the plan's: 9)" in caplog.text
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        hf.training_arguments(Plan("bf16", 4, 16, world_size=2, sharding="fsdp", device="cuda"), output_dir="x")
    assert "shards the model with FSDP2 over 2 processes" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tightfit"):
        hf.training_arguments(Plan("bf16", 4, 16, world_size=2, sharding="fsdp", device="cuda"), output_dir="x",
                              fsdp="full_shard")
    assert "FSDP2" not in caplog.text


def test_a_plain_train_of_a_causal_lm_the_trainer_counts_unshifted_is_told(tmp_path):
    """Found by a fresh user: the README says the callback warns under a plain trainer.train(),
    but GPT-2's loss, scaled there by targets / (targets + rows), came without a word."""
    from conftest import tiny_gpt2

    plan = Plan("fp32", 2, 8)
    args = TrainingArguments(output_dir=str(tmp_path / "lm"), max_steps=1, learning_rate=1e-3, logging_steps=1,
                             save_strategy="no", report_to=[], disable_tqdm=True, seed=0, **hf.training_arguments(plan))
    cb = hf.TightfitCallback(plan)
    Trainer(model=tiny_gpt2(dropout=0.0), args=args, train_dataset=_LMRows(8), callbacks=[cb]).train()
    assert any("counts GPT2LMHeadModel's labels unshifted" in e for e in cb.events), cb.events
    classifier = hf.TightfitCallback(Plan("fp32", 2, 8))
    _trainer(tmp_path / "cls", Plan("fp32", 2, 8), steps=1, callback=classifier).train()
    assert not any("unshifted" in e for e in classifier.events), classifier.events
