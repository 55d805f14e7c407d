"""Mixed precision: choose fp32/fp16/bf16 for a card, and the autocast context and loss scaler.

Rules (NVIDIA's mixed-precision training guide; Micikevicius et al. 2018, "Mixed Precision
Training"): bf16 needs compute capability >= 8.0 (Ampere) to run natively; fp16 pays for its
loss scaling only where tensor cores exist (sm_70+, except the GTX 16xx chips); Pascal's
GP102 (GTX 1080 Ti) runs fp16 arithmetic at 1/64 of fp32, so it uses fp16 only for memory.
"""

from __future__ import annotations

import contextlib

import torch

from ..config import option_given
from ..devices import DeviceProfile


def preferred_precision(profile: DeviceProfile | None) -> tuple[str, str]:
    """The precision to try first on this card, and why.

    Args:
        profile: the GPU, or None for the CPU.

    Returns:
        ``(precision, reason)`` with precision in ``fp32|fp16|bf16``.
    """
    if profile is None:
        return "fp32", "CPU: fp32 (autocast on the CPU is slower for training)"
    cc = profile.compute_capability
    if profile.bf16 and cc >= (8, 0):
        return "bf16", f"compute capability {cc[0]}.{cc[1]} >= 8.0: bf16 autocast (no loss scaling needed)"
    if profile.fp16_tensor_cores:
        return "fp16", f"fp16 tensor cores on sm_{cc[0]}{cc[1]}: fp16 autocast with dynamic loss scaling"
    return "fp32", (f"no tensor cores on sm_{cc[0]}{cc[1]} (fp16 at {profile.fp16_tflops / profile.fp32_tflops:.3g}x "
                    "the fp32 rate): fp32 unless memory needs fp16")


def fallback_precisions(profile: DeviceProfile | None, first: str) -> list[str]:
    """Precisions to try, in order, when ``first`` cannot fit the budget: fp16 saves activation
    memory on any GPU of compute capability >= 5.3; bf16 only where it runs natively."""
    if profile is None or first != "fp32":
        return [first]
    order = [first]
    if profile.bf16:
        order.append("bf16")
    if profile.compute_capability >= (5, 3):
        order.append("fp16")
    return order


SLOW_FP16_RATIO = 0.5  # warn when an explicit fp16 runs below this share of the fp32 rate


def check_precision(precision: str, profile: DeviceProfile | None) -> list[str]:
    """Validate a user's explicit precision for this device.

    Returns:
        Warnings for a precision the card runs but slowly: fp16 without tensor cores at under
        :data:`SLOW_FP16_RATIO` of the fp32 rate (Pascal's GP102: 1/64).

    Raises:
        TightfitError: bf16/fp16 asked for on the CPU, or bf16 below compute capability 8.0.
    """
    from ..errors import TightfitError

    if precision == "fp32":
        return []
    if profile is None:
        raise TightfitError(f"{option_given('precision', precision)} needs a CUDA GPU; on the CPU use fp32")
    if precision == "bf16" and not profile.bf16:
        cc = profile.compute_capability
        raise TightfitError(f"bf16 needs compute capability >= 8.0; {profile.name} is {cc[0]}.{cc[1]}: use fp16 or fp32")
    ratio = profile.fp16_tflops / profile.fp32_tflops
    if precision == "fp16" and not profile.fp16_tensor_cores and ratio < SLOW_FP16_RATIO:
        rate = f"1/{1 / ratio:.0f}" if ratio < 1 else f"{ratio:.2g}x"
        return [f"{profile.name} runs fp16 at {rate} of its fp32 rate ({profile.fp16_tflops:.3g} vs "
                f"{profile.fp32_tflops:.3g} TFLOP/s): --precision fp16 saves activation memory but trains far "
                "slower; --precision fp32 (or auto, which uses fp16 only when fp32 does not fit) is faster"]
    return []


def nonfinite_advice(precision: str, profile: DeviceProfile | None = None, lr: float | None = None,
                     own_loop: bool = False) -> str:
    """What to try after training stopped on non-finite gradients in ``precision``.

    fp16 overflows first (largest value 65504): bf16 where the card runs it natively, else fp32;
    bf16 has fp32's range but 8 bits of mantissa: fp32. In fp32 the precision is not the cause:
    the learning rate or the data is (a label or text that makes the loss explode), or, in the
    user's own loop, the batches or the loss function it was given.

    Args:
        precision: the precision the run used (``fp32|fp16|bf16``).
        profile: the GPU, or None (unknown: bf16 is then not suggested).
        lr: the run's peak learning rate, to suggest a tenth of it, at most 1e-3 (AdamW's usual
            rate from scratch; fine-tuning takes less): a tenth of a rate far beyond any that
            trains (``--lr 1e308``) would take many failed runs to reach one.
        own_loop: raised from the user's own training loop (:class:`tightfit.TrainStep`, the
            Lightning callback), whose data and loss tightfit did not make: the fp32 advice then
            names those, not texts and labels.

    Returns:
        One sentence, starting with "Try".
    """
    lower = f"a lower --lr (e.g. --lr {min(lr / 10, 1e-3):.0e})" if lr else "a lower --lr"
    if precision == "fp16" and profile is not None and profile.bf16:
        return f"Try --precision bf16 (fp32's range, no loss scaling) or fp32, or {lower}"
    if precision in ("fp16", "bf16"):
        return f"Try --precision fp32, or {lower}"
    if own_loop:
        return (f"Try {lower}: it blew up in fp32, so the precision is not the cause; also check the batches and "
                "the loss function for inf or nan values")
    return (f"Try {lower}: it blew up in fp32, so the precision is not the cause; also check the data for "
            "broken texts or labels")


_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def autocast(precision: str, device_type: str):
    """The ``torch.autocast`` context for ``precision`` (a no-op context for fp32).

    The cast weights are not cached (``cache_enabled=False``). torch's cache keeps the
    low-precision copy of every weight until the forward's autocast region ends: 2 bytes per
    parameter, held for nothing where blocks are recomputed (they cast again in backward) and
    on top of the window's gradients in every forward after the first of an accumulation window
    (BERT-large, bf16, 8-bit AdamW, all blocks checkpointed, micro-batch 32: 0.62 GiB of a
    4.24 GiB peak, NVIDIA H200). Each weight of a transformer is used once per forward, so the
    cache saves no casts; a weight a layer keeps for its backward is still saved by that layer.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=_DTYPES[precision], cache_enabled=False)


def make_grad_scaler(precision: str, device_type: str, init_scale: float = 2.0**16) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler``, enabled only for fp16 (bf16 and fp32 need no loss scaling).
    A disabled scaler passes ``scale``/``unscale_``/``step``/``update`` straight through.
    ``init_scale``: the first loss scale (PyTorch's default 2**16; the planner's probe uses 1)."""
    return torch.amp.GradScaler(device_type, init_scale=init_scale, enabled=(precision == "fp16"))
