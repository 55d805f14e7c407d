"""The training step whose memory is estimated (on meta tensors) and measured (on a GPU).

One step = forward under autocast, loss, (scaled) backward, unscale, gradient clipping,
optimizer step, ``zero_grad(set_to_none=True)`` -- the order of tightfit's runtime loop.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def module_mode(model: torch.nn.Module, training: bool):
    """Put every submodule of ``model`` in train (``training=True``: dropout active) or eval
    mode for the ``with`` block, then give each module back the mode it had (DESIGN invariant
    9). Hugging Face's ``from_pretrained`` returns a model in eval mode, so whoever runs a
    training step -- the runtime, the GPU probe -- must set the mode itself.
    """
    before = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield model
    finally:
        for m, was in before:
            m.training = was


def training_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on ``batch`` as a 0-d fp32 tensor.

    ``labels`` of shape ``[B]`` are classification targets for ``logits [B, C]``; ``[B, T]``
    labels are next-token targets for ``logits [B, T, V]`` (shifted by one, as causal LMs train).
    Logits are upcast to fp32 first, as tightfit's runtime and Hugging Face's LM loss do.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    labels = batch["labels"]
    if labels.dim() == 2:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


# Optimizers the estimator and the runtime know: fused AdamW (tightfit's default on CUDA),
# multi-tensor ("foreach") AdamW, SGD with momentum.
OPTIMIZERS = ("adamw", "adamw-foreach", "sgd")


def make_optimizer(params, kind: str, device_type: str, lr: float = 1e-6, weight_decay: float = 0.01):
    """``adamw``: fused AdamW (one kernel per step, on CUDA and on the CPU); ``adamw-foreach``: the
    multi-tensor AdamW; ``sgd``: SGD with momentum 0.9. On the meta device, a stand-in that
    allocates the same state and temporaries (:class:`MetaOptimizer`).

    Fused AdamW allocates nothing at its step but the state on the first step, and that before
    any parameter or state is written: an out-of-memory error inside its step leaves the model
    and the optimizer as they were, so the runtime can redo the window (DESIGN invariant 10).

    Raises:
        ValueError: unknown ``kind``.
    """
    params = [p for p in params if p.requires_grad]
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}")
    if device_type == "meta":
        return MetaOptimizer(params, kind)
    if kind.startswith("adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                 fused=kind == "adamw",
                                 foreach=True if kind == "adamw-foreach" else None)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class MetaOptimizer:
    """Allocates what the optimizers of :data:`OPTIMIZERS` allocate, in the same order, on meta params.

    AdamW (``torch.optim.AdamW(fused=True)``): per parameter, on its first step, a 0-d fp32
    ``step`` tensor on the device, then ``exp_avg`` and ``exp_avg_sq`` (``zeros_like``); the
    fused kernel needs no temporaries. Foreach AdamW: the same state, and at every step one
    temporary per parameter of its size, ``torch._foreach_sqrt(exp_avg_sqs)`` for the whole
    group at once (``torch/optim/adam.py``, ``_multi_tensor_adam``), freed when the step ends.
    SGD with momentum: a ``momentum_buffer`` cloned from the gradient on the first step.
    Parameters without a gradient get no state.
    """

    def __init__(self, params, kind: str):
        self.params, self.kind, self.state = list(params), kind, {}
        # entered around the step's temporaries (the estimator labels them there)
        self.temporaries_context = contextlib.nullcontext

    def step(self):
        for p in self.params:
            if p.grad is None or p in self.state:
                continue
            if self.kind.startswith("adamw"):
                self.state[p] = (torch.zeros((), dtype=torch.float32, device=p.device),
                                 torch.zeros_like(p), torch.zeros_like(p))
            else:
                self.state[p] = (torch.clone(p.grad).detach(),)
        if self.kind == "adamw-foreach":
            self._temporaries([s[2] for p, s in self.state.items() if p.grad is not None])

    def _temporaries(self, exp_avg_sqs: list) -> None:
        with self.temporaries_context():
            sqrt = torch._foreach_sqrt(exp_avg_sqs)  # noqa: F841 -- alive until the step returns

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.state.values() for t in s]


def training_step(model, batch, optimizer, scaler, autocast_ctx, max_grad_norm: float | None = 1.0) -> None:
    """Run one full step (see the module doc). ``scaler`` may be None (no loss scaling);
    ``autocast_ctx`` is a zero-argument callable returning the autocast context."""
    with autocast_ctx():
        loss = training_loss(model, batch)
    if scaler is not None:
        loss = scaler.scale(loss)
    loss.backward()
    del loss
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    if max_grad_norm is not None and params:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
