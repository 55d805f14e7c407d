"""Find where non-finite values first appear in a forward pass."""

from __future__ import annotations

from typing import Callable

import torch

from ..step import module_mode


def _nonfinite(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_floating_point() and not bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return any(_nonfinite(v) for v in x)
    if isinstance(x, dict) or hasattr(x, "values"):
        try:
            return any(_nonfinite(v) for v in x.values())
        except TypeError:
            return False
    return False


@torch.no_grad()
def first_nonfinite_module(model: torch.nn.Module, batch: dict, autocast_ctx: Callable) -> str | None:
    """Run one forward pass with hooks and return the qualified name of the first module (in
    execution order) whose output holds inf/NaN, or None if the whole forward is finite.

    The forward runs in eval mode (:func:`tightfit.step.module_mode`), and every module gets its
    own mode back after (DESIGN invariant 9): a frozen BatchNorm left in eval mode inside a model in
    train mode stays in eval mode.

    Args:
        model: the model.
        batch: model inputs plus ``labels`` (dropped), on the model's device.
        autocast_ctx: returns the autocast context the training step uses.
    """
    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, inputs, output):
        if not found and _nonfinite(output):
            found.append(names.get(module, type(module).__name__) or "<model>")

    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        # module by module, not model.train(was_training) after: that put every part in the root's mode
        with module_mode(model, False), autocast_ctx():
            model(**{k: v for k, v in batch.items() if k != "labels"})
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
