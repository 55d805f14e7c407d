"""``tightfit plan``: the fastest plan that fits a card, explained, with no GPU needed."""

from __future__ import annotations

import json
import sys
import time

from ..units import format_rate
from ..errors import TightfitError



def add_parser(subparsers) -> None:
    """Add the ``plan`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser("plan", help="choose the fastest plan that fits a card (no GPU needed)",
                              description="Search precision, micro-batch x accumulation and activation "
                                          "checkpointing for the fastest predicted plan that fits the budget.")
    from ..memory.cli import add_model_arguments

    from ..config import WorkloadOptions

    add_model_arguments(p, default_model="minilm")  # with no model and batch given: tightfit train's main job
    batch = WorkloadOptions.batch_size
    p.add_argument("--batch-size", type=int, default=batch,
                   help=f"effective batch: samples per optimizer step (default: {batch}, tightfit train's)")
    p.add_argument("--gpu", help="card profile, e.g. gtx-1650-ti (default with --budget: h200 rates)")
    p.add_argument("--budget", help="memory budget, e.g. 4GiB (default: the card's)")
    p.add_argument("--precision", default="auto", help="auto|fp32|fp16|bf16 (default auto)")
    p.add_argument("--checkpointing", default="auto", help="auto|on|off (default auto: searched per block)")
    p.add_argument("--optimizer", default="auto", help="auto|adamw|adamw8bit|adamw-offload|adamw8bit-bf16 (default auto: fp32 "
                                                       "AdamW state first, then the optimizer levers)")
    p.add_argument("--trainable", default="all", help="all|lora|frozen-embeddings|frozen-N: plan for training every "
                                                      "parameter; LoRA adapters (peft, rank 8) with the rest frozen; "
                                                      "all but the input layers; or all but the input layers and the "
                                                      "first N blocks (default all)")
    p.add_argument("--sharding", default="auto", help="auto|fsdp-offload: plan parameter offload (FSDP2 with the "
                                                      "weights, gradients and AdamW state in host memory); auto takes "
                                                      "it where no single-GPU plan fits (default auto)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    """Run ``tightfit plan``: search (no GPU) and print the plan, as text or ``--json``; returns
    the exit code.

    Raises:
        TightfitError: bad arguments, a budget below the model state, a model that cannot be
            traced at the size asked, or nothing fits.
    """
    from ..levers.checkpointing import check_checkpointing
    from ..models import build_model
    from .advice import check_model_state
    from .optimizers import UNKNOWN_HOST_BYTES, search_optimizers
    from .search import NothingFitsError, estimator_for

    from ..levers.optimizers import check_precision

    profile, budget, notes = _card_and_budget(args)
    check_precision(args.optimizer, args.precision, profile)  # bf16 weights: bf16 autocast only
    if args.precision != "auto":  # e.g. fp16 on a card without tensor cores: as `tightfit train` notes it
        from ..levers.precision import check_precision as check_card_precision

        notes += check_card_precision(args.precision, profile)
    model, make_batch = build_model(args.model, image_size=args.image_size)  # an image model built for that size
    notes += getattr(make_batch, "notes", [])  # e.g. the padding token a GPT-style classifier's config lacks
    from ..levers.trainable import apply_trainable

    model, note = apply_trainable(model, args.trainable)  # as `tightfit train --trainable` does before planning
    notes += [note] if note else []
    from ..memory.cli import model_size

    kind = make_batch.kind
    size = model_size(args, kind)
    if kind != "image":
        from ..models import check_planned_seq_len

        check_planned_seq_len(size, args.model)
    make_batch(1, size)  # validates the size against the model

    def estimator(kind):  # the planner's estimate with optimizer ``kind``; also says which lever would fit
        return estimator_for(model, make_batch, size, profile, args.batch_size, optimizer=kind)

    shortest = 1
    if kind != "image":  # no shorter --seq-len is advised than the one plan and train accept
        from ..models import shortest_planned_seq_len

        shortest = shortest_planned_seq_len(args.model)

    def estimator_at(kind):  # what fits instead, when nothing does
        def at(other_size, effective_batch):
            return estimator_for(model, make_batch, other_size, profile, effective_batch, optimizer=kind)

        at.smallest_size = shortest
        return at

    check_checkpointing(model, args.checkpointing)
    started = time.perf_counter()  # the offload plan's planning_seconds (a search's result times its own)
    if args.sharding == "fsdp-offload":  # asked for: no single-GPU search
        plan = _offload_plan(args, model, make_batch, size, profile, budget, None)
        _print_offload(args, plan, model, notes, profile, budget, kind, size, time.perf_counter() - started)
        return 0
    try:  # planning for a card elsewhere: the levers are searched whether or not their libraries are here
        refused = None  # the single-GPU planner's refusal: its state, or no step, does not fit
        try:
            check_model_state(model, budget, args.optimizer, True, profile.host_link_bytes_per_s, profile=profile,
                              estimator=estimator, precision=args.precision, checkpointing=args.checkpointing,
                              effective_batch=args.batch_size)
        except TightfitError as e:
            refused = e
        if refused is None:
            try:
                result = search_optimizers(
                    model, make_batch, size, args.batch_size, profile, budget, estimator,
                    optimizer=args.optimizer, estimator_at=estimator_at, levers=True,
                    host_bytes=UNKNOWN_HOST_BYTES,  # the card's machine, not this one: its reason says what offload pins
                    precision=args.precision, checkpointing=args.checkpointing)
            except NothingFitsError as e:
                refused = e
        if refused is not None:  # as `tightfit train` does: parameter offload where its GPU share fits
            plan = _offload_plan(args, model, make_batch, size, profile, budget, str(refused))
            if plan is None:
                raise refused
            _print_offload(args, plan, model, notes, profile, budget, kind, size, time.perf_counter() - started)
            return 0
    except (ValueError, RuntimeError) as e:  # e.g. an image smaller than the model's kernels
        from ..models import trace_failure

        raise trace_failure(args.model, size, e) from None
    if args.json:
        _print_json(result, model, notes)
    else:
        _print_text(args, result, model, notes, profile, budget, kind, size)
    return 0


def _offload_plan(args, model, make_batch, size: int, profile, budget: int, refused: str | None):
    """The parameter-offload plan: asked for (``refused`` None), or the one `tightfit train` falls
    back to where no single-GPU plan fits (``refused``: the planner's refusal); falling back, None
    where train would not (:func:`tightfit.planner.sharding.falls_back_to_offload`).

    Raises:
        TightfitError: asked for, where it cannot run or nothing fits (one line); fallen back to,
            where no micro-batch fits (the refusal, then why offload does not fit either).
    """
    from dataclasses import replace
    from types import SimpleNamespace

    from ..config import PlanOptions
    from ..levers.blocks import find_blocks
    from ..levers.trainable import trainable_fields
    from .sharding import fallback_reason, falls_back_to_offload, offload_plan

    if refused is None:
        PlanOptions(sharding="fsdp-offload", optimizer=args.optimizer, precision=args.precision).check_for_device("cuda")
        if not find_blocks(model):
            raise TightfitError("--sharding fsdp-offload needs a model of repeated blocks (transformer layers): "
                                "FSDP2 gathers one block at a time")
    elif not falls_back_to_offload(model, budget, profile, args.optimizer, args.precision):
        return None
    workload = SimpleNamespace(model=model, effective_batch=args.batch_size,
                               train=SimpleNamespace(worst_case=lambda n: make_batch(n, size)))
    recipe = SimpleNamespace(req=SimpleNamespace(planning=PlanOptions(precision=args.precision,
                                                                      checkpointing=args.checkpointing)),
                             workload=workload, budget=budget, profile=profile, model=model)
    first = "--sharding fsdp-offload (asked for)" if refused is None else fallback_reason(refused, args.optimizer)
    return replace(offload_plan(recipe, first, refused), **trainable_fields(model))


def _print_offload(args, plan, model, notes: list[str], profile, budget: int, kind: str, size: int,
                   seconds: float) -> None:
    """A parameter-offload plan (:func:`_offload_plan`, planned in ``seconds``), as text or ``--json``."""
    from ..levers.blocks import find_blocks
    from ..runtime.graphs import graphs_unavailable
    from ..tasks import size_name
    from .sharding import host_state_bytes
    from ..units import format_bytes

    host = host_state_bytes(model)
    if args.json:
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        # every key of a single-GPU plan's JSON (SearchResult.to_dict), in its order, None for the figures
        # the offload planner does not compute, so that a reader finds them whichever plan it gets
        print(json.dumps({"plan": plan.to_dict(),
                          "checkpoint_blocks": list(plan.checkpointed_blocks(len(find_blocks(model)))),
                          "block_policies": None if plan.block_policies is None else list(plan.block_policies),
                          "budget_bytes": budget, "predicted_peak_bytes": plan.predicted_peak_reserved_bytes,
                          "predicted_peak_allocated_bytes": None, "breakdown": None, "predicted_samples_per_s": None,
                          "runners_up": [], "planning_seconds": seconds, "breakdown_notes": [],
                          "graphs_off": graphs_unavailable(plan, model), "notes": list(notes),
                          "host_state_bytes": host}, indent=2))
        return
    for n in notes:
        print(f"note: {n}")
    print(f"{args.model}, {size_name(kind)} {size}, effective batch "
          f"{args.batch_size}, {profile.name} rules, budget {format_bytes(budget)}")
    last = args.batch_size - (plan.accumulation_steps - 1) * plan.micro_batch
    print(f"plan: parameter offload (--sharding fsdp-offload), {plan.precision}, micro-batch {plan.micro_batch} x "
          f"{plan.accumulation_steps} accumulation steps" + (f" (the last {last})" if last != plan.micro_batch else "")
          + f", checkpointing {'on' if plan.activation_checkpointing else 'off'}")
    if plan.trainable_params is not None and plan.trainable != "all":
        print(f"trainable: {plan.trainable}, {plan.trainable_params:,} parameters")
    print(f"predicted: peak {format_bytes(plan.predicted_peak_reserved_bytes)} reserved of {format_bytes(budget)}, "
          f"{format_bytes(host)} of host memory; speed not predicted (no time model for parameter offload; "
          "`tightfit train` verifies the micro-batch with real steps)")
    for r in plan.reasons:
        print(f"  {r}")
    print(_graphs_line(plan, model))
    print(_planned_in(seconds))


def _graphs_line(plan, model) -> str:
    """What `tightfit train --cuda-graphs auto` (the default) would do with ``plan``'s steps."""
    from ..runtime.graphs import graphs_unavailable

    why = graphs_unavailable(plan, model)
    if why:
        return f"CUDA graphs: not used: {why}"
    return ("CUDA graphs: `tightfit train` captures these steps and replays them, one graph per batch shape, "
            "where the budget holds a graph beside an eager step (unless its GPU planner compiles the model): "
            "the run's peak then adds their memory, which the prediction above leaves out, and a host-bound "
            "step runs faster than the eager step predicted (the main job on an NVIDIA H100: 10,105 samples/s "
            "steady, 2,576 eager)")


def _planned_in(seconds: float) -> str:
    """The last line of every plan printed as text: how long planning took (``seconds``)."""
    return f"(planned in {seconds:.1f} s, no GPU used)"


def _card_and_budget(args):
    """The card profile whose rules apply, the budget (bytes) and notes on how it was chosen: a
    ``--budget`` above what the ``--gpu`` card can give its tensors is lowered to that
    (:meth:`~tightfit.devices.DeviceProfile.budget_bytes`).

    Raises:
        TightfitError: neither ``--gpu`` nor ``--budget``, a bad option, or a budget above the card.
    """
    from ..config import PlanOptions, WorkloadOptions, check_option

    if args.gpu is None and args.budget is None:
        raise TightfitError("give --gpu PROFILE or --budget SIZE")
    check_option(WorkloadOptions, "batch_size", args.batch_size)  # as `tightfit train` checks them
    check_option(PlanOptions, "precision", args.precision)
    check_option(PlanOptions, "checkpointing", args.checkpointing)
    check_option(PlanOptions, "optimizer", args.optimizer)
    check_option(WorkloadOptions, "trainable", args.trainable)
    check_option(WorkloadOptions, "image_size", args.image_size)  # train's bound: no plan for a run it refuses
    check_option(PlanOptions, "sharding", args.sharding)
    if args.sharding in ("ddp", "fsdp"):
        raise TightfitError(f"--sharding {args.sharding} applies to several GPUs; tightfit plan plans one: "
                            "--sharding auto or fsdp-offload")
    return card_budget(args.gpu, args.budget)


def card_budget(gpu: str | None, budget_text: str | None):
    """The card profile (``gpu``, else the H200's rates), the budget in bytes (``budget_text``,
    e.g. ``"4GiB"``, else the card's usable memory) and notes: a budget above what the ``gpu``
    card can give its tensors is lowered to that (:func:`tightfit.devices.card_budget`, as
    ``tightfit train`` and :func:`tightfit.plan` decide it).
    ``tightfit plan`` and ``tightfit estimate`` read ``--gpu`` and ``--budget`` alike.

    Raises:
        TightfitError: an unknown profile, a bad size, or a budget above the card's memory.
    """
    from ..devices import card_budget as budget_on, get_profile
    from ..units import parse_budget

    for flag, given in (("--gpu", gpu), ("--budget", budget_text)):
        if given is not None and not given.strip():  # "" would silently mean the default
            raise TightfitError(f"{flag} is empty: give a value, or leave {flag} out")
    profile = get_profile(gpu or "h200")
    try:
        budget = parse_budget(budget_text) if budget_text is not None else None
    except TightfitError as e:  # named as the command line gave it, as `tightfit train` names it
        raise TightfitError(str(e) if "--budget" in str(e) else f"--budget {budget_text}: {e}") from None
    try:
        budget, notes = budget_on(profile, budget, named=bool(gpu))
    except TightfitError as e:
        raise TightfitError(str(e) + ("" if gpu else " (whose rates are used without --gpu)")) from None
    return profile, budget, notes


def _print_json(result, model, notes: list[str]) -> None:
    """The search result as JSON on stdout, its ``notes`` also on stderr."""
    from ..levers.optimizers import trainable_gradient_bytes
    from ..memory.cli import gradient_note
    from ..runtime.graphs import graphs_unavailable

    b = result.best
    grad_note = gradient_note(b.breakdown.get("gradients", 0), trainable_gradient_bytes(model, b.optimizer),
                              b.accumulation_steps)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)  # as `tightfit train` logs its notes
    d = result.to_dict()
    d["breakdown_notes"] = [f"gradients: {grad_note}"] if grad_note else []
    d["graphs_off"] = graphs_unavailable(result.to_plan(), model)  # None: the run would capture them
    d["notes"] = list(notes)  # those printed on stderr too: the JSON carries what the text says
    print(json.dumps(d, indent=2))


def _print_text(args, result, model, notes: list[str], profile, budget: int, kind: str, size: int) -> None:
    """The plan, its predicted speed and memory breakdown and the runners-up, as text."""
    from ..tasks import size_name
    from ..levers.optimizers import trainable_gradient_bytes
    from ..memory.cli import breakdown_lines
    from ..levers.blocks import describe_policies
    from ..units import format_bytes

    b = result.best
    for n in notes:
        print(f"note: {n}")  # as `tightfit train` logs its notes
    print(f"{args.model}, {size_name(kind)} {size}, effective batch {args.batch_size}, "
          f"{profile.name} rules, budget {format_bytes(budget)}")
    last = args.batch_size - (b.accumulation_steps - 1) * b.micro_batch
    plan = result.to_plan()  # the blocks it checkpoints (not frozen first blocks, which keep nothing)
    blocks = plan.checkpointed_blocks(result.n_blocks)
    print(f"plan: {b.precision}, micro-batch {b.micro_batch} x {b.accumulation_steps} accumulation steps"
          + (f" (the last {last})" if last != b.micro_batch else "") + ", "
          + (f"blocks {describe_policies(b.block_policies)}" if b.block_policies is not None else
             f"checkpointing {len(blocks)} of {result.n_blocks} blocks"
             + (f" ({', '.join(map(str, blocks))})" if 0 < len(blocks) < result.n_blocks else "")))
    why = b.why.find("; optimizer ")  # why this optimizer and its cost (planner/optimizers.py): its own line
    per_step = b.why[b.why.find("; per step"):why if why >= 0 else None] if "; per step" in b.why else ""
    print(f"predicted: {format_rate(b.samples_per_s)} samples/s, peak {format_bytes(b.peak_reserved_bytes)} reserved of "
          f"{format_bytes(budget)}" + per_step)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reason = b.why[why + len("; optimizer ") + len(b.optimizer):].lstrip(",:; ") if why >= 0 else ""
    if b.optimizer == "adamw":
        reason = "; ".join(filter(None, [reason, f"fused (no temporaries at its step; foreach AdamW would need "
                                                 f"{format_bytes(4 * trainable)} more there, one fp32 copy of the parameters)"]))
    # "adamw (fused, fp32 state): ...": a parenthesis follows the name, any other reason a colon
    print(f"optimizer: {b.optimizer}" + ((" " if reason.startswith("(") else ": ") + reason if reason else ""))
    if "; precision " in b.why:  # not the card's preferred precision (search.py): why, on its own line
        print("precision: " + b.why.split("; precision ", 1)[1].split("; optimizer ", 1)[0])
    print("\n".join(breakdown_lines(b.breakdown, trainable_gradient_bytes(model, b.optimizer), b.accumulation_steps)))
    print(_graphs_line(plan, model))
    print(f"runners-up with {result.best.optimizer}:" if result.runners_up else
          f"runners-up with {result.best.optimizer}: none (the search had no other choice; the optimizer line compares the others)")
    shown = 8
    for c in result.runners_up[:shown]:
        print(f"  {c.label():<52} {c.why}")
    if len(result.runners_up) > shown:
        print(f"  ... {len(result.runners_up) - shown} more (--json lists them all)")
    print(_planned_in(result.seconds))
