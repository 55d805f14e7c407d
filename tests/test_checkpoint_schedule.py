"""When the loop checkpoints: the default spaces checkpoints out to stay within 2% of the training
time and never waits for a write; an explicit ``checkpoint_every`` keeps its exact grid."""

from __future__ import annotations

import time

import pytest
import torch

from tightfit.plan import Plan
from tightfit.runtime import checkpoint_schedule
from tightfit.runtime.checkpoint_schedule import CheckpointCosts, CheckpointSchedule


def _costs(**known):
    """The costs a step of the grid is weighed by (asked for lazily, as the trainer gives them)."""
    return lambda: CheckpointCosts(**known)


def test_the_default_takes_a_step_of_its_grid_only_where_the_checkpoint_is_cheap():
    s = CheckpointSchedule(None)
    assert s.due(100, _costs(seconds=10.0, held=0.0, next_hold=0.1, writer_busy=False))  # 0.1 s of 10: 1%
    assert not s.due(200, _costs(seconds=10.0, held=0.15, next_hold=0.1, writer_busy=False))  # 2.5%
    assert not s.due(300, _costs(seconds=100.0, held=0.0, next_hold=0.1, writer_busy=True))  # never waits for a write
    assert not s.due(150, _costs(seconds=100.0, held=0.0, next_hold=0.0, writer_busy=False))  # off the grid
    assert s.due(400, _costs(seconds=100.0, held=1.0, next_hold=1.0, writer_busy=False))  # 2.0%: within
    # asked again for the same step (the loop asks before queueing the next step and at the boundary)
    assert s.due(400, _costs(seconds=0.0, held=9.0, next_hold=9.0, writer_busy=True))


@pytest.mark.parametrize("every", [7, 0, 100])
def test_an_explicit_interval_keeps_its_grid_whatever_the_cost(every):
    s = CheckpointSchedule(every)
    due = [k for k in range(1, 250) if s.due(k, _costs(seconds=1.0, held=5.0, next_hold=5.0, writer_busy=True))]
    assert due == (list(range(every, 250, every)) if every else [])


def test_several_processes_keep_the_default_grid():
    s = CheckpointSchedule(None, plain_grid=True)  # every rank must checkpoint at the same step
    assert s.due(100, _costs(seconds=1.0, held=5.0, next_hold=5.0, writer_busy=True))
    assert not s.due(150, _costs(seconds=1.0, held=0.0, next_hold=0.0, writer_busy=False))


def _run(make_workload, tmp_path, log=None, **cfg):
    from tightfit.runtime.checkpoint import list_checkpoints
    from tightfit.runtime.trainer import TrainConfig, Trainer

    # 250 steps of 8 samples, one epoch
    config = TrainConfig(epochs=1, lr=1e-3, keep_last=10, checkpoint_dir=str(tmp_path), prefetch=False, **cfg)
    trainer = Trainer(make_workload(n=2000, effective_batch=8), Plan("fp32", 8, 8), config, progress=False,
                      **({"log": log} if log else {}))
    trainer.fit()
    return [p.name for p in list_checkpoints(tmp_path)], trainer


def test_by_default_a_run_whose_snapshot_would_cost_much_checkpoints_at_its_end_only(make_workload, tmp_path,
                                                                                      monkeypatch):
    import tightfit.runtime.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "first_hold_seconds", lambda *a: 60.0)  # a snapshot of a minute
    assert _run(make_workload, tmp_path)[0] == ["ckpt-250"]


def test_an_explicit_interval_checkpoints_on_its_grid_however_costly(make_workload, tmp_path, monkeypatch):
    import tightfit.runtime.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "first_hold_seconds", lambda *a: 60.0)
    assert _run(make_workload, tmp_path, checkpoint_every=100)[0] == ["ckpt-100", "ckpt-200", "ckpt-250"]


def test_by_default_cheap_checkpoints_come_every_100_steps(make_workload, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_schedule, "SHARE", 1.0)  # any checkpoint counts as cheap
    names, _ = _run(make_workload, tmp_path, background_checkpoints=False)  # no write left in flight
    assert names == ["ckpt-100", "ckpt-200", "ckpt-250"]


def test_by_default_the_loop_does_not_wait_for_a_write_in_flight(make_workload, tmp_path, monkeypatch):
    import threading

    import tightfit.runtime.checkpoint as ckpt

    hashing, last_step = ckpt.sha256_file, threading.Event()
    # a disk so slow that ckpt-100's write ends only once step 250 is logged (just before its checkpoint)
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: last_step.wait(600) and hashing(path))
    monkeypatch.setattr(checkpoint_schedule, "SHARE", 1.0)
    names, trainer = _run(make_workload, tmp_path, log=lambda r: r.get("step") == 250 and last_step.set())
    assert names == ["ckpt-100", "ckpt-250"]  # step 200 came while ckpt-100 was being written


def test_the_last_checkpoint_is_copied_on_the_writer_thread_and_holds_the_final_state(make_workload, tmp_path,
                                                                                       monkeypatch):
    """The end of training snapshots nothing in the loop (the writer thread copies the state, which
    no step changes any more, while the model is evaluated): the checkpoint holds the state at the
    end."""
    import threading

    import tightfit.runtime.async_checkpoint as writer_module
    from safetensors.torch import load_file

    from tightfit.runtime.checkpoint import read_state
    from tightfit.runtime.trainer import TrainConfig, Trainer

    threads, take = [], writer_module.take_snapshot
    monkeypatch.setattr(writer_module, "take_snapshot",
                        lambda *a, **k: threads.append(threading.current_thread().name) or take(*a, **k))

    def fit(folder, max_steps):
        cfg = TrainConfig(checkpoint_dir=str(folder), checkpoint_every=2, max_steps=max_steps, keep_last=10, lr=1e-3,
                          seed=3, epochs=2, prefetch=False)
        trainer = Trainer(make_workload(n=48, effective_batch=8, dropout=0.1), Plan("fp32", 4, 8), cfg, progress=False)
        trainer.fit()
        return trainer

    short = fit(tmp_path / "short", 3)  # ckpt-2 in the loop, ckpt-3 at the end
    assert threads[0] == threading.main_thread().name and threads[-1].startswith("tightfit-checkpoint")
    state = read_state(tmp_path / "short" / "ckpt-3")
    for i, p in enumerate(short.optimizer.param_groups[0]["params"]):
        assert torch.equal(state["optimizer"]["state"][i]["exp_avg"], short.optimizer.state[p]["exp_avg"])
    weights = load_file(tmp_path / "short" / "ckpt-3" / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in short.model.state_dict().items() if k in weights)


def test_the_last_copy_goes_into_the_buffers_of_the_earlier_snapshots(make_workload, tmp_path, monkeypatch):
    """One host copy of the state at most: the end's copy, on the writer thread, reuses the
    buffers the loop's snapshots filled (a fresh set would hold a second copy at the end)."""
    import tightfit.runtime.async_checkpoint as writer_module

    given, take = [], writer_module.take_snapshot
    monkeypatch.setattr(writer_module, "take_snapshot", lambda m, s, buffers=None, **k: given.append(buffers)
                        or take(m, s, buffers, **k))
    _, trainer = _run(make_workload, tmp_path, checkpoint_every=100)
    assert len(given) == 3 and all(b is trainer._writer._buffers for b in given)


def test_a_run_whose_checkpoints_torch_distributed_checkpoint_writes_keeps_the_plain_grid(make_workload, tmp_path):
    """Parameter offload on one process writes its checkpoints in the loop through
    torch.distributed.checkpoint: no background writer whose holds the default could weigh."""
    from tightfit.runtime.distributed import World
    from tightfit.runtime.trainer import TrainConfig, Trainer

    world = World()
    try:
        trainer = Trainer(make_workload(n=16, effective_batch=8), Plan("fp32", 8, 8, sharding="fsdp-offload"),
                          TrainConfig(epochs=1, checkpoint_dir=str(tmp_path), prefetch=False), progress=False,
                          world=world)
        assert trainer.world.writes_dcp and not trainer._schedule.adaptive
    finally:
        world.close()


def test_a_second_interrupt_while_the_last_checkpoint_is_written_keeps_the_run(tmp_path, monkeypatch):
    """Ctrl-C during the evaluation, then again while fit() waits for the end's checkpoint: the
    run's only checkpoint was still being written, so the new run's folder was deleted under the
    writer. It is now waited for, and the run can be finished with --resume."""
    import threading

    from conftest import tiny_cpu_job

    import tightfit.runtime.async_checkpoint as writer_module
    import tightfit.runtime.checkpoint as ckpt
    from tightfit.api import TrainRequest, train
    from tightfit.runtime.trainer import Trainer

    job, hashing, release = tiny_cpu_job(tmp_path), ckpt.sha256_file, threading.Event()
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: release.wait(30) and hashing(path))  # a slow disk

    def evaluate(self):
        raise KeyboardInterrupt  # the first Ctrl-C

    flush, second = writer_module.CheckpointWriter.flush, []

    def interrupted_flush(self, *args):
        if self.busy and not second:
            second.append(1)
            release.set()  # the disk catches up while the run is being judged
            raise KeyboardInterrupt  # the second Ctrl-C, while fit() waits for the write
        return flush(self, *args)

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    monkeypatch.setattr(writer_module.CheckpointWriter, "flush", interrupted_flush)
    with pytest.raises(KeyboardInterrupt):
        train(TrainRequest(**job, out=str(tmp_path / "run")))
    assert second
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert names and ckpt.verify_checkpoint(tmp_path / "run" / "checkpoints" / names[-1])


def test_a_wait_for_the_last_write_after_the_evaluation_is_not_counted_as_holding_the_loop(make_workload, tmp_path,
                                                                                            monkeypatch):
    """A fresh user's short run showed checkpoints 'holding the loop' for 9-103% of its training:
    the wait for the end's write after the evaluation, which holds no training, was counted."""
    import tightfit.runtime.checkpoint as ckpt
    from tightfit.runtime.trainer import TrainConfig, Trainer

    hashing = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: time.sleep(0.5) or hashing(path))  # a slow disk
    trainer = Trainer(make_workload(n=16, effective_batch=8), Plan("fp32", 8, 8),
                      TrainConfig(epochs=1, checkpoint_dir=str(tmp_path), prefetch=False), progress=False)
    result = trainer.fit()
    assert ckpt.verify_checkpoint(tmp_path / "ckpt-2")  # in place when fit returned
    assert result.checkpoint_write_seconds >= 0.5 > result.checkpoint_seconds


def test_the_last_checkpoint_holds_the_buffers_the_last_step_left_not_the_evaluations(make_workload, tmp_path,
                                                                                       monkeypatch):
    """Found by a review: the end's checkpoint, copied on the writer thread while the model is
    evaluated, took a buffer the evaluation's forwards write (a counter, an average of the user's)
    as the evaluation had it by then: a resume from ``ckpt-N`` did not start from step N."""
    import threading

    import tightfit.runtime.async_checkpoint as writer_module
    from conftest import count_forwards
    from safetensors.torch import load_file

    from tightfit.runtime.trainer import TrainConfig, Trainer

    evaluated, take = threading.Event(), writer_module.take_snapshot

    def late(*a, **k):  # the writer thread copies only once the evaluation has run (a busy host, at worst)
        if threading.current_thread() is not threading.main_thread():
            evaluated.wait(60)
        return take(*a, **k)
    monkeypatch.setattr(writer_module, "take_snapshot", late)
    workload = make_workload(n=16, effective_batch=8)
    count_forwards(workload.model.classifier)
    cfg = TrainConfig(checkpoint_dir=str(tmp_path), max_steps=2, lr=1e-3, seed=0, epochs=1, prefetch=False)
    trainer = Trainer(workload, Plan("fp32", 8, 8), cfg, progress=False)
    seen, evaluate = {}, trainer.evaluate

    def evaluate_then_say():
        seen["at the end"] = int(workload.model.classifier.seen)
        try:
            return evaluate()
        finally:
            evaluated.set()
    trainer.evaluate = evaluate_then_say
    trainer.fit()
    assert int(workload.model.classifier.seen) > seen["at the end"]  # the evaluation wrote it
    assert int(load_file(tmp_path / "ckpt-2" / "model.safetensors")["classifier.seen"]) == seen["at the end"]
