"""Shared test helpers: a tiny random BERT and synthetic token batches, so unit tests run in
seconds on a CPU; the end-to-end tests use the real shipped model and data."""

import random

import pytest

from tightfit.runtime.allocator import configure_allocator

configure_allocator()  # as the command line does, before CUDA starts

import torch  # noqa: E402

from tightfit.workload import Workload


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _own_plan_cache(tmp_path, monkeypatch):
    """Each test plans afresh: its own, empty plan cache (tightfit.planner.cache)."""
    monkeypatch.setenv("TIGHTFIT_CACHE_DIR", str(tmp_path / "tightfit-cache"))


class SyntheticBatches:
    """``n`` samples of random token ids with lengths 3..``seq_len`` (padded per batch) and
    random binary labels; same interface as :class:`tightfit.workload.TextBatches`.
    ``pad_multiple``: batches padded to a multiple of it (at most ``seq_len``), as tightfit's text
    data pads them to 8; None pads to the longest sample."""

    def __init__(self, n=24, seq_len=12, vocab=50, seed=0, pad_multiple=None):
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(3, seq_len + 1, (n,), generator=g).tolist()
        self.ids = torch.randint(1, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.seq_len, self.pad_multiple = seq_len, pad_multiple

    def __len__(self):
        return len(self.lengths)

    def collate(self, indices, pad_to=None):
        T = pad_to or max(self.lengths[i] for i in indices)
        if self.pad_multiple and not pad_to:
            T = min(self.seq_len, -(-T // self.pad_multiple) * self.pad_multiple)
        ids = torch.zeros(len(indices), T, dtype=torch.long)
        mask = torch.zeros(len(indices), T, dtype=torch.long)
        for r, i in enumerate(indices):
            L = min(self.lengths[i], T)
            ids[r, :L] = self.ids[i, :L]
            mask[r, :L] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": self.labels[list(indices)]}

    def worst_case(self, n):
        return self.collate([i % len(self) for i in range(n)], pad_to=self.seq_len)


class LMBatches(SyntheticBatches):
    """Synthetic causal-LM samples of different lengths; padding is -100 in ``labels``."""

    def collate(self, indices, pad_to=None):
        b = super().collate(indices, pad_to)
        b["labels"] = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        return b


def tiny_gpt2(seed=0, dropout=None):
    """A 2-layer GPT-2 (vocabulary 50); ``dropout`` sets its three dropout rates (None: GPT-2's 0.1)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(seed)
    rates = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2, **rates))


def tiny_bert(dropout=0.0, seed=0):
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=32, num_labels=2,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return BertForSequenceClassification(cfg)


@pytest.fixture
def make_workload():
    def make(n=24, effective_batch=8, dropout=0.0, seed=0):
        return Workload(tiny_bert(dropout, seed), SyntheticBatches(n), SyntheticBatches(8, seed=1), effective_batch)
    return make


def tiny_text_model_folder(root, words, **config):
    """Save a seeded BERT classifier (``BertConfig(**config)``) with a WordPiece tokenizer of the
    special tokens plus ``words`` under ``root/model``, as ``tightfit train --model`` reads it."""
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    model_dir = root / "model"
    torch.manual_seed(0)
    transformers.logging.disable_progress_bar()  # as tightfit's loading does: a test's stderr is tightfit's alone
    BertForSequenceClassification(BertConfig(vocab_size=len(vocab), **config)).save_pretrained(model_dir)
    BertTokenizerFast(vocab=str(root / "vocab.txt")).save_pretrained(model_dir)  # transformers 5 ignores vocab_file=
    return model_dir


def tiny_cpu_job(tmp_path) -> dict:
    """TrainRequest fields of a small CPU job: a 2-layer BERT folder (``tmp_path/model``) and 60
    labelled texts (``tmp_path/data.csv``)."""
    words = ["good", "bad", "great", "awful", "fine", "film", "plot"]
    model_dir = tiny_text_model_folder(tmp_path, words, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=64)
    rng = random.Random(0)
    rows = ["text,label"] + [f"{' '.join(rng.choices(words, k=5))},{rng.choice(['pos', 'neg'])}" for _ in range(60)]
    (tmp_path / "data.csv").write_text("\n".join(rows) + "\n")
    return dict(model=str(model_dir), data=str(tmp_path / "data.csv"), batch_size=8, seq_len=16, device="cpu",
                progress=False)


def shipped_model_reviews():
    """The shipped MiniLM folder and 8 tokenized review snippets (16 tokens) with 0/1 labels:
    ``(path, encoding dict, labels (8,))``; skips the test where the shipped model is absent."""
    from transformers import AutoTokenizer

    from tightfit.errors import TightfitError
    from tightfit.models import default_model_path

    try:
        path = default_model_path()
    except TightfitError as e:
        pytest.skip(str(e))
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["a fine film", "a dull film", "great acting", "poor plot"] * 2
    enc = tok(texts, padding="max_length", max_length=16, truncation=True, return_tensors="pt")
    return path, enc, torch.tensor([i % 2 for i in range(len(texts))])


def params_of(model):
    """Every named parameter of ``model``, detached copies (to compare runs bit for bit)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a, b):
    """Two :func:`params_of` results are equal, name by name, bit for bit."""
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


def count_forwards(module):
    """Give ``module`` a ``seen`` buffer (int64) that each of its forwards adds 1 to: a buffer a
    training step writes, as BatchNorm's statistics are."""
    module.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def count(m, inputs, output):
        m.seen.add_(1)
    module.register_forward_hook(count)
