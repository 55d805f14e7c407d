"""Activation checkpointing: recompute each transformer block's activations during backward.

Uses the model's own Hugging Face hook (``gradient_checkpointing_enable``) with the
non-reentrant ``torch.utils.checkpoint`` (it works when a block's inputs do not require grad,
e.g. frozen embeddings, and restores the RNG state so dropout masks are recomputed identically).
The KV cache is turned off, as caching conflicts with recomputation in training, and the
model's own setting comes back when checkpointing is turned off again (:func:`restore_kv_cache`).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import TightfitError
from ..buffers import running_stat_norms
from .blocks import compiled_by_blocks


def set_activation_checkpointing(model: torch.nn.Module, enabled: bool, blocks=None, policies=None) -> None:
    """Turn activation checkpointing on or off.

    Turning it on turns a Hugging Face model's KV cache off (``config.use_cache = False``);
    turning it off gives back the setting the model had before (:func:`restore_kv_cache`).

    Args:
        model: a Hugging Face ``PreTrainedModel`` (or any model with repeated blocks when
            ``blocks`` selects some of them).
        enabled: checkpoint or not.
        blocks: indices of the repeated blocks (:func:`tightfit.levers.blocks.find_blocks`) to
            checkpoint; None or all of them: the model's own Hugging Face hook, or tightfit's
            block wrappers for a model without one (e.g. ResNet) or compiled block by block.
        policies: one choice per block (``none|selective|full|offload``,
            :data:`tightfit.levers.blocks.BLOCK_POLICIES`), overriding ``enabled`` and ``blocks``
            (a plan's ``block_policies``); None: ``enabled`` and ``blocks`` decide.

    Raises:
        ValueError: if ``enabled`` and the model does not support gradient checkpointing
            (:func:`can_checkpoint`; the planners refuse such a request first).
        TightfitError: ``policies`` not one known policy per block; ``blocks`` outside the model's.
    """
    from .blocks import apply_block_policies, apply_checkpointing, find_blocks

    n = len(find_blocks(model))
    outside = sorted(b for b in (blocks or ()) if not 0 <= b < n)
    if enabled and policies is None and outside:  # a plan of another model, or edited by hand
        raise TightfitError(f"the plan checkpoints block indices {outside} but the model has {n} blocks"
                            + (f" (0-{n - 1})" if n else ""))
    if n:
        apply_checkpointing(model, ())  # unwrap tightfit's block wrappers from an earlier choice
    if policies is not None:
        _disable_hf_hook(model)
        apply_block_policies(model, policies)
        if any(p != "none" for p in policies):
            _no_kv_cache(model)
        else:
            restore_kv_cache(model)
        return
    # A block compiled alone must be checkpointed around its compiled call, which only
    # tightfit's wrappers do (HF's hook may checkpoint inside the layer's forward).
    # HF's hook recomputes BatchNorm layers with their running statistics updated a second time;
    # tightfit's wrappers keep them (blocks.run_block).
    own_hook = getattr(model, "supports_gradient_checkpointing", False) and not compiled_by_blocks(model) \
        and not running_stat_norms(model)
    chosen = tuple(range(n)) if blocks is None else tuple(blocks)
    if enabled and n and (len(chosen) < n or not own_hook):  # a subset, or a model without HF's hook
        _disable_hf_hook(model)
        apply_checkpointing(model, chosen)  # non-reentrant, RNG-preserving
        _no_kv_cache(model)
        return
    if not enabled:
        _disable_hf_hook(model)
        restore_kv_cache(model)
        return
    if not own_hook:
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    _enable_hf_hook(model)
    _no_kv_cache(model)


@contextlib.contextmanager
def kept_checkpointing(model: torch.nn.Module):
    """Within, :func:`set_activation_checkpointing` may set anything (the GPU planner's probes
    try plans with and without checkpointing on the model itself); on leaving, an error
    included, the model checkpoints as it did on entry: the same blocks with tightfit's wrappers
    and policies, or its Hugging Face hook with the same checkpoint function in each layer (yours
    too, e.g. reentrant), or nothing; and its KV cache setting (``config.use_cache``) and the one
    :func:`restore_kv_cache` would give back are as they were."""
    from .blocks import apply_block_policies, block_policy, find_blocks

    policies = [block_policy(b) for b in find_blocks(model)]
    layers = [(m, m.__dict__.get("gradient_checkpointing"), m.__dict__.get("_gradient_checkpointing_func"))
              for m in model.modules() if "gradient_checkpointing" in m.__dict__] if hf_hook_active(model) else []
    config = getattr(model, "config", None)
    use_cache, yours = getattr(config, "use_cache", None), _base(model).__dict__.get(_USER_USE_CACHE)
    try:
        yield
    finally:
        set_activation_checkpointing(model, False)
        if any(p != "none" for p in policies):
            apply_block_policies(model, policies)
        if layers:
            _enable_hf_hook(model)  # its input-embedding hook, if the first enable had one
            for m, on, fn in layers:
                m.gradient_checkpointing = on
                if fn is None:
                    m.__dict__.pop("_gradient_checkpointing_func", None)
                else:
                    m._gradient_checkpointing_func = fn
        if use_cache is not None:
            config.use_cache = use_cache
        _base(model).__dict__.pop(_USER_USE_CACHE, None)
        if yours is not None:
            _base(model).__dict__[_USER_USE_CACHE] = yours


def can_checkpoint(model: torch.nn.Module) -> bool:
    """Whether :func:`set_activation_checkpointing` can turn checkpointing on for ``model``: it has
    repeated blocks (:func:`tightfit.levers.blocks.find_blocks`) or Hugging Face's own hook."""
    from .blocks import find_blocks

    return bool(find_blocks(model)) or bool(getattr(model, "supports_gradient_checkpointing", False))


def check_checkpointing(model: torch.nn.Module, checkpointing: str) -> None:
    """``checkpointing="on"`` needs something to checkpoint: refused before any planning or probe
    (the search would plan "every block" of none, and a probe or step fail with a ValueError).
    The message names the command line's option (:func:`tightfit.loop.as_arguments` says it as
    the Python argument).

    Raises:
        TightfitError: ``"on"`` for a model without repeated blocks or Hugging Face's hook
            (:func:`can_checkpoint`).
    """
    if checkpointing == "on" and not can_checkpoint(model):
        from ..errors import TightfitError

        raise TightfitError(f"--checkpointing on: {type(model).__name__} has no repeated blocks to checkpoint (children "
                            "of an nn.ModuleList or nn.Sequential of one class) and no Hugging Face gradient "
                            "checkpointing; use --checkpointing off or auto")


def checkpointing_active(model: torch.nn.Module) -> bool:
    """Whether ``model`` checkpoints any activations now: its Hugging Face hook (turned on by you or
    an earlier plan) or tightfit's block wrappers."""
    from .blocks import find_blocks, is_checkpointed

    return hf_hook_active(model) or any(is_checkpointed(b) for b in find_blocks(model))


TURNED_OFF_NOTE = ("the model's activation checkpointing (yours, or an earlier plan's) is turned off: this plan "
                   "has none; plan with checkpointing='on' to keep it")


def plans_checkpointing(enabled: bool, policies=None) -> bool:
    """Whether a plan with ``activation_checkpointing`` ``enabled`` and ``block_policies``
    ``policies`` checkpoints anything."""
    return any(p != "none" for p in policies) if policies is not None else bool(enabled)


def turned_off_note(model: torch.nn.Module, enabled: bool, blocks=None, policies=None) -> str | None:
    """What :func:`set_activation_checkpointing` with these arguments would turn off without a word:
    :data:`TURNED_OFF_NOTE` when ``model`` checkpoints now (:func:`checkpointing_active`) and the
    plan checkpoints nothing; None otherwise. (The GPU planner's probes leave it as they found it:
    :func:`kept_checkpointing`.)"""
    if plans_checkpointing(enabled, policies) or not checkpointing_active(model):
        return None
    return TURNED_OFF_NOTE


def hf_hook_active(model: torch.nn.Module) -> bool:
    """Whether the model's own Hugging Face checkpointing hook is on."""
    return bool(getattr(model, _name(model, "is_activation_checkpointing", "is_gradient_checkpointing"), False))


def _enable_hf_hook(model) -> None:
    # Hugging Face's enable also hooks the input embeddings (outputs made to require grad) and
    # its disable leaves that hook: each enable would add one more, and a model compiled with n
    # hooks recompiles at n + 1 (a planner trying several plans paid minutes of recompilation).
    # One hook is enough: a second enable keeps the first's, and disable removes the ones it added.
    base = _base(model)
    before = list(getattr(base, "_require_grads_hooks", None) or [])
    kwargs = {"use_reentrant": False}
    # the wrapped model's class says which name it has (a peft wrapper forwards both: the old one warns)
    if _name(model, "activation_checkpointing_enable", "gradient_checkpointing_enable") \
            == "activation_checkpointing_enable":
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    after = list(getattr(base, "_require_grads_hooks", None) or [])
    added = [h for h in after if h not in before]
    if before and added:  # the inputs already require grad (the user's hook, or an earlier enable's)
        for h in added:
            h.remove()
        base._require_grads_hooks = before
    elif added:
        base.__dict__["_tightfit_input_grad_hooks"] = added


def _disable_hf_hook(model) -> None:
    if hf_hook_active(model):
        getattr(model, _name(model, "activation_checkpointing_disable", "gradient_checkpointing_disable"))()
    base = _base(model)
    ours = base.__dict__.pop("_tightfit_input_grad_hooks", None)
    if ours:  # the input-embedding hooks our enable added (HF's disable leaves them)
        for h in ours:
            h.remove()
        if list(getattr(base, "_require_grads_hooks", None) or []) == ours:
            base._require_grads_hooks = []


def _base(model) -> torch.nn.Module:
    # a peft wrapper's hooks live on the model it wraps
    return model.get_base_model() if hasattr(type(model), "get_base_model") else model


# where _no_kv_cache keeps the model's own use_cache (on the module, not its config, which
# save_pretrained would write out)
_USER_USE_CACHE = "_tightfit_user_use_cache"


def _no_kv_cache(model) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", None):
        _base(model).__dict__[_USER_USE_CACHE] = config.use_cache
        config.use_cache = False


def restore_kv_cache(model: torch.nn.Module) -> None:
    """Give a Hugging Face model back the KV cache setting (``config.use_cache``) it had before
    :func:`set_activation_checkpointing` turned it off; nothing where it turned nothing off, or
    where the setting is no longer the False it left (set since by you)."""
    user = _base(model).__dict__.pop(_USER_USE_CACHE, None)
    config = getattr(model, "config", None)
    if user is not None and config is not None and getattr(config, "use_cache", None) is False:
        config.use_cache = user


def _name(model, new: str, old: str) -> str:
    # transformers renamed gradient_* to activation_* (the old names warn, and go in v6); a peft
    # wrapper forwards both to the model it wraps, whose class says which it has
    return new if hasattr(type(_base(model)), new) else old
