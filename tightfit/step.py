"""The one training step: the runtime trains with it, the planner's GPU probe times and measures
it, and the memory estimator traces it on meta tensors (DESIGN invariant 13).

One optimizer step over one accumulation window, as nanoGPT's ``train.py`` writes it::

    for batch in micro_batches:                 # accumulate()
        with autocast:  loss = loss_sum(model, batch) / normaliser
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                  # apply_update(): unscale exactly once,
    clip_grad_norm_(params, max_grad_norm)      #   clip the true (unscaled) gradients,
    scaler.step(optimizer)                      #   step (skipped on inf/NaN),
    scaler.update()                             #   update the loss scale, also after a skip,
    optimizer.zero_grad(set_to_none=True)       #   and free the gradients.

The optimizer comes from :func:`make_optimizer` with the plan's ``optimizer``, the autocast
context and the loss scaler from the plan's precision, and checkpointing from the plan applied
to the model; the callers only differ in the guards around the step (the runtime's OOM
recovery, the probe's timing, the estimator's labelling of allocations).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from .masks import model_inputs


@contextlib.contextmanager
def module_mode(model: torch.nn.Module, training: bool):
    """Put every submodule of ``model`` in train (``training=True``: dropout active) or eval
    mode for the ``with`` block, then give each module back the mode it had (DESIGN invariant
    9). Hugging Face's ``from_pretrained`` returns a model in eval mode, so whoever runs a
    training step -- the runtime, the GPU probe -- must set the mode itself.
    """
    # Only the modules whose mode differs are touched: in the steady state (the runtime keeps the
    # model in train mode between steps) this costs one walk over the modules, no attribute writes.
    changed = [m for m in model.modules() if m.training != training]
    for m in changed:
        m.training = training  # what Module.train() sets, module by module
    try:
        yield model
    finally:
        for m in changed:
            m.training = not training


def _owners_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model its owner made, inside the wrappers that are made in train mode whatever the mode
    of what they wrap: DDP's or DataParallel's ``.module``, ``torch.compile``'s ``_orig_mod``, a
    peft model's base model."""
    for _ in range(8):  # a few layers of wrapping at most
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        elif type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
            model = model.get_base_model()
        else:
            break
    return model


def training_modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """The mode each submodule of ``model`` trains in, as ``(module, training)`` pairs (DESIGN
    invariant 9). A model whose root is in train mode keeps the modes its owner gave its parts
    (a backbone put in eval mode to freeze its BatchNorm statistics stays in eval mode, as in a
    plain PyTorch loop); a model whose root is in eval mode -- as Hugging Face's
    ``from_pretrained`` returns it -- trains with every module in train mode (dropout on). The root
    is the owner's model inside DDP, ``torch.compile`` or peft (:func:`_owners_model`): those
    wrappers are made in train mode around a model in any mode.
    """
    if _owners_model(model).training:
        return [(m, m.training) for m in model.modules()]
    return [(m, True) for m in model.modules()]


@contextlib.contextmanager
def train_mode(model: torch.nn.Module, modes: list[tuple[torch.nn.Module, bool]] | None = None):
    """Put the submodules of ``model`` in the modes a training step runs with -- ``modes`` (from
    :func:`training_modes`), by default :func:`training_modes` of the model as it is now -- for
    the ``with`` block, then give each module back the mode it had."""
    changed = [(m, mode) for m, mode in (training_modes(model) if modes is None else modes) if m.training != mode]
    for m, mode in changed:
        m.training = mode
    try:
        yield model
    finally:
        for m, mode in changed:
            m.training = not mode


def training_loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
    """Mean cross-entropy of ``model`` on ``batch`` as a 0-d fp32 tensor (the estimator's loss,
    which knows no workload: for one unpadded micro-batch it equals a workload's
    ``loss_sum / count``).

    ``labels`` of shape ``[B]`` are classification targets for ``logits [B, C]``; ``[B, T]``
    labels are next-token targets for ``logits [B, T, V]`` (shifted by one, as causal LMs train).
    Logits are upcast to fp32 first, as tightfit's runtime and Hugging Face's LM loss do.
    """
    from .tasks import model_logits  # the one call of a model for its logits, with its messages

    logits = model_logits(model, batch)
    labels = batch["labels"]
    if labels.dim() == 2:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


# Optimizers the estimator and the runtime know: fused AdamW (tightfit's default on CUDA),
# multi-tensor ("foreach") AdamW, SGD with momentum, and the levers of
# :mod:`tightfit.levers.optimizers`: 8-bit AdamW state (bitsandbytes), AdamW state offloaded to the
# CPU (torchao), bf16 weights with 8-bit AdamW state and stochastically rounded updates (torchao).
OPTIMIZERS = ("adamw", "adamw-foreach", "sgd", "adamw8bit", "adamw-offload", "adamw8bit-bf16")


def make_optimizer(params, kind: str, device_type: str, lr: float = 1e-6, weight_decay: float = 0.01,
                   accumulating: bool = False):
    """The optimizer of a plan (``plan.optimizer``) over the trainable ``params``: the one
    builder of the runtime, the GPU probe (lr 0) and the estimator (meta).

    ``adamw``: fused AdamW (one kernel per step, on CUDA and on the CPU); ``adamw-foreach``: the
    multi-tensor AdamW; ``sgd``: SGD with momentum 0.9; ``adamw8bit``: bitsandbytes' AdamW8bit;
    ``adamw-offload``: torchao's CPUOffloadOptimizer around a fused CPU AdamW (CUDA only);
    ``adamw8bit-bf16``: torchao's AdamW8bit rounding bf16 weights stochastically (the ``params``
    must be bf16 already; see :mod:`tightfit.levers.optimizers`). On the meta device, a stand-in
    that allocates the same GPU state and temporaries (:class:`MetaOptimizer`).

    Fused AdamW allocates nothing at its step but the state on the first step, and that before
    any parameter or state is written: an out-of-memory error inside its step leaves the model
    and the optimizer as they were, so the runtime can redo the window (DESIGN invariant 10).

    Args:
        params: parameters; those without ``requires_grad`` get no state (they are left out).
        kind: one of :data:`OPTIMIZERS`.
        device_type: the parameters' device type (``"cuda"``, ``"cpu"`` or ``"meta"``).
        lr, weight_decay: learning rate and decoupled weight decay (SGD: no weight decay).
        accumulating: the windows have several micro-batches (``adamw-offload`` then keeps the
            GPU gradients; the runtime switches it per window,
            :func:`tightfit.levers.optimizers.hold_gradients`).

    Raises:
        ValueError: unknown ``kind``.
        TightfitError: a lever whose library (bitsandbytes, torchao) is missing, ``adamw-offload``
            without CUDA, or ``adamw8bit-bf16`` over parameters that are not bf16.
    """
    params = [p for p in params if p.requires_grad]
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}")
    if device_type == "meta":
        return MetaOptimizer(params, kind, accumulating)
    if kind == "adamw8bit":
        from .levers.optimizers import adamw_8bit
        return adamw_8bit(params, lr, weight_decay)
    if kind == "adamw-offload":
        from .levers.optimizers import adamw_offload
        return adamw_offload(params, lr, weight_decay, accumulating)
    if kind == "adamw8bit-bf16":
        from .levers.optimizers import adamw_8bit_bf16
        return adamw_8bit_bf16(params, lr, weight_decay)
    if kind.startswith("adamw"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                 fused=kind == "adamw",
                                 foreach=True if kind == "adamw-foreach" else None)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


class MetaOptimizer:
    """Allocates on the GPU what the optimizers of :data:`OPTIMIZERS` allocate there, in the same
    order, on meta params.

    AdamW (``torch.optim.AdamW(fused=True)``): per parameter, on its first step, a 0-d fp32
    ``step`` tensor on the device, then ``exp_avg`` and ``exp_avg_sq`` (``zeros_like``); the
    fused kernel needs no temporaries. Foreach AdamW: the same state, and at every step one
    temporary per parameter of its size, ``torch._foreach_sqrt(exp_avg_sqs)`` for the whole
    group at once (``torch/optim/adam.py``, ``_multi_tensor_adam``), freed when the step ends.
    SGD with momentum: a ``momentum_buffer`` cloned from the gradient on the first step.
    8-bit AdamW (bitsandbytes ``AdamW8bit``, as :func:`tightfit.levers.optimizers.adamw_8bit`
    runs it: every parameter's state before any update): at the first quantized tensor
    (:func:`tightfit.levers.optimizers.is_quantized`) the two shared 256-entry fp32 quantization
    maps; per quantized tensor two uint8 code tensors of its shape, then two fp32 scale vectors of
    ``ceil(n / 256)``; fp32 ``zeros_like`` twice for the others; ``step`` counters are Python ints;
    its kernels allocate nothing at the step. CPU offload (torchao ``CPUOffloadOptimizer``):
    fused AdamW state only for the parameters kept on the GPU
    (:func:`tightfit.levers.optimizers.is_offloaded` false); the others' gradients are freed as
    backward produces them unless ``accumulating``.
    bf16 weights with torchao's 8-bit AdamW (``adamw8bit-bf16``, as
    :func:`tightfit.levers.optimizers.adamw_8bit_bf16` runs it: every parameter's state before any
    update; the parameters are bf16): per quantized tensor
    (:func:`tightfit.levers.optimizers.is_quantized_torchao`), for each moment in turn, uint8 codes
    of its shape, an fp32 scale per 256 elements and its own 256-entry fp32 map; bf16 ``zeros_like``
    twice for the others; a 0-d fp32 ``step`` counter per tensor, first; then, per param group and
    device where at least two tensors are small (under 4,096 elements,
    :func:`~tightfit.levers.optimizers.is_flat`), their counters and moments packed end to end for
    the flat call
    (:func:`tightfit.levers.optimizers._compiled_flat_update`: three new tensors, the per-tensor
    ones freed). At every step its compiled update (a chunk of consecutive 8-bit tensors per
    call, :func:`~tightfit.levers.optimizers._compiled_chunk_update`) holds, while it updates
    ``n`` elements of 8-bit tensors, fp32 temporaries of
    :data:`~tightfit.levers.optimizers.BF16_UPDATE_TEMPORARY_BYTES` (8) x ``n`` bytes (the two
    moments dequantized), and a chunk of several tensors their concatenations
    (:data:`~tightfit.levers.optimizers.CHUNK_TEMPORARY_BYTES` per element): counted here as one
    temporary, the largest call's (BERT-large: its word embeddings, updated alone; 241 MiB
    measured, bench/results/update-groups). Measured on an NVIDIA H200, torch 2.11, the second
    step of one tensor: 8.03 to 8.08 B per element for 1M to 67M elements
    (bench/results/optimizer-temporaries); the flat call holds its concatenated weights and
    gradients (4 B per element) instead where that is more.
    Parameters without a gradient get no state.

    Args:
        params: meta parameters, or param groups (dicts with ``"params"``) as ``torch.optim`` takes them.
        kind: one of :data:`OPTIMIZERS`.
        accumulating: as :func:`make_optimizer`'s (``adamw-offload`` keeps the gradients).
    """

    def __init__(self, params, kind: str, accumulating: bool = False):
        params = list(params)
        # as torch.optim's (for clipping, and adamw8bit-bf16's calls, which keep to one group)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.param_groups = [{**g, "params": list(g["params"])} for g in groups]
        self.params, self.kind, self.state = [p for g in self.param_groups for p in g["params"]], kind, {}
        self._qmaps = False  # adamw8bit: the shared quantization maps exist
        # entered around the step's temporaries (the estimator labels them there)
        self.temporaries_context = contextlib.nullcontext
        if kind == "adamw-offload" and not accumulating:
            from .levers.optimizers import is_offloaded
            for p in self.params:
                if is_offloaded(p.numel()):
                    p.register_post_accumulate_grad_hook(_free_grad)

    def step(self):
        from .levers.optimizers import (BLOCK_SIZE, QMAP_BYTES, TORCHAO_QMAP_BYTES, is_offloaded, is_quantized,
                                        is_quantized_torchao)

        for p in self.params:
            if p.grad is None or p in self.state:
                continue
            if self.kind == "adamw8bit-bf16":
                counter = (torch.zeros((), device=p.device),)  # the step counter, on the weight's device
                if not is_quantized_torchao(p.numel()):
                    self.state[p] = counter + (torch.zeros_like(p), torch.zeros_like(p))
                    continue
                self.state[p] = counter + tuple(
                    t for _ in range(2) for t in (torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
                                                  torch.zeros(p.numel() // BLOCK_SIZE, device=p.device),
                                                  torch.zeros(TORCHAO_QMAP_BYTES // 4, device=p.device)))
            elif self.kind == "adamw8bit":
                if not is_quantized(p.numel()):
                    self.state[p] = (torch.zeros_like(p, dtype=torch.float32), torch.zeros_like(p, dtype=torch.float32))
                    continue
                qmaps = () if self._qmaps else (torch.zeros(QMAP_BYTES // 4 // 2, device=p.device),
                                                torch.zeros(QMAP_BYTES // 4 // 2, device=p.device))
                self._qmaps = True  # shared by every tensor: counted once, with the first
                blocks = -(-p.numel() // BLOCK_SIZE)
                self.state[p] = qmaps + (torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
                                         torch.zeros(p.shape, dtype=torch.uint8, device=p.device),
                                         torch.zeros(blocks, device=p.device), torch.zeros(blocks, device=p.device))
            elif self.kind == "adamw-offload" and is_offloaded(p.numel()):
                self.state[p] = ()  # on the host
            elif self.kind.startswith("adamw"):
                self.state[p] = (torch.zeros((), dtype=torch.float32, device=p.device),
                                 torch.zeros_like(p), torch.zeros_like(p))
            else:
                self.state[p] = (torch.clone(p.grad).detach(),)
        if self.kind == "adamw-foreach":
            self._temporaries([s[2] for p, s in self.state.items() if p.grad is not None])
        if self.kind == "adamw8bit-bf16":
            self._pack_flat()
            self._dequantized_moments()

    def _stepped_sets(self) -> list[list[torch.Tensor]]:
        """The parameters with a gradient, one list per param group and device, in order: the
        sets that ``adamw8bit-bf16``'s calls keep to (none updates tensors of two)."""
        sets = {}
        for i, group in enumerate(self.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    sets.setdefault((i, p.device), []).append(p)
        return list(sets.values())

    def _pack_flat(self) -> None:
        """``adamw8bit-bf16``'s packing of its small tensors' state for the flat call
        (:meth:`~tightfit.levers.optimizers._bf16_class`'s ``_flat_sets``, once): per param group
        and device with at least two of them, their counters and moments copied end to end into
        three new tensors, the per-tensor ones then freed."""
        from .levers.optimizers import bf16_flat_call

        for stepped in self._stepped_sets():
            small = [stepped[i] for i in bf16_flat_call([p.shape for p in stepped])]
            if not small or all(self.state[p][1]._base is not None for p in small):
                continue
            n = sum(p.numel() for p in small)
            steps = torch.zeros(len(small), device=small[0].device)
            m1, m2 = (torch.zeros(n, dtype=small[0].dtype, device=small[0].device) for _ in range(2))
            start = 0
            for i, p in enumerate(small):
                k = p.numel()
                self.state[p] = (steps[i], m1[start:start + k].view(p.shape), m2[start:start + k].view(p.shape))
                start += k

    def _temporaries(self, exp_avg_sqs: list) -> None:
        with self.temporaries_context():
            sqrt = torch._foreach_sqrt(exp_avg_sqs)  # noqa: F841 -- alive until the step returns

    def _dequantized_moments(self) -> None:
        """The largest temporaries of the 8-bit bf16 update, one call's
        (:func:`~tightfit.levers.optimizers.bf16_step_temporary_bytes`: the dequantized moments of
        the call whose 8-bit tensors hold the most, within which the compiler may fuse the updates
        of same-sized tensors into one kernel that holds all their temporaries at once, or the flat
        call's concatenated weights and gradients)."""
        from .levers.optimizers import bf16_step_temporary_bytes

        held, stepped = max(((bf16_step_temporary_bytes(p.shape for p in ps), ps) for ps in self._stepped_sets()),
                            key=lambda x: x[0], default=(0, None))  # the calls keep to one group and device
        if not held:
            return
        with self.temporaries_context():
            held = torch.empty(held, dtype=torch.uint8, device=stepped[0].device)  # noqa: F841

    def zero_grad(self, set_to_none: bool = True):
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for s in self.state.values() for t in s]


def _free_grad(p: torch.Tensor) -> None:
    p.grad = None  # copied to the host as produced (CPU offload without accumulation)


@dataclass(frozen=True)
class StepResult:
    """What one :func:`training_step` did.

    Attributes:
        loss: the window's loss, the sum of every micro-batch's ``loss_sum / normaliser`` (a
            Python float; None on the meta device).
        grad_norm: global L2 norm of the unscaled gradients before clipping (a Python float;
            None on the meta device, which holds no values).
        finite: whether ``grad_norm`` is finite (True on the meta device). A non-finite step is
            not applied (with an enabled loss scaler, the scaler decides, from ``unscale_``).
    """

    loss: float | None
    grad_norm: float | None
    finite: bool


class PendingStep:
    """A training step launched on the GPU whose loss and gradient norm are not yet read.

    :func:`training_step` with ``defer=True`` returns one where the skip of a non-finite step
    is decided on the device (:func:`skips_on_device`): the two values are copied into pinned
    host memory behind the step's own kernels, so the host can queue the next step's work
    before reading them; :meth:`result` then waits for that copy only, not for work queued
    after it. Elsewhere (the CPU, optimizers that decide on the host) it holds the values
    already read.
    """

    def __init__(self, values: torch.Tensor | None = None, result: StepResult | None = None):
        """``values``: the 2-element float32 device tensor ``[grad norm, loss]``; or ``result``.

        Attributes:
            applied: with ``values``, a 0-d boolean device tensor, whether the update was applied
                (the gradient norm finite), for what must follow the verdict on the device.
            values: ``values`` (None with ``result``). Made during a CUDA graph's capture
                (:mod:`tightfit.runtime.graphs`), the step copies nothing to the host: the
                graph's replays are each given a new :class:`PendingStep` of ``values``.
        """
        self._result, self._host, self._copied, self.values = result, values, None, values
        self.applied = None if values is None else torch.isfinite(values[0])
        if values is not None and values.is_cuda and not torch.cuda.is_current_stream_capturing():
            self._host = torch.empty(2, dtype=torch.float32, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @property
    def known(self) -> StepResult | None:
        """The step's :class:`StepResult` if it is on the host already (None: still on the device)."""
        return self._result

    def result(self) -> StepResult:
        """The step's :class:`StepResult` (the first call waits for the device-to-host copy)."""
        if self._result is None:
            if self._copied is not None:
                self._copied.synchronize()
            grad_norm, loss = self._host.tolist()
            self._result = StepResult(loss, grad_norm, math.isfinite(grad_norm))
            self._host = self._copied = None
        return self._result


def skips_on_device(optimizer) -> bool:
    """Whether ``optimizer`` can skip a non-finite update on the device, given the verdict as a
    tensor (``found_inf``): PyTorch's fused optimizers (fused AdamW, fused SGD) on CUDA, which
    ``torch.amp.GradScaler`` drives the same way (``_step_supports_amp_scaling``, read by
    ``GradScaler.step`` in every torch since 2.0), and optimizers that say so with
    ``skips_nonfinite_on_device`` (``adamw8bit-bf16``: :func:`tightfit.levers.optimizers._bf16_class`).
    Others (bitsandbytes, CPU offload, foreach) need the verdict on the host before ``step()``."""
    groups = optimizer.param_groups
    first = next((p for g in groups for p in g["params"]), None)  # a fused optimizer's are on one device
    if first is None or not first.is_cuda or hasattr(optimizer, "wait_for_gradients"):
        return False
    if getattr(optimizer, "skips_nonfinite_on_device", False):  # tightfit's adamw8bit-bf16
        return True
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(g.get("fused") for g in groups)


def accumulate(model: torch.nn.Module, micro_batches: Iterable[dict], loss_sum: Callable, normaliser: float,
               scaler, autocast_ctx: Callable) -> torch.Tensor:
    """Forward and backward of every micro-batch of one window, adding to ``.grad``.

    Each micro-batch's loss is ``loss_sum(model, batch) / normaliser``, so with ``normaliser``
    the count of samples (or target tokens) of the whole window the summed gradient is that
    of one batch made of the same samples (DESIGN invariant 1). Each micro-batch is dropped
    before the next is drawn, so an iterator that makes or stages batches lazily holds one at
    a time.

    Args:
        model: in the mode the caller chose (training: train mode).
        micro_batches: dicts of tensors on the model's device, drawn one at a time.
        loss_sum: ``(model, batch) -> 0-d tensor``, the loss summed over what ``normaliser`` counts.
        normaliser: samples (or tokens) in the whole window, > 0.
        scaler: ``torch.amp.GradScaler`` (enabled: the loss is scaled before backward) or None.
        autocast_ctx: zero-argument callable returning the forward's autocast context.

    Returns:
        The window's loss: a 0-d detached tensor (sum over micro-batches of the normalised loss).

    Raises:
        ValueError: ``micro_batches`` is empty.
    """
    total = None
    for batch in micro_batches:
        with autocast_ctx():
            loss = loss_sum(model, batch)
            if normaliser != 1:  # dividing by 1 is the identity: no kernel, no extra 0-d tensor
                loss = loss / normaliser
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        del batch, loss
    if total is None:
        raise ValueError("a training step needs at least one micro-batch")
    return total


def apply_update(optimizer, scaler, max_grad_norm: float | None,
                 loss: torch.Tensor | None = None, defer: bool = False):
    """The update of one window: unscale exactly once, clip, step (or skip), update the loss
    scale, zero the gradients (DESIGN invariant 3).

    Clipping runs on every parameter of ``optimizer.param_groups`` (``max_grad_norm`` None:
    norm measured, nothing clipped). Without an enabled scaler a non-finite norm skips
    ``optimizer.step()`` (an optimizer with ``skips_nonfinite_on_device`` is stepped with the
    verdict as a device tensor instead, read or not, and skips the update itself); with one,
    ``scaler.step`` skips it when ``unscale_`` found inf/NaN or the norm is not finite (finite
    gradients whose norm overflows).
    ``scaler.update()`` runs also after a skipped step (the loss scale backs off).

    Args:
        optimizer: a ``torch.optim`` optimizer or :class:`MetaOptimizer` (or a wrapper of one
            with ``param_groups``, ``step`` and ``zero_grad``). One with ``wait_for_gradients``
            (CPU offload: ``param_groups`` hold the host copies) is waited for first.
        scaler: ``torch.amp.GradScaler`` (enabled or not) or None.
        max_grad_norm: clip the global L2 norm of the gradients to this; None: no clipping.
        loss: the window's 0-d loss tensor (:func:`accumulate`), read to the host in the same
            sync as the gradient norm (the non-finite guard needs the norm on the host before
            the step; reading the loss separately would cost a second sync per step); None: not read.
        defer: with ``loss``, where :func:`skips_on_device` holds, read nothing: the fused
            kernel (or ``adamw8bit-bf16``'s compiled update) is handed the verdict
            ``found_inf = not isfinite(norm)`` as a device tensor (as ``GradScaler.step`` hands
            it its own) and skips the update itself, with no host sync; the same decision as
            the host-side guard.

    Returns:
        ``(grad_norm, finite)`` as in :class:`StepResult`; with ``loss``, ``(grad_norm, finite,
        loss as a float)``; with ``defer`` and ``loss``, a :class:`PendingStep`.
    """
    if hasattr(optimizer, "wait_for_gradients"):  # CPU offload: the host copies of the gradients are complete
        optimizer.wait_for_gradients()
    scaling = scaler is not None and scaler.is_enabled()
    if scaling:
        scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    norm = torch.nn.utils.clip_grad_norm_(params, math.inf if max_grad_norm is None else max_grad_norm)
    if hasattr(norm, "full_tensor"):  # FSDP2's sharded gradients give a DTensor: the global norm, replicated
        norm = norm.full_tensor()
    if scaling and not norm.is_meta:
        # Finite gradients whose norm overflows (~1e19 and up in fp32) make a non-finite step too:
        # the scaler, whose unscale_ saw only finite values, is told so (on the device, no sync),
        # so that it skips the update and backs off the scale, as the guard reports the step.
        # (max, not add: a fused kernel skips only where found_inf is exactly 1.0)
        for found in scaler._found_inf_per_device(optimizer).values():
            found.copy_(torch.maximum(found, (~torch.isfinite(norm.detach())).to(found)))
    pending = None  # [grad norm, loss] left on the device: the skip is decided there
    loss_value, grad_norm = None, None
    # An optimizer that takes the verdict on the device is handed it even where the host reads the
    # norm: its skipped step then does what the deferred one does (adamw8bit-bf16 draws its
    # stochastic rounding's random numbers, applied or not), so both paths leave the same RNG state.
    verdict = norm.detach() if getattr(optimizer, "skips_nonfinite_on_device", False) and not norm.is_meta else None
    if defer and loss is not None and skips_on_device(optimizer):
        pending = torch.stack([norm.detach().float(), loss.detach().float().to(norm.device)])
        verdict = pending[0]
    elif norm.is_meta:
        pass
    elif loss is None:
        grad_norm = float(norm)  # a host sync; the tensor is freed before the step
    else:  # one host sync for both; the 2-element tensor is freed at once
        grad_norm, loss_value = torch.stack([norm.detach().float(), loss.detach().float().to(norm.device)]).tolist()
    del norm, loss
    finite = grad_norm is None or math.isfinite(grad_norm)
    if scaling:
        scaler.step(optimizer)  # skips the update itself if unscale_ found inf/NaN (fused: with no sync)
    elif verdict is not None:
        _step_unless_nonfinite(optimizer, verdict)
    elif finite:
        optimizer.step()
    with update_applied():  # the loss scaler's or the verdict's small allocations may run out of memory
        if scaler is not None:
            scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if pending is not None:
            return PendingStep(pending)
    return (grad_norm, finite) if loss_value is None else (grad_norm, finite, loss_value)


@contextlib.contextmanager
def update_applied():
    """Marks an error raised inside as coming after the optimizer's update was applied (its update,
    if not skipped, is in the weights and the state), for :func:`update_ran`: a caller must not
    redo the window, which would apply it twice (DESIGN invariant 10)."""
    try:
        yield
    except BaseException as e:
        e.tightfit_update_ran = True
        raise


def update_ran(error: BaseException) -> bool:
    """Whether ``error`` was raised inside :func:`update_applied` (after the optimizer's step had run)."""
    return bool(getattr(error, "tightfit_update_ran", False))


def _step_unless_nonfinite(optimizer, grad_norm: torch.Tensor) -> None:
    """``optimizer.step()`` as a no-op where ``grad_norm`` (0-d, on the device) is not finite:
    the fused kernel (or ``adamw8bit-bf16``'s compiled update) reads ``found_inf`` (1.0: skip)
    and leaves its step counters as they were."""
    optimizer.grad_scale = None
    optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


def training_step(model: torch.nn.Module, micro_batches: Iterable[dict], loss_sum: Callable, normaliser: float,
                  optimizer, scaler, autocast_ctx: Callable, max_grad_norm: float | None = 1.0,
                  defer: bool = False):
    """One optimizer step over one accumulation window: :func:`accumulate`, then
    :func:`apply_update` (see the module doc). The runtime, the GPU probe and the estimator's
    trace all run this function.

    Args:
        model, micro_batches, loss_sum, normaliser, scaler, autocast_ctx: as in :func:`accumulate`.
        optimizer, max_grad_norm: as in :func:`apply_update`.
        defer: return a :class:`PendingStep` (the values read when asked; with a fused
            optimizer or ``adamw8bit-bf16`` on CUDA the step ends with no host sync:
            :func:`apply_update`).

    Returns:
        A :class:`StepResult` (with ``defer``, a :class:`PendingStep`); the gradients are
        zeroed (``None``) after it.

    Raises:
        ValueError: no micro-batch. Errors of the model or the optimizer (out-of-memory
        included) propagate unchanged, leaving the gradients as they were at the error.
    """
    total = accumulate(model, micro_batches, loss_sum, normaliser, scaler, autocast_ctx)
    if total.is_meta:
        del total  # freed before the update, as the estimator traces it
        grad_norm, finite = apply_update(optimizer, scaler, max_grad_norm)
        return StepResult(None, grad_norm, finite)
    # the loss is read with the gradient norm: one host sync per window (apply_update's), or none
    done = apply_update(optimizer, scaler, max_grad_norm, loss=total, defer=defer)
    if isinstance(done, PendingStep):
        return done
    grad_norm, finite, loss = done
    result = StepResult(loss, grad_norm, finite)
    return PendingStep(result=result) if defer else result


def _versioned_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [p for g in optimizer.param_groups for p in g["params"]]
    return tensors + [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]


def in_place_versions(optimizer: torch.optim.Optimizer) -> dict[int, tuple[int, weakref.ref]]:
    """Version counter of every parameter and optimizer-state tensor, by ``id``, with a weak
    reference to the tensor (``id`` alone is not enough: a state tensor replaced during the step,
    as ``adamw8bit-bf16`` packs its small tensors' state anew after ``load_state_dict``, is freed
    and its ``id`` given to a new tensor). PyTorch bumps
    a tensor's version at each in-place write (the counter autograd uses to detect modified
    saved tensors; ``Tensor._version``, present in every torch release tightfit supports), so
    comparing two snapshots tells whether a step that failed part-way changed anything. Every
    AdamW implementation advances the per-parameter ``step`` counters before its first other
    write (the fused kernel itself bumps no version), so a started AdamW update always shows.
    ``adamw8bit-bf16``'s compiled update advances its counter last, but a compiled function
    bumps the versions of the inputs it mutates before its kernels run, so a started update
    shows there too (also one that was skipped on the device: an OOM inside it stops training,
    where a redo would have been safe)."""
    return {id(t): (t._version, weakref.ref(t)) for t in _versioned_tensors(optimizer)}


def changed_since(optimizer: torch.optim.Optimizer, before: dict[int, tuple[int, weakref.ref]]) -> bool:
    """True if a parameter or state tensor was written in place since ``before`` (state created
    since then, under a new ``id`` or a freed tensor's, counts from version 0: freshly zeroed or
    copied state that was never updated is unchanged)."""
    for t in _versioned_tensors(optimizer):
        version, ref = before.get(id(t), (0, None))
        if t._version != (version if ref is not None and ref() is t else 0):
            return True
    return False
