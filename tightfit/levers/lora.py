"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") through peft:
train low-rank adapters on the linear layers of the repeated blocks and the classification head,
with every other weight frozen (no gradient, no optimizer state: DESIGN invariant 6). Chosen
only when asked (``--trainable lora``): it changes what is learned, and so the accuracy.

The adapted layers are found per architecture from the model itself: every ``nn.Linear`` (and
Hugging Face's ``Conv1D``, GPT-2's linear layer) inside the blocks of
:func:`tightfit.levers.blocks.find_blocks` -- BERT's query/key/value/output/intermediate
projections, GPT-2's ``c_attn``/``c_proj``/``c_fc``, a Llama-style decoder's ``q_proj`` ... ``down_proj``.
"""

from __future__ import annotations

import copy
import warnings

import torch

from ..config import option_given
from ..errors import TightfitError
from .blocks import find_blocks
from .trainable import trainable_count
RANK, ALPHA, DROPOUT = 8, 16, 0.1  # the LoRA paper's and peft's usual settings for fine-tuning
HEADS = ("classifier", "score")  # Hugging Face's sequence-classification heads (BERT, decoders)
# Hugging Face classifiers, whose head is every layer outside the base model (:func:`head_names`)
CLASSIFIERS = ("ForSequenceClassification", "ForImageClassification")


def lora_targets(model: torch.nn.Module) -> list[str]:
    """Full names of the linear layers inside ``model``'s repeated blocks.

    Raises:
        TightfitError: the model has no repeated blocks with linear layers.
    """
    from transformers.pytorch_utils import Conv1D

    inside = {id(m) for b in find_blocks(model) for m in b.modules()}
    names = [n for n, m in model.named_modules() if id(m) in inside and isinstance(m, (torch.nn.Linear, Conv1D))]
    if not names:
        raise TightfitError(f"{option_given('trainable', 'lora')}: the model has no repeated blocks with linear layers "
                            "to adapt")
    return names


def head_names(model: torch.nn.Module) -> list[str]:
    """The children of (unwrapped) ``model`` that make its classification head, trained in full
    under LoRA: for a Hugging Face classifier (``...ForSequenceClassification``,
    ``...ForImageClassification``), every child with parameters outside its base model
    (``base_model_prefix``): with the classifier, the layers made new beside it, such as
    DistilBERT's ``pre_classifier`` and DeBERTa's ``pooler``, which would otherwise stay frozen at
    their random initialisation; for other models, the children named as in :data:`HEADS`."""
    prefix = getattr(model, "base_model_prefix", None)
    children = dict(model.named_children())
    if type(model).__name__.endswith(CLASSIFIERS) and prefix in children:
        return [n for n, m in children.items() if n != prefix and next(m.parameters(), None) is not None]
    return [n for n in children if n in HEADS]


def _peft_model(model: torch.nn.Module, config) -> torch.nn.Module:
    """peft's ``get_peft_model(model, config)`` (``model`` wrapped in place), without the warning
    peft's read of transformers 5's deprecated ``is_gradient_checkpointing`` gives."""
    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, config)


def apply_lora(model: torch.nn.Module, rank: int = RANK) -> torch.nn.Module:
    """``model`` wrapped by peft with LoRA adapters of ``rank`` on :func:`lora_targets`; the
    classification head (:func:`head_names`) stays trainable, everything else is frozen.
    The wrapper's ``forward(**batch)`` returns the model's output.

    Raises:
        TightfitError: peft is missing (the ``levers`` extra), or no layer to adapt.
    """
    try:
        from peft import LoraConfig
    except ImportError:
        raise TightfitError(f"{option_given('trainable', 'lora')} needs peft: pip install 'tightfit[levers]'") from None
    targets, heads = lora_targets(model), head_names(model)
    wrapped = _peft_model(model, LoraConfig(r=rank, lora_alpha=ALPHA, lora_dropout=DROPOUT, target_modules=targets))
    for h in heads:  # the head learns in full (peft wraps model in place: its children are the same)
        for p in getattr(model, h).parameters():
            p.requires_grad_(True)
    # the input layers (a stem before the first block) get no adapter: frozen, as under
    # frozen-embeddings, their BatchNorm layers keep their running statistics (eval mode), so the
    # merged model's stem computes the function it had
    from .freezing import freeze_running_statistics

    freeze_running_statistics(model, 0)
    return wrapped


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` is wrapped with LoRA adapters (:func:`apply_lora`: peft's wrapper)."""
    return hasattr(model, "merge_and_unload")


def check_adapters(trainable: str, model: torch.nn.Module) -> None:
    """Refuse a plan that trains LoRA adapters (``Plan.trainable`` ``"lora"``) for a model that
    has none: every weight would train, with the gradients and state a LoRA plan left out.

    Raises:
        TightfitError: one line saying what to do.
    """
    if trainable == "lora" and not has_adapters(model):
        raise TightfitError("the plan trains LoRA adapters (trainable lora), but the model has none: wrap it "
                            "with tightfit.levers.lora.apply_lora first, or plan it with trainable all")


def model_parameters(model: torch.nn.Module) -> int:
    """Parameters of ``model`` without its LoRA adapters (peft's ``lora_*`` tensors): the model's
    own size, which a LoRA-wrapped model and the plain one share."""
    adapters = set()
    if has_adapters(model):  # (peft is installed then)
        from peft.tuners.lora import LoraLayer

        adapters = {id(p) for m in model.modules() if isinstance(m, LoraLayer)
                    for name, p in m.named_parameters() if name.startswith("lora_")}
    return sum(p.numel() for p in model.parameters() if id(p) not in adapters)


def trainable_note(model: torch.nn.Module) -> str:
    """The line that says how many parameters of a LoRA-wrapped ``model`` train (plan and train say it)."""
    from ..config import option_given

    n, total = trainable_count(model)
    return (f"{option_given('trainable', 'lora')}: {n:,} of {total:,} parameters trainable ({100 * n / total:.2f}%: "
            f"LoRA adapters and the head; the rest frozen)")


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the LoRA adapters merged into the weights (peft's ``merge_and_unload``
    on a copy), to save in the model's own format; ``model`` itself if it has no adapters."""
    if not has_adapters(model):
        return model
    return copy.deepcopy(model).merge_and_unload()


def merged_from_state(model: torch.nn.Module, state_dict: dict) -> torch.nn.Module:
    """A plain model with the LoRA adapters merged, built on the CPU from ``state_dict``: the full
    state of the LoRA-wrapped ``model`` (its keys), as FSDP2 gathers it from the shards, where
    ``model`` itself holds only this rank's shard. The architecture is ``model``'s (its config and
    its adapters' peft config), in the dtype of ``state_dict``'s floating-point tensors where they
    are all one (bf16 weights stay bf16, as a one-process run saves them); the global RNG is left as
    it was."""
    base = model.get_base_model()
    with torch.random.fork_rng(devices=[]):
        wrapped = _peft_model(type(base)(copy.deepcopy(base.config)), copy.deepcopy(model.peft_config[model.active_adapter]))
    floating = {v.dtype for v in state_dict.values() if torch.is_floating_point(v)}
    if len(floating) == 1:  # bf16 weights: built in fp32 from the config, saved as the trained model is
        wrapped.to(floating.pop())
    wrapped.load_state_dict(state_dict)
    return wrapped.merge_and_unload()
