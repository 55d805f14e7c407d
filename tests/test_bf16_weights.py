"""``adamw8bit-bf16``: bf16 weights with torchao's 8-bit AdamW rounding each update to bf16
stochastically. Its weights move under updates below half a bf16 ulp; the GPU probe leaves the
fp32 weights bit-identical; the estimator holds torchao's state to the byte; it runs only under
bf16 autocast; a resumed run reproduces the uninterrupted one bit for bit (stochastic rounding
draws from the RNG the checkpoint restores); the planner chooses it only with its reason.

torchao's AdamW8bit compiles its per-tensor update with torch.compile, on the CPU too (a C++
compiler is needed): the first test in a process compiles it once per parameter shape.
"""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import SyntheticBatches
from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.step import make_optimizer
from tightfit.workload import Workload

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed")
KIND = "adamw8bit-bf16"


from test_optimizer_levers import bert_with_large_tensors as bert  # noqa: E402  (a 2-layer BERT, 8-bit-sized tensors)


def workload(n=24, effective_batch=8, seed=0):
    return Workload(bert(seed), SyntheticBatches(n), SyntheticBatches(8, seed=1), effective_batch)


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@needs_torchao
def test_weights_are_bf16_and_move_under_updates_below_half_an_ulp():
    """lr 1e-4: every AdamW update of LayerNorm's weights (1.0, about lr per step) is far below half
    a bf16 ulp there (2**-8 = 3.9e-3), so rounding to nearest would leave each as it was; rounded
    stochastically, each moves by one ulp with the probability update / ulp (about 1%)."""
    w = workload(n=80)
    t = Trainer(w, Plan("bf16", 8, 8, optimizer=KIND), TrainConfig(epochs=1, lr=1e-4, warmup_ratio=0.0),
                progress=False)
    assert {p.dtype for p in w.model.parameters()} == {torch.bfloat16}
    from torchao.optim.subclass_8bit import OptimState8bit

    before = params(w.model)
    torch.manual_seed(0)
    t.fit()  # 10 steps, dropout on
    ln = [k for k in before if k.endswith("LayerNorm.weight")]
    assert all(torch.equal(before[k], torch.ones_like(before[k])) for k in ln)
    moved = sum(int((params(w.model)[k] != before[k]).sum()) for k in ln)
    total = sum(before[k].numel() for k in ln)
    assert 0 < moved < total / 5  # 320 weights, 10 steps of <= 1e-4 against an ulp of 2**-7: ~20 moves
    assert any(isinstance(v, OptimState8bit) for s in t.optimizer.state.values() for v in s.values())


@needs_torchao
def test_the_optimizer_refuses_weights_that_are_not_bf16():
    with pytest.raises(TightfitError, match="needs bf16 weights, got torch.float32"):
        make_optimizer(bert().parameters(), KIND, "cpu")


def test_without_torchao_the_model_is_refused_before_its_weights_are_cast(monkeypatch):
    """The cast to bf16 drops each fp32 weight's low 16 bits for good: a Trainer (or TrainStep) whose
    optimizer cannot be made for want of torchao must refuse before it, leaving your model's weights
    as they were, not after, in bf16. The estimator's meta copy is cast without the library."""
    w = workload()  # made first: transformers imports torchao, if installed, as it builds the model
    before = params(w.model)
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import torchao.optim now raises ImportError
    with pytest.raises(TightfitError, match="needs torchao"):
        Trainer(w, Plan("bf16", 8, 8, optimizer=KIND), TrainConfig(epochs=1), progress=False)
    assert_same(params(w.model), before)
    from tightfit.levers.optimizers import cast_weights
    from tightfit.memory.estimate import meta_copy

    assert {p.dtype for p in cast_weights(meta_copy(w.model), KIND).parameters()} == {torch.bfloat16}


def _oom_in_new_buffer(trainer, n):
    """Raise a CUDA-style OOM at the ``n``-th moment torchao creates in the first step."""
    opt, calls = trainer.optimizer, []
    real = opt._new_buffer

    def new_buffer(p, signed):
        calls.append(1)
        if len(calls) == n:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return real(p, signed)

    opt._new_buffer = new_buffer


@needs_torchao
@pytest.mark.parametrize("n", [2, 5])
def test_oom_while_the_state_is_allocated_redoes_the_step_exactly(n):
    """2: the first parameter's second moment; 5: the third parameter's first, after which torchao
    alone would already have updated the first two (tightfit allocates every state before any update)."""
    cfg = dict(epochs=1, lr=1e-3, seed=3, grow_back_after=0)
    ref = workload()
    t_ref = Trainer(ref, Plan("bf16", 4, 8, optimizer=KIND), TrainConfig(**cfg), progress=False)
    torch.manual_seed(11)
    t_ref.fit()
    w = workload()
    t = Trainer(w, Plan("bf16", 8, 8, optimizer=KIND), TrainConfig(**cfg), progress=False)
    _oom_in_new_buffer(t, n)
    torch.manual_seed(11)
    res = t.fit()
    assert res.oom_recoveries == 1 and t.micro_batch == 4
    assert {float(s["step"]) for s in t.optimizer.state.values()} == {3.0}  # no parameter stepped twice
    assert_same(params(w.model), params(ref.model))


@needs_torchao
def test_oom_inside_the_update_after_a_parameter_was_written_stops_rather_than_apply_it_twice(monkeypatch):
    from tightfit.runtime.trainer import PartialUpdateError

    t = Trainer(workload(), Plan("bf16", 8, 8, optimizer=KIND), TrainConfig(epochs=1, lr=1e-3), progress=False)
    from tightfit.levers import optimizers

    calls = []

    def failing_second(compiled):  # the second call of either update fails, the first went through
        def update(*a):
            calls.append(1)
            if len(calls) == 2:  # a parameter (or a group of them) is updated already
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
            return compiled(*a)
        return update

    for name in ("_compiled_update", "_compiled_chunk_update", "_compiled_flat_update"):  # (flat, then one chunk)
        monkeypatch.setattr(optimizers, name, lambda f=failing_second(getattr(optimizers, name)()): f)
    with pytest.raises(PartialUpdateError, match="part"):
        t.train_step(list(range(8)))


# Shapes of :func:`_bf16_params`: quantized tensors apart (one compiled call each, the lone small
# tensor too), and a repeated (quantized, small, quantized) triple after a small tensor, then a
# larger quantized one (the quantized ones two per chunk, levers.optimizers.update_chunks: the
# largest lets a chunk hold 9,362 elements; the small ones in the flat call)
LONE = ((64, 64), (8,), (64, 64))
REPEATED = ((8, 8),) + ((64, 64), (8,), (32, 128)) * 3 + ((64, 256),)


def _bf16_params(shapes=LONE):
    """bf16 parameters of quantized (64 x 64) and unquantized shapes, drawn from the RNG."""
    return [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in shapes]


def _three_steps(make, seed=0):
    """Three steps of optimizer ``make(params)`` over bf16 tensors of a quantized (64 x 64) and
    an unquantized shape, with bf16 gradients drawn from ``seed``; the weights and the state."""
    torch.manual_seed(seed)
    ps = _bf16_params()
    opt = make(ps)
    for _ in range(3):
        for p in ps:
            p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
        opt.step()
    state = [{k: (v.dequantize() if hasattr(v, "dequantize") else v).clone() for k, v in opt.state[p].items()}
             for p in ps]
    return [p.detach().clone() for p in ps], state


@needs_torchao
def test_the_step_is_torchaos_own_step_bit_for_bit():
    """tightfit's step (state allocated first, one compiled update function) against
    ``torchao.optim.AdamW8bit`` as shipped: the same weights and moments after 3 steps, the
    stochastic rounding's draws included (another seed changes the weights: they are live)."""
    from torchao.optim import AdamW8bit

    from tightfit.levers.optimizers import adamw_8bit_bf16

    ours = _three_steps(lambda ps: adamw_8bit_bf16(ps, 1e-3, 0.01))
    theirs = _three_steps(lambda ps: AdamW8bit(ps, lr=1e-3, weight_decay=0.01, bf16_stochastic_round=True))
    for a, b in zip(ours[0], theirs[0]):
        assert torch.equal(a, b)
    for a, b in zip(ours[1], theirs[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a, b) for a, b in zip(_three_steps_other_draws(), ours[0]))


def _three_steps_other_draws():
    """:func:`_three_steps` of tightfit's step with the same weights and gradients as seed 0 but
    the random stream moved on before each step (other stochastic-rounding draws)."""
    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    ps = _bf16_params()
    opt = adamw_8bit_bf16(ps, 1e-3, 0.01)
    for _ in range(3):
        for p in ps:
            p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
        state = torch.get_rng_state()
        torch.manual_seed(1234)
        opt.step()
        torch.set_rng_state(state)
    return [p.detach().clone() for p in ps]


def _verdict_step(found_inf, shapes=LONE):
    """:func:`_three_steps`' tensors after two steps, then a third step handed ``found_inf`` (a
    0-d device tensor, as :func:`tightfit.step.apply_update` hands it; None: no verdict) with
    gradients that are not finite where ``found_inf`` says so; the weights and every state
    tensor (8-bit codes and scales, bf16 moments, step counters) before and after it."""
    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    ps = _bf16_params(shapes)
    opt = adamw_8bit_bf16(ps, 1e-3, 0.01)

    def tensors():
        return [p.detach().clone() for p in ps] + [x.clone() for p in ps for k, t in opt.state[p].items()
                                                   for x in ((t.codes, t.scale) if hasattr(t, "codes") else (t,))]
    for i in range(3):
        for p in ps:
            p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
        if i == 2:
            before = tensors()
            if found_inf is not None and found_inf.item() == 1.0:
                ps[1].grad[0] = math.nan
            opt.found_inf = found_inf
        opt.step()
    return before, tensors()


@needs_torchao
@pytest.mark.parametrize("shapes", [LONE, REPEATED], ids=["per-tensor", "chunked"])
def test_a_nonfinite_verdict_on_the_device_leaves_every_tensor_as_it_was(shapes):
    """The skip decided on the device (no host sync): handed ``found_inf`` 1.0 the step writes
    nothing, weights, 8-bit codes and scales, bf16 moments and step counters alike; handed 0.0 it
    is the step without a verdict, bit for bit, stochastic rounding's draws included; through
    one compiled call per tensor and through a chunk's call."""
    before, skipped = _verdict_step(torch.ones(()), shapes)
    assert all(torch.equal(a, b) for a, b in zip(before, skipped))
    _, none = _verdict_step(None, shapes)
    _, finite = _verdict_step(torch.zeros(()), shapes)
    assert all(torch.equal(a, b) for a, b in zip(none, finite))
    assert not all(torch.equal(a, b) for a, b in zip(before, finite))  # an applied step writes


def test_update_chunks_fill_up_to_chunk_elements_in_order():
    """BERT-large's 8-bit tensors in order (the others go in the flat call): the word embeddings
    (over CHUNK_ELEMENTS) alone, then consecutive tensors up to CHUNK_ELEMENTS elements per
    chunk, every tensor once and in order; the step's largest temporaries stay the word
    embeddings' lone update (a chunk's concatenations counted); with CHUNK_ELEMENTS 0 every
    tensor is alone."""
    from tightfit.levers import optimizers
    from tightfit.levers.optimizers import (BF16_UPDATE_TEMPORARY_BYTES, CHUNK_ELEMENTS, CHUNK_TEMPORARY_BYTES,
                                            bf16_step_temporary_bytes, update_chunks)

    layer = [1024 * 1024] * 4 + [4096 * 1024, 4096, 1024 * 4096]
    numels = [30522 * 1024, 512 * 1024] + layer * 24 + [1024 * 1024]
    chunks = update_chunks(numels)
    assert [i for r in chunks for i in r] == list(range(len(numels)))
    assert chunks[0] == range(0, 1) and len(chunks) == 25
    sums = [sum(numels[i] for i in r) for r in chunks[1:]]
    assert max(sums) <= CHUNK_ELEMENTS and all(s + numels[r.stop] > CHUNK_ELEMENTS for s, r in zip(sums, chunks[1:-1]))
    assert update_chunks([]) == [] and update_chunks([5 * CHUNK_ELEMENTS]) == [range(0, 1)]
    # the limit falls to what the largest tensor's lone update holds: 4M x 8 / 14 = 2.4M elements
    m = 2**20
    assert update_chunks([4 * m, m, m, m]) == [range(0, 1), range(1, 3), range(3, 4)]
    assert update_chunks([m] * 3) == [range(i, i + 1) for i in range(3)]  # all of one size: each alone
    shapes = [(30522, 1024), (512, 1024)] + [(n,) for n in layer * 24] + [(1024, 1024)]
    largest_chunk = max(sums[1:]) * (BF16_UPDATE_TEMPORARY_BYTES + CHUNK_TEMPORARY_BYTES)
    assert bf16_step_temporary_bytes(shapes) == 30522 * 1024 * BF16_UPDATE_TEMPORARY_BYTES > largest_chunk
    optimizers.CHUNK_ELEMENTS = 0
    try:
        assert update_chunks(numels[:5]) == [range(i, i + 1) for i in range(5)]
    finally:
        optimizers.CHUNK_ELEMENTS = CHUNK_ELEMENTS


@needs_torchao
def test_the_chunked_update_compiles_once_for_chunks_of_any_size():
    """Chunks of other lengths and tensor counts (other models: chunks of 2 and 3 tensors, lone
    tensors of 16 to 64 blocks) run the one graph of the chunked update (its block count
    dynamic): none compiles it again."""
    from torch._dynamo.utils import counters

    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    graphs, cuts = [], []
    for shapes in (((64, 256), (64, 64), (17, 256)), ((96, 256), (16, 256), (32, 128), (20, 256)),
                   ((64, 64),), ((16, 256), (48, 256))):
        ps = _bf16_params(shapes)
        opt = adamw_8bit_bf16(ps, 1e-3, 0.01)
        for p in ps:
            p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
        opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
        cuts.append([len(c) for c in opt._chunks([(opt.param_groups[0], p) for p in ps])])
    assert cuts == [[1, 2], [1, 3], [1], [1, 1]]
    assert graphs[1:] == graphs[:1] * 3


@needs_torchao
def test_a_tensor_moved_to_another_param_group_is_cut_anew():
    """The chunks are kept from step to step; a tensor moved into a new param group (same order,
    same tensors) is cut apart from its old chunk and takes its new group's lr (0: it stays)."""
    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    ps = _bf16_params(((64, 256), (64, 64), (17, 256)))
    opt = adamw_8bit_bf16(ps, 1e-3, 0.01)
    for p in ps:
        p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
    opt.step()
    opt.param_groups[0]["params"] = ps[:2]
    opt.add_param_group({"params": ps[2:], "lr": torch.tensor(0.0)})
    before = ps[2].detach().clone()
    opt.step()
    assert torch.equal(ps[2], before)


@needs_torchao
def test_a_weight_that_is_not_bf16_is_updated_alone_as_torchao_updates_it(monkeypatch):
    """A weight changed to fp32 after the optimizer was made (``p.data = ...``) is no part of a
    chunk: torchao updates it in fp32 without stochastic rounding, as its own per-tensor call
    does, and its bf16 neighbours keep theirs."""
    from tightfit.levers import optimizers

    results = []
    for chunked in (True, False):
        torch.manual_seed(0)
        ps = _bf16_params(((64, 256), (64, 64), (17, 256)))
        opt = optimizers.adamw_8bit_bf16(ps, 1e-3, 0.01)
        ps[2].data = ps[2].data.float() + 1e-4 * torch.randn(ps[2].shape, generator=torch.Generator().manual_seed(2))
        if not chunked:
            monkeypatch.setattr(type(opt), "_chunkable", lambda self, p: False)
        g = torch.Generator().manual_seed(1)
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        opt.step()
        monkeypatch.undo()
        results.append(ps[2].detach().clone())
    assert results[0].dtype == torch.float32 and torch.equal(*results)


@needs_torchao
def test_the_flat_call_compiles_once_for_sets_of_any_size():
    """The set of small tensors that step together changes (a tensor that got no gradient, a model
    whose blocks are dropped at random, another model): the flat call's graph takes any length
    (compiled with dynamic shapes), so no new set compiles it again (a compilation takes seconds)."""
    from torch._dynamo.utils import counters

    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    graphs = []
    for n in (2, 3, 5, 4):
        ps = _bf16_params(((8,),) * n)
        opt = adamw_8bit_bf16(ps, 1e-3, 0.01)
        for p in ps:
            p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
        opt.step()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 3


def test_the_flat_call_takes_the_small_tensors_only():
    """Tensors under 4,096 elements go in the flat call (where there are two); a large one whose
    moments are not 8-bit either (6,500 elements: not whole 256-blocks) keeps a call of its own,
    not concatenated (its size again in temporaries), and the step's temporaries are then the
    flat call's 4 B per small element."""
    from tightfit.levers.optimizers import bf16_step_temporary_bytes, bf16_update_calls

    shapes = [(8,), (100, 65), (4, 4), (64, 64)]
    assert bf16_update_calls(shapes) == [[0, 2], [1], [3]]
    assert bf16_update_calls([(8,), (64, 64)]) == [[0], [1]]  # one small tensor: no flat call
    assert bf16_step_temporary_bytes([(8,), (100, 65), (4, 4)]) == 4 * (8 + 16)


@needs_torchao
def test_a_gradient_laid_out_unlike_its_weight_is_stepped_as_a_contiguous_one():
    """A lone 8-bit tensor whose gradient is not contiguous (a transposed view, as a hook or a
    custom backward may hand in): its update is the contiguous gradient's, bit for bit."""
    from tightfit.levers.optimizers import adamw_8bit_bf16

    results = []
    for transposed in (True, False):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(64, 128).bfloat16())
        opt = adamw_8bit_bf16([p], 1e-3, 0.01)
        opt.bf16_stochastic_round = False
        g = (torch.randn(128, 64, generator=torch.Generator().manual_seed(1)) * 1e-3).bfloat16().t()
        p.grad = g if transposed else g.contiguous()
        assert p.grad.is_contiguous() != transposed
        opt.step()
        results.append((p.detach().clone(), opt.state[p]["exp_avg"].dequantize()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@needs_torchao
def test_a_chunk_never_mixes_param_groups():
    """Two param groups (one at lr 0) whose 8-bit tensors follow each other and would share a
    chunk: the chunks stop at the boundary, and the tensors of the lr-0 group do not move."""
    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    a, b = _bf16_params(((64, 64),)), _bf16_params(((64, 64), (8,)) * 3 + ((64, 256),))
    opt = adamw_8bit_bf16(a, 1e-2, 0.01)
    opt.add_param_group({"params": b, "lr": torch.tensor(0.0)})
    before = [p.detach().clone() for p in b]
    for p in a + b:
        p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
    opt.step()
    assert all(torch.equal(x, p) for x, p in zip(before, b))
    assert not torch.equal(a[0], before[0])
    quantized = [(g, p) for g in opt.param_groups for p in g["params"] if p.numel() >= 4096]
    chunks = opt._chunks(quantized)
    assert [len(c) for c in chunks] == [1, 2, 1, 1]  # (a's would chunk with b's first)
    assert all(len({id(g) for g, _ in c}) == 1 for c in chunks)


def _steps_chunked_or_not(monkeypatch, chunked: bool, stochastic_round: bool, steps: int, missing: int | None = None,
                          device: str = "cpu"):
    """``steps`` steps of ``adamw8bit-bf16`` over REPEATED's tensors, its 8-bit ones in one chunk's
    call or each through torchao's per-tensor update (``_chunkable`` patched to refuse them),
    gradients from a generator of their own (the calls draw the rounding's random numbers from the
    global one); the tensor ``missing`` has no gradient in the second step. The weights, the
    dequantized moments and the step counters (on ``device``)."""
    from tightfit.levers import optimizers

    calls = []
    chunk_update = optimizers._compiled_chunk_update()
    monkeypatch.setattr(optimizers, "_compiled_chunk_update", lambda: lambda *a: calls.append(1) or chunk_update(*a))
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(p.detach().to(device)) for p in _bf16_params(REPEATED)]
    opt = optimizers.adamw_8bit_bf16(ps, 1e-3, 0.01)
    if not chunked:
        monkeypatch.setattr(type(opt), "_chunkable", lambda self, p: False)
    opt.bf16_stochastic_round = stochastic_round
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, p in enumerate(ps):
            p.grad = None if (step, i) == (1, missing) else (torch.randn(p.shape, generator=g) * 1e-3).bfloat16().to(device)
        opt.step()
    monkeypatch.undo()
    assert bool(calls) == chunked
    moments = [(v.dequantize() if hasattr(v, "dequantize") else v).clone()
               for p in ps for k, v in opt.state[p].items()]
    return [p.detach().clone() for p in ps], moments


@needs_torchao
def test_a_chunk_updates_as_one_call_per_tensor(monkeypatch):
    """The chunked update is torchao's per-tensor update: bit for bit without stochastic rounding;
    with it, the same moments after three steps and, after one, each weight one of the two bf16
    neighbours of the per-tensor result (other draws, same rounding). A tensor that missed a step
    keeps its own counter in the chunk (its bias corrections one step behind the others')."""
    for missing in (None, 3):
        runs = [_steps_chunked_or_not(monkeypatch, c, False, 3, missing) for c in (True, False)]
        for a, b in zip(*runs):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    for a, b in zip(*(_steps_chunked_or_not(monkeypatch, c, False, 3) for c in (True, False))):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    chunked, single = (_steps_chunked_or_not(monkeypatch, c, True, 3) for c in (True, False))
    assert all(torch.equal(x, y) for x, y in zip(chunked[1], single[1]))
    (w_chunked, _), (w_single, _) = (_steps_chunked_or_not(monkeypatch, c, True, 1) for c in (True, False))
    for a, b in zip(w_chunked, w_single):
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((a.float() - b.float()).abs() <= ulp).all()


def _steps_flat_or_not(monkeypatch, flat: bool, stochastic_round: bool, steps: int, missing: int | None = None,
                       device: str = "cpu"):
    """``steps`` steps of ``adamw8bit-bf16`` over REPEATED's tensors, the small ones in the flat call
    or in the layers' calls (``FLAT_SMALL_TENSORS``), gradients from a generator of their own (the
    calls draw the rounding's random numbers from the global one); the tensor ``missing`` has no
    gradient in the second step. The weights, the dequantized moments and the step counters (on
    ``device``)."""
    from tightfit.levers import optimizers

    monkeypatch.setattr(optimizers, "FLAT_SMALL_TENSORS", flat)
    calls = []
    flat_update = optimizers._compiled_flat_update()
    monkeypatch.setattr(optimizers, "_compiled_flat_update", lambda: lambda *a: calls.append(1) or flat_update(*a))
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(p.detach().to(device)) for p in _bf16_params(REPEATED)]
    g = torch.Generator().manual_seed(1)
    opt = optimizers.adamw_8bit_bf16(ps, 1e-3, 0.01)
    opt.bf16_stochastic_round = stochastic_round
    for i in range(steps):
        for j, p in enumerate(ps):
            p.grad = None if (i == 1 and j == missing) else (torch.randn(p.shape, generator=g) * 1e-3).bfloat16().to(device)
        opt.step()
    monkeypatch.undo()
    assert bool(calls) == flat
    moments = [(v.dequantize() if hasattr(v, "dequantize") else v).clone()
               for p in ps for k, v in opt.state[p].items()]
    return [p.detach().clone() for p in ps], moments


@needs_torchao
def test_the_flat_call_updates_the_small_tensors_as_their_own_calls(monkeypatch):
    """The small tensors (moments not 8-bit) laid end to end in one call: bit for bit the update of
    each in its own or its layer's call without stochastic rounding (also where one misses a step,
    after which the set is packed anew and its counter stays behind); with it, the same moments
    and, after one step, each weight one of the two bf16 neighbours of the other's."""
    small = [i for i, s in enumerate(REPEATED) if math.prod(s) < 4096]
    for missing in (None, small[2]):
        flat, other = (_steps_flat_or_not(monkeypatch, f, False, 3, missing) for f in (True, False))
        for a, b in zip(flat, other):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    flat, other = (_steps_flat_or_not(monkeypatch, f, True, 3) for f in (True, False))
    assert all(torch.equal(x, y) for x, y in zip(flat[1], other[1]))
    (w_flat, _), (w_other, _) = (_steps_flat_or_not(monkeypatch, f, True, 1) for f in (True, False))
    assert not all(torch.equal(a, b) for a, b in zip(w_flat, w_other))  # other draws
    for a, b in zip(w_flat, w_other):
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((a.float() - b.float()).abs() <= ulp).all()


@needs_torchao
def test_a_tensor_that_missed_a_step_leaves_the_others_in_the_flat_call(monkeypatch):
    """One small tensor without a gradient in one step (an unused branch, a dropped layer, a tensor
    frozen for a while): its counter stays one behind the others' for good. The others go on in
    the flat call, packed once (no repacking, nor its host sync, at every later step), the one
    behind in a call of its own; bit for bit the update without the flat call."""
    from tightfit.levers import optimizers

    small = [i for i, s in enumerate(REPEATED) if math.prod(s) < 4096]
    behind = small[2]
    sizes, bases = [], []
    flat_update = optimizers._compiled_flat_update()
    monkeypatch.setattr(optimizers, "_compiled_flat_update",
                        lambda: lambda *a: sizes[-1].append(len(a[0])) or flat_update(*a))
    torch.manual_seed(0)
    ps, g = _bf16_params(REPEATED), torch.Generator().manual_seed(1)
    opt = optimizers.adamw_8bit_bf16(ps, 1e-3, 0.01)
    opt.bf16_stochastic_round = False
    for i in range(5):
        for j, p in enumerate(ps):
            p.grad = None if (i == 1 and j == behind) else (torch.randn(p.shape, generator=g) * 1e-3).bfloat16()
        sizes.append([])
        opt.step()
        bases.append(opt.state[ps[small[0]]]["exp_avg"]._base)
    monkeypatch.undo()
    assert sizes == [[len(small)], [len(small) - 1]] + [[len(small) - 1]] * 3
    assert bases[2] is bases[3] is bases[4]  # packed once after the tensor came back
    assert [float(opt.state[ps[j]]["step"]) for j in small] == [5.0 - (j == behind) for j in small]
    other = _steps_flat_or_not(monkeypatch, False, False, 5, behind)
    moments = [(v.dequantize() if hasattr(v, "dequantize") else v) for p in ps for v in opt.state[p].values()]
    assert all(torch.equal(a, b) for a, b in zip(ps, other[0]))
    assert all(torch.equal(a, b) for a, b in zip(moments, other[1]))


def _state_leaves(opt) -> list[torch.Tensor]:
    """The plain tensors of ``opt``'s state (an 8-bit moment's codes, scales and map)."""
    def leaves(t):
        return [x for n in t.__tensor_flatten__()[0] for x in leaves(getattr(t, n))] if hasattr(
            t, "__tensor_flatten__") else [t]
    return [x for s in opt.state.values() for t in s.values() for x in leaves(t)]


@needs_torchao
@pytest.mark.parametrize("comes_back", [False, True])
def test_a_tensor_out_of_the_flat_call_holds_no_more_memory_than_its_state(comes_back):
    """A small tensor frozen after a step (no gradient again), or missing one step (its counter then
    behind the others' for good), leaves the packed set: the others are packed anew, and the
    storage the optimizer's state keeps alive is exactly its tensors' bytes, not also the old
    packed tensors that the one left out still pointed into."""
    from tightfit.levers.optimizers import adamw_8bit_bf16

    torch.manual_seed(0)
    ps = _bf16_params(REPEATED)
    opt = adamw_8bit_bf16(ps, 1e-3, 0.01)
    out = [i for i, s in enumerate(REPEATED) if math.prod(s) < 4096][2]
    for i in range(4):
        for j, p in enumerate(ps):
            gone = j == out and (i == 1 if comes_back else i >= 1)
            p.grad = None if gone else (torch.randn(p.shape) * 1e-3).bfloat16()
        opt.step()
    leaves = _state_leaves(opt)
    used = sum(t.numel() * t.element_size() for t in leaves)
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves}
    assert sum(held.values()) == used


@needs_torchao
def test_an_oom_before_the_flat_call_writes_after_a_loaded_state_is_packed_is_redone(monkeypatch):
    """The first step after ``load_state_dict`` (a resume) packs the loaded state anew: new tensors,
    the loaded ones freed, whose ids Python then gives to the new ones. An OOM before anything is
    written (in the flat call's concatenation) must read as nothing written
    (:func:`tightfit.step.changed_since`, which the runtime asks before redoing the window), not as
    a partial update because a new tensor (version 0) took the id of a loaded one (version 1)."""
    import io

    from tightfit.levers import optimizers
    from tightfit.step import changed_since, in_place_versions

    torch.manual_seed(0)
    ps = _bf16_params(REPEATED)
    opt = optimizers.adamw_8bit_bf16(ps, 1e-3, 0.01)
    for p in ps:
        p.grad = (torch.randn(p.shape) * 1e-3).bfloat16()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)

    def oom(*a):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    monkeypatch.setattr(optimizers, "_compiled_flat_update", lambda: oom)
    for _ in range(5):
        buffer.seek(0)
        resumed = optimizers.adamw_8bit_bf16(ps, 1e-3, 0.01)
        resumed.load_state_dict(torch.load(buffer, weights_only=True))
        before = in_place_versions(resumed)
        with pytest.raises(torch.OutOfMemoryError):
            resumed.step()
        assert not changed_since(resumed, before)


@needs_torchao
def test_the_small_tensors_state_is_packed_and_a_loaded_state_continues_exactly():
    """After a step the small tensors' counters and moments are slices of one tensor each (the flat
    call's); a state_dict saved and loaded (torch.save, weights_only) into an optimizer that has
    stepped (its own state packed) replaces that state, is packed anew and its next steps are the
    uninterrupted optimizer's, bit for bit."""
    import io

    from tightfit.levers.optimizers import adamw_8bit_bf16

    def grads(ps, g):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).bfloat16()

    torch.manual_seed(0)
    ps, g = _bf16_params(REPEATED), torch.Generator().manual_seed(1)
    opt = adamw_8bit_bf16(ps, 1e-3, 0.01)
    opt.bf16_stochastic_round = False
    grads(ps, g)
    opt.step()
    small = [p for p in ps if p.numel() < 4096]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        bases = {opt.state[p][key]._base.data_ptr() for p in small}
        assert len(bases) == 1
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    resumed_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    resumed = adamw_8bit_bf16(resumed_ps, 1e-3, 0.01)
    resumed.bf16_stochastic_round = False
    grads(resumed_ps, torch.Generator().manual_seed(2))
    resumed.step()  # a state of its own, packed, then replaced
    with torch.no_grad():
        for a, b in zip(resumed_ps, ps):
            a.copy_(b)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for _ in range(2):
        state = g.get_state()
        grads(ps, g)
        g.set_state(state)
        grads(resumed_ps, g)
        opt.step()
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, resumed_ps))
    assert all(torch.equal(opt.state[a]["step"].cpu(), resumed.state[b]["step"].cpu()) for a, b in zip(ps, resumed_ps))
    assert float(opt.state[small[0]]["step"]) == 3.0


def _queued_and_read(monkeypatch, device):
    """Two runs of ``adamw8bit-bf16`` on ``device``, dropout on, the third window's forward not
    finite: the trainer's run-ahead (the skip decided on the device), then every step read on the
    host before its update. Returns both runs' weights and records, and how many steps were queued
    ahead and skipped in the first."""
    import tightfit.step as step

    real, may = step.skips_on_device, Trainer._may_run_ahead
    runs = []
    for ahead in (True, False):
        w = workload(n=48)
        w.model.to(device)
        calls = []

        def poison(module, args, out):
            if torch.is_grad_enabled():
                calls.append(1)
                return out * math.inf if len(calls) == 3 else out
        w.model.bert.encoder.layer[0].output.dense.register_forward_hook(poison)
        records, queued = [], []
        torch.manual_seed(5)
        t = Trainer(w, Plan("bf16", 8, 8, optimizer=KIND, device=device),
                    TrainConfig(epochs=1, lr=1e-3, seed=3, log_every=2), log=records.append, progress=False)
        monkeypatch.setattr(Trainer, "_may_run_ahead", lambda self, launched: queued.append(may(self, launched))
                            or queued[-1])
        # on the CPU the CUDA condition is lifted, as tests/test_run_ahead.py does for fused AdamW
        on_device = real if device == "cuda" else (lambda o: getattr(o, "skips_nonfinite_on_device", False))
        monkeypatch.setattr(step, "skips_on_device", on_device if ahead else (lambda o: False))
        t.fit()
        kept = ("type", "step", "epoch", "loss", "lr", "grad_norm", "stepped", "micro_batch", "accuracy", "eval_loss")
        runs.append((params(w.model), [{k: v for k, v in r.items() if k in kept} for r in records],
                     sum(queued), t.result.skipped_steps, {s["step"].device.type for s in t.optimizer.state.values()}))
    return runs


@needs_torchao
def test_steps_queued_ahead_with_the_device_side_skip_train_as_steps_read_at_once(monkeypatch):
    """The trainer's run-ahead with ``adamw8bit-bf16``, dropout on and one step whose gradients are
    not finite: the same records and weights as every step read on the host before the update
    (both hand the update the verdict, so both draw the same stochastic-rounding numbers)."""
    (weights, records, queued, skipped, _), (sync_weights, sync_records, *_) = _queued_and_read(monkeypatch, "cpu")
    assert queued >= 2 and skipped == 1
    assert records == sync_records
    assert_same(weights, sync_weights)


@pytest.mark.gpu
@needs_torchao
def test_on_the_gpu_steps_queued_ahead_with_the_device_side_skip_train_as_steps_read_at_once(monkeypatch):
    """The real path: on CUDA ``skips_on_device`` holds for ``adamw8bit-bf16`` as shipped."""
    (weights, records, queued, skipped, counters), (sync_weights, sync_records, *_) = _queued_and_read(monkeypatch,
                                                                                                       "cuda")
    assert queued >= 2 and skipped == 1 and counters == {"cuda"}  # the step counters beside the weights
    assert records == sync_records
    assert_same(weights, sync_weights)


@needs_torchao
def test_the_probe_leaves_the_fp32_weights_bit_identical():
    """The probe steps a bf16 copy (the optimizer refuses fp32) and gives the very same fp32
    parameter objects and buffers back, bit for bit."""
    from tightfit.planner.probe import run_probe_steps

    w = workload()
    model = w.model
    model.classifier.register_buffer("fp32_buffer", torch.randn(5) / 3)  # BERT's own buffers are integers
    before, objects = params(model), list(model.parameters())
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(next(m.parameters()).dtype))
    run_probe_steps(w, 4, "bf16", KIND, timed_steps=1)
    assert seen and set(seen) == {torch.bfloat16}  # the steps ran on bf16 weights
    assert_same(params(model), before)
    assert all(a is b for a, b in zip(model.parameters(), objects))
    assert all(torch.equal(b, buffers[k]) and b.dtype == buffers[k].dtype for k, b in model.named_buffers())


@needs_torchao
def test_the_estimators_state_is_torchaos_to_the_byte():
    """The estimator's stand-in (meta) and the planner's count hold exactly the bytes torchao's
    AdamW8bit allocates for bf16 weights: 4,096 and 8,192 elements (quantized, each moment with its
    own map), 6,565 (not a whole number of blocks: bf16 moments), small tensors (bf16 moments)."""
    import copy

    from tightfit.planner.optimizers import state_bytes

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(65, 101), torch.nn.Linear(101, 3), torch.nn.Linear(64, 64, bias=False),
                              torch.nn.Linear(64, 128, bias=False)).to(torch.bfloat16)
    meta = copy.deepcopy(net).to("meta")
    for model in (net, meta):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
    real = make_optimizer(net.parameters(), KIND, "cpu", lr=1e-3)
    real.step()

    def leaves(t):  # a tensor subclass holds its bytes in its inner tensors
        return [x for n in t.__tensor_flatten__()[0] for x in leaves(getattr(t, n))] if hasattr(
            t, "__tensor_flatten__") else [t]

    real_bytes = sum(x.numel() * x.element_size() for s in real.state.values() for t in s.values()
                     for x in leaves(t))  # the step counters included: they live on the weights' device
    assert all(s["step"].device == p.device for p, s in real.state.items())
    stand_in = make_optimizer(meta.parameters(), KIND, "meta")
    stand_in.step()
    assert sum(t.numel() * t.element_size() for t in stand_in.state_tensors()) == real_bytes
    assert state_bytes(net, KIND) == real_bytes


@needs_torchao
def test_the_estimators_state_is_packed_per_param_group_as_torchaos():
    """torchao's step packs the small tensors' state for its flat call per param group (and
    device), a group with only one small tensor not at all; the estimator's stand-in packed the
    small tensors of every group as one set: other allocations than the real optimizer's (one
    packed set where there are none or several). Two groups: the same tensors in the same
    storages, byte for byte."""
    from tightfit.levers.optimizers import adamw_8bit_bf16
    from tightfit.step import MetaOptimizer

    shapes = (((64, 64), (8,), (4, 4)), ((16,), (64, 128)))  # 2 small tensors in the first group, 1 in the second
    torch.manual_seed(0)
    a, b = (_bf16_params(s) for s in shapes)
    real = adamw_8bit_bf16(a, 1e-3, 0.01)
    real.add_param_group({"params": b})
    meta = [[torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta")) for p in ps] for ps in (a, b)]
    stand_in = MetaOptimizer([{"params": ps} for ps in meta], KIND)
    for p in a + b + meta[0] + meta[1]:
        p.grad = torch.ones_like(p)
    real.step()
    stand_in.step()

    def storages(tensors):  # each allocation once, by the tensor that owns it (a packed state's views: their base)
        roots = {id(r): r for t in tensors for r in [t if t._base is None else t._base]}
        return sorted((r.numel() * r.element_size(), str(r.dtype)) for r in roots.values())

    def leaves(t):  # a tensor subclass (8-bit moments) holds its bytes in its inner tensors
        return [x for n in t.__tensor_flatten__()[0] for x in leaves(getattr(t, n))] if hasattr(
            t, "__tensor_flatten__") else [t]

    real_tensors = [x for p in a + b for t in real.state[p].values() for x in leaves(t)]
    assert real.state[a[1]]["exp_avg"]._base is not None and real.state[b[0]]["exp_avg"]._base is None
    assert storages(stand_in.state_tensors()) == storages(real_tensors)


def test_the_estimator_traces_bf16_weights():
    from tightfit.memory.estimate import estimate
    from tightfit.planner.optimizers import state_bytes

    m = bert(dropout=0.0)
    batch = SyntheticBatches(8).worst_case(4)
    ours = estimate(m, batch, Plan("bf16", 4, 4, optimizer=KIND, device="cuda"))
    fp32 = estimate(m, batch, Plan("bf16", 4, 4, optimizer="adamw", device="cuda"))
    n = sum(p.numel() for p in m.parameters())
    assert ours.breakdown["parameters"] == pytest.approx(2 * n, abs=64 * 1024)
    assert fp32.breakdown["parameters"] == pytest.approx(4 * n, abs=64 * 1024)
    assert ours.breakdown["optimizer_state"] == pytest.approx(state_bytes(m, KIND), abs=512 * 6 * len(list(m.parameters())))  # block rounding
    assert all(p.dtype == torch.float32 for p in m.parameters())  # the user's model is not touched


def _wide_bert(vocab=4096, hidden=1024):
    """A 1-layer BERT whose word embeddings (4.2M elements, 1,024 wide as BERT-large's) are the
    largest tensor: its 8-bit update's fp32 temporaries set the peak of the optimizer step. (A
    tensor whose rows are one 256-element block, e.g. 16384 x 256, held only 2 B per element on
    an NVIDIA H200: the stand-in's 8 B is what every other shape measured.)"""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=8, intermediate_size=1024,
        max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def test_the_estimator_counts_the_8bit_updates_fp32_temporaries(monkeypatch):
    """The optimizer step's predicted peak holds 8 B per element of the largest 8-bit tensor above
    the state (the update dequantizes its two moments; one layer here: each tensor its own call)."""
    from tightfit.levers import optimizers as lv
    from tightfit.memory.estimate import estimate

    m = _wide_bert()
    batch = {"input_ids": torch.randint(1, 4096, (4, 16)), "labels": torch.tensor([0, 1, 0, 1])}
    plan = Plan("bf16", 4, 4, optimizer=KIND, device="cuda")
    with_temporaries = estimate(m, batch, plan).extra["optimizer_step_peak_bytes"]
    monkeypatch.setattr(lv, "BF16_UPDATE_TEMPORARY_BYTES", 0)
    without = estimate(m, batch, plan).extra["optimizer_step_peak_bytes"]
    largest = max(p.numel() for p in m.parameters() if lv.is_quantized_torchao(p.numel()))
    assert largest == 4096 * 1024
    assert with_temporaries - without == pytest.approx(8 * largest, abs=2 * 2**20)  # 2 MiB: the allocator's rounding


def test_the_estimator_counts_a_chunks_concatenations(monkeypatch):
    """3 layers whose 8-bit tensors are updated in chunks (the largest tensor, 256 x 1024, lets a
    chunk hold two 256 x 256 ones): a chunk's concatenations and update temporaries stay within the
    largest tensor's lone update, which sets the predicted step's temporaries, 8 B per element;
    every tensor alone (CHUNK_ELEMENTS 0) predicts the same, and a chunk let grow to the whole
    model (the lower limit patched out) holds 14 B per element of all of them."""
    from transformers import BertConfig, BertForSequenceClassification

    from tightfit.levers import optimizers as lv
    from tightfit.memory.estimate import estimate

    torch.manual_seed(0)
    m = BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=256, num_hidden_layers=3,
                                                 num_attention_heads=4, intermediate_size=1024))
    batch = {"input_ids": torch.randint(1, 64, (4, 16)), "labels": torch.tensor([0, 1, 0, 1])}
    plan = Plan("bf16", 4, 4, optimizer=KIND, device="cuda")
    peak = lambda: estimate(m, batch, plan).extra["optimizer_step_peak_bytes"]  # noqa: E731
    chunked = peak()
    assert any(len(c) > 1 for c in lv.bf16_update_calls([p.shape for p in m.parameters()]))
    monkeypatch.setattr(lv, "CHUNK_ELEMENTS", 0)
    assert peak() == chunked
    monkeypatch.setattr(lv, "BF16_UPDATE_TEMPORARY_BYTES", 0)
    without = peak()
    assert chunked - without == pytest.approx(8 * 256 * 1024, abs=2 * 2**20)
    monkeypatch.setattr(lv, "BF16_UPDATE_TEMPORARY_BYTES", 8)
    monkeypatch.setattr(lv, "CHUNK_ELEMENTS", 1 << 30)
    monkeypatch.setattr(lv, "update_chunks", lambda numels: [range(len(numels))] * bool(numels))
    quantized = sum(p.numel() for p in m.parameters() if lv.is_quantized_torchao(p.numel()))  # 2.6M
    assert peak() - without == pytest.approx(14 * quantized, abs=2 * 2**20)


def test_fp16_and_fp32_with_bf16_weights_are_refused_in_one_line(capsys, tmp_path):
    from tightfit.cli import main

    for precision in ("fp16", "fp32"):
        with pytest.raises(TightfitError, match=f"keeps the weights in bf16 .* not precision='{precision}'"):
            Plan(precision, 4, 4, optimizer=KIND)
    args = ["--optimizer", KIND, "--precision", "fp16"]
    assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB",
                 *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "keeps the weights in bf16" in err and "not --precision fp16" in err
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--no-progress", "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "keeps the weights in bf16" in err
    assert not out.exists()  # refused before anything was written
    assert main(["train", "--device", "cpu", "--no-progress", "--out", str(out), "--optimizer", KIND]) == 2
    assert "CUDA GPU only" in capsys.readouterr().err and not out.exists()


@needs_torchao
def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    """Dropout on, stochastic rounding at every update: the checkpoint's weights (bf16), 8-bit state
    (torchao tensor subclasses) and RNG states make the resumed run the uninterrupted one. The state
    also loads (weights_only) in a process that has not imported torchao."""
    from torchao.optim.subclass_8bit import OptimState8bit

    from tightfit.runtime.checkpoint import list_checkpoints, read_state

    cfg = dict(epochs=2, lr=1e-3, seed=5)  # 24 samples / 8 = 3 steps per epoch, 6 in all
    full = workload(seed=1)
    torch.manual_seed(0)
    Trainer(full, Plan("bf16", 4, 8, optimizer=KIND), TrainConfig(**cfg, checkpoint_every=2, keep_last=3,
                                                                 checkpoint_dir=str(tmp_path)), progress=False).fit()
    ckpt = [c for c in list_checkpoints(tmp_path) if c.name == "ckpt-2"][0]  # written mid-run
    saved = read_state(ckpt)["optimizer"]["state"]
    assert any(isinstance(v, OptimState8bit) for s in saved.values() for v in s.values())
    resumed = workload(seed=2)  # other initial weights: all come from the checkpoint
    t = Trainer(resumed, Plan("bf16", 4, 8, optimizer=KIND), TrainConfig(**cfg), progress=False)
    t.resume(ckpt)
    t.fit()
    assert_same(params(resumed.model), params(full.model))
    code = ("import sys; from tightfit.runtime.checkpoint import read_state; "
            "s = read_state(sys.argv[1])['optimizer']['state']; "
            "assert any(type(v).__name__ == 'OptimState8bit' for x in s.values() for v in x.values())")
    root = Path(__file__).parents[1]
    r = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True, cwd=root,
                       env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]


# ---------------------------------------------------------------- the planner (no GPU, no torchao needed)

SEQ, E = 16, 8


from test_optimizer_planning import make_batch, model as planning_model  # noqa: E402


@pytest.fixture(scope="module")
def m():
    return planning_model()


def _plan(m, budget, optimizer="auto", precision="auto", **kw):
    from tightfit.devices import get_profile
    from tightfit.planner.optimizers import search_optimizers
    from tightfit.planner.search import estimator_for

    h200 = get_profile("h200")
    return search_optimizers(m, make_batch, SEQ, E, h200, budget,
                             lambda kind: estimator_for(m, make_batch, SEQ, h200, E, optimizer=kind),
                             optimizer=optimizer, levers=True, precision=precision, host_bytes=1 << 20, **kw)


def _least_peak(m, kind):
    from tightfit.devices import get_profile
    from tightfit.planner.search import estimator_for

    fn = estimator_for(m, make_batch, SEQ, get_profile("h200"), E, optimizer=kind)
    return min(fn("bf16", 1, blocks).peak_reserved_bytes for blocks in ((), (0, 1)))


def test_the_planner_chooses_bf16_weights_only_where_nothing_else_fits_and_says_why(m):
    from tightfit.planner.search import NothingFitsError

    eight, ours = _least_peak(m, "adamw8bit"), _least_peak(m, KIND)
    assert ours < eight - 2 * 2**20
    budget = int((eight + ours) / 2 / 0.95)  # between the two, with the planner's headroom
    r = _plan(m, budget)
    assert r.best.optimizer == KIND and r.best.precision == "bf16" and r.to_plan().optimizer == KIND
    assert "bf16 weights, updates stochastically rounded (torchao AdamW8bit)" in r.best.why
    assert "changes the numerics" in r.best.why and "weights in bf16" in r.best.why
    # asked for fp16 autocast: bf16 weights are not searched, and the reason says why
    with pytest.raises(NothingFitsError, match=r"--optimizer adamw8bit-bf16\): does not fit either \(needs bf16 autocast, --precision fp16"):
        _plan(m, budget, precision="fp16")
    # where 8-bit state fits, the fp32 weights stay
    roomy = _plan(m, int(eight / 0.95 * 1.5))
    assert roomy.best.optimizer != KIND and KIND not in roomy.best.why


def test_nothing_fits_with_bf16_weights_counts_their_bytes_and_offers_no_optimizer_lever_again(m):
    from tightfit.planner.search import NothingFitsError

    with pytest.raises(NothingFitsError) as e:
        _plan(m, 12 * 2**20, optimizer=KIND)
    text = str(e.value)
    assert "x 6 B (bf16 weights 2 B, gradients 2 B, 8-bit AdamW moments 2 B)" in text
    assert "--optimizer" not in text and "freezing the input layers" in text


def test_an_explicit_bf16_weights_optimizer_says_what_it_changes_and_refuses_another_precision(m):
    r = _plan(m, 1 << 30, optimizer=KIND)
    assert r.best.precision == "bf16" and "stochastically rounded" in r.best.why and "as asked" in r.best.why
    with pytest.raises(TightfitError, match="not precision='fp32'"):
        _plan(m, 1 << 30, optimizer=KIND, precision="fp32")


def test_least_state_counts_bf16_weights_and_gradients(m):
    from tightfit.planner.optimizers import least_state_bytes, state_bytes

    n = sum(p.numel() for p in m.parameters())
    assert least_state_bytes(m, KIND) == (4 * n + state_bytes(m, KIND), KIND)
    assert state_bytes(m, KIND) < state_bytes(m, "adamw8bit") + 4 * 2**20


def test_the_bf16_weights_step_time_counts_its_calls():
    """The time model's host share of tightfit's adamw8bit-bf16 step over BERT-large's 393 bf16
    tensors: one flat call (222 small tensors) and 25 chunks (its 171 8-bit tensors), no tensor
    alone; one compiled call per tensor (every 8-bit tensor refused by the chunks) is the measured
    81.1 ms on an NVIDIA H200 host (bench/results/update-groups/update_groups-per-tensor.json),
    predicted within 5%."""
    from tightfit.devices import get_profile
    from tightfit.levers import optimizers
    from tightfit.planner import cost as cost_module
    from tightfit.planner.cost import ForwardCost, TimeModel, optimizer_tensor_counts

    import json

    layer = [(1024, 1024)] * 4 + [(4096, 1024), (4096,), (1024, 4096)] + [(1024,)] * 9
    shapes = [(30522, 1024), (512, 1024), (2, 1024), (1024,), (1024,)] + layer * 24 + [(1024, 1024), (1024,), (2, 1024), (2,)]
    counts = optimizer_tensor_counts(shapes)
    assert counts["trainable_tensors"] == 393 == len(shapes)
    assert (counts["flat_tensors"], counts["chunked_tensors"], counts["chunk_calls"]) == (222, 171, 25)
    profile, n = get_profile("h200"), 335_143_938
    streamed = n * cost_module.ADAMW8BIT_BF16_BYTES_PER_PARAM / profile.memory_bytes_per_s
    predicted = TimeModel(profile, ForwardCost(1e9, 1000, n, 24, **counts), optimizer=KIND).optimizer_seconds()
    assert predicted == pytest.approx(streamed + cost_module.TORCHAO_FLAT_CALL_S + 25 * cost_module.TORCHAO_CHUNK_CALL_S)
    row = json.loads((Path(__file__).parents[1] / "bench/results/update-groups/update_groups-per-tensor.json")
                     .read_text())
    assert row["variant"] == "per-tensor" and row["compiled_calls_per_step"] == row["tensors"] == 393
    per_tensor = ForwardCost(1e9, 1000, n, 24, trainable_tensors=393)
    predicted = TimeModel(profile, per_tensor, optimizer=KIND).optimizer_seconds()
    assert abs(predicted / (row["step_ms"] / 1e3) - 1) < 0.05
    assert optimizers.bf16_update_calls(shapes)[0] == [i for i, s in enumerate(shapes) if math.prod(s) < 4096]


# ---------------------------------------------------------------- on a GPU

def _first_cuda_step(warm: bool = True):
    """A tiny bf16 BERT's first ``adamw8bit-bf16`` step on CUDA: (bytes allocated before the step,
    bytes after it, peak during it, the stand-in's state bytes, the allocator's rounding).

    ``warm``: first step an identical model once, so that torchao's update is compiled for these
    shapes before the measured step; the compilation's own first-call allocations (tens of MB,
    once per process and shape) are no part of a step's peak, and whether another test compiled
    first would otherwise decide this one's outcome."""
    from tightfit.planner.optimizers import state_bytes

    def model_and_optimizer():
        model = bert(dropout=0.0).to(torch.bfloat16).cuda()
        batch = {k: v.cuda() for k, v in SyntheticBatches(8).worst_case(4).items()}
        opt = make_optimizer(model.parameters(), KIND, "cuda", lr=1e-3)
        with torch.autocast("cuda", torch.bfloat16):
            model(**batch).loss.backward()
        return model, opt

    if warm:
        opt = model_and_optimizer()[1]
        opt.step()
        del opt
    model, opt = model_and_optimizer()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt.step()
    torch.cuda.synchronize()
    rounding = 512 * 6 * len(list(model.parameters()))  # the caching allocator's 512-byte blocks
    return start, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), state_bytes(model, KIND), rounding


@pytest.mark.gpu
@needs_torchao
def test_on_the_gpu_the_chunks_and_the_flat_call_update_as_one_call_per_tensor(monkeypatch):
    """On CUDA (Triton's kernels, not the CPU's), without stochastic rounding: the 8-bit tensors in
    chunks and the small ones in the flat call are bit for bit the update of one call per tensor
    (weights, moments, counters), also where a tensor missed a step."""
    small = [i for i, s in enumerate(REPEATED) if math.prod(s) < 4096]
    for missing in (None, 3, small[2]):
        chunked, single = (_steps_chunked_or_not(monkeypatch, c, False, 3, missing, "cuda") for c in (True, False))
        flat, other = (_steps_flat_or_not(monkeypatch, f, False, 3, missing, "cuda") for f in (True, False))
        for a, b in (*zip(chunked, single), *zip(flat, other)):
            assert all(x.is_cuda and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
@needs_torchao
def test_on_the_gpu_the_state_is_the_estimators():
    """torchao's state for bf16 BERT weights on CUDA is the stand-in's (to the allocator's 512-byte
    rounding)."""
    start, after, _, state, rounding = _first_cuda_step()
    assert 0 <= after - start - state <= rounding


@pytest.mark.gpu
@needs_torchao
def test_on_the_gpu_the_first_steps_peak_is_the_state_and_little_more():
    """With torchao's update compiled (a process's first compilation peaked 63 MB above the state
    for a 2-layer BERT on an NVIDIA H200, bench/results/bf16-weights/pytest-gpu.log, once), the
    first step allocates the state and little more: the estimator's stand-in holds no temporary
    beyond the small tensors' state packed end to end (a copy of it, while the per-tensor one is
    freed) and the flat call's concatenated weights and gradients, a few KiB for this BERT."""
    start, _, peak, state, rounding = _first_cuda_step()
    assert peak - start < state + rounding + 4 * 2**20


@pytest.mark.gpu
@needs_torchao
def test_on_the_gpu_the_optimizer_steps_peak_is_the_estimators():
    """The peak of a warm optimizer step (state held, update compiled) over a BERT whose 4.2M-element
    embeddings are its largest tensor is never above the estimator's optimizer-step peak, and at
    most 15% below it. With one compiled call per tensor it was within 2% (the update's fp32
    temporaries, 8 B per element, counted; without them the prediction fell 19% short). The chunked
    update's dynamic graph holds less on a GPU: an NVIDIA H100 (torch 2.11) measured 150,969,344
    bytes against the 171,642,880 predicted (+13.7%), and BERT-large's step 126 MiB of temporaries
    against 241 MiB per tensor (bench/results/session-2026-12-06/). The estimator keeps 8 B per
    element, on the safe side, until the parts are measured apart."""
    from tightfit.memory.estimate import estimate

    m = _wide_bert()
    batch = {"input_ids": torch.randint(1, 4096, (4, 16)), "labels": torch.tensor([0, 1, 0, 1])}
    predicted = estimate(m, batch, Plan("bf16", 4, 4, optimizer=KIND, device="cuda")).extra[
        "optimizer_step_peak_bytes"]
    model = m.to(torch.bfloat16).cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    opt = make_optimizer(model.parameters(), KIND, "cuda", lr=1e-3)
    for step in range(3):  # the first step allocates the state and compiles the update
        with torch.autocast("cuda", torch.bfloat16):
            model(**batch).loss.backward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated()
        opt.zero_grad(set_to_none=True)
    assert measured <= predicted <= 1.15 * measured, (measured, predicted)


@pytest.mark.gpu
@needs_torchao
def test_on_the_gpu_the_probe_restores_the_fp32_weights_and_resume_is_exact(tmp_path):
    from tightfit.planner.probe import probe_step
    from tightfit.runtime.checkpoint import list_checkpoints

    w = workload()
    w.model.cuda()
    before = params(w.model)
    r = probe_step(w, 4, "bf16", 8 << 30, timed_steps=1, optimizer=KIND)
    assert r.fits and r.peak_allocated_bytes is not None
    assert_same(params(w.model), before)

    cfg = dict(epochs=2, lr=1e-3, seed=5)
    full = workload(seed=1)
    torch.manual_seed(0)
    Trainer(full, Plan("bf16", 4, 8, optimizer=KIND, device="cuda"),
            TrainConfig(**cfg, checkpoint_every=2, keep_last=3, checkpoint_dir=str(tmp_path)), progress=False).fit()
    resumed = workload(seed=2)
    t = Trainer(resumed, Plan("bf16", 4, 8, optimizer=KIND, device="cuda"), TrainConfig(**cfg), progress=False)
    t.resume([c for c in list_checkpoints(tmp_path) if c.name == "ckpt-2"][0])
    t.fit()
    assert_same(params(resumed.model), params(full.model))


@pytest.mark.gpu
@needs_torchao
def test_your_own_loop_with_the_plans_bf16_weights_optimizer_casts_the_model():
    from tightfit.loop import TrainStep

    model = bert().cuda()
    step = TrainStep(Plan("bf16", 4, 8, optimizer=KIND, device="cuda"), model, lr=1e-3)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    batch = {k: v.cuda() for k, v in SyntheticBatches(8).worst_case(8).items()}
    before = params(model)
    out = step(batch)
    assert out.stepped and out.accumulation_steps == 2
    assert any(not torch.equal(v, before[k]) for k, v in params(model).items())


def test_bf16_weights_on_a_card_without_bf16_are_refused_naming_the_optimizer_and_what_runs_there(capsys):
    """A card without bf16 (GTX 1650 Ti, compute capability 7.5): the refusal names the optimizer
    and offers the optimizer levers that run there, not a precision that the optimizer refuses
    (--precision fp16/fp32) or that the card cannot run (bf16)."""
    from tightfit.cli import main

    for precision in ("auto", "bf16", "fp16", "fp32"):
        assert main(["plan", "--model", "minilm", "--seq-len", "16", "--batch-size", "4", "--gpu", "gtx-1650-ti",
                     "--optimizer", KIND, "--precision", precision]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        assert f"optimizer {KIND}" in err and "GTX 1650 Ti" in err and "7.5" in err, err
        assert "--optimizer adamw8bit " in err and "adamw-offload" in err and "use fp16" not in err, err


def test_a_request_for_bf16_weights_in_another_precision_is_refused_when_made():
    import pytest

    from tightfit.api import TrainRequest
    from tightfit.errors import TightfitError

    with pytest.raises(TightfitError, match="^optimizer='adamw8bit-bf16' keeps the weights in bf16 .* not precision='fp16': use precision='bf16'$"):
        TrainRequest(optimizer="adamw8bit-bf16", precision="fp16")
    for precision in ("bf16", "auto"):
        TrainRequest(optimizer="adamw8bit-bf16", precision=precision)
