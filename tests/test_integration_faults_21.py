"""Faults a review of the Hugging Face Trainer and Lightning integrations found (session 21)."""

import logging

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import Trainer, TrainingArguments  # noqa: E402

from conftest import SyntheticBatches, tiny_bert  # noqa: E402
from tightfit.integrations import hf  # noqa: E402
from tightfit.plan import Plan  # noqa: E402


class _NoKwargs(torch.nn.Module):
    """A module of the user's own whose forward takes no ``**kwargs``: the Trainer hands it no
    ``num_items_in_batch`` (``model_accepts_loss_kwargs`` False) and divides its mean loss by the
    accumulation steps."""

    def __init__(self):
        super().__init__()
        self.inner = tiny_bert()

    def forward(self, input_ids, attention_mask, labels):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return {"loss": out.loss, "logits": out.logits}


class _OwnMeanLoss(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        return (out["loss"], out) if return_outputs else out["loss"]


def _rows(n):
    data = SyntheticBatches(n=n, seq_len=8)
    return [{k: v[0] for k, v in data.collate([i], pad_to=8).items()} for i in range(n)]


def test_a_mean_the_trainer_divides_by_the_steps_is_said_also_for_a_forward_without_kwargs(tmp_path, caplog):
    """14 samples, effective batch 8 at micro-batch 4: the last window is 4 + 2, which the Trainer
    takes as (mean of 4 + mean of 2) / 2, not the mean of its 6 samples. hf.train cannot weigh a loss
    it does not compute (your compute_loss) and warns so for a model whose loss
    ignores the count; a forward without **kwargs, which is given no count at all, was trained so
    without a word (the README: 'hf.train warns so')."""
    weights = {}
    for mb in (8, 4):
        plan = Plan("fp32", mb, 8, device="cpu")
        args = TrainingArguments(**hf.training_arguments(
            plan, output_dir=str(tmp_path / str(mb)), num_train_epochs=1, learning_rate=0.5, optim="sgd", report_to=[],
            save_strategy="no", max_grad_norm=0, lr_scheduler_type="constant", seed=0, disable_tqdm=True))
        t = _OwnMeanLoss(model=_NoKwargs(), args=args, train_dataset=_rows(14), callbacks=[hf.TightfitCallback(plan)])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tightfit"):
            hf.train(t)
        weights[mb] = torch.cat([p.detach().flatten() for p in t.model.parameters()])
        warned = "only where its micro-batches hold as many labelled items" in caplog.text
        assert warned == (mb == 4), caplog.text
    # what the warning is about: the short last window is not one batch of its samples
    assert not torch.allclose(weights[4], weights[8], rtol=0, atol=1e-4)


class _OwnSumLoss(Trainer):
    """The warning's advice: the sum over the micro-batch divided by the window's labelled items."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = out["loss"] * inputs["labels"].numel() / num_items_in_batch
        return (loss, out) if return_outputs else loss


def test_the_warnings_advice_trains_a_short_last_window_as_one_batch(tmp_path, caplog):
    """Following the advice (divide the sum by num_items_in_batch; model_accepts_loss_kwargs = True), the
    4 + 2 window at micro-batch 4 trains as the one batch of 6 at micro-batch 8, with no warning."""
    weights = {}
    for mb, trainer_class in ((8, _OwnMeanLoss), (4, _OwnSumLoss)):
        plan = Plan("fp32", mb, 8, device="cpu")
        args = TrainingArguments(**hf.training_arguments(
            plan, output_dir=str(tmp_path / str(mb)), num_train_epochs=1, learning_rate=0.5, optim="sgd", report_to=[],
            save_strategy="no", max_grad_norm=0, lr_scheduler_type="constant", seed=0, disable_tqdm=True))
        t = trainer_class(model=_NoKwargs(), args=args, train_dataset=_rows(14), callbacks=[hf.TightfitCallback(plan)])
        t.model_accepts_loss_kwargs = mb == 4  # the Trainer counts the window's items and takes the loss as scaled
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tightfit"):
            hf.train(t)
        weights[mb] = torch.cat([p.detach().flatten() for p in t.model.parameters()])
        assert "only where its micro-batches hold as many labelled items" not in caplog.text
    torch.testing.assert_close(weights[4], weights[8], rtol=0, atol=1e-5)
