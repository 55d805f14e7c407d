"""The step that ends without a host sync (the skip of a non-finite update decided on the device)
and the trainer queueing the next step before reading the last one's values: the same training,
metrics, checkpoints and stops as steps read at once.

On CUDA only fused optimizers qualify (:func:`tightfit.step.skips_on_device`); PyTorch's fused
AdamW takes ``found_inf`` on the CPU as well, so these tests run the device-side path on the CPU
by lifting the CUDA condition (dropout active in every run)."""

import dataclasses
import math
import os
import signal

import pytest
import torch

import tightfit.step as step
from conftest import SyntheticBatches, assert_same_params, params_of, tiny_bert
from tightfit.plan import Plan
from tightfit.runtime.checkpoint import list_checkpoints, load_checkpoint
from tightfit.runtime.trainer import NonFiniteTrainingError, TrainConfig, Trainer, TrainingInterrupted
from tightfit.workload import Workload


def _fused_anywhere(optimizer) -> bool:
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        g.get("fused") for g in optimizer.param_groups)


@pytest.fixture
def on_device(monkeypatch):
    """The device-side skip and the run-ahead on the CPU; counts the steps queued ahead."""
    monkeypatch.setattr(step, "skips_on_device", _fused_anywhere)
    ahead = []
    may = Trainer._may_run_ahead

    def counted(self, launched):
        ok = may(self, launched)
        ahead.append(ok)
        return ok
    monkeypatch.setattr(Trainer, "_may_run_ahead", counted)
    return ahead


def _workload(n=80, effective_batch=8, dropout=0.1):
    return Workload(tiny_bert(dropout, 0), SyntheticBatches(n), SyntheticBatches(8, seed=1), effective_batch)



def _run(tmp_path, name, **cfg):
    records = []
    w = _workload()
    torch.manual_seed(5)
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=2, lr=1e-3, seed=3, log_every=3, checkpoint_every=4,
                                                   checkpoint_dir=str(tmp_path / name), **cfg),
                log=records.append, progress=False)
    t.fit()
    return t, [{k: v for k, v in r.items() if k not in ("samples_per_s", "path")} for r in records]


def test_steps_queued_ahead_train_log_and_checkpoint_as_steps_read_at_once(tmp_path, monkeypatch):
    sync, sync_records = _run(tmp_path, "sync")
    ahead = []
    monkeypatch.setattr(step, "skips_on_device", _fused_anywhere)
    may = Trainer._may_run_ahead
    monkeypatch.setattr(Trainer, "_may_run_ahead", lambda self, launched: ahead.append(may(self, launched)) or ahead[-1])
    queued, queued_records = _run(tmp_path, "queued")
    assert sum(ahead) >= 8  # 20 steps: queued ahead except before logs, checkpoints and the end
    assert queued_records == sync_records  # losses, lr, grad norms, loss scale, micro-batches, eval
    assert_same_params(params_of(queued.model), params_of(sync.model))
    kept = [p.name for p in list_checkpoints(tmp_path / "sync")]
    assert kept and kept == [p.name for p in list_checkpoints(tmp_path / "queued")]
    for ckpt in kept:
        ma, mb = _workload().model, _workload().model
        a = load_checkpoint(tmp_path / "sync" / ckpt, ma)
        b = load_checkpoint(tmp_path / "queued" / ckpt, mb)
        assert a["step"] == b["step"] and a["scheduler"] == b["scheduler"]
        assert_same_params(params_of(ma), params_of(mb))


def test_a_window_without_targets_queued_ahead_makes_no_update_as_in_steps_read_at_once(tmp_path, monkeypatch):
    """A window whose every label is -100 runs nothing on the device (no update, no non-finite step),
    also when it is queued ahead of the step before it being read; the steps around it run ahead as before."""
    from tightfit.runtime.trainer import epoch_order, windows_of

    def run(name):
        records = []
        data = SyntheticBatches(80)
        for s in (1, 5):  # both queued ahead: their boundaries write no metrics line and no checkpoint
            data.labels[windows_of(epoch_order(80, 3, 0), 8)[s]] = -100
        torch.manual_seed(5)
        t = Trainer(Workload(tiny_bert(0.1, 0), data, SyntheticBatches(8, seed=1), 8), Plan("fp32", 4, 8),
                    TrainConfig(epochs=2, lr=1e-3, seed=3, log_every=3, checkpoint_every=4,
                                checkpoint_dir=str(tmp_path / name)), log=records.append, progress=False)
        t.fit()
        return t, [{k: v for k, v in r.items() if k not in ("samples_per_s", "path")} for r in records]

    sync, sync_records = run("sync")
    monkeypatch.setattr(step, "skips_on_device", _fused_anywhere)
    launched, launch = [], Trainer._launch
    monkeypatch.setattr(Trainer, "_launch", lambda self, window, index: launched.append((index, self.step))
                        or launch(self, window, index))
    queued, queued_records = run("queued")
    assert {(1, 0), (5, 4)} <= set(launched)  # steps 2 and 6 were queued while steps 1 and 5 were unread
    assert queued_records == sync_records
    assert_same_params(params_of(queued.model), params_of(sync.model))
    assert queued.result.skipped_steps == 0 and [e for e in queued.result.events if "no target" in e] == [
        f"step {s}: no target in the window (every label is -100): nothing to learn, no update" for s in (2, 6)]


@pytest.mark.parametrize("grad", [1.0, math.inf, math.nan])
def test_the_device_side_skip_decides_as_the_host_guard(grad, monkeypatch):
    results = {}
    for deferred in (False, True):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(5))
        opt = torch.optim.AdamW([p], lr=0.1, fused=True)
        p.grad = torch.ones(5)
        opt.step()  # state exists, step 1
        p.grad = torch.full((5,), grad)
        before = p.detach().clone()
        if deferred:
            monkeypatch.setattr(step, "skips_on_device", _fused_anywhere)
            done = step.apply_update(opt, None, 1.0, loss=torch.tensor(2.0), defer=True)
            assert isinstance(done, step.PendingStep) and done.known is None
            r = done.result()
            norm, finite, loss = r.grad_norm, r.finite, r.loss
        else:
            norm, finite, loss = step.apply_update(opt, None, 1.0, loss=torch.tensor(2.0))
        results[deferred] = (p.detach().clone(), opt.state[p]["step"].item(), finite, loss)
        assert finite == math.isfinite(grad)
        assert torch.equal(p.detach(), before) != finite  # skipped exactly when not finite
    assert torch.equal(results[False][0], results[True][0]) and results[False][1:] == results[True][1:]


def test_sigint_while_a_step_is_queued_ahead_stops_after_it_with_a_checkpoint_that_resumes_exactly(tmp_path,
                                                                                                  on_device):
    def trainer(folder):
        return Trainer(_workload(n=48), Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-3, seed=3,
                       checkpoint_dir=str(folder), checkpoint_every=100), progress=False)

    torch.manual_seed(11)
    full = trainer(tmp_path / "full")
    full.fit()
    torch.manual_seed(11)
    stopped = trainer(tmp_path / "stopped")
    calls = []

    def ctrl_c(*a):  # Ctrl-C in the forward of the third step, queued while the second is read
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGINT)
    stopped.model.bert.encoder.layer[0].register_forward_pre_hook(ctrl_c)
    with pytest.raises(TrainingInterrupted, match="SIGINT: stopped after step 3") as e:
        stopped.fit()
    assert any(on_device)  # the third step was queued ahead
    assert e.value.checkpoint == str(tmp_path / "stopped" / "ckpt-3")
    resumed = trainer(tmp_path / "stopped")
    resumed.resume(e.value.checkpoint)
    resumed.fit()
    assert_same_params(params_of(resumed.model), params_of(full.model))


def test_a_run_of_nonfinite_steps_decided_on_the_device_stops_where_the_host_guard_stops(tmp_path, on_device):
    w = _workload(n=32, dropout=0.0)
    w.model.bert.encoder.layer[1].output.dense.register_forward_hook(lambda m, i, out: out * math.inf)
    before = params_of(w.model)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=2, lr=1e-3, max_skipped_steps=3,
                                                 checkpoint_dir=str(tmp_path)), progress=False)
    with pytest.raises(NonFiniteTrainingError, match=r"layer\.1\.output\.dense") as e:
        t.fit()
    assert any(on_device) and e.value.step == 3 and t.result.skipped_steps == 3
    assert_same_params(params_of(t.model), before)  # every skipped update left the weights alone
    state = load_checkpoint(tmp_path / "ckpt-3", _workload(n=32).model)
    assert state["step"] == 3 and state["scheduler"]["last_epoch"] == 3


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_on_cuda_steps_queued_ahead_train_as_steps_read_at_once(tmp_path, monkeypatch, precision):
    """The real path: fused AdamW on CUDA handed the verdict on the device (bf16), or by the loss
    scaler (fp16), the next step queued before the
    last is read: the same records and weights as every step read at once."""
    def run(name):
        records = []
        w = Workload(tiny_bert(0.1, 0).cuda(), SyntheticBatches(80), SyntheticBatches(8, seed=1), 8)
        torch.manual_seed(5)
        t = Trainer(w, Plan(precision, 4, 8, device="cuda"),
                    TrainConfig(epochs=2, lr=1e-3, seed=3, log_every=3, checkpoint_every=8,
                                checkpoint_dir=str(tmp_path / name)), log=records.append, progress=False)
        t.fit()
        kept = ("type", "step", "epoch", "loss", "lr", "grad_norm", "stepped", "micro_batch", "loss_scale",
                "accuracy", "eval_loss")
        return t, [{k: v for k, v in r.items() if k in kept} for r in records]

    ahead = []
    may = Trainer._may_run_ahead
    monkeypatch.setattr(Trainer, "_may_run_ahead", lambda self, launched: ahead.append(may(self, launched)) or ahead[-1])
    queued, queued_records = run("queued")
    assert sum(ahead) >= 8
    monkeypatch.setattr(step, "skips_on_device", lambda optimizer: False)
    sync, sync_records = run("sync")
    assert queued_records == sync_records
    assert any(r["type"] == "eval" for r in sync_records)
    assert_same_params(params_of(queued.model), params_of(sync.model))


def test_an_oom_in_a_step_queued_ahead_backs_off_and_grows_back_as_in_steps_read_at_once(tmp_path, monkeypatch):
    def run(name):
        records = []
        w = _workload()
        calls = []

        def inject(*a):  # one OOM in the first forward of step 6 (index 5), queued while step 5 is read
            if torch.is_grad_enabled():
                calls.append(1)
                if len(calls) == 11:
                    raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        w.model.bert.encoder.layer[1].register_forward_pre_hook(inject)
        torch.manual_seed(5)
        t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=2, lr=1e-3, seed=3, log_every=1, grow_back_after=3,
                                                       checkpoint_dir=None), log=records.append, progress=False)
        t.fit()
        return t, [{k: v for k, v in r.items() if k not in ("samples_per_s",)} for r in records]

    sync, sync_records = run("sync")
    ahead = []
    monkeypatch.setattr(step, "skips_on_device", _fused_anywhere)
    may = Trainer._may_run_ahead
    monkeypatch.setattr(Trainer, "_may_run_ahead", lambda self, launched: ahead.append(may(self, launched)) or ahead[-1])
    # log_every=1 would queue nothing ahead: metrics lines only where the sync run also has them
    monkeypatch.setattr(Trainer, "_may_run_ahead",
                        lambda self, launched: ahead.append(_ahead_ignoring_logs(may, self, launched)) or ahead[-1])
    queued, queued_records = run("queued")
    assert ahead[4]  # step 6 was queued ahead, and ran out of memory there
    events = lambda rs: [r["message"] for r in rs if r["type"] == "event"]  # noqa: E731
    assert any("out of memory" in m for m in events(sync_records)) and any("growing" in m for m in events(sync_records))
    assert events(queued_records) == events(sync_records)
    # every step's record but the lr, which a metrics line read after the next step's launch (here
    # forced, where the runtime never queues ahead) takes from the scheduler already stepped again
    trains = lambda rs: [{k: v for k, v in r.items() if k != "lr"} for r in rs if r["type"] == "train"]  # noqa: E731
    assert trains(queued_records) == trains(sync_records)
    assert_same_params(params_of(queued.model), params_of(sync.model))


def _ahead_ignoring_logs(may, trainer, launched):
    cfg, trainer.cfg = trainer.cfg, dataclasses.replace(trainer.cfg, log_every=10 ** 9)
    try:
        return may(trainer, launched)
    finally:
        trainer.cfg = cfg
