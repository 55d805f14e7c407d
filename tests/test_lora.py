"""LoRA through peft (``--trainable lora``): adapters on the blocks' linear layers per architecture,
the head trainable, everything else frozen and bit-identical; the estimator holds no gradient or
optimizer state for frozen weights; the saved model is the merged plain model."""

import re

import pytest
import torch

from conftest import SyntheticBatches, tiny_bert
from tightfit.memory.estimate import estimate
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload

pytest.importorskip("peft")
from tightfit.levers.lora import apply_lora, lora_targets, merged  # noqa: E402
from tightfit.levers.trainable import trainable_count  # noqa: E402


def tiny_gpt2_classifier():
    from transformers import GPT2Config, GPT2ForSequenceClassification
    torch.manual_seed(0)
    return GPT2ForSequenceClassification(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                    num_labels=2, pad_token_id=0))


@pytest.mark.parametrize("make, suffixes", [
    (lambda: tiny_bert(), {"query", "key", "value", "dense"}),
    (tiny_gpt2_classifier, {"c_attn", "c_proj", "c_fc"}),
])
def test_targets_are_the_linear_layers_of_every_block(make, suffixes):
    names = lora_targets(make())
    assert {n.rsplit(".", 1)[-1] for n in names} == suffixes
    assert {re.search(r"\.(\d+)\.", n).group(1) for n in names} == {"0", "1"}  # both blocks


def test_lora_trains_adapters_and_head_and_leaves_the_rest_bit_identical():
    model = apply_lora(tiny_bert(dropout=0.1))
    n, total = trainable_count(model)
    assert 0 < n < total / 3  # rank 8 on width 32: large for a tiny model
    frozen = {k: p.detach().clone() for k, p in model.named_parameters() if not p.requires_grad}
    trained = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    assert any("classifier" in k for k in trained) and all("lora_" in k or "classifier" in k for k in trained)
    w = Workload(model, SyntheticBatches(16), SyntheticBatches(8, seed=1), 8)
    t = Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-2), progress=False)
    t.fit()
    assert len(t.optimizer.state) == len(trained)  # no optimizer state for frozen weights
    for k, p in model.named_parameters():
        if k in frozen:
            assert torch.equal(p, frozen[k]), k
    assert any(not torch.equal(p, trained[k]) for k, p in model.named_parameters() if "lora_B" in k)


@pytest.mark.parametrize("make, new_layer", [
    (lambda: __import__("transformers").DistilBertForSequenceClassification(__import__("transformers").DistilBertConfig(
        vocab_size=50, dim=32, n_layers=2, n_heads=2, hidden_dim=64)), "pre_classifier"),
    (lambda: __import__("transformers").DebertaV2ForSequenceClassification(__import__("transformers").DebertaV2Config(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)), "pooler"),
])
def test_the_layers_made_new_beside_the_classifier_train_with_it(make, new_layer):
    """DistilBERT's ``pre_classifier`` and DeBERTa's ``pooler`` are made new with the classifier
    (a pretrained base checkpoint has neither): under LoRA they stayed frozen at their random
    initialisation, every prediction going through a fixed random layer; the advice's count of
    what LoRA trains agrees with what trains."""
    from tightfit.planner.advice import _lora_parameters

    adapters, head = _lora_parameters(make())
    model = apply_lora(make())
    trained = {k for k, p in model.named_parameters() if p.requires_grad and "lora_" not in k}
    assert any(f".{new_layer}." in k for k in trained) and any(".classifier." in k for k in trained), trained
    assert all(".classifier." in k or f".{new_layer}." in k for k in trained), trained  # the base stays frozen
    assert trainable_count(model)[0] == adapters + head


def test_a_berts_pretrained_pooler_stays_frozen_under_lora():
    model = apply_lora(tiny_bert())
    assert {k for k, p in model.named_parameters() if p.requires_grad and "lora_" not in k} == \
        {"base_model.model.classifier.weight", "base_model.model.classifier.bias"}


def test_the_estimator_holds_state_and_gradients_only_for_lora_parameters():
    model = apply_lora(tiny_bert())
    n, total = trainable_count(model)
    batch = SyntheticBatches(8).worst_case(2)
    lora = estimate(model, batch, Plan("fp32", 2, 2))
    full = estimate(tiny_bert(), batch, Plan("fp32", 2, 2))
    assert lora.breakdown["optimizer_state"] < full.breakdown["optimizer_state"] / 2
    assert lora.breakdown["optimizer_state"] <= 8 * n + 512 * 3 * len([p for p in model.parameters() if p.requires_grad])


def test_the_saved_model_is_the_plain_model_with_the_adapters_merged(tmp_path):
    from transformers import BertForSequenceClassification

    model = apply_lora(tiny_bert())
    for k, p in model.named_parameters():
        if "lora_B" in k:
            torch.nn.init.normal_(p)  # a trained adapter (B starts at zero)
    model.eval()
    batch = {k: v for k, v in SyntheticBatches(8).worst_case(3).items() if k != "labels"}
    want = model(**batch).logits
    merged(model).save_pretrained(tmp_path)
    loaded = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(**batch).logits, want, rtol=1e-4, atol=1e-5)
    assert any(k.endswith("lora_B.default.weight") for k, _ in model.named_parameters())  # the copy was merged


def test_wrapping_prints_no_deprecation_warning_of_the_libraries():
    """peft reads ``is_gradient_checkpointing``, which transformers 5 deprecates: `tightfit plan
    --trainable lora` printed that FutureWarning to the user; tightfit asked the peft wrapper for it
    too (the new name is on the wrapped model's class, not the wrapper's)."""
    import warnings

    from tightfit.levers.checkpointing import hf_hook_active

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not hf_hook_active(apply_lora(tiny_bert()))  # the trainer asks this of the peft wrapper
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]


def test_checkpointing_a_wrapped_model_prints_no_deprecation_warning():
    """`tightfit train --trainable lora --checkpointing on` printed transformers 5's FutureWarning
    that ``gradient_checkpointing_enable`` is deprecated: the new name was looked up on the peft
    wrapper's class, which forwards both names to the model it wraps, so the old one was called."""
    import warnings

    from tightfit.levers.checkpointing import hf_hook_active, set_activation_checkpointing

    model = apply_lora(tiny_bert())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_activation_checkpointing(model, True)
        assert hf_hook_active(model)
        set_activation_checkpointing(model, False)
        assert not hf_hook_active(model)
    assert not [w for w in caught if "deprecated" in str(w.message)], [str(w.message) for w in caught]


def test_plan_json_says_what_the_plan_trains(tmp_path, capsys):
    """`tightfit plan --trainable lora --json` wrote ``"trainable": "all"`` and no parameter count
    while its text said LoRA: the plan carries what is trained (the search's result fills it)."""
    import json

    from conftest import tiny_text_model_folder
    from tightfit.cli import main

    model = tiny_text_model_folder(tmp_path, ["good", "bad", "film"], hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    argv = ["plan", "--model", str(model), "--seq-len", "16", "--batch-size", "4", "--budget", "1GiB", "--json"]
    assert main(argv + ["--trainable", "lora"]) == 0
    out = capsys.readouterr()
    said, total = (int(n.replace(",", "")) for n in re.search(r"--trainable lora: ([\d,]+) of ([\d,]+) ", out.err).groups())
    plan = json.loads(out.out)["plan"]
    assert plan["trainable"] == "lora" and plan["trainable_params"] == said, plan
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["trainable"] == "all" and said < plan["trainable_params"] < total, plan  # total: with the adapters


def test_a_lora_model_merged_from_gathered_weights_keeps_their_bf16_dtype():
    """Under FSDP2 the saved model is rebuilt from the gathered state (levers/lora.py's
    merged_from_state); built from the config it was fp32, so a bf16-weights run saved fp32
    weights under FSDP2 and bf16 in one process."""
    from tightfit.levers.lora import merged_from_state

    lora = apply_lora(tiny_bert(seed=0)).to(torch.bfloat16)
    out = merged_from_state(lora, {k: v.clone() for k, v in lora.state_dict().items()})
    assert {p.dtype for p in out.parameters()} == {torch.bfloat16}
    for a, b in zip(out.state_dict().values(), merged(lora).state_dict().values()):
        assert torch.equal(a, b)


def test_lora_keeps_the_running_statistics_of_the_frozen_input_layers():
    """The input layers (a stem before the first block) get no adapter under LoRA: frozen as under
    frozen-embeddings, their BatchNorm layers keep their running statistics, so the frozen stem of
    the saved (merged) model computes the function it had. Before: every training forward moved
    them (a LeViT's patch embeddings: conv + BatchNorm)."""
    import torch.nn.functional as F
    from transformers import LevitConfig, LevitForImageClassification

    from tightfit import TrainStep

    torch.manual_seed(0)
    config = LevitConfig(image_size=32, num_channels=3, hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                         depths=[1, 1], key_dim=[8, 8], patch_size=16, stride=2,
                         down_ops=[["Subsample", 8, 2, 4, 2, 2]], num_labels=3)
    model = apply_lora(LevitForImageClassification(config).eval())  # as from_pretrained returns it
    stem = {n: b.clone() for n, b in model.named_buffers() if "patch_embeddings" in n}
    assert stem
    step = TrainStep(Plan("fp32", 4, 4, trainable="lora"), model, lr=1e-3,
                     loss=lambda m, b: F.cross_entropy(m(pixel_values=b["x"]).logits, b["y"]))
    for _ in range(2):
        step({"x": torch.randn(4, 3, 32, 32), "y": torch.randint(0, 3, (4,))})
    buffers = dict(model.named_buffers())
    for n, b in stem.items():
        assert torch.equal(buffers[n], b), n
    assert model.get_base_model().levit.encoder.training  # the rest trains (dropout on)


def test_the_headline_counts_the_models_parameters_not_the_adapters(tmp_path, capsys):
    """``tightfit train --trainable lora`` names the model with its own parameter count, as a run
    training all of it does; the adapters are counted in the LoRA note. Before: the headline
    counted the adapters into the model (the tiny BERT's 20,770 parameters shown as 27,938;
    MiniLM's 22.7M as 23.0M)."""
    from conftest import tiny_cpu_job
    from tightfit.cli import main

    j = tiny_cpu_job(tmp_path)
    args = ["train", "--model", j["model"], "--data", j["data"], "--batch-size", "8", "--seq-len", "16",
            "--device", "cpu", "--no-progress", "--max-steps", "1", "--trainable", "lora"]
    assert main(args + ["--out", str(tmp_path / "lora")]) == 0
    lora = capsys.readouterr().out
    assert main(args[:-2] + ["--out", str(tmp_path / "all")]) == 0
    everything = capsys.readouterr().out
    headline = re.compile(r"fine-tuning \S+ \(([0-9,.]+M?) parameters\)")
    assert headline.search(lora).group(1) == headline.search(everything).group(1) == "20,770"
    assert "7,234 of 27,938 parameters trainable" in lora


def test_the_headline_names_a_model_folder_as_given(tmp_path, capsys):
    """A run's model folder is named `model` in every run: the headline said "fine-tuning model
    (...)"; it names the folder as given."""
    from conftest import tiny_cpu_job
    from tightfit.cli import main

    j = tiny_cpu_job(tmp_path)
    assert main(["train", "--model", j["model"], "--data", j["data"], "--batch-size", "8", "--seq-len", "16",
                 "--device", "cpu", "--no-progress", "--max-steps", "1", "--out", str(tmp_path / "r")]) == 0
    assert f"fine-tuning {j['model']} (" in capsys.readouterr().out
