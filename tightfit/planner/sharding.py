"""The planner per rank: DDP when the replicated training state fits each GPU's budget, FSDP2
sharding of parameters, gradients and optimizer state when it does not.

Memory per rank (bytes; AdamW with fp32 master weights, as :func:`tightfit.models.model_state_bytes`
counts them: 4 B weights + 4 B gradient + 8 B moments per trainable parameter, Rajbhandari et
al. 2020, "ZeRO", section 3):

* DDP: the whole state on every rank. DDP's gradient buckets hold the gradients themselves
  (``gradient_as_bucket_view=True``), so nothing is added.
* FSDP2 (``fully_shard`` on each repeated block, then the root): the state divided by the world
  size (AdamW's moments included: allocated at the first step, they are there from then on),
  plus what FSDP2 holds unsharded while it computes: the root's own parameters (embeddings,
  head: all-gathered during the whole forward and backward) and their fp32 gradient before its
  reduce-scatter, two blocks' all-gathered parameters (the one computing and the one
  prefetched) and two blocks' fp32 gradients (the unsharded gradient and the reduce-scatter's
  input buffer) (PyTorch's FSDP2 notes: ``torch/distributed/fsdp/_fully_shard``). Activations
  per rank: the single-GPU estimator's bytes per sample (the slope of its line) times the
  micro-batch; on CUDA the planned micro-batch is then verified by one real step on every rank
  before training (:mod:`tightfit.planner.fsdp_probe`).

DDP is chosen when its state takes at most :data:`STATE_SHARE` of the budget (the rest is for
activations); FSDP2 otherwise, if its own state fits the budget (less the planner's headroom;
whether activations fit too is the micro-batch planner's question); else nothing fits. The
micro-batch is then planned on rank 0: under DDP by the single-GPU planner (each rank runs the
same step as one GPU would, on its share of the window); under FSDP2 from the memory estimator
(no GPU can run the unsharded step), see :func:`fsdp_micro_batch`.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from ..errors import TightfitError
from ..units import format_bytes, format_bytes_pair
from .margins import HEADROOM, planned_limit

# The share of the budget the training state may take; the rest is left to activations.
STATE_SHARE = 0.6
GATHERED_BLOCKS = 4  # two blocks all-gathered (current, prefetched) + two blocks' gradient buffers
ROOT_COPIES = 2  # the root's parameters all-gathered + their unsharded gradient


@dataclass(frozen=True)
class ShardingChoice:
    """How the ranks hold the training state.

    Attributes:
        sharding: ``"none"`` (one process), ``"ddp"`` or ``"fsdp"``.
        state_bytes: training state per rank (bytes), all-gather buffers included.
        saved_bytes: what FSDP2 removes from each rank compared with DDP (0 otherwise).
        reason: one line saying why.
    """

    sharding: str
    state_bytes: int
    saved_bytes: int
    reason: str


def _root_and_block(model: torch.nn.Module, size=lambda p: p.numel()) -> tuple[int, int]:
    """``(root, block)``: ``size`` summed over the parameters FSDP2 gathers with the root (those
    outside the repeated blocks: embeddings, head) and over the largest block (the whole model
    where it has none). ``size``: per parameter, elements by default."""
    from ..levers.blocks import find_blocks

    total = lambda m: sum(size(p) for p in m.parameters())  # noqa: E731
    blocks = find_blocks(model)
    return total(model) - sum(total(b) for b in blocks), max((total(b) for b in blocks), default=total(model))


def sharded_state_bytes(model: torch.nn.Module, world_size: int) -> tuple[int, int]:
    """``(replicated, sharded)``: training-state bytes per rank under DDP and under FSDP2 (see
    the module doc for the terms)."""
    from ..models import model_state_bytes

    total = model_state_bytes(model)["total"]
    root, block = _root_and_block(model, lambda p: p.numel() * p.element_size())
    return total, -(-total // world_size) + ROOT_COPIES * root + GATHERED_BLOCKS * block


def offloaded_state_bytes(model: torch.nn.Module, precision: str) -> int:
    """Training-state bytes on the GPU under parameter offload (``fsdp-offload``: FSDP2 with its
    shards, gradients and AdamW state in host memory): what FSDP2 holds gathered while it
    computes (see the module doc), in the dtype it gathers (2 B under ``bf16``, else 4 B), with
    the gradients of those parameters in fp32 before they go to the host."""
    root, block = _root_and_block(model)
    gathered = 2 if precision == "bf16" else 4
    return root * (gathered + 4) + 2 * block * (gathered + 4)


def offload_backward_end_bytes(model: torch.nn.Module, precision: str) -> int:
    """GPU bytes of parameter offload at the end of the backward, when FSDP2 reduces the root's
    gradients (embeddings, head: they are last, and often the largest tensors): the root's
    gathered parameters and its unsharded gradient (2 B each under ``bf16``, else 4 B), the fp32
    reduce-scatter input and output (on one rank both full size) before the copy to the host, and
    two blocks gathered. BERT-base at 400 MiB ran out at micro-batch 1 where only the
    activation-time share (:func:`offloaded_state_bytes`) was counted (bench/results/param-offload)."""
    root, block = _root_and_block(model)
    gathered = 2 if precision == "bf16" else 4
    return root * (2 * gathered + 4 + 4) + 2 * block * gathered


def offload_gpu_bytes(model: torch.nn.Module, precision: str) -> int:
    """The GPU's share of the state under parameter offload, at its larger moment (bytes): while
    the blocks compute (:func:`offloaded_state_bytes`) or when the root's gradients are reduced
    (:func:`offload_backward_end_bytes`). Where it is over the planned limit, no micro-batch fits."""
    return max(offloaded_state_bytes(model, precision), offload_backward_end_bytes(model, precision))


def host_state_bytes(model: torch.nn.Module) -> int:
    """Host memory parameter offload holds (bytes): fp32 weights (pinned), and for each trained
    parameter its fp32 gradient (pinned) and AdamW's two fp32 moments: 16 B per trained parameter,
    4 B per frozen one (Rajbhandari et al. 2021, "ZeRO-Infinity")."""
    return sum((16 if p.requires_grad else 4) * p.numel() for p in model.parameters())


def choose_sharding(model: torch.nn.Module, world_size: int, budget_bytes: int | None,
                    asked: str = "auto", precision: str = "bf16") -> ShardingChoice:
    """DDP or FSDP2 for ``model`` on ``world_size`` ranks of ``budget_bytes`` each.

    Args:
        asked: ``"auto"``, ``"ddp"``, ``"fsdp"`` or ``"fsdp-offload"`` (the last three are taken
            as given; ``fsdp-offload`` on one process too).
        precision: the run's, for what ``fsdp-offload`` gathers.

    Raises:
        TightfitError: not even the sharded state fits the budget.
    """
    if asked == "fsdp-offload":
        replicated = sharded_state_bytes(model, world_size)[0]
        state = offload_gpu_bytes(model, precision)
        return ShardingChoice("fsdp-offload", state, replicated - state,
                              f"parameter offload (FSDP2): weights, gradients and AdamW state in host "
                              f"memory ({format_bytes(host_state_bytes(model))}), the GPU holding "
                              f"{format_bytes(state)} of them while it computes")
    if world_size <= 1:
        return ShardingChoice("none", 0, 0, "one process")
    replicated, sharded = sharded_state_bytes(model, world_size)
    if asked in ("ddp", "fsdp"):
        state = replicated if asked == "ddp" else sharded
        return ShardingChoice(asked, state, 0 if asked == "ddp" else replicated - sharded, f"{asked} (asked for)")
    if budget_bytes is None or replicated <= STATE_SHARE * budget_bytes:
        where = "no budget" if budget_bytes is None else \
            f"{format_bytes(replicated)} of replicated state fits {int(STATE_SHARE * 100)}% of {format_bytes(budget_bytes)}"
        return ShardingChoice("ddp", replicated, 0, f"DDP on {world_size} ranks: {where}")
    if sharded <= (1 - HEADROOM) * budget_bytes:  # whether activations fit too: fsdp_micro_batch
        return ShardingChoice("fsdp", sharded, replicated - sharded,
                              f"FSDP2 on {world_size} ranks: the replicated state ({format_bytes(replicated)}) "
                              f"exceeds {int(STATE_SHARE * 100)}% of {format_bytes(budget_bytes)}; sharded it is "
                              f"{format_bytes(sharded)} per rank (state / {world_size} + all-gathered blocks)")
    shown = format_bytes_pair(sharded, budget_bytes)
    raise TightfitError(f"the training state needs {shown[0]} per rank even sharded over {world_size} "
                        f"ranks, more than the {shown[1]} budget allows: "
                        "use more ranks (--gpus N) or a larger budget")


def fsdp_micro_batch(workload, profile, budget_bytes: int, world_size: int, precision: str,
                     checkpointing: bool, state_bytes: int | None = None) -> tuple[int, int] | None:
    """The micro-batch (up to each rank's share of the window) of the fewest micro-batches per
    window whose predicted per-rank peak fits ``budget_bytes`` under FSDP2, the share split evenly
    among them (:func:`tightfit.plan.balanced_micro_batch`), and its predicted peak (bytes); None
    if micro-batch 1 does not fit.

    Per-rank peak = the sharded state (:func:`sharded_state_bytes`) + the single-GPU estimate's
    bytes per sample x micro-batch + what its line holds at micro-batch 0 beyond the replicated
    state (fixed temporaries); the estimate (:func:`tightfit.memory.estimate.estimate`) is traced
    on meta tensors at micro-batches 4 and 16 and fitted to a line
    (:class:`tightfit.memory.fast.MemoryLine`). ``state_bytes``: the GPU's share of the state
    when it is not the sharded one (parameter offload: :func:`offloaded_state_bytes`). Held to
    the planner's headroom. (Subtracting the
    replicated state from the single-GPU peak instead under-counts: that peak need not hold every
    state byte at once, e.g. AdamW's moments before the first step.)
    """
    from ..memory.estimate import estimate
    from ..memory.fast import TRACED_AT, MemoryLine
    from ..plan import Plan, balanced_micro_batch, rank_batch

    example = workload.train.worst_case(1)
    replicated, sharded = sharded_state_bytes(workload.model, world_size)
    upper = rank_batch(workload.effective_batch, world_size)
    # Parameter offload: the step traced with AdamW's state on the host and each gradient freed
    # once copied there (adamw-offload's step, no accumulation), so that its peak sits where the
    # activations peak, as it does when no gradient stays on the GPU; only its fp32 weights are
    # replaced by the GPU's share. (The fp32 AdamW step's peak sits at the end of the backward,
    # holding every gradient: its line across micro-batches grew far slower than the activations,
    # and planned BERT-large at 2 GiB at 128 where 64 ran, bench/results/param-offload.)
    offload = state_bytes is not None
    kept = 4 * sum(p.numel() for p in workload.model.parameters()) if offload else replicated

    def fn(prec, mb, blocks):
        plan = (Plan(prec, mb, mb, checkpointing, optimizer="adamw-offload", device="cuda") if offload
                else Plan(prec, mb, mb, checkpointing))
        return estimate(workload.model, example, plan, profile)

    line = MemoryLine.traced(fn, precision, (), TRACED_AT)
    extra = max(0.0, line.intercept - kept)  # fixed temporaries: workspaces, the batch
    rank_line = MemoryLine((state_bytes if offload else sharded) + extra, line.slope)
    limit = planned_limit(budget_bytes)
    # under offload, the end of the backward (the root's gradients reduced) is a second peak
    end = offload_backward_end_bytes(workload.model, precision) + extra if offload else 0.0
    mb = rank_line.largest_fitting(limit, upper)
    if mb < 1 or end > limit:
        return None
    mb = balanced_micro_batch(upper, mb)  # as many micro-batches, split evenly: the one trained, and its peak
    return mb, int(max(rank_line.reserved(mb), end))


def choose_checkpointing(fits: dict, share: int, offload: bool = False) -> list[bool]:
    """The activation-checkpointing choices worth running, best first, from ``{checkpointing:
    (micro-batch, peak) or None}`` and the rank's ``share`` of the window (samples).

    With checkpointing first when it at least halves the micro-batches per window
    (``ceil(share / micro-batch)``): under FSDP2 every micro-batch all-gathers the parameters in
    its forward and again in its backward (``reshard_after_forward``), and pays the host's
    per-pass cost, so a window of n micro-batches moves 2n copies of the weights; checkpointing
    adds one forward's compute (about a third of the step's), which halving n more than repays.
    Measured on 2 H200s at 4 GiB each (BERT-large, ``bench/results/multi-gpu-2``): micro-batch 9
    without checkpointing ran 64 samples/s and then ran out of memory. Under parameter offload
    (``offload``) checkpointing comes first whenever it means fewer micro-batches: each one more
    adds a pass over the fp32 gradients in host memory (the 1.3B decoder at 4 GiB: about 3.5 s
    per micro-batch of 5 samples, against 1.35 s for a whole step of one micro-batch of 4,
    ``bench/results/param-offload``).
    """
    off, on = fits.get(False), fits.get(True)
    n_on, n_off = (math.ceil(share / f[0]) if f else 0 for f in (on, off))
    if off and on and (n_on < n_off if offload else 2 * n_on <= n_off):
        return [True]
    return [c for c in (False, True) if fits.get(c)]


def plan_for_ranks(recipe, single_plan):
    """The plan of a run on ``recipe.world.size`` ranks, made on rank 0 (the caller broadcasts it).

    Resumed runs keep their plan (a new world size re-decides only the sharding). DDP: the
    single-GPU planner ``single_plan()`` on each rank's share of the window, with the budget
    less DDP's gradient buckets (gradients accumulated outside DDP's buckets until the window's
    last micro-batch sit beside them). FSDP2: precision from the card, the micro-batch from
    :func:`fsdp_micro_batch`, checkpointing as :func:`choose_checkpointing` decides.

    Args:
        recipe: a :class:`tightfit.api.TrainRecipe` after its model is loaded.
        single_plan: ``() -> Plan``, the one-GPU planner of the recipe (reads ``recipe.workload``
            and ``recipe.budget``).

    Raises:
        TightfitError: nothing fits, or an optimizer lever asked for under FSDP2.
    """
    from dataclasses import replace

    from ..models import model_state_bytes
    from ..plan import Plan, rank_batch

    world, p = recipe.world, recipe.req.planning
    cuda = recipe.device == "cuda"
    # on the CPU too: a budget given there is checked as a GPU's would be (one process checks it
    # against the model state, api.TrainRecipe._check_budget)
    choice = choose_sharding(recipe.model, world.size, recipe.budget, p.sharding,
                             offload_precision(recipe.profile, p.precision)[0] if p.sharding == "fsdp-offload" else "bf16")
    if recipe.resume_from is not None:
        plan = single_plan()
        if plan.world_size == world.size:
            return plan
        return replace(plan, world_size=world.size, sharding=choice.sharding,
                       reasons=plan.reasons + (f"resumed on {world.size} ranks: {choice.reason}",))
    if choice.sharding != "ddp" and p.optimizer not in ("auto", "adamw"):  # the FSDP2 plan holds fp32 AdamW state
        raise TightfitError(f"--optimizer {p.optimizer} is not available under FSDP2 "
                            f"({'--sharding ' + p.sharding if p.sharding != 'auto' else choice.reason}): its plan "
                            "shards fp32 AdamW state; use --sharding ddp, or --optimizer adamw")
    E = recipe.workload.effective_batch
    share = rank_batch(E, world.size)
    if choice.sharding == "ddp":
        saved = recipe.workload, recipe.budget
        recipe.workload = replace(recipe.workload, effective_batch=share)
        if cuda:
            recipe.budget -= model_state_bytes(recipe.model)["gradients"]
        try:
            base = single_plan()
        finally:
            recipe.workload, recipe.budget = saved
        # the single-process plan was made for one rank's share: say so where it speaks of the batch
        reasons = tuple(r.replace("the whole effective batch in one micro-batch", "each rank's whole share in one "
                                  "micro-batch") for r in base.reasons)
        return replace(base, effective_batch=E, world_size=world.size, sharding="ddp",
                       reasons=reasons + (choice.reason + f"; {share} samples of each window per rank",))
    if not cuda:
        prec = "fp32" if p.precision == "auto" else p.precision
        return Plan(prec, share, E, p.checkpointing == "on", device="cpu", world_size=world.size,
                    sharding=choice.sharding, reasons=(choice.reason, "CPU: each rank's whole share in one micro-batch"))
    return fsdp_plan(recipe, choice, world.size)


def offload_precision(profile, asked: str) -> tuple[str, str]:
    """The precision of a parameter-offload plan and why: bf16 where the card runs it, else fp32
    (fp16's loss scaler does not unscale gradients in host memory: refused by the options)."""
    from ..levers.precision import check_precision

    if asked != "auto":
        check_precision(asked, profile)
        return asked, f"{asked} (asked for)"
    if profile is not None and profile.bf16:
        return "bf16", "bf16: the card runs it; parameters gathered in bf16, gradients reduced in fp32"
    return "fp32", "fp32: the card has no bf16, and fp16's loss scaler does not reach gradients in host memory"


def first_clause(refused: str) -> str:
    """The single-GPU planner's refusal ``refused`` up to its first line's first ``;``."""
    return refused.splitlines()[0].split(";")[0]


def fallback_reason(refused: str, optimizer: str) -> str:
    """The first reason of a parameter-offload plan taken because no single-GPU plan fits:
    ``refused`` is the single-GPU planner's refusal (its :func:`first_clause` is kept)."""
    first = first_clause(refused)
    levers = " (nor with the optimizer levers)" if optimizer == "auto" and "optimizer lever" not in first else ""
    return f"no single-GPU plan fits{levers}: {first}"


def falls_back_to_offload(model: torch.nn.Module, budget_bytes: int, profile, optimizer: str, precision: str) -> bool:
    """Whether ``auto`` takes parameter offload where no single-GPU plan fits: ``tightfit train``
    on one CUDA GPU (the caller checks that) and ``tightfit plan`` decide alike. Only where
    tightfit chooses the optimizer too (``optimizer`` ``auto``: one asked for keeps the refusal,
    whose offload line says what it needs), not under fp16, for a model of repeated blocks, and
    where the GPU's share (:func:`offload_gpu_bytes`) is under the planned limit (else that line
    says by how much)."""
    from ..levers.blocks import find_blocks

    if optimizer != "auto" or precision == "fp16" or not find_blocks(model):
        return False
    return offload_gpu_bytes(model, offload_precision(profile, precision)[0]) <= planned_limit(budget_bytes)


def offload_plan(recipe, first_reason: str, refused: str | None = None):
    """The parameter-offload plan on one GPU (:func:`fsdp_plan`; two traces per checkpointing
    choice), ``first_reason`` first among its reasons. ``recipe``: as :func:`fsdp_plan` reads it.

    Raises:
        TightfitError: no micro-batch fits; where offload was fallen back to (``refused``: the
            single-GPU refusal), that refusal first, with its advice, then why offload does not
            fit either.
    """
    from dataclasses import replace

    prec = offload_precision(recipe.profile, recipe.req.planning.precision)[0]
    try:
        plan = fsdp_plan(recipe, choose_sharding(recipe.model, 1, recipe.budget, "fsdp-offload", prec), 1)
    except TightfitError as e:
        if refused is None:
            raise
        raise TightfitError(f"{refused}\n  parameter offload does not fit either: {e}") from None
    return replace(plan, reasons=(first_reason,) + plan.reasons)


def fsdp_plan(recipe, choice: ShardingChoice, world_size: int):
    """The FSDP2 plan (``fsdp`` on several ranks, ``fsdp-offload`` on one or several) on CUDA:
    precision from the card, the micro-batch from :func:`fsdp_micro_batch`, checkpointing as
    :func:`choose_checkpointing` decides. The trainer then verifies the micro-batch with real
    steps (:func:`tightfit.planner.fsdp_probe.verify_micro_batch`).

    Raises:
        TightfitError: micro-batch 1 does not fit, with checkpointing or without.
    """
    from ..levers.precision import check_precision, preferred_precision
    from ..plan import Plan, rank_batch

    p = recipe.req.planning
    E = recipe.workload.effective_batch
    share = rank_batch(E, world_size)
    offload = choice.sharding == "fsdp-offload"
    if offload:
        prec, why = offload_precision(recipe.profile, p.precision)
    elif p.precision == "auto":
        prec, why = preferred_precision(recipe.profile)
    else:
        check_precision(p.precision, recipe.profile)
        prec, why = p.precision, f"{p.precision} (asked for)"
    state = offloaded_state_bytes(recipe.model, prec) if offload else None
    fits, tried = {}, []
    for ckpt in {"auto": [False, True], "on": [True], "off": [False]}[p.checkpointing]:
        fits[ckpt] = fsdp_micro_batch(recipe.workload, recipe.profile, recipe.budget, world_size, prec, ckpt,
                                      state_bytes=state)
        tried.append(f"checkpointing {'on' if ckpt else 'off'}: "
                     + (f"micro-batch {fits[ckpt][0]}" if fits[ckpt] else "none fits"))
    per_rank = " per rank" if world_size > 1 else ""
    held = "the GPU's share of the state under parameter offload" if offload else "the sharded state"
    for ckpt in choose_checkpointing(fits, share, offload):
        mb, peak = fits[ckpt]
        limit = planned_limit(recipe.budget)
        return Plan(prec, mb, E, ckpt, device="cuda", budget_bytes=recipe.budget, world_size=world_size,
                    sharding=choice.sharding, predicted_peak_reserved_bytes=peak,
                    reasons=(why, choice.reason, f"micro-batch {mb}{per_rank}: the fewest micro-batches per window "
                             f"whose predicted peak (the estimator's activations, with {held}) fits the planned limit "
                             f"{format_bytes(limit)} of the {format_bytes(recipe.budget)} budget, the smallest micro-batch "
                             f"that many passes allow (the samples split as evenly as one size can)", f"activation checkpointing {'on' if ckpt else 'off'} ({'; '.join(tried)})"))
    where = "with parameter offload" if offload else "under FSDP2"
    raise TightfitError(f"nothing fits {format_bytes(recipe.budget)} per GPU {where} on {world_size} GPU"
                        f"{'s' if world_size > 1 else ''}: " + "; ".join(tried))
