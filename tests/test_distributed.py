"""Several ranks (two CPU processes on gloo, as torchrun runs them): the effective batch is
exact and every sample is trained on once; an OOM on one rank makes every rank redo the window
with the same smaller micro-batch; the skip decision agrees; DCP checkpoints resume exactly on
the same number of ranks and on one; the torchrun rendezvous of ``tightfit train --gpus 2``."""

import importlib
import json
import subprocess
import sys

import pytest
import torch

from distributed_worker import spawn
from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.planner.sharding import choose_sharding, sharded_state_bytes
from tightfit.runtime.distributed import micro_batches_per_rank, shard_of


def _losses(result):
    return [r["loss"] for r in result["records"] if r["type"] == "train"]


def _same_weights(a, b, exact=True):
    assert a.keys() == b.keys()
    for k in a:
        if exact:
            assert torch.equal(a[k], b[k]), k
        else:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


# ---------------------------------------------------------------- without processes
@pytest.mark.parametrize("size", [0, 1, 2, 5, 8, 9])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_cover_the_window_once_and_differ_by_at_most_one(size, world):
    window = list(range(100, 100 + size))
    shards = [shard_of(window, r, world) for r in range(world)]
    assert sum(shards, []) == window  # in order, each sample once
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    for mb in (1, 2, 3):
        n = micro_batches_per_rank(size, world, mb)
        assert n >= 1 and all(-(-len(s) // mb) <= n for s in shards)


def test_plan_counts_accumulation_per_rank():
    p = Plan("fp32", 4, 32, world_size=2, sharding="ddp")
    assert p.rank_batch == 16 and p.accumulation_steps == 4  # 4 x 4 x 2 = 32
    assert Plan.from_dict(p.to_dict()) == p
    assert Plan("fp32", 64, 32, world_size=2, sharding="ddp").micro_batch == 16
    with pytest.raises(TightfitError):
        Plan("fp32", 4, 32, sharding="zero3")


def test_sharding_choice_ddp_when_replicated_state_fits_else_fsdp():
    from conftest import tiny_bert

    model = tiny_bert()
    replicated, sharded = sharded_state_bytes(model, 4)  # a tiny model's embeddings weigh a lot: 4 ranks
    assert sharded < replicated
    assert choose_sharding(model, 1, 10 * replicated).sharding == "none"
    assert choose_sharding(model, 2, 10 * replicated).sharding == "ddp"
    fsdp = choose_sharding(model, 4, int(1.2 * sharded))
    assert fsdp.sharding == "fsdp" and fsdp.saved_bytes == replicated - sharded and "FSDP2" in fsdp.reason
    with pytest.raises(TightfitError, match="even sharded over 4 ranks"):
        choose_sharding(model, 4, sharded // 2)


def test_sharded_state_is_the_state_over_the_ranks_plus_gathered_blocks():
    from conftest import tiny_bert

    from tightfit.models import model_state_bytes

    model = tiny_bert()
    total = model_state_bytes(model)["total"]  # 16 bytes per trainable fp32 parameter
    layers = model.bert.encoder.layer
    block = sum(p.numel() * 4 for p in layers[0].parameters())
    root = sum(p.numel() * 4 for p in model.parameters()) - len(layers) * block
    for world in (2, 4):  # root: parameters + gradient; blocks: 2 gathered + 2 gradient buffers
        assert sharded_state_bytes(model, world) == (total, -(-total // world) + 2 * root + 4 * block)


def test_fsdp_micro_batch_is_the_estimate_less_what_sharding_removes(monkeypatch):
    from types import SimpleNamespace

    from conftest import SyntheticBatches, tiny_bert

    est = importlib.import_module("tightfit.memory.estimate")  # the package's name is the function
    from tightfit.planner.margins import HEADROOM
    from tightfit.planner.sharding import fsdp_micro_batch
    from tightfit.workload import Workload

    w = Workload(tiny_bert(), SyntheticBatches(64, seq_len=32), None, 64)
    replicated, sharded = sharded_state_bytes(w.model, 2)
    monkeypatch.setattr(est, "estimate", lambda model, batch, plan, profile: SimpleNamespace(
        peak_reserved_bytes=replicated + 10_000 + 10_000 * plan.micro_batch))  # a line in the micro-batch
    budget = 500_000  # the replicated state alone would not fit
    mb, peak = fsdp_micro_batch(w, None, budget, 2, "fp32", False)
    assert int(((1 - HEADROOM) * budget - sharded - 10_000) / 10_000) == 12  # the largest that fits
    assert mb == 11  # each rank's 32 samples in as few micro-batches (3), split evenly
    assert peak == sharded + 10_000 + 10_000 * mb
    # A single-GPU peak that does not hold the whole state (AdamW's moments come at the first
    # step): only its bytes per sample count, the sharded state is added in full.
    monkeypatch.setattr(est, "estimate", lambda model, batch, plan, profile: SimpleNamespace(
        peak_reserved_bytes=replicated // 2 + 10_000 * plan.micro_batch))
    mb, peak = fsdp_micro_batch(w, None, budget, 2, "fp32", False)
    assert int(((1 - HEADROOM) * budget - sharded) / 10_000) == 13 and mb == 11 and peak == sharded + 10_000 * mb


def test_fsdp_takes_checkpointing_when_it_halves_the_micro_batches_per_window():
    from tightfit.planner.sharding import choose_checkpointing

    assert choose_checkpointing({False: (3, 0), True: (24, 0)}, 128) == [True]
    assert choose_checkpointing({False: (9, 0), True: (128, 0)}, 128) == [True]  # BERT-large, 2 x 4 GiB
    assert choose_checkpointing({False: (12, 0), True: (48, 0)}, 128) == [True]  # 11 -> 3 micro-batches
    assert choose_checkpointing({False: (64, 0), True: (96, 0)}, 128) == [False, True]  # 2 -> 2
    assert choose_checkpointing({False: (3, 0), True: (5, 0)}, 128) == [False, True]  # 43 -> 26: not worth it
    assert choose_checkpointing({False: (3, 0), True: (8, 0)}, 3) == [False, True]  # the whole share
    assert choose_checkpointing({False: None, True: (8, 0)}, 128) == [True]
    assert choose_checkpointing({False: (3, 0)}, 128) == [False]  # --checkpointing off


def test_fsdp_micro_batch_comes_from_the_estimator_less_the_sharded_state():
    from conftest import SyntheticBatches, tiny_bert

    from tightfit.planner.margins import HEADROOM
    from tightfit.planner.sharding import fsdp_micro_batch
    from tightfit.workload import Workload

    w = Workload(tiny_bert(), SyntheticBatches(64, seq_len=32), None, 64)
    mb, peak = fsdp_micro_batch(w, None, 100_000_000, 2, "fp32", False)
    assert mb == 32 and peak <= (1 - HEADROOM) * 100_000_000  # each rank's share of 64, predicted to fit
    assert fsdp_micro_batch(w, None, 80_000_000, 2, "fp32", False) is None  # below the step's fixed bytes


def test_rng_of_more_gpus_restores_on_fewer(monkeypatch):
    """A checkpoint written where 2 GPUs were visible resumes where 1 is: device 0's state is
    restored, device 1's (absent here) is not asked for (torch raised IndexError)."""
    import torch.cuda.random as cuda_random

    from tightfit.rng import capture_rng, restore_rng

    set_on = []

    def fake_set(state, device="cuda"):
        idx = device if isinstance(device, int) else 0
        if idx >= 1:
            raise IndexError("tuple index out of range")  # torch.cuda.default_generators[1]
        set_on.append(idx)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", fake_set)
    monkeypatch.setattr(cuda_random, "set_rng_state", fake_set)
    restore_rng({**capture_rng(), "cuda": [torch.zeros(16, dtype=torch.uint8)] * 2})
    assert set_on == [0]


# ---------------------------------------------------------------- two processes on gloo
def test_two_ranks_train_every_sample_once_and_match_one_process(tmp_path):
    # 21 samples, effective batch 8, micro-batch 3: windows 8, 8, 5; rank shares 4+4, 4+4, 3+2.
    spec = {"n": 21, "effective_batch": 8, "micro_batch": 3}
    two = spawn(spec, 2, tmp_path)
    one = spawn(spec, 1, tmp_path)[0]
    drawn = [sorted(i for mb in r["drawn"] for i in mb) for r in two]
    assert sorted(drawn[0] + drawn[1]) == list(range(21))  # every sample once, no rank overlaps
    assert [len(mb) for mb in two[1]["drawn"]] == [3, 1, 3, 1, 2]  # 4 = 3+1 per window, then 2
    # micro-batch x accumulation x world size = effective batch: same losses and weights as one process
    torch.testing.assert_close(_losses(two[0]), _losses(one), rtol=1e-5, atol=1e-6)
    _same_weights(two[0]["weights"], one["weights"], exact=False)
    _same_weights(two[0]["weights"], two[1]["weights"])  # the replicas agree bit for bit
    # the skip decision agrees: the gradient norm every rank measured is the same number
    norms = [[r["grad_norm"] for r in res["records"] if r["type"] == "train"] for res in two]
    assert norms[0] == norms[1]


def test_ddp_all_reduces_the_gradients_once_per_window(tmp_path):
    # 4 micro-batches per rank per window (no_sync on the first 3) all-reduce as often as 1.
    spec = {"n": 48, "effective_batch": 16}
    many = spawn({**spec, "micro_batch": 2}, 2, tmp_path)
    one = spawn({**spec, "micro_batch": 8}, 2, tmp_path)
    assert many[0]["steps"] == 3 and len(one[0]["allreduces"]) >= 3
    assert many[0]["allreduces"] == one[0]["allreduces"]  # the same buckets, at the same steps


def test_a_window_smaller_than_the_ranks_is_padded_with_zero_weight(tmp_path):
    # 17 samples, effective batch 8: the last window holds 1 sample, rank 1 has none of it.
    spec = {"n": 17, "effective_batch": 8, "micro_batch": 4, "sharding": "fsdp"}
    two = spawn(spec, 2, tmp_path)
    one = spawn(spec, 1, tmp_path)[0]
    assert two[0]["samples"] == 17 and two[0]["steps"] == 3
    torch.testing.assert_close(_losses(two[0]), _losses(one), rtol=1e-5, atol=1e-6)
    _same_weights(two[0]["weights"], one["weights"], exact=False)


def test_oom_on_one_rank_every_rank_redoes_the_window_with_the_smaller_micro_batch(tmp_path):
    base = {"n": 24, "effective_batch": 8, "dropout": 0.1}  # dropout on: the redo must draw the same masks
    ref = spawn({**base, "micro_batch": 2}, 2, tmp_path)
    hit = spawn({**base, "micro_batch": 4, "oom": (1, 0)}, 2, tmp_path)  # rank 1's forward, first step
    for r in hit:
        assert r["oom_recoveries"] == 1 and r["micro_batch"] == 2 and r["steps"] == 3
    assert _losses(hit[0]) == _losses(ref[0])  # as micro-batch 2 from the start, bit for bit
    _same_weights(hit[0]["weights"], ref[0]["weights"])
    events = [r["message"] for r in hit[0]["records"] if r["type"] == "event"]
    assert any("out of memory" in m and "redoing step 1" in m for m in events)  # rank 0 redid it too


def test_an_oom_redo_on_two_ranks_halves_a_share_and_leaves_batchnorm_no_single_sample(tmp_path):
    """Found by a review: the redo halved the whole window (10 samples at 5 per rank: 2), which
    split each rank's share of 5 as 2 + 2 + 1, and BatchNorm stopped both ranks with a ValueError."""
    hit = spawn({"n": 20, "effective_batch": 10, "micro_batch": 5, "token_bn": True, "oom": (0, 0)}, 2, tmp_path)
    assert [r["micro_batch"] for r in hit] == [3, 3] and [r["oom_recoveries"] for r in hit] == [1, 1]
    events = [r["message"] for r in hit[0]["records"] if r["type"] == "event"]
    assert any("10 samples as 3+2 and 3+2 on the ranks" in m for m in events), events


def test_oom_mid_run_on_one_rank_keeps_the_replicas_identical(tmp_path):
    # Step 2: DDP has rebuilt its buckets and armed all-reduces before; the redo must not leave
    # one rank in an all-reduce (gloo aborts on a mismatched collective).
    hit = spawn({"n": 24, "effective_batch": 8, "micro_batch": 4, "dropout": 0.1, "oom": (0, 1)}, 2, tmp_path)
    assert [r["oom_recoveries"] for r in hit] == [1, 1] and [r["micro_batch"] for r in hit] == [2, 2]
    assert [r["samples"] for r in hit] == [24, 24]
    _same_weights(hit[0]["weights"], hit[1]["weights"])


def test_fsdp_probe_step_halves_on_oom_and_leaves_no_trace(tmp_path):
    # The planned micro-batch 4 runs out of memory in the probe on every rank: all take 2, and
    # training then runs exactly as a run planned at 2 (weights, AdamW state, RNG and BatchNorm's
    # running statistics untouched: the probe's forwards folded their batches into them).
    base = {"n": 24, "effective_batch": 8, "dropout": 0.1, "sharding": "fsdp", "token_bn": True}
    ref = spawn({**base, "micro_batch": 2}, 2, tmp_path)
    probed = spawn({**base, "micro_batch": 4, "probe_oom_above": 2}, 2, tmp_path)
    assert [r["micro_batch"] for r in probed] == [2, 2] and [r["oom_recoveries"] for r in probed] == [0, 0]
    assert _losses(probed[0]) == _losses(ref[0])  # bit for bit
    _same_weights(probed[0]["weights"], ref[0]["weights"])
    for a, b in zip(probed, ref):  # each rank's own statistics (FSDP2 does not broadcast buffers)
        assert a["bn_batches"] == b["bn_batches"] == [6]  # 3 windows, 2 + 2 on each rank
        torch.testing.assert_close(a["bn_mean"], b["bn_mean"], rtol=0, atol=0)


def test_a_ranks_padding_micro_batches_leave_its_batchnorm_statistics_in_training(tmp_path):
    """Windows of 5 on two ranks at micro-batch 2: rank 0 runs 2 + 1, rank 1 runs 2 and a padding
    micro-batch (a repeat of a sample, weighted 0) to keep the collectives in step. Rank 1's
    BatchNorm counted the padding forwards too (8 batches for 4 real ones)."""
    spec = {"n": 20, "effective_batch": 5, "micro_batch": 2, "sharding": "fsdp", "token_bn": True}
    two = spawn(spec, 2, tmp_path)
    assert [r["steps"] for r in two] == [4, 4]
    assert [r["bn_batches"] for r in two] == [[8], [4]]


def test_resume_from_two_ranks_on_two_is_exact_and_on_one_continues(tmp_path):
    spec = {"n": 24, "effective_batch": 8, "micro_batch": 2, "dropout": 0.1, "sharding": "fsdp"}
    full = spawn({**spec, "checkpoint_dir": str(tmp_path / "full"), "checkpoint_every": 1}, 2, tmp_path)
    ckpt = tmp_path / "full" / "ckpt-1"
    assert (ckpt / "dcp").is_dir()
    assert all(r["checkpoint_seconds"] > 0 for r in full)  # the summary's "time: checkpoints" counts them
    resumed = spawn({**spec, "resume": str(ckpt)}, 2, tmp_path)
    # ckpt-1's state was taken before its own write, the first: its time is read back from beside it
    assert all(r["checkpoint_seconds"] > 0 for r in resumed)
    assert _losses(resumed[0]) == _losses(full[0])[1:]  # dropout on, bit for bit
    _same_weights(resumed[0]["weights"], full[0]["weights"])
    # 2 -> 1: the sharded state is resharded into one process; without dropout the run continues
    # as the two ranks did (only the order of floating-point sums differs)
    plain = {**spec, "dropout": 0.0}
    full = spawn({**plain, "checkpoint_dir": str(tmp_path / "plain"), "checkpoint_every": 1},
                 2, tmp_path)
    one = spawn({**plain, "resume": str(tmp_path / "plain" / "ckpt-1")}, 1, tmp_path)[0]
    torch.testing.assert_close(_losses(one), _losses(full[0])[1:], rtol=1e-5, atol=1e-6)
    _same_weights(one["weights"], full[0]["weights"], exact=False)


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_resume_on_two_ranks_gives_rank_0_its_own_batchnorm_statistics(tmp_path, sharding):
    """Found by a review: the ranks' BatchNorm statistics differ (each from its own share; no
    buffer is broadcast), and DCP wrote each replicated buffer from whichever rank had written
    least: a resume gave rank 0 rank 1's statistics, and its saved and evaluated model was not the
    run's. Each is now written from rank 0."""
    spec = {"n": 24, "effective_batch": 8, "micro_batch": 4, "dropout": 0.0, "sharding": sharding, "token_bn": True}
    full = spawn({**spec, "checkpoint_dir": str(tmp_path / "full"), "checkpoint_every": 1}, 2, tmp_path)
    assert not torch.equal(full[0]["bn_mean"][0], full[1]["bn_mean"][0])  # the ranks' statistics differ
    resumed = spawn({**spec, "resume": str(tmp_path / "full" / "ckpt-1")}, 2, tmp_path)
    _same_weights(resumed[0]["weights"], full[0]["weights"])


def test_a_non_finite_buffer_on_one_rank_stops_every_rank_without_a_checkpoint(tmp_path):
    """Found by a review: several processes checked only the parameters before a checkpoint, so
    a BatchNorm running variance that overflowed was written (one process refuses it)."""
    spec = {"n": 24, "effective_batch": 8, "micro_batch": 4, "dropout": 0.0, "token_bn": True,
            "checkpoint_dir": str(tmp_path / "run"), "checkpoint_every": 1, "inf_buffer": (1, 2)}
    ranks = spawn(spec, 2, tmp_path)
    assert all(r["error"] and "not finite" in r["error"] for r in ranks), [r["error"] for r in ranks]
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt-*")) == ["ckpt-1"]
    # a buffer infinite by design (a -inf attention mask) is checkpointed, as by one process (found by a review)
    masked = spawn({**spec, "inf_buffer": None, "mask_buffer": True, "checkpoint_dir": str(tmp_path / "masked")},
                   2, tmp_path)
    assert [r["error"] for r in masked] == [None, None]
    assert (tmp_path / "masked" / "ckpt-3").is_dir()


def test_a_signal_on_one_rank_after_the_stop_vote_stops_every_rank_at_the_same_step(tmp_path):
    """SIGTERM reaching rank 1 while it logs step 1 (after the ranks voted on stopping): rank 1
    stopped alone and began its stop checkpoint's collectives while rank 0 began step 2, so the
    collectives crossed and both waited for the timeout. The signal now waits for the next vote:
    both stop after step 2 with one checkpoint."""
    spec = {"n": 48, "effective_batch": 8, "micro_batch": 4, "checkpoint_dir": str(tmp_path / "ck"),
            "signal": (1, 1)}
    two = spawn(spec, 2, tmp_path)
    assert [r["steps"] for r in two] == [2, 2]
    assert two[0]["error"].startswith("TrainingInterrupted: a stop on another rank: stopped after step 2")
    assert two[1]["error"].startswith("TrainingInterrupted: SIGTERM: stopped after step 2")
    assert (tmp_path / "ck" / "ckpt-2" / "dcp").is_dir()


def test_a_checkpoint_of_one_process_resumes_under_fsdp2_on_two_ranks(tmp_path):
    """docs/distributed.md: a run continues on any number of processes. A one-process checkpoint
    (``model.safetensors``, the optimizer's state by position) failed under FSDP2 ("does not fit
    the model: ... invalid python storage"): loaded into the sharded parameters as if whole. Each
    rank now reads it whole and keeps its shard; the run goes on as the one process did."""
    spec = {"n": 24, "effective_batch": 8, "micro_batch": 2, "dropout": 0.0, "sharding": "fsdp"}
    one = spawn({**spec, "checkpoint_dir": str(tmp_path / "one"), "checkpoint_every": 1}, 1, tmp_path)[0]
    assert (tmp_path / "one" / "ckpt-1" / "model.safetensors").is_file()
    two = spawn({**spec, "resume": str(tmp_path / "one" / "ckpt-1")}, 2, tmp_path)
    torch.testing.assert_close(_losses(two[0]), _losses(one)[1:], rtol=1e-5, atol=1e-6)
    # the one process's RNG states were restored on both ranks: each would draw the same dropout
    # masks for its own samples; each rank now draws its own stream
    assert not torch.equal(two[0]["rng_after_resume"], two[1]["rng_after_resume"])
    _same_weights(two[0]["weights"], one["weights"], exact=False)
    # 8-bit, bf16-weight or offloaded state is not keyed by name: refused in one line, before any load
    from tightfit.runtime.sharded_checkpoint import load_whole_into_sharded

    with pytest.raises(TightfitError, match=r"written by one process with --optimizer adamw8bit: it resumes on one "):
        load_whole_into_sharded(tmp_path / "one" / "ckpt-1", None, None, verified=True,
                                state={"plan": {"optimizer": "adamw8bit"}})


def test_an_evaluation_oom_on_one_rank_under_fsdp2_stops_every_rank_in_one_line(tmp_path):
    """Under FSDP2 every forward all-gathers: rank 1 halved its evaluation batch alone after an
    OOM, its forwards no longer paired with rank 0's, and gloo aborted on the mismatched
    collective (NCCL would wait for the timeout). The OOM now stops the run as one in training
    does, in one line; without it both ranks evaluate at the training micro-batch."""
    spec = {"n": 16, "effective_batch": 8, "micro_batch": 4, "sharding": "fsdp", "eval": 12}
    fine = spawn(spec, 2, tmp_path)
    assert [r["eval"]["eval_batch"] for r in fine] == [4, 4] and fine[0]["eval"] == fine[1]["eval"]
    hit = spawn({**spec, "eval_oom": 1, "exit_on_error": True}, 2, tmp_path, failing=True)
    assert hit[1]["error"] == ("TightfitError: out of memory in evaluation on rank 1 under FSDP2 (its collectives "
                               "run in every forward, so no rank can halve its evaluation batch alone): every "
                               "rank stops")  # (no checkpoint folder in this run: no word of one)
    # rank 0 is stopped once rank 1 exits (as torchrun stops the others) or fails on its own as its
    # peer leaves (gloo: "Connection closed by peer"), whichever comes first; it is not left waiting
    assert hit[0] is None or hit[0]["failed"]


class _BatchNormNet(torch.nn.Module):
    """Linear, BatchNorm1d over ``x`` ``[B, 4]``; a classifier's output (``.logits``, 2 classes)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))

    def forward(self, x):
        import types

        return types.SimpleNamespace(logits=self.body(x)[:, :2])


def test_batchnorm_is_checked_on_every_ranks_share_before_training():
    """Two ranks share a window of 7 as 4 + 3; at micro-batch 2 rank 1 ran 2 + 1, and BatchNorm's
    ValueError stopped it mid-step while rank 0 waited in a collective. The check that refuses
    this for one process now splits each rank's share (and its padding micro-batches) as the
    ranks will, and refuses it before any process group is touched."""
    from tightfit.runtime.distributed import World
    from tightfit.runtime.trainer import TrainConfig, Trainer, rank_micro_batch_sizes
    from tightfit.workload import Workload

    assert rank_micro_batch_sizes(7, 2, 2) == [[2, 2], [2, 1]] and rank_micro_batch_sizes(1, 2, 2) == [[1], [1]]
    assert rank_micro_batch_sizes(8, 4, 2) == [[4], [4]] and rank_micro_batch_sizes(7, 3) == [[3, 3, 1]]

    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(14)]
    cfg = TrainConfig(epochs=1, prefetch=False)
    with pytest.raises(TightfitError, match=r"micro-batch 2 on 2 ranks splits each window of 7 samples as 2\+2 "
                                            r"and 2\+1;"):
        Trainer(Workload(_BatchNormNet(), data, None, 7), Plan("fp32", 2, 7, world_size=2, sharding="ddp"), cfg,
                progress=False, world=World(rank=0, size=2))
    with pytest.raises(TightfitError, match=r"on 2 ranks splits each window of 1 sample as 1 and 1 \(a rank"):
        Trainer(Workload(_BatchNormNet(), data[:2], None, 1), Plan("fp32", 1, 1, world_size=2, sharding="ddp"), cfg,
                progress=False, world=World(rank=0, size=2))
    Trainer(Workload(_BatchNormNet(), data[:8], None, 8), Plan("fp32", 4, 8), cfg, progress=False)  # 4 + 4 on one: fine


def test_a_padding_micro_batch_leaves_batchnorm_statistics_as_they_were():
    """A rank with fewer micro-batches than its peer runs padding micro-batches (repeats of its
    samples, weighted 0) to keep the collectives in step; their forward in train mode folded
    those samples into BatchNorm's running statistics a second time. The window's real
    micro-batch updates them; the padding one leaves them."""
    from tightfit.runtime.distributed import World

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).train()
    guard = World().guard(model, lambda m, b: m(b).sum(), micro_batches=2, padding=1)
    x = torch.randn(3, 4)
    guard(model, x).backward()  # the real micro-batch
    after_real = (model[1].running_mean.clone(), model[1].running_var.clone(), int(model[1].num_batches_tracked))
    loss = guard(model, x[:2] + 1.0)  # padding (other values: it would move the statistics)
    loss.backward()
    guard.restore_statistics()  # as the trainer does after the window's backward
    assert float(loss) == 0.0 and int(model[1].num_batches_tracked) == after_real[2] == 1
    torch.testing.assert_close(model[1].running_mean, after_real[0], rtol=0, atol=0)
    torch.testing.assert_close(model[1].running_var, after_real[1], rtol=0, atol=0)


def _tiny_inputs(tmp_path):
    """The model folder and the CSV of :func:`_tiny_cli_run`."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_resume import WORDS

    from conftest import tiny_text_model_folder

    model = tiny_text_model_folder(tmp_path, WORDS, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=64)
    data = tmp_path / "data.csv"
    data.write_text("text,label\n" + "".join(f"{WORDS[i % 12]} {WORDS[(i * 5) % 12]},{'ab'[i % 2]}\n"
                                             for i in range(40)))
    return model, data


def _tiny_cli_run(tmp_path, *extra):
    """``tightfit train ... --device cpu`` of a tiny text classifier (40 rows, effective batch 8,
    dropout on) into ``tmp_path/run``; returns the finished process and the run folder."""
    model, data = _tiny_inputs(tmp_path)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tightfit", "train", "--model", str(model), "--data", str(data), "--batch-size",
           "8", "--epochs", "1", "--seq-len", "16", "--log-every", "1", "--out", str(out), "--no-progress",
           "--device", "cpu", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240), out


def _train_losses(run):
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if r["type"] == "train"}


def _cut_to(run, step, dest):
    """A copy of run folder ``run`` as if it had been killed right after checkpoint ``step``."""
    import shutil

    shutil.copytree(run, dest)
    for c in (dest / "checkpoints").glob("ckpt-*"):
        if int(c.name.split("-")[1]) > step:
            shutil.rmtree(c)
    (dest / "summary.json").unlink()
    return dest


def test_gpus_2_resume_through_the_cli_on_two_ranks_and_on_one(tmp_path):
    """``tightfit train --resume DIR --gpus 2`` continues a 2-rank run bit for bit (every rank
    restores the checkpoint, not only the one that planned), and ``tightfit train --resume DIR``
    continues it in one process with the same effective batch (DCP reshards)."""
    done, run = _tiny_cli_run(tmp_path, "--gpus", "2", "--checkpoint-every", "1", "--keep-last", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    full = _train_losses(run)
    assert sorted(full) == [1, 2, 3, 4, 5]
    for gpus in ("2", "1"):
        cut = _cut_to(run, 3, tmp_path / f"cut{gpus}")
        cmd = [sys.executable, "-m", "tightfit", "train", "--resume", str(cut), "--no-progress", "--gpus", gpus]
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "resumed from" in again.stdout + again.stderr
        losses = _train_losses(cut)
        assert sorted(losses) == [1, 2, 3, 4, 5]  # the steps after the checkpoint were trained anew
        recs = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
        mark = max(i for i, r in enumerate(recs) if r["type"] == "event" and r["message"].startswith("resumed from"))
        assert [r["step"] for r in recs[mark + 1:] if r["type"] == "train"] == [4, 5]  # what bench/multi_gpu_report.py reads
        plan = json.loads((cut / "plan.json").read_text())
        assert plan["effective_batch"] == 8 and plan["world_size"] == int(gpus)
        assert plan["micro_batch"] * -(-8 // (plan["micro_batch"] * int(gpus))) * int(gpus) >= 8
        if gpus == "2":
            assert losses == full  # dropout on: bit for bit
        else:
            assert [losses[s] for s in (1, 2, 3)] == [full[s] for s in (1, 2, 3)]
            torch.testing.assert_close([losses[4], losses[5]], [full[4], full[5]], rtol=0.05, atol=0.05)


_LATE_RESTORE = """
import os, signal, sys, time
signal.alarm(100)  # a rank left waiting in a collective ends (the launcher then ends the other)
from tightfit.runtime import checkpoint
if os.environ.get("RANK") == "0":  # rank 0 puts the displaced checkpoint back late: rank 1 looks first
    restore = checkpoint.restore_displaced
    checkpoint.restore_displaced = lambda folder: (time.sleep(3), restore(folder))[1]
from tightfit.cli import main
sys.exit(main())
"""


def test_every_rank_resumes_from_the_checkpoint_rank_0_chose(tmp_path):
    """A checkpoint write cut short between its two renames leaves ``ckpt-3`` as ``.ckpt-3.old``;
    a resume puts it back (rank 0: the folder's one writer) and continues from it. Each rank chose
    its checkpoint alone: a rank that looked before rank 0 had put it back took ``ckpt-2``, so
    the ranks trained different steps and their collectives crossed. Rank 0 now chooses for all."""
    import os
    from pathlib import Path

    import tightfit

    done, run = _tiny_cli_run(tmp_path, "--checkpoint-every", "1", "--keep-last", "5")
    assert done.returncode == 0, done.stderr[-2000:]
    cut = _cut_to(run, 3, tmp_path / "cut")
    (cut / "checkpoints" / "ckpt-3").rename(cut / "checkpoints" / ".ckpt-3.old")
    script = tmp_path / "late_restore.py"
    script.write_text(_LATE_RESTORE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           "train", "--resume", str(cut), "--no-progress"]
    here = str(Path(tightfit.__file__).parents[1])  # the script's folder is not the tests' working directory
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])))
    assert again.returncode == 0, again.stderr[-3000:]
    recs = [json.loads(x) for x in (cut / "metrics.jsonl").read_text().splitlines()]
    mark = max(i for i, r in enumerate(recs) if r["type"] == "event" and r["message"].startswith("resumed from"))
    assert "ckpt-3" in recs[mark]["message"]
    assert [r["step"] for r in recs[mark + 1:] if r["type"] == "train"] == [4, 5]


def test_gpus_2_rendezvous_and_only_rank_0_writes(tmp_path):
    """``tightfit train --gpus 2 --device cpu``: torch.distributed.run starts two processes that
    meet at the rendezvous, train DDP and write one run folder with one line per step."""
    done, out = _tiny_cli_run(tmp_path, "--gpus", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("summary:") == 1  # rank 1 keeps quiet
    assert "(host RSS of rank 0, one of 2 processes)" in done.stdout, done.stdout[-1500:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["sharding"] == "ddp"
    # micro-batch 4 x 1 per rank: not "the whole effective batch (8) in one micro-batch"
    assert not any("whole effective batch" in r for r in plan["reasons"]), plan["reasons"]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "train"]
    assert steps == sorted(set(steps)) and len(steps) == 5  # 36 training samples / 8
    # the run records the command as given, --gpus 2 included (the processes' own argv has none)
    request = json.loads((out / "request.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    for recorded in (request.get("command"), summary.get("command") or json.dumps(summary)):
        assert "--gpus 2" in str(recorded), recorded
    assert "--gpus 2" in (out / "report.md").read_text()


def test_gpus_2_an_input_error_found_by_every_rank_is_printed_once(tmp_path):
    """An error of the input that each rank finds in its own setup (here: a label column the data
    lacks, found only once the file is read) is printed by rank 0 alone, exit code 2."""
    done, out = _tiny_cli_run(tmp_path, "--gpus", "2", "--label-column", "stars")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("tightfit: error:") == 1, done.stderr[-2000:]
    assert "stars" in done.stderr and not out.exists()


_GLOO_THREADS = """
import json, os, sys
import torch
from tightfit.runtime.distributed import World
world = World.from_env("cpu")
from torch.distributed import checkpoint as dcp  # as tightfit's sharded checkpoints import it: late
dcp.save({"x": torch.ones(2)}, checkpoint_id=os.path.join(sys.argv[1], "ckpt"))
world.close()
names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print(json.dumps([n for n in names if "gloo" in n]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads thread names from /proc")
def test_after_close_no_gloo_thread_is_left_to_die_at_interpreter_exit(tmp_path):
    """A gloo thread still running at interpreter exit aborts the rank ("terminate called without
    an active exception"): torch.distributed.checkpoint imported after the group exists keeps the
    group alive past destroy_process_group, so World.from_env imports it first."""
    import os

    from distributed_worker import free_port

    port, procs = free_port(), []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        procs.append(subprocess.Popen([sys.executable, "-c", _GLOO_THREADS, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == [], "gloo threads alive after World.close"


def test_gpus_2_fsdp_with_lora_saves_the_plain_model_with_the_adapters_merged(tmp_path):
    """``--sharding fsdp --trainable lora``: the saved model is the plain model with the trained
    adapters merged, as one process saves it (peft's ``save_pretrained`` of the gathered weights
    wrote the adapters alone: no config.json, no trained head, nothing ``export`` or
    ``from_pretrained`` reads)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import BertForSequenceClassification

    pytest.importorskip("peft")
    from tightfit.levers.lora import apply_lora, merged

    done, run = _tiny_cli_run(tmp_path, "--gpus", "2", "--sharding", "fsdp", "--trainable", "lora",
                              "--checkpoint-every", "100")
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "model" / "config.json").is_file() and not (run / "model" / "adapter_config.json").exists()
    saved = load_file(run / "model" / "model.safetensors")
    # the last checkpoint (the last step) holds the trained adapters and head: merged, the saved model
    lora = apply_lora(BertForSequenceClassification.from_pretrained(run / "model"))
    state = {"model": lora.state_dict()}
    dcp.load(state, checkpoint_id=str(max((run / "checkpoints").glob("ckpt-*")) / "dcp"), no_dist=True)
    lora.load_state_dict(state["model"])
    assert any(k.endswith("lora_B.default.weight") and v.abs().sum() > 0 for k, v in state["model"].items())
    _same_weights(saved, merged(lora).state_dict(), exact=False)


def test_the_batchnorm_check_before_planning_names_each_ranks_share_as_its_micro_batch():
    """Found by a review: before planning, 2 ranks were checked at micro-batch = the effective
    batch, and the refusal said 'micro-batch 16 on 2 ranks' where each rank runs at most 8."""
    from tightfit.api import TrainRecipe
    from tightfit.config import TrainRequest
    from tightfit.runtime.distributed import World
    from tightfit.workload import Workload

    data = [{"x": torch.randn(4), "labels": i % 2} for i in range(17)]  # windows of 16 and 1: shares 1 and 0
    recipe = TrainRecipe.__new__(TrainRecipe)
    recipe.req, recipe.world = TrainRequest(batch_size=16, epochs=1.0), World(rank=0, size=2)
    recipe.model = _BatchNormNet()
    recipe.workload, recipe.train_data = Workload(recipe.model, data, None, 16), data
    with pytest.raises(TightfitError, match=r"micro-batch 8 on 2 ranks splits the last window of 1 sample"):
        recipe._check_batchnorm()


_RANK_1_FAILS = """
# rank 1 alone meets an input error mid-training (as a sample's image deleted while the run reads it)
import os, sys, importlib.abc, importlib.util
if os.environ.get("RANK") == "1":
    class _Hook(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "tightfit.runtime.trainer":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                settle = module.Trainer._settle

                def failing(self, *a, **k):
                    if self.step == 2:
                        from tightfit.errors import TightfitError
                        raise TightfitError("a sample of rank 1 is gone")
                    return settle(self, *a, **k)
                module.Trainer._settle = failing
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, _Hook())
"""


def test_gpus_2_an_error_on_one_rank_mid_training_is_one_line_not_the_others_traceback(tmp_path):
    """Found by a review: a rank that meets an input error mid-training (an image deleted while
    the run read it) said so in one line and exited with 2, but the other rank, whose collective
    then lost its peer, printed gloo's "Connection closed by peer" with a 40-line traceback."""
    import os

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_RANK_1_FAILS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    model, data = _tiny_inputs(tmp_path)
    cmd = [sys.executable, "-m", "tightfit", "train", "--model", str(model), "--data", str(data), "--batch-size", "8",
           "--seq-len", "16", "--out", str(tmp_path / "run"), "--no-progress", "--device", "cpu", "--gpus", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("tightfit: error:") == 1 and "a sample of rank 1 is gone" in done.stderr
    assert "Traceback" not in done.stderr and "Connection closed by peer" not in done.stderr, done.stderr[-3000:]
