"""On a CUDA GPU (skipped elsewhere): the probe's plan fits a capped budget for real, a real
out-of-memory error mid-run is recovered from, and mixed precision steps run."""

import gc

import pytest
import torch

from tightfit.plan import Plan
from tightfit.planner.probe import plan_first
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.units import GiB, MiB
from tightfit.workload import Workload

from conftest import SyntheticBatches

pytestmark = pytest.mark.gpu


def _bert_base_workload(n=256, effective_batch=64, seq_len=128, seed=0, dropout=0.1):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    cfg = BertConfig(num_labels=2, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    model = BertForSequenceClassification(cfg).cuda()  # 110M parameters
    # padded to a multiple of 8 as tightfit's text data is (other data costs a second compiled graph)
    return Workload(model, SyntheticBatches(n, seq_len=seq_len, vocab=30000, seed=seed, pad_multiple=8),
                    SyntheticBatches(32, seq_len=seq_len, vocab=30000, seed=1), effective_batch)


# With expandable segments the caching allocator maps memory in 20 MiB pages of the large pool
# and may pass the fraction cap by part of one mapping (seen: 16 MiB over 3 GiB on an H200).
CAP_SLACK = 32 * MiB


@pytest.fixture
def capped():
    """Cap the caching allocator at a budget for the test, then lift the cap."""
    def cap(budget):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(0).total_memory)
    yield cap
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()


def test_probed_plan_fits_for_a_whole_run(capped):
    budget = 3 * GiB
    capped(budget)
    w = _bert_base_workload()
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    plan = plan_first(w, "cuda", None, budget, precision="fp32", checkpointing="off")
    for n, p in w.model.named_parameters():  # probes leave the weights bit-identical
        assert torch.equal(p, before[n]), n
    assert 1 <= plan.micro_batch < 64  # 64 x 128 tokens of fp32 BERT-base does not fit 3 GiB
    torch.cuda.reset_peak_memory_stats()
    t = Trainer(w, plan, TrainConfig(epochs=2, lr=1e-5), progress=False)
    res = t.fit()
    assert res.oom_recoveries == 0 and res.steps == 8
    assert res.peak_reserved_bytes <= budget + CAP_SLACK


def test_real_oom_is_recovered_without_changing_the_run(capped):
    budget = 3 * GiB
    capped(budget)

    def losses(plan_micro_batch, schedule=None):
        # Dropout on: the redo restores the RNG states, so it draws the masks of a run that used
        # the smaller micro-batch for that step; only the order of floating-point sums differs.
        w = _bert_base_workload(n=192, dropout=0.1)
        w.model.eval()  # as from_pretrained returns it: the trainer must switch dropout on
        log = []
        t = Trainer(w, Plan("fp32", plan_micro_batch, 64, device="cuda"),
                    TrainConfig(epochs=1, lr=1e-5, grow_back_after=0, log_every=1), log=log.append, progress=False)
        if schedule:  # each step at the micro-batch the recovered run ended that step with
            launch = t._launch

            def at_schedule(window, index):
                t.micro_batch = schedule[index]
                return launch(window, index)
            t._launch = at_schedule
        res = t.fit()
        train = [r for r in log if r["type"] == "train"]
        del t, w
        gc.collect()  # the trainer's scheduler closure makes a reference cycle
        torch.cuda.empty_cache()
        return res, [r["loss"] for r in train], [r["micro_batch"] for r in train]

    # A plan that claims the whole window fits: a real out-of-memory error, recovered mid-run (at
    # step 1, or later where memory another test left in this process tightens the budget).
    res, recovered, micro_batches = losses(64)
    assert res.oom_recoveries >= 1 and res.steps == 3 and res.samples == 192
    assert res.plan.micro_batch < 64 and res.peak_reserved_bytes <= budget + CAP_SLACK
    # The same samples at those micro-batches, with no OOM, give the same losses.
    ref_res, reference, ref_micro_batches = losses(micro_batches[0], schedule=micro_batches)
    assert ref_res.oom_recoveries == 0 and ref_micro_batches == micro_batches
    torch.testing.assert_close(torch.tensor(recovered), torch.tensor(reference), rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_steps(precision):
    if precision == "bf16" and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 needs compute capability >= 8.0")
    from conftest import tiny_bert
    w = Workload(tiny_bert().cuda(), SyntheticBatches(64), None, 16)
    t = Trainer(w, Plan(precision, 8, 16, device="cuda"), TrainConfig(epochs=3, lr=1e-3), progress=False)
    res = t.fit()
    assert res.steps == 12 and res.skipped_steps <= 5
    assert all(p.dtype == torch.float32 for p in w.model.parameters())  # fp32 master weights
    if precision == "fp16":
        assert t.scaler.is_enabled() and t.scaler.get_scale() > 0


def test_prefetch_gives_the_same_training_as_no_prefetch():
    from conftest import tiny_bert
    results = []
    for prefetch in (False, True):
        w = Workload(tiny_bert(seed=0).cuda(), SyntheticBatches(64), None, 16)
        t = Trainer(w, Plan("fp32", 4, 16, device="cuda"), TrainConfig(epochs=2, lr=1e-3, prefetch=prefetch),
                    progress=False)
        t.fit()
        results.append({n: p.detach().clone() for n, p in w.model.named_parameters()})
    for n in results[0]:
        torch.testing.assert_close(results[0][n], results[1][n], rtol=1e-5, atol=1e-6, msg=n)


def test_searched_plan_is_verified_and_trains_without_oom(capped):
    from tightfit.devices import detect
    from tightfit.planner.gpu import plan_on_gpu
    budget = 3 * GiB
    capped(budget)
    w = _bert_base_workload(n=512, effective_batch=128)
    plan = plan_on_gpu(w, detect(), budget, seq_len=128)
    assert plan.micro_batch * plan.accumulation_steps >= 128 and plan.probe_peak_reserved_bytes <= budget
    res = Trainer(w, plan, TrainConfig(epochs=1, lr=1e-5), progress=False).fit()
    assert res.oom_recoveries == 0 and res.steps == 4
    assert res.peak_reserved_bytes <= budget + CAP_SLACK


def test_compiled_training_matches_eager():
    """``Plan(compile=True)``: the same losses as eager (fp32, no dropout) over micro-batches of
    varying size and length (4 x 4 per window and a short last one), without recompiling per shape."""
    from conftest import tiny_bert
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        w = Workload(tiny_bert(seed=0).cuda(), SyntheticBatches(72, seq_len=16), None, 16)
        log = []
        Trainer(w, Plan("fp32", 4, 16, device="cuda", compile=compiled),
                TrainConfig(epochs=2, lr=1e-3, log_every=1), log=log.append, progress=False).fit()
        losses[compiled] = [r["loss"] for r in log if r["type"] == "train"]
    assert len(losses[True]) == 10
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-3, atol=1e-4)


def test_a_whole_model_graph_with_every_block_checkpointed_trains_as_eager_does():
    """``Plan(compile=True, compile_scope="model")`` with every block checkpointed: one compiled
    graph with the model's own checkpointing inside (no block compiled alone), the same losses as
    the eager run of the same plan (fp32; no dropout: compiled dropout draws from the compiler's
    own random stream, so no eager run could match it)."""
    from conftest import tiny_bert
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.checkpointing import hf_hook_active
    from tightfit.levers.compile import compiled_call
    losses = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        model = tiny_bert(seed=0).cuda()
        w = Workload(model, SyntheticBatches(72, seq_len=16), None, 16)
        log = []
        t = Trainer(w, Plan("fp32", 4, 16, True, device="cuda", compile=compiled,
                            compile_scope="model" if compiled else None),
                    TrainConfig(epochs=2, lr=1e-3, log_every=1, seed=3), log=log.append, progress=False)
        if compiled:
            assert compiled_call(model) is not None and hf_hook_active(model)
            assert all(compiled_call(b) is None for b in find_blocks(model))
        t.fit()
        losses[compiled] = [r["loss"] for r in log if r["type"] == "train"]
    assert len(losses[True]) == 10
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-3, atol=1e-4)


def _graphs_recorded() -> int:
    """CUDA graphs cudagraph trees recorded on GPU 0 since their last reset."""
    from torch._inductor import cudagraph_trees
    manager = cudagraph_trees.get_manager(0, create_if_none_exists=False)
    if manager is None:
        return 0
    seen, stack = 0, [n for nodes in manager.roots.values() for n in nodes]
    while stack:
        node = stack.pop()
        seen += 1
        stack += [c for nodes in node.children.values() for c in nodes]
    return seen


def _fit_scoped(scope, dropout=0.1, seed=3, folder=None, resume=None, max_steps=None):
    """tiny BERT, fp32, 4 x 4 accumulation steps, compiled whole in ``scope``: the losses by step."""
    from conftest import tiny_bert
    model = tiny_bert(dropout=dropout).cuda()
    w = Workload(model, SyntheticBatches(72, seq_len=16, pad_multiple=8), None, 16)
    log = []
    cfg = TrainConfig(epochs=2, lr=1e-3, log_every=1, seed=seed, max_steps=max_steps, prefetch=False,
                      **({"checkpoint_dir": str(folder), "checkpoint_every": 2, "keep_last": 10} if folder else {}))
    plan = Plan("fp32", 4, 16, device="cuda", compile=True, compile_scope=scope)
    if folder:  # compiled and recorded before training, as the planner's probes or a resumed run's warm-up do
        from tightfit.planner.warmup import warm_compiled_plan
        warm_compiled_plan(w, plan, 2**30)
    t = Trainer(w, plan, cfg, log=log.append, progress=False)
    if resume:
        t.resume(resume)
    t.fit()
    return t, {r["step"]: r["loss"] for r in log if r["type"] == "train"}


def test_a_model_replayed_as_cuda_graphs_trains_as_the_compiled_model_does():
    """``compile_scope="model-graphs"``: the whole model compiled and its forward and backward
    replayed as CUDA graphs, four micro-batches accumulated per step, dropout on: the losses of
    the same model compiled in the default mode, and graphs really recorded and replayed (no
    cudagraph skipped). Accumulation is what the graphs' gradients would break (a replay
    overwrites the previous one's outputs); dropout is seen to act (other losses without it)."""
    from torch._dynamo.utils import counters
    losses = {}
    for scope, dropout in (("model", 0.1), ("model-graphs", 0.1), ("model-graphs", 0.0)):
        torch._dynamo.reset()
        counters.clear()
        trainer, losses[scope, dropout] = _fit_scoped(scope, dropout)
        if scope == "model-graphs":
            assert _graphs_recorded() >= 2 and not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch._dynamo.reset()
    a, b = losses["model", 0.1], losses["model-graphs", 0.1]
    assert len(a) == 10 and a.keys() == b.keys()
    torch.testing.assert_close(torch.tensor(list(b.values())), torch.tensor(list(a.values())), rtol=1e-5, atol=1e-6)
    assert max(abs(x - y) for x, y in zip(b.values(), losses["model-graphs", 0.0].values())) > 1e-3


@pytest.mark.parametrize("scope, deterministic", [(None, False), ("model", True), ("model-graphs", True)])
def test_a_resumed_compiled_run_reproduces_the_uninterrupted_one(tmp_path, scope, deterministic):
    """A compiled plan, dropout on, resumed from its step-2 checkpoint in a new trainer with
    nothing compiled or recorded: the losses of steps 3-6 and the final weights are the
    uninterrupted run's, bit for bit. Blocks compiled one by one (scope None) need nothing more;
    a model compiled as one graph (``model``; ``model-graphs``, replayed as CUDA graphs) adds its
    embeddings' gradients with atomic adds, whose order varies from run to run (measured: two
    uninterrupted runs differed by up to 2.7e-8 after 4 steps, bench/results/session-2026-12-07d),
    so it runs under ``--deterministic``'s kernels, as a user who needs this would. Both runs
    compile and record before training, as ``tightfit train`` and ``--resume`` do
    (``warm_compiled_plan``): a graph's first runs (warm-up, recording) may differ from its
    replays in the last bits."""
    from tightfit.runtime.determinism import deterministic_kernels
    with deterministic_kernels(deterministic):
        torch._dynamo.reset()
        full, full_losses = _fit_scoped(scope, folder=tmp_path / "full", max_steps=6)
        torch._dynamo.reset()  # also frees the recorded graphs: as a new process
        resumed, rest = _fit_scoped(scope, folder=tmp_path / "resumed", max_steps=6,
                                    resume=tmp_path / "full" / "ckpt-2")
        torch._dynamo.reset()
    assert rest == {k: v for k, v in full_losses.items() if k > 2} and len(rest) == 4
    a, b = full.model.state_dict(), resumed.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_compiled_checkpointed_block_recomputes_with_the_dropout_mask_of_its_forward():
    """Blocks compiled one by one and every one checkpointed, dropout 0.5 on: the last block's
    output is ``dropout(sin(h)) * w``, so its weight's gradient is ``out.sum(0) / w`` exactly
    when the recomputation draws the forward's mask, and far from it otherwise (this body on the
    CPU's Inductor: error 11 with ``preserve_rng_state=False`` in ``run_block``, 1e-6 as shipped).
    Checkpointing wraps each compiled block's call (checkpointing inside the compiled function
    failed in torch 2.11's partitioner, bench/results/checkpoint-inside)."""
    import torch.nn.functional as F

    import tightfit.levers.compile as compile_lever
    from tightfit.levers.checkpointing import set_activation_checkpointing

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(d) + 0.5)

        def forward(self, h):
            return F.dropout(torch.sin(h), 0.5, self.training) * self.w

    class Net(torch.nn.Module):
        def __init__(self, d=64):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(d) for _ in range(3)])

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net().cuda().train()
    compile_lever.compile_model(model)
    set_activation_checkpointing(model, True, None)
    x = torch.randn(32, 64, device="cuda")
    for _ in range(2):
        out = model(x)
        out.sum().backward()
        last = model.layers[-1]
        assert 0.8 < (out == 0).float().mean().item() < 0.95  # three masks of p 0.5 drew
        torch.testing.assert_close(last.w.grad, out.detach().sum(0) / last.w.detach(), rtol=1e-4, atol=1e-4)
        model.zero_grad()


def test_planner_compiles_and_the_compiled_plan_fits(capped):
    from tightfit.devices import detect
    from tightfit.planner.gpu import plan_on_gpu
    torch._dynamo.reset()
    budget = 3 * GiB
    capped(budget)
    w = _bert_base_workload(n=512, effective_batch=128)
    plan = plan_on_gpu(w, detect(), budget, seq_len=128, compile="on")
    assert plan.compile and plan.probe_peak_reserved_bytes <= 0.95 * budget
    assert any(r.startswith("torch.compile") for r in plan.reasons)
    res = Trainer(w, plan, TrainConfig(epochs=1, lr=1e-5), progress=False).fit()
    assert res.oom_recoveries == 0 and res.steps == 4
    assert res.peak_reserved_bytes <= budget + CAP_SLACK


def test_bench_run_measures_every_setting(tmp_path):
    """``tightfit bench run`` on the smoke workload (MiniLM, 1 GiB): a row per compared setting,
    tightfit's under its budget with no OOM after planning, and the report's files."""
    import json

    from tightfit.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--out", str(out), "--steps", "5",
                 "--tightfit-steps", "8", "--warmup", "2"]) == 0
    torch.cuda.set_per_process_memory_fraction(1.0)
    res = json.loads((out / "minilm-32@smoke.json").read_text())
    settings = [r["setting"] for r in res["rows"]]
    assert settings.count("tightfit") == 1 and settings.count("no budget") == 4
    assert settings.count("compiled no budget") == 1
    assert settings.count("plain") == 6 and settings.count("HF Trainer auto_find_batch_size") == 2
    tf = next(r for r in res["rows"] if r["setting"] == "tightfit")
    assert tf["ooms_after_planning"] == 0 and tf["steps"] == 8 and tf["effective_batch"] == 8
    assert tf["peak_reserved_bytes"] <= 1 * GiB + CAP_SLACK and tf["samples_per_s"] > 0
    assert main(["bench", "report", str(out)]) == 0
    assert (out / "results.png").stat().st_size > 0


def test_probe_and_training_run_with_dropout_on(capped):
    """A model in eval mode (as from_pretrained returns it) is probed and trained with dropout
    active: dropout masks are saved for backward, so a probe without them under-measures."""
    from tightfit.planner.probe import probe_step
    capped(8 * GiB)
    w = _bert_base_workload(n=64, effective_batch=16)
    w.model.eval()
    seen = []
    for m in w.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.register_forward_pre_hook(lambda mod, args: seen.append(mod.training) if torch.is_grad_enabled() else None)
    assert probe_step(w, 8, "bf16", 8 * GiB).fits
    assert seen and all(seen)
    seen.clear()
    Trainer(w, Plan("bf16", 8, 16, device="cuda"), TrainConfig(epochs=1, lr=1e-5), progress=False).fit()
    assert seen and all(seen) and not w.model.training


def test_oom_while_fused_adamw_allocates_its_state_is_redone_on_cuda():
    """CUDA's fused AdamW: an OOM while its state is allocated changes nothing, so the window
    is redone (the CPU test injects the same failure; this one runs the CUDA kernels)."""
    from test_trainer_correctness import _inject_in_optimizer_step
    from conftest import tiny_bert
    results = []
    for micro_batch, inject in ((4, False), (8, True)):
        w = Workload(tiny_bert(dropout=0.1).cuda(), SyntheticBatches(32), None, 8)
        t = Trainer(w, Plan("fp32", micro_batch, 8, device="cuda"), TrainConfig(epochs=1, lr=1e-3, grow_back_after=0),
                    progress=False)
        if inject:
            _inject_in_optimizer_step(t, "zeros_like", 7)
        torch.manual_seed(11)
        res = t.fit()
        assert res.oom_recoveries == int(inject) and t.micro_batch == 4
        results.append({n: p.detach().clone() for n, p in w.model.named_parameters()})
    for n in results[0]:
        torch.testing.assert_close(results[0][n], results[1][n], rtol=0, atol=0, msg=n)
