"""The estimator's reuse of meta-kernel layouts (tightfit.memory.meta_cache) changes no byte of
an estimate; it only skips repeated meta kernels."""

import pytest
import torch

from tightfit.devices import get_profile
from tightfit.memory import meta_cache
from tightfit.memory.estimate import estimate
from tightfit.memory.tracker import AllocationTracker
from tightfit.models import build_model
from tightfit.plan import Plan

# Each case: (model, size, plan, estimate keywords); together they cover accumulation, the three
# precisions, the optimizer levers (8-bit and bf16 weights), per-block policies (selective
# recompute and offload), a convolution net and a causal LM.
CASES = [
    ("bert-base", 128, Plan("fp16", 8, 32), dict(block_policies=["selective"] * 4 + ["offload"] * 4 + ["full"] * 2 + ["none"] * 2)),
    ("bert-base", 64, Plan("bf16", 4, 4, optimizer="adamw8bit-bf16"), dict(checkpoint_blocks=[0, 1, 2])),
    ("bert-base", 64, Plan("bf16", 4, 8, optimizer="adamw8bit"), dict(checkpoint_blocks="none")),
    ("gpt2", 64, Plan("fp32", 2, 2), dict(checkpoint_blocks="all")),
    ("resnet50", 64, Plan("bf16", 4, 8), dict(checkpoint_blocks="none")),
]


def _everything(e):
    return e.peak_allocated_bytes, e.peak_reserved_bytes, e.breakdown, e.first_step_peak_reserved_bytes, e.extra


@pytest.fixture
def cache_state():
    meta_cache.clear()
    yield
    meta_cache.enabled = True
    meta_cache.clear()


@pytest.mark.parametrize("name,size,plan,kw", CASES, ids=[c[0] + "-" + c[2].precision for c in CASES])
def test_estimates_are_the_same_byte_for_byte_with_and_without_the_cache(cache_state, name, size, plan, kw):
    model, make_batch = build_model(name)
    batch = make_batch(1, size)
    meta_cache.enabled = False
    without = _everything(estimate(model, batch, plan, get_profile("h200"), **kw))
    assert meta_cache.stats["hits"] == 0
    meta_cache.enabled = True
    cold = _everything(estimate(model, batch, plan, get_profile("h200"), **kw))
    warm = _everything(estimate(model, batch, plan, get_profile("h200"), **kw))  # every op from the cache
    assert meta_cache.stats["hits"] > 10 * meta_cache.stats["misses"]
    assert cold == without and warm == without


def test_only_fresh_outputs_are_made_from_the_cache(cache_state):
    # A view and an in-place op give back (the storage of) their input: made afresh they would
    # count a new allocation. They run their kernels every time; a product comes out new every time.
    x = torch.empty(256, 256, device="meta")
    with AllocationTracker() as tracker:
        tracker.track(x)
        held = tracker.allocator.allocated
        for _ in range(3):
            assert x.view(-1).untyped_storage() is x.untyped_storage()
            assert x.add_(1) is x
            assert tracker.allocator.allocated == held
            a, b = torch.mm(x, x), torch.mm(x, x)
            assert a.untyped_storage() is not b.untyped_storage() and a.shape == (256, 256)
            assert tracker.allocator.allocated == held + 2 * 256 * 256 * 4
            del a, b
    assert meta_cache.stats["hits"] >= 5  # every mm after the first


def test_a_layout_differs_when_only_dtype_or_strides_differ(cache_state):
    with AllocationTracker():
        a = torch.empty(4, 8, device="meta")
        assert torch.mm(a, a.t()).dtype == torch.float32
        h = a.to(torch.bfloat16)
        assert torch.mm(h, h.t()).dtype == torch.bfloat16
        t = torch.empty(8, 4, device="meta").t()  # same shape as a, other strides
        assert (t + 1).stride() == t.stride() and (a + 1).stride() == a.stride()


def test_the_autocast_argument_walk_casts_what_torchs_pytree_casts():
    """CudaOnMeta walks a call's arguments by hand where all are tensors or scalars (cheaper than
    torch's pytree); any container, a namedtuple included, still goes through the pytree."""
    from collections import namedtuple

    from torch.utils._pytree import tree_map

    from tightfit.memory.cuda_autocast import _map_args

    def cast(x):
        return x.to(torch.bfloat16) if isinstance(x, torch.Tensor) else x

    t = torch.empty(2, 3, device="meta")
    pair = namedtuple("Pair", "a b")
    calls = [((t, t.T, None, 2, 0.5), {"dtype": torch.float32}), ((torch.nn.Parameter(t),), {}),
             (([t, t], 1), {}), ((pair(t, t),), {"other": (t,)}), ((t,), {"x": {"y": t}})]
    for args, kwargs in calls:
        want, got = tree_map(cast, (args, kwargs)), _map_args(cast, args, kwargs)
        assert str(tree_map(lambda x: (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else x, got)) == \
            str(tree_map(lambda x: (x.dtype, tuple(x.shape)) if isinstance(x, torch.Tensor) else x, want))


def _layouts(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [(tuple(t.shape), t.stride(), t.dtype, t.storage_offset()) if isinstance(t, torch.Tensor) else t
            for t in outs]


def test_calls_that_differ_in_one_argument_get_their_own_layouts(cache_state):
    """The key tells apart every argument a fresh op's layouts depend on: each pair differs in one
    thing only (dtype, strides, shape, a scalar's type, a list item, a keyword,
    the number of arguments, the default dtype), and the second call of each pair must get what
    its own kernel gives, not the first call's layouts."""
    aten = torch.ops.aten
    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 5, 6, device="meta")
    pairs = [
        (aten.add.Tensor, (a, a), {}, (a.to(torch.bfloat16), a.to(torch.bfloat16)), {}),  # dtype
        (aten.add.Tensor, (a, a), {}, (torch.empty(8, 4, device="meta").t(), a), {}),  # strides
        (aten.mm.default, (a, a.t()), {}, (a[:2], a.t()), {}),  # shape
        (aten.add.Tensor, (a.to(torch.int32), 1), {}, (a.to(torch.int32), 1.0), {}),  # 1 against 1.0
        (aten.add.Tensor, (a.to(torch.int32), 1), {}, (a.to(torch.int32), True), {}),  # 1 against True
        (aten.sum.dim_IntList, (a, [0]), {}, (a, [1]), {}),  # a list item
        (aten.sum.dim_IntList, (a, [1]), {}, (a, [1], True), {}),  # one more argument
        (aten.sum.dim_IntList, (a, [1]), {"dtype": torch.float64}, (a, [1]), {"dtype": torch.float16}),
        (aten.sum.dim_IntList, (a, [1]), {"keepdim": True}, (a, [1]), {}),  # a keyword
        (aten.zeros.default, ([2, 3],), {"device": "meta"}, ([3, 2],), {"device": "meta"}),
        (aten.diagonal_copy.default, (b,), {"offset": 2}, (b,), {"dim2": 2}),  # a keyword's name
        (aten.native_layer_norm.default, (a, [8], None, None, 1e-5), {},
         (a, [8], torch.empty(8, device="meta"), None, 1e-5), {}),  # None against a tensor
    ]
    for op, args1, kw1, args2, kw2 in pairs:
        meta_cache.clear()
        want = _layouts(op(*args2, **kw2))  # the kernel's own answer
        meta_cache.call(op, args1, kw1)  # stored first
        assert _layouts(meta_cache.call(op, args2, kw2)) == want, (op, args1, args2)
    meta_cache.clear()  # the default dtype: a factory call without a dtype; an integer tensor plus a float
    i = a.to(torch.int32)
    meta_cache.call(aten.zeros.default, ([2],), {"device": "meta"})
    meta_cache.call(aten.add.Tensor, (i, 0.5), {})
    torch.set_default_dtype(torch.float64)
    try:
        assert meta_cache.call(aten.zeros.default, ([2],), {"device": "meta"}).dtype == torch.float64
        assert meta_cache.call(aten.add.Tensor, (i, 0.5), {}).dtype == torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_in_place_ops_are_skipped_only_where_they_change_nothing(cache_state):
    """An in-place op on meta tensors returns its first argument unchanged: repeated, it is
    answered with that argument. One that changes its argument's layout (resize_, an in-place
    view op) runs its kernel every time; so does an in-place op whose arguments differ."""
    x, s = torch.empty(64, 64, device="meta"), torch.empty((), device="meta")
    with AllocationTracker() as tracker:
        tracker.track(x)
        hits = meta_cache.stats["hits"]
        for _ in range(3):
            assert x.mul_(s) is x and x.add_(x, alpha=2) is x and x.shape == (64, 64)
        assert meta_cache.stats["hits"] >= hits + 4  # the second and third of each
        y = torch.empty(4, 4, device="meta")
        for n in (4, 8, 8, 4):
            assert y.resize_(n, n).shape == (n, n)  # layout changed: never skipped
        resize = torch.ops.aten._resize_output_.default  # in place, and no view op: checked on its first call
        for n in (4, 8, 4, 8):
            w = torch.empty(4, 4, device="meta")
            assert meta_cache.call(resize, (w, [n, n], torch.device("meta")), {}).shape == (n, n)
        z = torch.empty(4, 6, device="meta")
        for _ in range(2):
            assert z.t_().shape == (6, 4)
            assert z.t_().shape == (4, 6)
        with pytest.raises(RuntimeError):  # the same op whose other argument no longer broadcasts
            x.mul_(torch.empty(3, device="meta"))
        i = torch.empty(8, dtype=torch.int64, device="meta")
        i.add_(1)
        with pytest.raises(RuntimeError):  # an integer self cannot take a float result: checked again
            i.add_(1.5)
        assert x._version > 0  # autograd's version counter still moves (above this level)


def test_in_place_ops_are_told_by_their_schema_where_torch_has_no_inplace_tag(monkeypatch):
    """torch.Tag.inplace may be missing from an older supported torch: the schema alone must then
    tell an in-place op from an in-place view op or an out= op."""
    import tightfit.memory.meta_cache as mc

    aten = torch.ops.aten
    kinds = {}
    for tag in (getattr(torch.Tag, "inplace", None), None):
        monkeypatch.setattr(mc, "_INPLACE_TAG", tag)
        kinds[tag is None] = [mc._kind(op) for op in (aten.mul_.Tensor, aten.add_.Tensor, aten.transpose_.default,
                                                      aten.add.out, aten.add.Tensor, aten.view.default)]
    assert kinds[True] == kinds[False] == [mc._INPLACE, mc._INPLACE, mc._PLAIN, mc._PLAIN, mc._FRESH, mc._PLAIN]
