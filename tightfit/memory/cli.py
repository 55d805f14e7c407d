"""``tightfit estimate``: predict a training step's peak GPU memory, on any machine.

Wire into ``tightfit/cli.py``: ``add_parser(sub)`` next to the other sub-commands, and
``return run(args)`` when ``args.command == "estimate"``.
"""

from __future__ import annotations

import json
import sys
from typing import NamedTuple

from ..errors import TightfitError
from ..units import format_bytes


def add_model_arguments(p, default_model: str | None = None) -> None:
    """``--model`` and ``--seq-len | --image-size``, shared by the commands that take a built-in
    architecture or a Hugging Face folder; ``--model`` is required unless ``default_model`` is given."""
    p.add_argument("--model", required=default_model is None, default=default_model,
                   help="minilm, bert-base, bert-large, gpt2, vit-b16, resnet50 or a local Hugging Face folder"
                        + (f" (default: {default_model}, tightfit train's)" if default_model else ""))
    size = p.add_mutually_exclusive_group()
    size.add_argument("--seq-len", type=int, help="tokens per sample (text models; default: tightfit train's, 64)")
    size.add_argument("--image-size", type=int, help="pixels per side (image models; default: the model's own "
                                                     "side, as tightfit train takes it)")


def model_size(args, kind: str) -> int:
    """The size a command traces ``args.model`` at (and sets it in ``args``): ``--seq-len`` or
    ``--image-size`` as given, else what ``tightfit train`` takes by default -- 64 tokens, or an
    image model's own side (its config's, a tightfit-saved folder's, else 224:
    :meth:`tightfit.models.ModelEntry.fit_image_size`).

    Raises:
        TightfitError: the size given is the other kind's (``--seq-len`` for an image model).
    """
    if kind == "image":
        if args.seq_len is not None:
            raise TightfitError(f"{args.model} takes images: give --image-size, not --seq-len")
        if args.image_size is None:
            from ..models import resolve

            entry = resolve(args.model)
            args.image_size = entry.fit_image_size(entry.load_config()[1], None)
        return args.image_size
    if args.image_size is not None:
        raise TightfitError(f"{args.model} takes text: give --seq-len, not --image-size")
    if args.seq_len is None:
        from ..config import WorkloadOptions

        args.seq_len = WorkloadOptions().seq_len
    return args.seq_len


def gradient_note(gradients_at_peak: int, all_gradient_bytes: int, accumulation_steps: int = 1) -> str:
    """Why the breakdown's gradients (bytes held at the peak) differ from the model's gradients
    (``all_gradient_bytes``: every trainable parameter's, in its dtype); "" when they agree and
    there is no accumulation to mention.

    The breakdown is taken at the moment of the allocated peak. A training step frees its
    gradients after the optimizer step (``zero_grad(set_to_none=True)``, :mod:`.step`), and the
    peak usually comes in the next step's forward or early backward, while the activations are
    still held and before backward has produced every gradient -- so few or none are counted
    there. With gradient accumulation they are held across the window's micro-batches.
    """
    if gradients_at_peak < all_gradient_bytes:
        # not "while the activations are still held": at small micro-batches the peak is a
        # late backward temporary (the embedding's gradient), after the activations are freed
        return (f"at the peak; all gradients: {format_bytes(all_gradient_bytes)}. The peak comes before backward has "
                f"produced them all; each optimizer step frees them (zero_grad(set_to_none=True))")
    if accumulation_steps > 1:
        return f"all of them: held across the {accumulation_steps} micro-batches of each accumulation window"
    return ""


MARGIN_NOTE = ("kept free for the estimator's error on checkpointed steps; not in `tightfit estimate`'s peak; "
               "on a GPU, real probe steps verify the plan instead")


def breakdown_lines(breakdown: dict, all_gradient_bytes: int, accumulation_steps: int = 1) -> list[str]:
    """The per-component bytes at the peak as indented display lines, the gradients with
    :func:`gradient_note`."""
    lines = []
    for k, v in breakdown.items():
        note = gradient_note(v, all_gradient_bytes, accumulation_steps) if k == "gradients" else \
            MARGIN_NOTE if k == "estimator_margin" else ""
        lines.append(f"  {k:<20}{format_bytes(v)}" + (f"  ({note})" if note else ""))
    return lines


def add_parser(subparsers) -> None:
    """Add the ``estimate`` sub-command to an argparse ``subparsers`` object."""
    p = subparsers.add_parser("estimate", help="predict a training step's peak GPU memory (no GPU needed)",
                              description="Predict peak allocated/reserved GPU memory of one training step "
                                          "(forward, backward, optimizer step) by tracing it on meta tensors.")
    from ..config import WorkloadOptions

    add_model_arguments(p, default_model="minilm")  # as tightfit plan: tightfit train's main job
    batch = WorkloadOptions.batch_size
    p.add_argument("--micro-batch", type=int,
                   help=f"samples per forward/backward pass (default: the whole effective batch, --batch-size or "
                        f"{batch}, the main job's, as tightfit plan plans it)")
    p.add_argument("--batch-size", type=int,
                   help="effective batch: samples per optimizer step (default: the micro-batch); above it the "
                        "step accumulates gradients over micro-batches, holding every gradient, as tightfit plan "
                        "traces it")
    p.add_argument("--precision", default="fp32", help="fp32|fp16|bf16 (autocast; default fp32)")
    p.add_argument("--checkpointing", default="none",
                   help="none|all|comma-separated block indices (default none; off and on, as tightfit plan "
                        "and train write them, mean none and all)")
    p.add_argument("--block-policies",
                   help="instead of --checkpointing, what each repeated block keeps for backward: none|selective|"
                        "full|offload, one per block (as tightfit plan --json lists them) or runs of blocks (as "
                        "tightfit plan prints them, e.g. '0-9 full, 10-11 selective')")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw (fused; default) | adamw-foreach (multi-tensor: one more fp32 copy of the "
                        "parameters at its step) | sgd (momentum) | adamw8bit | adamw-offload | adamw8bit-bf16 "
                        "(bf16 weights: --precision bf16 only); the levers of tightfit plan --optimizer")
    p.add_argument("--attention", default="sdpa", help="Hugging Face attention: sdpa|eager (default sdpa)")
    p.add_argument("--allocator", default="expandable", choices=("expandable", "default"),
                   help="CUDA caching allocator configuration: expandable (expandable_segments:True, what "
                        "tightfit's runtime sets; default) or default (PyTorch's default segments)")
    p.add_argument("--gpu", help="GPU profile, e.g. gtx-1650-ti (sets workspace sizes, and the budget whose "
                                         "planned limit, as tightfit plan keeps it, the verdict compares with)")
    p.add_argument("--budget", help="memory budget for the verdict, e.g. 4GiB (default: the --gpu card's; "
                                    "without --gpu the h200's rules apply, as in tightfit plan)")
    p.add_argument("--trainable", default="all", help="all|lora|frozen-embeddings|frozen-N: what is trained, as "
                                                      "tightfit plan and train --trainable take it (default all)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args) -> int:
    """Run ``tightfit estimate``; returns the exit code.

    Raises:
        TightfitError: bad arguments (unknown model/profile/precision/allocator, sizes < 1, a batch
            above :data:`tightfit.plan.MAX_BATCH`, bad blocks or block policies, or both given).
    """
    from ..tasks import size_name
    from ..plan import Plan
    from .estimate import estimate
    from ..models import build_model

    from ..config import WorkloadOptions, check_option

    if args.batch_size is not None:  # as `tightfit plan` checks it
        check_option(WorkloadOptions, "batch_size", args.batch_size, called="--batch-size")
    if args.micro_batch is None:  # the whole effective batch in one micro-batch: --batch-size's, else the main job's
        args.micro_batch = args.batch_size if args.batch_size is not None else WorkloadOptions.batch_size
    check_option(WorkloadOptions, "batch_size", args.micro_batch, called="--micro-batch")  # >= 1, <= MAX_BATCH
    effective_batch = args.micro_batch if args.batch_size is None else args.batch_size
    if effective_batch < args.micro_batch:
        raise TightfitError(f"--batch-size {args.batch_size} is below --micro-batch {args.micro_batch}: the effective "
                            f"batch is the samples of one optimizer step, one or more micro-batches")
    from ..step import OPTIMIZERS

    if args.optimizer not in OPTIMIZERS:
        raise TightfitError(f"unknown optimizer {args.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
    profile, budget, card_notes = None, None, []
    if args.gpu is not None or args.budget is not None:
        from ..planner.cli import card_budget

        profile, budget, card_notes = card_budget(args.gpu, args.budget)
    check_option(WorkloadOptions, "trainable", args.trainable)
    if args.precision not in ("fp32", "fp16", "bf16"):
        raise TightfitError(f"unknown --precision {args.precision!r}; use fp32, fp16 or bf16")
    from ..levers.optimizers import check_precision as check_optimizer_precision

    check_optimizer_precision(args.optimizer, args.precision, profile)  # bf16 weights: bf16 on a bf16 card
    warnings = []
    if profile is not None:
        from ..levers.precision import check_precision

        warnings = check_precision(args.precision, profile)  # raises e.g. for bf16 below compute capability 8.0
    for w in card_notes + warnings:  # e.g. fp16 without tensor cores, noted as `tightfit plan` notes it
        print(f"note: {w}", file=sys.stderr if args.json else sys.stdout)
    check_option(WorkloadOptions, "image_size", args.image_size)  # train's bound: 0 is no multiple of a patch
    model, make_batch = build_model(args.model, attn_implementation=args.attention, image_size=args.image_size)
    notes = list(make_batch.notes)  # e.g. the padding token a GPT-style classifier's config lacks
    from ..levers.trainable import apply_trainable

    model, note = apply_trainable(model, args.trainable)  # as `tightfit plan` and `train --trainable` do
    notes += [note] if note else []
    for n in notes:
        print(f"note: {n}", file=sys.stderr if args.json else sys.stdout)
    kind = make_batch.kind
    size = model_size(args, kind)
    if kind != "image":
        from ..models import check_planned_seq_len

        check_planned_seq_len(size, args.model)
    batch = make_batch(1, size)
    policies = None
    if args.block_policies is not None:
        if args.checkpointing not in ("none", "off"):
            raise TightfitError("give --block-policies or --checkpointing, not both: the policies say which blocks "
                                "recompute")
        from ..levers.blocks import find_blocks, parse_policies

        policies = parse_policies(args.block_policies, len(find_blocks(model)))
    from ..levers.trainable import trainable_fields

    plan = Plan(args.precision, args.micro_batch, effective_batch, optimizer=args.optimizer, device="cuda",
                budget_bytes=budget, **trainable_fields(model))  # what is trained, as plan --json says it
    try:
        result = estimate(model, batch, plan, device=profile, checkpoint_blocks=args.checkpointing,
                          allocator=getattr(args, "allocator", "expandable"), block_policies=policies)
    except (ValueError, RuntimeError) as e:  # e.g. an image smaller than the model's kernels
        from ..models import trace_failure

        raise trace_failure(args.model, size, e) from None
    from ..levers.freezing import frozen_prefix_blocks

    free = frozen_prefix_blocks(model, batch)  # frozen first blocks: checkpointed, they recompute nothing
    # the estimator's margin as the planner adds it: any policy but none, else a recomputed block past the frozen ones
    checkpointed = any(p != "none" for p in policies) if policies else \
        any(i >= free for i in result.plan["checkpoint_blocks"])
    verdict = fits_verdict(result.peak_reserved_bytes, checkpointed, budget) if budget else None
    from ..levers.optimizers import trainable_gradient_bytes

    grads = trainable_gradient_bytes(model, args.optimizer)
    steps = plan.accumulation_steps
    note = gradient_note(result.breakdown.get("gradients", 0), grads, steps)
    if args.json:
        d = result.to_dict()
        if profile:
            # fits: peak_reserved_bytes + estimator_margin_bytes <= planned_limit_bytes
            d.update(budget_bytes=budget, planned_limit_bytes=verdict.limit_bytes,
                     estimator_margin_bytes=verdict.margin_bytes, fits=verdict.fits)
        # every note the text prints (the card's, the model's, --trainable's), then the gradients'
        d["notes"] = card_notes + warnings + notes + ([f"gradients: {note}"] if note else [])
        print(json.dumps(d, indent=2))
        return 0
    from ..levers.blocks import find_blocks

    n, blocks = len(find_blocks(model)), result.plan["checkpoint_blocks"]  # what was traced
    ck = "none" if not blocks else f"all {n} blocks" if len(blocks) == n else "blocks " + ",".join(map(str, blocks))
    if policies:
        from ..levers.blocks import describe_policies

        ck = f"per block {describe_policies(policies)}"
    last = effective_batch - (steps - 1) * args.micro_batch  # the window's short last micro-batch
    batch = f"micro-batch {args.micro_batch}" + (
        f" x {steps} accumulation steps" + (f" (the last {last})" if last != args.micro_batch else "")
        + f" (effective batch {effective_batch})" if steps > 1 else "")
    card = profile.name if profile else "a Hopper GPU such as the H200 (the default; --gpu NAME for another card)"
    print(f"{args.model}, {size_name(kind)} {size}, {batch}, {args.precision}, checkpointing {ck}, {args.optimizer}, {result.allocator} allocator, "
          f"for {card}")
    print(f"peak allocated  {format_bytes(result.peak_allocated_bytes)}")
    print(f"peak reserved   {format_bytes(result.peak_reserved_bytes)}, of which:")  # the parts add up to it
    print("\n".join(breakdown_lines(result.breakdown, grads, steps)))
    if profile:
        print(f"{profile.name}: {verdict.line}")
    return 0


class FitsVerdict(NamedTuple):
    """:func:`fits_verdict`'s answer: ``fits`` is ``peak + margin_bytes <= limit_bytes``."""

    fits: bool
    limit_bytes: int  # the planned limit: the budget less the planner's headroom
    line: str  # one display line
    margin_bytes: int  # the estimator's margin added to the peak (0 where nothing is checkpointed)


def fits_verdict(peak_reserved_bytes: int, checkpointed: bool, budget_bytes: int) -> FitsVerdict:
    """Whether a step whose predicted peak is ``peak_reserved_bytes`` fits ``budget_bytes`` as
    ``tightfit plan`` decides it without a GPU: the peak, plus the estimator's margin where blocks
    are ``checkpointed`` (:func:`tightfit.planner.margins.estimator_margin_bytes`), against the
    planned limit (:func:`tightfit.planner.margins.planned_limit`: the budget less the planner's
    headroom)."""
    from ..planner.margins import HEADROOM, estimator_margin_bytes, planned_limit

    limit = int(planned_limit(budget_bytes))
    margin = estimator_margin_bytes(peak_reserved_bytes, checkpointed)
    fits = peak_reserved_bytes + margin <= limit
    counted = f"peak {format_bytes(peak_reserved_bytes)}" + (
        f" + {format_bytes(margin)} estimator margin (a checkpointed step's, as tightfit plan adds it)" if margin else "")
    return FitsVerdict(fits, limit, (f"{counted} {'fits' if fits else 'does NOT fit'} the planned limit {format_bytes(limit)} "
                         f"of budget {format_bytes(budget_bytes)} ({int(HEADROOM * 100)}% headroom, as tightfit plan "
                         f"keeps)"), margin)
