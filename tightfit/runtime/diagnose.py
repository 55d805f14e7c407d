"""Find where non-finite values first appear in a micro-batch's forward or backward: named when a
run of skipped steps stops training (DESIGN invariant 3)."""

from __future__ import annotations

from typing import Callable

import torch



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


def nonfinite_input(batch: dict, indices: list[int] | None = None) -> str | None:
    """Where a micro-batch's own floating-point tensors hold inf/NaN, as a stop's phrase names it
    (e.g. ``"the batch's 'pixel_values' (NaN in sample 3 of the data set): the data itself"``), else
    None: non-finite data makes every step non-finite whatever the learning rate or precision, so
    it is looked for first.

    Args:
        batch: the micro-batch, names to tensors with samples along dim 0 (any device).
        indices: the data set's index of each of its samples (None: the place in the batch is named).
    """
    for key, v in batch.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all()):
            rows = v.detach().reshape(v.shape[0], -1) if v.dim() else v.detach().reshape(1, 1)
            at = int((~torch.isfinite(rows)).any(dim=1).nonzero()[0, 0])
            kind = "NaN" if bool(torch.isnan(v).any()) else "inf"
            name = f"element {key}" if str(key).isdigit() else repr(key)  # a tuple batch's tensors are numbered
            where = f"sample {at} of the batch" if indices is None else f"sample {indices[at]} of the data set"
            return f"the batch's {name} ({kind} in {where}): the data itself"
    return None


# what a stop on non-finite data advises, in place of the learning rate and precision
DATA_ADVICE = ("No learning rate or precision makes such a batch finite: repair or drop the samples "
               "that hold them.")


def first_nonfinite(model: torch.nn.Module, forward: Callable[[], torch.Tensor], autocast_ctx: Callable,
                    train_ctx: Callable, scaled: bool, backward: bool = True) -> str:
    """Where one micro-batch's values first stop being finite, as the phrase a stop on non-finite
    steps names: the output of the first module (in execution order) that holds inf/NaN; else the
    loss (a loss of the user's own computed from finite outputs); else the first parameter whose
    gradient is not finite after the unscaled backward of that forward; else the loss-scaled
    backward (``scaled``), or the whole window (each micro-batch alone finite). Callers look at the
    batch first (:func:`nonfinite_input`).

    One forward, in train mode as the step runs it (a model whose output differs in eval mode,
    auxiliary heads say, or a loss that calls autograd, runs as it trained), with gradients
    enabled where ``backward``; BatchNorm's statistics (which the skipped steps left as they found
    them, and the stop's checkpoint holds) and the RNG states are put back after, the gradients
    zeroed, and every module keeps its own mode (DESIGN invariant 9). A diagnosis that fails
    itself says so in the phrase: the stop's own error is what the caller raises. With several
    ranks, each must run the same forward and backward (the runtime diagnoses one global
    micro-batch on every rank); where the ranks hold batches of their own, ``backward=False``: the
    forward runs without gradients, as one rank's backward would leave it alone in collectives.

    Args:
        model: the model, in the layout it trains in.
        forward: runs ``model`` on the micro-batch and returns its loss (0-d), as the step does.
        autocast_ctx, train_ctx: return the step's autocast and train-mode contexts.
        scaled: the step scales the loss (fp16's GradScaler).
        backward: run the backward where the forward is finite (False: name the gradients as a whole).
    """
    from ..buffers import KeptBuffers
    from ..errors import error_line
    from ..rng import capture_rng, restore_rng

    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def hook(module, inputs, output):
        if not found and _nonfinite(output):
            found.append(names.get(module, type(module).__name__) or "<model>")

    rng = capture_rng()  # its dropout draws leave no trace in what follows
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with KeptBuffers(model.modules()):
            try:
                with torch.set_grad_enabled(backward), train_ctx(), autocast_ctx():
                    loss = forward()
                for h in handles:  # the backward's recomputed forwards (checkpointed blocks) name nothing
                    h.remove()
                if found:
                    return f"the output of module {found[0]!r}"
                if _nonfinite(loss):
                    return "the loss (every module's output is finite)"
                if not backward:
                    return "the gradients (this rank's forward is finite)"
                loss.backward()
                bad = next((n for n, p in model.named_parameters()
                            if p.grad is not None and not bool(torch.isfinite(p.grad).all())), None)
            except Exception as e:  # noqa: BLE001 - the stop's own error is the one to raise
                return f"a place not found (the forward and backward run to find it failed: {error_line(e)})"
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
        restore_rng(rng)
    if bad:
        return f"the gradient of {bad!r} (backward overflow)"
    if scaled:
        return "the loss-scaled backward (gradients overflowed after scaling)"
    return "the gradients of the whole window (each micro-batch alone is finite)"
