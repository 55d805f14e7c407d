"""Faults a careful user found (a review helper, 2026-12-07): each reproduced, then fixed."""

import pytest

from conftest import tiny_cpu_job


def _train_args(job, out):
    return ["train", "--model", job["model"], "--data", job["data"], "--batch-size", "8", "--max-steps", "2",
            "--seq-len", "16", "--out", str(out), "--no-progress"]


def test_an_out_that_is_a_link_to_nothing_is_refused_in_one_line_before_any_work(tmp_path, capsys):
    """It planned, then crashed in the run folder's mkdir (FileExistsError, 29 lines, exit 1)."""
    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "run")
    capsys.readouterr()
    assert main(_train_args(job, link)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {link} is a link to nothing" in err, err
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()
    loop = tmp_path / "loop"  # a link to itself leads nowhere either, but not for want of a folder
    loop.symlink_to(loop)
    assert main(_train_args(job, loop)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {loop} is a link in a loop of links" in err, err


def test_a_run_stopped_non_finite_before_any_checkpoint_says_to_start_again_elsewhere(tmp_path, capsys):
    """Its advice (a lower --lr) followed with the same --out was refused (the folder holds a
    run), and --resume too (no checkpoint): the message now says how to start again."""
    from tightfit.cli import main

    job = tiny_cpu_job(tmp_path)
    out = tmp_path / "run"
    assert main(_train_args(job, out) + ["--lr", "1e308"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"no checkpoint could be written, and {out} holds none to continue from: start again with "
                        f"another --out, or delete {out} first"), err
    assert main(_train_args(job, tmp_path / "again") + ["--lr", "1e-3"]) == 0  # as it says


def test_an_int8_export_whose_config_has_other_labels_than_its_weights_is_refused(tmp_path):
    """config.json is not hashed: edited to 5 labels, it loaded a head printing out_features=5 that
    gave 2 logits (a quantized Linear takes its packed weights without a shape check)."""
    import json

    from conftest import tiny_text_model_folder

    from tightfit.errors import TightfitError
    from tightfit.export import WEIGHTS_FILE, export_int8, load_int8

    model = tiny_text_model_folder(tmp_path, ["good", "bad"], hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32, max_position_embeddings=32)
    out = tmp_path / "int8"
    export_int8(model, out)
    load_int8(out)  # as exported: loads
    config = json.loads((out / "config.json").read_text())
    config.update(num_labels=5, id2label={str(i): str(i) for i in range(5)}, label2id={str(i): i for i in range(5)})
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(TightfitError, match=rf"{WEIGHTS_FILE}: weights do not match config.json \(classifier: "
                                            rf"\(2, 16\) packed for a 16 -> 5 layer\)"):
        load_int8(out)


def test_an_image_list_row_naming_the_list_itself_is_refused_with_its_row(tmp_path):
    """It said "l.csv: not a readable image", which reads as if the list itself were broken."""
    Image = pytest.importorskip("PIL.Image")
    from tightfit.errors import TightfitError
    from tightfit.images import load_image_classification

    rows = ["path,label"]
    for c, v in (("a", 30), ("b", 200)):
        for k in range(3):
            Image.new("RGB", (4, 4), (v, k, 0)).save(tmp_path / f"{c}{k}.png")
            rows.append(f"{c}{k}.png,{c}")
    listing = tmp_path / "l.csv"
    listing.write_text("\n".join(rows + ["l.csv,a"]) + "\n")
    with pytest.raises(TightfitError, match=r"l\.csv: row 7: l\.csv is this list itself, not an image file$"):
        load_image_classification(str(listing))
