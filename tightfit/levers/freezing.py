"""Selective freezing: train every parameter but the model's input layers (``--trainable
frozen-embeddings``), or but the input layers and the first ``N`` repeated blocks
(``--trainable frozen-N``), as fine-tuning freezes the lower layers (Howard & Ruder 2018,
"Universal Language Model Fine-tuning", gradual unfreezing; the articles' "selective freezing").

The input layers are every parameter registered before the first repeated block
(:func:`tightfit.levers.blocks.find_blocks`): a transformer's embeddings (BERT's word, position
and token-type embeddings and their LayerNorm; GPT-2's ``wte``/``wpe``), a CNN's stem. A
parameter tied to them (GPT-2's output layer shares ``wte``) is frozen with them, and the note
says so.

What freezing saves: a frozen parameter gets no gradient and no optimizer state (DESIGN
invariant 6: 12 B per parameter with fp32 AdamW), and stays bit-identical. Below the first trained
parameter autograd records nothing, so the frozen blocks keep no activations for backward and
run no backward: memory and compute both, which the estimator's trace sees by itself (its meta
copy keeps ``requires_grad``). Chosen only when asked: it changes what is learned.
"""

from __future__ import annotations

import functools
import re

import torch

from ..config import option_given
from ..errors import TightfitError
from .blocks import find_blocks

FROZEN_EMBEDDINGS = "frozen-embeddings"
_FROZEN_BLOCKS = re.compile(r"frozen-([1-9][0-9]*)")
MARK = "_tightfit_trainable"  # the model's attribute naming the freezing applied (read by trainable_fields)


def frozen_blocks(trainable: str) -> int | None:
    """Repeated blocks a ``--trainable`` value freezes besides the input layers: 0 for
    ``frozen-embeddings``, ``N`` for ``frozen-N``, None for a value that freezes nothing this way
    (``all``, ``lora``, or not a freezing value)."""
    if trainable == FROZEN_EMBEDDINGS:
        return 0
    m = _FROZEN_BLOCKS.fullmatch(trainable) if isinstance(trainable, str) else None
    return int(m.group(1)) if m else None


def input_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter registered before the first repeated block of
    ``model`` (its input layers); empty for a model without repeated blocks."""
    blocks = find_blocks(model)
    if not blocks:
        return []
    inside = {id(p) for b in blocks for p in b.parameters()}
    out = []
    for name, p in model.named_parameters():
        if id(p) in inside:
            break
        out.append((name, p))
    return out


def frozen_prefix_blocks(model: torch.nn.Module, batch: dict) -> int:
    """Leading repeated blocks of ``model`` that run no backward: no trainable parameter in them,
    and an input that needs no gradient, as one forward of ``batch`` (a dict of tensors, any
    micro-batch; traced on a meta copy, so on any machine) shows it. Autograd records nothing
    there, so they keep no activations for backward, and checkpointing them recomputes nothing.
    Read from the data flow, not from the order the parameters are registered in: a trainable
    layer registered after the blocks but run before them, or one between two blocks, sends a
    gradient through the blocks before it. 0 when the first block trains (no trace then)."""
    blocks = find_blocks(model)
    if not blocks or any(p.requires_grad for p in blocks[0].parameters()) \
            or all(p.requires_grad for p in model.parameters()):
        return 0
    from torch.utils._pytree import tree_leaves

    from ..memory.cuda_autocast import CudaOnMeta
    from ..memory.estimate import meta_copy

    meta = meta_copy(model)
    needs = {}  # block index -> whether its input needs a gradient

    def seen(i, module, args, kwargs):
        needs.setdefault(i, any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))))

    hooks = [b.register_forward_pre_hook(functools.partial(seen, i), with_kwargs=True)
             for i, b in enumerate(find_blocks(meta))]
    try:
        # at least two rows: BatchNorm refuses one sample where maps are pooled to 1 x 1 (ResNet-50
        # at 32 pixels), and which inputs need a gradient does not depend on the rows
        with torch.enable_grad(), CudaOnMeta("fp32"):
            meta(**{k: torch.empty((max(2, v.shape[0]), *v.shape[1:]), dtype=v.dtype, device="meta")
                    for k, v in batch.items() if k != "labels"})
    finally:
        for h in hooks:
            h.remove()
    free = 0
    for i, b in enumerate(blocks):
        if needs.get(i, True) or any(p.requires_grad for p in b.parameters()):
            break
        free += 1
    return free


def frozen_parameters(model: torch.nn.Module, trainable: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters ``trainable`` (a freezing value, :func:`frozen_blocks`) freezes in ``model``:
    its input layers, then every parameter registered up to the end of its ``N``-th repeated
    block: the first ``N`` blocks and what is registered between them. A ResNet of basic layers
    repeats the conv layers inside each residual layer, and each layer's shortcut is registered
    beside them: counting the blocks alone left a shortcut (and its BatchNorm) training in the
    middle of a frozen network.

    Raises:
        TightfitError: not a freezing value; the model has no repeated blocks, fewer than ``N``, or
            nothing before its first block to freeze (``frozen-embeddings``).
    """
    n = frozen_blocks(trainable)
    given = option_given("trainable", trainable)
    if n is None:
        raise TightfitError(f"{given} freezes nothing: use frozen-embeddings or frozen-N")
    blocks = find_blocks(model)
    if not blocks:
        raise TightfitError(f"{given}: the model has no repeated blocks (transformer layers, residual blocks) "
                            "after which its input layers end")
    if n > len(blocks):
        raise TightfitError(f"{given}: the model has {len(blocks)} repeated blocks; freeze at most {len(blocks)} "
                            f"(frozen-{len(blocks)} trains only what comes after them, e.g. the head)")
    frozen = input_parameters(model)
    if not frozen and n == 0:
        raise TightfitError(f"{given}: the model has no parameters before its first repeated block; "
                            "freeze blocks with frozen-N")
    inside = {id(p) for b in blocks[:n] for p in b.parameters()}
    return _through(model.named_parameters(), inside, key=lambda named: id(named[1])) if inside else frozen


def _through(items, ids: set, key=id) -> list:
    """The leading ``items`` (registration order) up to the last one whose ``key`` is in ``ids``:
    the first blocks, the input layers before them and what is registered between them."""
    left, out = set(ids), []
    for item in items:
        if not left:
            break
        out.append(item)
        left.discard(key(item))
    return out


def apply_freezing(model: torch.nn.Module, trainable: str) -> str:
    """Freeze what ``trainable`` says in ``model`` (in place: ``requires_grad`` off) and mark the
    model with it (:func:`tightfit.levers.trainable.trainable_fields` reads the mark); returns
    the line that says what trains.

    Raises:
        TightfitError: as :func:`frozen_parameters`.
    """
    frozen, n = frozen_parameters(model, trainable), frozen_blocks(trainable)
    ids = {id(p) for _, p in frozen}
    if not any(p.requires_grad and id(p) not in ids for p in model.parameters()):
        raise TightfitError(f"{option_given('trainable', trainable)} leaves no parameter to train: freeze fewer blocks")
    inputs = bool(input_parameters(model))
    for _, p in frozen:
        p.requires_grad_(False)
    norms = freeze_running_statistics(model, n)
    setattr(model, MARK, trainable)
    named = {name for name, _ in frozen}
    tied = [name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in ids and name not in named]
    ps = list(model.parameters())
    trained, total = sum(p.numel() for p in ps if p.requires_grad), sum(p.numel() for p in ps)
    parts = (["the input layers"] if inputs else []) + \
        ([f"the first {n} of {len(find_blocks(model))} blocks"] if n else [])
    return (f"{option_given('trainable', trainable)}: {' and '.join(parts)} frozen ({total - trained:,} parameters"
            + (f", tied to {', '.join(tied)}, frozen with them" if tied else "")
            + (f"; their {norms} BatchNorm layers keep their running statistics (eval mode)" if norms > 1 else
               "; its BatchNorm layer keeps its running statistics (eval mode)" if norms else "")
            + f"); {trained:,} of {total:,} parameters trainable ({100 * trained / total:.2f}%)")


def freeze_running_statistics(model: torch.nn.Module, n_blocks: int) -> int:
    """Put the BatchNorm layers of the frozen part (the input layers and the first ``n_blocks``
    repeated blocks with what is registered between them, by position, as :func:`frozen_parameters`
    takes them; an ``affine=False``
    layer has no parameter to tell) in eval mode, so that training leaves their running
    statistics as they are and a frozen part computes the same function after training (a frozen
    backbone's usual treatment). The model's root is put in train mode first where it was in eval
    mode (as ``from_pretrained`` returns it): the runtime then keeps the modes of its parts
    (:func:`tightfit.step.training_modes`); in eval mode it would train every part in train mode.
    With the Hugging Face Trainer or Lightning, whose ``train()`` call puts every module in train
    mode, the statistics adapt. Returns how many layers were set so."""
    blocks = find_blocks(model)
    if n_blocks:  # registration order: the input layers, then up to the last frozen block's end
        region = {id(m) for m in _through(model.modules(), {id(m) for b in blocks[:n_blocks] for m in b.modules()})}
    else:  # the input layers: what comes before the first block
        starts = {id(b) for b in blocks}
        region = set()
        for m in model.modules():
            if id(m) in starts:
                break
            region.add(id(m))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats and id(m) in region]
    if norms and not model.training:
        model.train()
    for m in norms:
        m.eval()
    return len(norms)


def frozen_label(model: torch.nn.Module) -> str | None:
    """The freezing value that says what is frozen in ``model`` now: ``frozen-N`` for the input
    layers and the first ``N`` repeated blocks all frozen (the largest such ``N``),
    ``frozen-embeddings`` for the input layers alone, None where an input layer trains. Read from
    ``requires_grad``, so it stays true after a second freezing (``frozen-1`` then
    ``frozen-embeddings`` leaves block 0 frozen) or a partial unfreezing."""
    inputs, blocks = input_parameters(model), find_blocks(model)
    if any(p.requires_grad for _, p in inputs):
        return None
    n = 0
    while n < len(blocks) and not any(p.requires_grad for p in blocks[n].parameters()) \
            and next(blocks[n].parameters(), None) is not None:
        n += 1
    if n:
        return f"frozen-{n}"
    return FROZEN_EMBEDDINGS if inputs else None


def check_frozen(trainable: str, model: torch.nn.Module) -> None:
    """Refuse a plan made for ``trainable`` (a freezing value) for a model where what it freezes
    still requires grad: the step would hold gradients and state the plan left out.

    Raises:
        TightfitError: one line saying what to do.
    """
    if frozen_blocks(trainable) is None:
        return
    live = [n for n, p in frozen_parameters(model, trainable) if p.requires_grad]
    if live:
        raise TightfitError(f"the plan trains with trainable {trainable}, but {len(live)} of the parameters it "
                            f"freezes require grad ({live[0]}, ...): freeze them first "
                            "(tightfit.levers.trainable.apply_trainable), or plan again for the model as it is now")
