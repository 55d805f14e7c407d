"""Selective freezing (``--trainable frozen-embeddings`` / ``frozen-N``): what is frozen, that it
stays bit-identical while the rest trains with dropout on, that the estimator and the time model
see what freezing saves, and that bad values and mismatched plans are refused in one line."""

import pytest
import torch

from conftest import SyntheticBatches, tiny_bert
from tightfit.cli import main
from tightfit.errors import TightfitError
from tightfit.levers.freezing import frozen_prefix_blocks, input_parameters
from tightfit.levers.trainable import apply_trainable, trainable_fields
from tightfit.memory.estimate import estimate
from tightfit.plan import Plan
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload


def prefix(model):
    return frozen_prefix_blocks(model, SyntheticBatches(8).worst_case(2))


def frozen_names(model):
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def test_frozen_embeddings_freezes_the_layers_before_the_first_block():
    model, note = apply_trainable(tiny_bert(), "frozen-embeddings")
    assert frozen_names(model) == {n for n, _ in tiny_bert().named_parameters() if n.startswith("bert.embeddings.")}
    assert "input layers frozen" in note and "parameters trainable" in note
    assert trainable_fields(model)["trainable"] == "frozen-embeddings"
    assert prefix(model) == 0  # block 0 trains: it keeps its activations


def test_frozen_n_freezes_the_first_n_blocks_too():
    model, _ = apply_trainable(tiny_bert(), "frozen-1")
    names = frozen_names(model)
    assert any(n.startswith("bert.encoder.layer.0.") for n in names)
    assert not any(n.startswith("bert.encoder.layer.1.") for n in names)
    assert not any(n.startswith(("bert.pooler.", "classifier.")) for n in names)
    assert prefix(model) == 1
    assert prefix(apply_trainable(tiny_bert(), "frozen-2")[0]) == 2
    assert prefix(tiny_bert()) == 0


def test_a_tied_output_layer_is_named_in_the_note():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2))
    model, note = apply_trainable(model, "frozen-embeddings")
    assert {n for n, _ in input_parameters(model)} == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert "lm_head.weight" in note and not model.lm_head.weight.requires_grad


@pytest.mark.parametrize("value, words", [
    ("frozen-3", "has 2 repeated blocks; freeze at most 2"),
    ("frozen-0", "must be all, lora, frozen-embeddings or frozen-N"),
    ("frozen", "must be all, lora, frozen-embeddings or frozen-N"),
    ("Frozen-1", "must be all, lora, frozen-embeddings or frozen-N"),
])
def test_bad_values_are_refused_in_one_line(value, words):
    with pytest.raises(TightfitError, match=words) as e:
        apply_trainable(tiny_bert(), value)
    assert "\n" not in str(e.value)


def test_a_model_without_blocks_cannot_freeze_its_input_layers():
    with pytest.raises(TightfitError, match="no repeated blocks"):
        apply_trainable(torch.nn.Sequential(torch.nn.Linear(2, 2)), "frozen-embeddings")


def test_plan_takes_the_freezing_values_and_refuses_others():
    assert Plan("fp32", 4, 8, trainable="frozen-2").trainable == "frozen-2"
    with pytest.raises(TightfitError, match="trainable"):
        Plan("fp32", 4, 8, trainable="frozen-x")


def test_frozen_weights_stay_bit_identical_while_the_rest_trains_with_dropout_on():
    model, _ = apply_trainable(tiny_bert(dropout=0.1), "frozen-1")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w = Workload(model, SyntheticBatches(16), SyntheticBatches(8, seed=1), 8)
    t = Trainer(w, Plan("fp32", 4, 8, trainable="frozen-1"), TrainConfig(epochs=1, lr=1e-2), progress=False)
    seen = []
    model.bert.encoder.layer[1].register_forward_hook(lambda m, a, o: seen.append(m.training))
    t.fit()
    assert seen[:4] == [True] * 4  # 2 steps x 2 micro-batches in train mode (dropout on); then evaluation
    assert len(t.optimizer.state) == sum(p.requires_grad for p in model.parameters())
    for n, p in model.named_parameters():
        if p.requires_grad:
            continue
        assert torch.equal(p, before[n]), n
    assert not torch.equal(model.classifier.weight, before["classifier.weight"])
    assert not torch.equal(model.bert.encoder.layer[1].output.dense.weight,
                           before["bert.encoder.layer.1.output.dense.weight"])


def test_a_plan_for_a_freezing_is_refused_for_a_model_that_is_not_frozen():
    w = Workload(tiny_bert(), SyntheticBatches(16), SyntheticBatches(8, seed=1), 8)
    with pytest.raises(TightfitError, match="freeze them first"):
        Trainer(w, Plan("fp32", 4, 8, trainable="frozen-1"), TrainConfig(epochs=1), progress=False)


def test_the_estimator_holds_no_gradients_state_or_activations_for_frozen_blocks():
    batch = SyntheticBatches(8).worst_case(2)
    full = estimate(tiny_bert(), batch, Plan("fp32", 8, 8))
    model, _ = apply_trainable(tiny_bert(), "frozen-2")
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    est = estimate(model, batch, Plan("fp32", 8, 8))
    # fp32 AdamW: 8 B of moments per trainable parameter (the moments are allocated per tensor, rounded)
    assert full.breakdown["optimizer_state"] - est.breakdown["optimizer_state"] >= 8 * frozen * 0.95
    # the blocks keep nothing for backward: what is left is the hidden state they hand on
    kept, trained = est.extra["block_forward_bytes"], full.extra["block_forward_bytes"]
    assert max(kept) < min(trained) / 4, (kept, trained)


def test_the_time_model_leaves_out_the_backward_and_recomputation_of_frozen_blocks():
    from tightfit.devices import get_profile
    from tightfit.planner.cost import TimeModel, forward_cost

    batches = SyntheticBatches(8)
    make = lambda mb, size: batches.worst_case(mb)  # noqa: E731
    profile = get_profile("h200")
    model, _ = apply_trainable(tiny_bert(), "frozen-1")
    frozen, free = TimeModel(profile, forward_cost(model, make, 8, 2)), TimeModel(profile, forward_cost(tiny_bert(), make, 8, 2))
    assert frozen.cost.free_blocks == 1
    # checkpointing the frozen block recomputes nothing; the trained one costs a recomputation
    assert frozen.step_seconds("bf16", 8, 8, 1) == frozen.step_seconds("bf16", 8, 8, 0)
    assert frozen.step_seconds("bf16", 8, 8, 2) > frozen.step_seconds("bf16", 8, 8, 1)
    assert frozen.micro_batch_parts("bf16", 8, 0)[0] < free.micro_batch_parts("bf16", 8, 0)[0]


def test_tightfit_plan_with_a_freezing_says_what_trains(capsys):
    assert main(["plan", "--model", "minilm", "--seq-len", "32", "--batch-size", "8", "--budget", "2GiB",
                 "--trainable", "frozen-3", "--json"]) == 0
    out = capsys.readouterr()
    assert '"trainable": "frozen-3"' in out.out and "first 3 of 6 blocks frozen" in out.err
    assert main(["plan", "--model", "minilm", "--seq-len", "32", "--batch-size", "8", "--budget", "2GiB",
                 "--trainable", "frozen-9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "freeze at most 6" in err[0]


def test_a_plan_does_not_checkpoint_frozen_first_blocks(capsys):
    """Checkpointing a block that keeps nothing recomputes nothing: the plan leaves those blocks
    out, and a plan that fits otherwise is not taken for one that pays for memory."""
    from tightfit.plan import without_free_blocks

    plan = Plan("bf16", 8, 8, activation_checkpointing=True)  # every block of 6
    assert without_free_blocks(plan, 2, 6).checkpoint_blocks == (2, 3, 4, 5)
    assert not without_free_blocks(Plan("bf16", 8, 8, activation_checkpointing=True, checkpoint_blocks=(0, 1)),
                                   2, 6).activation_checkpointing
    assert main(["plan", "--model", "minilm", "--seq-len", "64", "--batch-size", "32", "--budget", "4GiB",
                 "--trainable", "frozen-3"]) == 0
    out = capsys.readouterr().out
    assert "checkpointing 0 of 6 blocks" in out and "fits without accumulation, checkpointing" in out, out
    # nor does a runner-up's reason count them (BERT-base with 6 of 12 frozen: 6 recomputable)
    assert main(["plan", "--model", "bert-base", "--seq-len", "128", "--batch-size", "256", "--budget", "4GiB",
                 "--trainable", "frozen-6", "--json"]) == 0
    import json
    d = json.loads(capsys.readouterr().out)
    counts = [int(n) for c in d["runners_up"] for n in __import__("re").findall(r"checkpointing (\d+) block", c["why"])]
    assert all(n <= 6 for n in counts) and all(i >= 6 for c in d["runners_up"] for i in c["checkpoint_blocks"] or ())
    assert all(i >= 6 for i in d["checkpoint_blocks"])


def test_no_estimator_margin_for_checkpointing_only_frozen_first_blocks(capsys):
    """The planner keeps a margin for the estimator's error on checkpointed steps: checkpointing
    only frozen first blocks (which recompute nothing) is no such step. It was kept, and the plan
    split a batch that fits whole (16 x 2 where 32 x 1 fits)."""
    args = ["plan", "--model", "bert-base", "--batch-size", "32", "--seq-len", "128", "--gpu", "t4",
            "--budget", "2.38GiB", "--trainable", "frozen-3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "micro-batch 32 x 1" in out and "estimator_margin" not in out, out


def _bert_base(dropout=0.1):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(num_labels=2, hidden_dropout_prob=dropout,
                                                    attention_probs_dropout_prob=dropout))


@pytest.mark.gpu
@pytest.mark.parametrize("trainable", ["frozen-embeddings", "frozen-6"])
def test_on_the_gpu_a_frozen_models_peak_is_the_estimators(trainable):
    """BERT-base seq 128, micro-batch 32, bf16, fp32 AdamW, frozen: the measured peak of three
    training steps (reserved, expandable segments) is the estimate within the project's 5%."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import gc

    model, _ = apply_trainable(_bert_base(), trainable)
    data = SyntheticBatches(96, seq_len=128, vocab=30000, pad_multiple=8)
    plan = Plan("bf16", 32, 32, device="cuda", trainable=trainable)
    predicted = estimate(model, data.worst_case(1), plan).peak_reserved_bytes
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # what this process holds already (e.g. cuBLAS workspaces of an earlier test's streams) is not this run's
    held = torch.cuda.memory_reserved()
    res = Trainer(Workload(model, data, SyntheticBatches(8, seq_len=128, vocab=30000), 32), plan,
                  # the estimate is the eager step's: CUDA graphs would add their pool (docs/cuda-graphs.md)
                  TrainConfig(epochs=1, lr=1e-5, checkpoint_every=10**6, cuda_graphs="off"), progress=False).fit()
    measured = torch.cuda.max_memory_reserved() - held
    assert res.steps == 3 and res.oom_recoveries == 0
    assert measured == pytest.approx(predicted, rel=0.05), (measured, predicted)
    del res
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_on_the_gpu_the_planner_plans_and_trains_a_frozen_model():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tightfit.devices import detect
    from tightfit.planner.gpu import plan_on_gpu

    model, _ = apply_trainable(_bert_base(), "frozen-6")
    w = Workload(model.cuda(), SyntheticBatches(256, seq_len=128, vocab=30000, pad_multiple=8),
                 SyntheticBatches(16, seq_len=128, vocab=30000), 128)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    plan = plan_on_gpu(w, detect(), 3 << 30, 128, compile="off")
    assert plan.trainable == "frozen-6" and plan.trainable_params < sum(p.numel() for p in model.parameters()) / 2
    res = Trainer(w, plan, TrainConfig(epochs=1, lr=1e-4), progress=False).fit()
    assert res.oom_recoveries == 0 and res.peak_reserved_bytes <= (3 << 30) + (32 << 20)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p, before[n]), n


def test_frozen_batchnorm_layers_keep_their_running_statistics():
    """A frozen stem or block computes the same function after training: its BatchNorm layers
    stay in eval mode (their running statistics were updated by every training forward), while
    the trained blocks' BatchNorm layers learn theirs."""
    import torch.nn.functional as F

    from tightfit import TrainStep

    class Block(torch.nn.Module):  # a residual block, as a CNN's stages repeat them
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            self.plain = torch.nn.BatchNorm2d(8, affine=False)  # no parameter to tell where it is

        def forward(self, x):
            return self.plain(torch.relu(self.bn(self.conv(x)))) + x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
            self.layers, self.fc = torch.nn.Sequential(*[Block() for _ in range(3)]), torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(self.layers(torch.relu(self.bn1(self.conv1(x)))).mean((2, 3)))

    torch.manual_seed(0)
    model = Net().eval()  # as a loaded model comes: the root in eval mode
    model, note = apply_trainable(model, "frozen-1")
    assert "3 BatchNorm layers keep their running statistics" in note  # the stem's, block 0's two
    assert model.layers[2].plain.training and not model.layers[0].plain.training
    frozen_bn = {n: b.clone() for n, b in model.named_buffers() if n.startswith(("bn1.", "layers.0."))}
    trained_bn = {n: b.clone() for n, b in model.named_buffers() if n.startswith("layers.2.")}
    step = TrainStep(Plan("fp32", 4, 4, trainable="frozen-1"), model, lr=1e-3,
                     loss=lambda m, b: F.cross_entropy(m(b["x"]), b["y"]))
    for _ in range(2):
        step({"x": torch.randn(4, 3, 32, 32), "y": torch.randint(0, 3, (4,))})
    buffers = dict(model.named_buffers())
    for n, b in frozen_bn.items():
        assert torch.equal(buffers[n], b), n
    assert any(not torch.equal(buffers[n], b) for n, b in trained_bn.items())


def test_freezing_that_leaves_nothing_to_train_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.raises(TightfitError, match="leaves no parameter to train"):
        apply_trainable(model, "frozen-2")


def test_the_python_plan_says_what_a_frozen_model_trains():
    import tightfit

    model, _ = apply_trainable(tiny_bert(), "frozen-1")
    batch = {k: v for k, v in SyntheticBatches(8).worst_case(4).items()}
    plan = tightfit.plan(model, batch, effective_batch=8, device="cpu")
    assert plan.trainable == "frozen-1"
    assert plan.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_blocks_that_run_no_backward_are_read_from_the_data_flow():
    """A trainable layer registered after the blocks but run before them (or between two blocks)
    sends a gradient through the frozen blocks: they keep activations. Counting by registration
    order took them for free, and the plan left them out of its checkpointing and time model."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Late(torch.nn.Module):  # the embedding registered last, run first
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
            self.head = torch.nn.Linear(8, 2)
            self.emb = torch.nn.Embedding(10, 8)

        def forward(self, input_ids):
            x = self.emb(input_ids)
            for b in self.blocks:
                x = b(x)
            return self.head(x.mean(1))

    batch = {"input_ids": torch.randint(0, 10, (2, 4))}
    model = Late()
    for b in model.blocks[:2]:
        b.requires_grad_(False)
    assert frozen_prefix_blocks(model, batch) == 0
    model.emb.requires_grad_(False)
    assert frozen_prefix_blocks(model, batch) == 2


def test_the_gpu_planners_calibrated_line_counts_passes_as_the_time_model_does():
    """The GPU planner's measured micro-batch line scaled candidates by 3 + checkpointed share,
    frozen first blocks included: it under-priced recomputation against the time model."""
    from types import SimpleNamespace

    from tightfit.devices import get_profile
    from tightfit.planner.cost import passes
    from tightfit.planner.gpu import MicroBatchLine

    assert passes(12, 6, 6) == 2.0 and passes(12, 6, 12) == 2.5 and passes(12, 0, 0) == 3.0
    step = lambda mb: SimpleNamespace(step_seconds=0.1 * mb, micro_batches=1, micro_batch=mb)  # noqa: E731
    none = SimpleNamespace(precision="bf16", checkpoint_blocks=tuple(range(6)), free_blocks=6, micro_batch=8)
    line = MicroBatchLine.fit(none, step(8), step(4), 12, get_profile("h200"))
    trained = SimpleNamespace(precision="bf16", checkpoint_blocks=tuple(range(12)), free_blocks=6, micro_batch=8)
    assert line.step_seconds(trained, 8, 12) / line.step_seconds(none, 8, 12) == pytest.approx(1.25)


def test_estimate_json_says_what_is_trained(capsys):
    import json

    assert main(["estimate", "--model", "minilm", "--seq-len", "32", "--micro-batch", "4", "--trainable", "frozen-2",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["trainable"] == "frozen-2" and plan["trainable_params"] > 0


def test_a_model_unfrozen_since_its_freezing_is_planned_as_it_trains_now():
    """Gradual unfreezing: after apply_trainable(model, "frozen-1") and unfreezing every
    parameter, tightfit.plan still labelled the plan frozen-1 (with every parameter counted as
    trained), and TrainStep refused the plan it had just made ("or plan with trainable all", an
    argument tightfit.plan does not have)."""
    import tightfit

    model, _ = apply_trainable(tiny_bert(0.0, 0), "frozen-1")
    assert trainable_fields(model)["trainable"] == "frozen-1"
    for p in model.parameters():
        p.requires_grad_(True)
    fields = trainable_fields(model)
    assert fields == {"trainable": "all", "trainable_params": sum(p.numel() for p in model.parameters())}
    batch = SyntheticBatches(8).collate(list(range(8)))
    plan = tightfit.plan(model, batch, effective_batch=8, device="cpu")
    assert plan.trainable == "all"
    tightfit.TrainStep(plan, model)(batch)


def test_the_label_says_what_is_frozen_after_a_second_freezing_or_a_partial_unfreezing():
    """apply_trainable(m, "frozen-1") then apply_trainable(m, "frozen-embeddings") left block 0
    frozen while the plan said frozen-embeddings; unfreezing block 0 alone (embeddings still
    frozen) was labelled "all"."""
    import tightfit

    model, _ = apply_trainable(tiny_bert(0.0, 0), "frozen-1")
    model, _ = apply_trainable(model, "frozen-embeddings")
    assert trainable_fields(model)["trainable"] == "frozen-1"
    for p in model.bert.encoder.layer[0].parameters():
        p.requires_grad_(True)
    assert trainable_fields(model)["trainable"] == "frozen-embeddings"
    batch = SyntheticBatches(8).collate(list(range(8)))
    plan = tightfit.plan(model, batch, effective_batch=8, device="cpu")
    assert plan.trainable == "frozen-embeddings"
    tightfit.TrainStep(plan, model)(batch)
