"""Work the planner does once instead of per estimate or per search: the meta copy of the model
(tightfit.memory.estimate.meta_copy, a direct copy of the module tree) and the forward's cost
(tightfit.planner.cost.forward_cost, remembered per model)."""

import copy

import torch
from torch import nn
from torch.nn.utils import parametrize

from tightfit.memory.estimate import meta_copy
from tightfit.planner import cost as cost_module


class _Double(nn.Module):
    def forward(self, x):
        return 2 * x


class _Net(nn.Module):
    """Tied weights, a module registered twice, a module reached through a plain list, a frozen
    parameter, a buffer, a user hook and a parametrized layer (another class: deepcopy's path)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied
        self.shared = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.again = self.shared  # the same module under two names
        self.plain = [self.a]  # a module held outside _modules
        self.norm = nn.BatchNorm1d(4)
        self.norm.weight.requires_grad_(False)
        self.p = nn.Linear(4, 4)
        parametrize.register_parametrization(self.p, "weight", _Double())
        self.a.seen = []  # a hook's record, kept on the module (deepcopy copies lists, not closures)
        self.a.shared = self.b.shared = {}  # one empty dict two modules share: still one in the copy
        self.a.register_forward_hook(lambda m, i, o: m.seen.append(1))

    def forward(self, x):
        return self.p(self.norm(self.again(self.b(self.a(x)))))


def _shape(m: nn.Module):
    """Everything the copy must keep: module types and names, parameter/buffer layouts and
    flags, which objects are the same object, the hooks."""
    ids = {}

    def who(x):
        return ids.setdefault(id(x), len(ids))

    mods = [(n, type(x).__name__, who(x), sorted(x.__dict__), len(x._forward_hooks)) for n, x in m.named_modules(remove_duplicate=False)]
    params = [(n, tuple(p.shape), p.dtype, p.requires_grad, p.device.type, who(p))
              for n, p in m.named_parameters(remove_duplicate=False)]
    bufs = [(n, tuple(b.shape), b.dtype, b.device.type, who(b)) for n, b in m.named_buffers(remove_duplicate=False)]
    return mods, params, bufs, who(m.plain[0])


def test_meta_copy_keeps_what_deepcopy_keeps():
    model = _Net()
    ours = meta_copy(model)
    memo = {}
    for p in model.parameters():
        memo.setdefault(id(p), nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad))
    for b in model.buffers():
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    theirs = copy.deepcopy(model, memo)
    assert _shape(ours) == _shape(theirs)
    assert ours.plain[0] is ours.a and ours.again is ours.shared and ours.b.weight is ours.a.weight
    assert ours.a.shared is ours.b.shared and ours.a.shared is not model.a.shared
    assert all(p.device.type == "meta" for p in ours.parameters())
    # the copy is its own: its hook lists and the original's are apart, and the original kept its weights
    ours.b._forward_hooks[0] = lambda *a: None
    assert not model.b._forward_hooks and model.a.weight.device.type == "cpu"
    ours(torch.empty(2, 4, device="meta"))
    assert ours.a.seen == [1] and model.a.seen == []


def test_forward_cost_is_traced_once_per_planning_call_and_keeps_nothing_after_it(monkeypatch):
    import gc
    import weakref

    from tightfit.models import build_model

    traced = []
    real = cost_module._trace_forward_cost
    monkeypatch.setattr(cost_module, "_trace_forward_cost", lambda *a: traced.append(1) or real(*a))

    def plan_once():
        model, make_batch = build_model("bert-base")
        holder = {"model": model}  # a batch maker that reaches the model, as the GPU planner's does
        make = lambda n, size: (holder, make_batch(n, size))[1]  # noqa: E731
        with cost_module.remembered_forward_costs():
            first = cost_module.forward_cost(model, make, 16, 12)
            assert cost_module.forward_cost(model, make, 16, 12) is first and len(traced) == 1
            assert cost_module.forward_cost(model, make, 32, 12).flops_per_sample > first.flops_per_sample
        model.eval()  # outside the scope every call traces: the model may have changed
        assert cost_module.forward_cost(model, make, 16, 12).ops < first.ops and len(traced) == 3  # no dropout
        return weakref.ref(model)

    gone = plan_once()
    gc.collect()
    assert gone() is None  # nothing kept the planned model (and its weights) alive
