"""The padding mask handed to encoders in 4-D (tightfit.masks): the same logits as the 2-D mask,
with no host check of the mask in the forward; causal and non-SDPA models keep the 2-D mask."""

import pytest
import torch

from tightfit.masks import model_inputs, takes_prepared_mask
from tightfit.tasks import SequenceClassification

from conftest import SyntheticBatches, tiny_bert, tiny_gpt2


def _encoder(kind: str, attn: str = "sdpa"):
    import transformers as tr
    torch.manual_seed(0)
    small = dict(vocab_size=50, max_position_embeddings=40, num_labels=2)
    if kind == "bert":
        return tiny_bert()
    if kind == "roberta":
        cfg = tr.RobertaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                               pad_token_id=1, **small)
        model = tr.RobertaForSequenceClassification(cfg)
    else:
        cfg = tr.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64, **small)
        model = tr.DistilBertForSequenceClassification(cfg)
    model.config._attn_implementation = attn
    return model


def _padded_batch():
    b = SyntheticBatches(8, seq_len=12).collate(range(8))
    assert (b["attention_mask"] == 0).any() and (b["attention_mask"] == 1).all(dim=1).any()  # padded and not
    return b


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_the_4d_mask_gives_the_logits_of_the_2d_mask(kind):
    model = _encoder(kind).eval()
    batch = _padded_batch()
    inputs = model_inputs(model, batch)
    assert inputs["attention_mask"].shape == (8, 1, 12, 12) and inputs["attention_mask"].dtype == torch.bool
    assert "labels" not in inputs and batch["attention_mask"].dim() == 2  # the batch is left as it was
    with torch.no_grad():
        ours = model(**inputs).logits
        theirs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        unmasked = model(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-8)
    assert (ours - unmasked).abs().max() > 1e-6  # the mask matters in this batch (logits ~1e-2)


def test_the_forward_asks_nothing_of_the_mask_on_the_host(monkeypatch):
    """The host check is transformers' ``_ignore_bidirectional_mask_sdpa``; with the 4-D mask it is
    never reached (on a GPU it is a device-to-host read)."""
    import transformers.masking_utils as mu

    def host_check(padding_mask, *args, **kwargs):
        if padding_mask is not None:
            raise AssertionError("the padding mask was read on the host")
        return True

    monkeypatch.setattr(mu, "_ignore_bidirectional_mask_sdpa", host_check)
    model, batch = tiny_bert().eval(), _padded_batch()
    with torch.no_grad():
        model(**model_inputs(model, batch))
        SequenceClassification().loss_sum(model, batch)
        with pytest.raises(AssertionError, match="read on the host"):  # the check is the live one
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def test_causal_eager_and_decoder_models_keep_the_2d_mask():
    bert_decoder = tiny_bert()
    bert_decoder.config.is_decoder = True
    for model in (tiny_gpt2(), _encoder("distilbert", attn="eager"), bert_decoder):
        assert not takes_prepared_mask(model)
        batch = _padded_batch()
        assert model_inputs(model, batch)["attention_mask"] is batch["attention_mask"]
    assert takes_prepared_mask(tiny_bert())


@pytest.mark.gpu
def test_a_padded_training_step_does_not_sync_on_the_gpu():
    model = tiny_bert(dropout=0.1).cuda().train()
    batch = {k: v.cuda() for k, v in _padded_batch().items()}
    task = SequenceClassification()
    task.loss_sum(model, batch).backward()  # warm up (lazy inits may sync once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        task.loss_sum(model, batch).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_own_loop_and_the_estimator_hand_the_mask_over_in_4d(monkeypatch):
    """The own-loop step's default loss (the model's own ``.loss``) and the estimator's loss call
    the model with the 4-D mask too (same check as above)."""
    import transformers.masking_utils as mu

    import tightfit
    from tightfit.plan import Plan
    from tightfit.step import training_loss

    def host_check(padding_mask, *args, **kwargs):
        if padding_mask is not None:
            raise AssertionError("the padding mask was read on the host")
        return True

    monkeypatch.setattr(mu, "_ignore_bidirectional_mask_sdpa", host_check)
    model, batch = tiny_bert(), _padded_batch()
    step = tightfit.TrainStep(Plan("fp32", 4, 8), model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert step(batch).stepped
    training_loss(model, batch)


def test_the_choice_follows_the_model_as_it_is_now():
    """The attention implementation or the decoder flag changed after a first call: the next call
    hands the 2-D mask (eager attention adds the mask to the scores: a boolean one would add 0/1)."""
    model, batch = tiny_bert().eval(), _padded_batch()
    assert model_inputs(model, batch)["attention_mask"].dim() == 4
    model.set_attn_implementation("eager")
    assert model_inputs(model, batch)["attention_mask"].dim() == 2
    with torch.no_grad():
        eager = model(**model_inputs(model, batch)).logits
        model.set_attn_implementation("sdpa")
        sdpa = model(**model_inputs(model, batch)).logits
    torch.testing.assert_close(eager, sdpa, rtol=0, atol=1e-6)
    model.config.is_decoder = True
    assert model_inputs(model, batch)["attention_mask"].dim() == 2


class _MeanPooled(torch.nn.Module):
    """A user's own module around an encoder that uses the mask itself (mean pooling)."""

    def __init__(self):
        super().__init__()
        self.bert = tiny_bert().bert
        self.head = torch.nn.Linear(32, 2)

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask[..., None].float()
        return self.head((h * m).sum(1) / m.sum(1))


def test_only_the_encoder_itself_or_a_pass_through_wrapper_gets_the_4d_mask():
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    batch = _padded_batch()
    own = _MeanPooled()
    assert model_inputs(own, batch)["attention_mask"].dim() == 2
    own(**model_inputs(own, batch))  # runs (a 4-D mask broke its pooling)
    lora = get_peft_model(tiny_bert(), LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["query", "value"]))
    assert model_inputs(lora, batch)["attention_mask"].dim() == 4
    prompt = get_peft_model(tiny_bert(), PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=2))
    assert model_inputs(prompt, batch)["attention_mask"].dim() == 2
    prompt(**model_inputs(prompt, batch))  # peft joins its prompt positions to the 2-D mask
    compiled = torch.compile(tiny_bert(), backend="eager")
    assert model_inputs(compiled, batch)["attention_mask"].dim() == 4
