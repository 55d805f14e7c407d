import json

import torch

import pytest

from tightfit.devices import CUDA_CONTEXT_BYTES, SAFETY_MARGIN, get_profile, load_profiles
from tightfit.errors import TightfitError
from tightfit.plan import Plan
from tightfit.units import format_bytes, parse_size


@pytest.mark.parametrize("text,expected", [
    ("4GiB", 4 * 2**30), ("4 gib", 4 * 2**30), ("11GB", 11 * 10**9), ("512MiB", 512 * 2**20),
    ("3.5GiB", int(3.5 * 2**30)), ("2048", 2048), ("6G", 6 * 2**30), (4096, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4GiBB", "four GiB", "", "-1GiB", "0", "4 XB", "1.2.3GB"])
def test_parse_size_rejects(text):
    with pytest.raises(TightfitError):
        parse_size(text)


@pytest.mark.parametrize("text,message", [
    ("-1", "must be positive"), (-1, "must be positive"), ("-1GiB", "must be positive"), (0.0, "must be positive"),
    (4.5, "fraction of a byte"), ("4.5", "fraction of a byte"), ("4.5B", "fraction of a byte"), (True, "cannot read"),
    # whole bytes mistyped: the hint names them, not 4 billion GiB (found by a fresh user)
    ("4294967296.5", "give whole bytes, e.g. 4294967296$"), (6442450944.5, "give whole bytes, e.g. 6442450944$"),
    ("4.5", "e.g. 4.5GiB$"), (4.5, 'e.g. "4.5GiB"$'),
])
def test_parse_size_says_what_is_wrong(text, message):
    with pytest.raises(TightfitError, match=message):
        parse_size(text)


def test_parse_size_takes_a_whole_float_of_bytes():
    assert parse_size(4e9) == 4_000_000_000 and parse_size("0.5KB") == 500


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1536 * 2**10) == "1.50 MiB"
    assert format_bytes(None) == "-"


def test_plan_roundtrip_and_accumulation():
    plan = Plan("fp16", micro_batch=12, effective_batch=32, activation_checkpointing=True, device="cuda",
                budget_bytes=4 * 2**30, reasons=("a", "b"), probe_peak_reserved_bytes=123)
    assert plan.accumulation_steps == 3  # 12 + 12 + 8
    d = json.loads(plan.to_json())
    assert d["accumulation_steps"] == 3 and d["micro_batch"] == 12
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.with_micro_batch(6).accumulation_steps == 6
    assert plan.with_micro_batch(6).effective_batch == 32


def test_plan_rejects_bad_values():
    with pytest.raises(TightfitError):
        Plan("fp8", 1, 1)
    with pytest.raises(TightfitError):
        Plan("fp32", 0, 8)
    with pytest.raises(TightfitError):
        Plan.from_dict({"precision": "fp32", "micro_batch": 1, "effective_batch": 2, "colour": "red"})
    with pytest.raises(TightfitError):
        Plan.from_json("{not json")


def test_profiles_and_budget():
    p = get_profile("GTX_1650_Ti")
    assert p.total_bytes == 4 * 2**30 and p.compute_capability == (7, 5) and not p.fp16_tensor_cores
    assert p.budget_bytes() == int((4 * 2**30 - CUDA_CONTEXT_BYTES) * (1 - SAFETY_MARGIN))
    p = get_profile("gtx-1080-ti")
    assert p.fp16_tflops / p.fp32_tflops == pytest.approx(1 / 64)
    with pytest.raises(TightfitError, match="unknown GPU profile"):
        get_profile("gtx-9999")


def test_user_profile_file(tmp_path, monkeypatch):
    f = tmp_path / "cards.json"
    f.write_text(json.dumps([{"key": "my-card", "name": "My Card", "total_bytes": "6GiB",
                              "compute_capability": [7, 5], "fp16_tensor_cores": True, "bf16": False,
                              "fp32_tflops": 5, "fp16_tflops": 20, "bf16_tflops": 0,
                              "host_link_bytes_per_s": 12e9}]))
    monkeypatch.setenv("TIGHTFIT_GPU_PROFILES", str(f))
    assert get_profile("my-card").total_bytes == 6 * 2**30
    f.write_text('[{"key": "broken"}]')
    with pytest.raises(TightfitError, match="malformed GPU profile"):
        load_profiles()

    card = {"key": "my-card", "name": "My Card", "total_bytes": "6GiB", "compute_capability": [7, 5],
            "fp16_tensor_cores": True, "bf16": True, "fp32_tflops": 5, "fp16_tflops": 20, "bf16_tflops": 20,
            "host_link_bytes_per_s": 12e9}
    f.write_text(json.dumps([card]))  # a Turing card claiming bf16
    with pytest.raises(TightfitError, match="bf16 needs compute capability >= 8.0"):
        load_profiles()
    for bad in ({"total_bytes": 0}, {"fp16_tflops": 0}, {"fp32_tflops": float("nan")}):
        f.write_text(json.dumps([{**card, "compute_capability": [8, 6], **bad}]))
        with pytest.raises(TightfitError, match="must be positive|finite"):
            load_profiles()


def test_compile_is_offered_on_cuda_only_and_survives_the_plan_round_trip():
    from tightfit.levers.compile import compile_unavailable, is_compiled, compile_model, uncompile_model
    assert "CUDA" in compile_unavailable("cpu")
    plan = Plan("bf16", 64, 256, True, device="cuda", compile=True)
    assert Plan.from_dict(plan.to_dict()) == plan and Plan("fp32", 1, 1).compile is False
    m = torch.nn.Linear(2, 2)
    compile_model(m)  # compilation itself is lazy: nothing runs until the first call
    assert is_compiled(m)
    uncompile_model(m)
    assert not is_compiled(m) and m(torch.ones(1, 2)).shape == (1, 2)


def test_the_whole_model_scope_compiles_one_graph_and_survives_the_plan_round_trip():
    from conftest import tiny_bert
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.compile import WHOLE_MODEL, compile_model, compiled_call, is_compiled, uncompile_model
    bert = tiny_bert()
    compile_model(bert, WHOLE_MODEL)  # identical blocks, compiled whole all the same
    assert is_compiled(bert) and compiled_call(bert) is not None
    assert all(compiled_call(b) is None for b in find_blocks(bert))
    uncompile_model(bert)
    assert not is_compiled(bert) and compiled_call(bert) is None
    with pytest.raises(ValueError, match="scope"):
        compile_model(bert, "layers")
    plan = Plan("bf16", 64, 256, True, device="cuda", compile=True, compile_scope="model")
    assert Plan.from_dict(plan.to_dict()) == plan
    older = {k: v for k, v in plan.to_dict().items() if k != "compile_scope"}  # a plan written before the field
    assert Plan.from_dict(older).compile_scope is None
    with pytest.raises(TightfitError, match="compile scope"):
        Plan("bf16", 64, 256, compile=True, compile_scope="blocks")


def test_the_cuda_graph_scope_compiles_the_whole_model_and_recomputes_nothing():
    from conftest import tiny_bert
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.compile import GRAPHED, compile_model, compiled_call, is_compiled, is_graphed, uncompile_model
    bert = tiny_bert()
    compile_model(bert, GRAPHED)  # lazy: nothing compiles or records until the first call
    assert is_compiled(bert) and is_graphed(bert) and compiled_call(bert) is not None
    assert all(compiled_call(b) is None for b in find_blocks(bert))
    uncompile_model(bert)
    assert not is_compiled(bert) and not is_graphed(bert) and compiled_call(bert) is None
    plan = Plan("bf16", 64, 256, device="cuda", compile=True, compile_scope="model-graphs")
    assert Plan.from_dict(plan.to_dict()) == plan
    with pytest.raises(TightfitError, match="recompute nothing"):
        Plan("bf16", 64, 256, True, device="cuda", compile=True, compile_scope="model-graphs")
    with pytest.raises(TightfitError, match="recompute nothing"):
        Plan("bf16", 64, 256, device="cuda", compile=True, compile_scope="model-graphs", block_policies=("full",) * 2)


def test_gradients_a_replayed_graph_adds_into_live_outside_its_outputs():
    """cudagraph trees overwrite a run's outputs at the next run, a backward graph's gradients
    included: a ``.grad`` autograd took over from them would be overwritten by the next
    micro-batch. StableGrads gives every parameter the graph trains a ``.grad`` of its own before
    backward (views of one buffer), zeroed at each step's first micro-batch; a parameter the graph
    does not reach keeps ``.grad`` None. Eager here (no graph): the gradients are the eager ones."""
    from tightfit.levers.compile import StableGrads

    torch.manual_seed(0)
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
            self.unused = torch.nn.Linear(2, 2)  # a part of the model its forward does not run

        def forward(self, x):
            return self.body(x)

    model = Net()
    trained = list(model.body.parameters())
    xs = [torch.randn(3, 4) for _ in range(4)]
    reference = {}
    for step in range(2):  # eager accumulation of two micro-batches per step
        for x in xs[2 * step:2 * step + 2]:
            model(x).square().sum().backward()
        reference[step] = [p.grad.clone() for p in trained]
        model.zero_grad(set_to_none=True)
    grads = StableGrads()
    for step in range(2):
        for x in xs[2 * step:2 * step + 2]:
            out = model(x)
            grads.ensure({"logits": out})
            held = [p.grad for p in trained]
            assert all(g is not None and g._base is not None for g in held)  # views of the buffer, before backward
            out.square().sum().backward()
            assert all(p.grad is g for p, g in zip(trained, held))  # added into, not replaced
        assert all(torch.allclose(p.grad, r) for p, r in zip(trained, reference[step]))
        assert model.unused.weight.grad is None and model.unused.bias.grad is None
        model.zero_grad(set_to_none=True)  # as apply_update does: the next step's first micro-batch zeroes


def test_identical_blocks_are_compiled_one_by_one_and_other_models_whole():
    from conftest import tiny_bert
    from tightfit.levers.blocks import find_blocks
    from tightfit.levers.compile import compile_model, compile_scope, is_compiled, uncompile_model
    bert = tiny_bert()
    layers = find_blocks(bert)
    assert compile_scope(bert) == "blocks"
    compile_model(bert)
    assert is_compiled(bert) and bert._compiled_call_impl is None
    assert all(layer._compiled_call_impl is not None for layer in layers)
    uncompile_model(bert)
    assert not is_compiled(bert) and all(layer._compiled_call_impl is None for layer in layers)
    # blocks with hooks (all of them, forward or backward) would skip them when compiled alone
    for register in ("register_forward_hook", "register_full_backward_hook"):
        hooked = tiny_bert()
        for layer in find_blocks(hooked):
            getattr(layer, register)(lambda *a: None)
        assert compile_scope(hooked) == "model"
    # blocks of two widths (like ResNet's stages) share no compiled code: the whole model is compiled
    mixed = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8))
    mixed = torch.nn.Sequential(torch.nn.ModuleList([mixed[0], mixed[1]]), torch.nn.ModuleList([mixed[2], torch.nn.Linear(8, 8)]))
    assert compile_scope(mixed) == "model"
    compile_model(mixed)
    assert mixed._compiled_call_impl is not None


def test_compiled_blocks_checkpoint_around_the_compiled_call_with_eager_gradients(monkeypatch):
    """The wiring of regional compilation, with the compiler replaced by the identity (TorchInductor
    needs a GPU here): each block runs its class's forward, checkpointed blocks are recomputed
    outside it, and loss and gradients equal the eager model's."""
    from conftest import tiny_bert
    from tightfit.levers.checkpointing import set_activation_checkpointing
    from tightfit.levers.compile import compile_model
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn: (lambda *a, **k: calls.append(1) or fn(*a, **k)))
    ids = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 0])

    def grads(model):
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    ref_loss, ref = grads(tiny_bert())
    model = tiny_bert()
    set_activation_checkpointing(model, True, (0,))
    compile_model(model)
    loss, got = grads(model)
    n = len(model.bert.encoder.layer)
    assert len(calls) == n + 1  # every block once, the checkpointed one again in backward
    assert torch.equal(loss, ref_loss) and len(got) == len(ref)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, ref))
    # every block checkpointed, in either order: Hugging Face's hook (which may checkpoint inside
    # the compiled forward) gives way to tightfit's wrappers around the compiled call
    from tightfit.levers.blocks import find_blocks, is_checkpointed
    from tightfit.levers.checkpointing import hf_hook_active
    for hook_first in (True, False):
        model, calls[:] = tiny_bert(), []
        if hook_first:
            set_activation_checkpointing(model, True, None)
            assert hf_hook_active(model)
        compile_model(model)
        if not hook_first:
            set_activation_checkpointing(model, True, None)
        assert not hf_hook_active(model) and all(is_checkpointed(b) for b in find_blocks(model))
        loss, got = grads(model)
        assert len(calls) == 2 * n and torch.equal(loss, ref_loss)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, ref))


def test_a_compiled_plan_is_refused_where_compilation_cannot_run():
    from conftest import SyntheticBatches, tiny_bert
    from tightfit.errors import TightfitError
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload
    w = Workload(tiny_bert(), SyntheticBatches(8), None, 4)
    with pytest.raises(TightfitError, match="compiles the model"):
        Trainer(w, Plan("fp32", 4, 4, device="cpu", compile=True), TrainConfig(epochs=1), progress=False)


def test_the_compiled_call_slot_is_honoured_by_this_torch():
    """tightfit.levers.compile writes nn.Module's private compiled-call slot in one function;
    this fails on a torch release that stops reading it."""
    import torch
    from tightfit.levers.compile import compiled_call, set_compiled_call

    m = torch.nn.Linear(2, 2)
    x = torch.ones(1, 2)
    m.compile()  # the public method fills the slot that set_compiled_call writes
    assert compiled_call(m) is not None
    set_compiled_call(m, lambda *args, **kwargs: "replaced")
    assert m(x) == "replaced"
    set_compiled_call(m, None)
    assert compiled_call(m) is None and torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))


@pytest.mark.parametrize("name, cc, gib, key, fp16_ratio", [
    ("NVIDIA GeForce GTX 1660 SUPER", (7, 5), 6, "local", 1.0),  # sm_75 without tensor cores: no fp16 speed-up
    ("NVIDIA GeForce GTX 1650", (7, 5), 4, "local", 1.0),  # not the 1650 Ti's profile either
    ("NVIDIA GeForce GTX 1650 Ti", (7, 5), 4, "gtx-1650-ti", 1.0),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 80, "a100-80gb", 16.0),
    ("NVIDIA A100-SXM4-40GB", (8, 0), 40, "a100-40gb", 16.0),
    ("NVIDIA A100-PCIE-40GB", (8, 0), 40, "a100-40gb", 16.0),
    ("NVIDIA A100 80GB PCIe", (8, 0), 80, "a100-80gb", 16.0),
    ("NVIDIA GeForce RTX 3060 Ti", (8, 6), 8, "local", 8.0),  # no RTX 3060
    ("NVIDIA GeForce RTX 2060 SUPER", (7, 5), 8, "local", 8.0),  # no RTX 2060
    ("NVIDIA GeForce RTX 3060", (8, 6), 12, "rtx-3060", 25.5 / 12.7),
    ("NVIDIA H100 80GB HBM3", (9, 0), 80, "h100", 989 / 67),
    ("Tesla T4", (7, 5), 15, "t4", 65 / 8.1),
    ("NVIDIA GeForce GTX 1080 Ti", (6, 1), 11, "gtx-1080-ti", 1 / 64),
])
def test_detect_knows_real_cards_by_the_names_torch_gives_them(monkeypatch, name, cc, gib, key, fp16_ratio):
    """A GTX 16xx (no tensor cores) got the generic fp16 speed-up of 2; torch's A100 names matched no
    A100 profile, and an RTX 3060 Ti took the RTX 3060's by substring."""
    from types import SimpleNamespace

    from tightfit.devices import detect

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name=name, major=cc[0], minor=cc[1], total_memory=gib * 2**30, multi_processor_count=10))
    p = detect()
    assert (p.key, p.name, p.total_bytes) == (key, name, gib * 2**30)
    assert p.fp16_tflops / p.fp32_tflops == pytest.approx(fp16_ratio)
    assert p.fp16_tensor_cores == (fp16_ratio > 1)


@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_a_plan_replayed_as_cuda_graphs_resumes_compiled_without_them_under_cuda_graphs_off(graphs):
    """--cuda-graphs may change on resume: off, a plan compiled whole and replayed as CUDA graphs
    runs the same compiled graph without them, and its reasons say so."""
    from tightfit import api

    plan = Plan("bf16", 64, 256, device="cuda", compile=True, compile_scope="model-graphs", reasons=("planned",))
    recipe = api.TrainRecipe(api.TrainRequest(progress=False, cuda_graphs=graphs))
    recipe.resume_from, recipe.resume_state = "ckpt-2", {"plan": plan.to_dict()}
    resumed = recipe._choose_plan()
    if graphs == "auto":
        assert resumed == plan
    else:
        assert resumed.compile_scope == "model" and resumed.compile and not resumed.activation_checkpointing
        assert resumed.reasons == ("planned", "--cuda-graphs off on resume: compiled whole, not replayed as CUDA graphs")


def test_stable_gradients_cover_the_parameters_trained_now_in_their_own_layout():
    """Found by a review (eager stand-ins for the compiled call): a bare output that trains
    nothing, an input that requires grad, a first call that trains nothing, a parameter frozen or
    weights cast after the first call, and channels-last weights."""
    from tightfit.levers.compile import StableGrads, _trained_leaves

    frozen = torch.nn.Linear(4, 2).requires_grad_(False)
    assert _trained_leaves(frozen(torch.randn(3, 4))) == []  # a bare tensor: no Tensor.values() mistaken for a dict
    m, x = torch.nn.Linear(4, 2), torch.randn(3, 4, requires_grad=True)
    assert {id(t) for t in _trained_leaves(m(x))} == {id(m.weight), id(m.bias)}  # not the input

    sg = StableGrads()  # a first call that trains nothing is not remembered
    sg.ensure({"out": frozen(torch.randn(3, 4))})
    frozen.requires_grad_(True)
    sg.ensure({"out": frozen(torch.randn(3, 4))})
    assert frozen.weight.grad is not None

    net, sg = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), StableGrads()
    sg.ensure(net(torch.randn(3, 4)))
    net.zero_grad(set_to_none=True)
    net[0].weight.requires_grad_(False)  # frozen since: no zero .grad for weight decay to act on
    out = net(torch.randn(3, 4))
    sg.ensure(out)
    out.sum().backward()
    assert net[0].weight.grad is None and net[1].weight.grad is not None

    net.zero_grad(set_to_none=True)
    net.to(torch.bfloat16)  # cast since the first call: new buffers of the new dtype
    sg.ensure(net(torch.randn(3, 4, dtype=torch.bfloat16)))
    assert net[1].weight.grad.dtype == torch.bfloat16

    conv, sg = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last), StableGrads()
    sg.ensure(conv(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)))
    assert conv.weight.grad.stride() == conv.weight.stride()


def test_the_cuda_graph_scope_is_for_one_process_and_allows_blocks_that_keep_everything():
    Plan("bf16", 64, 256, device="cuda", compile=True, compile_scope="model-graphs", block_policies=("none",) * 2)
    with pytest.raises(TightfitError, match="one process"):
        Plan("bf16", 64, 512, device="cuda", compile=True, compile_scope="model-graphs", world_size=2, sharding="ddp")
