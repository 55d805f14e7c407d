"""Faults a new user of the Python API finds (session 39): class ids that cross-entropy cannot take
reach it from the own-loop API and from a custom dataset."""

import re

import pytest
import torch

import tightfit
from conftest import params_of, assert_same_params, tiny_bert
from tightfit.errors import TightfitError

CLASS_IDS = "labels must be class ids in [0, 2) (the model's num_labels), or -100 to leave a sample out"


def _text_batch(labels):
    ids = torch.randint(1, 50, (len(labels), 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


@pytest.mark.parametrize("bad, said", [(5, "sample 3 is labelled 5 (number the classes 0..1, or give the model "
                                            "num_labels=6)"),
                                       (-1, "sample 3 is labelled -1 (number the classes 0..1)")])
def test_the_own_loop_refuses_class_ids_past_a_classifiers_labels_before_the_step(bad, said):
    """tightfit.plan and TrainStep with a Hugging Face classifier's own loss passed labels past its
    num_labels to cross-entropy: torch's "IndexError: Target 5 is out of bounds" on the CPU, a
    device-side assert on a GPU, which ends the CUDA context (nothing after it runs). The Trainer's
    workloads refused them on the host; the own loop now does too, before any forward."""
    model = tiny_bert()
    labels = torch.tensor([0, 1, 0, bad, 1, 0, 1, 0])
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; {said}")):
        tightfit.plan(model, _text_batch(labels), effective_batch=8, device="cpu")
    plan = tightfit.plan(model, _text_batch(torch.arange(8) % 2), effective_batch=8, device="cpu")
    step = tightfit.TrainStep(plan, model)
    before = params_of(model)
    with pytest.raises(TightfitError, match=re.escape(f"{CLASS_IDS}; {said}")):
        step(_text_batch(labels))
    assert_same_params(before, params_of(model))
    assert step.steps == 0
    # -100 leaves a sample out and stays allowed; a good batch trains after the refusal
    assert step(_text_batch(torch.tensor([0, 1, -100, 1, 0, 0, 1, 1]))).stepped
