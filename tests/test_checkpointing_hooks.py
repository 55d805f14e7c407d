"""Turning Hugging Face's checkpointing hook on and off leaves the model's hooks as they were:
a compiled model recompiles when its hook count changes (a planner trying several plans paid
minutes of recompilation for it)."""

import torch

from tightfit.levers.checkpointing import set_activation_checkpointing

from conftest import tiny_bert


def _embedding_hooks(model) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


def test_repeated_enable_keeps_one_input_hook_and_disable_removes_it():
    model = tiny_bert()
    assert _embedding_hooks(model) == 0
    for _ in range(3):
        set_activation_checkpointing(model, True)
        assert _embedding_hooks(model) == 1
    set_activation_checkpointing(model, False)
    assert _embedding_hooks(model) == 0
    set_activation_checkpointing(model, True)
    set_activation_checkpointing(model, True, blocks=[0])  # a subset: tightfit's wrappers, HF's hook off
    assert _embedding_hooks(model) == 0


def test_a_users_own_input_hook_is_kept():
    model = tiny_bert()
    model.enable_input_require_grads()  # the user's own (e.g. frozen embeddings)
    set_activation_checkpointing(model, True)
    set_activation_checkpointing(model, True)
    assert _embedding_hooks(model) == 1
    set_activation_checkpointing(model, False)
    assert _embedding_hooks(model) == 1
    out = model.get_input_embeddings()(torch.tensor([[1, 2]]))
    assert out.requires_grad
