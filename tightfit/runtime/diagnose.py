"""Find where non-finite values first appear in a micro-batch's forward or backward: named when a
run of skipped steps stops training (DESIGN invariant 3)."""

from __future__ import annotations

from typing import Callable, Sequence

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


def nonfinite_input(batch: dict, samples: int, indices: Sequence[int] | None = None) -> str | None:
    """Where a micro-batch's own floating-point tensors hold inf/NaN, as a phrase (e.g. ``"the
    batch's 'pixel_values' holds NaN (sample 3 of the data set)"``), else None. Only tensors with
    one row per sample (``shape[0] == samples``) are read; the kind named is that of the row named.
    A loss may mask such values by design (missing targets), so this is said beside the
    diagnosis (:func:`stop_phrase`), never in its place.

    Args:
        batch: the micro-batch, names to tensors with samples along dim 0 (any device).
        samples: the micro-batch's samples.
        indices: the data set's index of each of its samples (None: the place in the batch is named).
    """
    for key, v in batch.items():
        if (not isinstance(v, torch.Tensor) or not v.is_floating_point() or v.dim() == 0 or v.shape[0] != samples
                or not v.numel() or bool(torch.isfinite(v).all())):
            continue
        rows = v.detach().reshape(samples, -1)
        at = int((~torch.isfinite(rows)).any(dim=1).nonzero()[0, 0])
        kind = "NaN" if bool(torch.isnan(rows[at]).any()) else "inf"
        name = f"tensor at position {key}" if str(key).isdigit() else repr(key)  # a tuple batch's are numbered
        where = f"sample {at} of the batch" if indices is None else f"sample {indices[at]} of the data set"
        return f"the batch's {name} holds {kind} ({where})"
    return None


def stop_phrase(culprit: str, in_data: str | None, advice: str) -> str:
    """A stop's "first non-finite values in ..." sentence and its advice, with what the batch itself
    holds (:func:`nonfinite_input`) said beside the diagnosis and first in the advice."""
    if in_data is None:
        return f"first non-finite values in {culprit}. {advice}"
    return (f"first non-finite values in {culprit}; {in_data}. If such values are not meant to be in the data, "
            f"repair or drop those samples; otherwise: {advice[:1].lower()}{advice[1:]}")


def first_nonfinite(model: torch.nn.Module, forward: Callable[[], torch.Tensor], autocast_ctx: Callable,
                    train_ctx: Callable, scaled: bool, backward: bool = True) -> str:
    """Where one micro-batch's values first stop being finite, as the phrase a stop on non-finite
    steps names: the output of the first module (in execution order) that holds inf/NaN; else the
    loss (a loss of the user's own computed from finite outputs); else the first parameter whose
    gradient is not finite after the unscaled backward of that forward; else the loss-scaled
    backward (``scaled``), or the whole window (each micro-batch alone finite). Callers say beside
    it what the batch itself holds (:func:`nonfinite_input`, :func:`stop_phrase`).

    One forward, in train mode as the step runs it (a model whose output differs in eval mode,
    auxiliary heads say, or a loss that calls autograd, runs as it trained), with gradients
    enabled where ``backward`` and the RNG seeded alike on every rank; BatchNorm's statistics
    (which the skipped steps left as they found them, and the stop's checkpoint holds) and the RNG
    states are put back after, the gradients zeroed, and every module keeps its own mode (DESIGN invariant 9). A diagnosis that fails
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
        with torch.no_grad():  # its checks save nothing for backward (a checkpointed block counts what is saved)
            bad = not found and _nonfinite(output)
        if bad:
            found.append(names.get(module, type(module).__name__) or "<model>")

    rng = capture_rng()  # its dropout draws leave no trace in what follows
    # one seed on every rank: the same dropout masks, so that every rank finds the same place and
    # either all run the backward (and its collectives) or none does
    torch.manual_seed(0)
    handles = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with KeptBuffers(model.modules()):
            try:
                with torch.set_grad_enabled(backward), train_ctx():  # the backward's recomputation in train mode too
                    with autocast_ctx():
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
