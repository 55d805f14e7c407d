"""Runtime faults a careful user found, each kept as a test that fails when the fault comes back:
train mode in every training step, no stray gradients, the user's KV-cache setting restored,
an all-or-nothing optimizer step under OOM, resume after an OOM back-off, honest split reports,
and stops (signal, non-finite run) that leave a resumable checkpoint."""

import math
import os
import signal

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import SyntheticBatches, assert_same_params, params_of, tiny_bert
from tightfit.plan import Plan
from tightfit.runtime.checkpoint import list_checkpoints, load_checkpoint
from tightfit.runtime.trainer import (NonFiniteTrainingError, PartialUpdateError, TrainConfig, Trainer,
                                      TrainingInterrupted, describe_split)
from tightfit.workload import Workload


def _workload(n=24, effective_batch=8, dropout=0.1, seed=0):
    return Workload(tiny_bert(dropout, seed), SyntheticBatches(n), SyntheticBatches(8, seed=1), effective_batch)



def test_every_training_step_runs_in_train_mode_and_evaluation_in_eval_mode():
    w = _workload()
    w.model.eval()  # as Hugging Face's from_pretrained returns it
    seen = []  # (grad enabled, dropout module in training mode)
    for m in w.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: seen.append((torch.is_grad_enabled(), mod.training)))
    Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False).fit()
    train_calls = [t for g, t in seen if g]
    eval_calls = [t for g, t in seen if not g]
    assert train_calls and all(train_calls), "a training step ran with dropout off"
    assert eval_calls and not any(eval_calls), "evaluation ran with dropout on"
    assert not any(m.training for m in w.model.modules())  # the caller's mode is given back


def test_a_module_switched_to_eval_between_steps_is_put_back_in_train_mode():
    # fit() checks the modules it listed instead of walking the module tree at each step; a
    # module flipped between steps (here by the metrics callback) must still train with dropout on.
    w = _workload()
    head = w.model.dropout  # the classifier's dropout, run in every forward
    seen = []  # its mode in every training forward
    head.register_forward_pre_hook(lambda mod, args: seen.append(mod.training) if torch.is_grad_enabled() else None)

    def log(record):
        if record["type"] == "train":
            head.training = False  # a plain attribute write, as Module.eval() does module by module

    Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, log_every=1), log=log, progress=False).fit()
    assert seen == [True] * 6  # 3 steps of 2 micro-batches
    assert w.model.training and not head.training  # the modes the caller (and callback) left come back


def test_a_model_in_train_mode_is_evaluated_with_dropout_off_and_given_train_mode_back():
    # The mirror of the test above for a model made in train mode (a user's own, a built-in one): the
    # caller's mode is train mode, so evaluation must switch to eval mode itself, not run as it finds it.
    w = _workload()  # dropout 0.1
    assert all(m.training for m in w.model.modules())
    seen = []  # dropout's mode in every forward without grad (the evaluation's)
    for m in w.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: None if torch.is_grad_enabled() else seen.append(mod.training))
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False)
    first = t.fit().eval
    assert seen and not any(seen), "evaluation ran with dropout on"
    assert all(m.training for m in w.model.modules())  # the caller's train mode is given back
    torch.manual_seed(1)  # other dropout draws, were dropout on: the same evaluation regardless
    again = t.evaluate()
    assert again["loss"] == first["loss"] and again["accuracy"] == first["accuracy"]
    assert all(m.training for m in w.model.modules())


def test_dropout_is_active_so_seeds_change_the_losses():
    losses = []
    for seed in (0, 1):
        w = _workload()
        w.model.eval()
        t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, seed=0), progress=False)
        torch.manual_seed(seed)  # the data order is fixed; only dropout draws differ
        losses.append(t.train_step(list(range(8)))[0])
    assert losses[0] != losses[1]


def test_gradients_left_on_the_model_do_not_leak_into_the_first_step():
    clean, dirty = _workload(dropout=0.0), _workload(dropout=0.0)
    batch = dirty.train.collate(list(range(8)))
    dirty.model(**{k: v for k, v in batch.items() if k != "labels"}).logits.sum().backward()  # a stray backward
    results = []
    for w in (clean, dirty):
        t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)
        t.train_step(list(range(8)))
        results.append(params_of(w.model))
    assert_same_params(*results)


def test_use_cache_is_restored_after_training_with_checkpointing():
    w = _workload()
    assert w.model.config.use_cache is True
    t = Trainer(w, Plan("fp32", 4, 8, activation_checkpointing=True), TrainConfig(epochs=1), progress=False)
    assert w.model.config.use_cache is False  # off while training with recomputation
    t.fit()
    assert w.model.config.use_cache is True


def test_metrics_say_how_a_window_was_really_split():
    assert describe_split(7, 3) == "3+3+1"
    assert describe_split(8, 4) == "4 x 2"
    records = []
    w = _workload(n=7, effective_batch=7)
    Trainer(w, Plan("fp32", 3, 7), TrainConfig(epochs=1, log_every=1), log=records.append, progress=False).fit()
    (rec,) = [r for r in records if r["type"] == "train"]
    assert rec["micro_batches"] == "3+3+1" and rec["accumulation_steps"] == 3 and rec["window_samples"] == 7


class _OOMOnCall(TorchDispatchMode):
    """Raise a CUDA-style OOM at the ``n``-th call of an aten op whose name contains ``op``
    (ops run under the mode skip some version-counter bumps: use it only before any write)."""

    def __init__(self, op, n):
        super().__init__()
        self.op, self.n, self.calls = op, n, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.op in str(func):
            self.calls += 1
            if self.calls == self.n:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return func(*args, **(kwargs or {}))


def _inject_in_optimizer_step(trainer, op, n):
    """Run the trainer's first optimizer step under :class:`_OOMOnCall`."""
    step, state = trainer.optimizer.step, {"done": False}

    def wrapped(*args, **kwargs):
        if state["done"]:
            return step(*args, **kwargs)
        state["done"] = True
        with _OOMOnCall(op, n):
            return step(*args, **kwargs)

    trainer.optimizer.step = wrapped


@pytest.mark.parametrize("foreach", [True, False])
def test_oom_part_way_through_a_non_fused_optimizer_step_is_never_applied_twice(monkeypatch, foreach):
    w = _workload(dropout=0.0)
    t = Trainer(w, Plan("fp32", 8, 8, optimizer="adamw-foreach"), TrainConfig(epochs=1, lr=1e-3), progress=False)
    for g in t.optimizer.param_groups:
        g["foreach"] = foreach  # False: the per-parameter (for-loop) implementation
    t.train_step(list(range(8)))  # the state exists: the next step's failure comes after writes
    calls = []

    def failing(real):  # the square root of exp_avg_sq comes after step, exp_avg and exp_avg_sq are written
        def sqrt(*args, **kwargs):
            calls.append(1)
            if len(calls) == 3 or foreach:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
            return real(*args, **kwargs)
        return sqrt

    if foreach:
        monkeypatch.setattr(torch, "_foreach_sqrt", failing(torch._foreach_sqrt))
    else:
        monkeypatch.setattr(torch.Tensor, "sqrt", failing(torch.Tensor.sqrt))
    with pytest.raises(PartialUpdateError, match="part"):
        t.train_step(list(range(8, 16)))
    assert calls and max(float(s["step"]) for s in t.optimizer.state.values()) <= 2.0  # none stepped twice


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_oom_while_fused_adamw_allocates_its_state_redoes_the_step_exactly():
    ref = _workload()
    t_ref = Trainer(ref, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, grow_back_after=0), progress=False)
    torch.manual_seed(11)
    t_ref.fit()

    w = _workload()
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, grow_back_after=0), progress=False)
    _inject_in_optimizer_step(t, "zeros_like", 7)  # part of the state allocated, nothing updated yet
    torch.manual_seed(11)
    res = t.fit()
    assert res.oom_recoveries == 1 and t.micro_batch == 4
    assert {float(s["step"]) for s in t.optimizer.state.values()} == {3.0}
    assert_same_params(params_of(w.model), params_of(ref.model))


def _oom_once_in_the_first_step(trainer):
    """Raise one CUDA-style OOM in the first step's forward at micro-batch 8 (the trainer backs off to 4)."""
    fired = []

    def inject(*a):
        if trainer.step == 0 and trainer.micro_batch == 8 and not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    trainer.model.bert.encoder.layer[1].register_forward_pre_hook(inject)


def test_an_oom_in_an_epochs_short_last_window_is_redone_with_a_smaller_pass():
    """The last window of 3 samples ran as one pass of 3 at micro-batch 8 and ran out of memory; the
    redo halved the micro-batch to 4, balanced it to 3 and ran the same pass of 3 again: a second
    OOM, counted as a second recovery, and the micro-batch went down to 1 for the rest of the run.
    The redo now runs at most half of the pass that failed (2 + 1)."""
    from tightfit.plan import halved_micro_batch

    assert halved_micro_batch(3, 8) == 2 and halved_micro_batch(4, 8) == 2 and halved_micro_batch(2, 8) == 1
    t = Trainer(_workload(n=11), Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)

    def inject(module, args):  # the last window's step runs out of memory with 3 samples in a pass
        if t.step == 1 and args[0].shape[0] >= 3:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    t.model.bert.encoder.layer[0].register_forward_pre_hook(inject)
    result = t.fit()
    assert result.oom_recoveries == 1 and t.micro_batch == 2 and result.steps == 2
    assert "redoing step 2 with micro-batch 2: 3 samples as 2+1" in result.events[0]


def test_an_oom_in_a_window_given_to_train_step_halves_that_windows_pass():
    """Found by a review: Trainer.train_step(window) halved the micro-batch for the run's window at
    that step (8 samples: 4), not the window given (3 samples at 4: the same pass, out of memory again)."""
    t = Trainer(_workload(n=16), Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)
    fired = []

    def inject(module, args):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    t.model.bert.encoder.layer[0].register_forward_pre_hook(inject)
    t.train_step([0, 1, 2])
    assert t.micro_batch == 2 and "3 samples as 2+1" in t.result.events[0], t.result.events


def test_resume_after_an_oom_back_off_grows_back_like_the_uninterrupted_run(tmp_path):
    def run(folder, resume_from=None):
        w = _workload(n=48)
        cfg = TrainConfig(epochs=1, lr=1e-3, seed=3, grow_back_after=2, checkpoint_dir=str(folder),
                          checkpoint_every=1, keep_last=10)
        plan = Plan("fp32", 8, 8)
        if resume_from is not None:  # the plan the checkpoint carries, as `--resume` takes it
            plan = Plan.from_dict(load_checkpoint(resume_from, w.model)["plan"])
        t = Trainer(w, plan, cfg, progress=False)
        if resume_from is None:
            _oom_once_in_the_first_step(t)
            torch.manual_seed(11)
        else:
            t.resume(resume_from)  # restores the RNG states too
        t.fit()
        return t

    full = run(tmp_path / "full")
    assert any("growing micro-batch back 4 -> 8" in e for e in full.result.events)
    resumed = run(tmp_path / "resumed", resume_from=tmp_path / "full" / "ckpt-1")  # at micro-batch 4
    assert any("growing micro-batch back 4 -> 8" in e for e in resumed.result.events)
    assert resumed.micro_batch == full.micro_batch == 8
    assert_same_params(params_of(resumed.model), params_of(full.model))


def test_a_run_of_nonfinite_steps_stops_with_a_resumable_checkpoint(tmp_path):
    w = _workload(n=32, dropout=0.0)
    w.model.bert.encoder.layer[1].output.dense.register_forward_hook(lambda m, i, out: out * math.inf)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=2, lr=1e-3, max_skipped_steps=3,
                                                 checkpoint_dir=str(tmp_path)), progress=False)
    with pytest.raises(NonFiniteTrainingError, match=r"layer\.1\.output\.dense.*lower --lr") as e:
        t.fit()
    assert e.value.step == 3 and e.value.checkpoint == str(tmp_path / "ckpt-3")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-3"]
    state = load_checkpoint(tmp_path / "ckpt-3", _workload(n=32).model)
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3  # data position and schedule agree


def test_sigint_stops_at_a_step_boundary_with_a_checkpoint_that_resumes_exactly(tmp_path):
    def trainer(folder):
        w = _workload(n=48)
        return Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, checkpoint_dir=str(folder),
                                                          checkpoint_every=100), progress=False)

    torch.manual_seed(11)
    full = trainer(tmp_path / "full")
    full.fit()

    torch.manual_seed(11)
    stopped = trainer(tmp_path / "stopped")
    calls = []

    def ctrl_c(*a):  # Ctrl-C in the middle of the third step's forward
        calls.append(1)
        if stopped.step == 2 and len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
    stopped.model.bert.encoder.layer[0].register_forward_pre_hook(ctrl_c)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(TrainingInterrupted, match="SIGINT: stopped after step 3") as e:
        stopped.fit()
    assert signal.getsignal(signal.SIGINT) is handler  # the caller's handler is back
    assert e.value.checkpoint == str(tmp_path / "stopped" / "ckpt-3")

    resumed = trainer(tmp_path / "stopped")
    resumed.resume(e.value.checkpoint)
    resumed.fit()
    assert_same_params(params_of(resumed.model), params_of(full.model))


def test_a_sigint_the_process_ignores_stays_ignored_during_training(tmp_path):
    """A shell starts a background job (``cmd &``) with SIGINT ignored; Python then leaves it so,
    and tightfit's evaluation did, but its training loop put its own handler in: a SIGINT meant
    for the foreground stopped the training of a background run, not its evaluation. Now both
    leave an ignored signal ignored: the run finishes, and the ignore is in force after."""
    t = Trainer(_workload(n=24), Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3), progress=False)
    calls = []

    def ctrl_c(*a):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
    t.model.bert.encoder.layer[0].register_forward_pre_hook(ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        r = t.fit()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert r.steps == 3 and r.eval is not None and not any(e.startswith("SIGINT") for e in r.events)


def test_a_resumed_run_counts_the_samples_of_its_earlier_sessions(tmp_path):
    """The resumed run's samples (summary, metrics lines) go on from the checkpoint's count, as
    the uninterrupted run's do, and its last logged step and final loss are those of the
    uninterrupted run; a total of steps that is no multiple of log_every still logs the last step."""
    def trainer(folder, log):
        return Trainer(_workload(n=40), Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, log_every=2,
                                                                       checkpoint_dir=str(folder)),
                       log=log, progress=False)

    torch.manual_seed(11)
    full_records = []
    full = trainer(tmp_path / "full", full_records.append).fit()
    torch.manual_seed(11)
    stopped, calls = trainer(tmp_path / "stopped", lambda record: None), []

    def ctrl_c(*a):  # in the third step's forward: stops after it, with ckpt-3
        calls.append(1)
        if stopped.step == 2 and len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
    stopped.model.bert.encoder.layer[0].register_forward_pre_hook(ctrl_c)
    with pytest.raises(TrainingInterrupted) as e:
        stopped.fit()
    resumed_records = []
    resumed = trainer(tmp_path / "stopped", resumed_records.append)
    resumed.resume(e.value.checkpoint)
    r = resumed.fit()
    steps = [(x["step"], x["samples"], x["loss"]) for x in full_records if x["type"] == "train"]
    assert [s for s, _, _ in steps] == [2, 4, 5]  # 5 steps, logged every 2: the last one too
    assert [(x["step"], x["samples"], x["loss"]) for x in resumed_records if x["type"] == "train"] == steps[1:]
    assert r.samples == full.samples == 40 and math.isfinite(full.final_loss)
    assert full.final_loss == steps[-1][2] and r.final_loss == full.final_loss


def test_a_second_sigint_interrupts_at_once_and_a_second_sigterm_does_not(tmp_path):
    """Ctrl-C twice stops at once (KeyboardInterrupt, no step boundary waited for); a repeated
    SIGTERM (a supervisor and its child both passing it on) is the same request again."""
    for sig, raised in ((signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, TrainingInterrupted)):
        t = Trainer(_workload(n=24), Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3), progress=False)
        calls = []

        def twice(*a, t=t, sig=sig):
            calls.append(1)
            if t.step == 1 and len(calls) == 3:
                os.kill(os.getpid(), sig)
                os.kill(os.getpid(), sig)
        t.model.bert.encoder.layer[0].register_forward_pre_hook(twice)
        with pytest.raises(raised):
            t.fit()
        assert t.step == (1 if raised is KeyboardInterrupt else 2)


def test_ctrl_c_in_the_last_step_stops_before_the_final_evaluation(tmp_path):
    """A Ctrl-C during the last training step was acknowledged ("stopping after the current step")
    and then ignored: the final evaluation ran and the run exited as finished. It now stops after
    that step with its checkpoint, as at any other step; the resume evaluates and finishes."""
    def trainer():
        return Trainer(_workload(n=24), Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3,
                                                                       checkpoint_dir=str(tmp_path)), progress=False)

    stopped, calls = trainer(), []

    def ctrl_c(*a):  # in the middle of the last (third) step's forward
        calls.append(1)
        if stopped.step == 2 and len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
    stopped.model.bert.encoder.layer[0].register_forward_pre_hook(ctrl_c)
    with pytest.raises(TrainingInterrupted, match="SIGINT: stopped after step 3 of 3") as e:
        stopped.fit()
    assert stopped.result.eval is None and e.value.checkpoint == str(tmp_path / "ckpt-3")
    resumed = trainer()
    resumed.resume(e.value.checkpoint)
    assert resumed.fit().eval["samples"] == 8


def test_resume_with_a_new_learning_rate_rescales_the_schedule_from_the_checkpoint(tmp_path):
    cfg = dict(epochs=1, lr=1e-3, seed=3, checkpoint_dir=str(tmp_path), checkpoint_every=2, keep_last=10)
    t = Trainer(_workload(n=48), Plan("fp32", 4, 8), TrainConfig(**cfg), progress=False)
    t.fit()
    lrs = {}
    for lr in (1e-3, 2.5e-4):
        r = Trainer(_workload(n=48), Plan("fp32", 4, 8), TrainConfig(**{**cfg, "lr": lr}), progress=False)
        r.resume(tmp_path / "ckpt-2")
        lrs[lr] = r.optimizer.param_groups[0]["lr"]
        assert r.scheduler.get_last_lr() == [lrs[lr]] and r.scheduler.base_lrs == [lr]
    assert lrs[2.5e-4] == pytest.approx(lrs[1e-3] / 4) and lrs[1e-3] > 0


def test_a_non_finite_gradient_with_a_finite_forward_is_named_and_a_new_lr_starts_a_fresh_count(tmp_path):
    w = _workload(n=32, dropout=0.0)
    w.model.classifier.weight.register_hook(lambda g: g * math.nan)  # fp32: no loss scaling involved
    cfg = dict(epochs=2, lr=1e-3, max_skipped_steps=2, checkpoint_dir=str(tmp_path))
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(**cfg), progress=False)
    with pytest.raises(NonFiniteTrainingError, match=r"the gradient of 'classifier\.weight'") as e:
        t.fit()
    assert "loss-scaled" not in str(e.value)
    r = Trainer(_workload(n=32, dropout=0.0), Plan("fp32", 8, 8), TrainConfig(**{**cfg, "lr": 1e-4}), progress=False)
    r.resume(e.value.checkpoint)
    assert r._skipped_in_row == 0  # the old learning rate's run of skipped steps does not carry over


@pytest.mark.parametrize("where", ["forward", "gradient"])
def test_a_stop_on_non_finite_steps_gives_every_module_its_own_mode_back(where):
    """The stop's diagnosis (which module first gives inf/NaN) ran the model in eval mode and then
    called model.train(), which put every module in the root's mode: a part the caller had left in
    eval mode inside a model in train mode (a frozen backbone, frozen-N's BatchNorm layers) came
    back in train mode, and a later run updated its running statistics. Every module now gets its
    own mode back."""
    w = _workload(n=32, dropout=0.1)
    if where == "forward":
        w.model.bert.encoder.layer[1].output.dense.register_forward_hook(lambda m, i, out: out * math.inf)
    else:
        w.model.classifier.weight.register_hook(lambda g: g * math.nan)
    w.model.train()
    w.model.bert.embeddings.eval()  # kept frozen in eval mode by its owner
    modes = {n: m.training for n, m in w.model.named_modules()}
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=2, lr=1e-3, max_skipped_steps=2), progress=False)
    with pytest.raises(NonFiniteTrainingError):
        t.fit()
    assert {n: m.training for n, m in w.model.named_modules()} == modes


def test_the_record_of_a_step_gives_the_micro_batch_it_ran_with_even_when_it_grows_back():
    records = []
    w = _workload(n=48)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3, grow_back_after=2, log_every=1),
                log=records.append, progress=False)
    _oom_once_in_the_first_step(t)
    t.fit()
    steps = {r["step"]: r["micro_batch"] for r in records if r["type"] == "train"}
    # steps 1 and 2 run at 4; the micro-batch grows back after step 2, so step 3 runs at 8
    assert [steps[s] for s in (1, 2, 3)] == [4, 4, 8]


def test_metrics_cut_back_to_a_checkpoint_drop_later_steps_and_the_evaluation_after_it(tmp_path):
    import json
    from tightfit.report.metrics import keep_metrics_until
    path = tmp_path / "metrics.jsonl"
    records = [{"type": "plan", "step": 0}, {"type": "train", "step": 5}, {"type": "checkpoint", "step": 6},
               {"type": "train", "step": 6}, {"type": "eval", "step": 6}, {"type": "train", "step": 7}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"type": "train", "st')  # a cut last line
    keep_metrics_until(path, 6)
    kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert kept == records[:4]


def test_a_resume_drops_the_events_after_its_checkpoint_but_keeps_how_the_session_ended(tmp_path):
    """An out-of-memory back-off in step 7, after the checkpoint of step 6, happens again when the
    run resumes from that checkpoint: kept, it was listed twice in the report's events against one
    recovery counted. How the stopped session ended (a signal) stays; events before the
    checkpoint's record stay, also those logged at its step."""
    import json
    from tightfit.report.metrics import earlier_events, keep_metrics_until
    path = tmp_path / "metrics.jsonl"
    records = [{"type": "event", "step": 6, "message": "grew back"}, {"type": "checkpoint", "step": 6},
               {"type": "event", "step": 6, "message": "out of memory, redoing step 7"},
               {"type": "train", "step": 7},
               {"type": "event", "step": 8, "message": "SIGTERM: stopped after step 8", "session": True},
               {"type": "event", "step": 8, "message": "out of memory in evaluation"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    keep_metrics_until(path, 6)
    assert earlier_events(path) == ["grew back", "SIGTERM: stopped after step 8"]
    # without the checkpoint's record (a file of another writer): the events of steps up to it
    path.write_text("".join(json.dumps(r) + "\n" for r in records if r["type"] != "checkpoint"))
    keep_metrics_until(path, 6)
    assert earlier_events(path) == ["grew back", "out of memory, redoing step 7", "SIGTERM: stopped after step 8"]
    # a file written before the flag: a resume's and a stop's words say what they are
    old = [{"type": "checkpoint", "step": 6}, {"type": "event", "step": 6, "message": "resumed from ckpt-4 at step 4"},
           {"type": "event", "step": 7, "message": "SIGTERM received: stopping after the current step"},
           {"type": "event", "step": 7, "message": "SIGTERM: stopped after step 7, checkpoint ckpt-7"},
           {"type": "event", "step": 7, "message": "out of memory, redoing step 8"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    keep_metrics_until(path, 6)
    assert earlier_events(path) == [r["message"] for r in old[1:4]]


def test_an_out_of_memory_back_off_after_the_checkpoint_is_listed_once_after_a_resume(tmp_path, monkeypatch):
    """End to end (the run of a careful user): an OOM in step 6, past the checkpoint of step 4,
    then a resume from that checkpoint, which meets the same OOM again: one back-off is listed in
    the report, as the summary counts one (it listed two)."""
    import json
    import shutil

    import tightfit.runtime.trainer as trainer_module
    import tightfit.tasks as tasks
    from conftest import tiny_cpu_job
    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    launch, sums, at = trainer_module.Trainer._launch_step, tasks.classification_loss_sum, {"step": None}

    def tracking(self, window, index):
        at["step"] = index
        return launch(self, window, index)

    def oom_in_step_6_at_8(model, batch):
        if at["step"] == 5 and batch["labels"].numel() == 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return sums(model, batch)

    monkeypatch.setattr(trainer_module.Trainer, "_launch_step", tracking)
    monkeypatch.setattr(tasks, "classification_loss_sum", oom_in_step_6_at_8)
    run = tmp_path / "run"
    assert main(["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "8",
                 "--checkpoint-every", "4", "--keep-last", "5", "--seq-len", "16", "--device", "cpu",
                 "--out", str(run), "--no-progress"]) == 0
    shutil.rmtree(run / "checkpoints" / "ckpt-8")  # as if killed after step 6
    assert main(["train", "--resume", str(run / "checkpoints" / "ckpt-4"), "--no-progress"]) == 0
    report = (run / "report.md").read_text()
    assert report.count("- out of memory (OutOfMemoryError) at micro-batch 8: redoing step 6") == 1, report
    assert json.loads((run / "summary.json").read_text())["oom_recoveries"] == 1


@pytest.mark.parametrize("log_every", [1, 3])  # 3: the steps between records are queued ahead
def test_each_metrics_record_gives_the_learning_rate_its_step_ran_with(log_every):
    records, used = [], []
    w = _workload(n=48, effective_batch=4)
    t = Trainer(w, Plan("fp32", 4, 4), TrainConfig(epochs=1, lr=1e-3, warmup_ratio=0.25, log_every=log_every),
                log=records.append, progress=False)
    step = t.optimizer.step

    def recorded_step(*a, **k):
        used.append(t.optimizer.param_groups[0]["lr"])
        return step(*a, **k)

    t.optimizer.step = recorded_step
    t.fit()
    logged = {r["step"]: r["lr"] for r in records if r["type"] == "train"}
    assert len(used) == 12 and len(logged) == (12 if log_every == 1 else 4)
    assert used[0] < used[2] == pytest.approx(1e-3) and used[-1] < used[-2]  # warm-up, then decay
    for s, lr in logged.items():
        assert lr == pytest.approx(used[s - 1], rel=1e-12), s


def test_the_schedule_advances_once_per_optimizer_step_not_per_micro_batch():
    # 48 samples, effective batch 8 as 4 micro-batches of 2: 6 optimizer steps, 24 micro-batches. The
    # schedule (10% warm-up floored to 1 step, then linear decay to 0) moves once per window: a
    # schedule stepped per micro-batch would reach 0 after the second step.
    used = []
    w = _workload(n=48, effective_batch=8)
    t = Trainer(w, Plan("fp32", 2, 8), TrainConfig(epochs=1, lr=1e-3, warmup_ratio=0.25), progress=False)
    t.optimizer.register_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    forwards = []
    w.model.bert.embeddings.register_forward_pre_hook(lambda m, a: forwards.append(1) if torch.is_grad_enabled() else None)
    t.fit()
    assert len(forwards) == 24 and t.step == 6 and t.scheduler.last_epoch == 6
    # warm-up of int(0.25 * 6) = 1 step: lambda(0) = 1, then (6 - s) / 5
    assert used == pytest.approx([1e-3, 1e-3, 0.8e-3, 0.6e-3, 0.4e-3, 0.2e-3], rel=1e-9)


def test_a_signal_during_a_checkpoint_write_is_announced_in_the_events(tmp_path):
    """SIGINT during step 2's checkpoint stopped the run after step 2, but its note ("SIGINT
    received: ...") was logged only at a next step's end, which never came."""
    t = Trainer(_workload(n=48), Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3,
                checkpoint_dir=str(tmp_path), checkpoint_every=2), progress=False)
    save = t.save_checkpoint

    def save_then_ctrl_c(*a, **k):
        where = save(*a, **k)
        os.kill(os.getpid(), signal.SIGINT)
        return where
    t.save_checkpoint = save_then_ctrl_c
    with pytest.raises(TrainingInterrupted, match="SIGINT: stopped after step 2"):
        t.fit()
    said = [e for e in t.result.events if e.startswith("SIGINT")]
    assert said[0].startswith("SIGINT received: stopping after the current step") and \
        said[1].startswith("SIGINT: stopped after step 2"), said


def test_the_evaluations_sample_count_is_what_its_accuracy_divides_by():
    """Held-out samples labelled -100 are left out of the accuracy and loss; the evaluation's
    ``samples`` (metrics.jsonl, summary.json, "held-out accuracy ... on N samples") still gave all
    of them, so the accuracy read as over 10 samples was over 5."""
    from tightfit.report.summary import RunInfo, summary_rows

    held_out = SyntheticBatches(10, seed=1)
    held_out.labels[::2] = -100
    w = Workload(tiny_bert(0.0, 0), SyntheticBatches(16), held_out, 8)
    result = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1), progress=False).fit()
    assert result.eval["samples"] == 5 and result.eval["held_out"] == 10
    assert result.eval["accuracy"] * 5 == pytest.approx(round(result.eval["accuracy"] * 5))
    info = RunInfo("m", "d", 16, 10, ["a", "b"], 0.5, "CPU", None, "2", "0", "tightfit train")
    row = dict(summary_rows(result, info))["held-out accuracy"]
    assert "on the 5 labelled of 10 samples" in row, row


def test_a_model_no_better_than_the_majority_class_is_said_so():
    """A short trial (the README's --train-samples 1000 --epochs 1 on the default job) can end at the
    majority class's accuracy, printed beside it without a word: a new user took the tool for broken.
    The summary says what it means; a model above it gets no such note."""
    from types import SimpleNamespace

    from tightfit.report.summary import RunInfo, summary_rows

    info = RunInfo("m", "d", 16, 10, ["a", "b"], 0.5777, "CPU", None, "2", "0", "tightfit train")

    def rows(accuracy, loss=0.69):
        result = SimpleNamespace(eval={"accuracy": accuracy, "loss": loss, "samples": 10}, steps=1, samples=8,
                                 train_seconds=1.0, samples_per_s=8.0, final_loss=0.7, peak_reserved_bytes=None,
                                 skipped_steps=0, oom_recoveries=0, plan=Plan("fp32", 8, 8))
        return dict(summary_rows(result, info))

    assert "no better than always answering the most common class" in rows(0.5777).get("note", "")
    assert "note" not in rows(0.8119)
    # diverged weights (NaN logits, every answer class 0): not "train more", and the accuracy disowned
    diverged = rows(0.6250, math.nan)["note"]
    assert "not finite" in diverged and "lower --lr" in diverged and "train on more" not in diverged


def test_the_loss_plot_leaves_out_non_finite_held_out_losses(tmp_path, monkeypatch):
    """metrics.jsonl writes a NaN loss as the string "nan"; the held-out points took it, and
    matplotlib turned loss.png's axis into categories (one tick "nan")."""
    import json

    import matplotlib.axes

    from tightfit.report.plots import plot_run

    records = [{"type": "train", "step": 1, "loss": 0.7}, {"type": "train", "step": 2, "loss": 0.6},
               {"type": "eval", "step": 1, "loss": 0.65}, {"type": "eval", "step": 2, "loss": "nan"}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plotted = []
    scatter = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter",
                        lambda self, x, y, **k: plotted.append(list(y)) or scatter(self, x, y, **k))
    assert [p.name for p in plot_run(tmp_path, [], None)] == ["loss.png"]
    assert plotted == [[0.65]]


# ---- a window without targets (every label -100): nothing to learn, no update, no non-finite step

def _without_targets(n: int, seed: int, steps: tuple[int, ...], effective_batch: int = 8) -> SyntheticBatches:
    """``n`` samples whose windows of ``steps`` (0-based, first epoch, as ``seed`` orders it) hold no label."""
    from tightfit.runtime.trainer import epoch_order, windows_of

    data = SyntheticBatches(n)
    windows = windows_of(epoch_order(n, seed, 0), effective_batch)
    for s in steps:
        data.labels[windows[s]] = -100
    return data


def _models_mean_loss(model, batch):
    """The model's own mean over the labelled samples times their count: NaN (0/0) times 0 without
    any, whose gradient is 0 (cross-entropy's backward leaves out the samples labelled -100)."""
    from tightfit.workload import count_samples

    return model(**batch).loss * count_samples(batch)


def _masked_mean_loss(model, batch):
    """A user's masked mean over the labelled samples times their count: without any, its gradient
    is 0/0 too, NaN, and the step non-finite."""
    logp = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float().log_softmax(-1)
    labelled = batch["labels"] != -100
    picked = logp.gather(1, batch["labels"].clamp(min=0)[:, None])[:, 0]
    n = labelled.sum()
    return -(picked * labelled).sum() / n * n


@pytest.mark.parametrize("loss_sum", [None, _models_mean_loss, _masked_mean_loss],
                         ids=["task-sum", "model-mean", "masked-mean"])
def test_a_window_without_targets_makes_no_update_and_is_not_a_skipped_nonfinite_step(loss_sum):
    """A window whose every label is -100 stepped AdamW with zero gradients (its weight decay moved
    the weights, its step count went on; with the model's own mean the step's loss read NaN) or,
    where that gradient is 0/0, was counted as a skipped non-finite step, one of the
    ``max_skipped_steps`` in a row that stop the run. It is now no update, said once; the
    schedule goes on, as it follows the data."""
    from tightfit.workload import count_samples

    def run(data):
        records, seen = [], []

        def log(r):
            records.append(r)
            if r["type"] == "train":  # the state after each step: weights, AdamW's step count
                seen.append((params_of(t.model), [int(s["step"]) for s in t.optimizer.state.values()]))
        extra = {"loss_sum": loss_sum, "count": count_samples} if loss_sum else {}
        t = Trainer(Workload(tiny_bert(0.1, 0), data, None, 8, **extra), Plan("fp32", 4, 8),
                    TrainConfig(epochs=1, lr=1e-3, seed=3, weight_decay=0.1, log_every=1, max_skipped_steps=1),
                    log=log, progress=False)
        result = t.fit()  # max_skipped_steps=1: one skipped non-finite step would stop it
        return t, result, records, seen

    t, result, records, seen = run(_without_targets(24, 3, steps=(1,)))
    train = [r for r in records if r["type"] == "train"]
    assert [r["stepped"] for r in train] == [True, False, True] and train[1]["loss"] == 0.0
    assert_same_params(seen[1][0], seen[0][0])  # no weight decay, no moment applied
    assert seen[1][1] == seen[0][1] and set(seen[2][1]) == {2}  # AdamW counted two updates, not three
    assert result.skipped_steps == 0 and t._skipped_in_row == 0
    events = [r["message"] for r in records if r["type"] == "event"]
    assert events == ["step 2: no target in the window (every label is -100): nothing to learn, no update"]
    _, _, full, _ = run(SyntheticBatches(24))
    assert [r["lr"] for r in train] == [r["lr"] for r in full if r["type"] == "train"]  # the schedule went on


def test_a_resume_across_a_window_without_targets_is_exact(tmp_path):
    def run(folder, resume_from=None):
        w = Workload(tiny_bert(0.1, 0), _without_targets(32, 3, steps=(1, 2)), None, 8)
        t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, checkpoint_dir=str(folder),
                                                       checkpoint_every=1, keep_last=10), progress=False)
        if resume_from is not None:
            t.resume(resume_from)
        t.fit()
        return t

    full = run(tmp_path / "full")
    assert sum("no target" in e for e in full.result.events) == 2 and full.result.skipped_steps == 0
    for ckpt in ("ckpt-1", "ckpt-2"):  # before the two windows, between them
        resumed = run(tmp_path / ckpt, resume_from=tmp_path / "full" / ckpt)
        assert_same_params(params_of(resumed.model), params_of(full.model))
        assert resumed.optimizer.state_dict()["state"][0]["step"] == full.optimizer.state_dict()["state"][0]["step"]


class _NoisyFeatures(torch.utils.data.Dataset):
    """Features with noise drawn from Python's ``random`` or NumPy's global generator at collation,
    as augmentation libraries that do not use torch's generator draw it."""

    def __init__(self, source):
        g = torch.Generator().manual_seed(0)
        self.x, self.y, self.source = torch.randn(48, 16, generator=g), torch.randint(0, 2, (48,), generator=g), source

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        import random

        import numpy as np

        noise = [random.gauss(0.0, 1.0) for _ in range(16)] if self.source == "python" else np.random.randn(16)
        return {"pixel_values": self.x[i] + 0.1 * torch.tensor(noise, dtype=torch.float32), "labels": self.y[i]}


def _noisy_run(source, folder, resume_from=None):
    from types import SimpleNamespace

    from tightfit.tasks import ImageClassification

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, pixel_values):
            return SimpleNamespace(logits=self.net(pixel_values))

    records = []
    w = Workload(Wrapped(), _NoisyFeatures(source), None, 8, task=ImageClassification())
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-2, seed=3, log_every=1, checkpoint_dir=str(folder),
                                                   checkpoint_every=3, keep_last=10, prefetch=False),
                log=records.append, progress=False)
    if resume_from is not None:
        t.resume(resume_from)
    t.fit()
    return {r["step"]: r["loss"] for r in records if r.get("type") == "train"}, t


@pytest.mark.parametrize("source", ["python", "numpy"])
def test_a_resume_restores_the_python_and_numpy_generators_a_collation_draws_from(tmp_path, source):
    # DESIGN invariant 5: the RNG states a checkpoint holds are all of them, not only torch's (the
    # Trainer seeds Python's and NumPy's generators too, so a resume that forgot to restore them would
    # start them again from the seed and draw other noise than the uninterrupted run did after step 3)
    full, _ = _noisy_run(source, tmp_path / "a")
    assert len(full) == 6
    resumed, t = _noisy_run(source, tmp_path / "b", resume_from=tmp_path / "a" / "ckpt-3")
    assert t.step == 6 and sorted(resumed) == [4, 5, 6]
    assert resumed == {s: loss for s, loss in full.items() if s > 3}


def test_a_resume_gives_back_the_loss_scale_a_skipped_fp16_step_lowered(tmp_path):
    # DESIGN invariant 5: the loss scaler is part of an exact resume. The first window's gradients are
    # made non-finite: the step is skipped and the scale backs off from 65536 to 32768; a resume from
    # ckpt-2 must go on at 32768 (with its growth tracker), not at a fresh scaler's 65536.
    def trainer(folder):
        w = _workload(n=48)
        return Trainer(w, Plan("fp16", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, checkpoint_dir=str(folder),
                                                          checkpoint_every=2, keep_last=10,
                                                          background_checkpoints=False),
                       progress=False)

    full = trainer(tmp_path / "full")
    calls = []

    def poison(grad):  # the first micro-batch's gradient only
        calls.append(1)
        return grad * math.inf if len(calls) == 1 else grad
    hook = full.model.classifier.weight.register_hook(poison)
    full.fit()
    hook.remove()
    assert full.result.skipped_steps == 1 and full.scaler.get_scale() == 32768.0

    resumed = trainer(tmp_path / "resumed")
    resumed.resume(tmp_path / "full" / "ckpt-2")
    assert resumed.scaler.get_scale() == 32768.0
    resumed.fit()
    assert resumed.scaler.state_dict() == full.scaler.state_dict()
    assert resumed.result.skipped_steps == 1
    assert_same_params(params_of(resumed.model), params_of(full.model))


def test_each_epoch_has_its_own_order_of_every_sample_once():
    """Epoch ``e``'s order is a permutation of the samples, fixed by (seed, epoch) and different
    from epoch to epoch: the same order every epoch would train on the same windows each time."""
    from tightfit.runtime.trainer import epoch_order

    n = 50
    orders = [epoch_order(n, 7, e) for e in range(3)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    assert epoch_order(n, 7, 1) == orders[1] and epoch_order(n, 8, 1) != orders[1]
