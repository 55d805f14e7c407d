"""Delivering the plan's speed: the plan cache, planning in proportion to the run, checkpoints
written in the background (taken at the step boundary, atomic, exact on resume), a resume that
reads and hashes its checkpoint once, sequence lengths compiled at planning time, and the
delivered-against-predicted report."""

import json
import math
import shutil
import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from conftest import SyntheticBatches, tiny_bert, tiny_cpu_job, tiny_text_model_folder
from tightfit.levers.blocks import find_blocks
from tightfit.plan import Plan

MiB = 2**20


# ---------------------------------------------------------------- the plan cache

def _key(model=None, **changes):
    from tightfit.planner.cache import plan_key

    args = dict(worst_case={"input_ids": torch.zeros(1, 12, dtype=torch.long)}, effective_batch=8,
                options={"precision": "auto", "checkpointing": "auto", "compile": "auto", "planner": "search"},
                card="NVIDIA H200", total_bytes=140 * 2**30, budget_bytes=4 * 2**30, run_samples=800)
    args.update(changes)
    return plan_key(model if model is not None else tiny_bert(), **args)


def test_plan_key_depends_on_what_decides_the_plan_and_not_on_the_weights():
    base = _key()
    assert _key(tiny_bert(seed=1)) == base  # other weights, same structure
    other = tiny_bert()
    other.classifier = torch.nn.Linear(32, 3)  # another head: another structure
    assert _key(other) != base
    frozen = tiny_bert()
    frozen.bert.embeddings.requires_grad_(False)
    assert _key(frozen) != base
    for change in ({"worst_case": {"input_ids": torch.zeros(1, 16, dtype=torch.long)}}, {"effective_batch": 16},
                   {"options": {"precision": "bf16", "checkpointing": "auto", "compile": "auto", "planner": "search"}},
                   {"card": "NVIDIA A100"}, {"total_bytes": 80 * 2**30}, {"budget_bytes": 8 * 2**30},
                   {"run_samples": 8000}):
        assert _key(**change) != base, change
    from tightfit.levers import blocks  # the blocks the plan's indices name, as this tightfit finds them

    real = blocks.find_blocks
    try:
        blocks.find_blocks = lambda m: real(m)[:1]
        assert _key() != base
    finally:
        blocks.find_blocks = real


def test_plan_key_depends_on_the_attention_implementation(tmp_path):
    """A model folder whose config.json is edited in place to ``"attn_implementation": "eager"``
    loads with eager attention, which holds the T x T attention matrices sdpa does not: it
    replans (config.to_dict() leaves the implementation out, so the sdpa plan was reused)."""
    from transformers import AutoModelForSequenceClassification

    folder = tmp_path / "model"
    tiny_bert().save_pretrained(folder)
    sdpa = AutoModelForSequenceClassification.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, attn_implementation="eager")))
    eager = AutoModelForSequenceClassification.from_pretrained(folder)
    assert eager.config._attn_implementation == "eager" != sdpa.config._attn_implementation
    assert _key(eager) != _key(sdpa)


def test_plan_key_depends_on_the_profiles_rates_and_the_installed_levers(monkeypatch):
    """A custom profile's speeds change the time model, and a lever library installed since the
    plan was cached adds choices: both replan (the key had the card's name alone, and no libraries)."""
    import dataclasses

    import tightfit.planner.cache as cache
    from tightfit.devices import get_profile

    h200 = dataclasses.asdict(get_profile("h200"))
    base = _key(profile=h200)
    assert _key(profile=dict(h200, bf16_tflops=h200["bf16_tflops"] / 2)) != base
    monkeypatch.setattr(cache, "lever_libraries", lambda: {"bitsandbytes": "0.50.2", "torchao": None})
    with_bnb = _key(profile=h200)
    monkeypatch.setattr(cache, "lever_libraries", lambda: {"bitsandbytes": None, "torchao": None})
    assert _key(profile=h200) != with_bnb
    import tightfit.levers.optimizers as lv  # another host's memory: offloaded state and activations fit otherwise

    monkeypatch.setattr(lv, "total_host_bytes", lambda: 16 * 2**30)
    laptop = _key(profile=h200)
    monkeypatch.setattr(lv, "total_host_bytes", lambda: 128 * 2**30)
    assert _key(profile=h200) != laptop
    alone = _key(profile=h200)  # 4 DDP ranks on the host share its pinned memory: each gets a quarter
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _key(profile=h200) != alone
    expandable = _key(profile=h200)  # the probes verified the plan under another allocator configuration
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert _key(profile=h200) != expandable


def test_plan_cache_round_trip_is_atomic_and_ignores_damaged_entries(tmp_path, monkeypatch):
    from tightfit.planner.cache import cache_dir, load_plan, store_plan

    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    plan = Plan("bf16", 16, 32, device="cuda", budget_bytes=4 * 2**30, reasons=("why",), compile=True,
                predicted_samples_per_s=123.0)
    assert load_plan("k" * 64) is None
    path = store_plan("k" * 64, plan, 12.5, timings={"probed_samples_per_s": 123.0})
    assert path.parent == tmp_path / "cache" / "plans" and not list(path.parent.glob(".*.tmp"))
    got, record = load_plan("k" * 64)
    assert got == plan and record["planning_seconds"] == 12.5 and record["timings"]["probed_samples_per_s"] == 123.0
    entry = json.loads(path.read_text())
    path.write_text(json.dumps({**entry, "format": "tightfit-plan-cache/1"}))
    assert load_plan("k" * 64) is None  # an entry of another format (older code's plans) is planned anew
    path.write_text("{not json")
    assert load_plan("k" * 64) is None  # a damaged entry only costs a fresh plan


class _Recipe(SimpleNamespace):
    pass


def _recipe(tmp_path, replan=False, **options):
    """A TrainRecipe that has reached planning on a (faked) GPU (``options``: more TrainRequest fields)."""
    from tightfit.api import TrainRecipe
    from tightfit.config import TrainRequest
    from tightfit.devices import get_profile
    from tightfit.workload import Workload

    recipe = TrainRecipe.__new__(TrainRecipe)
    recipe.req = TrainRequest(**{"batch_size": 8, "epochs": 1.0, "replan": replan, **options})
    recipe.workload = Workload(tiny_bert(), SyntheticBatches(24), None, 8)
    recipe.train_data = list(range(24))
    recipe.profile, recipe.budget, recipe.device = get_profile("h200"), 4 * 2**30, "cuda"
    recipe.plan_timings = {}
    return recipe


def test_a_second_run_of_the_same_job_takes_its_plan_from_the_cache(tmp_path, monkeypatch):
    import tightfit.planner.gpu as gpu

    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(gpu.GRAPHS_ENV, "1")  # the planner may replay CUDA graphs: not under --cuda-graphs off
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=140 * 2**30))
    calls = []

    def fake_plan_on_gpu(workload, profile, budget, seq_len, precision, checkpointing, compile, run_samples=None,
                         timings=None, optimizer="auto", cuda_graphs=True):
        calls.append(run_samples if cuda_graphs else "no graphs")
        timings.update(probed_samples_per_s=500.0, predicted_samples_per_s=450.0, compile_s=3.0)
        return Plan("bf16", 8, 8, device="cuda", budget_bytes=budget, reasons=("searched",))

    monkeypatch.setattr(gpu, "plan_on_gpu", fake_plan_on_gpu)
    first = _recipe(tmp_path)._cached_gpu_plan()
    assert calls == [24]  # 3 steps of 8 samples: the run's length reaches the planner
    second = _recipe(tmp_path)
    plan = second._cached_gpu_plan()
    assert calls == [24], "planned again"
    assert plan.reasons[0].startswith("plan from the cache") and plan.reasons[1:] == first.reasons
    assert second.plan_timings["cached"] and second.plan_timings["probed_samples_per_s"] == 500.0
    again = _recipe(tmp_path)._cached_gpu_plan()  # a plan from the cache says so once, not twice
    assert sum(r.startswith("plan from the cache") for r in again.reasons) == 1
    _recipe(tmp_path, replan=True)._cached_gpu_plan()
    assert calls == [24, 24]  # --replan plans afresh
    _recipe(tmp_path, cuda_graphs="off")._cached_gpu_plan()  # a plan that may not replay CUDA graphs: its own
    assert calls == [24, 24, "no graphs"]
    _recipe(tmp_path, deterministic=True)._cached_gpu_plan()  # compiled under deterministic kernels: its own
    assert calls == [24, 24, "no graphs", 24]


@pytest.mark.parametrize("lever", ["adamw-offload", "activation offload"])
def test_a_cached_adamw_offload_plan_that_the_host_memory_now_free_would_not_hold_is_planned_anew(tmp_path,
                                                                                                  monkeypatch, lever):
    """Found by a review: the key holds the host's total memory, but the planner sizes its
    host-memory levers to the memory free when it plans; a plan made with plenty free was taken
    from the cache on a host with little free, and the run refused its adamw-offload."""
    import tightfit.levers.optimizers as levers
    import tightfit.planner.gpu as gpu

    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=140 * 2**30))
    calls = []
    fields = {"optimizer": "adamw-offload"} if lever == "adamw-offload" else {"block_policies": ("offload", "none")}

    def fake_plan_on_gpu(workload, profile, budget, *a, **k):
        calls.append(1)
        return Plan("bf16", 8, 8, device="cuda", budget_bytes=budget, reasons=("searched",), **fields)

    monkeypatch.setattr(gpu, "plan_on_gpu", fake_plan_on_gpu)
    monkeypatch.setattr(levers, "available_host_bytes", lambda: 64 * 2**30)
    monkeypatch.setattr(levers, "is_offloaded", lambda numel: True)  # the tiny model's tensors too
    _recipe(tmp_path)._cached_gpu_plan()
    assert _recipe(tmp_path)._cached_gpu_plan().reasons[0].startswith("plan from the cache") and calls == [1]
    monkeypatch.setattr(levers, "available_host_bytes", lambda: 2**16)
    # adamw-offload's state is re-checked; offloaded activations are not (their bytes are not kept:
    # a review found a drop of 10% from the memory free when planned replanned them on ordinary swings)
    anew = lever == "adamw-offload"
    assert _recipe(tmp_path)._cached_gpu_plan().reasons[0].startswith("plan from the cache") is not anew
    assert calls == ([1, 1] if anew else [1])


def test_a_run_that_compiles_nothing_takes_its_plan_from_the_cache_for_any_length(tmp_path, monkeypatch):
    """The run's length decides only whether compilation repays itself: with --compile off (or
    the probe planner) a longer run of the same job takes the cached plan (it was replanned)."""
    import tightfit.planner.gpu as gpu

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=140 * 2**30))
    calls = []

    def fake_plan_on_gpu(workload, profile, budget, seq_len, precision, checkpointing, compile, run_samples=None,
                         timings=None, optimizer="auto", cuda_graphs=True):
        calls.append((compile, run_samples))
        return Plan("bf16", 8, 8, device="cuda", budget_bytes=budget, reasons=("searched",))

    monkeypatch.setattr(gpu, "plan_on_gpu", fake_plan_on_gpu)
    _recipe(tmp_path, compile="off")._cached_gpu_plan()
    assert _recipe(tmp_path, compile="off", epochs=3.0)._cached_gpu_plan().reasons[0].startswith("plan from the cache")
    assert calls == [("off", 24)]
    _recipe(tmp_path)._cached_gpu_plan()
    _recipe(tmp_path, epochs=3.0)._cached_gpu_plan()  # compile auto: the length may decide it
    assert calls == [("off", 24), ("auto", 24), ("auto", 72)]


def test_the_probe_planner_probes_the_optimizer_asked_for(tmp_path, monkeypatch):
    """--planner probe --optimizer adamw8bit probed with fp32 AdamW state and only named the
    lever in the plan: where 8-bit state fits and fp32 state does not, it said nothing fits."""
    import tightfit.planner.probe as probe

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=140 * 2**30))
    probed = []

    def fake_probe_step(workload, micro_batch, precision, budget_bytes, timed_steps=2, optimizer="adamw"):
        probed.append(optimizer)  # fp32 AdamW's state alone is over the budget, 8-bit state fits
        fits = optimizer != "adamw"
        return probe.ProbeResult(micro_batch, fits, 1 << 30 if fits else None, None, 0.01 if fits else None)

    monkeypatch.setattr(probe, "probe_step", fake_probe_step)
    plan = _recipe(tmp_path, planner="probe", optimizer="adamw8bit")._cached_gpu_plan()
    assert plan.optimizer == "adamw8bit" and plan.micro_batch == 8 and set(probed) == {"adamw8bit"}


def _fake_gpu_plan(monkeypatch, run_samples, compile="auto", runners_up=(), probes=None):
    """plan_on_gpu on the CPU with the search's answer and every probe faked (eager 240 samples/s, 220
    timed again; compiled 400, 380 timed again); ``probes`` collects the probed micro-batches."""
    import tightfit.planner.gpu as gpu
    from tightfit.devices import get_profile
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate, SearchResult

    E = 64
    a = Candidate("bf16", 32, (), 2, 900, 900, {}, 300.0, "fastest predicted")
    result = SearchResult(a, list(runners_up), 10**9, E, 4, 0.1)
    compiled = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        if probes is not None:
            probes.append(mb)
        # eager: 240 in the verification's 2 timed steps, 220 when timed again with 5 (the steady state)
        # compiled: 400, and 380 when timed again with 5 (compiled plans with --compile on)
        retimed = timed_steps == gpu.RETIMED_STEPS
        sps = (380.0 if retimed else 400.0) if compiled else (220.0 if retimed else 240.0)
        return ProbeResult(mb, True, 500 * MiB, 500 * MiB, E / (sps * math.ceil(E / mb)), 1)

    monkeypatch.setattr(gpu, "search_optimizers", lambda *a, **k: result)
    monkeypatch.setattr(gpu, "estimator_for", lambda *a, **k: None)
    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    monkeypatch.setattr(gpu, "compile_unavailable", lambda device: None)
    monkeypatch.setattr(gpu, "compile_scope", lambda m: "model")
    monkeypatch.setattr(gpu, "compile_model", lambda m, scope=None: compiled.append(1))
    monkeypatch.setattr(gpu, "uncompile_model", lambda m: compiled.clear())
    monkeypatch.setattr(gpu, "set_activation_checkpointing", lambda *a, **k: None)
    w = SimpleNamespace(effective_batch=E, model=torch.nn.Linear(1, 1), train=None)
    timings = {}
    plan = gpu.plan_on_gpu(w, get_profile("h200"), 10**9, 16, run_samples=run_samples, timings=timings,
                           compile=compile)
    return plan, timings


def test_a_run_too_short_to_repay_compilation_is_not_compiled_and_the_reason_says_so(monkeypatch):
    short, timings = _fake_gpu_plan(monkeypatch, run_samples=240 * 30)  # 30 s at the eager 240 samples/s
    assert not short.compile
    assert any("torch.compile not tried: the run is predicted to take 30 s" in r for r in short.reasons)
    # the probed speed is the chosen plan timed again (5 steps), not the verification's figure
    assert timings["probed_samples_per_s"] == pytest.approx(220.0) and timings["predicted_samples_per_s"] == 300.0
    assert any(r.startswith("the plan timed again (5 timed steps, the median)") and "220 samples/s" in r
               for r in short.reasons)
    assert {"search_s", "verify_s", "compile_s"} <= set(timings)
    # the planner's own time, by stage; no second "planning took" beside the one `tightfit train` logs
    # for the whole planning (a cached plan carried the first run's into a run that planned in 0.1 s)
    assert not any("planning took" in r for r in short.reasons), short.reasons
    stages = [r for r in short.reasons if r.startswith("where the planner's time went")]
    assert len(stages) == 1, stages
    assert all(w in stages[0] for w in ("search", "verification on the GPU", "compilation")), stages
    long, timings = _fake_gpu_plan(monkeypatch, run_samples=240 * 600)
    # retimed side by side (5 steps each): compiled 380 vs eager 220, compiled kept
    assert long.compile and timings["probed_samples_per_s"] == pytest.approx(380.0)
    forced, timings = _fake_gpu_plan(monkeypatch, run_samples=240 * 30, compile="on")
    # --compile on: no retiming, so the compiled plan is timed again for its probed speed
    assert forced.compile and timings["probed_samples_per_s"] == pytest.approx(380.0)
    assert any(r.startswith("the plan timed again (5 timed steps") for r in forced.reasons)


def test_a_single_candidate_is_not_calibrated(monkeypatch):
    from tightfit.planner.search import Candidate

    probes = []
    plan, _ = _fake_gpu_plan(monkeypatch, run_samples=240 * 30, probes=probes)
    # its verification and its timing again: no probe at a quarter of its micro-batch, nothing to re-rank
    assert probes == [32, 32] and not any(r.startswith("calibrated with probes") for r in plan.reasons)
    probes.clear()
    other = Candidate("bf16", 64, (0,), 1, 900, 900, {}, 250.0, "slower")
    plan, _ = _fake_gpu_plan(monkeypatch, run_samples=240 * 30, runners_up=[other], probes=probes)
    assert probes[:2] == [32, 8] and any(r.startswith("calibrated with probes") for r in plan.reasons)


# ---------------------------------------------------------------- sequence lengths compiled while planning

def test_the_warm_up_length_is_another_padded_length_of_text_data():
    from tightfit.planner.warmup import _AtLength, other_length
    from tightfit.workload import DatasetBatches

    data = SyntheticBatches(24, seq_len=32)
    assert other_length(data) == 16
    assert _AtLength(data, 16).worst_case(3)["input_ids"].shape == (3, 16)
    run = data.collate([0, 1, 2])
    for padded in (True, False):  # the warm-up's batches are the run's: same keys and dtypes
        warm = _AtLength(data, 16, padded).collate([0, 1, 2])
        assert {k: v.dtype for k, v in warm.items()} == {k: v.dtype for k, v in run.items()}
        assert bool((warm["attention_mask"] == 0).any()) == padded  # with padding, or none at all
    assert other_length(SyntheticBatches(24, seq_len=8)) is None  # half of 8 rounds to nothing
    # TorchInductor guards some kernels on a length's alignment to 8: data padded otherwise is
    # warmed up at an unaligned length too
    from tightfit.planner.warmup import pads_to_multiple
    assert not pads_to_multiple(data) and pads_to_multiple(SyntheticBatches(24, seq_len=32, pad_multiple=8))
    assert other_length(DatasetBatches([(torch.zeros(3), 0)] * 4)) is None  # fixed-size samples


class _Batch:
    """One batch of ``data``'s own collate (padded to its longest sample, as in the run) as the
    probe's worst case."""

    def __init__(self, data, indices):
        self.data, self.indices = data, indices

    def __len__(self):
        return len(self.data)

    def collate(self, indices, pad_to=None):
        return self.data.collate(self.indices)

    def worst_case(self, n):
        return self.collate(self.indices)


@pytest.mark.parametrize("padded_worst_case", [True, False])
@pytest.mark.parametrize("mask_4d", [True, False])
def test_after_the_warm_up_run_batches_of_any_length_with_or_without_padding_do_not_recompile(monkeypatch,
                                                                                               padded_worst_case,
                                                                                               mask_4d):
    """TorchDynamo's guards and automatic dynamic shapes, on the CPU with a backend that runs the
    traced graph as it is: the run's batches reuse what the planner compiled, and the planner
    compiles each kind of call once. BERT with SDPA, handed its 2-D mask, gives its layers no mask
    for a batch without padding and a mask tensor otherwise (two graphs); handed the 4-D mask
    (tightfit.masks, ``mask_4d``) it gives them a mask tensor always (one graph)."""
    import functools

    import torch._dynamo

    import tightfit.planner.warmup as warmup
    from tightfit.levers.compile import compile_model
    from tightfit.planner.probe import run_probe_steps
    from tightfit.workload import Workload

    graphs = []  # each graph TorchDynamo compiles (the block's forward, for one kind of call)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=lambda gm, inputs: graphs.append(
        gm) or gm.forward))
    monkeypatch.setattr(warmup, "probe_step", lambda w, mb, precision, budget, timed_steps, optimizer:
                        run_probe_steps(w, mb, precision, optimizer, timed_steps))
    data = SyntheticBatches(64, seq_len=32)
    data.lengths = ([32] * 8 if not padded_worst_case else [5] + [32] * 7) + [24] * 8 + [8] * 8 + [3, 30] * 20
    if not mask_4d:
        monkeypatch.setattr("tightfit.masks.ENCODERS", frozenset())
    w = Workload(tiny_bert(dropout=0.1), data, None, 8)
    torch._dynamo.reset()
    try:
        compile_model(w.model)
        with warmup.any_length(data):  # the planner's probes: the worst case, 32 tokens
            run_probe_steps(w, 8, "fp32", "adamw", 1)
            reason, = warmup.warm_other_lengths(w, 8, (), "fp32", 2**30)
            # one step per kind of batch, at 16 tokens and (the data not padded to 8) at 17
            assert f"{2 if mask_4d else 4} warm-up step(s) at 16 and 17 tokens" in reason
        assert len(graphs) == (1 if mask_4d else 2)  # with a mask (and without), each once for every length
        batches = [range(8, 16), range(8, 12), range(16, 19), range(15, 19), [24, 26, 28], range(24, 30),
                   range(1, 5)]  # 24 and 8 tokens without padding, then with; 32 with, then without
        with torch._dynamo.config.patch(error_on_recompile=True):
            for indices in batches:
                run_probe_steps(replace(w, train=_Batch(data, list(indices))), len(indices), "fp32", "adamw", 1)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("scope", [None, "model"])
def test_the_evaluation_after_a_compiled_run_compiles_nothing(monkeypatch, scope):
    """The graphs compiled for training are guarded on grad mode: the evaluation's no_grad forward
    compiled the model again at the run's end (a block, or the whole model), and again at each
    evaluation length. It runs eagerly, and the model is left compiled. On the CPU with a backend
    that runs the traced graph as it is; dropout on, so that eval mode is seen to hold."""
    import functools

    import torch._dynamo

    import tightfit.planner.warmup as warmup
    import tightfit.runtime.trainer as trainer_mod
    from tightfit.levers.compile import compiled_call
    from tightfit.planner.probe import run_probe_steps
    from tightfit.runtime.trainer import Trainer, TrainConfig
    from tightfit.workload import Workload

    graphs = []
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=lambda gm, inputs: graphs.append(
        gm) or gm.forward))
    monkeypatch.setattr(warmup, "probe_step", lambda w, mb, precision, budget, timed_steps=2, optimizer="adamw":
                        run_probe_steps(w, mb, precision, optimizer, timed_steps))
    monkeypatch.setattr(trainer_mod, "compile_unavailable", lambda device: None)
    data = SyntheticBatches(32, seq_len=32, pad_multiple=8)
    w = Workload(tiny_bert(dropout=0.1), data, SyntheticBatches(12, seq_len=32, seed=1), 8)
    plan = Plan("fp32", 8, 8, activation_checkpointing=scope == "model", compile=True, compile_scope=scope)
    eager = Trainer(replace(w, model=tiny_bert(dropout=0.1)), replace(plan, compile=False),
                    TrainConfig(max_steps=2, checkpoint_dir=None), progress=False).fit().eval
    torch._dynamo.reset()
    try:
        warmup.warm_compiled_plan(w, plan, 2**30)  # what planning compiles
        compiled = len(graphs)
        trainer = Trainer(w, plan, TrainConfig(max_steps=2, checkpoint_dir=None), progress=False)
        result = trainer.fit()
        assert len(graphs) == compiled, "the run compiled again"
        assert result.eval["samples"] == 12 and result.eval["accuracy"] == eager["accuracy"]
        assert result.eval["loss"] == pytest.approx(eager["loss"], rel=1e-4)  # the weights trained eagerly, in eval mode
        modules = find_blocks(w.model) if scope is None else [w.model]
        assert all(compiled_call(m) is not None for m in modules)  # still compiled for training
    finally:
        torch._dynamo.reset()


# ---------------------------------------------------------------- checkpoints in the background

def _model_and_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].weight = torch.nn.Parameter(model[1].weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, {"step": 1, "optimizer": opt.state_dict(), "rng": torch.get_rng_state()}


def test_a_background_checkpoint_holds_the_state_of_its_step_boundary(tmp_path, monkeypatch):
    import tightfit.runtime.checkpoint as ckpt
    from tightfit.runtime.async_checkpoint import CheckpointWriter

    model, state = _model_and_state()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_avg = state["optimizer"]["state"][0]["exp_avg"].clone()
    release, started = threading.Event(), threading.Event()
    clean = ckpt.remove_stale_temporaries  # the writer's first call, before any file is written

    def slow_start(folder):
        started.set()
        release.wait(10)
        return clean(folder)

    monkeypatch.setattr(ckpt, "remove_stale_temporaries", slow_start)
    writer = CheckpointWriter(tmp_path, keep_last=2)
    path = writer.save(1, model, state)
    assert started.wait(10)
    assert not path.exists()  # still being written: nothing in place yet
    with torch.no_grad():  # the next steps change the weights and the state in place
        for p in model.parameters():
            p.add_(1.0)
        state["optimizer"]["state"][0]["exp_avg"].add_(1.0)
    release.set()
    writer.close()
    saved = load_file(path / "model.safetensors")
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    assert torch.equal(ckpt.read_state(path)["optimizer"]["state"][0]["exp_avg"], expected_avg)
    assert ckpt.verify_checkpoint(path)


def test_a_failed_background_write_leaves_no_checkpoint_and_is_raised(tmp_path, monkeypatch):
    import tightfit.runtime.checkpoint as ckpt
    from tightfit.runtime.async_checkpoint import CheckpointWriter

    model, state = _model_and_state()
    writer = CheckpointWriter(tmp_path, keep_last=2)
    writer.save(1, model, state)
    writer.flush()

    def broken(path):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "sha256_file", broken)
    writer.save(2, model, state)
    with pytest.raises(ckpt.CheckpointWriteError, match="checkpoint ckpt-2 could not be written: disk full"):
        writer.flush()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-1"]  # no half checkpoint
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_background_and_foreground_checkpoints_are_the_same(tmp_path):
    from tightfit.runtime.checkpoint import read_state, save_checkpoint
    from tightfit.runtime.async_checkpoint import CheckpointWriter

    model, state = _model_and_state()
    save_checkpoint(tmp_path / "fg", 1, model, state)
    writer = CheckpointWriter(tmp_path / "bg")
    writer.save(1, model, state)
    writer.close()
    a, b = (load_file(tmp_path / d / "ckpt-1" / "model.safetensors") for d in ("fg", "bg"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = (read_state(tmp_path / d / "ckpt-1") for d in ("fg", "bg"))
    assert torch.equal(sa["rng"], sb["rng"]) and sa["optimizer"]["state"][0]["exp_avg"].equal(
        sb["optimizer"]["state"][0]["exp_avg"])


def _fit(make_workload, folder, resume=None):
    from tightfit.runtime.trainer import TrainConfig, Trainer

    w = make_workload(n=48, effective_batch=8, dropout=0.1)
    cfg = TrainConfig(checkpoint_dir=str(folder), checkpoint_every=2, max_steps=6, keep_last=10, lr=1e-3, seed=3,
                      log_every=1, prefetch=False, background_checkpoints=True)
    losses = []
    trainer = Trainer(w, Plan("fp32", 4, 8), cfg, progress=False,
                      log=lambda r: losses.append((r["step"], r["loss"])) if r["type"] == "train" else None)
    if resume:
        trainer.resume(resume)
    trainer.fit()
    return trainer, dict(losses)


def test_a_run_resumed_from_a_background_checkpoint_reproduces_the_uninterrupted_one(make_workload, tmp_path):
    full, full_losses = _fit(make_workload, tmp_path / "full")
    assert full.result.checkpoint_write_seconds > 0 and full.result.checkpoint_seconds > 0
    for step in (2, 4):
        resumed, rest = _fit(make_workload, tmp_path / f"from-{step}", resume=tmp_path / "full" / f"ckpt-{step}")
        assert rest == {k: v for k, v in full_losses.items() if k > step}
        a, b = full.model.state_dict(), resumed.model.state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resumed_whole_model_compiled_run_reproduces_the_uninterrupted_one(tmp_path, monkeypatch):
    """A plan compiled as one whole-model graph with Hugging Face's checkpointing inside, dropout
    on: resumed from its step-2 checkpoint in a new trainer (the resume compiles first, as
    ``tightfit train --resume`` does), the losses of steps 3-6 are the uninterrupted run's, bit for
    bit. On the CPU with AOTAutograd's eager backend (the partitioner, the recomputation and the
    random ops as compiled; TorchInductor's CPU code gave the same in a 2-minute check)."""
    import functools

    import torch._dynamo

    import tightfit.planner.warmup as warmup
    import tightfit.runtime.trainer as trainer_mod
    from tightfit.planner.probe import run_probe_steps
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(warmup, "probe_step", lambda w, mb, precision, budget, timed_steps=2, optimizer="adamw":
                        run_probe_steps(w, mb, precision, optimizer, timed_steps))
    monkeypatch.setattr(trainer_mod, "compile_unavailable", lambda device: None)
    plan = Plan("fp32", 4, 8, activation_checkpointing=True, compile=True, compile_scope="model")

    def fit(folder, resume=None):
        w = Workload(tiny_bert(dropout=0.1), SyntheticBatches(48, seq_len=16, pad_multiple=8), None, 8)
        warmup.warm_compiled_plan(w, plan, 2**30)
        cfg = TrainConfig(checkpoint_dir=str(folder), checkpoint_every=2, max_steps=6, keep_last=10, lr=1e-3, seed=3,
                          log_every=1, prefetch=False)
        losses = {}
        trainer = Trainer(w, plan, cfg, progress=False,
                          log=lambda r: losses.update({r["step"]: r["loss"]}) if r["type"] == "train" else None)
        if resume:
            trainer.resume(resume)
        trainer.fit()
        return trainer, losses

    torch._dynamo.reset()
    try:
        full, full_losses = fit(tmp_path / "full")
        torch._dynamo.reset()  # a new process: nothing compiled
        resumed, rest = fit(tmp_path / "resumed", resume=tmp_path / "full" / "ckpt-2")
    finally:
        torch._dynamo.reset()
    assert rest == {k: v for k, v in full_losses.items() if k > 2}
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_training_returns_only_once_its_last_checkpoint_is_in_place(make_workload, tmp_path, monkeypatch):
    import time as clock

    import tightfit.runtime.checkpoint as ckpt
    from tightfit.runtime.trainer import TrainConfig, Trainer

    hashing = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: clock.sleep(0.3) or hashing(path))  # a slow disk
    cfg = TrainConfig(checkpoint_dir=str(tmp_path), checkpoint_every=1, max_steps=2, prefetch=False)
    trainer = Trainer(make_workload(n=16, effective_batch=8), Plan("fp32", 8, 8), cfg, progress=False)
    trainer.fit()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["ckpt-1", "ckpt-2"]
    assert ckpt.verify_checkpoint(tmp_path / "ckpt-2")
    assert trainer.result.checkpoint_write_seconds >= 2 * 0.3  # hashed in the background


def test_the_last_checkpoint_is_written_while_the_model_is_evaluated(make_workload, tmp_path, monkeypatch):
    import time as clock

    import tightfit.runtime.checkpoint as ckpt
    from tightfit.runtime.trainer import TrainConfig, Trainer

    hashing = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: clock.sleep(0.3) or hashing(path))  # a slow disk
    cfg = TrainConfig(checkpoint_dir=str(tmp_path), checkpoint_every=0, max_steps=2, prefetch=False)
    trainer = Trainer(make_workload(n=16, effective_batch=8), Plan("fp32", 8, 8), cfg, progress=False)
    evaluate, in_place = trainer.evaluate, []

    def slow_evaluation():
        clock.sleep(1.0)
        in_place.append((tmp_path / "ckpt-2").exists())
        return evaluate()

    monkeypatch.setattr(trainer, "evaluate", slow_evaluation)
    trainer.fit()
    assert in_place == [True]  # the write (0.3 s of hashing) ended during the evaluation
    assert ckpt.verify_checkpoint(tmp_path / "ckpt-2")
    assert trainer.result.checkpoint_seconds < 0.3 <= trainer.result.checkpoint_write_seconds


def test_the_files_of_a_checkpoint_are_hashed_at_the_same_time(tmp_path, monkeypatch):
    import time as clock

    import tightfit.runtime.checkpoint as ckpt

    hashing = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda path: clock.sleep(0.5) or hashing(path))
    model, state = _model_and_state()
    t0 = clock.perf_counter()
    path = ckpt.save_checkpoint(tmp_path, 1, model, state)
    assert clock.perf_counter() - t0 < 0.9  # 0.5 s for each of the three files, side by side
    assert ckpt.verify_checkpoint(path)


def test_checkpoints_reuse_one_set_of_host_buffers(tmp_path):
    from tightfit.runtime.async_checkpoint import CheckpointWriter

    model, state = _model_and_state()
    writer = CheckpointWriter(tmp_path)
    snaps = []
    original = writer._write
    writer._write = lambda step, snap, *rest: snaps.append(snap) or original(step, snap, *rest)
    for step in (1, 2):
        writer.save(step, model, state)
    writer.close()
    first, second = snaps
    assert first.weights.keys() == second.weights.keys()
    assert all(first.weights[k].data_ptr() == second.weights[k].data_ptr() for k in first.weights)
    exp_avg = [s.state["optimizer"]["state"][0]["exp_avg"] for s in snaps]
    assert exp_avg[0].data_ptr() == exp_avg[1].data_ptr()
    tensors = [*model.state_dict().values(), state["rng"], *state["optimizer"]["state"][0].values(),
               *state["optimizer"]["state"][1].values(), *state["optimizer"]["state"][2].values(),
               *state["optimizer"]["state"][3].values()]
    assert writer.host_bytes == sum(t.numel() * t.element_size() for t in tensors)  # one copy of everything


def test_resume_reads_and_hashes_the_checkpoint_once(tmp_path, monkeypatch):
    import tightfit.api as api
    import tightfit.runtime.checkpoint as ckpt

    run, common = tmp_path / "run", tiny_cpu_job(tmp_path)
    api.train(api.TrainRequest(**common, max_steps=4, checkpoint_every=2, out=str(run)))
    hashed, loaded = [], []
    sha, load = ckpt.sha256_file, torch.load
    monkeypatch.setattr(ckpt, "sha256_file", lambda p: hashed.append(p.name) or sha(p))
    monkeypatch.setattr(torch, "load", lambda p, *a, **k: loaded.append(str(p)) or load(p, *a, **k))
    recipe = api.TrainRecipe(api.TrainRequest(**common, resume=str(run)))
    recipe.setup()
    assert sorted(hashed) == ["model.safetensors", "state.pt", "state.safetensors"]  # each file hashed once
    assert [p for p in loaded if p.endswith("state.pt")] == [str(run / "checkpoints" / "ckpt-4" / "state.pt")]
    assert recipe.trainer.step == 4


def test_a_resumed_run_compiles_its_plan_before_training(tmp_path, monkeypatch):
    """The plan from the checkpoint compiled nothing in the resumed process: without a warm-up the
    run's first batches compiled the model, length after length (a resumed BERT-large at 4 GiB on
    an NVIDIA H200: 273 s in its first 10 steps). The resume warms the checkpoint's plan first."""
    import tightfit.api as api
    import tightfit.planner.warmup as warmup

    run, common = tmp_path / "run", tiny_cpu_job(tmp_path)
    warmed = []
    monkeypatch.setattr(warmup, "warm_compiled_plan", lambda w, plan, budget: warmed.append(plan) or 2.5)
    api.train(api.TrainRequest(**common, max_steps=4, checkpoint_every=2, out=str(run)))
    recipe = api.TrainRecipe(api.TrainRequest(**common, resume=str(run)))
    recipe.setup()
    assert warmed == []  # on the CPU nothing is compiled
    recipe.device = "cuda"  # as on a GPU (the CPU cannot run the rest of _plan)
    recipe._compile_before_training()
    assert [p.to_dict() for p in warmed] == [recipe.plan.to_dict()]  # the checkpoint's plan, warmed once
    assert recipe.plan_timings["compile_s"] == 2.5  # and its time shown as compilation
    fresh = api.TrainRecipe(api.TrainRequest(**common, max_steps=4, out=str(tmp_path / "fresh")))
    fresh.setup()
    fresh.device = "cuda"
    fresh._compile_before_training()
    assert len(warmed) == 1  # a fresh plan: the planner compiled what it compiled


def test_a_resumed_runs_times_are_the_whole_runs(tmp_path):
    """After a resume, summary.json mixed whole-run figures (steps, train_seconds) with the resumed
    session's alone (wall_seconds under train_seconds, checkpoint times of the last session only,
    planning the read-back of the plan). The checkpoint carries the earlier sessions' wall and
    checkpoint times, and the first run's planning time is reported, said to be the first run's."""
    import tightfit.api as api

    run, common = tmp_path / "run", tiny_cpu_job(tmp_path)
    api.train(api.TrainRequest(**common, max_steps=4, checkpoint_every=2, out=str(run)))
    first = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()  # as if stopped after step 2's checkpoint
    shutil.rmtree(run / "checkpoints" / "ckpt-4")
    state = torch.load(run / "checkpoints" / "ckpt-2" / "state.pt", weights_only=True)
    carried = state["counters"]
    assert carried["wall_seconds"] >= carried["train_seconds"] > 0 and carried["checkpoint_seconds"] >= 0
    api.train(api.TrainRequest(**common, resume=str(run)))
    second = json.loads((run / "summary.json").read_text())
    assert second["wall_seconds"] >= second["train_seconds"] + carried["wall_seconds"] - carried["train_seconds"]
    assert second["speed"]["checkpoint_write_seconds"] >= carried["checkpoint_write_seconds"]
    assert second["speed"]["planning_seconds"] == first["speed"]["planning_seconds"]
    assert second["speed"]["plan_from_checkpoint"] and not first["speed"]["plan_from_checkpoint"]
    assert second["speed"]["planning_of_first_run"] and not first["speed"]["planning_of_first_run"]
    assert "(the first run's; this run took its plan from the checkpoint)" in (run / "report.md").read_text()


def test_a_resume_without_the_first_runs_metrics_still_says_its_plan_is_the_checkpoints(tmp_path):
    """With metrics.jsonl gone the first run's planning time is unknown: the summary said
    plan_from_checkpoint false, and the report showed the read-back of the plan as planning."""
    import tightfit.api as api

    run, common = tmp_path / "run", tiny_cpu_job(tmp_path)
    api.train(api.TrainRequest(**common, max_steps=4, checkpoint_every=2, out=str(run)))
    (run / "summary.json").unlink()  # as if stopped after step 2's checkpoint
    shutil.rmtree(run / "checkpoints" / "ckpt-4")
    (run / "metrics.jsonl").unlink()
    api.train(api.TrainRequest(**common, resume=str(run)))
    speed = json.loads((run / "summary.json").read_text())["speed"]
    assert speed["plan_from_checkpoint"] and not speed["planning_of_first_run"]
    assert "(this run read its plan from the checkpoint; the first run's planning time is not in metrics.jsonl)" \
        in (run / "report.md").read_text()


def test_a_resumed_run_reports_against_the_first_runs_predicted_and_probed_speeds(tmp_path, monkeypatch):
    """The resumed run's plan is the checkpoint's, not timed again: its summary showed "predicted -;
    probed -". The first run's plan record carries them, and the resume reads them from there."""
    import tightfit.api as api

    run, common = tmp_path / "run", tiny_cpu_job(tmp_path)
    plan = api.TrainRecipe._plan

    def planned(self):  # as the GPU planner fills its timings
        plan(self)
        if self.resume_from is None:
            self.plan_timings.update(predicted_samples_per_s=450.0, probed_samples_per_s=400.0)

    monkeypatch.setattr(api.TrainRecipe, "_plan", planned)
    api.train(api.TrainRequest(**common, max_steps=4, checkpoint_every=2, out=str(run)))
    (run / "summary.json").unlink()  # as if stopped before the end
    summary = api.train(api.TrainRequest(**common, resume=str(run)))
    speed = json.loads((run / "summary.json").read_text())["speed"]
    assert speed["predicted_samples_per_s"] == 450.0 and speed["probed_samples_per_s"] == 400.0
    assert summary is not None


# ---------------------------------------------------------------- delivered against predicted

def test_steady_state_is_the_median_of_ten_step_windows_and_the_report_shows_all_speeds():
    from tightfit.report.speed import speed_record, speed_rows, steady_samples_per_s

    # 30 steps of 8 samples: the first window is slow (warm-up), the others 0.1 s per step
    ends, t = [], 0.0
    for step in range(1, 31):
        t += 1.0 if step <= 10 else 0.1
        ends.append((t, 8 * step))
    assert steady_samples_per_s(ends) == pytest.approx(80.0)
    assert steady_samples_per_s(ends[:9]) is None
    result = SimpleNamespace(step_ends=ends, samples_per_s=240 / t, eval_seconds=1.5, checkpoint_seconds=0.25,
                             checkpoint_write_seconds=2.0, train_seconds=t)
    speed = speed_record(result, 0.4, {"cached": True, "predicted_samples_per_s": 90.0,
                                       "probed_samples_per_s": 100.0, "compile_s": 7.0})
    assert speed["steady_vs_probed"] == pytest.approx(0.8) and speed["plan_cached"]
    text = dict(speed_rows(speed))
    assert "predicted 90; probed 100; delivered 80 steady" in text["speed, samples/s"]
    assert "|" not in text["speed, samples/s"]  # a cell of report.md's Markdown table
    assert "not yet a steady state" not in text["speed, samples/s"]  # 3 windows: the warm-up one is outvoted
    # 18 steps: one window, the first steps' own (a fresh user's run read 14.3 steady against 23.2 whole)
    short = SimpleNamespace(**{**vars(result), "step_ends": ends[:18]})
    said = dict(speed_rows(speed_record(short, 0.4, {})))["speed, samples/s"]
    assert "median of 10-step windows; only 1, the first steps' warm-up included: not yet a steady state" in said
    assert "plan from the cache" in text["time: planning"]
    assert "compilation before training 7.0 s" in text["time: planning"]  # not within the 0.4 s
    fresh = dict(speed_rows(speed_record(result, 40.0, {"compile_s": 25.0})))
    assert fresh["time: planning"] == "40.0 s, of which compilation 25.0 s"  # a stage of the 40 s, not 65 s in all
    assert text["time: evaluation"] == "1.5 s"
    assert text["time: checkpoints"].startswith(f"0.25 s holding the loop ({25 / t:.1f}% of the training time)")
    json.dumps(speed)


def test_a_slow_run_shows_its_whole_run_speed_as_the_summary_does():
    """A CPU run at 2.5 samples/s: the speed row said "3 whole run" under "samples/s 2.5"."""
    from tightfit.report.speed import speed_record, speed_rows

    result = SimpleNamespace(step_ends=[(12.7, 32)], samples_per_s=32 / 12.7, eval_seconds=1.0,
                             checkpoint_seconds=0.0, checkpoint_write_seconds=0.0)
    text = dict(speed_rows(speed_record(result, 0.0, {})))["speed, samples/s"]
    assert "predicted -; probed -; delivered - steady" in text and "2.52 whole run" in text, text
    assert "none: this session ran under 10 steps" in text  # why there is no steady figure (a short resume)


def test_each_speed_reads_the_same_in_the_summary_the_plan_and_the_speed_row():
    """The whole run's samples/s read "32.4" in the summary's row and "32 whole run" in the speed
    row below it (terminal and report.md), and a predicted 45.67 read "45.7" in the plan's lines
    and "46" in the speed row: three formats of one figure. Now one (tightfit.units.format_rate)."""
    from tightfit.report.speed import speed_record, speed_rows
    from tightfit.report.summary import RunInfo, plan_lines, summary_rows

    info = RunInfo("m", "d", 16, 10, ["a", "b"], 0.5, "CPU", None, "2", "0", "tightfit train")
    plan = Plan("fp16", 8, 8, device="cuda", predicted_samples_per_s=45.67)
    for whole_run in (32.38, 2.52, 1355.3, 7.0):
        result = SimpleNamespace(eval=None, steps=12, samples=96, train_seconds=96 / whole_run,
                                 samples_per_s=whole_run, final_loss=0.7, peak_reserved_bytes=None, skipped_steps=0,
                                 oom_recoveries=0, plan=plan, step_ends=[(i / whole_run * 8, 8 * i) for i in range(1, 13)],
                                 eval_seconds=0.0, checkpoint_seconds=0.0, checkpoint_write_seconds=0.0)
        shown = dict(summary_rows(result, info))["samples/s"]
        speed = dict(speed_rows(speed_record(result, 0.0, {"predicted_samples_per_s": 45.67})))["speed, samples/s"]
        assert f"{shown} whole run" in speed and f", {shown} whole run" in speed, (shown, speed)
        predicted = next(line for line in plan_lines(plan) if line.startswith("predicted"))
        assert predicted.startswith("predicted        45.7 samples/s") and "predicted 45.7;" in speed, (predicted, speed)


# ---------------------------------------------------------------- on a GPU

@pytest.mark.gpu
def test_after_the_planning_warm_up_other_lengths_do_not_recompile():
    import torch._dynamo

    from tightfit.levers.compile import compile_model
    from tightfit.planner.probe import probe_step
    from tightfit.planner.warmup import _AtLength, any_length, warm_other_lengths
    from tightfit.workload import Workload

    w = Workload(tiny_bert(dropout=0.1).cuda(), SyntheticBatches(64, seq_len=32), None, 8)
    compile_model(w.model)
    budget = 8 * 2**30
    with any_length(w.train):  # as the planner does
        assert probe_step(w, 8, "bf16", budget, timed_steps=1).fits  # compiled at the worst case (32 tokens)
        assert warm_other_lengths(w, 8, (), "bf16", budget)
    with torch._dynamo.config.patch(error_on_recompile=True):
        # other lengths (17: not a multiple of 8, as this data pads), a short last micro-batch
        for length, mb in ((24, 8), (8, 3), (17, 8), (32, 5)):
            for padded in (True, False, None):  # with padding, without, as collated
                assert probe_step(replace(w, train=_AtLength(w.train, length, padded)), mb, "bf16", budget,
                                  timed_steps=1).fits


@pytest.mark.gpu
def test_a_background_checkpoint_from_the_gpu_holds_its_step(tmp_path):
    from tightfit.runtime.async_checkpoint import CheckpointWriter
    from tightfit.runtime.checkpoint import read_state

    model, state = _model_and_state()
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    opt.step()
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(tmp_path)
    path = writer.save(1, model, {"optimizer": opt.state_dict()})
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # queued right after the copies: must not reach them
    writer.close()
    saved = load_file(path / "model.safetensors")
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    assert read_state(path)["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"


def test_the_probes_step_time_is_the_median_of_its_timed_steps_not_the_fastest(monkeypatch):
    """A host-bound step's fastest of a few timings over-states the run's steady state: the probe
    reports the median (the first, untimed step allocates the optimizer's state)."""
    import tightfit.planner.probe as probe
    from tightfit.workload import Workload

    durations = iter([9.0, 0.1, 0.5, 0.2])  # the untimed first step, then three timed ones
    clock = [0.0]

    def step(*args, **kwargs):
        clock[0] += next(durations)

    monkeypatch.setattr(probe, "training_step", step)
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    w = Workload(tiny_bert(), SyntheticBatches(16, seq_len=8), None, 8)
    seconds, micro_batches = probe.run_probe_steps(w, 8, "fp32", "adamw", timed_steps=3)
    assert seconds == pytest.approx(0.2) and micro_batches == 1


def test_a_cold_first_timed_step_does_not_set_the_verified_speed(make_workload, monkeypatch):
    """The verification's step time is the median of its timed steps: one slow step (the process's
    first on a cold GPU, 5x the steady one on an NVIDIA H200) must not decide it, since the verified
    speed decides whether a short run is compiled."""
    import tightfit.planner.gpu as gpu
    import tightfit.planner.probe as probe

    durations = iter([1.0, 0.5] + [0.01] * 10)  # untimed first step, a cold timed one, then steady
    clock = [0.0]

    def fake_step(*args, **kwargs):
        clock[0] += next(durations)

    monkeypatch.setattr(probe, "training_step", fake_step)
    monkeypatch.setattr(probe.time, "perf_counter", lambda: clock[0])
    w = make_workload(n=16, effective_batch=8)
    seconds, _ = probe.run_probe_steps(w, 8, "fp32", "adamw", timed_steps=gpu.VERIFIED_STEPS)
    assert seconds == pytest.approx(0.01)


def test_compile_on_times_one_eager_candidate_per_precision_and_optimizer(monkeypatch):
    """With --compile on (or auto, for a run long enough by the search's prediction) the compiled stage searches micro-batch and blocks itself and keeps only the
    eager winner's precision and optimizer: a runner-up differing only in micro-batch or blocks is
    not timed, and there is no calibration; one of another precision still is."""
    from tightfit.planner.search import Candidate

    same = Candidate("bf16", 16, (), 4, 800, 800, {}, 280.0, "slower")
    other = Candidate("fp16", 64, (0,), 1, 700, 700, {}, 250.0, "slower")
    probes = []
    plan, _ = _fake_gpu_plan(monkeypatch, run_samples=240 * 600, compile="on", runners_up=[same, other], probes=probes)
    verified = [r for r in plan.reasons if r.startswith("verification timing")]
    assert len(verified) == 2 and any("fp16" in r for r in verified), plan.reasons
    assert 16 not in probes and 8 not in probes, probes  # the same-kind runner-up, the calibration
    assert not any(r.startswith("calibrated with probes") for r in plan.reasons)
    probes.clear()  # --compile auto, a run long enough to compile even at the predicted 300 samples/s: the same
    plan, _ = _fake_gpu_plan(monkeypatch, run_samples=300 * 61, compile="auto", runners_up=[same, other], probes=probes)
    assert plan.compile and 16 not in probes and 8 not in probes, probes
    probes.clear()  # shorter by the prediction (59 s), long enough at the measured 240: the eager timings may decide
    plan, _ = _fake_gpu_plan(monkeypatch, run_samples=300 * 59, compile="auto", runners_up=[same, other], probes=probes)
    assert plan.compile and 16 in probes and 8 in probes, probes


def test_a_thin_verification_that_ends_eager_times_every_candidate_after_all(monkeypatch):
    """Predicted 200 samples/s, a run of 200 x 61 samples: long enough to compile by the prediction,
    so one candidate of a kind was timed (240); at that speed the run is too short to compile, and
    the plan would have stayed at 240 while a runner-up of the same kind runs 360 (review of the
    thin verification). Eager after all, every candidate is timed."""
    import tightfit.planner.gpu as gpu
    from tightfit.devices import get_profile
    from tightfit.planner.probe import ProbeResult
    from tightfit.planner.search import Candidate, SearchResult

    E = 64
    a = Candidate("bf16", 32, (), 2, 900, 900, {}, 200.0, "fastest predicted")
    b = Candidate("bf16", 16, (), 4, 800, 800, {}, 190.0, "slower")
    result = SearchResult(a, [b], 10**9, E, 4, 0.1)
    speeds = {32: 240.0, 16: 360.0, 8: 300.0}  # samples/s by micro-batch (8: the calibration's quarter)
    probed = []

    def fake_probe(workload, mb, precision, budget, timed_steps=2, optimizer="adamw"):
        probed.append(mb)
        return ProbeResult(mb, True, 500 * MiB, 500 * MiB, E / (speeds[mb] * math.ceil(E / mb)), 1)

    monkeypatch.setattr(gpu, "search_optimizers", lambda *a, **k: result)
    monkeypatch.setattr(gpu, "estimator_for", lambda *a, **k: None)
    monkeypatch.setattr(gpu, "probe_step", fake_probe)
    monkeypatch.setattr(gpu, "compile_unavailable", lambda device: None)
    monkeypatch.setattr(gpu, "set_activation_checkpointing", lambda *a, **k: None)
    w = SimpleNamespace(effective_batch=E, model=torch.nn.Linear(1, 1), train=None)
    plan = gpu.plan_on_gpu(w, get_profile("h200"), 10**9, 16, run_samples=200 * 61, compile="auto")
    assert probed[0] == 32 and 16 in probed, probed  # thin first, then every candidate
    assert not plan.compile and plan.micro_batch == 16, (plan.micro_batch, plan.reasons)
    assert any(r.startswith("the plan runs eager: every eager candidate timed") for r in plan.reasons)
