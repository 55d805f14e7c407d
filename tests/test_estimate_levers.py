"""``tightfit estimate`` with the optimizer levers: its help names them, the gradients it reports
are in the weights' dtype (bf16 under ``adamw8bit-bf16``), and a precision or card that bf16
weights cannot train with is refused in one line whose advice the command accepts."""

import pytest

from tightfit.cli import main

ARGS = ["estimate", "--model", "minilm", "--seq-len", "16", "--micro-batch", "2"]


def test_the_help_names_every_optimizer_the_command_accepts(capsys):
    from tightfit.step import OPTIMIZERS

    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for kind in OPTIMIZERS:
        assert kind in text, kind


def test_bf16_weights_report_their_gradients_in_bf16(capsys):
    """MiniLM at micro-batch 2 holds every gradient at the peak: in bf16 (2 B per weight) that is
    all of them, so no note says that only some are held (it said so, comparing them with the
    fp32 gradients' bytes)."""
    import json

    from tightfit.levers.optimizers import trainable_gradient_bytes
    from tightfit.models import build_model
    model = build_model("minilm")[0]
    fp32 = trainable_gradient_bytes(model)
    assert trainable_gradient_bytes(model, "adamw8bit-bf16") == fp32 // 2
    assert main([*ARGS, "--precision", "bf16", "--optimizer", "adamw8bit-bf16", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["breakdown"]["gradients"] >= fp32 // 2 and d["notes"] == [], d["notes"]


@pytest.mark.parametrize("extra, says", [
    ([], "not --precision fp32: use --precision bf16"),  # estimate's default precision is fp32; it has no "auto"
    (["--precision", "bf16", "--gpu", "gtx-1650-ti"], "use --optimizer adamw8bit or adamw-offload"),
])
def test_bf16_weights_refused_with_advice_the_command_accepts(capsys, extra, says):
    assert main([*ARGS, "--optimizer", "adamw8bit-bf16", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "adamw8bit-bf16" in err and says in err and "or auto" not in err, err
