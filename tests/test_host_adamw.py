"""The offload's host step (one fused CPU AdamW over every offloaded parameter) gives, bit for bit,
the weights and state of torchao's per-parameter fused AdamW steps: over several windows, with a
parameter that has no gradient in one of them, after a learning-rate change through the groups,
and across a checkpoint (torch.save / torch.load(weights_only=True)), including one written by
the per-parameter optimizers. Runs on the CPU (the GPU glue is tested in test_optimizer_levers.py).
"""

import io

import torch

from tightfit.levers.host_adamw import HostAdamW
from tightfit.levers.optimizers import set_lr

SHAPES = [(64, 96), (4096,), (33, 130), (128, 64)]
LR, WD = 1e-3, 0.01


def host_tensors(seed=0):
    """Host copies as torchao allocates them: a weight with a preallocated gradient buffer."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in SHAPES:
        p = torch.randn(s, generator=g)
        p.grad = torch.empty_like(p)
        out.append(p)
    return out


class PerParameter:
    """torchao's step: one fused AdamW per host tensor, stepped for the tensors in the queue."""

    def __init__(self, params):
        self.params = params
        self.opts = [torch.optim.AdamW([{"params": p}], lr=LR, weight_decay=WD, fused=True) for p in params]

    @property
    def param_groups(self):
        return [g for o in self.opts for g in o.param_groups]

    def step(self, ready):
        ready = {id(p) for p in ready}
        for p, o in zip(self.params, self.opts):
            if id(p) in ready:
                o.step()

    def state_dict(self):
        return [o.state_dict() for o in self.opts]


def copy_of(params):
    out = []
    for p in params:
        c = p.detach().clone()
        c.grad = p.grad.clone()
        out.append(c)
    return out


def window(ref, new, step, skip=()):
    """Write a gradient into both sides' buffers (as the offload's copies do) for every tensor but
    those in ``skip`` (no gradient this window: the buffer keeps the earlier window's values),
    then step each side over the tensors that got one."""
    g = torch.Generator().manual_seed(100 + step)
    ready = [k for k in range(len(SHAPES)) if k not in skip]
    for k in ready:
        grad = torch.randn(SHAPES[k], generator=g)
        ref.params[k].grad.copy_(grad)
        new.params[k].grad.copy_(grad)
    ref.step([ref.params[k] for k in ready])
    new.step([new.params[k] for k in ready])


def assert_identical(ref: PerParameter, new: HostAdamW):
    for k, (a, b) in enumerate(zip(ref.params, new.params)):
        assert torch.equal(a, b), f"weight {k}"
        sa, sb = ref.opts[k].state.get(a, {}), new.state.get(b, {})
        assert sa.keys() == sb.keys(), f"state keys {k}"
        for key in sa:
            assert torch.equal(sa[key], sb[key]), f"state {key} of {k}"


def through_checkpoint(state_dict):
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def run_windows(ref, new, start, n, skip_at=None):
    for step in range(start, start + n):
        skip = (1,) if step == skip_at else ()
        window(ref, new, step, skip)
        assert_identical(ref, new)


def test_one_fused_step_equals_the_per_parameter_steps_bit_for_bit():
    base = host_tensors()
    ref, new = PerParameter(copy_of(base)), HostAdamW(copy_of(base), LR, WD)
    assert [p for g in new.param_groups for p in g["params"]] == new.params  # host tensors, with their grads
    assert all(g["fused"] for g in new.param_groups)  # the runtime takes no snapshot for fused groups
    run_windows(ref, new, 0, 3, skip_at=1)  # tensor 1 has no gradient in window 1
    assert int(new.state[new.params[1]]["step"]) == 2 and int(new.state[new.params[0]]["step"]) == 3
    for groups in (ref.param_groups, new.param_groups):  # the runtime's schedule
        for g in groups:
            set_lr(g, LR / 2)
    run_windows(ref, new, 3, 2)


def test_a_tensor_without_gradient_in_its_first_window_gets_no_state():
    base = host_tensors()
    ref, new = PerParameter(copy_of(base)), HostAdamW(copy_of(base), LR, WD)
    run_windows(ref, new, 0, 1, skip_at=0)
    assert new.params[1] not in new.state
    assert new.params[1].grad is not None  # its buffer is kept for the next copy
    run_windows(ref, new, 1, 2)


def test_resume_from_a_state_dict_is_exact():
    base = host_tensors()
    ref, new = PerParameter(copy_of(base)), HostAdamW(copy_of(base), LR, WD)
    run_windows(ref, new, 0, 3, skip_at=2)
    saved = through_checkpoint(new.state_dict())
    resumed = HostAdamW(copy_of(new.params), LR * 7, WD)  # the group's lr comes from the checkpoint
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["lr"] == LR
    run_windows(ref, resumed, 3, 3, skip_at=4)


def test_resume_from_the_per_parameter_optimizers_checkpoint_is_exact():
    """A checkpoint written by torchao's per-parameter optimizers (a list of state dicts) loads."""
    base = host_tensors()
    ref, new = PerParameter(copy_of(base)), HostAdamW(copy_of(base), LR, WD)
    run_windows(ref, new, 0, 2, skip_at=0)  # tensor 1: one step fewer than the others
    resumed = HostAdamW(copy_of(ref.params), LR, WD)
    resumed.load_state_dict(through_checkpoint(ref.state_dict()))
    assert_identical(ref, resumed)
    run_windows(ref, resumed, 2, 3)
