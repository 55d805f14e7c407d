"""``torch.compile`` as a lever: fewer, fused kernels per micro-batch.

On a fast GPU a small or checkpointed micro-batch is bound by the CPU that launches its
kernels (tens of microseconds per eager op); TorchInductor fuses the element-wise ops
(bias, GELU, dropout, residual adds, LayerNorm) into a few Triton kernels, which cuts the
fixed cost per micro-batch and keeps fewer intermediates for backward (less activation memory).

Where a model's repeated blocks are identical (a transformer's layers), each block is compiled
in place rather than the whole model ("regional compilation"): the compiler traces one layer
and every other layer reuses that code, so compilation takes seconds instead of a minute, and
checkpointing a different set of blocks later needs no new compilation (checkpointing wraps the
compiled call). Other models (ResNet: blocks of four shapes) are compiled whole
(``nn.Module.compile``). See https://pytorch.org/tutorials/recipes/regional_compilation.html.
Either way modules are compiled in place, so ``state_dict`` keys do not change.

The batch dimension is marked dynamic (``torch._dynamo.maybe_mark_dynamic``) so that one
compiled graph serves every micro-batch size: the short last micro-batch of a window and the
halved micro-batch after an out-of-memory recovery do not recompile.
See https://pytorch.org/docs/stable/torch.compiler.html.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..plan import COMPILE_SCOPES
from .blocks import COMPILED_MARK, block_buffers, block_policy, find_blocks, run_block



def compile_unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` is not used on ``device_type`` (None: it can be).

    Only CUDA devices with Triton are considered: on the CPU TorchInductor needs a C++
    compiler and the step is compute-bound, so compiling gains little for its minutes.
    """
    if device_type != "cuda":
        return "compilation is used on CUDA GPUs only"
    try:
        from torch.utils._triton import has_triton
    except ImportError:  # pragma: no cover - very old torch
        return "this torch has no Triton support"
    if not has_triton():
        return "Triton is not installed"
    return None


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` was compiled in place by :func:`compile_model`."""
    return bool(model.__dict__.get(COMPILED_MARK))


MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself has forward or backward hooks (Python that runs around its call)."""
    return any(getattr(module, h) for h in MODULE_HOOKS)


def compile_scope(model: torch.nn.Module) -> str:
    """``"blocks"`` when every repeated block of ``model`` (:func:`~tightfit.levers.blocks.find_blocks`)
    has the same class and the same parameter and buffer shapes, and none has forward or backward
    hooks, so one compiled block serves all; otherwise ``"model"``."""
    blocks = find_blocks(model)

    def signature(block):
        return (type(block), [(n, tuple(t.shape)) for n, t in block.named_parameters()],
                [(n, tuple(t.shape)) for n, t in block.named_buffers()])

    hooked = any(map(has_hooks, blocks))  # a block compiled alone runs its class's forward, skipping its hooks
    if len(blocks) >= 2 and not hooked and all(signature(b) == signature(blocks[0]) for b in blocks[1:]):
        return "blocks"
    return "model"


# compile_model's scope that compiles the whole model as one graph whatever its blocks
WHOLE_MODEL = "model"
# compile_model's scope that compiles the whole model as one graph and replays it as CUDA graphs
# (``mode="reduce-overhead"``): a step of small micro-batches without recomputation that fits where
# larger ones need it, without the host's launches that make small micro-batches slow
# (BERT-base seq 128 at 4 GiB, 64 x 4: 3,514-3,646 samples/s against 2,241-2,849 compiled in the
# default mode; NVIDIA H100, bench/results/session-2026-12-07b)
GRAPHED = "model-graphs"
GRAPHED_MARK = "_tightfit_graphed"  # in a model's __dict__: compiled with GRAPHED


def compile_model(model: torch.nn.Module, scope: str | None = None) -> None:
    """Compile ``model`` in place with TorchInductor: each repeated block when they are identical
    (:func:`compile_scope`), else the whole forward; ``scope`` :data:`WHOLE_MODEL` compiles the
    whole forward in any case (a plan that checkpoints every block runs faster as one graph,
    checkpointing inside it: one compiled call per micro-batch where blocks compiled one by one
    make three per block, forward, recomputation and backward; BERT-large, 4 GiB plan, NVIDIA
    H200: 782 vs 620 samples/s, bench/results/step-breakdown-2); ``scope`` :data:`GRAPHED` compiles
    it whole and replays its forward and backward as CUDA graphs (:func:`_compile_graphed`).
    Otherwise the default mode: no CUDA graphs, whose private memory pool holds each recorded
    shape's intermediates between steps. Every compiled call marks the micro-batch
    dimension of its tensor arguments dynamic before entering the compiled code. Compilation
    itself happens at the first call. A second call does nothing.

    A compiled block runs its class's ``forward`` (one compiled function shared by all blocks;
    blocks with hooks are not compiled alone), and a block that
    :func:`~tightfit.levers.blocks.apply_checkpointing` checkpoints is checkpointed around the
    compiled call: checkpointing inside a graph that is one block (its output made in the
    checkpointed region) fails in the partitioner of torch 2.11. For the same reason Hugging
    Face's own checkpointing hook, which newer transformers apply inside the layer's ``forward``,
    is replaced by tightfit's block wrappers (:func:`~tightfit.levers.checkpointing.set_activation_checkpointing`
    does so for a model compiled block by block).
    """
    if scope not in COMPILE_SCOPES:
        raise ValueError(f"unknown compile scope {scope!r}")
    if is_compiled(model):
        return
    if scope == GRAPHED:
        _compile_graphed(model)
        return
    if scope != WHOLE_MODEL and compile_scope(model) == "blocks":
        modules = find_blocks(model)
        forward = torch.compile(type(modules[0]).forward)
        for block in modules:
            set_compiled_call(block, functools.partial(_call_block, forward, block))
        model.__dict__[COMPILED_MARK] = modules
        from .checkpointing import hf_hook_active, set_activation_checkpointing
        if hf_hook_active(model):  # its checkpoint would sit inside the compiled block: move it around
            set_activation_checkpointing(model, True, None)
        return
    model.compile()  # the public way: compiles the module's call, hooks included
    compiled = compiled_call(model)

    def call(*args, **kwargs):  # outside the compiled region, where marking takes effect
        _mark_batch_dynamic(_tensors(args, kwargs))
        return compiled(*args, **kwargs)

    set_compiled_call(model, call)
    model.__dict__[COMPILED_MARK] = [model]


def _compile_graphed(model: torch.nn.Module) -> None:
    """:func:`compile_model`'s :data:`GRAPHED` scope: the whole model compiled with
    ``mode="reduce-overhead"``, whose forward and backward TorchInductor records as CUDA graphs
    (cudagraph trees: one recording per batch shape, replayed after; a private memory pool for
    their intermediates and outputs).

    Two rules of cudagraph trees make accumulation safe here:

    - each micro-batch is a new run (``torch.compiler.cudagraph_mark_step_begin()`` before its
      forward): the previous micro-batch's backward has run, so its outputs are dead, and the
      replay may reuse their memory;
    - a replay overwrites the previous run's outputs, gradients included: a ``.grad`` that
      autograd took over from the backward graph's output (as it does when ``.grad`` is None)
      would be overwritten by the next micro-batch's backward. Before each forward, the
      parameters the graph trains get a ``.grad`` of their own where they have none
      (:class:`StableGrads`), so that autograd adds into it, outside the pool.
    """
    model.compile(mode="reduce-overhead")
    compiled, grads = compiled_call(model), StableGrads()

    def call(*args, **kwargs):
        _mark_batch_dynamic(_tensors(args, kwargs))
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(*args, **kwargs)
        if torch.is_grad_enabled():
            grads.ensure(out)
        return out

    set_compiled_call(model, call)
    model.__dict__[COMPILED_MARK] = [model]
    model.__dict__[GRAPHED_MARK] = True


class StableGrads:
    """Gradients that a replayed backward graph adds into rather than hands over: for every
    parameter the graph trains (an ``nn.Parameter`` its outputs' autograd graph reaches, found at
    the first call that trains any), a view of one flat buffer per dtype and device, with the
    parameter's strides (channels-last weights get channels-last gradients), zeroed and given as
    ``.grad`` where the parameter has none and requires grad (after
    ``zero_grad(set_to_none=True)``: at each step's first micro-batch). Parameters the graph does
    not reach, or frozen since, keep ``.grad`` None, as in an eager step; weights cast or moved
    since (another dtype or device) get new buffers. The buffers live as long as the compiled
    call or a ``.grad`` view of them: the gradients' bytes stay allocated between steps (eager
    steps free them; the planner's probes measure the step as it runs).
    """

    def __init__(self):
        self.params: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []
        self.flats: list[torch.Tensor] = []

    def ensure(self, outputs) -> None:
        """Give ``.grad`` to the trained parameters that have none, before the backward of
        ``outputs`` (the compiled call's return: tensors, in tuples, lists, dicts or a Hugging Face
        ``ModelOutput``) runs."""
        if not self.params:  # none trained at an earlier call: walked again
            self._allocate(_trained_leaves(outputs))
        missing = [i for i, p in enumerate(self.params) if p.grad is None and p.requires_grad]
        if not missing:  # the step's later micro-batches: one pass over the parameters, nothing else
            return
        if any((self.views[i].dtype, self.views[i].device) != (self.params[i].dtype, self.params[i].device)
               for i in missing):  # weights cast or moved since: new buffers
            self._allocate(_trained_leaves(outputs))
            missing = [i for i, p in enumerate(self.params) if p.grad is None and p.requires_grad]
        if len(missing) == len(self.params):  # a step's first micro-batch: one zeroing per buffer
            for flat in self.flats:
                flat.zero_()
        else:
            for i in missing:
                self.views[i].zero_()
        for i in missing:
            self.params[i].grad = self.views[i]

    def _allocate(self, params: list[torch.Tensor]) -> None:
        by_kind: dict = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        self.params, self.flats, views = [], [], {}
        for (dtype, device), group in by_kind.items():
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=device)
            self.flats.append(flat)
            start = 0
            for p in group:  # the parameter's own strides where they are dense (channels-last)
                views[p] = flat.as_strided(p.shape, p.stride(), start) if _dense(p) \
                    else flat[start:start + p.numel()].view(p.shape)
                start += p.numel()
            self.params += group
        self.views = [views[p] for p in self.params]


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides cover its elements exactly: contiguous, channels-last (4-D) or
    channels-last-3d (5-D)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or \
        (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _trained_leaves(outputs) -> list[torch.Tensor]:
    """The parameters (``nn.Parameter`` leaves; not inputs that require grad) reached from the
    autograd graph of the tensors in ``outputs``, in the order first met (a walk over
    ``grad_fn.next_functions``)."""
    from collections.abc import Mapping

    from torch.utils._pytree import tree_leaves

    roots = [t.grad_fn for t in tree_leaves(outputs) if torch.is_tensor(t) and t.grad_fn is not None]
    if not roots and isinstance(outputs, Mapping):  # a mapping pytree does not know
        roots = [t.grad_fn for t in outputs.values() if torch.is_tensor(t) and t.grad_fn is not None]
    seen, leaves, stack = set(), {}, list(roots)
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, torch.nn.Parameter):
            leaves.setdefault(id(variable), variable)
        stack.extend(f for f, _ in fn.next_functions)
    return list(leaves.values())


def set_compiled_call(module: torch.nn.Module, call) -> None:
    """Make ``module(...)`` run ``call(*args, **kwargs)`` in place of its eager call (None: eager
    again). This is the slot ``nn.Module.compile()`` fills (``_compiled_call_impl``, read by
    ``nn.Module.__call__`` in every torch since 2.2); the public method cannot give one compiled
    function to many blocks or wrap checkpointing or dynamic-shape marking around it, so the
    private attribute is written here and read in :func:`compiled_call`, nowhere else
    (tests/test_units_plan_devices.py checks that the installed torch still honours it)."""
    module._compiled_call_impl = call


def compiled_call(module: torch.nn.Module):
    """What ``module(...)`` runs in place of its eager call (None: the eager call)."""
    return getattr(module, "_compiled_call_impl", None)


def _tensors(args: tuple, kwargs: dict) -> list:
    """The tensors among a call's arguments, and inside tuples/lists among them (one level)."""
    out = []
    for v in (*args, *kwargs.values()):
        out.extend(v if isinstance(v, (tuple, list)) else (v,))
    return [v for v in out if torch.is_tensor(v)]


def _call_block(forward, block, *args, **kwargs):
    _mark_batch_dynamic(_tensors(args, kwargs))
    policy = block_policy(block)
    if policy != "none":
        return run_block(forward, policy, None, None, block_buffers(block), block, *args, **kwargs)
    return forward(block, *args, **kwargs)


def uncompile_model(model: torch.nn.Module) -> None:
    """Undo :func:`compile_model`: the eager forward runs again. For :data:`GRAPHED` the recorded
    CUDA graphs and their memory pool are freed with all compiled code (``torch._dynamo.reset()``:
    compiled functions keep the graphs' manager, so freeing the graphs alone would break them),
    and the pool's memory is handed back to the driver (the planner's eager retiming after it ran
    out of memory within the budget otherwise; the fix is not yet measured on a GPU); compiling
    again traces again, from TorchInductor's on-disk caches."""
    for module in model.__dict__.pop(COMPILED_MARK, None) or ():
        set_compiled_call(module, None)
    if model.__dict__.pop(GRAPHED_MARK, False):
        from ..memory.oom import release_memory

        torch._dynamo.reset()
        release_memory()


def is_graphed(model: torch.nn.Module) -> bool:
    """Whether ``model`` was compiled by :func:`compile_model` with scope :data:`GRAPHED`."""
    return bool(model.__dict__.get(GRAPHED_MARK))


@contextlib.contextmanager
def eager_calls(model: torch.nn.Module):
    """While active, the modules :func:`compile_model` compiled run eagerly; their compiled calls
    come back after. For evaluation: the graphs compiled for training are guarded on grad mode, so
    forward under ``torch.no_grad()`` would compile the model again during the run, and again at
    each new evaluation length, for seconds of inference (BERT-base at 4 GiB compiled whole,
    NVIDIA H200: the evaluation of 256 samples took 5.1 s, its compilation included).
    ``model``: the model :func:`compile_model` was given (not a DDP or FSDP wrapper of it)."""
    saved = [(m, compiled_call(m)) for m in model.__dict__.get(COMPILED_MARK) or ()]
    for m, _ in saved:
        set_compiled_call(m, None)
    try:
        yield
    finally:
        for m, call in saved:
            set_compiled_call(m, call)


_dynamic_length: int | None = None  # set by :func:`length_dynamic` while a warm-up compiles


@contextlib.contextmanager
def length_dynamic(length: int):
    """While active, compiled calls also mark dynamic every other dimension of their tensor
    arguments whose size is ``length`` (tokens): the sequence dimensions of hidden states and of
    attention masks ``[B, 1, T, T]``. TorchDynamo's automatic dynamic shapes makes a dimension
    dynamic only when one input name was seen with two sizes, so a kind of call first compiled at
    the warm-up's length (a block given a mask where the first probe gave none) would be
    specialised to that length and recompile at the next one. ``maybe_mark_dynamic`` lets the
    compiler keep a dimension static where the code needs it (a head dimension of equal size)."""
    global _dynamic_length
    previous, _dynamic_length = _dynamic_length, length
    try:
        yield
    finally:
        _dynamic_length = previous


def _mark_batch_dynamic(values) -> None:
    """Mark dimension 0 (the micro-batch) of every tensor in ``values`` dynamic for the compiler,
    so micro-batches of other sizes reuse the compiled graph (and, under :func:`length_dynamic`,
    the dimensions of that length)."""
    for v in values:
        if torch.is_tensor(v) and v.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(v, 0)
            for d in range(1, v.dim()):
                if _dynamic_length is not None and v.shape[d] == _dynamic_length:
                    torch._dynamo.maybe_mark_dynamic(v, d)
