"""When the loop checkpoints: the default spaces checkpoints out to stay within 2% of the training
time and never waits for a write; an explicit ``checkpoint_every`` keeps its exact grid."""

from __future__ import annotations

import time

import pytest

from tightfit.plan import Plan
from tightfit.runtime import checkpoint_schedule
from tightfit.runtime.checkpoint_schedule import CheckpointSchedule


def test_the_default_takes_a_step_of_its_grid_only_where_the_checkpoint_is_cheap():
    s = CheckpointSchedule(None)
    assert s.due(100, seconds=10.0, held=0.0, next_hold=0.1, writer_busy=False)  # 0.1 s of 10: 1%
    assert not s.due(200, seconds=10.0, held=0.15, next_hold=0.1, writer_busy=False)  # 2.5%
    assert not s.due(300, seconds=100.0, held=0.0, next_hold=0.1, writer_busy=True)  # never waits for a write
    assert not s.due(150, seconds=100.0, held=0.0, next_hold=0.0, writer_busy=False)  # off the grid
    assert s.due(400, seconds=100.0, held=1.0, next_hold=1.0, writer_busy=False)  # 2.0%: within
    # asked again for the same step (the loop asks before queueing the next step and at the boundary)
    assert s.due(400, seconds=0.0, held=9.0, next_hold=9.0, writer_busy=True)


@pytest.mark.parametrize("every", [7, 0, 100])
def test_an_explicit_interval_keeps_its_grid_whatever_the_cost(every):
    s = CheckpointSchedule(every)
    due = [k for k in range(1, 250) if s.due(k, seconds=1.0, held=5.0, next_hold=5.0, writer_busy=True)]
    assert due == (list(range(every, 250, every)) if every else [])


def test_several_processes_keep_the_default_grid():
    s = CheckpointSchedule(None, distributed=True)  # every rank must checkpoint at the same step
    assert s.due(100, seconds=1.0, held=5.0, next_hold=5.0, writer_busy=True)
    assert not s.due(150, seconds=1.0, held=0.0, next_hold=0.0, writer_busy=False)


def _run(make_workload, tmp_path, **cfg):
    from tightfit.runtime.checkpoint import list_checkpoints
    from tightfit.runtime.trainer import TrainConfig, Trainer

    # 250 steps of 8 samples, one epoch
    config = TrainConfig(epochs=1, lr=1e-3, keep_last=10, checkpoint_dir=str(tmp_path), prefetch=False, **cfg)
    trainer = Trainer(make_workload(n=2000, effective_batch=8), Plan("fp32", 8, 8), config, progress=False)
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
    import tightfit.runtime.checkpoint as ckpt

    hashing = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: time.sleep(3.0) or hashing(path))  # a slow disk
    monkeypatch.setattr(checkpoint_schedule, "SHARE", 1.0)
    names, trainer = _run(make_workload, tmp_path)
    assert names == ["ckpt-100", "ckpt-250"]  # step 200 came while ckpt-100 was being written
