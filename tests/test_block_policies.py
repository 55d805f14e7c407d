"""Per-block choices of what a block keeps for backward (none / selective / full / offload):
exact gradients with dropout on, what selective recomputation recomputes, the estimator's
memory of each choice, and plans with and without per-block choices."""

import pytest
import torch

from tightfit.levers.blocks import apply_block_policies, block_policy, find_blocks
from tightfit.levers.checkpointing import set_activation_checkpointing

from conftest import SyntheticBatches, tiny_bert


def _run(policies, freeze=False, seed=123, device="cpu", before_forward=None):
    """Loss and gradients of one forward/backward of a tiny BERT (dropout 0.1, train mode);
    ``before_forward()`` is called just before the forward."""
    model = tiny_bert(dropout=0.1, seed=0).to(device).train()
    if freeze:
        for p in model.bert.embeddings.parameters():
            p.requires_grad_(False)
    set_activation_checkpointing(model, False, policies=policies)
    batch = {k: v.to(device) for k, v in SyntheticBatches(8).collate(list(range(8))).items()}
    torch.manual_seed(seed)
    if device == "cuda":
        torch.cuda.manual_seed(seed)
    if before_forward is not None:
        before_forward()
    loss = model(**batch).loss
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-6)
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        torch.testing.assert_close(b[1][n], a[1][n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("freeze", [False, True])
def test_selective_full_and_mixed_blocks_give_the_same_loss_and_gradients_with_dropout(freeze):
    ref = _run(("none", "none"), freeze)
    for policies in [("selective", "selective"), ("full", "full"), ("selective", "full"), ("offload", "selective")]:
        _same(ref, _run(policies, freeze))
    # dropout is really on: other masks give other gradients
    other = _run(("none", "none"), freeze, seed=124)
    assert other[0] != pytest.approx(ref[0], rel=1e-6)


class _RandomSavedBlock(torch.nn.Module):
    """A matrix product, an op that is saved and draws random numbers (on CUDA: the fused
    attention kernel with attention dropout; here ``native_dropout``, saved by the test), then a
    recomputed dropout."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        h, _ = torch.ops.aten.native_dropout(self.linear(x), 0.5, True)
        return x + torch.nn.functional.dropout(torch.tanh(h), 0.5, training=True)


def test_selective_recomputation_replays_the_random_numbers_of_a_saved_op(monkeypatch):
    """The recomputation takes a saved random op's output from the cache; the dropout after it
    must still draw the forward's numbers (the generator is where the saved op left it)."""
    import tightfit.levers.selective as selective

    monkeypatch.setattr(selective, "SAVED_OPS", selective.SAVED_OPS | {torch.ops.aten.native_dropout})

    def grads(policies, seed=7):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.ModuleList([_RandomSavedBlock(), _RandomSavedBlock()]))
        apply_block_policies(model, policies)
        x = torch.randn(32, 16, requires_grad=True)
        torch.manual_seed(seed)
        y = x
        for block in model[0]:
            y = block(y)
        y.square().sum().backward()
        return [x.grad] + [p.grad for p in model.parameters()]

    ref = grads(("none", "none"))
    for policies in [("selective", "selective"), ("selective", "none"), ("offload", "selective")]:
        for a, b in zip(ref, grads(policies)):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=str(policies))
    assert not torch.allclose(grads(("none", "none"), seed=8)[0], ref[0])  # the masks matter


class _CountBackwardMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.addmm, torch.ops.aten.mm):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _backward_matmuls(policies):
    model = tiny_bert(dropout=0.1, seed=0).train()
    set_activation_checkpointing(model, False, policies=policies)
    batch = SyntheticBatches(8).collate(list(range(8)))
    loss = model(**batch).loss
    with _CountBackwardMatmuls() as counter:
        loss.backward()
    return counter.calls


def test_selective_recomputes_no_matrix_product_but_full_recomputes_them_all():
    none, selective, full = (_backward_matmuls((p, p)) for p in ("none", "selective", "full"))
    assert selective == none
    assert full == none + 2 * 6  # each BERT layer's six linear layers run again


def test_policies_are_set_per_block_and_undone():
    model = tiny_bert()
    blocks = find_blocks(model)
    apply_block_policies(model, ("offload", "selective"))
    assert [block_policy(b) for b in blocks] == ["offload", "selective"]
    set_activation_checkpointing(model, False)
    assert [block_policy(b) for b in blocks] == ["none", "none"]
    from tightfit.errors import TightfitError
    with pytest.raises(TightfitError, match="unknown block policy"):
        apply_block_policies(model, ("none", "lazy"))
    with pytest.raises(TightfitError, match="1 block policies for a model with 2 blocks"):
        apply_block_policies(model, ("none",))


def _estimate(policies, precision="bf16"):
    from transformers import BertConfig, BertForSequenceClassification

    from tightfit.memory.estimate import estimate
    from tightfit.plan import Plan

    with torch.device("meta"):
        model = BertForSequenceClassification(BertConfig(
            vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=128, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1))
    batch = {"input_ids": torch.zeros(1, 128, dtype=torch.long), "labels": torch.zeros(1, dtype=torch.long)}
    return estimate(model, batch, Plan(precision, 64, 64, device="cuda"), block_policies=policies)


def test_estimator_orders_the_choices_by_the_memory_they_keep():
    est = {p: _estimate((p,) * 4) for p in ("none", "selective", "full", "offload")}
    peak = {p: e.peak_allocated_bytes for p, e in est.items()}
    assert peak["none"] > peak["selective"] > peak["full"]
    assert peak["offload"] < peak["selective"]
    # the traced plan says what was traced
    assert est["selective"].plan["block_policies"] == ["selective"] * 4
    assert est["full"].plan["block_policies"] is None and est["full"].plan["checkpoint_blocks"] == [0, 1, 2, 3]


def test_selective_keeps_the_matmul_and_attention_outputs():
    """A selectively checkpointed layer keeps, per token, what its matrix products and the
    attention kernel output (bf16: q, k, v, attention, its projection, intermediate, output:
    7 x hidden + intermediate values, 2 bytes each, + the fp32 log-sum-exp per head)."""
    none, sel = _estimate(("none",) * 4), _estimate(("none", "selective", "none", "none"))
    full = _estimate(("none", "full", "none", "none"))
    tokens = 64 * 128
    kept = tokens * (5 * 256 + 1024 + 256) * 2 + 64 * 4 * 128 * 4
    got = sel.extra["first_step_peak_allocated_bytes"] - full.extra["first_step_peak_allocated_bytes"]
    assert got == pytest.approx(kept, rel=0.05)
    assert sel.peak_allocated_bytes < none.peak_allocated_bytes


def test_plans_without_per_block_choices_still_load_and_new_ones_round_trip():
    from tightfit.plan import Plan

    old = {"precision": "bf16", "micro_batch": 8, "effective_batch": 32, "activation_checkpointing": True,
           "checkpoint_blocks": [0, 1], "accumulation_steps": 4}
    assert Plan.from_dict(old).block_policies is None
    new = Plan("bf16", 8, 32, True, block_policies=("selective", "full", "none"))
    assert Plan.from_json(new.to_json()) == new


class _SavedRandomOps(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from tightfit.levers.selective import is_saved
        if is_saved(func) and torch.Tag.nondeterministic_seeded in func.tags:
            self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
def test_offload_on_cuda_gives_the_same_gradients_and_frees_the_saved_activations(monkeypatch):
    """Offload and selective recomputation give the gradients of no recomputation on CUDA, with
    dropout on, also when the copies to the host run late or the forward's kernels do (a
    missing stream or event wait then copies NaN or memory already reused). Deterministic algorithms where torch has them; the rest of the CUDA kernels'
    run-to-run noise (the memory-efficient attention's backward) is measured from two runs
    without recomputation and allowed for, capped far below what another dropout mask or a
    wrong value changes."""
    import tightfit.levers.offload as offload

    monkeypatch.setattr(offload, "MIN_OFFLOAD_BYTES", 0)  # the tiny model's tensors are all small
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ref = _run(("none", "none"), device="cuda")
        noise = {n: (g - _run(("none", "none"), device="cuda")[1][n]).abs().max().item() for n, g in ref[1].items()}
        for n, g in ref[1].items():  # noise, not another computation
            assert noise[n] <= 1e-4 * g.abs().max().item() + 1e-7, (n, noise[n])

        def same(b):
            assert b[0] == pytest.approx(ref[0], rel=1e-5)
            for n, g in ref[1].items():
                torch.testing.assert_close(b[1][n], g, rtol=1e-5, atol=1e-6 + 4 * noise[n], msg=n)

        with _SavedRandomOps() as seen:  # the case at stake: the fused attention applies dropout
            _run(("none", "none"), device="cuda")
        assert seen.ops, "no saved op draws random numbers: the fused attention with dropout did not run"

        device = torch.device("cuda", torch.cuda.current_device())
        side = offload.HostOffload._streams.setdefault(device, torch.cuda.Stream(device))

        def late(stream):
            """Before the forward: fresh pinned buffers, only NaN in the allocator's free blocks
            (of the current stream, whose pool the forward allocates from), then ``stream``
            held up ~0.25 s while the other stream runs ahead."""
            def before_forward():
                torch._C._host_emptyCache()
                torch.cuda.empty_cache()  # no free block keeps the last run's (same) values
                junk = [torch.full((1 << 16,), float("nan"), device=device) for _ in range(512)]
                del junk
                torch.cuda.synchronize()
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(int(5e8))
            return before_forward

        for policies in [("offload", "offload"), ("selective", "selective"), ("offload", "selective")]:
            same(_run(policies, device="cuda"))
            if "offload" in policies:
                same(_run(policies, device="cuda", before_forward=late(side)))  # the copies run late
                same(_run(policies, device="cuda", before_forward=late(torch.cuda.current_stream())))  # the kernels do
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])

    def held_after_forward(policies):
        model = tiny_bert(dropout=0.1, seed=0).cuda().train()
        set_activation_checkpointing(model, False, policies=policies)
        batch = {k: v.cuda() for k, v in SyntheticBatches(64, seq_len=32).collate(list(range(64))).items()}
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(**batch).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held

    assert held_after_forward(("offload", "offload")) < 0.5 * held_after_forward(("none", "none"))


# --------------------------------------------------------------------------- the planner

KEEP = {"none": 1.0, "selective": 0.6, "full": 0.1, "offload": 0.05}  # share of a block's activations kept


def _policy_memory(precision, micro_batch, choice, n=2):
    """Peak = 100 MiB + micro-batch x 10 MiB x the share of the activations the choice keeps."""
    from test_planner import Est, MiB

    policies = choice if choice and isinstance(choice[0], str) else \
        ["full" if i in choice else "none" for i in range(n)]
    s = 10 * MiB * sum(KEEP[p] for p in policies) / n
    peak = int(100 * MiB + micro_batch * s)
    return Est(peak, peak, {"activations": int(micro_batch * s)})


def test_planner_mixes_selective_and_full_blocks_when_that_is_faster_and_says_what_it_costs(monkeypatch):
    from test_planner import MiB, _search

    from tightfit.planner import search as search_module
    from tightfit.planner.cost import ForwardCost

    # launch-bound at small micro-batches, compute-bound at 64 samples: fewer micro-batches pay, and
    # selective recomputation costs less than recomputing a whole block
    monkeypatch.setattr(search_module, "forward_cost", lambda *a: ForwardCost(
        flops_per_sample=2e9, ops=100, trainable_params=1000, n_blocks=2, selective_ops_per_block=40,
        selective_bytes_per_sample=1e5))

    # 350 MiB: one micro-batch of 64 fits with one block selective and one full (324 MiB) but not
    # with both selective (420 MiB); both full (164 MiB) recompute more
    r = _search("h100", int(350 * MiB / 0.95), _policy_memory, E=64, precision="fp32", per_block=True)
    assert r.best.block_policies == ("full", "selective") and r.best.micro_batch == 64
    assert "recomputation" in r.best.why
    whole = next(c for c in r.runners_up if c.block_policies is None and len(c.checkpoint_blocks) == 2)
    assert whole.micro_batch == 64 and whole.samples_per_s < r.best.samples_per_s
    plan = r.to_plan()
    assert plan.block_policies == ("full", "selective") and plan.activation_checkpointing
    # 500 MiB: every block selective fits one micro-batch (484 MiB), no block recomputes its matmuls
    r = _search("h100", int(500 * MiB / 0.95), _policy_memory, E=64, precision="fp32", per_block=True)
    assert r.best.block_policies == ("selective", "selective") and r.best.micro_batch == 64
    # more room: no recomputation beats any
    r = _search("h100", int(800 * MiB / 0.95), _policy_memory, E=64, precision="fp32", per_block=True)
    assert r.best.block_policies is None and r.best.checkpoint_blocks == ()


def test_one_micro_batch_of_per_block_choices_is_found_where_only_the_held_gradients_hid_it(monkeypatch):
    """The per-block ladders' memory lines are traced at micro-batches that accumulate, with the
    window's gradients held; one micro-batch of the whole batch holds none. Every block selective
    fits 64 samples at once (484 MiB of 500), but its line says 684 MiB there (the 200 MiB of
    gradients): the search planned 2 x 32 or recomputed whole blocks instead."""
    from test_planner import Est, MiB, _search

    import tightfit.levers.optimizers as levers
    from tightfit.planner import search as search_module
    from tightfit.planner.cost import ForwardCost

    monkeypatch.setattr(search_module, "forward_cost", lambda *a: ForwardCost(
        flops_per_sample=2e9, ops=100, trainable_params=1000, n_blocks=2, selective_ops_per_block=40,
        selective_bytes_per_sample=1e5))
    monkeypatch.setattr(levers, "trainable_gradient_bytes", lambda *a: 200 * MiB)

    def fn(precision, micro_batch, choice):  # _policy_memory, plus the gradients an accumulating step holds
        est = _policy_memory(precision, micro_batch, choice)
        held = 200 * MiB if micro_batch < 64 else 0
        return Est(est.peak_reserved_bytes + held, est.peak_allocated_bytes + held, est.breakdown)

    r = _search("h100", int(500 * MiB / 0.95), fn, E=64, precision="fp32", per_block=True)
    assert r.best.block_policies == ("selective", "selective") and r.best.micro_batch == 64
    assert r.best.peak_reserved_bytes == fn("fp32", 64, ("selective", "selective")).peak_reserved_bytes


def test_offload_is_costed_by_the_host_link():
    from dataclasses import replace

    from tightfit.devices import get_profile
    from tightfit.planner.cost import ForwardCost, TimeModel

    cost = ForwardCost(flops_per_sample=1e12, ops=100, trainable_params=1000, n_blocks=4, selective_ops_per_block=20,
                       selective_bytes_per_sample=1e6)
    slow = TimeModel(get_profile("h100"), cost, offload_bytes={"bf16": 4e6})
    fast = replace(slow, profile=replace(slow.profile, host_link_bytes_per_s=1e15))
    policies = ("offload",) * 2 + ("none",) * 2
    _, _, transfer = slow.step_parts("bf16", 64, 64, 0, policies)
    # compute-bound: the copies out hide behind the forward, the copies back are waited for
    assert transfer == pytest.approx(2 * 64 * 4e6 / slow.profile.host_link_bytes_per_s, rel=0.01)
    assert fast.step_parts("bf16", 64, 64, 0, policies)[2] < transfer / 1000
    # selective reruns launches only, full reruns the block's FLOPs too
    sel = slow.step_parts("bf16", 64, 64, 0, ("selective",) * 4)[1]
    full = slow.step_parts("bf16", 64, 64, 4, None)[1]
    assert 0 < sel < full


def test_offload_leaves_weights_and_their_views_and_small_tensors_on_the_device():
    from tightfit.levers.offload import HostOffload

    hooks = HostOffload(min_bytes=1024)
    weight = torch.nn.Parameter(torch.empty(64, 64, device="meta"))
    activation = torch.empty(64, 64, device="meta")
    assert not hooks._offloads(weight) and not hooks._offloads(weight.t())
    assert hooks._offloads(activation) and not hooks._offloads(activation[:1])
    assert not hooks._offloads(torch.empty(64, 64))  # host tensors stay where they are


def test_the_runtime_applies_the_plans_per_block_choices(make_workload):
    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer

    w = make_workload(n=16, effective_batch=8, dropout=0.1)
    plan = Plan("fp32", 4, 8, True, block_policies=("selective", "full"))
    t = Trainer(w, plan, TrainConfig(epochs=1, lr=1e-3), progress=False)
    assert [block_policy(b) for b in find_blocks(t.model)] == ["selective", "full"]
    res = t.fit()
    assert res.steps == 2


@pytest.mark.parametrize("stash", [1, 3])
def test_offload_keeps_the_last_saved_tensors_until_backward_and_the_trace_counts_them(monkeypatch, stash):
    """Saved tensors are dropped in stream order: the last ``STASH_TENSORS`` stay allocated
    after the forward (their copies may still run), the first unpack of backward drops them.
    On the meta device, as the estimator traces it: a chain of tanh (each saves its 1 MiB
    output) leaves the input plus ``stash`` outputs (the last being the forward's result)."""
    from tightfit.levers import offload
    from tightfit.memory.tracker import AllocationTracker

    monkeypatch.setattr(offload, "STASH_TENSORS", stash)
    MiB = 1 << 20
    tracker = AllocationTracker()
    with tracker:
        x = torch.empty(MiB // 4, device="meta", requires_grad=True)
        tracker.track(x)
        hooks = offload.HostOffload(min_bytes=0)
        with hooks:
            y = x
            for _ in range(8):
                y = torch.tanh(y)
        assert hooks.bytes_offloaded == 8 * MiB
        assert tracker.allocator.allocated == (1 + stash) * MiB
        stashed = offload.HostOffload._stash[torch.device("meta")]
        assert len(stashed) == stash and stashed[-1][0] is y
        y.sum().backward()
        assert not stashed


def test_offloaded_activations_are_held_to_the_hosts_pinned_memory(monkeypatch):
    """An offloading plan holds one micro-batch's offloaded activations in pinned host memory: a
    host with less gets a smaller micro-batch (or another choice), and the plan says what it pins
    (BERT-large at 4 GiB: 23 blocks offloaded at micro-batch 128 was verified on the GPU, ~10 GiB
    pinned, which a 16 GiB laptop cannot give)."""
    from test_planner import MiB, _search

    from tightfit.planner import search as search_module
    from tightfit.planner.cost import ForwardCost

    # recomputing a block costs more than copying its activations out and back
    monkeypatch.setattr(search_module, "forward_cost", lambda *a: ForwardCost(
        flops_per_sample=2e10, ops=1000, trainable_params=1000, n_blocks=2, selective_ops_per_block=40,
        selective_bytes_per_sample=1e5))
    budget = int(150 * MiB / 0.95)  # both blocks offloaded fit 64 samples (132 MiB); both recomputed do not (164)

    def pinned(c):
        return sum(p == "offload" for p in c.block_policies or ()) * c.micro_batch * 4.5 * MiB  # 4.5 MiB/sample/block

    free = _search("h100", budget, _policy_memory, E=64, precision="fp32", per_block=True)
    assert free.best.block_policies == ("offload", "offload") and free.best.micro_batch == 64
    assert "(576.00 MiB of pinned host memory)" in free.best.why, free.best.why
    small = _search("h100", budget, _policy_memory, E=64, precision="fp32", per_block=True, host_bytes=200 * MiB)
    offloading = [c for c in [small.best, *small.runners_up] if c.block_policies and "offload" in c.block_policies]
    assert offloading and all(pinned(c) <= 200 * MiB for c in offloading), [(c.label(), pinned(c)) for c in offloading]
    assert small.best.micro_batch < 64


def test_a_forward_that_ran_out_of_memory_leaves_no_offloaded_activation_on_the_device():
    """Found by a review: the activations offloading keeps on the device until their copies are
    done (the stash) were released only by a backward; a forward that failed has none, so the
    redo after an out-of-memory error started with the failed attempt's tensors still held."""
    from tightfit.levers.offload import HostOffload
    from tightfit.memory.oom import release_memory

    layer = torch.nn.Linear(1024, 1024, device="meta")
    x = torch.randn(64, 1024, device="meta", requires_grad=True)
    with pytest.raises(torch.OutOfMemoryError):
        with HostOffload(min_bytes=0):
            h = x
            for _ in range(3):
                h = torch.relu(layer(h))  # each saves an activation: offloaded, stashed
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    del h
    release_memory()  # what the runtime and TrainStep do before the redo
    assert not HostOffload._stash.get(torch.device("meta"))


def test_a_ladder_step_that_misses_at_the_whole_batch_climbs_its_ladder_before_shrinking(capsys):
    """BERT-base at 1000 MiB (GTX 1650 Ti rules, AdamW state offloaded): 7 offloaded blocks at
    32 x 1 were over when traced, and a smaller micro-batch holds the window's gradients, so every
    one was over too; the plan fell to fp32 recomputation at 30.4 samples/s, slower than the
    34.7 found at 900 MiB. A step of the whole batch that misses now takes the lowest rung above
    it on its ladder that fits at the same micro-batch (9 blocks offloaded fit at 900 MiB)."""
    import json

    from tightfit.cli import main

    speeds = {}
    for budget in ("900MiB", "1000MiB"):
        assert main(["plan", "--model", "bert-base", "--gpu", "gtx-1650-ti", "--budget", budget, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        speeds[budget] = out["predicted_samples_per_s"]
        assert out["plan"]["micro_batch"] == 32 and "offload" in out["plan"]["block_policies"]
    assert speeds["1000MiB"] >= speeds["900MiB"]
