"""Checkpoint integrity: each checkpoint carries a manifest of sizes and SHA-256 checksums, verified
before loading; a corrupt newest checkpoint falls back to the previous intact one with a note, no
intact one stops with one line before anything is written, and temporary folders of a killed
checkpoint write are removed."""

import json
import os
import random
from pathlib import Path

import pytest
import torch

from tightfit.errors import TightfitError
from tightfit.runtime.checkpoint import (
    CorruptCheckpointError, latest_intact_checkpoint, list_checkpoints, load_checkpoint, read_state, resume_point,
    remove_stale_temporaries, save_checkpoint, verify_checkpoint,
)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def _save(folder, steps, model=None):
    model = model or _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    for step in steps:
        save_checkpoint(folder, step, model, {"step": step, "optimizer": opt.state_dict()}, keep_last=5)
    return model


def _truncate(path, keep=0.5):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def _flip_middle_byte(path):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert path.stat().st_size == size


def test_manifest_records_size_and_checksum_of_each_file(tmp_path):
    _save(tmp_path, [2])
    ckpt = tmp_path / "ckpt-2"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "state.pt", "state.safetensors"}
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (ckpt / name).stat().st_size and len(entry["sha256"]) == 64
    assert verify_checkpoint(ckpt) is True


def test_the_states_tensor_bytes_are_written_by_safetensors_not_torch_save(tmp_path):
    """torch.save holds the GIL while it writes tensor bytes, stalling a host-bound training loop
    during a background checkpoint (tightfit/runtime/state_tensors.py): state.pt keeps only
    placeholders, and the optimizer state read back is the one saved, bit for bit."""
    from safetensors.torch import load_file

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, 2, model, {"step": 2, "optimizer": opt.state_dict(), "one": torch.tensor(3.5)})
    structure = torch.load(tmp_path / "ckpt-2" / "state.pt", weights_only=True)
    placeholders = [t for s in structure["optimizer"]["state"].values() for t in s.values()] + [structure["one"]]
    assert placeholders and all(t.device.type == "meta" for t in placeholders)
    assert len(load_file(tmp_path / "ckpt-2" / "state.safetensors")) == len(placeholders)
    state = read_state(tmp_path / "ckpt-2")
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(state["optimizer"]["state"][i][k], v)
    assert state["one"] == 3.5 and state["step"] == 2


def test_a_checkpoint_whose_state_pt_holds_its_tensors_still_loads(tmp_path):
    """state.pt of tightfit before state.safetensors: every tensor in it, no state.safetensors."""
    from tightfit.runtime.checkpoint import sha256_file

    model = _save(tmp_path, [2])
    ckpt = tmp_path / "ckpt-2"
    whole = read_state(ckpt)
    torch.save(whole, ckpt / "state.pt")
    (ckpt / "state.safetensors").unlink()
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["format"] == "tightfit-checkpoint/2"
    del manifest["files"]["state.safetensors"]
    manifest["files"]["state.pt"] = {"bytes": (ckpt / "state.pt").stat().st_size, "sha256": sha256_file(ckpt / "state.pt")}
    (ckpt / "manifest.json").write_text(json.dumps({**manifest, "format": "tightfit-checkpoint/1"}))
    assert verify_checkpoint(ckpt) is True
    state = load_checkpoint(ckpt, _model(seed=1))
    for i, s in whole["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(state["optimizer"]["state"][i][k], v)
    assert state["optimizer"]["state"][0]["exp_avg"].device.type == "cpu"


def test_state_safetensors_missing_or_unlisted_is_corrupt(tmp_path):
    _save(tmp_path, [2, 4])
    (tmp_path / "ckpt-4" / "state.safetensors").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"ckpt-4 is corrupt \(state\.safetensors: missing"):
        verify_checkpoint(tmp_path / "ckpt-4")
    with pytest.raises(CorruptCheckpointError, match=r"state\.safetensors: missing \(state\.pt refers to its"):
        read_state(tmp_path / "ckpt-4")  # unverified: still one line
    manifest = json.loads((tmp_path / "ckpt-2" / "manifest.json").read_text())
    del manifest["files"]["state.safetensors"]
    (tmp_path / "ckpt-2" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: does not list state\.safetensors"):
        verify_checkpoint(tmp_path / "ckpt-2")
    (tmp_path / "ckpt-4" / "manifest.json").unlink()  # without a manifest too: the fault found, not at resume
    with pytest.raises(CorruptCheckpointError, match=r"ckpt-4 is corrupt \(state\.safetensors: missing"):
        verify_checkpoint(tmp_path / "ckpt-4")


def test_a_manifest_of_an_unknown_format_is_refused_in_one_line(tmp_path):
    _save(tmp_path, [2])
    manifest = json.loads((tmp_path / "ckpt-2" / "manifest.json").read_text())
    (tmp_path / "ckpt-2" / "manifest.json").write_text(json.dumps({**manifest, "format": "tightfit-checkpoint/3"}))
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: unreadable: not a tightfit-checkpoint/1 or "
                                                     r"tightfit-checkpoint/2 manifest\)$"):
        verify_checkpoint(tmp_path / "ckpt-2")
    (tmp_path / "ckpt-2" / "manifest.json").write_text('["x"]')  # found by a fresh user: Python's words were shown
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: unreadable: not a JSON object but a list"):
        verify_checkpoint(tmp_path / "ckpt-2")


@pytest.mark.parametrize("name, damage, fault", [
    ("state.pt", _truncate, "state.pt: truncated"),
    ("model.safetensors", _truncate, "model.safetensors: truncated"),
    ("model.safetensors", _flip_middle_byte, "model.safetensors: checksum mismatch"),
    ("state.pt", _flip_middle_byte, "state.pt: checksum mismatch"),
    ("state.safetensors", _truncate, "state.safetensors: truncated"),
    ("state.safetensors", _flip_middle_byte, "state.safetensors: checksum mismatch"),
])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, name, damage, fault):
    _save(tmp_path, [2, 4])
    damage(tmp_path / "ckpt-4" / name)
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint ckpt-4 is corrupt \\({fault}"):
        verify_checkpoint(tmp_path / "ckpt-4")
    with pytest.raises(CorruptCheckpointError, match=fault):
        load_checkpoint(tmp_path / "ckpt-4", _model())
    point = latest_intact_checkpoint(tmp_path)
    assert point.path == tmp_path / "ckpt-2"
    assert len(point.notes) == 1
    assert point.notes[0].startswith(f"checkpoint ckpt-4 is corrupt ({fault}")
    assert point.notes[0].endswith("; resuming from ckpt-2")


def test_a_flipped_weight_byte_no_longer_loads_silently(tmp_path):
    model = _save(tmp_path, [2])
    _flip_middle_byte(tmp_path / "ckpt-2" / "model.safetensors")
    other = _model(seed=1)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        load_checkpoint(tmp_path / "ckpt-2", other)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))  # nothing was loaded
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_no_intact_checkpoint_is_one_line_error(tmp_path):
    _save(tmp_path, [2, 4])
    _truncate(tmp_path / "ckpt-4" / "state.pt")
    _flip_middle_byte(tmp_path / "ckpt-2" / "model.safetensors")
    with pytest.raises(TightfitError) as info:
        latest_intact_checkpoint(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert "ckpt-4 is corrupt (state.pt: truncated" in msg and "ckpt-2 is corrupt (model.safetensors: checksum" in msg
    with pytest.raises(TightfitError, match="no checkpoint"):
        latest_intact_checkpoint(tmp_path / "empty")


def test_missing_file_and_unreadable_manifest(tmp_path):
    _save(tmp_path, [2, 4, 6])
    (tmp_path / "ckpt-6" / "state.pt").unlink()
    (tmp_path / "ckpt-4" / "manifest.json").write_text('{"format": "tightfit-checkpoint/1", "fi')
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt: missing"):
        verify_checkpoint(tmp_path / "ckpt-6")
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json: unreadable"):
        verify_checkpoint(tmp_path / "ckpt-4")
    point = latest_intact_checkpoint(tmp_path)
    assert point.path.name == "ckpt-2" and len(point.notes) == 2


def test_a_manifest_with_an_infinite_number_is_unreadable_not_a_traceback(tmp_path):
    """JSON takes ``Infinity`` and ``1e400`` (an infinite float), which int() refuses with an
    OverflowError: verifying, pruning and choosing the checkpoint to resume raised it."""
    from tightfit.runtime.checkpoint import ABANDONED, prune_checkpoints

    _save(tmp_path, [2, 4, 6])
    manifest = json.loads((tmp_path / "ckpt-4" / "manifest.json").read_text())
    manifest["files"]["state.pt"]["bytes"] = float("inf")
    (tmp_path / "ckpt-4" / "manifest.json").write_text(json.dumps(manifest))
    manifest = json.loads((tmp_path / "ckpt-6" / "manifest.json").read_text())
    (tmp_path / "ckpt-6" / "manifest.json").write_text(json.dumps({**manifest, "skipped_in_row": 1e400}))
    with pytest.raises(CorruptCheckpointError, match=r"ckpt-4 is corrupt \(manifest\.json: unreadable"):
        verify_checkpoint(tmp_path / "ckpt-4")
    (tmp_path / ABANDONED).write_text('{"resumed_from": Infinity, "checkpoints": {}}')
    assert latest_intact_checkpoint(tmp_path).path.name == "ckpt-6"
    prune_checkpoints(tmp_path, 6, keep_last=1)  # ckpt-6's record cannot be read: not the clean one kept, but kept
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-4", "ckpt-6"]


def test_checkpoint_without_manifest_is_accepted_with_a_note_and_checked_for_truncation(tmp_path):
    """Checkpoints of tightfit before manifests: resumable, with a note; truncation is still found
    (safetensors header vs. file length, zip CRCs of state.pt)."""
    model = _save(tmp_path, [2, 4, 6])
    for step in (2, 4, 6):
        (tmp_path / f"ckpt-{step}" / "manifest.json").unlink()
    for step in (4, 6):  # as such a tightfit wrote them: every tensor in state.pt (ckpt-2 kept as today's)
        ckpt = tmp_path / f"ckpt-{step}"
        torch.save(read_state(ckpt), ckpt / "state.pt")
        (ckpt / "state.safetensors").unlink()
    assert verify_checkpoint(tmp_path / "ckpt-6") is False
    point = latest_intact_checkpoint(tmp_path)
    assert point.path.name == "ckpt-6" and "has no manifest.json (written by an older tightfit)" in point.notes[-1]
    # today's format (state.safetensors) whose manifest was deleted: not blamed on an older tightfit
    assert "has no manifest.json (lost: this tightfit writes one)" in resume_point(tmp_path / "ckpt-2").notes[-1]
    other = _model(seed=1)
    assert load_checkpoint(tmp_path / "ckpt-6", other)["step"] == 6
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))

    _truncate(tmp_path / "ckpt-6" / "model.safetensors")
    _flip_middle_byte(tmp_path / "ckpt-4" / "state.pt")
    with pytest.raises(CorruptCheckpointError, match="ckpt-6 is corrupt \\(model.safetensors: "):
        verify_checkpoint(tmp_path / "ckpt-6")
    with pytest.raises(CorruptCheckpointError, match="ckpt-4 is corrupt \\(state.pt: "):
        verify_checkpoint(tmp_path / "ckpt-4")
    assert latest_intact_checkpoint(tmp_path).path.name == "ckpt-2"
    _truncate(tmp_path / "ckpt-2" / "state.safetensors")
    with pytest.raises(CorruptCheckpointError, match="ckpt-2 is corrupt \\(state.safetensors: "):
        verify_checkpoint(tmp_path / "ckpt-2")


def test_unloadable_state_is_one_line_error(tmp_path):
    (tmp_path / "ckpt-2").mkdir()
    (tmp_path / "ckpt-2" / "state.pt").write_bytes(b"\x00" * 100)
    with pytest.raises(CorruptCheckpointError) as info:
        read_state(tmp_path / "ckpt-2")
    assert str(info.value).startswith("checkpoint ckpt-2 is corrupt (state.pt: cannot be loaded") \
        and "\n" not in str(info.value)


def test_weights_of_another_model_are_one_line_error(tmp_path):
    _save(tmp_path, [2])
    with pytest.raises(TightfitError, match="holds another model's weights") as info:
        load_checkpoint(tmp_path / "ckpt-2", torch.nn.Linear(3, 2))
    assert "\n" not in str(info.value)


def test_stale_temporary_folders_are_removed_when_the_next_checkpoint_is_written(tmp_path):
    _save(tmp_path, [2])
    tmp = tmp_path / ".ckpt-4.x1y2z3ab.tmp"  # what atomic_write_dir leaves when the process is killed
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(os.urandom(5000))
    (tmp_path / ".ckpt-2.old").mkdir()
    (tmp_path / ".other.tmp").mkdir()  # not a checkpoint's: left alone
    _save(tmp_path, [4])
    assert not tmp.exists() and not (tmp_path / ".ckpt-2.old").exists()
    assert (tmp_path / ".other.tmp").is_dir()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-2", "ckpt-4"]


def test_remove_stale_temporaries_reports_what_it_removed(tmp_path):
    tmp = tmp_path / ".ckpt-40.abcdefgh.tmp"
    tmp.mkdir()
    (tmp / "state.pt").write_bytes(b"x" * 1234)
    assert remove_stale_temporaries(tmp_path) == [(".ckpt-40.abcdefgh.tmp", 1234)]
    assert remove_stale_temporaries(tmp_path) == [] and remove_stale_temporaries(tmp_path / "none") == []


def test_remove_stale_temporaries_removes_a_times_json_write_cut_short_in_a_checkpoint(tmp_path):
    """times.json is written into a checkpoint already in place: a kill then leaves its temporary
    file inside ckpt-<step>/, which is removed (the checkpoint and a times.json in place are not)."""
    _save(tmp_path, [2])
    ckpt = tmp_path / "ckpt-2"
    (ckpt / "times.json").write_text('{"checkpoint_seconds": 1.0, "checkpoint_write_seconds": 0.5}')
    (ckpt / ".times.json.x7f3q.tmp").write_bytes(b"x" * 17)
    (ckpt / ".other.tmp").write_text("not tightfit's")
    assert remove_stale_temporaries(tmp_path) == [("ckpt-2/.times.json.x7f3q.tmp", 17)]
    assert sorted(p.name for p in ckpt.iterdir()) == [".other.tmp", "manifest.json", "model.safetensors", "state.pt", "state.safetensors",
                                                      "times.json"]
    assert verify_checkpoint(ckpt)


def test_checkpoints_past_a_fallback_are_dropped_when_the_run_writes_again(tmp_path):
    """After resuming from ckpt-2 because ckpt-4 was corrupt, the next checkpoint replaces the
    abandoned stretch: keep_last then counts intact checkpoints of this stretch only."""
    model = _save(tmp_path, [2, 4])
    _flip_middle_byte(tmp_path / "ckpt-4" / "model.safetensors")
    save_checkpoint(tmp_path, 3, model, {"step": 3}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-2", "ckpt-3"]


# ---------------------------------------------------------------- the command line

WORDS = "film plot actor scene great dull awful superb boring moving".split()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished CPU run of a tiny BERT with checkpoints at steps 2, 4 and 6."""
    from conftest import tiny_text_model_folder
    from tightfit.cli import main

    root = tmp_path_factory.mktemp("run")
    model_dir = tiny_text_model_folder(root, WORDS, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=32)
    rng = random.Random(0)
    rows = ["text,label"] + [f"{' '.join(w)},{'pos' if 'great' in w else 'neg'}"
                             for w in (rng.choices(WORDS, k=rng.randint(3, 10)) for _ in range(80))]
    (root / "data.csv").write_text("\n".join(rows) + "\n")
    run = root / "out"
    assert main(["train", "--model", str(model_dir), "--data", str(root / "data.csv"), "--batch-size", "4",
                 "--max-steps", "6", "--seq-len", "16", "--log-every", "1", "--checkpoint-every", "2",
                 "--keep-last", "3", "--out", str(run), "--no-progress", "--device", "cpu"]) == 0
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["ckpt-2", "ckpt-4", "ckpt-6"]
    return run


def _copy_run(run, dest):
    import shutil

    shutil.copytree(run, dest)
    return dest


def test_cli_resume_skips_a_corrupt_newest_checkpoint_with_a_note(tiny_run, tmp_path, capsys):
    from tightfit.cli import main

    run = _copy_run(tiny_run, tmp_path / "run")
    _flip_middle_byte(run / "checkpoints" / "ckpt-6" / "model.safetensors")
    (run / "checkpoints" / ".ckpt-8.k2j3h4g5.tmp").mkdir()
    (run / "checkpoints" / ".ckpt-8.k2j3h4g5.tmp" / "model.safetensors").write_bytes(b"x" * 2048)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "note: checkpoint ckpt-6 is corrupt (model.safetensors: checksum mismatch); resuming from ckpt-4" in out
    assert "note: removed .ckpt-8.k2j3h4g5.tmp" in out
    assert not (run / "checkpoints" / ".ckpt-8.k2j3h4g5.tmp").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["type"] != "plan" and any((r.get("resumed_from") or "").endswith("ckpt-4")
                                                for r in records if r["type"] == "plan")
    verify_checkpoint(run / "checkpoints" / "ckpt-6")  # rewritten by the resumed run: intact again


def test_cli_resume_with_no_intact_checkpoint_stops_with_one_line_and_writes_nothing(tiny_run, tmp_path,
                                                                                     capsys):
    from tightfit.cli import main

    run = _copy_run(tiny_run, tmp_path / "run")
    _truncate(run / "checkpoints" / "ckpt-6" / "state.pt")
    _truncate(run / "checkpoints" / "ckpt-4" / "model.safetensors")
    _flip_middle_byte(run / "checkpoints" / "ckpt-2" / "model.safetensors")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("tightfit: error: --resume") and "no intact checkpoint" in err and "\n" not in err
    assert "ckpt-6 is corrupt (state.pt: truncated" in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # metrics.jsonl untouched


class _Planted:
    """An object whose unpickling runs code: what a rewritten checkpoint file could hold."""
    ran = []

    def __reduce__(self):
        return (_Planted.ran.append, ("code ran",))


@pytest.mark.parametrize("where", ["none", "metadata", "dotted", "param_groups"])
def test_a_multi_process_checkpoint_loads_no_more_than_weights_only_allows(tmp_path, where):
    """DCP unpickled dcp/.metadata with pickle.load and the optimizer's param_groups with
    torch.load(weights_only=False): a file rewritten with its manifest ran any code it held on
    --resume. Both are now refused in one line, before anything of theirs is run."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tightfit.runtime.distributed import World
    from tightfit.runtime.sharded_checkpoint import DCP_DIR, load_sharded

    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    if where == "param_groups":
        optim_sd["param_groups"][0]["lr"] = _Planted()  # an item the load asks for
    folder = tmp_path / "ckpt-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / DCP_DIR), no_dist=True)
    torch.save({"rng": None, "step": 1}, folder / "state.pt")
    meta = folder / DCP_DIR / ".metadata"
    if where == "metadata":
        with open(meta, "rb") as f:
            m = pickle.load(f)
        m.planted = _Planted()
        with open(meta, "wb") as f:
            pickle.dump(m, f)
    if where == "dotted":  # an allowed module's import reached through a dotted name (protocol 4)
        module = "torch.distributed.checkpoint.metadata"
        meta.write_bytes(b"\x80\x04" + pickle.SHORT_BINUNICODE + bytes([len(module)]) + module.encode()
                         + pickle.SHORT_BINUNICODE + b"\x09os.getpid" + pickle.STACK_GLOBAL
                         + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP)
    _Planted.ran.clear()
    fresh = _model(1)
    if where == "none":
        load_sharded(folder, fresh, torch.optim.AdamW(fresh.parameters()), World(), verified=True)
        assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
        return
    with pytest.raises(CorruptCheckpointError, match=r"^checkpoint ckpt-1 is corrupt \(dcp"):
        load_sharded(folder, fresh, torch.optim.AdamW(fresh.parameters()), World(), verified=True)
    assert _Planted.ran == []


def test_a_multi_process_checkpoint_that_does_not_fit_or_cannot_be_read_says_why(tmp_path):
    """DCP wraps a rank's error in a CheckpointException whose text says only "ranks:dict_keys([0])":
    the message now gives the rank's own error, and a file cut short is corrupt, not a model that
    does not fit."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from tightfit.runtime.distributed import World
    from tightfit.runtime.sharded_checkpoint import DCP_DIR, load_sharded

    model = _model()
    folder = tmp_path / "ckpt-1"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(dict(zip(("model", "optim"), get_state_dict(model, torch.optim.AdamW(model.parameters())))),
                 checkpoint_id=str(folder / DCP_DIR), no_dist=True)
    other = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    with pytest.raises(TightfitError, match=r"does not fit the model: Size mismatch .* for model\.0\.weight"):
        load_sharded(folder, other, torch.optim.AdamW(other.parameters()), World(), verified=True)
    data = next((folder / DCP_DIR).glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(CorruptCheckpointError, match=r"ckpt-1 is corrupt \(dcp: cannot be read"):
        load_sharded(folder, model, torch.optim.AdamW(model.parameters()), World(), verified=True)


@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
def test_trainer_resume_refuses_a_flipped_byte_and_leaves_the_model_as_it_was(tmp_path, name):
    # Trainer.resume(path), the Python API's resume without the command line's latest_intact_checkpoint
    # in front of it, verifies the checksums itself: a flipped byte (same size, so only the SHA-256 can
    # tell) is refused before anything is loaded.
    from conftest import SyntheticBatches, params_of, tiny_bert
    from tightfit.plan import Plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    def trainer():
        w = Workload(tiny_bert(0.1), SyntheticBatches(24), None, 8)
        return Trainer(w, Plan("fp32", 4, 8), TrainConfig(epochs=1, lr=1e-2, checkpoint_dir=str(tmp_path),
                                                          checkpoint_every=2, background_checkpoints=False),
                       progress=False)

    trainer().fit()
    _flip_middle_byte(tmp_path / "ckpt-2" / name)
    fresh = trainer()
    before = params_of(fresh.model)
    with pytest.raises(CorruptCheckpointError, match=f"{name}: checksum mismatch"):
        fresh.resume(tmp_path / "ckpt-2")
    assert fresh.step == 0
    after = params_of(fresh.model)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_the_state_read_back_does_not_keep_its_file_mapped(tmp_path):
    """safetensors maps the file it loads; optimizer state left on those pages kept a pruned
    checkpoint's state.safetensors open (its disk space too) for the rest of a resumed run."""
    _save(tmp_path, [2])
    state = read_state(tmp_path / "ckpt-2")
    maps = Path("/proc/self/maps").read_text()
    assert state["optimizer"]["state"] and str(tmp_path / "ckpt-2" / "state.safetensors") not in maps


def test_an_atomic_folder_write_that_fails_leaves_the_folder_it_would_replace(tmp_path):
    """A checkpoint folder rewritten in place (the same step saved again after a resume) by a write
    that fails part-way (disk full, an interrupt): the old folder is whole and no temp folder is
    left. Deleting the old folder before the new one is complete loses the last good checkpoint."""
    import errno

    from tightfit.fileio import atomic_write_dir

    path = tmp_path / "ckpt-4"
    atomic_write_dir(path, lambda d: (d / "model.safetensors").write_bytes(b"old weights"))

    def fails(d):
        (d / "model.safetensors").write_bytes(b"new wei")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write_dir(path, fails)
    assert (path / "model.safetensors").read_bytes() == b"old weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-4"]
