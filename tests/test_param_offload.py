"""Parameter offload (``--sharding fsdp-offload``): FSDP2 over a process group of one.

On the CPU the runtime's whole path runs (the one-process group, FSDP2's DTensor parameters,
AdamW over them, DCP checkpoints and resume, the OOM redo) without FSDP2's CPUOffloadPolicy
itself, which needs a GPU (the GPU tests below)."""

import math

import pytest
import torch

from distributed_worker import spawn
from test_distributed import _losses
from test_freezing import _bert_base

BASE = {"n": 24, "effective_batch": 8, "micro_batch": 4, "dropout": 0.1}  # dropout on: masks must match


def _same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


def test_one_process_fsdp_trains_as_the_plain_run(tmp_path):
    plain = spawn(BASE, 1, tmp_path)[0]
    off = spawn({**BASE, "sharding": "fsdp-offload"}, 1, tmp_path)[0]
    assert off["steps"] == plain["steps"] == 3
    assert _losses(off) == _losses(plain)  # one rank: the all-gather and reduce-scatter are copies
    _same_weights(off["weights"], plain["weights"])


def test_checkpoint_is_dcp_and_resume_is_exact(tmp_path):
    spec = {**BASE, "sharding": "fsdp-offload"}
    full = spawn({**spec, "checkpoint_dir": str(tmp_path / "full"), "checkpoint_every": 1}, 1, tmp_path)[0]
    ckpt = tmp_path / "full" / "ckpt-1"
    assert (ckpt / "dcp").is_dir() and not (ckpt / "model.safetensors").exists()
    resumed = spawn({**spec, "resume": str(ckpt)}, 1, tmp_path)[0]
    assert _losses(resumed) == _losses(full)[1:]  # dropout on, bit for bit
    _same_weights(resumed["weights"], full["weights"])


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_redoes_the_window_with_a_smaller_micro_batch(tmp_path, where):
    # An OOM in the second step's forward (or backward), once: the window is redone at micro-batch
    # 2 exactly as the plain one-process runtime redoes it (FSDP2 first ends the failed pass: a
    # backward that raised left its end-of-backward callback unrun, which would lose the root's
    # gradients in the redo).
    plain = spawn({**BASE, "oom": (0, 1), "oom_in": where}, 1, tmp_path)[0]
    hit = spawn({**BASE, "sharding": "fsdp-offload", "oom": (0, 1), "oom_in": where}, 1, tmp_path)[0]
    assert hit["oom_recoveries"] == plain["oom_recoveries"] == 1
    assert hit["micro_batch"] == 2 and hit["steps"] == 3
    assert _losses(hit) == _losses(plain)
    _same_weights(hit["weights"], plain["weights"])
    assert not torch.distributed.is_initialized()  # the trainer's one-process group was left


def test_the_offload_plan_holds_blocks_not_the_model_on_the_gpu():
    """The planner's arithmetic on the CPU: the GPU's share under parameter offload is the root's
    parameters and two blocks' (gathered in bf16, their gradients in fp32), far below the
    replicated state; the plan's micro-batch fits the budget where the model state would not."""
    from types import SimpleNamespace

    from conftest import SyntheticBatches, tiny_bert

    from tightfit.config import PlanOptions
    from tightfit.devices import get_profile
    from tightfit.planner.sharding import (choose_sharding, fsdp_plan, host_state_bytes, offload_backward_end_bytes,
                                           offload_gpu_bytes, offloaded_state_bytes)
    from tightfit.workload import Workload

    model = tiny_bert()
    n = sum(p.numel() for p in model.parameters())
    blocks = model.bert.encoder.layer
    block = sum(p.numel() for p in blocks[0].parameters())
    root = n - len(blocks) * block
    assert offloaded_state_bytes(model, "bf16") == root * 6 + 2 * block * 6
    assert offloaded_state_bytes(model, "fp32") == root * 8 + 2 * block * 8
    # the end of the backward: the root gathered, its gradient, and the fp32 reduce-scatter in and out
    assert offload_backward_end_bytes(model, "bf16") == root * 12 + 2 * block * 2
    assert offload_gpu_bytes(model, "bf16") == max(root * 12 + 2 * block * 2, root * 6 + 2 * block * 6)
    assert host_state_bytes(model) == 16 * n
    w = Workload(model, SyntheticBatches(64), None, 32)
    budget = 256 << 20  # a tiny model: the fixed temporaries (82 MiB, cuBLAS workspaces) dominate
    recipe = SimpleNamespace(req=SimpleNamespace(planning=PlanOptions()), workload=w, budget=budget,
                             profile=get_profile("h200"), model=model)
    plan = fsdp_plan(recipe, choose_sharding(model, 1, budget, "fsdp-offload", "bf16"), 1)
    assert plan.sharding == "fsdp-offload" and plan.world_size == 1 and plan.precision == "bf16"
    assert 1 <= plan.micro_batch and plan.predicted_peak_reserved_bytes <= budget
    assert any("parameter offload" in r for r in plan.reasons)


def test_under_parameter_offload_checkpointing_comes_first_for_any_fewer_micro_batches():
    from tightfit.planner.sharding import choose_checkpointing

    assert choose_checkpointing({False: (3, 0), True: (5, 0)}, 128) == [False, True]  # 43 -> 26: FSDP2 alone
    assert choose_checkpointing({False: (3, 0), True: (5, 0)}, 128, offload=True) == [True]
    assert choose_checkpointing({False: (64, 0), True: (96, 0)}, 128, offload=True) == [False, True]  # 2 -> 2


@pytest.mark.parametrize("argv, says", [
    (["--sharding", "fsdp-offload", "--device", "cpu"], "needs a CUDA GPU"),
    (["--sharding", "fsdp-offload", "--optimizer", "adamw8bit"], "does not go with it"),
    (["--sharding", "fsdp-offload", "--precision", "fp16"], "bf16 or fp32"),
])
def test_options_parameter_offload_cannot_run_are_refused_in_one_line(argv, says):
    from tightfit.config import PlanOptions
    from tightfit.errors import TightfitError

    kw = {"sharding": "fsdp-offload"}
    for k, v in zip(argv[2::2], argv[3::2]):
        kw[k.lstrip("-")] = v
    device = kw.pop("device", "cuda")
    with pytest.raises(TightfitError, match=says):
        PlanOptions(**kw).check_for_device(device)


@pytest.mark.gpu
def test_on_the_gpu_parameter_offload_trains_where_no_single_gpu_plan_fits(tmp_path, capsys):
    """BERT-base at 600 MiB: no single-GPU plan fits (`tightfit plan` refuses); parameter
    offload plans a micro-batch, verifies it with real steps, keeps the parameters in host
    memory, trains within the budget with dropout on, and resumes exactly from its DCP checkpoint."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import gc
    from types import SimpleNamespace

    from conftest import SyntheticBatches

    from tightfit.config import PlanOptions
    from tightfit.devices import detect
    from tightfit.planner.fsdp_probe import verify_micro_batch
    from tightfit.planner.sharding import choose_sharding, fsdp_plan
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    budget, profile = 600 << 20, detect()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total)

    def run(resume=None, steps=4):
        w = Workload(_bert_base(), SyntheticBatches(256, seq_len=128, vocab=30000, pad_multiple=8),
                     SyntheticBatches(16, seq_len=128, vocab=30000), 64)
        recipe = SimpleNamespace(req=SimpleNamespace(planning=PlanOptions()), workload=w, budget=budget,
                                 profile=profile, model=w.model)
        plan = fsdp_plan(recipe, choose_sharding(w.model, 1, budget, "fsdp-offload", "bf16"), 1)
        records = []
        t = Trainer(w, plan, TrainConfig(epochs=1, max_steps=steps, lr=1e-4, checkpoint_dir=str(tmp_path / "ck"),
                                         checkpoint_every=2, log_every=1, prefetch=False), log=records.append,
                    progress=False)
        if resume:
            t.resume(resume)
        else:
            verify_micro_batch(t)
        torch.cuda.reset_peak_memory_stats()
        res = t.fit()
        params_on = {p.device.type for p in t.model.parameters()}
        weights = {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()
                   if "position_ids" not in k}
        weights = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in weights.items()}
        t.world.close()
        return res, [r["loss"] for r in records if r["type"] == "train"], params_on, weights, plan

    try:
        from tightfit.cli import main

        # no single-GPU plan: `tightfit plan` plans parameter offload, as `tightfit train` takes it
        assert main(["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "64", "--budget", "600MiB"]) == 0
        assert "plan: parameter offload (--sharding fsdp-offload)" in capsys.readouterr().out
        full, losses, params_on, weights, plan = run()
        assert plan.sharding == "fsdp-offload" and full.steps == 4 and full.oom_recoveries == 0
        assert params_on == {"cpu"}  # the shards live in host memory
        assert full.peak_reserved_bytes <= budget
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] + 0.5
        again, losses2, _, weights2, _ = run(resume=str(tmp_path / "ck" / "ckpt-2"))
        assert losses2 == losses[2:]  # dropout on: the same masks, bit for bit
        for k in weights:
            assert torch.equal(weights[k], weights2[k]), k
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("options, offloads", [
    ({}, True),  # auto: no single-GPU plan holds the state -> parameter offload
    ({"sharding": "fsdp-offload"}, True),
    ({"optimizer": "adamw8bit"}, False),  # a lever asked for: its own refusal stands
    ({"precision": "fp16"}, False),
    ({"budget_bytes": 80_000}, False),  # offload's own GPU share (123 KiB) is over too
])
def test_train_takes_parameter_offload_when_no_single_gpu_plan_holds_the_state(options, offloads):
    """`tightfit train`'s budget check on a CUDA GPU (set by hand here: the check itself runs no
    GPU work): a budget below every single-GPU optimizer's model state falls back to parameter
    offload unless an option rules it out, where the refusal names it as a lever."""
    from conftest import tiny_bert

    from tightfit.api import TrainRecipe, TrainRequest
    from tightfit.devices import get_profile
    from tightfit.errors import TightfitError

    budget = options.pop("budget_bytes", 150_000)
    recipe = TrainRecipe(TrainRequest(progress=False, **options))
    model = tiny_bert()
    recipe.model, recipe.device, recipe.profile = model, "cuda", get_profile("h200")
    recipe.budget = budget  # 150 kB: below even 8-bit state with bf16 weights (164 KiB); offload's GPU share: 123 KiB
    if offloads:
        recipe._check_budget()
        assert recipe.offload_reason is not None and recipe._offloads()
    else:
        with pytest.raises(TightfitError, match="below the"):
            recipe._check_budget()
        assert recipe.offload_reason is None


def test_the_nothing_fits_advice_names_parameter_offload():
    from conftest import tiny_bert

    from tightfit.devices import get_profile
    from tightfit.errors import TightfitError
    from tightfit.planner.advice import check_model_state

    model = tiny_bert()
    with pytest.raises(TightfitError, match=r"--sharding fsdp-offload.*its GPU share is under the planned limit \(whether"):
        check_model_state(model, 150_000, "auto", True, 25e9, profile=get_profile("h200"))
    with pytest.raises(TightfitError, match=r"--sharding fsdp-offload.*still 45.04 KiB over"):  # the GPU share too
        check_model_state(model, 4 * sum(p.numel() for p in model.parameters()), "auto", True, 25e9,
                          profile=get_profile("h200"))
    # fp32 asked on a bf16 card: the share it would gather in fp32 (over 150 kB)
    with pytest.raises(TightfitError, match=r"--sharding fsdp-offload.*still [\d.]+ KiB over") as e:
        check_model_state(model, 150_000, "auto", True, 25e9, profile=get_profile("h200"), precision="fp32")
    # fp16 (which offload does not run): the line says what to ask for instead
    with pytest.raises(TightfitError, match=r"ask for it with --sharding fsdp-offload and --precision bf16 \(fp16"):
        check_model_state(model, 150_000, "auto", True, 25e9, profile=get_profile("h200"), precision="fp16")


def test_train_takes_parameter_offload_when_the_search_finds_nothing_that_fits(monkeypatch):
    """The state fits a single-GPU plan, but no step with its activations does (the single-GPU
    search's NothingFitsError): `tightfit train` then plans parameter offload, with the search's
    refusal as its first reason, and the model back in host memory."""
    from conftest import SyntheticBatches, tiny_bert

    from tightfit import api
    from tightfit.devices import get_profile
    from tightfit.planner.search import NothingFitsError
    from tightfit.workload import Workload

    def nothing(self):
        raise NothingFitsError("no micro-batch fits 1.00 MiB: the smallest step tried needs 2.00 MiB\n  levers ...")

    monkeypatch.setattr(api.TrainRecipe, "_cached_gpu_plan", nothing)
    recipe = api.TrainRecipe(api.TrainRequest(progress=False))
    model = tiny_bert()
    recipe.model, recipe.device, recipe.profile, recipe.budget = model, "cuda", get_profile("h200"), 256 << 20
    recipe.workload = Workload(model, SyntheticBatches(64), None, 32)
    plan = recipe._choose_plan()
    assert plan.sharding == "fsdp-offload" and plan.reasons[0].startswith("no single-GPU plan fits (nor with the optimizer levers): no micro-batch")
    recipe.offload_reason = None
    recipe.req = api.TrainRequest(progress=False, optimizer="adamw8bit")  # a lever asked for: the refusal stands
    with pytest.raises(NothingFitsError):
        recipe._choose_plan()
    from tightfit.runtime.distributed import World

    recipe.req, recipe.world = api.TrainRequest(progress=False), World(0, 2)  # rank 0 planning DDP's share
    with pytest.raises(NothingFitsError):
        recipe._choose_plan()
    assert recipe.offload_reason is None


def test_the_plan_says_it_offloads_and_the_summary_shows_host_memory():
    from tightfit.plan import Plan
    from tightfit.report.summary import plan_lines

    lines = plan_lines(Plan("bf16", 4, 8, True, device="cuda", sharding="fsdp-offload"))
    assert any(x.startswith("offload ") and "host memory" in x for x in lines)
    assert not any(x.startswith("offload ") for x in plan_lines(Plan("bf16", 4, 8, True, device="cuda")))


def test_loops_other_than_tightfits_refuse_a_parameter_offload_plan():
    from conftest import tiny_bert

    from tightfit import TrainStep
    from tightfit.errors import TightfitError
    from tightfit.integrations.hf import training_arguments
    from tightfit.integrations.lightning import trainer_arguments
    from tightfit.plan import Plan

    plan = Plan("fp32", 4, 8, device="cpu", sharding="fsdp-offload")
    model = tiny_bert()
    for call in (lambda: TrainStep(plan, model, torch.optim.AdamW(model.parameters())),
                 lambda: training_arguments(plan, output_dir="/tmp/unused"), lambda: trainer_arguments(plan)):
        with pytest.raises(TightfitError, match="does not offload parameters"):
            call()


def test_tightfit_plan_shows_the_offload_plan_train_would_take(capsys):
    """`tightfit plan` of BERT-base at 600 MiB: no single-GPU plan fits (every optimizer searched);
    it prints the parameter-offload plan `tightfit train` falls back to, and exits 0. With an
    optimizer lever asked for, offload is not for it: the refusal stands (exit 2) and names it."""
    import json

    from tightfit.cli import main

    args = ["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "32", "--budget", "600MiB"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plan = out["plan"]
    assert out["budget_bytes"] == 600 << 20 and out["predicted_peak_bytes"] == plan["predicted_peak_reserved_bytes"]
    assert out["predicted_samples_per_s"] is None and out["host_state_bytes"] > 0
    assert plan["sharding"] == "fsdp-offload" and plan["predicted_peak_reserved_bytes"] <= 600 << 20
    assert plan["reasons"][0].startswith("no single-GPU plan fits (nor with the optimizer levers)")
    assert main(args + ["--optimizer", "adamw8bit"]) == 2
    assert "--sharding fsdp-offload" in capsys.readouterr().err  # named, with --optimizer adamw


def test_tightfit_plan_json_has_the_same_keys_whether_or_not_one_gpu_fits(capsys):
    """`tightfit plan --json` of a model no single GPU holds printed the parameter-offload plan
    without checkpoint_blocks, block_policies, predicted_peak_allocated_bytes, breakdown,
    planning_seconds and breakdown_notes, keys of every plan that fits one GPU: a script that reads
    them failed on exactly the model that does not fit. Now every key is there (None where the
    offload planner computes no such figure), with host_state_bytes besides."""
    import json

    from tightfit.cli import main

    args = ["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "32", "--json", "--budget"]
    assert main(args + ["4GiB"]) == 0
    fits = json.loads(capsys.readouterr().out)
    assert fits["plan"]["sharding"] == "none"
    for budget in ("600MiB", "600MiB --sharding fsdp-offload --optimizer adamw"):  # fallen back to, asked for
        assert main(args + budget.split()) == 0
        offload = json.loads(capsys.readouterr().out)
        assert offload["plan"]["sharding"] == "fsdp-offload"
        assert list(offload) == [*fits, "host_state_bytes"], (list(offload), list(fits))
        assert offload["predicted_samples_per_s"] is None and offload["predicted_peak_allocated_bytes"] is None
        assert offload["planning_seconds"] > 0 and offload["runners_up"] == [] and offload["breakdown_notes"] == []
        assert offload["checkpoint_blocks"] == list(range(12))  # every block of BERT-base checkpointed


def test_tightfit_plan_says_how_long_an_offload_plan_took_as_it_says_for_any_other(capsys):
    """`tightfit plan` ends every single-GPU plan with "(planned in X s, no GPU used)"; a
    parameter-offload plan, asked for or fallen back to, printed no planning time at all."""
    import re

    from tightfit.cli import main

    args = ["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "32", "--budget"]
    for budget in ("600MiB --sharding fsdp-offload --optimizer adamw", "600MiB", "4GiB"):  # asked, fallen back, fits
        assert main(args + budget.split()) == 0
        lines = capsys.readouterr().out.splitlines()
        assert ("plan: parameter offload" in lines[1]) == (budget != "4GiB"), lines[1]
        assert re.fullmatch(r"\(planned in \d+\.\d s, no GPU used\)", lines[-1]), lines[-1]


def test_tightfit_plan_takes_sharding_and_says_when_offload_does_not_fit_either(capsys):
    """`tightfit plan --sharding fsdp-offload` plans it directly (what the refusals' offload line
    tells an optimizer asked for to do); where offload's share fits but no step with its
    activations does, the refusal says so; --sharding ddp|fsdp is for several GPUs."""
    import json

    from tightfit.cli import main

    args = ["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "32", "--budget", "600MiB"]
    assert main(args + ["--optimizer", "adamw", "--sharding", "fsdp-offload", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["sharding"] == "fsdp-offload" and plan["reasons"][0] == "--sharding fsdp-offload (asked for)"
    assert plan["micro_batch"] * plan["accumulation_steps"] >= 32 and plan["trainable_params"] > 0
    assert main(args[:-1] + ["500MiB", "--checkpointing", "off"]) == 2  # offload needs checkpointing there
    assert "parameter offload does not fit either: nothing fits" in capsys.readouterr().err
    assert main(args + ["--sharding", "fsdp"]) == 2
    assert "applies to several GPUs" in capsys.readouterr().err


def test_no_offload_micro_batch_fits_where_the_end_of_the_backward_does_not(monkeypatch):
    """The end of the backward, when the root's gradients are reduced, is a peak of its own under
    parameter offload (BERT-base at 400 MiB ran out at micro-batch 1 on the GPU where only the
    blocks' share was counted): a budget the activation line fits but that end does not plans
    nothing; a larger one plans the line's micro-batch, with the larger of the two peaks."""
    import importlib
    from types import SimpleNamespace

    from conftest import SyntheticBatches, tiny_bert

    from tightfit.planner.margins import HEADROOM
    from tightfit.planner.sharding import fsdp_micro_batch, offload_backward_end_bytes
    from tightfit.workload import Workload

    est = importlib.import_module("tightfit.memory.estimate")
    w = Workload(tiny_bert(), SyntheticBatches(64, seq_len=32), None, 8)
    weights = 4 * sum(p.numel() for p in w.model.parameters())
    monkeypatch.setattr(est, "estimate", lambda model, batch, plan, profile: SimpleNamespace(
        peak_reserved_bytes=weights + 1_000 * plan.micro_batch))  # fixed temporaries 0, 1 kB per sample
    end = offload_backward_end_bytes(w.model, "bf16")
    state = 1  # a GPU share the line alone would fit with room to spare
    assert fsdp_micro_batch(w, None, int(end / (1 - HEADROOM)) - 10, 1, "bf16", True, state_bytes=state) is None
    mb, peak = fsdp_micro_batch(w, None, int(end / (1 - HEADROOM)) + 10, 1, "bf16", True, state_bytes=state)
    assert mb == 8 and peak == end  # the whole share (8 samples): the end of the backward is the larger
