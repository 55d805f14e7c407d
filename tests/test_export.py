"""``tightfit export --int8`` (CPU): a tiny text run and a tiny image run quantized, saved, read
back safely and reported; refusals of CUDA inference and int8 training before any work."""

import json
import random

import pytest
import torch

from tightfit.cli import main
from tightfit.export import WEIGHTS_FILE, load_int8, quantize

WORDS = "film plot actor scene great dull awful superb boring moving".split()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A finished CPU run of a tiny BERT on 80 labelled rows (held out: 8)."""
    from conftest import tiny_text_model_folder

    root = tmp_path_factory.mktemp("text")
    model_dir = tiny_text_model_folder(root, WORDS, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=32)
    rng = random.Random(0)
    rows = ["text,label"] + [f"{' '.join(w)},{'pos' if 'great' in w else 'neg'}"
                             for w in (rng.choices(WORDS, k=rng.randint(3, 10)) for _ in range(80))]
    (root / "data.csv").write_text("\n".join(rows) + "\n")
    run = root / "run"
    assert main(["train", "--model", str(model_dir), "--data", str(root / "data.csv"), "--batch-size", "8",
                 "--max-steps", "4", "--seq-len", "16", "--checkpoint-every", "0", "--out", str(run),
                 "--no-progress", "--device", "cpu"]) == 0
    return run


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A finished CPU run of a tiny ResNet on digits (held out: 180)."""
    pytest.importorskip("sklearn")
    from transformers import ResNetConfig, ResNetForImageClassification

    root = tmp_path_factory.mktemp("image")
    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                              layer_type="basic", num_labels=2)).save_pretrained(root / "resnet")
    run = root / "run"
    assert main(["train", "--data", "digits", "--model", str(root / "resnet"), "--image-size", "16", "--epochs", "1",
                 "--batch-size", "32", "--lr", "3e-3", "--checkpoint-every", "0", "--out", str(run), "--no-progress",
                 "--device", "cpu"]) == 0
    return run


def _linears(model):
    return [type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)
            or type(m).__name__ == "Linear" and "quantized" in type(m).__module__]


def test_text_run_export_reads_back_safely(text_run, tmp_path, capsys):
    out = tmp_path / "int8"
    assert main(["export", "--int8", str(text_run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| saved size |" in printed and "CPU latency, batch 32" in printed and "held-out accuracy" in printed
    assert "| saved size |" in (out / "report.md").read_text()
    r = json.loads((out / "export.json").read_text())
    assert r["held_out_samples"] == 8 and 0 <= r["int8"]["accuracy"] <= 1 and r["int8"]["size_bytes"] > 0
    assert set(r["int8"]["latency_s"]) == {"1", "32"}
    # the run's own held-out split: the exported fp32 model scores what the run reported
    assert r["fp32"]["accuracy"] == json.loads((text_run / "summary.json").read_text())["accuracy"]
    torch.load(out / WEIGHTS_FILE, weights_only=True)  # no pickled code
    before = torch.get_rng_state()
    loaded = load_int8(out)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's random numbers are not drawn from
    kinds = {t.__module__ for t in _linears(loaded)}
    assert kinds == {"torch.ao.nn.quantized.dynamic.modules.linear"}, kinds
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    fp32 = AutoModelForSequenceClassification.from_pretrained(text_run / "model").eval()
    batch = AutoTokenizer.from_pretrained(out)(["great film", "dull plot"], return_tensors="pt", padding=True)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, quantize(fp32)(**batch).logits)
    assert not list(tmp_path.glob(".*tmp"))


def test_image_run_export_keeps_accuracy(image_run, tmp_path):
    out = tmp_path / "int8"
    assert main(["export", "--int8", str(image_run), "--out", str(out)]) == 0
    r = json.loads((out / "export.json").read_text())
    summary = json.loads((image_run / "summary.json").read_text())
    assert r["held_out_samples"] == 180 and r["fp32"]["accuracy"] == summary["accuracy"]
    assert summary["accuracy"] > 0.6 and abs(r["int8"]["accuracy"] - r["fp32"]["accuracy"]) <= 0.05, r
    assert (out / "tightfit_images.json").is_file()


@pytest.mark.parametrize("kind", ["text", "image"])
def test_a_run_whose_starting_model_is_gone_still_exports(kind, text_run, image_run, tmp_path):
    """The run folder holds the trained model (weights, config, tokenizer or image side): the
    export rebuilt the held-out split through the model folder the run started from, and refused
    once that was moved or deleted ("model folder not found", naming a folder not given to it)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(text_run if kind == "text" else image_run, run)
    request = json.loads((run / "request.json").read_text())
    request["model"] = str(tmp_path / "deleted-since")
    (run / "request.json").write_text(json.dumps(request))
    out = tmp_path / "int8"
    assert main(["export", "--int8", str(run), "--out", str(out)]) == 0
    r = json.loads((out / "export.json").read_text())
    assert r["fp32"]["accuracy"] == json.loads((run / "summary.json").read_text())["accuracy"]


def _refused(argv, capsys, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tightfit: error:") and message in err[0], err


def test_cuda_inference_and_int8_training_are_refused_before_any_work(text_run, tmp_path, capsys, monkeypatch):
    import tightfit.export as export

    def no_work(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(export, "_load_fp32", no_work)
    _refused(["export", "--int8", str(text_run), "--out", str(tmp_path / "o"), "--device", "cuda"], capsys,
             "runs on the CPU only")
    _refused(["train", "--int8", "--out", str(tmp_path / "t"), "--device", "cpu"], capsys, "not training")
    _refused(["export", "--int8", str(tmp_path / "nope"), "--out", str(tmp_path / "o")], capsys, "no such run")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    _refused(["export", "--int8", str(text_run), "--out", str(tmp_path / "full")], capsys, "not an empty folder")
    # through a folder that does not exist yet: the OS resolves "new/.." only once "new" exists
    _refused(["export", "--int8", str(text_run), "--out", str(tmp_path / "new" / ".." / "full")], capsys,
             "not an empty folder")
    assert (tmp_path / "full" / "x").read_text() == "x" and not (tmp_path / "new").exists()
    (tmp_path / "afile").write_text("x")  # a folder under a file: FileExistsError's traceback before
    _refused(["export", "--int8", str(text_run), "--out", str(tmp_path / "afile" / "sub")], capsys,
             "is not a writable folder")
    assert not (tmp_path / "o").exists() and not (tmp_path / "t").exists()


def test_unwritable_out_and_a_folder_without_weights_are_refused_before_any_work(text_run, tmp_path, capsys,
                                                                                 monkeypatch):
    """`--out` under /proc passed the folder check (root may write anywhere by the permission bits)
    and an empty `--out` was checked itself, not its parent, where the export's temporary folder is
    made: both raised a traceback after the export's work. A model folder with config.json and no
    weights raised transformers' OSError."""
    import shutil
    import tempfile
    from pathlib import Path

    import tightfit.export as export

    def no_work(*a, **k):
        raise AssertionError("work started")

    monkeypatch.setattr(export, "_load_fp32", no_work)
    _refused(["export", "--int8", str(text_run), "--out", "/proc/tightfit-export/int8"], capsys,
             "cannot create --out /proc/tightfit-export/int8: /proc is not a writable folder")
    ro = tmp_path / "read-only"
    (ro / "empty").mkdir(parents=True)
    real = tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **k):  # a folder nothing can be created in, as a read-only mount is
        if dir is not None and Path(dir) == ro:
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    _refused(["export", "--int8", str(text_run), "--out", str(ro / "empty")], capsys,
             f"{ro} is not a writable folder")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in (text_run / "model").iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, bare / f.name)
    _refused(["export", "--int8", str(bare), "--out", str(tmp_path / "o")], capsys,
             "config.json but no weights file")
    assert not (tmp_path / "o").exists() and not list(ro.parent.glob(".*tmp")) and not list(ro.glob(".*"))


def test_a_bare_model_folder_exports_without_accuracy(text_run, tmp_path):
    out = tmp_path / "int8"
    assert main(["export", "--int8", str(text_run / "model"), "--out", str(out)]) == 0
    r = json.loads((out / "export.json").read_text())
    assert r["held_out_samples"] == 0 and r["fp32"]["accuracy"] is None and r["int8"]["accuracy"] is None
    report = (out / "report.md").read_text()
    assert "not measured" in report and "(0 samples)" not in report  # found by a fresh user
    assert "shown: the round of the median speed-up" in report  # it said "the median of 10 calls" (a fresh user)
    for b in ("1", "32"):  # the times shown are the median round's: their ratio is the speed-up beside them
        ratio = r["fp32"]["latency_s"][b] / r["int8"]["latency_s"][b]
        assert ratio == pytest.approx(r["speedup_median"][b]), (b, ratio, r["speedup_median"])
    assert (out / "vocab.txt").is_file() or (out / "tokenizer.json").is_file()
    # what was timed is said: random ids of 128 tokens, or the model's 32 positions here, and the run's
    # own texts from its folder (a fresh user saw the same weights 6x slower from the model folder and
    # could not tell why)
    assert r["latency_inputs"] == {"from": "random inputs", "shape": {"1": [1, 32], "32": [32, 32]}}
    assert "Latency inputs: random inputs, batch 1: 1 x 32; batch 32: 32 x 32 (token ids" in report
    run = tmp_path / "from-run"
    assert main(["export", "--int8", str(text_run), "--out", str(run)]) == 0
    timed = json.loads((run / "export.json").read_text())["latency_inputs"]
    assert timed["from"] == "held-out samples" and timed["shape"]["32"][0] == 32


def test_a_run_saved_with_full_and_train_samples_still_exports(text_run, tmp_path):
    """Runs saved before --full with --train-samples was refused hold both in request.json: export
    rebuilds the request as resume does (--train-samples, what the run trained on)."""
    import shutil

    run = tmp_path / "old-run"
    shutil.copytree(text_run, run)
    saved = json.loads((run / "request.json").read_text())
    (run / "request.json").write_text(json.dumps({**saved, "full": True, "train_samples": 64}))
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "int8")]) == 0
    assert json.loads((tmp_path / "int8" / "export.json").read_text())["held_out_samples"] == 8


def test_an_export_interrupted_while_measuring_accuracy_leaves_no_out(text_run, tmp_path, monkeypatch, capsys):
    """The held-out accuracy is measured after the weights are written; Ctrl-C there left --out with
    the weights but no report.md or export.json, and the re-run refused the non-empty folder."""
    import tightfit.export as export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    out = tmp_path / "int8"
    monkeypatch.setattr(export, "_accuracy", interrupted)
    assert main(["export", "--int8", str(text_run), "--out", str(out)]) == 130
    assert not out.exists() and not list(tmp_path.glob(".*"))
    monkeypatch.undo()
    assert main(["export", "--int8", str(text_run), "--out", str(out)]) == 0  # the re-run goes through
    assert (out / "report.md").is_file() and (out / "export.json").is_file()


def test_latency_is_timed_with_the_two_models_taking_turns():
    """fp32 and int8 timed one after the other let a passing load on the host land on one of them
    (a contended host showed 128x one run, 0.99x the next): they alternate call by call."""
    from tightfit.export import LATENCY_REPEATS, cpu_latency

    calls = []

    class Model(torch.nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, x):
            calls.append(self.name)
            return x

    got = cpu_latency({"fp32": Model("fp32"), "int8": Model("int8")}, {"x": torch.zeros(1)})
    assert set(got) == {"fp32", "int8"} and all(v >= 0 for v in got.values())
    assert calls == ["fp32", "int8"] * (LATENCY_REPEATS + 2)


def test_an_empty_out_is_refused(text_run, capsys):
    """``--out ""`` exported everything, then crashed on Path('.') ("has an empty name")."""
    assert main(["export", "--int8", str(text_run), "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err


def test_an_out_inside_the_model_folder_it_exports_is_refused_before_any_work(text_run, capsys):
    before = sorted(p.name for p in (text_run / "model").iterdir())
    assert main(["export", "--int8", str(text_run / "model"), "--out", str(text_run / "model" / "int8")]) == 2
    assert "is inside the model folder" in capsys.readouterr().err
    assert sorted(p.name for p in (text_run / "model").iterdir()) == before  # nothing written there


def test_an_out_inside_the_run_folder_it_exports_is_refused_before_any_work(text_run, capsys):
    """It wrote the export into the run folder (exit 0), which a run writes, replaces and prunes
    (--resume), as `train` refuses an --out inside a run folder (a review helper, 2026-12-07)."""
    before = sorted(p.name for p in text_run.iterdir())
    for source, out in ((text_run, text_run / "sub"),
                        (text_run / "model", text_run / "int8")):  # its model folder named: the run's still
        assert main(["export", "--int8", str(source), "--out", str(out)]) == 2
        assert f"is inside the run folder {text_run}" in capsys.readouterr().err
    assert sorted(p.name for p in text_run.iterdir()) == before  # nothing written there


def test_an_export_stopped_by_sigterm_leaves_no_out_and_no_temporary_folder(text_run, tmp_path, monkeypatch):
    """SIGTERM (e.g. `timeout`) mid-export left the hidden temporary folder behind (57 MB): only
    train mapped SIGTERM to the interrupt path that cleans up."""
    import os
    import signal

    import tightfit.export as export

    monkeypatch.setattr(export, "_accuracy", lambda *a, **k: os.kill(os.getpid(), signal.SIGTERM))
    out = tmp_path / "int8"
    assert main(["export", "--int8", str(text_run), "--out", str(out)]) == 143  # 128 + SIGTERM, not Ctrl-C's 130
    assert not out.exists() and not list(tmp_path.glob(".*"))


def test_a_run_whose_data_changed_is_refused_before_any_work(text_run, tmp_path, capsys):
    """The held-out samples are rebuilt from the run's data file: if it changed (labels flipped),
    the accuracy would be measured on other samples than the run's, so export refuses, as --resume
    does, and writes nothing."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(text_run, run)
    data = tmp_path / "data.csv"
    saved = json.loads((run / "request.json").read_text())
    lines = open(saved["data"]).read().splitlines()
    data.write_text("\n".join([lines[0]] + [l.replace(",pos", ",XX").replace(",neg", ",pos").replace(",XX", ",neg")
                                            for l in lines[1:]]) + "\n")
    (run / "request.json").write_text(json.dumps({**saved, "data": str(data)}))
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "int8")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the data differ from those the run trained on" in err[0]
    assert not (tmp_path / "int8").exists()


def test_a_run_whose_data_moved_says_how_to_export_it_anyway(text_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(text_run, run)
    saved = json.loads((run / "request.json").read_text())
    (run / "request.json").write_text(json.dumps({**saved, "data": str(tmp_path / "moved.csv")}))
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "int8")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data cannot be read" in err[0] and "export the model folder" in err[0], err
    assert not (tmp_path / "int8").exists()


def test_a_bare_image_model_folder_is_timed_at_its_trained_image_size(tmp_path, monkeypatch):
    """A bare image model folder was timed at 224 x 224 whatever its ``tightfit_images.json`` said
    (ResNet's config has no ``image_size``): the latency was that of inputs it never takes. The
    preprocessing file's size is used."""
    import tightfit.export as export
    from transformers import ResNetConfig, ResNetForImageClassification

    from tightfit.images import PREPROCESSING_FILE, preprocessing_record

    torch.manual_seed(0)
    folder = tmp_path / "resnet"
    ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                              layer_type="basic", num_labels=2)).save_pretrained(folder)
    (folder / PREPROCESSING_FILE).write_text(json.dumps(preprocessing_record(20, 1, ["a", "b"])))
    shapes, real = [], export.cpu_latency

    def spy(models, inputs, *a, **k):
        shapes.append(tuple(inputs["pixel_values"].shape))
        return real(models, inputs, *a, **k)

    monkeypatch.setattr(export, "cpu_latency", spy)
    assert main(["export", "--int8", str(folder), "--out", str(tmp_path / "int8")]) == 0
    assert shapes == [(1, 1, 20, 20), (32, 1, 20, 20)], shapes


def test_an_image_run_saved_with_list_column_options_still_exports(image_run, tmp_path):
    """``--image-column``/``--label-column`` with digits or a class folder are now refused by ``train``;
    a run saved before that carries them (they were ignored) and still exports."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(image_run, run)
    request = json.loads((run / "request.json").read_text())
    (run / "request.json").write_text(json.dumps({**request, "label_column": "digit", "image_column": "file"}))
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "int8")]) == 0
    assert json.loads((tmp_path / "int8" / "export.json").read_text())["held_out_samples"] == 180


@pytest.mark.parametrize("broken", ["request.json", "tokenizer.json", "tightfit_images.json"])
def test_a_run_whose_files_cannot_be_read_is_refused_in_one_line(broken, text_run, image_run, tmp_path, capsys):
    """A run folder's request.json, tokenizer or image preprocessing file cut short (or missing)
    ended the export in a JSONDecodeError or FileNotFoundError traceback, after the model was
    loaded: now one line naming the file, and nothing written."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(image_run if broken == "tightfit_images.json" else text_run, run)
    target = run / broken if broken == "request.json" else run / "model" / broken
    target.write_text('{"cut short": ')
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "int8")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    named = broken.replace(".json", "") if broken == "tokenizer.json" else broken  # the tokenizer: by its folder
    assert len(err) == 1 and err[0].startswith("tightfit: error:") and named in err[0], err
    assert not (tmp_path / "int8").exists() and not list(tmp_path.glob(".*"))
    if broken == "tightfit_images.json":  # and one that is missing
        target.unlink()
        assert main(["export", "--int8", str(run), "--out", str(tmp_path / "int8")]) == 2
        assert broken in capsys.readouterr().err


def test_the_fp32_size_is_that_of_the_fp32_model_whatever_the_source_files_hold(text_run, tmp_path):
    """The fp32 column's saved size was the size of the source's weights files: a model folder
    saved in bf16 (as most Hugging Face folders are, in fp16 or bf16) showed half the fp32 size,
    smaller than its int8 export. It is the fp32 model's state_dict as torch.save writes it."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(text_run / "model")
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert main(["export", "--int8", str(tmp_path / "bf16"), "--out", str(tmp_path / "int8")]) == 0
    r = json.loads((tmp_path / "int8" / "export.json").read_text())
    assert r["fp32"]["size_bytes"] >= 4 * params > (tmp_path / "bf16" / "model.safetensors").stat().st_size


def test_an_out_that_links_to_an_empty_folder_is_written_there(text_run, tmp_path):
    """The export's folder was renamed onto the link itself: the link became a folder, the empty
    folder it named stayed empty and the link was left behind as a hidden ``.link.old``."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    assert main(["export", "--int8", str(text_run), "--out", str(tmp_path / "link")]) == 0
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / WEIGHTS_FILE).is_file()
    assert not list(tmp_path.glob(".*"))
    load_int8(tmp_path / "link")


def test_an_out_filled_by_another_command_while_exporting_is_kept(text_run, tmp_path, monkeypatch, capsys):
    """--out is checked new or empty before the work, but the finished export replaced whatever was
    there by then: a run or another export started meanwhile with the same --out was deleted."""
    import tightfit.export as export

    out, real = tmp_path / "int8", export._accuracy

    def meanwhile(*args, **kwargs):  # another command writes into --out while this one measures
        out.mkdir(exist_ok=True)
        (out / "request.json").write_text("another run's")
        return real(*args, **kwargs)

    monkeypatch.setattr(export, "_accuracy", meanwhile)
    assert main(["export", "--int8", str(text_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was filled while the export ran" in err[0], err
    assert [p.name for p in out.iterdir()] == ["request.json"] and (out / "request.json").read_text() == "another run's"
    assert not list(tmp_path.glob(".*"))


def test_an_export_onto_a_full_disk_says_so_in_one_line_and_leaves_nothing(text_run, tmp_path, monkeypatch, capsys):
    """torch.save's zip writer reports a full disk as a RuntimeError ("unexpected pos ..."), not an
    OSError: the export ended in two chained tracebacks (exit 1)."""
    import tightfit.export as export

    out = tmp_path / "int8"

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 36160 vs 36054")

    monkeypatch.setattr(export.torch, "save", full)
    assert main(["export", "--int8", str(text_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not be written: [enforce fail at inline_container.cc:664]" in err[0], err
    assert "nothing of it is left" in err[0] and not out.exists() and not list(tmp_path.glob(".*"))


def test_a_tokenizer_of_bpe_codes_is_exported_whole(tmp_path):
    """The export copied the source's .json, .txt and .model files: PhoBERT's and BERTweet's
    bpe.codes (as *.tiktoken) has none of those suffixes, and the exported folder's tokenizer
    could not be loaded (TypeError: expected str ... not NoneType)."""
    from transformers import AutoTokenizer, PhobertTokenizer, RobertaConfig, RobertaForSequenceClassification

    (tmp_path / "vocab.txt").write_text("".join(f"{w} 1\n" for w in WORDS))
    (tmp_path / "bpe.codes").write_text("f i 1\nfi l 1\n")
    tokenizer = PhobertTokenizer(vocab_file=str(tmp_path / "vocab.txt"), merges_file=str(tmp_path / "bpe.codes"))
    model_dir = tmp_path / "phobert"
    torch.manual_seed(0)
    RobertaForSequenceClassification(RobertaConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=130, pad_token_id=tokenizer.pad_token_id)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main(["export", "--int8", str(model_dir), "--out", str(tmp_path / "int8")]) == 0
    assert (tmp_path / "int8" / "bpe.codes").is_file()
    assert AutoTokenizer.from_pretrained(tmp_path / "int8")("great film") == tokenizer("great film")


@pytest.mark.parametrize("spelling", [".", "absolute"])
def test_an_out_that_is_the_working_folder_is_refused_before_any_work(spelling, text_run, tmp_path, monkeypatch,
                                                                       capsys):
    """``--out .`` in an empty folder did all the work, then crashed on the rename onto the working
    folder (a traceback, exit 1); spelled as an absolute path it was renamed onto it, and the shell
    was left in a removed folder that showed no files."""
    import tightfit.export as export

    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr(export, "_load_fp32", lambda *a: pytest.fail("work started"))
    out = "." if spelling == "." else str(here)
    assert main(["export", "--int8", str(text_run), "--out", out]) == 2
    assert "is the working folder" in capsys.readouterr().err
    assert here.is_dir() and not list(here.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_an_interrupted_export_leaves_no_parent_folders_it_made(text_run, tmp_path, monkeypatch):
    """Ctrl-C while the held-out accuracy was measured removed the temporary folder but not the
    parents made for --out (a/b/ of --out a/b/int8): an empty a/b/ was left behind."""
    import tightfit.export as export

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_accuracy", interrupted)
    (tmp_path / "kept").mkdir()
    assert main(["export", "--int8", str(text_run), "--out", str(tmp_path / "kept" / "a" / "b" / "int8")]) == 130
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["kept"]  # kept: was there


def test_an_out_inside_the_runs_image_folder_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    """--out inside the image folder the run trained on was written there: a class folder without
    images, so that the next export of the run (and a resume) refused the run's own data."""
    import tightfit.export as export
    from PIL import Image
    from transformers import ResNetConfig, ResNetForImageClassification

    for c in ("a", "b"):
        (tmp_path / "imgs" / c).mkdir(parents=True)
        for i in range(10):
            Image.new("L", (8, 8), 40 * i + (5 if c == "a" else 0)).save(tmp_path / "imgs" / c / f"{i}.png")
    torch.manual_seed(0)
    ResNetForImageClassification(ResNetConfig(num_channels=1, embedding_size=8, hidden_sizes=[8], depths=[1],
                                              layer_type="basic", num_labels=2)).save_pretrained(tmp_path / "resnet")
    run = tmp_path / "run"
    assert main(["train", "--data", str(tmp_path / "imgs"), "--model", str(tmp_path / "resnet"), "--image-size", "8",
                 "--max-steps", "1", "--batch-size", "4", "--checkpoint-every", "0", "--out", str(run),
                 "--no-progress", "--device", "cpu"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(export, "_load_fp32", lambda *a: pytest.fail("work started"))
    assert main(["export", "--int8", str(run), "--out", str(tmp_path / "imgs" / "int8")]) == 2
    assert "is inside the data folder" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["a", "b"]


def test_a_run_resumed_from_an_earlier_checkpoint_is_not_exported_as_finished(text_run, tmp_path, capsys):
    """A finished run resumed from an earlier checkpoint (``--resume RUN/checkpoints/ckpt-N``) and
    stopped keeps the model/ of the finish it abandoned until it finishes again; its summary.json
    and report.md are removed at the resume's start ("written anew when this run finishes (model/
    is replaced then)"). export took that model/ as the run's, without a word. Now such a run (a
    model/ but no summary.json, and a checkpoint to resume from) is refused as not finished, as a run
    without model/ is: resume it first; while a tightfit train writes it, it is still training."""
    import shutil

    from tightfit.api import _hold_run_folder, _release_run_folders

    run, out = tmp_path / "run", tmp_path / "int8"
    shutil.copytree(text_run, run)
    (run / "summary.json").unlink()  # as the resume from an earlier checkpoint left it
    (run / "report.md").unlink()
    _refused(["export", "--int8", str(run), "--out", str(out)], capsys,
             f"{run}: the run has not finished (its model/ is from an earlier finish, or was written as it stopped): "
             f"run tightfit train --resume {run} first")
    owner = object()  # a resume training in it now
    _hold_run_folder(run, owner)
    try:
        _refused(["export", "--int8", str(run), "--out", str(out)], capsys, "the run is still training")
    finally:
        _release_run_folders(owner)
    assert not out.exists()
    shutil.rmtree(run / "checkpoints")  # nothing to resume from: its model/ is all the run has
    assert main(["export", "--int8", str(run), "--out", str(out)]) == 0


def test_a_finished_run_whose_model_lost_its_config_is_told_so(text_run, tmp_path, capsys):
    """From a fresh user's trial: a finished run whose model/config.json was deleted was called
    "not finished: run tightfit train --resume first", and the resume said the run had already
    finished: advice in a circle. The missing file is named."""
    import shutil

    run, out = tmp_path / "run", tmp_path / "int8"
    shutil.copytree(text_run, run)
    (run / "model" / "config.json").unlink()
    _refused(["export", "--int8", str(run), "--out", str(out)], capsys,
             f"{run / 'model'}: no config.json (the finished run's model folder is incomplete)")
    assert not out.exists()
