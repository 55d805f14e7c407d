"""Faults a review found bringing one's own Hugging Face models and modules to estimate, plan, train
and the Python API: XLNet's ``max_position_embeddings`` of -1 (no limit) was read as a limit of -1
positions, refusing every --seq-len; a list of layers nested in a list (a small Funnel Transformer's
blocks of one layer) was taken for the blocks, whose forward is never called, so that checkpointing
them saved nothing while the estimate said "checkpointing all 2 blocks"; an encoder-decoder's encoder
layers (BART: another class than its decoder's) were not blocks but "input layers", frozen whole by
--trainable frozen-embeddings and never checkpointed; a forward with an operation that has no meta
kernel (BART's and T5's classifiers) was refused with torch's message about torch.compile and custom ops."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tightfit.cli import main  # noqa: E402
from tightfit.levers.blocks import find_blocks  # noqa: E402


def _save(path, model):
    transformers.logging.set_verbosity_error()
    model.save_pretrained(path)
    return str(path)


def _xlnet(path):
    torch.manual_seed(0)
    config = transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, d_inner=64, pad_token_id=0)
    assert config.max_position_embeddings == -1  # XLNet's own: relative positions, any length
    return _save(path, transformers.XLNetForSequenceClassification(config))


def _bart_config():
    return transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2,
                                   encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                   decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=2,
                                   eos_token_id=3, decoder_start_token_id=3)


def test_a_model_without_a_position_limit_takes_any_sequence_length(tmp_path, capsys):
    folder = _xlnet(tmp_path / "xlnet")
    capsys.readouterr()
    code = main(["estimate", "--model", folder, "--seq-len", "16", "--micro-batch", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err  # was: "sequence length 16 exceeds the model's -1 positions"
    assert json.loads(out)["peak_reserved_bytes"] > 0


def test_train_checks_the_sequence_length_of_a_model_without_a_position_limit_as_none(tmp_path):
    from transformers import BertTokenizerFast

    from tightfit.models import _check_seq_len

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good"]) + "\n")
    tokenizer = BertTokenizerFast(vocab=str(tmp_path / "vocab.txt"))
    model = transformers.XLNetForSequenceClassification.from_pretrained(_xlnet(tmp_path / "xlnet"))
    _check_seq_len(model, tokenizer, 16)  # was: "--seq-len 16 exceeds the model's -1 positions: give --seq-len -1"


def test_a_list_nested_in_a_list_is_not_a_block_its_layers_are():
    torch.manual_seed(0)
    config = transformers.FunnelConfig(vocab_size=64, d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[1, 1])
    model = transformers.FunnelForSequenceClassification(config)
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["FunnelLayer", "FunnelLayer"]  # was: the two inner ModuleLists


def test_checkpointing_a_funnel_saves_memory(tmp_path):
    from tightfit.memory.estimate import estimate
    from tightfit.models import build_model
    from tightfit.plan import Plan

    torch.manual_seed(0)
    config = transformers.FunnelConfig(vocab_size=64, d_model=32, n_head=2, d_head=16, d_inner=64, block_sizes=[1, 1])
    folder = _save(tmp_path / "funnel", transformers.FunnelForSequenceClassification(config))
    model, make_batch = build_model(folder)
    batch = make_batch(1, 64)
    plan = Plan("fp32", 64, 64, device="cuda")
    none = estimate(model, batch, plan, checkpoint_blocks="none").peak_allocated_bytes
    every = estimate(model, batch, plan, checkpoint_blocks="all").peak_allocated_bytes
    assert every < none  # was: the same bytes (the wrapped lists' forward never runs)


def test_an_encoder_decoders_encoder_layers_are_blocks_too():
    torch.manual_seed(0)
    model = transformers.BartForSequenceClassification(_bart_config())
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(b)] for b in find_blocks(model)] == [
        "model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0", "model.decoder.layers.1"]
    # nn.Transformer too: its encoder's and decoder's layers, in the order they run
    t = torch.nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32,
                             batch_first=True)
    assert [type(b).__name__ for b in find_blocks(t)] == ["TransformerEncoderLayer"] * 2 + ["TransformerDecoderLayer"] * 2


def test_frozen_embeddings_of_an_encoder_decoder_freezes_its_embeddings_not_its_encoder():
    from tightfit.levers.trainable import apply_trainable

    torch.manual_seed(0)
    model = transformers.BartForSequenceClassification(_bart_config())
    apply_trainable(model, "frozen-embeddings")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "model.shared.weight" in frozen and "model.encoder.embed_positions.weight" in frozen
    assert not any(".encoder.layers." in n for n in frozen), sorted(frozen)  # was: the whole encoder frozen


def test_a_model_with_a_value_dependent_operation_is_refused_in_words_of_its_own(tmp_path, capsys):
    torch.manual_seed(0)
    folder = _save(tmp_path / "bart", transformers.BartForSequenceClassification(_bart_config()))
    capsys.readouterr()
    code = main(["estimate", "--model", folder, "--seq-len", "16", "--micro-batch", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert "aten::unique_consecutive" in err and "values of its input" in err, err
    assert "PT2" not in err and "fake impl" not in err, err  # was: torch's advice on custom ops for torch.compile


def test_a_boolean_mask_on_meta_tensors_is_refused_as_value_dependent_too():
    """A boolean mask's indexing runs nonzero, whose meta kernel raises another message than
    unique_consecutive's ("The register_meta function for torch.nonzero() raises unimplemented ..."):
    it reached the user raw."""
    from tightfit.models import trace_failure

    x, mask = torch.ones(3, 4, device="meta"), torch.ones(3, dtype=torch.bool, device="meta")
    try:
        x[mask]
    except RuntimeError as e:
        said = str(trace_failure("mine", 16, e))
    else:
        pytest.skip("this torch indexes a boolean mask on meta tensors")
    assert "its forward calls torch.nonzero, whose result depends on the values of its input" in said, said
