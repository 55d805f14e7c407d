"""Find where non-finite values first appear in a micro-batch's forward or backward: named when a
run of skipped steps stops training (DESIGN invariant 3)."""

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


LOSS = "<loss>"  # what first_nonfinite_module names where only what ``forward`` returns is not finite


@torch.no_grad()
def first_nonfinite_module(model: torch.nn.Module, forward: Callable[[], object], autocast_ctx: Callable) -> str | None:
    """Run one forward pass with hooks and return the qualified name of the first module (in
    execution order) whose output holds inf/NaN, else a name for what ``forward`` returns where
    that alone is not finite (a loss of the user's own: :data:`LOSS`), or None if the whole forward is finite.

    The forward runs in eval mode (:func:`tightfit.step.module_mode`), and every module gets its
    own mode back after (DESIGN invariant 9): a frozen BatchNorm left in eval mode inside a model in
    train mode stays in eval mode.

    Args:
        model: the model.
        forward: runs ``model`` on one micro-batch on its device (the step's loss, say).
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
            out = forward()
    finally:
        for h in handles:
            h.remove()
    if not found and _nonfinite(out):  # every module's output finite, what forward computed from them not
        found.append(LOSS)
    return found[0] if found else None


def first_nonfinite(model: torch.nn.Module, forward: Callable[[], torch.Tensor], autocast_ctx: Callable,
                    train_ctx: Callable, scaled: bool, backward: bool = True) -> str:
    """Where one micro-batch's values first stop being finite, as the phrase a stop on non-finite
    steps names: the output of the first module that holds inf/NaN in an eval-mode forward
    (:func:`first_nonfinite_module`); else the first parameter whose gradient is not finite after
    one unscaled train-mode backward; else the loss-scaled backward (``scaled``), or the whole
    window (each micro-batch alone finite).

    The backward's forward would fold the micro-batch into BatchNorm's statistics, which the
    skipped steps left as they found them (and the stop's checkpoint holds): they are put back
    after the backward (BatchNorm's backward needs them unchanged since its forward); the
    gradients are zeroed and the RNG states restored. With several ranks, each must run the same
    forward and backward (the runtime diagnoses one global micro-batch on every rank); where the
    ranks hold batches of their own, ``backward=False``: one rank's finite forward would otherwise
    leave it alone in the backward's collectives.

    Args:
        model: the model, in the layout it trains in.
        forward: runs ``model`` on the micro-batch and returns its loss (0-d), as the step does.
        autocast_ctx, train_ctx: return the step's autocast and train-mode contexts.
        scaled: the step scales the loss (fp16's GradScaler).
        backward: run the backward where the forward is finite (False: name the gradients as a whole).
    """
    from ..buffers import KeptBuffers
    from ..rng import capture_rng, restore_rng

    name = first_nonfinite_module(model, forward, autocast_ctx)
    if name == LOSS:
        return "the loss (every module's output is finite)"
    if name:
        return f"the output of module {name!r}"
    if not backward:
        return "the gradients (this rank's forward is finite)"
    rng = capture_rng()  # its dropout draws leave no trace in what follows
    try:
        with KeptBuffers(model.modules()):
            with train_ctx(), autocast_ctx():
                loss = forward()
            loss.backward()
    finally:
        restore_rng(rng)
    bad = next((n for n, p in model.named_parameters()
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())), None)
    model.zero_grad(set_to_none=True)
    if bad:
        return f"the gradient of {bad!r} (backward overflow)"
    if scaled:
        return "the loss-scaled backward (gradients overflowed after scaling)"
    return "the gradients of the whole window (each micro-batch alone is finite)"
