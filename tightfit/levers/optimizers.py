"""Optimizer state that fits where AdamW's fp32 state does not: 8-bit moments (bitsandbytes), CPU
offload (torchao), and bf16 weights with 8-bit moments (torchao), all from
``pip install 'tightfit[levers]'``.

- ``adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` -- both moments quantized block-wise to 8 bits
  (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"). Layout
  (``bitsandbytes/optim/optimizer.py``, ``Optimizer2State.init_state``, 0.48-0.50): tensors of
  fewer than 4,096 elements (``min_8bit_size``) keep fp32 moments; larger ones two uint8 code
  tensors of the parameter's shape plus two fp32 scales per block of 256 (the last block may be
  partial): 2.03 B per element instead of 8 B. One signed and one unsigned 256-entry fp32
  quantization map are shared by all tensors of the optimizer (2 KiB). The ``step`` counters are
  Python ints, the learning rate a float.

  Why bitsandbytes rather than torchao's ``AdamW8bit``: one optimizer step over BERT-large's
  335.1M parameters in 393 tensors on an NVIDIA H200 (torch 2.11,
  ``bench/results/optimizer-levers/optimizer_step_time.json``) took 26.5 ms with bitsandbytes
  (one CUDA kernel per tensor, nothing allocated beyond its state) against 143.8 ms with torchao
  (a compiled call per tensor, ~0.37 ms of host time each, and fp32 dequantized copies of the
  tensor being updated); both hold 0.64 GiB of state. bitsandbytes (>= 0.50) also runs its 8-bit
  AdamW on the CPU, so the optimizer that trains on the GPU is tested on the CPU.
- ``adamw-offload``: ``torchao.optim.CPUOffloadOptimizer`` around a fused torch AdamW (Ren et al.
  2021, "ZeRO-Offload"): for every parameter of at least 4,096 elements, an fp32 master copy,
  its gradient and both moments live in pinned host memory (16 B per element); gradients are
  copied to the host on a side stream as backward produces them; the step runs on the CPU and
  the new weights are copied back. Without accumulation the GPU gradient is freed once copied
  (:func:`hold_gradients`). Smaller parameters keep a fused AdamW on the GPU.

  The host step is one fused torch AdamW over every offloaded parameter
  (:class:`tightfit.levers.host_adamw.HostAdamW`), not torchao's one AdamW per parameter stepped
  one by one: over BERT-large's 335.1M parameters in 393 tensors torchao's step took 665 ms on
  an NVIDIA H200 host against 70 ms for the fused CPU AdamW over one tensor of that size
  (``bench/results/optimizer-levers/optimizer_step_time.json``); on a 2-thread CPU, 132M
  parameters in 165 tensors, 1,212 ms per parameter against 208 ms for one fused step. Weights
  and state are bit-identical to the per-parameter steps.
- ``adamw8bit-bf16``: ``torchao.optim.AdamW8bit(..., bf16_stochastic_round=True)`` over bf16
  weights (Zamirai et al. 2020, "Revisiting BFloat16 Training"): the model's weights and so its
  gradients are bf16 (2 + 2 B per parameter, no fp32 master copy) and the two moments 8-bit;
  each update is computed in fp32 and rounded to bf16 stochastically (``_fp32_to_bf16_sr``,
  torchao/optim/quant_utils.py: away from zero with the probability of the dropped 16 bits), so
  an update below half a bf16 ulp moves the weight in expectation instead of rounding away. It
  changes the numerics (bf16 weights), and runs only under bf16 autocast
  (:func:`check_precision`). torchao's layout for bf16 parameters (torchao/optim/adam.py
  ``_new_buffer``, subclass_8bit.py ``OptimState8bit.zeros``, 0.18): tensors of at least 4,096
  elements whose size is a multiple of 256 keep each moment as uint8 codes of the parameter's
  shape, one fp32 scale per 256 elements and their own 256-entry fp32 look-up table; the others
  two bf16 moments (``zeros_like``); the learning rate is an fp32 0-d tensor on the CPU, the
  ``step`` counters fp32 0-d tensors (on the CPU in torchao; on the weights' device in tightfit,
  :func:`_bf16_class`). (bitsandbytes' AdamW8bit has no stochastic rounding: a bf16 weight of 1.0
  stays exactly 1.0 under 50 steps of lr 1e-4.)
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

from ..errors import TightfitError

LEVER_OPTIMIZERS = ("adamw8bit", "adamw-offload", "adamw8bit-bf16")
# the library (import name, of the ``levers`` extra) behind each lever
LEVER_LIBRARY = {"adamw8bit": "bitsandbytes", "adamw-offload": "torchao", "adamw8bit-bf16": "torchao"}
# The optimizers that keep the model's weights (and so its gradients) in bf16, with no fp32
# copy, and so need bf16 autocast: the one place that says so (:func:`weights_dtype`).
BF16_WEIGHTS = ("adamw8bit-bf16",)

# bitsandbytes' 8-bit layout (bitsandbytes/optim/optimizer.py: ``min_8bit_size``, the block size of
# ``Optimizer2State.init_state``, ``fill_qmap``) and torchao's offload threshold
# (torchao/optim/cpu_offload.py ``minimal_size``).
QUANTIZED_MIN_NUMEL = 4096
BLOCK_SIZE = 256
QMAP_BYTES = 2 * 256 * 4  # a signed and an unsigned fp32 map, shared by all tensors of one optimizer
OFFLOAD_MIN_NUMEL = 4096
# torchao's 8-bit layout (torchao/optim/adam.py ``_new_buffer``: "follow bitsandbytes, only
# quantize tensors >= 4096 values", and a whole number of blocks; subclass_8bit.py: a 256-entry
# fp32 map per moment of each quantized tensor).
TORCHAO_QMAP_BYTES = 256 * 4
_BF16_NEEDS = "optimizer adamw8bit-bf16 (bf16 weights, 8-bit AdamW state)"  # what a missing torchao stops


def _library(module: str, what: str):
    """``module`` (a lever's library), imported on first use.

    Raises:
        TightfitError: the library is not installed (one line: ``what`` needs it, and the extra).
    """
    try:
        return __import__(module, fromlist=["_"])  # the submodule itself
    except ImportError:
        raise TightfitError(f"{what} needs {module.split('.')[0]}: pip install 'tightfit[levers]'") from None


def _torchao_optim(what: str = "CPU-offloaded optimizer state"):
    """``torchao.optim`` (raises TightfitError, saying ``what`` needs torchao, when it is missing)."""
    return _library("torchao.optim", what)


def _bnb_optim():
    """``bitsandbytes.optim`` (raises TightfitError when bitsandbytes is missing)."""
    return _library("bitsandbytes.optim", "8-bit optimizer state")


def is_quantized(numel: int) -> bool:
    """Whether bitsandbytes' 8-bit AdamW keeps a tensor of ``numel`` elements in 8 bits."""
    return numel >= QUANTIZED_MIN_NUMEL


def adamw_8bit_state_bytes(numels) -> int:
    """Bytes of the state ``adamw8bit`` holds on the parameters' device for trainable tensors of
    ``numels`` elements (fp32 or lower-precision weights alike), once every one has stepped: per
    quantized tensor (:func:`is_quantized`) two uint8 codes per element and two fp32 scales per
    block of :data:`BLOCK_SIZE` elements (``ceil(n / 256)`` blocks); 8 B per element of the
    others; :data:`QMAP_BYTES` once if any tensor is quantized. Source: bitsandbytes
    ``Optimizer2State.init_state`` (0.48-0.50)."""
    numels = list(numels)
    quantized = [n for n in numels if is_quantized(n)]
    return (sum(2 * n + 2 * 4 * -(-n // BLOCK_SIZE) for n in quantized)
            + sum(8 * n for n in numels if not is_quantized(n)) + (QMAP_BYTES if quantized else 0))


def is_offloaded(numel: int) -> bool:
    """Whether ``CPUOffloadOptimizer`` moves a parameter of ``numel`` elements to the host."""
    return numel >= OFFLOAD_MIN_NUMEL


def adamw_8bit(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """bitsandbytes' ``AdamW8bit`` over ``params`` (trainable; CUDA or CPU), as :func:`_8bit_class`
    adapts it to tightfit's step guards.

    Raises:
        TightfitError: bitsandbytes is not installed.
    """
    return _8bit_class()(params, lr=lr, weight_decay=weight_decay)


@functools.cache
def _8bit_class():
    """The subclass of ``bitsandbytes.optim.AdamW8bit`` that tightfit's step needs (built on first
    use, so that bitsandbytes is imported lazily):

    - ``step`` allocates the state of every parameter that has none before it updates any (the
      library allocates and updates one parameter after the other): an out-of-memory error while
      the first step's state is allocated leaves every weight and moment unwritten, and the
      runtime drops the new state and redoes the window (DESIGN invariant 10), as with fused AdamW;
    - each update bumps the version counter of the parameter it wrote (the library's kernels write
      through raw pointers, invisible to autograd), so that the runtime's partial-update check
      (:func:`tightfit.step.changed_since`) sees a step that failed half-way;
    - ``load_state_dict`` shares one copy of each quantization map per device again (a checkpoint
      holds one per tensor, and the library moves each to the device separately);
    - ``step`` leaves out the library's device synchronisation after every tensor's update
      (:func:`_stream_ordered`), where the kernels are ordered on the default stream anyway.
    """
    base = _bnb_optim().AdamW8bit

    class AdamW8bit(base):
        @torch.no_grad()
        def step(self, closure=None):
            if not self.initialized:  # as the library's first step does, before any state exists
                self.check_overrides()
                self.to_gpu()
                self.initialized = True
            for gindex, group in enumerate(self.param_groups):
                for pindex, p in enumerate(group["params"]):
                    if p.grad is not None and len(self.state[p]) == 0:
                        self.init_state(group, p, gindex, pindex)
            with _stream_ordered(self):
                return super().step(closure)

        def update_step(self, group, p, gindex, pindex):
            super().update_step(group, p, gindex, pindex)
            torch.autograd.graph.increment_version(p)

        def load_state_dict(self, state_dict, move_to_device=True):
            super().load_state_dict(state_dict, move_to_device)
            shared = {}
            for s in self.state.values():
                for key in ("qmap1", "qmap2"):
                    if isinstance(s.get(key), torch.Tensor):
                        s[key] = shared.setdefault((key, s[key].device), s[key])

    return AdamW8bit


# False restores bitsandbytes' device sync after every tensor's update (bench/optimizer_sync.py
# times both in one run).
SKIP_PER_TENSOR_SYNC = True


@contextlib.contextmanager
def _stream_ordered(optimizer):
    """Within it, bitsandbytes' ``Optimizer8bit.step`` does not call ``torch.cuda.synchronize()``
    after each tensor's update (``bitsandbytes/optim/optimizer.py``, ``sync_gpu(p)``, 0.48-0.50).

    That sync is there for paged state, whose updates run asynchronously to a prefetch; for state
    in ordinary device memory it only makes the host wait for the GPU once per tensor (BERT-base:
    ~200 syncs per step, the host idle while each kernel runs and the queue drains, bench/results/
    speed-4's profile). The library launches its kernels on the default CUDA stream, so where
    PyTorch's current stream is the default stream too, every later kernel (the next forward, the
    checkpoint's copies) is ordered after the update without it. Paged state, or a step run on
    another stream, keeps the library's syncs. (bitsandbytes PR #2050, open, proposes the same for
    non-paged CUDA optimizers.)
    """
    import bitsandbytes.optim.optimizer as library

    default_stream = not torch.cuda.is_available() or torch.cuda.current_stream() == torch.cuda.default_stream()
    if not SKIP_PER_TENSOR_SYNC or optimizer.is_paged or not default_stream:
        yield
        return
    from unittest import mock

    with mock.patch.object(library, "sync_gpu", lambda t: None):
        yield


def weights_dtype(kind: str) -> torch.dtype | None:
    """The dtype optimizer ``kind`` keeps the model's floating-point weights in: ``torch.bfloat16``
    for :data:`BF16_WEIGHTS`, None for the others (the weights stay as they are, fp32). The
    runtime casts the model to it before building the optimizer, the GPU probe casts for its steps
    and restores the weights after (:func:`weights_in`), the estimator traces a copy in it."""
    return torch.bfloat16 if kind in BF16_WEIGHTS else None


def trainable_gradient_bytes(model: torch.nn.Module, kind: str = "adamw") -> int:
    """Bytes of the gradients of every trainable parameter: in the parameter's dtype, or in
    :func:`weights_dtype` of optimizer ``kind`` (bf16 under ``adamw8bit-bf16``)."""
    dtype = weights_dtype(kind)
    return sum(p.numel() * (dtype.itemsize if dtype is not None and p.is_floating_point() else p.element_size())
               for p in model.parameters() if p.requires_grad)


def check_precision(kind: str, precision: str, profile=None) -> None:
    """Refuse a precision that optimizer ``kind`` cannot train with: bf16 weights need bf16
    autocast (fp32 autocast would not run the matrix products in the weights' dtype; fp16's
    loss scaling would unscale bf16 gradients that have no room to spare).

    Args:
        profile: the card planned for (a :class:`~tightfit.devices.DeviceProfile`), or None
            (not known yet): bf16 weights are refused first on a card without bf16, whatever
            the precision, since no precision would do there.

    Raises:
        TightfitError: ``kind`` keeps bf16 weights and the card does not run bf16, or
            ``precision`` is not ``"bf16"`` (``"auto"`` passes: the planner then searches bf16 only).
    """
    from ..config import option_given  # the options as this face names them (--optimizer, optimizer=)

    if kind in BF16_WEIGHTS and profile is not None and not profile.bf16:
        cc = profile.compute_capability
        raise TightfitError(f"{option_given('optimizer', kind)} keeps the weights in bf16, which needs compute "
                            f"capability >= 8.0; {profile.name} is {cc[0]}.{cc[1]}: use "
                            f"{option_given('optimizer', 'adamw8bit')} or adamw-offload")
    if kind in BF16_WEIGHTS and precision not in ("bf16", "auto"):
        raise TightfitError(f"{option_given('optimizer', kind)} keeps the weights in bf16 and trains under bf16 "
                            f"autocast only, not {option_given('precision', precision)}: use "
                            f"{option_given('precision', 'bf16')}")


def cast_weights(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """``model`` with its floating-point parameters and buffers in :func:`weights_dtype` of
    ``kind`` (in place, ``Module.to``: the parameter objects stay the same); unchanged for
    optimizers that keep the weights as they are.

    Raises:
        TightfitError: ``kind``'s library (torchao) is missing, for a model with real (not meta)
            weights: refused before the cast, which drops each fp32 weight's low 16 bits for good
            (a refusal when the optimizer is made after it would leave your model in bf16).
    """
    dtype = weights_dtype(kind)
    if dtype is None:
        return model
    if any(not p.is_meta for p in model.parameters()):  # the estimator's meta copy needs no library
        _torchao_optim(_BF16_NEEDS)
    return model.to(dtype)


@contextlib.contextmanager
def weights_in(model: torch.nn.Module, kind: str):
    """The ``with`` block runs with ``model``'s floating-point parameters and buffers in
    :func:`weights_dtype` of ``kind``; after it every one is exactly what it was, bit for bit
    and the same object: each parameter's data is copied back from a host copy made before the
    cast (bf16 cannot hold fp32 weights), each buffer is the original tensor again. A no-op for
    optimizers that keep the weights as they are.
    """
    dtype = weights_dtype(kind)
    if dtype is None:
        yield model
        return
    params = [(p, p.detach().to("cpu", copy=True)) for p in model.parameters()
              if p.is_floating_point() and p.dtype != dtype]
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    try:
        for p, _ in params:
            p.data = p.data.to(dtype)  # the fp32 data is freed: only the host copy is left
        for m, name, b in buffers:
            if b.is_floating_point():
                m._buffers[name] = b.to(dtype)
        yield model
    finally:
        for p, host in params:  # every low-precision copy freed before the fp32 weights come back
            p.data = torch.empty(0, dtype=host.dtype, device=p.device)
        for p, host in params:
            p.data = host.to(p.device)
        for m, name, b in buffers:
            m._buffers[name] = b


def allow_state_classes(error: Exception) -> bool:
    """Whether ``torch.load(weights_only=True)`` may succeed on a second try after ``error``: it
    refused a class of torchao's optimizer state (``OptimState8bit`` of ``adamw8bit-bf16``), and
    torchao, now imported, allows its classes (torchao/optim/subclass_8bit.py calls
    ``torch.serialization.add_safe_globals`` on import). False if torchao is not installed."""
    import importlib.util

    if "torchao.optim" not in str(error) or importlib.util.find_spec("torchao") is None:
        return False
    _torchao_optim(_BF16_NEEDS)
    return True


# fp32 bytes per element that torchao's 8-bit update (as _compiled_update runs it) holds above
# the state while it updates one 8-bit tensor: its two moments dequantized. NVIDIA H200, torch
# 2.11: 8.03-8.08 B per element for 1M-67M elements (bench/results/optimizer-temporaries).
BF16_UPDATE_TEMPORARY_BYTES = 8


def is_quantized_torchao(numel: int) -> bool:
    """Whether torchao's 8-bit AdamW keeps a tensor of ``numel`` elements in 8 bits (at least
    4,096 elements, a whole number of 256-element blocks)."""
    return numel >= QUANTIZED_MIN_NUMEL and numel % BLOCK_SIZE == 0


def adamw_8bit_bf16_state_bytes(numels) -> int:
    """Bytes of the state ``adamw8bit-bf16`` holds on the parameters' device for bf16 trainable
    tensors of ``numels`` elements, once every one has stepped: per quantized tensor
    (:func:`is_quantized_torchao`) two uint8 codes per element, two fp32 scales per 256 elements
    and two 256-entry fp32 maps (:data:`TORCHAO_QMAP_BYTES` each); two bf16 moments (4 B per
    element) for the others; a 0-d fp32 ``step`` counter per tensor (4 B; the CUDA allocator
    rounds each to 512 B, as every small tensor). Source: torchao 0.18 ``_AdamBase._new_buffer``
    and ``OptimState8bit.zeros``; the counters' device: :func:`_bf16_class`."""
    return sum(4 + (2 * n + 2 * 4 * (n // BLOCK_SIZE) + 2 * TORCHAO_QMAP_BYTES if is_quantized_torchao(n) else 4 * n)
               for n in numels)


def adamw_8bit_bf16(params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """torchao's ``AdamW8bit`` with stochastic rounding to bf16 over bf16 ``params`` (trainable;
    CUDA or CPU), as :func:`_bf16_class` adapts it to tightfit's step guards.

    Raises:
        TightfitError: torchao is not installed, or a parameter is not bf16 (cast the model first:
            :func:`cast_weights`; torchao would step fp32 weights without rounding, silently).
    """
    params = list(params)
    wrong = sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16})
    if wrong:
        raise TightfitError(f"optimizer adamw8bit-bf16 needs bf16 weights, got {', '.join(wrong)} parameters "
                            "(cast the model to bf16 first)")
    return _bf16_class()(params, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=True)


def _skippable_update():
    """torchao's per-parameter AdamW update (``torchao.optim.adam.single_param_adam``), made
    skippable on the device; uncompiled, the one body of every compiled call (per tensor, flat,
    chunk). Called as ``skippable(p, grad, step, found_inf, m1, m2, signed1, signed2, lr, beta1,
    beta2, weight_decay, eps, is_adamw, stochastic_round)``, where ``m1``/``m2`` are a moment's
    plain tensors (:func:`_moment_parts`) and ``step`` the counter before this update (0-d, or one
    per row of ``p``); returns the 0-d verdict ``apply`` (True: the update was written), by which
    the caller advances its counters. See :func:`_compiled_update`."""
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_8bit import OptimState8bit

    def moment(parts, signed):  # (codes, block scales, map) of an 8-bit moment, or (a plain moment,)
        return OptimState8bit(*parts, signed) if len(parts) == 3 else parts[0]

    def skippable(p, grad, step, found_inf, m1, m2, signed1, signed2, *rest):
        apply = found_inf == 0
        new_p = p.clone()
        new1 = tuple(t.clone() for t in m1[:2]) + tuple(m1[2:])  # the map is only read
        new2 = tuple(t.clone() for t in m2[:2]) + tuple(m2[2:])
        single_param_adam(new_p, grad, step + 1, moment(new1, signed1), moment(new2, signed2), None, *rest)
        for old, new in zip((p, *m1[:2], *m2[:2]), (new_p, *new1[:2], *new2[:2])):
            old.copy_(torch.where(apply, new, old))
        return apply

    return skippable


def _moment_parts(state):
    """(the plain tensors of a moment, whether it is signed): an 8-bit ``OptimState8bit``'s
    (codes, block scales, map), or a bf16 moment alone."""
    from torchao.optim.subclass_8bit import OptimState8bit
    if type(state) is OptimState8bit:
        return (state.codes, state.scale, state.qmap), state.signed
    return (state,), False


@functools.cache
def _compiled_update():
    """torchao's per-parameter AdamW update (``torchao.optim.adam.single_param_adam``) compiled
    once, as torchao's step compiles it (``fullgraph=True, dynamic=False``), made skippable on
    the device. Called as ``update(p, grad, step, exp_avg, exp_avg_sq, found_inf, lr, beta1,
    beta2, weight_decay, eps, is_adamw, stochastic_round)``: ``step`` is the parameter's 0-d
    fp32 counter on ``p``'s device, ``found_inf`` a 0-d fp32 tensor on that device (1.0: a
    gradient was not finite).

    With ``found_inf`` 0 it is torchao's update with torchao's math, order and stochastic-rounding
    draws (``single_param_adam`` at ``step + 1``, then the counter advanced; the weights
    bit-identical to torchao's own step, tests/test_bf16_weights.py); with 1 nothing is written,
    the counter included: the update is computed on copies and each written tensor is selected
    back with ``torch.where``, so the verdict never goes to the host and the step needs no
    sync (:func:`tightfit.step.skips_on_device`). Inductor fuses the copies into the update's
    kernels (an NVIDIA H200's step time unchanged, 1.25 vs 1.22 ms on an 8192 x 8192 tensor). The
    update of an 8-bit tensor still holds fp32 temporaries of :data:`BF16_UPDATE_TEMPORARY_BYTES`
    per element while it runs, as torchao's own did (514 MiB above the state for that tensor),
    which the estimator's :class:`tightfit.step.MetaOptimizer` counts.

    Two host costs of torchao's own step are left out:

    - torchao calls ``torch.compile(single_param_adam, ...)`` anew for every parameter of every
      step, a fresh wrapper around the same cached code: here one compiled function serves all;
    - 8-bit moments are torchao's ``OptimState8bit`` tensor subclass, which every call of a
      compiled function flattens and rebuilds in Python: here the compiled function takes their
      plain tensors (codes, block scales, quantization map) and wraps them inside the graph.

    NVIDIA H200 host, BERT-large's 393 bf16 tensors (bench/results/optimizer-dispatch): 281 ms per
    step as shipped, 139 ms through one compiled function; on another machine
    (bench/results/optimizer-dispatch-2) 77.9 ms through one function, 44.6 ms with the plain
    tensors. The update itself is ~8 ms of GPU time. (AMSGrad has no skippable variant: the
    optimizer's ``step`` refuses it.) Here go the tensors that fit neither the chunks
    (:func:`_compiled_chunk_update`) nor the flat call: sharded (DTensor) weights, and large tensors
    whose moments are not 8-bit.
    """
    skippable = _skippable_update()

    def one(p, grad, step, found_inf, *rest):
        step.add_(skippable(p, grad, step, found_inf, *rest).to(step.dtype))

    compiled = torch.compile(one, fullgraph=True, dynamic=False)

    def update(p, grad, step, exp_avg, exp_avg_sq, found_inf, *rest):
        (m1, signed1), (m2, signed2) = _moment_parts(exp_avg), _moment_parts(exp_avg_sq)
        return compiled(p, grad, step, found_inf, m1, m2, signed1, signed2, *rest)

    return update


@functools.cache
def _compiled_chunk_update():
    """:func:`_compiled_update` over a chunk of 8-bit tensors (:func:`update_chunks`) laid end to
    end as 256-element blocks: one compiled graph, its block count dynamic, serves every chunk
    and every lone 8-bit tensor of a param group's hyperparameters (they are constants of the
    graph, as in the other calls: a group with another weight decay compiles its own). Called as ``update(params, grads, steps,
    exp_avg, exp_avg_sq, found_inf, lr, beta1, beta2, weight_decay, eps, is_adamw,
    stochastic_round)``: ``params`` the weights (detached, contiguous, each a whole number of
    256-element blocks), ``grads`` their gradients, ``steps`` their 0-d fp32 counters (they may
    differ), ``exp_avg``/``exp_avg_sq`` their ``OptimState8bit`` moments.

    Why: the step is bound by the host, and compilation by the graphs' size. A graph that
    unrolled one update per tensor of a layer (the repeats of a model's tensor sequence, one
    call per layer) cost ~0.1 ms of host time per tensor and compiled for ~30 s on a CPU for
    BERT's 7 8-bit tensors (bench/results/chunked-update); here a chunk costs a few launches
    (the concatenations, one graph of one update, a multi-tensor copy back per dtype, the
    counters' add) and one graph of one update compiles once. A lone tensor pays those few
    launches too (on a CPU ~345 against ~300 us for a 4,096-element tensor through
    :func:`_compiled_update`): the price of one graph for every shape.

    The math per element is :func:`_compiled_update`'s: a chunk's blocks are its tensors'
    blocks (every 8-bit tensor is a whole number of them), so the 8-bit moments' block scales
    and codes are each tensor's own, bit for bit; each block takes its tensor's counter for the
    bias corrections; without stochastic rounding the weights are bit-identical too, with it
    they get other draws (tests/test_bf16_weights.py). Non-finite verdicts skip it as
    :func:`_compiled_update` does: every value stays as it was, the counters included. A chunk of
    several tensors holds their concatenated weights, gradients and codes
    (:data:`CHUNK_TEMPORARY_BYTES` per element) beside the update's own temporaries while it runs
    (a gradient laid out unlike its weight is copied first, 2 B per element more, which the
    estimator leaves out).
    """
    skippable = _skippable_update()

    def chunk(w, grad, steps, codes1, scale1, codes2, scale2, qmap1, qmap2, signed1, signed2, found_inf, *rest):
        # w, grad, codes: (blocks, 256); scale: (blocks,); steps: (blocks,) fp32, each block's counter
        # (advanced by the caller, per tensor)
        skippable(w, grad, steps.unsqueeze(1), found_inf, (codes1, scale1, qmap1), (codes2, scale2, qmap2),
                  signed1, signed2, *rest)

    compiled = torch.compile(chunk, fullgraph=True)

    def update(params, grads, steps, exp_avg, exp_avg_sq, found_inf, *rest):
        def joined(ts, *shape):  # one tensor of ``shape``: a view of a lone one (written in place), else a concatenation
            return ts[0].view(shape) if len(ts) == 1 else torch.cat([t.reshape(-1) for t in ts]).view(shape)

        blocks = [p.numel() // BLOCK_SIZE for p in params]
        # the gradients are only read: reshaped, so that a lone one laid out unlike its weight is copied, not refused
        grad = grads[0].reshape(-1, BLOCK_SIZE) if len(grads) == 1 else joined(grads, -1, BLOCK_SIZE)
        parts = [joined(params, -1, BLOCK_SIZE), grad,
                 torch.cat([s.reshape(1).expand(n) for s, n in zip(steps, blocks)])]
        for m in (exp_avg, exp_avg_sq):
            parts += [joined([x.codes for x in m], -1, BLOCK_SIZE), joined([x.scale for x in m], -1)]
        for t in parts:  # one graph for chunks of any length (a new length would compile anew)
            torch._dynamo.mark_dynamic(t, 0)
        w, grad, counters, c1, s1, c2, s2 = parts
        compiled(w, grad, counters, c1, s1, c2, s2, exp_avg[0].qmap, exp_avg_sq[0].qmap, exp_avg[0].signed,
                 exp_avg_sq[0].signed, found_inf, *rest)
        if len(params) > 1:  # the chunk's results back into each tensor,
            # one multi-tensor copy per dtype (bf16 weights, uint8 codes, fp32 scales): a list of
            # mixed dtypes falls back to one copy per tensor on CUDA (ATen's ForeachUtils)
            for sources, targets in (((w,), (params,)),
                                     ((c1, c2), ([x.codes for x in exp_avg], [x.codes for x in exp_avg_sq])),
                                     ((s1, s2), ([x.scale for x in exp_avg], [x.scale for x in exp_avg_sq]))):
                torch._foreach_copy_([t for ts in targets for t in ts],
                                     [s.view_as(t) for src, ts in zip(sources, targets)
                                      for s, t in zip(src.split(blocks), ts)])
        torch._foreach_add_(list(steps), (found_inf == 0).to(steps[0].dtype))

    return update


@functools.cache
def _compiled_flat_update():
    """:func:`_compiled_update` over many small tensors (fewer than 4,096 elements, :func:`is_flat`:
    their moments are plain bf16, not 8-bit), laid end to end: one compiled call on one tensor.
    Called as ``update(params, grads, steps, exp_avg, exp_avg_sq, found_inf, lr, beta1, beta2,
    weight_decay, eps, is_adamw, stochastic_round)``: ``params`` the weights (detached),
    ``grads`` their gradients, ``steps`` the fp32 vector of their ``step`` counters (all equal:
    the set always steps together, :meth:`AdamW8bitBf16._packed`), ``exp_avg``/``exp_avg_sq``
    1-D: the moments of every weight end to end, in order.

    Why: the step is bound by the host, and a transformer layer's biases and LayerNorm weights
    are more than half its tensors (BERT-large: 9 of 16 per layer, 222 of 393 tensors in all),
    each costing its own kernel launches in a layer's call (~0.1 ms of host time per tensor).
    Here their weights and gradients are concatenated (one ``torch.cat`` each), updated in one
    compiled call and copied back (``torch._foreach_copy_``): a few launches for all of them.

    Adam is element-wise, so each element's moments and (without stochastic rounding) weight are
    bit-identical to its own call's (tests/test_bf16_weights.py, run on a CPU only; a GPU's kernels
    were not compared); with it, other draws (as for
    :func:`_compiled_chunk_update`). Non-finite verdicts skip it as :func:`_compiled_update` does:
    nothing changes, the counters included (the weights are written back unchanged). It holds the
    concatenated weights and gradients (:data:`FLAT_TEMPORARY_BYTES` per element) while it runs.
    """
    skippable = _skippable_update()

    def flat(w, grad, steps, m1, m2, found_inf, *rest):  # (the counters all equal: the first stands for all)
        steps.add_(skippable(w, grad, steps[0], found_inf, (m1,), (m2,), False, False, *rest).to(steps.dtype))

    compiled = torch.compile(flat, fullgraph=True)

    def update(params, grads, steps, exp_avg, exp_avg_sq, found_inf, *rest):
        w, grad = (torch.cat([t.reshape(-1) for t in ts]) for ts in (params, grads))
        # the lengths dynamic: one graph for sets of any length (a set that changes, e.g. a tensor
        # without a gradient in a step, would compile anew, seconds each); the hyperparameters
        # stay constants, as in the other calls
        for t in (w, grad, steps, exp_avg, exp_avg_sq):
            torch._dynamo.mark_dynamic(t, 0)
        compiled(w, grad, steps, exp_avg, exp_avg_sq, found_inf, *rest)
        torch._foreach_copy_(params, [t.view_as(p) for t, p in zip(w.split([p.numel() for p in params]), params)])

    return update


# False: adamw8bit-bf16 updates its small (not 8-bit) tensors one call each, as before the flat
# call (bench/update_chunks.py's per-tensor variant).
FLAT_SMALL_TENSORS = True
# Bytes per element the flat call holds while it runs: the weights and gradients concatenated (bf16).
FLAT_TEMPORARY_BYTES = 4


def is_flat(numel: int) -> bool:
    """Whether ``adamw8bit-bf16`` updates a tensor of ``numel`` elements in its flat call
    (:func:`_compiled_flat_update`): a small one, under 4,096 elements (its moments are not 8-bit).
    A large tensor whose moments are not 8-bit either (not a whole number of 256-element blocks,
    e.g. GPT-2's 50257 x 768 word embeddings) keeps a call of its own: concatenated, it would cost
    its size again in temporaries for a launch saved."""
    return FLAT_SMALL_TENSORS and numel < QUANTIZED_MIN_NUMEL


# A chunk of the 8-bit bf16 update (one compiled call, :func:`_compiled_chunk_update`) holds
# consecutive 8-bit tensors up to this many elements in all (:func:`update_chunks` lowers it so that
# a chunk holds no more temporaries than the largest tensor's lone update); 0: every tensor alone.
# 2**24: BERT-large's 171 8-bit tensors in 25 calls (a layer holds 12.6M elements), each holding at
# most 16.8M x (CHUNK_TEMPORARY_BYTES + BF16_UPDATE_TEMPORARY_BYTES) = 235 MB, under its word
# embeddings' lone update (31.3M x 8 B).
CHUNK_ELEMENTS = 1 << 24
# Bytes per element a chunk of several tensors holds in concatenations while its call runs:
# weights and gradients (bf16) and both moments' codes (uint8); the block scales and counters
# (8 + 4 B per 256 elements) left out.
CHUNK_TEMPORARY_BYTES = 2 + 2 + 1 + 1


def update_chunks(numels: list[int]) -> list[range]:
    """Consecutive index ranges covering ``numels`` (the element counts of consecutive 8-bit
    tensors of one param group and device, in update order), each updated by one compiled call
    (:func:`_compiled_chunk_update`): as many tensors as fit the chunk's limit, a larger one
    alone. The limit is :data:`CHUNK_ELEMENTS`, or fewer where the chunk's temporaries
    (:data:`BF16_UPDATE_TEMPORARY_BYTES` + :data:`CHUNK_TEMPORARY_BYTES` per element) would exceed
    the largest tensor's lone update (:data:`BF16_UPDATE_TEMPORARY_BYTES` per element): chunks
    save launches without raising the step's peak. BERT-large: its word embeddings alone, then
    24 chunks of its other 170; tensors all of one size: each alone."""
    limit = min(CHUNK_ELEMENTS, max(numels, default=0) * BF16_UPDATE_TEMPORARY_BYTES
                // (BF16_UPDATE_TEMPORARY_BYTES + CHUNK_TEMPORARY_BYTES))
    ranges, start, total = [], 0, 0
    for i, n in enumerate(numels):
        if i > start and total + n > limit:
            ranges.append(range(start, i))
            start, total = i, 0
        total += n
    return ranges + [range(start, len(numels))] * bool(numels)


def chunked_calls(numels: list[int], chunkable: list[bool], keys: list | None = None) -> list[list[int]]:
    """Indices ``0..n-1`` (tensors in update order) cut into the calls of ``adamw8bit-bf16``'s
    step: each run of consecutive ``chunkable`` tensors with one key (param group and device;
    None: one for all) in chunks (:func:`update_chunks` of their ``numels``), every other
    tensor alone."""
    calls, run = [], []
    for i in range(len(numels) + 1):
        ends = i == len(numels) or not chunkable[i] or (run and keys is not None and keys[i] != keys[run[-1]])
        if run and ends:
            calls += [[run[j] for j in r] for r in update_chunks([numels[k] for k in run])]
            run = []
        if i < len(numels) and chunkable[i]:
            run.append(i)
        elif i < len(numels):
            calls.append([i])
    return calls


def bf16_flat_call(shapes) -> list[int]:
    """Indices into ``shapes`` (the trained tensors of one param group and device, in the order of
    ``model.parameters()``) of the tensors ``adamw8bit-bf16``'s flat call updates
    (:func:`_compiled_flat_update`): every small one (:func:`is_flat`) where there are at least
    two, else none."""
    flat = [i for i, s in enumerate(shapes) if is_flat(math.prod(s))]
    return flat if len(flat) > 1 else []


def bf16_update_calls(shapes) -> list[list[int]]:
    """Indices into ``shapes`` (the trained tensors of one param group and device, in the order of
    ``model.parameters()``) of each compiled call of ``adamw8bit-bf16``'s step, in the step's order,
    for the estimator and the time model: the flat call (:func:`bf16_flat_call`) where there is
    one, then each run of consecutive 8-bit tensors (the flat call's left out) in chunks
    (:func:`update_chunks`) and every other tensor alone."""
    shapes = [tuple(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    flat = bf16_flat_call(shapes)
    rest = sorted(set(range(len(sizes))) - set(flat))
    numels = [sizes[i] for i in rest]
    return [flat] * bool(flat) + [[rest[j] for j in c]
                                  for c in chunked_calls(numels, [is_quantized_torchao(n) for n in numels])]


def bf16_step_temporary_bytes(shapes) -> int:
    """The most bytes ``adamw8bit-bf16``'s step holds above its state while it runs, over trained
    tensors of ``shapes`` (:func:`bf16_update_calls`; the calls run one after the other): the
    largest of the flat call's concatenated weights and gradients (:data:`FLAT_TEMPORARY_BYTES`
    per element) and each other call's dequantized moments (:data:`BF16_UPDATE_TEMPORARY_BYTES`
    per element of its 8-bit tensors), with a chunk of several tensors' concatenations
    (:data:`CHUNK_TEMPORARY_BYTES` per element)."""
    shapes = [tuple(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    flat = sum(sizes[i] for i in bf16_flat_call(shapes))
    largest = 0
    for c in bf16_update_calls(shapes):
        n = sum(sizes[i] for i in c if is_quantized_torchao(sizes[i]))
        largest = max(largest, n * (BF16_UPDATE_TEMPORARY_BYTES + CHUNK_TEMPORARY_BYTES * (len(c) > 1)))
    return max(FLAT_TEMPORARY_BYTES * flat, largest)


def _own_storage(state: dict) -> None:
    """Give each plain tensor of a parameter's ``state`` that is a slice of a larger storage (the
    flat call's packed tensors, or a loaded checkpoint's) a copy of its own, so that the larger one
    is freed once nothing else points into it: a tensor that leaves the flat call's set would
    otherwise keep the whole of its old packed counters and moments alive."""
    for k, t in state.items():
        if type(t) is torch.Tensor and t.untyped_storage().nbytes() > t.numel() * t.element_size():
            state[k] = t.clone()


@functools.cache
def _bf16_class():
    """The subclass of ``torchao.optim.AdamW8bit`` that tightfit's step needs (built on first use,
    so that torchao is imported lazily). Its ``step`` is torchao's (0.18, ``_AdamBase.step``:
    the same state, the same update function and order of updates; the same stochastic rounding
    draws for tensors updated one call each), with three changes:

    - it allocates the state of every parameter that has a gradient and no state yet, as
      torchao's own step would (a ``step`` counter at 0, then both moments by ``_new_buffer``),
      before it updates any (torchao allocates and updates one parameter after the other): an
      out-of-memory error while the first step's state is allocated leaves every weight and
      moment unwritten, and the runtime drops the new state and redoes the window (DESIGN
      invariant 10). An error during the updates themselves is seen by the runtime's
      partial-update check (the version counters of the weights, the plain moments and the step
      counters; an 8-bit moment's wrapper keeps its version, but its codes are never written
      before its weight): each compiled update bumps the versions of the inputs it writes before
      its kernels run, and a chunk's copy back and counter add bump theirs;
    - every update goes through one compiled function (:func:`_compiled_update`), not a new
      ``torch.compile`` wrapper per parameter and step, and takes the 8-bit moments' plain tensors;
      the 8-bit tensors go in chunks of consecutive tensors, one call each (:func:`update_chunks`,
      :func:`_compiled_chunk_update`: other stochastic-rounding draws), and the small tensors
      (:func:`is_flat`) one flat call, their state packed end to end (:func:`_compiled_flat_update`,
      :meth:`_packed`);
    - it skips a non-finite update on the device, as PyTorch's fused optimizers do
      (``skips_nonfinite_on_device``): :func:`tightfit.step.apply_update` sets ``found_inf``
      (a 0-d fp32 device tensor, 1.0 where the gradient norm is not finite) and every update
      leaves its tensors as they were where it is 1.0, the counters included, so the step ends
      without a host sync and the trainer can queue the next one before reading this one's
      values. To that end the ``step`` counters live on the weights' device (torchao keeps them
      on the CPU; a CPU counter of a torchao checkpoint is moved there at the next step)."""
    base = _torchao_optim(_BF16_NEEDS).AdamW8bit

    class AdamW8bitBf16(base):
        skips_nonfinite_on_device = True  # read by tightfit.step.skips_on_device

        @torch.no_grad()
        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if any(group["amsgrad"] for group in self.param_groups):
                raise TightfitError("optimizer adamw8bit-bf16 has no AMSGrad variant")
            stepped = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
            for group, p in stepped:
                if p.grad.is_sparse:
                    raise RuntimeError("Sparse gradient is not supported")
                state = self.state[p]
                if len(state) == 0:  # torchao's own initialisation, the counter on the weight's device
                    state["step"] = torch.zeros((), device=p.device)
                    state["exp_avg"] = self._new_buffer(p, True)
                    state["exp_avg_sq"] = self._new_buffer(p, False)
                elif state["step"].device != p.device:  # torchao's CPU counter (its checkpoints)
                    state["step"] = state["step"].to(p.device)
            if getattr(self, "grad_scale", None) is not None:
                raise RuntimeError("adamw8bit-bf16 takes no loss scale (bf16 autocast only)")
            found_inf = getattr(self, "found_inf", None)  # the device's verdict (tightfit.step), or none
            verdicts = {}  # the verdict on each parameter's device (0.0 where none was handed in)
            for group, p in stepped:
                if not isinstance(group["lr"], torch.Tensor):
                    raise RuntimeError("lr was changed to a non-Tensor object; set it with "
                                       "optim.param_groups[0]['lr'].fill_(new_lr)")
                if p.device not in verdicts:
                    verdicts[p.device] = (torch.zeros((), device=p.device) if found_inf is None
                                          else found_inf.to(p.device))
            flat, others = self._flat_sets(stepped)  # packed before any update: allocations only
            # one compiled entry per distinct group (or shape) and state kind (torchao lifts the limit too)
            with torch._dynamo.utils.disable_cache_limit():
                for group, members, (steps, m1, m2) in flat:
                    rest = (group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"],
                            self.is_adamw, self.bf16_stochastic_round)
                    _compiled_flat_update()([q.detach() for q in members], [q.grad for q in members], steps, m1, m2,
                                            verdicts[members[0].device], *rest)
                for members in self._chunks(others):
                    group, p = members[0]
                    rest = (group["lr"], group["betas"][0], group["betas"][1], group["weight_decay"], group["eps"],
                            self.is_adamw, self.bf16_stochastic_round and p.dtype is torch.bfloat16)
                    if len(members) > 1 or self._chunkable(p):
                        states = [self.state[q] for _, q in members]
                        # q.detach(): torchao's workaround for FSDP2 (the gradient is passed on its own)
                        _compiled_chunk_update()([q.detach() for _, q in members], [q.grad for _, q in members],
                                                 [s["step"] for s in states], [s["exp_avg"] for s in states],
                                                 [s["exp_avg_sq"] for s in states], verdicts[p.device], *rest)
                    else:
                        s = self.state[p]
                        _compiled_update()(p.detach(), p.grad, s["step"], s["exp_avg"], s["exp_avg_sq"],
                                           verdicts[p.device], *rest)
            return loss

        def _flat_sets(self, stepped: list) -> tuple[list, list]:
            """``stepped`` ((param group, parameter) pairs) split into the sets updated by one flat
            call each (:func:`_compiled_flat_update`: at least two plain bf16 tensors of one param
            group and device, :func:`is_flat`, whose counters agree),
            as ``(group, members, (steps, exp_avg, exp_avg_sq))`` with their state packed
            (:meth:`_packed`), and the other pairs, in order."""
            sets = {}
            for group, p in stepped:
                s = self.state[p]
                plain = all(type(s[k]) is torch.Tensor and s[k].dtype == p.dtype for k in ("exp_avg", "exp_avg_sq"))
                if is_flat(p.numel()) and type(p.detach()) is torch.Tensor and p.is_contiguous() and plain:
                    sets.setdefault((id(group), p.device), (group, []))[1].append(p)
            flat, cache, old = [], {}, self.__dict__.get("_flat_cache", {})
            for group, members in sets.values():
                for subset, packed in (self._packed(members, cache) if len(members) > 1 else ()):
                    flat.append((group, subset, packed))
            self.__dict__["_flat_cache"] = cache  # only the sets of this step: older buffers are let go
            now = {id(p) for _, members, _ in cache.values() for p in members}
            for _, members, _ in old.values():  # a tensor that left every set (frozen, no gradient now)
                for p in members:
                    if id(p) not in now and self.state.get(p):
                        _own_storage(self.state[p])
            ids = {id(p) for _, members, _ in flat for p in members}
            return flat, [(g, p) for g, p in stepped if id(p) not in ids]

        def _packed(self, members: list, cache: dict) -> list:
            """``members`` cut by their ``step`` counters into subsets of at least two whose counters
            agree (in order of first appearance), each as ``(subset, (steps, exp_avg, exp_avg_sq))``:
            the subset's state laid end to end, 1-D tensors whose slices are each member's counter
            (0-d) and moments (of its shape), as the optimizer's ``state`` holds them. A tensor that
            missed a step keeps its counter behind the others' for good: it goes in the subset of
            the tensors with its count, or, alone with it, in a call of its own (its state copied
            out of the old packed tensors, :func:`_own_storage`). Cut and packed on
            the members' first step together, or when a state was replaced (``load_state_dict``) or
            the set changed, by copying (and one host sync to read the counters); kept in ``cache``,
            so that the steps in between read no counter: the subsets step together (every member
            has a gradient, one verdict), and their counters' differences stay as they were cut."""
            key = tuple(id(p) for p in members)
            hit = self.__dict__.get("_flat_cache", {}).get(key)
            if hit is not None and all(self.state[p][k] is v for p, views in zip(members, hit[2])
                                       for k, v in zip(("step", "exp_avg", "exp_avg_sq"), views)):
                cache[key] = hit
                return hit[0]
            states = [self.state[p] for p in members]
            steps = torch.stack([s["step"].to(members[0].device, torch.float32) for s in states])
            alike = {}
            for i, c in enumerate(steps.tolist()):
                alike.setdefault(c, []).append(i)
            packed = []
            for indices in alike.values():
                if len(indices) < 2:
                    _own_storage(states[indices[0]])  # updated alone: the old packed tensors are let go
                    continue
                subset = [members[i] for i in indices]
                counters = steps if len(indices) == len(members) else steps[indices]
                m1, m2 = (torch.cat([states[i][k].reshape(-1) for i in indices]) for k in ("exp_avg", "exp_avg_sq"))
                start = 0
                for j, i in enumerate(indices):
                    s, n = states[i], members[i].numel()
                    s["step"], s["exp_avg"], s["exp_avg_sq"] = counters[j], m1[start:start + n].view(
                        members[i].shape), m2[start:start + n].view(members[i].shape)
                    start += n
                packed.append((subset, (counters, m1, m2)))
            # every member's state objects as left here (packed or not): a replaced one misses the cache
            cache[key] = (packed, members, [(s["step"], s["exp_avg"], s["exp_avg_sq"]) for s in states])
            return packed

        def _chunkable(self, p) -> bool:
            """Whether ``p`` goes through the chunked update (:func:`_compiled_chunk_update`): a
            plain, contiguous bf16 weight whose moments are both 8-bit, with contiguous codes. The
            others go alone through :func:`_compiled_update`: sharded (DTensor) weights,
            non-contiguous ones (channels-last convolutions, transposed parameters), weights of
            another dtype (torchao rounds only bf16 ones stochastically; a chunk's are all bf16)
            and large tensors whose moments are plain (not whole 256-element blocks)."""
            from torchao.optim.subclass_8bit import OptimState8bit

            s = self.state[p]
            return (type(p.detach()) is torch.Tensor and p.is_contiguous() and p.dtype is torch.bfloat16
                    and all(type(s[k]) is OptimState8bit and s[k].codes.is_contiguous() for k in ("exp_avg", "exp_avg_sq")))

        def _chunks(self, stepped: list) -> list[list]:
            """``stepped`` ((param group, parameter) pairs, in update order) cut into the calls of the
            step: consecutive chunkable tensors (:meth:`_chunkable`) of one param group and device in
            chunks (:func:`update_chunks`), every other tensor alone. The cut is kept (as indices) for
            the last list of (param group, parameter, dtype, kinds of state) seen: a tensor moved to
            another group, or its state loaded anew as another kind, cuts again."""
            # what decides the cut, cheap to read at every step (a weight's layout or device changed
            # through .data is not seen)
            key = tuple((id(g), id(p), p.dtype, type(self.state[p]["exp_avg"]), type(self.state[p]["exp_avg_sq"]))
                        for g, p in stepped)
            cached = self.__dict__.get("_chunk_cache")  # (key, calls as lists of indices into stepped)
            if cached is None or cached[0] != key:
                calls = chunked_calls([p.numel() for _, p in stepped], [self._chunkable(p) for _, p in stepped],
                                      [(id(g), p.device) for g, p in stepped])
                cached = self.__dict__["_chunk_cache"] = (key, calls)
            return [[stepped[i] for i in c] for c in cached[1]]

    return AdamW8bitBf16


def adamw_offload(params, lr: float, weight_decay: float, accumulating: bool = False) -> torch.optim.Optimizer:
    """A ``torchao.optim.CPUOffloadOptimizer`` with a fused CPU AdamW (:func:`_offload_class`),
    over CUDA ``params``; GPU gradients are freed once copied unless ``accumulating``.

    Raises:
        TightfitError: torchao is not installed, no CUDA device (torchao offloads from CUDA), or
            too little host memory (:func:`check_host_memory`).
    """
    if not torch.cuda.is_available():
        raise TightfitError("optimizer adamw-offload needs a CUDA GPU (its state is offloaded from the GPU)")
    params = list(params)
    check_host_memory([p.numel() for p in params])
    return _offload_class()(params, lr=lr, weight_decay=weight_decay, hold=accumulating)


@functools.cache
def _offload_class():
    """The subclass of torchao's ``CPUOffloadOptimizer`` that tightfit's step needs (built on
    first use, so that torchao is imported lazily):

    - ``wait_for_gradients()``: the host gradients are complete (the side stream's copies have
      finished) before they are unscaled, clipped and checked for inf/NaN
      (:func:`tightfit.step.apply_update`);
    - ``hold``: keep the GPU gradients (accumulation: the next micro-batch adds to them and the
      accumulated sum is copied again) or free each once copied; switchable per window
      (torchao fixes its ``offload_gradients`` at construction);
    - ``step``: one fused CPU AdamW step over the host copies of every parameter whose gradient
      copy was queued in this window (:class:`~tightfit.levers.host_adamw.HostAdamW`; the others
      are left alone, as torchao steps only its queue), then the new weights are copied to the
      GPU on torchao's side stream, which is synchronised before the step returns; the small
      parameters' fused AdamW on the GPU (torchao's ``d_opt``) is started first, as torchao does;
    - ``param_groups``: the on-device optimizer's groups (not torchao's ``d_param_groups``, which
      its ``load_state_dict`` leaves behind), then the host optimizer's (the host copies
      with their host gradients: the runtime unscales, clips and sets ``lr`` through them);
    - ``state``: the host optimizer's and the on-device optimizer's per-parameter states, as one
      mapping, so that the runtime's rollback (drop state created by a failed attempt) works as
      with a torch optimizer;
    - ``state_dict``: ``{"offloaded": <the host optimizer's state dict>, "on-device": ...}``;
      ``load_state_dict`` also takes torchao's (a list of per-parameter state dicts), and
      refreshes the host master weights from the (resumed) model, which torchao copies only at
      construction;
    - ``zero_grad`` forgets the copies queued by a skipped step;
    - a host gradient not copied in a window is zeroed in ``wait_for_gradients``: the runtime's
      norm and inf check read every host gradient, and one without a gradient in a window held
      an earlier window's, or torchao's uninitialised memory;
    - ``close()`` removes the gradient hooks it put on the model's parameters (torchao keeps no
      handle to them; without this a throw-away optimizer, e.g. a probe's, would go on copying
      every gradient to its host buffers): :func:`release`.
    """
    base = _torchao_optim().CPUOffloadOptimizer

    class OffloadedAdamW(base):
        def __init__(self, params, lr: float, weight_decay: float, hold: bool = False):
            from unittest import mock

            from .host_adamw import HostAdamW

            self.handles = []
            register = torch.Tensor.register_post_accumulate_grad_hook

            def kept(t, hook):  # torchao's own hooks, with handles to remove them
                self.handles.append(register(t, hook))
                return self.handles[-1]

            with mock.patch.object(torch.Tensor, "register_post_accumulate_grad_hook", kept):
                super().__init__(params, torch.optim.AdamW, offload_gradients=False, lr=lr,
                                 weight_decay=weight_decay)
            # torchao's per-parameter optimizers (no state yet) give way to one over all host copies
            self.optim_dict = {}
            self.host = HostAdamW(self.param_d2h_map.values(), lr, weight_decay) if self.param_d2h_map else None
            self.hold = hold
            # parameters whose host gradient may hold something other than this window's copy: at first
            # every one (torchao leaves them uninitialised, in pinned memory that may be reused), zeroed
            # in the first window that does not copy it (wait_for_gradients)
            self._copied = set(self.param_d2h_map)
            for p in self.param_d2h_map:  # after torchao's hook, which queues the copy
                self.handles.append(p.register_post_accumulate_grad_hook(self._free_gradient))

        def close(self) -> None:
            for h in self.handles:
                h.remove()
            self.handles = []

        def _free_gradient(self, p):
            if not self.hold and p.grad is not None:
                p.grad.record_stream(self.stream)  # the copy on the side stream still reads it
                p.grad = None

        def wait_for_gradients(self) -> None:
            for event in self.queue.values():
                event.synchronize()
            # a host gradient copied in an earlier window and not in this one is zeroed: it would count
            # again in this window's norm and inf check (the host step leaves its parameter alone)
            stale = [p for p in self._copied if p not in self.queue]
            if stale:
                self.stream.synchronize()  # no copy of an earlier, abandoned attempt still writes one
                for p in stale:
                    self.param_d2h_map[p].grad.zero_()
            self._copied = set(self.queue)

        @torch.no_grad()
        def step(self, closure=None):
            # torchao's step, with one fused host step over the queue instead of one per parameter
            loss = None if closure is None else closure()
            if self.d_opt is not None:  # the small parameters on the GPU, beside the host step
                self.d_opt.step()
            self.wait_for_gradients()
            if self.host is not None and self.queue:
                self.host.step([self.param_d2h_map[p] for p in self.queue])
            with torch.cuda.stream(self.stream):  # after the gradient copies, on the same stream
                for p_device in self.queue:
                    p_device.copy_(self.param_d2h_map[p_device], non_blocking=True)
            self.stream.synchronize()  # the new weights are on the GPU before the next forward
            self.queue.clear()
            return loss

        @property
        def param_groups(self):
            # the on-device optimizer's own groups: its load_state_dict replaces them with new dicts,
            # so torchao's d_param_groups would then miss the runtime's lr updates after a resume
            return ((self.d_opt.param_groups if self.d_opt is not None else [])
                    + (self.host.param_groups if self.host is not None else []))

        @property
        def state(self):
            return _States(([self.host.state] if self.host is not None else [])
                           + ([self.d_opt.state] if self.d_opt else []))

        def zero_grad(self, set_to_none: bool = True):
            super().zero_grad(set_to_none)
            self._copied.update(self.queue)  # copied in a window that did not step (skipped, out of memory)
            self.queue.clear()

        def state_dict(self):
            state_dict = {"offloaded": self.host.state_dict() if self.host is not None else []}
            if self.d_opt:
                state_dict["on-device"] = self.d_opt.state_dict()
            return state_dict

        def load_state_dict(self, state_dict):
            if self.host is not None:
                self.host.load_state_dict(state_dict["offloaded"])
            elif state_dict["offloaded"]:
                raise ValueError("loaded state dict has offloaded parameters not present in the optimizer")
            if self.d_opt:
                self.d_opt.load_state_dict(state_dict["on-device"])
            elif "on-device" in state_dict:
                raise ValueError("loaded state dict has a 'on-device' parameter group not present in the optimizer")
            with torch.no_grad():
                for p_device, p_host in self.param_d2h_map.items():
                    p_host.copy_(p_device.detach())

    return OffloadedAdamW


class _States(dict):
    """Read/delete view over several optimizers' ``state`` mappings (keys are distinct tensors)."""

    def __init__(self, states: list):
        super().__init__((k, v) for s in states for k, v in s.items())
        self._states = states

    def __delitem__(self, key):
        super().__delitem__(key)
        for s in self._states:
            s.pop(key, None)


def release(optimizer) -> None:
    """Detach an optimizer that is done with from the model (CPU offload: its gradient hooks);
    a no-op for the others."""
    if hasattr(optimizer, "close"):
        optimizer.close()


def hold_gradients(optimizer, micro_batches: int) -> None:
    """Tell an optimizer that offloads gradients how many micro-batches the next window has:
    with more than one, the GPU gradients must stay to be accumulated; with one, each is freed
    once copied to the host. A no-op for the other optimizers."""
    if hasattr(optimizer, "hold"):
        optimizer.hold = micro_batches > 1


def set_lr(group: dict, lr: float) -> None:
    """Set a parameter group's learning rate, in place where it is a tensor (torchao's optimizers
    keep it as a 0-d tensor and refuse a float; bitsandbytes' and torch's take a float)."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


# The share of the host's available memory that pinned memory (offloaded optimizer state and
# activations) may take: the rest is the process's own (its model copy, data, Python).
PINNED_HOST_SHARE = 0.9


def available_host_bytes() -> int:
    """Host memory available to a new allocation, bytes: ``MemAvailable`` of ``/proc/meminfo``
    (Linux), else free physical pages (``os.sysconf``)."""
    return _meminfo("MemAvailable:", "SC_AVPHYS_PAGES")


def total_host_bytes() -> int:
    """The host's physical memory, bytes: ``MemTotal`` of ``/proc/meminfo`` (Linux), else
    ``os.sysconf``'s physical pages."""
    return _meminfo("MemTotal:", "SC_PHYS_PAGES")


def _meminfo(field: str, pages: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")


def offload_host_bytes(numels) -> int:
    """Pinned host memory ``adamw-offload`` holds for parameters of ``numels`` elements (fp32):
    master weight, gradient and two moments, 16 B per element of each offloaded parameter."""
    return sum(16 * n for n in numels if is_offloaded(n))


def pinned_shortfall(need: float, available: float) -> str | None:
    """Why ``need`` bytes of pinned host memory do not fit in ``available`` bytes of host memory
    (at most :data:`PINNED_HOST_SHARE` of it may be pinned), in words; None where they fit."""
    from ..units import format_bytes, format_bytes_pair

    if need <= PINNED_HOST_SHARE * available:
        return None
    shown = format_bytes_pair(need, PINNED_HOST_SHARE * available)
    return (f"needs {shown[0]} of pinned host memory, {format_bytes(available)} available, of which at most "
            f"{PINNED_HOST_SHARE:.0%} may be pinned ({shown[1]})")


def check_host_memory(numels, available: int | None = None) -> None:
    """Refuse ``adamw-offload`` where the host cannot hold its state.

    Raises:
        TightfitError: the pinned state (:func:`offload_host_bytes`) exceeds ``available``
            (default :func:`available_host_bytes`) less 10% for the process itself.
    """
    short = pinned_shortfall(offload_host_bytes(numels), available_host_bytes() if available is None else available)
    if short:
        raise TightfitError(f"optimizer adamw-offload (fp32 weights, gradients and AdamW state on the host) {short}")
