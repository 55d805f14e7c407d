"""``tightfit bench --suite seeds``: the suite's plumbing on the CPU with tiny configs (the real
suite needs a CUDA GPU: bench/seeds.sh)."""

import json

import pytest
import torch

pytest.importorskip("sklearn")

from tightfit.bench.seeds import ARTICLE_ROWS, SeedsConfig, run_seeds  # noqa: E402
from tightfit.cli import main  # noqa: E402


def test_seeds_suite_plumbing_on_the_cpu(tmp_path):
    from transformers import BertConfig, ViTConfig, ViTForImageClassification

    BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64).save_pretrained(tmp_path / "bert")
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=64, num_labels=2)
                              ).save_pretrained(tmp_path / "vit")
    out = tmp_path / "out"
    res = run_seeds(out, SeedsConfig(bert=str(tmp_path / "bert"), seq_len=16, bert_steps=3, warmup=1,
                                     vit=str(tmp_path / "vit"), image_size=16, vit_batch=16, vit_epochs=0.1,
                                     device="cpu"))
    assert sorted(p.name for p in out.iterdir()) == ["seeds-bert.png", "seeds-vit.png", "seeds.json", "seeds.md"]
    rows = res["bert"]["rows"]
    assert [r["setting"] for r in rows[:3]] == [name for name, *_ in ARTICLE_ROWS]
    for r, (_, prec, micro, eff, ck) in zip(rows, ARTICLE_ROWS):  # each configuration ran as the table says
        assert (r["precision"], r["micro_batch"], r["effective_batch"]) == (prec, micro, eff)
        assert (r["checkpointed_blocks"] > 0) == ck and r["predicted_peak_reserved_bytes"] > 0
        assert r["samples_per_s"] > 0 and r["it_per_s"] == pytest.approx(r["samples_per_s"] / eff)
    # tightfit's plan for the card: predicted without a GPU under the GTX 1080 Ti's rules (fp32 on Pascal)
    assert rows[3]["precision"] == "fp32" and rows[3]["effective_batch"] == 32
    assert res["bert"]["budget_bytes"] < 11 * 2**30 and "1080 Ti" in res["bert"]["card"]
    vit = res["vit"]
    assert set(vit["runs"]) == {"fp32", "tightfit"} and vit["runs"]["fp32"]["plan"]["precision"] == "fp32"
    assert vit["accuracy_loss"] == pytest.approx(vit["runs"]["fp32"]["accuracy"] - vit["runs"]["tightfit"]["accuracy"])
    assert vit["met"]["effective batch >= 16"]
    md = (out / "seeds.md").read_text()
    assert "FP16 + gradient accumulation, effective batch 32" in md and "accuracy loss < 2 points" in md
    assert json.loads((out / "seeds.json").read_text())["vit"]["runs"]["tightfit"]["steps"] >= 1


def test_seeds_suite_needs_a_gpu_or_says_how_to_call_it(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    assert main(["bench", "--suite", "seeds", "--out", str(tmp_path / "s")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert "--suite seeds --out DIR" in capsys.readouterr().err
