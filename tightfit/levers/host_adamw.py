"""One fused CPU AdamW step over the host copies of CPU-offloaded parameters.

torchao's ``CPUOffloadOptimizer`` (0.18, ``torchao/optim/cpu_offload.py``) builds one
``torch.optim.AdamW`` per offloaded parameter and steps them one after the other, each a Python
call with its own argument checks and state grouping: one step over BERT-large's 335.1M
parameters in 393 tensors took 665 ms on an NVIDIA H200 host (32 threads), against 70 ms for
torch's fused CPU AdamW over the same parameters as one tensor
(``bench/results/optimizer-levers/optimizer_step_time.json``). On a 2-thread CPU, 132M
parameters in 165 tensors: 1,212 ms per parameter, 208 ms as one fused AdamW over all of them.

:class:`HostAdamW` is that one fused AdamW. A step updates only the parameters whose gradient
copy arrived in the window (torchao steps its queue of copies, nothing else): the others' host
gradient buffers still hold an earlier window's values, so they are withheld (``grad`` set to
None, which torch's AdamW skips) for the step and put back after it. The fused CPU kernel updates
each tensor on its own, with a ``step`` counter per tensor, so the result is bit-identical to the
per-parameter optimizers' (tested in ``tests/test_host_adamw.py``).
"""

from __future__ import annotations

from typing import Iterable

import torch


class HostAdamW:
    """A fused ``torch.optim.AdamW`` over host (CPU, fp32) tensors whose ``grad`` buffers are
    written from outside (the offload's gradient copies); :meth:`step` updates only those named.

    Args:
        params: the host tensors (each with its ``grad`` buffer, any shape), in a fixed order:
            the order of :meth:`state_dict`'s indices.
        lr, weight_decay: AdamW's (the other hyperparameters are torch's defaults).

    Raises:
        ValueError: ``params`` is empty (torch's optimizer refuses it).
    """

    def __init__(self, params: Iterable[torch.Tensor], lr: float, weight_decay: float):
        self.params = list(params)
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, fused=True)

    @property
    def param_groups(self) -> list[dict]:
        """The fused optimizer's groups (the host tensors with their host gradients): the runtime
        unscales and clips through them and sets their ``lr``."""
        return self.optimizer.param_groups

    @property
    def state(self):
        """Per-tensor AdamW state (``step``, ``exp_avg``, ``exp_avg_sq``), keyed by host tensor."""
        return self.optimizer.state

    @torch.no_grad()
    def step(self, ready: Iterable[torch.Tensor]) -> None:
        """One fused AdamW step over the tensors in ``ready`` (those whose gradient is complete
        for this window); every other tensor, its state and its gradient buffer are left as
        they are."""
        ready = {id(p) for p in ready}
        withheld = [(p, p.grad) for p in self.params if id(p) not in ready and p.grad is not None]
        for p, _ in withheld:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in withheld:
                p.grad = g  # the buffer the next window's copy writes into

    def state_dict(self) -> dict:
        """torch's optimizer state dict (tensors by the index of their host tensor)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load a :meth:`state_dict`, or the list of one-parameter state dicts that torchao's
        ``CPUOffloadOptimizer`` writes (one per host tensor, in the same order: checkpoints of
        the per-parameter step), merged by :func:`merge_per_parameter`.

        Raises:
            ValueError: the state does not match these tensors (count, shapes: torch's checks).
        """
        if isinstance(state_dict, list):
            state_dict = merge_per_parameter(state_dict, len(self.params))
        self.optimizer.load_state_dict(state_dict)


def merge_per_parameter(state_dicts: list[dict], n: int) -> dict:
    """One torch AdamW state dict over ``n`` tensors from ``n`` one-parameter state dicts (those of
    torchao's per-parameter optimizers, in parameter order); the group's hyperparameters are the
    first one's (tightfit gives all of them the same).

    Raises:
        ValueError: not ``n`` state dicts, or one of them is not over one parameter.
    """
    if len(state_dicts) != n:
        raise ValueError(f"the optimizer state holds {len(state_dicts)} offloaded parameters, this optimizer {n}")
    state = {}
    for i, sd in enumerate(state_dicts):
        if len(sd["param_groups"]) != 1 or len(sd["param_groups"][0]["params"]) != 1:
            raise ValueError("a per-parameter optimizer state must hold exactly one parameter")
        (index,) = sd["param_groups"][0]["params"]
        if index in sd["state"]:
            state[i] = sd["state"][index]
    group = {**state_dicts[0]["param_groups"][0], "params": list(range(n))} if n else None
    return {"state": state, "param_groups": [group] if group else []}
