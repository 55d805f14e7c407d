"""Pluggable workloads and the one model registry: a causal-LM workload trains and evaluates
(perplexity), image classification with tiny ViT/ResNet configs, plain map-style datasets
(``TensorDataset``, dict samples) with a collate function, and ``--model`` naming the same
architecture for ``train`` as for ``estimate``/``plan``."""

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import LMBatches, SyntheticBatches, tiny_bert, tiny_gpt2
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer


# ---------------------------------------------------------------- causal LM
def test_causal_lm_workload_trains_and_evaluates_with_perplexity():
    from tightfit.workload import Workload, causal_lm_loss_sum, count_target_tokens

    held_out = LMBatches(n=10, seq_len=16, seed=1)
    w = Workload(tiny_gpt2(), LMBatches(n=24, seq_len=16), held_out, 8,
                 loss_sum=causal_lm_loss_sum, count=count_target_tokens)
    t = Trainer(w, Plan("fp32", 3, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)
    r = t.fit().eval  # evaluation batch 6: two batches, 6 + 4 samples of different lengths
    model = t.model.eval()
    with torch.no_grad():  # the token-level mean over every non-padding target, in one batch
        b = held_out.collate(list(range(10)))
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
        ref = F.cross_entropy(logits.reshape(-1, 50), b["labels"][:, 1:].reshape(-1), ignore_index=-100)
    assert r["tokens"] == int((b["labels"][:, 1:] != -100).sum()) and r["samples"] == 10
    assert r["loss"] == pytest.approx(ref.item(), rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(ref.item()), rel=1e-5)
    assert r["eval_batch"] == 6 and "accuracy" not in r
    from tightfit.tasks import CausalLM

    assert w.task == CausalLM()  # the task behind the causal-LM loss; on its own, in one batch:
    assert CausalLM().evaluate(model, [b])["perplexity"] == pytest.approx(r["perplexity"], rel=1e-5)


def test_causal_lm_evaluation_halves_its_batch_on_oom_and_counts_every_token_once():
    from tightfit.workload import Workload, causal_lm_loss_sum, count_target_tokens

    w = Workload(tiny_gpt2(), LMBatches(n=8, seq_len=16), LMBatches(n=8, seq_len=16, seed=1), 4,
                 loss_sum=causal_lm_loss_sum, count=count_target_tokens)
    t = Trainer(w, Plan("fp32", 4, 4), TrainConfig(), progress=False)
    ref = t.evaluate()

    def hook(module, args):
        if args[0].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    h = w.model.transformer.wte.register_forward_pre_hook(hook)
    r = t.evaluate()
    h.remove()
    assert r["eval_batch"] == 2 and r["tokens"] == ref["tokens"]
    assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6) and r["perplexity"] == pytest.approx(ref["perplexity"])


# ---------------------------------------------------------------- plain datasets, images
def _image_model(arch):
    from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    if arch == "vit":
        return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                                   num_attention_heads=2, intermediate_size=64, num_labels=3))
    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                     layer_type="basic", num_labels=3))


@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_image_classification_on_a_tensor_dataset(arch):
    from torch.utils.data import TensorDataset

    from tightfit.tasks import ImageClassification
    from tightfit.workload import Workload, collate_as

    g = torch.Generator().manual_seed(0)
    images, labels = torch.randn(20, 3, 16, 16, generator=g), torch.randint(0, 3, (20,), generator=g)
    train, held_out = TensorDataset(images[:12], labels[:12]), TensorDataset(images[12:], labels[12:])
    w = Workload(_image_model(arch), train, held_out, 4, task=ImageClassification(),
                 collate_fn=collate_as("pixel_values", "labels"))
    assert w.train.worst_case(3)["pixel_values"].shape == (3, 3, 16, 16)
    t = Trainer(w, Plan("fp32", 2, 4), TrainConfig(epochs=1, lr=1e-3), progress=False)
    r = t.fit().eval
    with torch.no_grad():
        logits = t.model.eval()(pixel_values=images[12:]).logits
    assert set(r) == {"accuracy", "loss", "samples", "eval_batch"} and r["samples"] == 8
    assert r["accuracy"] == pytest.approx((logits.argmax(-1) == labels[12:]).float().mean().item())
    assert r["loss"] == pytest.approx(F.cross_entropy(logits, labels[12:]).item(), rel=1e-5)


class DictSamples(torch.utils.data.Dataset):
    """A plain map-style dataset: fixed-length dict samples, collated by torch's default collate."""

    def __init__(self, source):
        self.batch = source.collate(list(range(len(source))), pad_to=source.seq_len)

    def __len__(self):
        return len(self.batch["labels"])

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def _train_weights(w):
    t = Trainer(w, Plan("fp32", 3, 8), TrainConfig(epochs=2, lr=1e-3), progress=False)
    result = t.fit()
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}, result.eval


@pytest.mark.parametrize("form", ["dict", "tensor"])
def test_a_plain_dataset_trains_like_the_same_samples_collated_by_index(form):
    """A ``torch.utils.data.Dataset`` (dict samples, default collate) or a ``TensorDataset``
    (tuple samples, ``collate_as``) gives the same weights and evaluation as the same samples
    behind a ``collate(indices)`` object."""
    from torch.utils.data import TensorDataset

    from tightfit.workload import Workload

    class Padded(SyntheticBatches):  # every sample at the full length, as the plain datasets hold them
        def collate(self, indices, pad_to=None):
            return super().collate(indices, pad_to=self.seq_len)

    ref_w, ref_eval = _train_weights(Workload(tiny_bert(), Padded(20), Padded(6, seed=1), 8))
    train, held_out = DictSamples(SyntheticBatches(20)), DictSamples(SyntheticBatches(6, seed=1))
    if form == "dict":
        w = Workload(tiny_bert(), train, held_out, 8)
    else:
        from tightfit.workload import collate_as

        keys = ("input_ids", "attention_mask", "labels")
        w = Workload(tiny_bert(), TensorDataset(*(train.batch[k] for k in keys)),
                     TensorDataset(*(held_out.batch[k] for k in keys)), 8, collate_fn=collate_as(*keys))
    got_w, got_eval = _train_weights(w)
    for n in ref_w:
        torch.testing.assert_close(got_w[n], ref_w[n], rtol=0, atol=0, msg=n)
    assert got_eval == ref_eval


def test_worst_case_of_a_padded_dataset_is_its_longest_sample_n_times():
    from tightfit.workload import DatasetBatches

    samples = [{"input_ids": list(range(1, n + 1)), "labels": n % 2} for n in (3, 9, 5, 2)]

    def pad(batch):
        T = max(len(s["input_ids"]) for s in batch)
        ids = torch.tensor([s["input_ids"] + [0] * (T - len(s["input_ids"])) for s in batch])
        return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.tensor([s["labels"] for s in batch])}

    d = DatasetBatches(samples, pad)
    assert d.collate([0, 3])["input_ids"].shape == (2, 3)
    worst = d.worst_case(4)
    assert worst["input_ids"].shape == (4, 9) and bool(worst["attention_mask"].all())


def test_a_collate_that_gives_no_dict_is_refused_in_one_line():
    from torch.utils.data import TensorDataset

    from tightfit.errors import TightfitError
    from tightfit.workload import Workload

    with pytest.raises(TightfitError, match=r"dict of tensors .*got list.*collate_as"):
        Workload(tiny_bert(), TensorDataset(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, dtype=torch.long)),
                 None, 2)


# ---------------------------------------------------------------- one registry
def _shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["minilm", "bert-base"])
def test_one_registry_resolves_the_same_model_for_train_and_estimate(name):
    """``--model NAME`` in ``train`` loads the architecture that ``estimate``/``plan`` build
    (same classes, parameter names and shapes), with a tokenizer that fits it."""
    from tightfit.models import build_model
    from tightfit.models import check_tokenizer, resolve_for_training

    estimated, make_batch = build_model(name)  # what tightfit estimate/plan trace (meta device)
    source = resolve_for_training(name)
    trained, tokenizer = source.load_classifier(["fresh", "rotten"])
    assert type(trained) is type(estimated) and _shapes(trained) == _shapes(estimated)
    assert len(tokenizer) == trained.config.vocab_size == 30522
    assert check_tokenizer(trained, tokenizer, source.tokenizer_path(), ["a fine film"] * 4, 64) == []
    assert make_batch.kind == "text" and (source.training_notes() == []) == (name == "minilm")


def test_a_local_folder_is_the_same_architecture_in_every_command(tmp_path):
    from transformers import BertTokenizer

    from tightfit.models import build_model
    from tightfit.models import resolve_for_training

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad"]))
    tiny_bert().save_pretrained(tmp_path / "m")
    BertTokenizer(vocab=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path / "m")
    estimated, _ = build_model(str(tmp_path / "m"))
    trained, _ = resolve_for_training(str(tmp_path / "m")).load_classifier(["a", "b"])
    assert _shapes(trained) == _shapes(estimated)


@pytest.mark.parametrize("name,match", [("gpt2", "no GPT-2 tokenizer"), ("vit-b16", "vit-b16 is an image model"),
                                        ("resnet50", "resnet50 is an image model")])
def test_train_refuses_registry_names_it_cannot_read_text_with(name, match, tmp_path, capsys):
    from tightfit.cli import main

    assert main(["train", "--model", name, "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tightfit: error:") and len(err.splitlines()) == 1 and match in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_bert_base_from_the_registry(tmp_path, capsys):
    """``tightfit train --model bert-base``: random BERT-base weights, the shipped MiniLM's tokenizer."""
    import json

    from tightfit.cli import main

    out = tmp_path / "run"
    assert main(["train", "--model", "bert-base", "--device", "cpu", "--no-progress", "--max-steps", "1",
                 "--batch-size", "2", "--seq-len", "16", "--train-samples", "20", "--eval-samples", "4",
                 "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "fine-tuning bert-base (random weights) (109.5M parameters)" in stdout
    assert "note: bert-base: no pretrained weights are shipped" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and 0 <= summary["accuracy"] <= 1


@pytest.mark.parametrize("micro_batch", [8, 2])
def test_unlabelled_samples_of_minus_100_are_out_of_the_loss_and_the_evaluation(micro_batch):
    """Class labels of -100 (unlabelled samples, skipped by cross-entropy as by Hugging Face's
    classifiers): the window's loss and gradient were the labelled samples' sum divided by all the
    samples (a weaker step the more are unlabelled), and evaluation counted them as misses. Now the
    loss is the mean over the labelled samples (the model's own), at every split; a window with no
    labelled sample gives 0, not NaN; accuracy is over the labelled samples."""
    from tightfit.tasks import SequenceClassification
    from tightfit.workload import Workload

    data = DictSamples(SyntheticBatches(8))
    data.batch["labels"][[1, 2, 5]] = -100
    w = Workload(tiny_bert(), data, data, 8)
    t = Trainer(w, Plan("fp32", micro_batch, 8), TrainConfig(epochs=1, lr=1e-3), progress=False)
    loss = t._forward_backward(list(range(8)))
    grads = [p.grad.clone() for p in t.model.parameters()]
    reference = tiny_bert()  # the model's own loss: the mean over the labelled samples
    own = reference(**data.batch).loss
    own.backward()
    assert loss == pytest.approx(float(own), rel=1e-5)
    for a, b in zip(grads, (p.grad for p in reference.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    t.model.zero_grad()
    assert t._forward_backward([1, 2, 5]) == 0.0  # no labelled sample: nothing to learn, no NaN
    t.model.eval()
    with torch.no_grad():
        logits = t.model(**{k: v for k, v in data.batch.items() if k != "labels"}).logits
    labelled = data.batch["labels"] != -100
    hits = (logits.argmax(-1) == data.batch["labels"])[labelled].float().mean()
    assert SequenceClassification().evaluate(t.model, [data.batch])["accuracy"] == pytest.approx(float(hits))


def test_a_collate_function_giving_a_batch_encoding_trains_as_one_giving_a_dict():
    """Hugging Face's collators (``DataCollatorWithPadding``, the language-modelling ones) give a
    ``BatchEncoding``, a ``UserDict`` rather than a ``dict``: a ``Workload`` refused it as "the
    collate function must give a dict of tensors (got BatchEncoding)", pointing to ``collate_as``
    for tuple samples. It now trains and evaluates as the same batches given as dicts do."""
    from torch.utils.data import default_collate
    from transformers import BatchEncoding

    from conftest import tiny_bert
    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(1, 50, (10,), generator=g), "attention_mask": torch.ones(10, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(20)]
    results = []
    for collate in (default_collate, lambda samples: BatchEncoding(default_collate(samples))):
        model = tiny_bert(dropout=0.1)
        w = Workload(model, data, data[:6], effective_batch=8, collate_fn=collate)
        r = Trainer(w, Plan("fp32", 3, 8), TrainConfig(epochs=1, seed=1), progress=False).fit()
        results.append((r.final_loss, r.eval, [p.detach().clone() for p in model.parameters()]))
    assert results[0][:2] == results[1][:2]
    assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))


def test_the_worst_case_of_batch_encoding_samples_is_their_largest():
    """A dataset whose samples are a tokenizer's output (``tokenizer(text)``: a ``BatchEncoding``, a
    ``UserDict``, of token lists) with a padding collator, as Workload now takes: the scan for the
    largest sample counted each such sample as 1 element (not a dict), so the worst case was the
    first sample's length, not the longest's, and the plan's memory was measured on short batches."""
    from transformers import BatchEncoding

    from tightfit.workload import DatasetBatches

    def pad(samples):
        longest = max(len(s["input_ids"]) for s in samples)
        return {"input_ids": torch.tensor([s["input_ids"] + [0] * (longest - len(s["input_ids"])) for s in samples]),
                "labels": torch.tensor([s["labels"] for s in samples])}

    data = [BatchEncoding({"input_ids": list(range(1, 3 + 10 * (i == 5))), "labels": i % 2}) for i in range(10)]
    assert DatasetBatches(data, pad).worst_case(4)["input_ids"].shape == (4, 12)
    assert DatasetBatches([dict(s) for s in data], pad).worst_case(4)["input_ids"].shape == (4, 12)


def test_a_worst_case_giving_a_batch_encoding_is_planned_as_a_dict():
    """Your own ``worst_case`` giving a ``BatchEncoding`` (a tokenizer's output, padded to the longest
    length) was refused by the estimator ("the example batch must be a non-empty dict of tensors")
    where the collate function's was taken since it became a plain dict; both are now."""
    from transformers import BatchEncoding

    from conftest import tiny_bert
    from tightfit.memory import estimate
    from tightfit.workload import DatasetBatches

    def worst(n):
        return BatchEncoding({"input_ids": torch.ones(n, 12, dtype=torch.long), "labels": torch.zeros(n, dtype=torch.long)})

    data = [{"input_ids": torch.ones(4, dtype=torch.long), "labels": torch.tensor(0)} for _ in range(8)]
    batch = DatasetBatches(data, worst_case=worst).worst_case(4)
    assert type(batch) is dict and batch["input_ids"].shape == (4, 12)
    assert estimate(tiny_bert(), batch, Plan("fp32", 4, 4)).peak_allocated_bytes > 0



def test_a_diverged_causal_lms_perplexity_is_inf_not_an_overflow():
    """Found by a review: a finite mean token loss above ~709.78 nats raised OverflowError from
    math.exp, ending a diverged run in its evaluation with a traceback; an inf loss gave inf."""
    from tightfit.tasks import CausalLM

    summary = CausalLM().summarize({"loss_sum": 835.0 * 54, "tokens": 54})
    assert summary["loss"] == pytest.approx(835.0) and summary["perplexity"] == math.inf
    assert CausalLM().summarize({"loss_sum": 2.0 * 10, "tokens": 10})["perplexity"] == pytest.approx(math.exp(2.0))
    assert math.isnan(CausalLM().summarize({"loss_sum": 0.0, "tokens": 0})["perplexity"])
    assert math.isnan(CausalLM().summarize({"loss_sum": math.nan, "tokens": 10})["perplexity"])  # not inf
