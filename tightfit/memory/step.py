"""The training step whose memory is estimated (on meta tensors) and measured (on a GPU).

One step = forward under autocast, loss, (scaled) backward, unscale, gradient clipping,
optimizer step, ``zero_grad(set_to_none=True)`` -- the order of tightfit's runtime loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def make_optimizer(params, kind: str, device_type: str, lr: float = 1e-6):
    """The optimizer the runtime uses: fused AdamW on CUDA (foreach elsewhere), or SGD with
    momentum 0.9. On the meta device, a stand-in that allocates the same state
    (:class:`MetaOptimizer`).

    Raises:
        ValueError: unknown ``kind``.
    """
    params = [p for p in params if p.requires_grad]
    if kind not in ("adamw", "sgd"):
        raise ValueError(f"unknown optimizer {kind!r}")
    if device_type == "meta":
        return MetaOptimizer(params, kind)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=device_type == "cuda")
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class MetaOptimizer:
    """Allocates what fused AdamW / SGD-with-momentum allocate, in the same order, on meta params.

    AdamW (``torch.optim.AdamW(fused=True)``): per parameter, on its first step, a 0-d fp32
    ``step`` tensor on the device, then ``exp_avg`` and ``exp_avg_sq`` (``zeros_like``); the
    fused kernel needs no temporaries. SGD with momentum: a ``momentum_buffer`` cloned from
    the gradient on the first step. Parameters without a gradient get no state.
    """

    def __init__(self, params, kind: str):
        self.params, self.kind, self.state = list(params), kind, {}

    def step(self):
        for p in self.params:
            if p.grad is None or p in self.state:
                continue
            if self.kind == "adamw":
                self.state[p] = (torch.zeros((), dtype=torch.float32, device=p.device),
                                 torch.zeros_like(p), torch.zeros_like(p))
            else:
                self.state[p] = (torch.clone(p.grad).detach(),)

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
