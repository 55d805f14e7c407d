"""Input that used to be accepted without a word (or crash with a traceback): a model folder
without its tokenizer, a tokenizer that does not fit the model, a truncated weights file, a
--seq-len that leaves no room for text, too little data, too many classes, a tab-separated
.csv, huge CSV fields, --max-skipped-steps 0, fp16 on Pascal, and the advice after a blow-up."""

import random
import re
import shutil

import pytest
import torch

from tightfit import data as tdata
from tightfit.cli import main
from tightfit.data import held_out_split, load_text_classification
from tightfit.devices import get_profile
from tightfit.errors import TightfitError
from tightfit.levers import precision

WORDS = ("the a film movie plot actor scene great dull awful superb boring moving script music "
         "was is and of it this good bad").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _texts(n, seed=0, words=WORDS):
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(4, 12))) for _ in range(n)]


def _write_csv(path, texts, labels):
    path.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels)))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A small BERT folder with its WordPiece tokenizer, and a 60-row CSV in its vocabulary."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    root = tmp_path_factory.mktemp("tiny")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(SPECIALS + WORDS) + "\n")
    torch.manual_seed(0)
    model_dir = root / "model"
    BertForSequenceClassification(BertConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32,
                                             num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                             max_position_embeddings=64)).save_pretrained(model_dir)
    BertTokenizer(vocab=str(vocab)).save_pretrained(model_dir)
    data = _write_csv(root / "data.csv", _texts(60), ["pos", "neg"] * 30)
    return model_dir, data


def _copy_model(src, dst, keep_tokenizer=True):
    dst.mkdir()
    for f in src.iterdir():
        if keep_tokenizer or f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def _refused(capsys, tmp_path, args, match):
    """``tightfit train ARGS`` exits 2 with one error line matching ``match``, writing nothing."""
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--no-progress", "--max-steps", "1", "--eval-samples", "8",
                 "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tightfit: error:") and len(err.splitlines()) == 1, err
    assert re.search(match, err), err
    assert not out.exists()
    return err


# ---- fault 9: a model folder without a tokenizer; a tokenizer that does not fit the model

def test_tiny_model_with_tokenizer_passes_the_checks(tiny):
    from tightfit.models import check_tokenizer, load_classifier

    model_dir, data = tiny
    model, tok = load_classifier(model_dir, ["neg", "pos"])
    assert check_tokenizer(model, tok, model_dir, _texts(50), 32) == []


def test_model_folder_without_tokenizer_is_refused(tiny, tmp_path, capsys):
    model_dir, data = tiny
    bare = _copy_model(model_dir, tmp_path / "bare", keep_tokenizer=False)
    _refused(capsys, tmp_path, ["--model", str(bare), "--data", str(data)], "no tokenizer files")


def test_shipped_minilm_without_tokenizer_is_refused(tmp_path, capsys):
    from tightfit.models import default_model_path

    src, bare = default_model_path(), tmp_path / "minilm-bare"
    bare.mkdir()
    shutil.copy(src / "config.json", bare / "config.json")
    (bare / "model.safetensors").symlink_to(src / "model.safetensors")
    _refused(capsys, tmp_path, ["--model", str(bare), "--train-samples", "64"], "no tokenizer files")


def test_tokenizer_with_more_tokens_than_the_embedding_is_refused(tiny, tmp_path, capsys):
    from transformers import BertTokenizer

    model_dir, data = tiny
    other = _copy_model(model_dir, tmp_path / "other")
    big = tmp_path / "big-vocab.txt"
    big.write_text("\n".join(SPECIALS + WORDS + [f"w{i}" for i in range(40)]) + "\n")
    for f in other.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    BertTokenizer(vocab=str(big)).save_pretrained(other)
    _refused(capsys, tmp_path, ["--model", str(other), "--data", str(data)],
             r"tokenizer has 68 tokens.*embedding has 28 rows")


def test_special_token_outside_the_embedding_is_refused(tiny):
    from tightfit.models import check_tokenizer, load_classifier

    model_dir, _ = tiny
    model, tok = load_classifier(model_dir, ["neg", "pos"])

    class Shifted:  # the real tokenizer, but its [SEP] id past the embedding
        def __getattr__(self, name):
            return getattr(tok, name)

        def __len__(self):
            return len(tok)

        sep_token_id = 99

    with pytest.raises(TightfitError, match=r"sep token has id 99, outside the model's embedding of 28 rows"):
        check_tokenizer(model, Shifted(), model_dir, _texts(10), 32)


def test_data_the_tokenizer_cannot_read_is_refused_or_noted(tiny, tmp_path, capsys):
    model_dir, _ = tiny
    french = _write_csv(tmp_path / "fr.csv", _texts(40, words="le la un une chat chien maison".split()),
                        ["a", "b"] * 20)
    _refused(capsys, tmp_path, ["--model", str(model_dir), "--data", str(french)],
             r"100% of the tokens .* are \[UNK\]")
    from tightfit.models import check_tokenizer, load_classifier

    model, tok = load_classifier(model_dir, ["neg", "pos"])
    mixed = [t + " chat" for t in _texts(40)]  # about 1 unknown word in 9
    notes = check_tokenizer(model, tok, model_dir, mixed, 32)
    assert len(notes) == 1 and re.search(r"\d+% of the tokens .* are \[UNK\]", notes[0])


def _train_one_step(tmp_path, capsys, model_dir, data):
    out = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--no-progress", "--max-steps", "1", "--batch-size", "4",
                 "--seq-len", "16", "--model", str(model_dir), "--data", str(data), "--out", str(out)]) == 0
    assert (out / "summary.json").is_file()
    return capsys.readouterr().out


def test_a_fitting_tokenizer_trains(tiny, tmp_path, capsys):
    stdout = _train_one_step(tmp_path, capsys, *tiny)
    assert "note: accuracy on 6 held-out samples moves in steps of 16.7%" in stdout


def test_tokenizer_without_pad_token_borrows_eos(tmp_path, capsys, tiny):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "gpt"
    GPT2ForSequenceClassification(GPT2Config(vocab_size=len(vocab), n_embd=32, n_layer=1, n_head=2,
                                             n_positions=32)).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                            unk_token="<unk>").save_pretrained(folder)
    stdout = _train_one_step(tmp_path, capsys, folder, tiny[1])  # was: ValueError from GPT-2's forward
    assert "note: the tokenizer has no padding token; padding with its end-of-sequence token" in stdout
    from tightfit.models import check_tokenizer, load_classifier

    model, tok = load_classifier(folder, ["neg", "pos"])
    assert any("no padding token" in n for n in check_tokenizer(model, tok, folder, _texts(20), 16))
    assert tok.pad_token_id == model.config.pad_token_id == 0


# ---- fault 10: a truncated weights file; weights of another model

def test_truncated_safetensors_is_one_line(tiny, tmp_path, capsys):
    model_dir, data = tiny
    broken = _copy_model(model_dir, tmp_path / "broken")
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    _refused(capsys, tmp_path, ["--model", str(broken), "--data", str(data)],
             r"cannot load the model from .*broken.*: SafetensorError.*truncated or corrupt")


def test_weights_of_another_model_are_refused(tiny, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    model_dir, data = tiny
    other = _copy_model(model_dir, tmp_path / "renamed")
    weights = load_file(other / "model.safetensors")
    save_file({f"encoder_of_something_else.{k}": v for k, v in weights.items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    _refused(capsys, tmp_path, ["--model", str(other), "--data", str(data)],
             r"weights .* lack .* of this model's parameters")


# ---- fault 13: --seq-len, data size, classes, --max-skipped-steps, fp16 on Pascal, CSV

@pytest.mark.parametrize("seq_len, left", [("1", "0 tokens"), ("2", "0 tokens"), ("3", "1 token"), ("7", "5 tokens")])
def test_seq_len_without_room_for_text_is_refused(tiny, tmp_path, capsys, seq_len, left):
    model_dir, data = tiny
    _refused(capsys, tmp_path, ["--model", str(model_dir), "--data", str(data), "--seq-len", seq_len],
             rf"--seq-len {seq_len} leaves {left} of text .*2 special tokens.* at least 8")


def test_seq_len_8_is_accepted(tiny):
    from tightfit.models import check_tokenizer, load_classifier

    model_dir, _ = tiny
    model, tok = load_classifier(model_dir, ["neg", "pos"])
    assert check_tokenizer(model, tok, model_dir, _texts(10), 8) == []


def test_two_row_data_file_is_refused(tmp_path, capsys):
    data = _write_csv(tmp_path / "two.csv", ["good film", "bad film"], ["pos", "neg"])
    _refused(capsys, tmp_path, ["--data", str(data)], r"2 usable rows.*train on 1 and evaluate on 1.*at least 20")


def test_more_classes_than_half_the_rows_is_refused(tmp_path, capsys):
    data = _write_csv(tmp_path / "ids.csv", _texts(400), [f"id{i}" for i in range(300)] + ["x"] * 100)
    _refused(capsys, tmp_path, ["--data", str(data)], r"301 classes among 400 rows \(1\.3 per class\)")


def test_small_splits_and_missing_classes_are_noted():
    from tightfit.data import TextClassificationData

    labels = [i % 4 for i in range(40)]
    data = TextClassificationData(_texts(40), labels, ["a", "b", "c", "d"], "x")
    train_idx, eval_idx = held_out_split(len(data))
    assert tdata.check_split(data, data.subset(train_idx), data.subset(eval_idx)) == [
        "accuracy on 4 held-out samples moves in steps of 25% (more data for a finer measure)"]  # all 4 used
    only_a = [i for i in train_idx if labels[i] == 0][:3]
    notes = tdata.check_split(data, data.subset(only_a), data.subset(eval_idx))
    assert any("3 of 4 classes have no training sample" in n for n in notes)
    assert any("0.8 training samples per class" in n for n in notes)
    one_missing = [i for i in train_idx if labels[i] != 3]
    assert any("1 of 4 classes has no training sample: the model cannot learn it" in n
               for n in tdata.check_split(data, data.subset(one_missing), data.subset(eval_idx)))


def test_max_skipped_steps_zero_is_refused(tmp_path, capsys):
    _refused(capsys, tmp_path, ["--max-skipped-steps", "0"], "--max-skipped-steps must be >= 1")


def test_fp16_on_pascal_is_warned_with_its_rate():
    notes = precision.check_precision("fp16", get_profile("gtx-1080-ti"))
    assert len(notes) == 1 and "1/64" in notes[0] and "fp32" in notes[0]
    assert precision.check_precision("fp16", get_profile("rtx-2060")) == []   # tensor cores
    assert precision.check_precision("fp16", get_profile("gtx-1650-ti")) == []  # fp16 at the fp32 rate
    assert precision.check_precision("fp32", get_profile("gtx-1080-ti")) == []


@pytest.mark.parametrize("sep,hint", [("\t", r"looks tab-separated.*\.tsv"), (";", "looks semicolon-separated")])
def test_csv_with_another_delimiter_gets_a_hint(tmp_path, sep, hint):
    f = tmp_path / "d.csv"
    f.write_text(f"text{sep}label\ngood film{sep}pos\nbad film{sep}neg\n")
    with pytest.raises(TightfitError, match=r"no column 'text'.*" + hint):
        load_text_classification(f)


@pytest.mark.parametrize("sep,hint", [("\t", r"looks tab-separated.*\.tsv"), (";", "looks semicolon-separated")])
def test_csv_with_another_delimiter_and_commas_in_its_texts_gets_the_hint_too(tmp_path, sep, hint):
    """Texts with commas in them split into several fields: the error was about a record's field
    count, without the hint the README promises."""
    f = tmp_path / "d.csv"
    f.write_text(f"text{sep}label\ngood film{sep}pos\nbad, dull film{sep}neg\n")
    with pytest.raises(TightfitError, match=r"record 2 has 2 fields, the header has 1.*" + hint):
        load_text_classification(f)


def test_csv_fields_over_128_kib_load_truncated(tmp_path):
    long = "word " * 60_000  # 300,000 characters, over the csv module's default 131,072
    f = _write_csv(tmp_path / "long.csv", [long, "short text"], ["a", "b"])
    d = load_text_classification(f)
    assert len(d.texts[0]) == tdata.MAX_TEXT_CHARS and d.texts[1] == "short text"


def test_nonfinite_advice_depends_on_the_precision():
    ampere, turing = get_profile("rtx-3060"), get_profile("rtx-2060")
    assert "--precision bf16" in precision.nonfinite_advice("fp16", ampere)
    fp16_turing = precision.nonfinite_advice("fp16", turing)
    assert "bf16" not in fp16_turing and "--precision fp32" in fp16_turing and "--lr" in fp16_turing
    assert "--precision fp32" in precision.nonfinite_advice("bf16", ampere)
    fp32 = precision.nonfinite_advice("fp32", ampere, lr=1e-3)
    assert "--precision" not in fp32 and "--lr 1e-04" in fp32 and "labels" in fp32
    # a tenth of a rate far beyond any that trains would take many failed runs: at most 1e-3
    assert "--lr 1e-03" in precision.nonfinite_advice("fp32", ampere, lr=1e308)


@pytest.mark.parametrize("argv,message", [
    (["--warn-temp", "nan"], "--warn-temp must be a GPU temperature"),
    (["--cooldown-temp", "-5"], "--cooldown-temp must be a GPU temperature"),
])
def test_temperatures_must_be_temperatures(argv, message, tmp_path, capsys):
    from tightfit.cli import main
    assert main(["train", *argv, "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_folder_given_as_data_is_named_a_folder(tmp_path, capsys):
    from tightfit.cli import main
    assert main(["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_a_model_without_logits_is_named_in_one_line():
    """A plain nn.Module returning a tensor failed with AttributeError: 'Tensor' object has no attribute 'logits'."""
    import torch

    from tightfit.errors import TightfitError
    from tightfit.tasks import ImageClassification

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, pixel_values):
            return self.fc(pixel_values)

    batch = {"pixel_values": torch.ones(3, 4), "labels": torch.zeros(3, dtype=torch.long)}
    with pytest.raises(TightfitError, match=r"returned Tensor, not an output with \.logits"):
        ImageClassification().loss_sum(Plain(), batch)


def test_a_run_folder_that_cannot_be_created_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """Under /proc the folder check passes for root but mkdir fails: it was a FileNotFoundError traceback."""
    import pathlib

    real = pathlib.Path.mkdir

    def refuse(self, *a, **k):
        if self.name == "run":
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
    _refused(capsys, tmp_path, ["--model", str(tiny[0]), "--data", str(tiny[1])], "cannot create the run folder")


@pytest.mark.parametrize("args,match", [
    (["--image-size", "64"], r"--image-size does not apply: .* is a text model"),
    (["--model", "resnet50", "--data", "digits", "--seq-len", "32", "--text-column", "t"],
     r"--seq-len and --text-column do not apply: resnet50 is an image model"),
])
def test_options_of_the_other_kind_of_model_are_refused(args, match, tmp_path, capsys):
    """`tightfit plan` refused them; `tightfit train` ignored them silently."""
    _refused(capsys, tmp_path, args, match)


def test_an_unknown_card_is_refused_when_the_request_is_made():
    """TrainRequest(gpu="gtx1080") was accepted and refused only inside train()."""
    from tightfit.config import TrainRequest

    with pytest.raises(TightfitError, match=r"^gpu names no known card: unknown GPU profile 'gtx1080'; known: .*gtx-1080-ti"):
        TrainRequest(gpu="gtx1080")
    assert TrainRequest(gpu="GTX 1080 Ti").planning.gpu == "GTX 1080 Ti"  # as get_profile reads it
