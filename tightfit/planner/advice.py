"""When no plan fits the budget: what does fit, and which levers would make the request fit.

What fits is found by re-estimating (:mod:`tightfit.memory`, no GPU): the largest effective
batch that fits with no gradient accumulation (its gradients are then not held across
micro-batches), and the largest sequence length or image size that fits the effective batch
asked for. Both use the smallest step there is -- micro-batch 1, or the whole effective batch in
one micro-batch when not accumulating -- with the checkpointing the search may choose (every block
first, then none, whichever fits: a checkpointed step carries the margin for the
estimator's error on checkpointed steps, :mod:`.margins`).

Each lever below is given with the bytes it would save at the peak of the smallest step tried;
the first three are tightfit's optimizer levers (``--optimizer``, :mod:`tightfit.levers.optimizers`),
the last is not available in tightfit yet. Whether an optimizer lever would fit is not read off
its savings: it is the planner's own answer (:func:`lever_peaks`) -- the exact estimate the
search makes of that lever's smallest step (micro-batch 1 with the checkpointing the search may
choose, in the precisions it may choose) against the planned limit, the budget less the
planner's headroom (:func:`.margins.planned_limit`); a lever whose model state alone is over
that limit is not traced. Only the levers the device can run are offered: the others are named
in one line with the reason. The savings follow from the bytes per parameter of fp32
weights, fp32 gradients and AdamW's two fp32 moments (4 + 4 + 8 = 16 B per trainable parameter;
autocast keeps the weights, and so the gradients, in fp32):

- 8-bit AdamW state (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"): the
  two moments take 1 B each instead of 4 B, 6 B per trainable parameter less (less the block
  scales, 2 x 4 B per 256 parameters).
- AdamW state in CPU memory (Ren et al. 2021, "ZeRO-Offload"): its 8 B per trainable parameter
  leave the GPU; every optimizer step then sends the fp32 gradients to the host and the updated
  fp32 weights back, 8 B per trainable parameter over the host link.
- bf16 weights and gradients with no fp32 master copy (``--optimizer adamw8bit-bf16``, with 8-bit
  AdamW state): 2 B each instead of 4 B (updates smaller than bf16's resolution would be lost:
  torchao rounds them stochastically).
- Freezing the input layers (``--trainable frozen-embeddings``, :mod:`tightfit.levers.freezing`):
  no gradient and no optimizer state for them: the state the plan's optimizer keeps on the GPU
  (fp32 AdamW 8 B per parameter, 8-bit state 2 B, offloaded state none), and the gradient (4 B,
  2 B in bf16) where the gradients are held at the peak.
"""

from __future__ import annotations

from ..units import format_bytes, format_bytes_pair, format_seconds
from .bisection import bisect
from .margins import planned_limit

# Bytes per trainable parameter of fp32 training with AdamW: weight, gradient, two moments.
WEIGHT_B, GRADIENT_B, ADAMW_STATE_B = 4, 4, 8
ADAMW_8BIT_STATE_B = 2  # two 1-byte moments (block-wise quantized; the per-block scales are not counted)
# Optimizer state on the GPU per trainable parameter, bytes, and how to say it.
STATE_ON_GPU = {"adamw8bit": (ADAMW_8BIT_STATE_B, "8-bit AdamW moments"),
                "adamw-offload": (0, "AdamW moments in CPU memory"),
                "adamw8bit-bf16": (ADAMW_8BIT_STATE_B, "8-bit AdamW moments")}


def _state_on_gpu(optimizer: str) -> tuple[int, str]:
    """``(bytes per trainable parameter, words)`` of ``optimizer``'s state on the GPU."""
    return STATE_ON_GPU.get(optimizer, (ADAMW_STATE_B, "AdamW moments"))

_TRACE_ERRORS = (ValueError, RuntimeError)


def _peak(estimate_fn, precision: str, micro_batch: int, block_options, limit: float) -> int | None:
    """Peak reserved bytes of one step's exact estimate with the first of ``block_options`` (sets
    of checkpointed blocks) that fits ``limit``, else the least of them; None where it cannot be
    traced (e.g. a size the model refuses)."""
    from ..errors import TightfitError

    if estimate_fn is None:
        return None
    peaks = []
    for blocks in block_options:
        try:
            peaks.append(estimate_fn(precision, micro_batch, tuple(blocks)).peak_reserved_bytes)
        except (TightfitError,) + _TRACE_ERRORS:
            continue
        if peaks[-1] <= limit:
            break
    return min(peaks, default=None)


def smallest_step_peak(estimate_fn, precisions, block_options, limit: float, micro_batches=(1,)) -> int | None:
    """Peak reserved bytes of the smallest step the search plans: one of ``micro_batches`` (1,
    and for a lever whose step holds less without accumulation, the effective batch) in one of
    ``precisions`` with one of ``block_options`` (:func:`_peak`) -- the first that fits ``limit``
    (bytes), else the least; None where none could be traced."""
    least = None
    for precision in precisions:
        for micro_batch in dict.fromkeys(micro_batches):
            got = _peak(estimate_fn, precision, micro_batch, block_options, limit)
            if got is not None and got <= limit:
                return got
            least = got if least is None or (got is not None and got < least) else least
    return least


def lever_peaks(model, estimator, precisions, block_options, limit: float, effective_batch: int | None = None):
    """``kind -> (bytes, words, estimated)``: what decides whether optimizer lever ``kind`` fits
    ``limit`` (the planned limit, bytes) when the planner plans it.

    Its model state alone (:func:`.optimizers.least_state_bytes`) when that is over ``limit``
    (no trace: no step of it can fit); else the exact peak of its smallest step
    (:func:`smallest_step_peak` with ``estimator(kind)``, the estimate the search makes: bf16
    alone for the levers that keep bf16 weights, as the search of them), ``estimated`` True; else
    (no ``estimator``, or nothing could be traced) the model state, ``estimated`` False.

    Args:
        estimator: ``kind -> estimate_fn`` (as :func:`.optimizers.search_optimizers` takes it), or None.
        precisions, block_options: what the search of the lever may choose.
        effective_batch: samples per step; its smallest step is also tried without accumulation
            (``adamw-offload`` frees each gradient on the GPU once copied only then: at 1 GiB
            BERT-base's offloaded step fits at 64 x 1 and not at micro-batch 1 of 64).
    """
    from ..levers.optimizers import weights_dtype
    from .optimizers import least_state_bytes

    def peak(kind: str):
        state = least_state_bytes(model, kind)[0]
        if state > limit or estimator is None:
            return state, "its model state alone", False
        got = smallest_step_peak(estimator(kind), ["bf16"] if weights_dtype(kind) is not None else precisions,
                                 block_options, limit, (1, effective_batch or 1))
        return (state, "its model state alone", False) if got is None else (got, "its smallest step", True)

    return peak


def left_out_levers(cuda: bool, profile=None) -> tuple[set[str], str | None]:
    """The optimizer levers the device cannot run, and one line saying which and why (None if
    none): on the CPU (not ``cuda``) those that need a CUDA GPU; on a card without bf16
    (``profile``), bf16 weights (:func:`tightfit.levers.optimizers.check_precision`, the one place
    of that rule)."""
    from ..errors import TightfitError
    from ..levers.optimizers import BF16_WEIGHTS, check_precision

    if not cuda:
        return {"adamw-offload", *BF16_WEIGHTS}, ("--optimizer adamw-offload and adamw8bit-bf16 need a CUDA GPU "
                                                  "(this run is on the CPU)")
    for kind in BF16_WEIGHTS:
        try:
            check_precision(kind, "auto", profile)
        except TightfitError as e:
            return set(BF16_WEIGHTS), f"--optimizer {kind} is not offered: {e}"
    return set(), None


def _largest(candidates: list[int], peak, limit: float) -> tuple[int | None, int | None]:
    """The largest of the sorted ``candidates`` whose ``peak(c)`` (bytes, growing with ``c``; None
    where it cannot be estimated, counted as not fitting) is at most ``limit``, by bisection
    (:func:`.bisection.bisect`) after checking the smallest; and the smallest's peak (None where
    it could not be estimated). ``(None, peak)`` if none fits."""
    first = peak(candidates[0]) if candidates else None
    if first is None or first > limit:
        return None, first

    def fits(i: int) -> bool:
        p = peak(candidates[i])
        return p is not None and p <= limit

    return candidates[bisect(0, len(candidates), fits)], first


def largest_effective_batch_without_accumulation(estimator_at, size: int, effective_batch: int, precisions,
                                                 block_options, limit: float) -> tuple[int | None, int | None]:
    """The largest effective batch below ``effective_batch`` that fits ``limit`` (bytes) in one
    micro-batch in one of ``precisions`` with one of ``block_options`` checkpointed (None if even
    1 does not fit), and the least peak reserved bytes of effective batch 1 (None if it could not
    be estimated).

    Args:
        estimator_at: ``(size, effective_batch) -> estimate_fn`` (see
            :func:`tightfit.planner.search.estimator_for`); may return None for a size it cannot
            estimate.
        precisions: those the search plans in (a smaller step may fit in another precision than
            the smallest one tried: fp32 keeps no half-precision copy of the weights).
    """
    return _largest(list(range(1, effective_batch)),
                    lambda m: smallest_step_peak(estimator_at(size, m), precisions, block_options, limit, (m,)),
                    limit)


def largest_size(estimator_at, size: int, effective_batch: int, precisions, block_options,
                 limit: float, smallest: int = 1) -> tuple[int | None, int | None, int]:
    """The largest sequence length / image size from ``smallest`` to below ``size`` at which
    micro-batch 1 (with ``effective_batch`` accumulation steps, in one of ``precisions``, with one
    of ``block_options`` checkpointed) fits ``limit`` (bytes);
    multiples of 8 from 16 up (tensor-core friendly), every size below that. None if none fits.
    Second: the least peak reserved bytes at the smallest size that could be estimated (None if
    none could), third: that size. Sizes too small to trace (ResNet-50's BatchNorm at 1 px: one
    value per channel) are passed over, found by bisection (a model traces at every size above
    its smallest): the search gave up at 1 px and said no smaller size fits where 2048 did."""
    sizes = [s for s in range(smallest, size) if s < 16 or s % 8 == 0]
    memo: dict[int, int | None] = {}

    def peak(s: int) -> int | None:
        if s not in memo:
            memo[s] = smallest_step_peak(estimator_at(s, effective_batch), precisions, block_options, limit)
        return memo[s]

    start = 0
    if len(sizes) > 1 and peak(sizes[0]) is None:
        if peak(sizes[-1]) is None:
            return None, None, sizes[-1]
        start = bisect(len(sizes) - 1, 0, lambda i: peak(sizes[i]) is not None)  # the smallest that traces
    best, first = _largest(sizes[start:], peak, limit)
    return best, first, sizes[start] if sizes else smallest


def _resizable(estimator_at, size: int, effective_batch: int) -> bool:
    """Whether ``estimator_at`` can estimate a size below ``size``."""
    from ..errors import TightfitError

    try:
        return size > 1 and estimator_at(size - 1, effective_batch) is not None
    except (TightfitError,) + _TRACE_ERRORS:
        return False


def _input_embedding_params(model) -> int:
    """Trainable parameters of the model's input layers, those ``--trainable frozen-embeddings``
    freezes (:func:`tightfit.levers.freezing.input_parameters`); 0 if none."""
    from ..levers.freezing import input_parameters

    return sum(p.numel() for _, p in input_parameters(model) if p.requires_grad)


def _lora_parameters(model) -> tuple[int, int] | None:
    """The parameters LoRA (:func:`tightfit.levers.lora.apply_lora`) would leave to train: its
    adapters' (new weights; rank r: ``r x (in + out)`` per adapted layer) and the classification
    head's; None where LoRA does not apply (no repeated blocks with linear layers) or is applied
    already."""
    from ..errors import TightfitError
    from ..levers.lora import RANK, has_adapters, head_names, lora_targets

    if has_adapters(model):
        return None
    try:
        names = lora_targets(model)
    except TightfitError:
        return None
    layers = dict(model.named_modules())
    adapters = 0
    for n in names:
        w = layers[n].weight  # Linear [out, in]; transformers' Conv1D [in, out]
        adapters += RANK * (w.shape[0] + w.shape[1])
    head = sum(p.numel() for n in head_names(model) for p in getattr(model, n).parameters())
    return adapters, head


def offload_line(model, limit: float, host_link_bytes_per_s: float, profile=None, cuda: bool = True,
                 optimizer: str = "auto", precision: str = "auto") -> str | None:
    """The nothing-fits line for parameter offload (``--sharding fsdp-offload``), which ``tightfit
    train`` takes by itself when no single-GPU plan holds the training state: what stays on the
    GPU (:func:`.sharding.offload_gpu_bytes`) against ``limit`` (bytes), what the host holds
    (:func:`.sharding.host_state_bytes`) and what each micro-batch moves over the host link (the
    fp32 shards copied in for the forward and again for the backward, 8 B per parameter, and the
    fp32 gradients of the trained ones out, 4 B each), in the precision it would run (``precision`` asked: bf16 where the card
    has it, else fp32; under fp16, which it does not run, the line says what to ask for instead).
    None on the CPU or for a model without repeated blocks."""
    from ..levers.blocks import find_blocks
    from .sharding import host_state_bytes, offload_gpu_bytes

    if not cuda or not find_blocks(model):
        return None
    params = sum(p.numel() for p in model.parameters())
    bf16 = precision == "bf16" or (precision in ("auto", "fp16") and (profile is None or profile.bf16))
    gpu = offload_gpu_bytes(model, "bf16" if bf16 else "fp32")
    moved = 8 * params + 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)  # frozen: no gradient
    fits = ("its GPU share is under the planned limit (whether a step with its activations fits too is "
            "planned when nothing else fits)" if gpu < limit else f"still {format_bytes(gpu - limit)} over")
    if gpu < limit and (optimizer != "auto" or precision == "fp16"):  # chosen for you only with both auto
        needs = [f"--optimizer adamw (not {optimizer}: it keeps fp32 AdamW state)"] if optimizer not in (
            "auto", "adamw") else []
        needs += [f"--precision {'bf16' if bf16 else 'fp32'} (fp16's loss scaler does not reach gradients in host "
                  "memory)"] if precision == "fp16" else []
        fits = "its GPU share is under the planned limit: ask for it with --sharding fsdp-offload" + (
            " and " + " and ".join(needs) if needs else "")
    return (f"parameter offload (--sharding fsdp-offload: FSDP2 keeps the weights, gradients and AdamW state in host "
            f"memory, {format_bytes(host_state_bytes(model))}, and gathers one block at a time on the GPU, "
            f"{format_bytes(gpu)} held there; each micro-batch moves {format_bytes(moved)} over the host link, about "
            f"{format_seconds(moved / host_link_bytes_per_s)}, and each step runs AdamW on the CPU): {fits}")


def lora_line(model, limit: float) -> str | None:
    """The nothing-fits line for LoRA, which the planner never chooses by itself (it changes what is
    trained): its model state with fp32 AdamW (4 B per weight, 12 B more per parameter left to
    train: :func:`_lora_parameters`) against ``limit`` (bytes); None where LoRA does not apply or
    is in use."""
    found = _lora_parameters(model)
    if found is None:
        return None
    adapters, head = found
    left = adapters + head
    need = 4 * (sum(p.numel() for p in model.parameters()) + adapters) + 12 * left  # the adapters are new weights
    verdict = "under" if need <= limit else "over"
    shown = format_bytes_pair(need, limit)
    return (f"not searched: LoRA (--trainable lora: peft adapters of rank 8, the other weights frozen; it changes what "
            f"is trained, {left:,} parameters left to train): its model state with fp32 AdamW, {shown[0]}, "
            f"is {verdict} the {shown[1]} a step may hold" + ("; plan it with --trainable lora"
                                                             if verdict == "under" else ""))


def lever_lines(model, peak_bytes: int, limit: float, gradients_at_peak: int, host_link_bytes_per_s: float,
                optimizer: str = "adamw", accumulating: bool | None = None, cuda: bool = True, profile=None,
                lever_peak=None, activations: bool = True) -> list[str]:
    """One line per lever (the optimizer levers with their ``--optimizer`` value, freezing with
    its ``--trainable`` value): the bytes it would save at a step whose peak is
    ``peak_bytes`` with ``gradients_at_peak`` bytes of gradients held there, and whether that
    alone brings the step under ``limit`` (all in bytes; the savings are per parameter, so they
    leave out the caching allocator's rounding, a few MiB at most). The embeddings' gradients
    count as held only when all gradients are (accumulation). An optimizer lever already in use
    (``optimizer``) is not offered again, and offload saves what ``optimizer`` keeps on the GPU, and
    without accumulation (``accumulating``; None: when all gradients are held at the peak) the
    gradients too, since it frees each once copied to the host. The levers the device cannot run
    (:func:`left_out_levers`: on the CPU, without ``cuda``, offload and bf16 weights; bf16 weights
    on a ``profile`` without bf16) are named in one closing line instead.

    Whether an optimizer lever fits is ``lever_peak(kind)``'s answer (:func:`lever_peaks`: the
    planner's estimate of its smallest step against ``limit``, the planned limit); without it,
    and for freezing, the savings are taken off ``peak_bytes`` (a step's
    peak; without ``activations``, the model state alone: then no lever is said to fit, only its
    model state)."""
    from .optimizers import weight_bytes

    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gradient_b = weight_bytes(optimizer)  # a gradient has its weight's dtype: 2 B under adamw8bit-bf16
    held = gradients_at_peak >= gradient_b * trainable  # all of them, as when accumulating
    emb = _input_embedding_params(model)

    def verdict(kind: str | None, saving: float) -> tuple[float, bool, str]:
        """(bytes saved as shown, whether the lever's step was traced, what is left): where the
        lever's own peak or state was measured, the saving shown is the difference it makes, so
        that over = saved + still over, line by line (the nominal bytes per parameter leave out
        e.g. the 8-bit state's scales)."""
        got = lever_peak(kind) if lever_peak is not None and kind is not None else None
        need, words, estimated = got if got is not None else (peak_bytes - saving, "", activations)
        if 0 < peak_bytes - need:
            saving = peak_bytes - need
        if need > limit:
            return saving, estimated and bool(words), f"still {format_bytes(need - limit)} over" + (
                f" ({words} needs {format_bytes(need)})" if words else "")
        if estimated:
            return saving, bool(words), "would fit" + (f" ({words} needs {format_bytes(need)} of the planned limit "
                                                       f"{format_bytes(limit)})" if words else "")
        return saving, False, (f"{words or 'its model state'}, {format_bytes(need)}, is under the planned limit "
                               f"{format_bytes(limit)}; its activations were not estimated")

    state_b, state_words = _state_on_gpu(optimizer)
    freed = 0 if (held if accumulating is None else accumulating) else gradients_at_peak  # offload frees them
    levers = [  # (--optimizer, what it is, bytes saved), in the order each makes the ones before it moot
        ("adamw8bit", f"8-bit AdamW state (--optimizer adamw8bit: two 1-byte moments instead of two fp32 ones, "
         f"about {ADAMW_STATE_B - ADAMW_8BIT_STATE_B} B x {trainable:,} trainable parameters)",
         int((ADAMW_STATE_B - ADAMW_8BIT_STATE_B - 8 / 256) * trainable)),
        ("adamw-offload", f"AdamW state in CPU memory (--optimizer adamw-offload: {state_b} B x {trainable:,} off "
         f"the GPU, {format_bytes(16 * trainable)} of pinned host memory; each optimizer step "
         f"then moves {format_bytes((WEIGHT_B + GRADIENT_B) * trainable)} over the host link, about "
         f"{format_seconds((WEIGHT_B + GRADIENT_B) * trainable / host_link_bytes_per_s)}, plus the CPU's AdamW step"
         + (", and without accumulation each gradient is freed on the GPU once copied" if freed else "") + ")",
         state_b * trainable + freed),
        ("adamw8bit-bf16", f"bf16 weights and gradients with no fp32 master copy (--optimizer adamw8bit-bf16, "
         f"8-bit AdamW state and stochastically rounded updates, bf16 autocast only; it changes the numerics; "
         f"2 B less per weight"
         + (", and half the gradients held" if held else "")
         + (f", {state_b - ADAMW_8BIT_STATE_B} B less state per trainable parameter" if state_b > ADAMW_8BIT_STATE_B
            else f", {ADAMW_8BIT_STATE_B - state_b} B more state per trainable parameter on the GPU"
            if state_b < ADAMW_8BIT_STATE_B else "") + ")",
         (WEIGHT_B // 2) * params + gradients_at_peak // 2 + (state_b - ADAMW_8BIT_STATE_B) * trainable),
    ]
    per = state_b + (gradient_b if held else 0)  # what a frozen parameter no longer holds under this optimizer
    if emb and per:
        levers.append((None, f"freezing the input layers (--trainable frozen-embeddings: it changes what is trained; "
                       f"{emb:,} parameters: no gradient" + (f" and no {state_words}" if state_b else "")
                       + f", {per} B each)", per * emb))
    kinds = [kind for kind, _, _ in levers]
    # the lever in use, and those before it, save nothing more
    after = levers[kinds.index(optimizer) + 1:] if optimizer in kinds else levers
    left_out, why = left_out_levers(cuda, profile)
    def saves(shown: float, nominal: float, traced: bool) -> str:  # where the step differs from the bytes per parameter
        if abs(shown - nominal) < 1 << 20:
            return f"saves {format_bytes(shown)}"
        if not traced:  # its model state alone was compared (over the limit: no step of it was traced)
            return f"saves {format_bytes(shown)} of model state" + (
                f" (nominally {format_bytes(nominal)})" if format_bytes(shown) != format_bytes(nominal) else "")
        return (f"saves {format_bytes(shown)} in its traced step (nominally {format_bytes(nominal)}; the rest goes to "
                f"what the lever's own step holds)" if shown < nominal else
                f"saves {format_bytes(shown)} in its traced step (nominally {format_bytes(nominal)})")

    lines = [f"{name}: {saves(shown, saving, traced)}, {left}" for kind, name, saving in after if kind not in left_out
             for shown, traced, left in [verdict(kind, saving)]]
    if why and any(kind in left_out for kind, _, _ in after):
        lines.append(why)
    return lines


def check_model_state(model, budget: int, optimizer: str, levers: bool, host_link_bytes_per_s: float,
                      cuda: bool = True, profile=None, estimator=None, precision: str = "auto",
                      checkpointing: str = "auto", effective_batch: int | None = None) -> None:
    """Refuse, before any trace, a budget (bytes) whose planned limit (:func:`.margins.planned_limit`,
    what the search compares every peak with) is below the least model state of the optimizers
    that may be chosen (:func:`.optimizers.least_state_bytes`; fp32 AdamW: weights, gradients and
    state, 16 B per parameter), naming the levers and what each saves (:func:`lever_lines`).
    ``tightfit plan`` and ``tightfit train`` both check with it. Only when refusing, and only with
    ``estimator``, is each optimizer lever's smallest step traced, to say whether it would fit
    (:func:`lever_peaks`).

    Args:
        optimizer: ``--optimizer``; levers: whether ``auto`` may choose the optimizer levers.
        host_link_bytes_per_s: the card's host link, for offload's transfer time.
        cuda: whether the run is on a CUDA GPU (else the CUDA-only levers are not offered).
        profile: the card (precisions, and the levers it can run), or None.
        estimator: ``kind -> estimate_fn`` as the search uses it
            (:func:`.optimizers.search_optimizers`), or None: the levers' steps are not estimated.
        precision, checkpointing: ``--precision`` and ``--checkpointing``, what the search of a
            lever may choose; effective_batch: samples per step (see :func:`lever_peaks`).

    Raises:
        TightfitError: the planned limit is below the model state.
    """
    from ..errors import TightfitError
    from .margins import HEADROOM
    from .optimizers import least_state_bytes

    limit = planned_limit(budget)
    least, kind = least_state_bytes(model, optimizer, levers=levers)
    if least <= limit:
        return
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = params * 4 + trainable * 12  # frozen weights (LoRA's base) hold no gradient or AdamW state
    precisions, options = (), ()
    if estimator is not None and profile is not None:  # the search's choices at their least memory
        from ..levers.blocks import find_blocks
        from .search import candidate_precisions, checkpoint_ends, least_memory_options, per_block_ladders

        blocks = find_blocks(model)
        first, last = checkpoint_ends(checkpointing, len(blocks))
        precisions = candidate_precisions(profile, precision)
        # the frozen first blocks without a trace: a first block with nothing to train
        free = int(bool(blocks) and not any(p.requires_grad for p in blocks[0].parameters()))
        options = least_memory_options(first, last, len(blocks), per_block_ladders(checkpointing, len(blocks), free))
    peaks = lever_peaks(model, estimator if options else None, precisions, options, limit, effective_batch)
    lines = lever_lines(model, state, limit, 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
                        host_link_bytes_per_s, accumulating=False, cuda=cuda, profile=profile,
                        lever_peak=peaks, activations=False)  # the least state: no accumulation
    fp32 = (f"fp32 weights ({format_bytes(4 * params)}), gradients and AdamW state, 16 B per parameter, "
            f"{format_bytes(state)}" if trainable == params else
            f"fp32 weights ({format_bytes(4 * params)}), and gradients and AdamW state of the {trainable:,} trained "
            f"parameters (12 B each), {format_bytes(state)}")
    who = (f"fp32 AdamW needs ({fp32})" if kind == "adamw" else
           f"--optimizer {kind} keeps on the GPU" + (", the least of the optimizers tightfit has" if optimizer == "auto"
                                                     else "") + f" (fp32 AdamW: {fp32})")
    lora = lora_line(model, limit)  # never chosen for you: named where it would change the answer
    lines += [lora] if lora else []
    offload = offload_line(model, limit, host_link_bytes_per_s, profile, cuda, optimizer, precision)
    lines += [offload] if offload else []
    shown = format_bytes_pair(limit, least)
    raise TightfitError(f"budget {format_bytes(budget)} (planned against {shown[0]}, keeping "
                        f"{int(HEADROOM * 100)}% headroom) is below the {shown[1]} of model state that "
                        f"{who}, by {format_bytes(least - limit)}; no micro-batch, accumulation or checkpointing "
                        "changes that. Levers (bytes saved against fp32 AdamW):" + "".join("\n  " + x for x in lines))


def nothing_fits_lines(model, estimate, limit: float, precision: str, block_options, size: int,
                       effective_batch: int, size_flag: str, host_link_bytes_per_s: float,
                       estimator_at=None, optimizer: str = "adamw", profile=None, lever_peak=None,
                       asked_precision: str = "auto", precisions=None) -> list[str]:
    """The way forward when the smallest step tried does not fit: what it costs, what does fit,
    and the levers that would make it fit, with their predicted savings (bytes throughout;
    GiB/MiB only in the text).

    Args:
        model: the ``nn.Module`` planned for (parameter counts).
        estimate: exact estimate of the smallest step tried (``peak_reserved_bytes``,
            ``breakdown``).
        limit: the planned limit (budget less headroom), bytes.
        precision: that step's precision.
        block_options: the sets of checkpointed blocks the search may choose from (e.g. none and
            all), the one of the smallest step first; what fits may use any of them.
        size: sequence length or image size asked for; ``size_flag`` its option, e.g. ``"--seq-len"``.
        estimator_at: ``(size, effective_batch) -> estimate_fn`` to search what fits; None (or a
            None result for sizes other than ``size``) where it cannot be re-estimated; its
            ``smallest_size`` attribute, where set, is the shortest size worth advising.
        optimizer: the plan's optimizer (:data:`tightfit.step.OPTIMIZERS`): its state's bytes.
        profile: the card (the levers it can run, :func:`left_out_levers`), or None.
        lever_peak: whether each optimizer lever fits, as the planner would plan it
            (:func:`lever_peaks`); None: read off its savings.
        asked_precision: ``--precision`` (parameter offload's line: the precision it would run).
        precisions: those the search plans in, for what fits (None: ``precision`` alone). A
            shorter input or a smaller batch may fit in another one than the smallest step's
            (fp32 keeps no half-precision copy of the weights), and the planner then plans it.

    Returns:
        Display lines, without indentation.
    """
    peak = estimate.peak_reserved_bytes
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    params = sum(p.numel() for p in model.parameters())
    from .optimizers import weight_bytes

    state_b, words = _state_on_gpu(optimizer)
    w = weight_bytes(optimizer)  # 4 (fp32), 2 under adamw8bit-bf16; the gradients as many
    state = w * params + (w + state_b) * trainable
    gradients = int(estimate.breakdown.get("gradients", 0))
    kind = 'fp32' if w == 4 else 'bf16'
    if trainable == params:
        made_of = f"{params:,} parameters x {2 * w + state_b} B ({kind} weights {w} B, gradients {w} B, {words} {state_b} B)"
    else:  # frozen weights (LoRA's base too) hold no gradient or optimizer state
        made_of = (f"{params:,} {kind} weights x {w} B, and the {trainable:,} trained parameters' gradients and "
                   f"{words} x {w + state_b} B")
    lines = [f"model state: {made_of} = {format_bytes(state)}"
             + (f"; the rest of that step, {format_bytes(peak - state)}, is activations, temporaries and allocator "
                "overhead" if peak > state else "")]
    if state > limit:
        lines.append(f"the model state alone is {format_bytes(state - limit)} over the planned limit: no "
                     f"micro-batch, accumulation or checkpointing can fit it")
    elif estimator_at is not None:
        precisions = list(precisions or [precision])
        how = f"{' or '.join(precisions)}, checkpointing searched as for the plan"
        if effective_batch > 1:
            mb, one = largest_effective_batch_without_accumulation(estimator_at, size, effective_batch, precisions,
                                                                   block_options, limit)
            if mb or one is not None:  # None: not traced (BatchNorm cannot train on one sample)
                lines.append(f"fits: effective batch {mb} in one micro-batch (no accumulation, so no gradients held "
                             f"across micro-batches; {how}): --batch-size {mb}"
                             if mb else f"does not fit either: effective batch 1 (no accumulation) needs "
                                        f"{format_bytes(one)}")
        from ..models import MIN_TEXT_TOKENS

        # the shortest --seq-len `tightfit train` takes (text after the special tokens, which
        # ``estimator_at.smallest_size`` counts where it knows them); any image size
        smallest = getattr(estimator_at, "smallest_size", MIN_TEXT_TOKENS if size_flag == "--seq-len" else 1)
        if size <= smallest:
            pass  # nothing shorter worth training on
        elif not _resizable(estimator_at, size, effective_batch):
            lines.append(f"a shorter {size_flag} also needs less activation memory (not estimated here)")
        else:
            s, one, smallest = largest_size(estimator_at, size, effective_batch, precisions, block_options, limit,
                                            smallest)
            lines.append(f"fits: {size_flag} {s} at effective batch {effective_batch} (micro-batch 1 x "
                         f"{effective_batch} accumulation steps; {how})" if s else
                         f"does not fit either: a shorter {size_flag} at effective batch {effective_batch} "
                         f"({size_flag} {smallest} needs {format_bytes(one)})" if one else
                         f"does not fit either: a shorter {size_flag} at effective batch {effective_batch} (the "
                         f"sizes down to where the model can still be traced were tried)")
    lines.append(f"levers (bytes saved at the peak of that step, {format_bytes(peak - limit)} over):")
    lines += ["  " + s for s in lever_lines(model, peak, limit, gradients, host_link_bytes_per_s, optimizer,
                                            profile=profile, lever_peak=lever_peak)]
    offload = offload_line(model, limit, host_link_bytes_per_s, profile, precision=asked_precision) \
        if optimizer in ("adamw", "auto") else None
    lines += ["  " + offload] if offload else []
    lora = lora_line(model, limit)  # never chosen for you: named whatever --optimizer is
    lines += ["  " + lora] if lora else []
    return lines
