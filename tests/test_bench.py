"""The benchmark harness's pieces that run without a GPU: the calibrated time line, the
report's ratios and files, and bad input."""

import json
import math

import pytest
import torch

from tightfit.bench.report import ratios, write_report
from tightfit.cli import main
from tightfit.devices import get_profile
from tightfit.planner.gpu import MicroBatchLine
from tightfit.planner.probe import ProbeResult
from tightfit.planner.search import Candidate


def _cand(precision, mb, blocks):
    return Candidate(precision, mb, tuple(range(blocks)), 0, None, None)


def test_micro_batch_line_recovers_fixed_and_per_sample_cost():
    fixed, per = 0.030, 0.0002  # seconds per micro-batch, per sample
    big = ProbeResult(128, True, 1, 1, step_seconds=fixed + per * 128, micro_batches=1)
    small = ProbeResult(32, True, 1, 1, step_seconds=2 * (fixed + per * 32), micro_batches=2)
    line = MicroBatchLine.fit(_cand("bf16", 128, 12), big, small, 12, get_profile("h200"))
    assert line.fixed_s == pytest.approx(fixed) and line.per_sample_s == pytest.approx(per)
    # same precision and blocks: 256 samples as 2 x 128 cost two fixed costs
    assert line.step_seconds(_cand("bf16", 128, 12), 256, 12) == pytest.approx(2 * (fixed + per * 128))
    # no checkpointing: 3 passes instead of 4 -> three quarters of the time
    assert line.step_seconds(_cand("bf16", 256, 0), 256, 12) == pytest.approx(0.75 * (fixed + per * 256))
    # fp32 on the H200 profile: the per-sample term scales with the bf16/fp32 peak ratio
    p = get_profile("h200")
    assert line.step_seconds(_cand("fp32", 256, 12), 256, 12) == pytest.approx(
        fixed + per * 256 * p.bf16_tflops / p.fp32_tflops)


def _rows():
    return [
        {"setting": "no budget", "precision": "bf16", "samples_per_s": 1000.0},
        {"setting": "no budget", "precision": "fp16", "samples_per_s": 800.0},
        {"setting": "plain", "precision": "fp32", "fits": False},
        {"setting": "plain", "precision": "bf16", "samples_per_s": 500.0, "peak_reserved_bytes": 2**30},
        {"setting": "HF Trainer auto_find_batch_size", "precision": "bf16", "samples_per_s": 400.0},
        {"setting": "tightfit", "precision": "bf16", "samples_per_s": 600.0, "ooms_after_planning": 0,
         "steps": 300, "planning_seconds": 5.0},
    ]


def test_ratios_against_the_best_of_each_setting():
    r = ratios(_rows())
    assert r["vs no-budget best"] == pytest.approx(0.6)
    assert r["vs best plain PyTorch"] == pytest.approx(1.2)
    assert r["vs best HF Trainer"] == pytest.approx(1.5)
    assert math.isnan(ratios(_rows()[:2])["vs best HF Trainer"])


def test_report_files(tmp_path):
    res = {"workload": {"name": "bert-base-128@4GiB", "arch": "bert-base", "size": 128, "budget": "4GiB",
                        "effective_batch": 256}, "device": "NVIDIA H200", "torch": "2.11", "rows": _rows()}
    (tmp_path / "bert-base-128@4GiB.json").write_text(json.dumps(res))
    assert main(["bench", "report", str(tmp_path)]) == 0
    md = (tmp_path / "results.md").read_text()
    assert "| bert-base-128@4GiB | vs no-budget best | ≥ 0.80 | 0.60 | no |" in md
    assert "| bert-base-128@4GiB | vs best HF Trainer | ≥ 1.25 | 1.50 | yes |" in md
    assert (tmp_path / "results.csv").read_text().count("\n") == 1 + len(_rows())
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_report_keeps_three_digits_of_a_rate_under_100(tmp_path):
    """Found by a review: every rate was rounded to a whole number (a CPU smoke run's 1.40 and 1.85
    samples/s read "1" and "2"); from 100 up, whole numbers with thousands separators, as before."""
    rows = [{"setting": "no budget", "precision": "fp32", "samples_per_s": 1.4003599},
            {"setting": "tightfit", "precision": "fp32", "samples_per_s": 1.848, "planning_seconds": 5.1,
             "ooms_after_planning": 0, "steps": 5},
            {"setting": "plain", "precision": "bf16", "samples_per_s": 3321.4}]
    res = {"workload": {"name": "minilm-32@smoke", "arch": "minilm", "size": 32, "budget": "1GiB",
                        "effective_batch": 8}, "device": "cpu", "torch": "2.13", "rows": rows}
    (tmp_path / "minilm-32@smoke.json").write_text(json.dumps(res))
    assert main(["bench", "report", str(tmp_path)]) == 0
    table = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert [line.split(" | ")[6] for line in table[1:4]] == ["1.4", "1.85", "3,321"]


def test_bench_bad_input(tmp_path, capsys):
    assert main(["bench", "report", str(tmp_path)]) == 2  # no results
    if not torch.cuda.is_available():
        assert main(["bench", "run", "--workload", "bert-base-128@4GiB", "--out", str(tmp_path / "o")]) == 2
    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--out", str(tmp_path / "o"),
                 "--settings", "hf,nope"]) == 2
    assert "unknown settings: nope" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_report_refuses_what_is_not_a_bench_result(tmp_path, capsys):
    from tightfit.cli import main
    assert main(["bench", "report", str(tmp_path / "missing")]) == 2
    assert "not found" in capsys.readouterr().err
    (tmp_path / "one.json").write_text("{}")  # a result file named instead of its folder: not "not found"
    assert main(["bench", "report", str(tmp_path / "one.json")]) == 2
    assert "is a file, not a folder of benchmark results" in capsys.readouterr().err
    (tmp_path / "one.json").unlink()
    for text in ("{bad", '{"a": 1}', "[]"):
        (tmp_path / "x.json").write_text(text)
        assert main(["bench", "report", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tightfit: error:") and len(err.splitlines()) == 1
        assert not (tmp_path / "results.md").exists()



def test_report_refuses_a_result_that_lacks_what_the_tables_read(tmp_path, capsys):
    """A result with a workload and rows but without a field the tables read (edited by hand,
    written by another tool) ended in a KeyError's traceback: now one line naming the field."""
    workload = {"name": "bert-base-128@4GiB", "arch": "bert-base", "size": 128, "budget": "4GiB",
                "effective_batch": 256}
    whole = {"workload": workload, "device": "NVIDIA H200", "torch": "2.11", "rows": _rows()}
    for broken, named in (({**whole, "workload": {"name": "x"}}, "workload.arch"),
                          ({k: v for k, v in whole.items() if k != "device"}, "device"),
                          ({**whole, "rows": [*_rows(), {"samples_per_s": 1.0}]}, "rows[6].setting"),
                          ({**whole, "rows": [{k: v for k, v in r.items() if k != "steps"} for r in _rows()]},
                           "rows[5].steps")):
        (tmp_path / "x.json").write_text(json.dumps(broken))
        assert main(["bench", "report", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tightfit: error:") and named in err[0], err
        assert not (tmp_path / "results.md").exists()

def test_every_row_leaves_out_the_same_warm_up_steps():
    """tightfit's and plain rows timed the steps after the first ``warmup``; the HF Trainer row
    left out one more (its slice started a step later), which favoured it while its early steps
    were still slow. One rule now times them all (tightfit.bench.settings.speed_after_warmup)."""
    import inspect

    from tightfit.bench import peers
    from tightfit.bench.settings import speed_after_warmup

    ends = [1.0, 2.0, 3.0, 4.0, 6.0]  # steps 1-5 end at these times; step 5 takes 2 s
    assert speed_after_warmup(ends, 3, 10) == 10 * 2 / 3  # steps 4 and 5: from the end of step 3 to 6.0
    assert speed_after_warmup(ends, 0, 10) == 10 * 4 / 5 and speed_after_warmup(ends, 4, 10) == 10 * 1 / 2
    assert speed_after_warmup(ends, 5, 10) is None
    assert "speed_after_warmup(" in inspect.getsource(peers.hf_trainer)


def test_report_into_a_read_only_folder_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """Results read from a read-only copy (a mount, a checkout): the report's first write raised
    OSError's traceback. Now one line, before anything is drawn or written."""
    import tempfile
    from pathlib import Path

    res = {"workload": {"name": "bert-base-128@4GiB", "arch": "bert-base", "size": 128, "budget": "4GiB",
                        "effective_batch": 256}, "device": "NVIDIA H200", "torch": "2.11", "rows": _rows()}
    (tmp_path / "bert-base-128@4GiB.json").write_text(json.dumps(res))
    real_dir, real_file = tempfile.mkdtemp, tempfile.mkstemp

    def refused(real):  # nothing can be created in tmp_path, as on a read-only mount
        def make(*a, dir=None, **k):
            if dir is not None and Path(dir) == tmp_path:
                raise OSError(30, "Read-only file system", str(dir))
            return real(*a, dir=dir, **k)
        return make

    monkeypatch.setattr(tempfile, "mkdtemp", refused(real_dir))
    monkeypatch.setattr(tempfile, "mkstemp", refused(real_file))
    assert main(["bench", "report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a writable folder" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert-base-128@4GiB.json"]


def test_a_result_records_a_command_that_re_runs_it(tmp_path, monkeypatch, capsys):
    """The command in <workload>.json was joined unquoted: with --out "my results" it read as two
    words, a command that does not run the benchmark again."""
    import shlex

    from tightfit.bench import peers

    monkeypatch.setattr(peers, "hf_trainer", lambda w, precision, ck, *a, **k: {
        "setting": "HF Trainer auto_find_batch_size", "precision": precision, "samples_per_s": 1.0})
    out = tmp_path / "my results"
    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--out", str(out), "--device", "cpu",
                 "--settings", "hf", "--steps", "3", "--warmup", "1"]) == 0
    argv = shlex.split(json.loads((out / "minilm-32@smoke.json").read_text())["command"])
    assert argv[argv.index("--out") + 1] == str(out) and argv[:3] == ["tightfit", "bench", "run"]


def test_a_result_records_the_tightfit_version_that_measured_it(tmp_path, monkeypatch):
    """<workload>.json recorded the torch, transformers and Python versions, not tightfit's own:
    a result could not be told from one of another planner."""
    import tightfit
    from tightfit.bench import peers

    monkeypatch.setattr(peers, "hf_trainer", lambda w, precision, ck, *a, **k: {
        "setting": "HF Trainer auto_find_batch_size", "precision": precision, "samples_per_s": 1.0})
    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--out", str(tmp_path), "--device", "cpu",
                 "--settings", "hf", "--steps", "3", "--warmup", "1"]) == 0
    assert json.loads((tmp_path / "minilm-32@smoke.json").read_text())["tightfit"] == tightfit.__version__


def test_a_cpu_run_without_settings_runs_the_smoke_test(tmp_path, monkeypatch):
    """--device cpu runs only the HF Trainer peer, yet without --settings it was refused
    ("--device cpu runs only --settings hf"): the CPU's default is now that one setting."""
    import shlex

    from tightfit.bench import peers

    monkeypatch.setattr(peers, "hf_trainer", lambda w, precision, ck, *a, **k: {
        "setting": "HF Trainer auto_find_batch_size", "precision": precision, "samples_per_s": 1.0})
    assert main(["bench", "run", "--workload", "minilm-32@smoke", "--out", str(tmp_path), "--device", "cpu",
                 "--steps", "3", "--warmup", "1"]) == 0
    argv = shlex.split(json.loads((tmp_path / "minilm-32@smoke.json").read_text())["command"])
    assert argv[argv.index("--settings") + 1] == "hf"


def test_report_without_matplotlib_writes_its_tables_and_says_the_chart_is_not_drawn(tmp_path, capsys, monkeypatch):
    """matplotlib is optional (the plots extra): without it the report wrote results.md and
    results.csv, then ended in ModuleNotFoundError's traceback at the chart. Now the tables are
    written, the chart is not, and a note says why; exit 0, as a run's plots are skipped."""
    import sys

    res = {"workload": {"name": "bert-base-128@4GiB", "arch": "bert-base", "size": 128, "budget": "4GiB",
                        "effective_batch": 256}, "device": "NVIDIA H200", "torch": "2.11", "rows": _rows()}
    (tmp_path / "bert-base-128@4GiB.json").write_text(json.dumps(res))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["bench", "report", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert-base-128@4GiB.json", "results.csv", "results.md"]
    note, *files = out.out.splitlines()  # the command line's notes are on stdout, as train's are
    assert note.startswith("note: results.png not drawn") and "matplotlib" in note, out
    assert [f.rsplit("/", 1)[-1] for f in files] == ["results.md", "results.csv"] and not out.err, out
