"""CUDA graphs for the eager step (tightfit.runtime.graphs): which plans may use them (CPU), and on a
GPU that replayed steps train exactly as eager steps do -- dropout on, the learning rate schedule
moving, a non-finite step skipped on the device, a resume from a checkpoint -- and that a capture
the memory budget cannot hold, or that fails, leaves the run eager and unchanged."""

import dataclasses
import json

import pytest
import torch

from conftest import SyntheticBatches, assert_same_params, params_of, tiny_bert
from tightfit.plan import Plan
from tightfit.runtime.graphs import graphs_unavailable
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload

EAGER = Plan("bf16", 8, 8, device="cuda")


@pytest.mark.parametrize("change, why", [
    (dict(device="cpu"), "not on a CUDA GPU"),
    (dict(compile=True), "compiles"),
    (dict(activation_checkpointing=True), "recomputes"),
    (dict(block_policies=("offload", "none")), "offloads"),
    (dict(precision="fp16"), "loss scaler"),
    (dict(optimizer="adamw8bit"), "adamw8bit is not captured"),
    (dict(micro_batch=4), "accumulates"),
    (dict(sharding="ddp", world_size=2, micro_batch=4), "processes"),
    (dict(sharding="fsdp-offload"), "parameter offload (FSDP2)"),
])
def test_only_plain_eager_plans_of_one_micro_batch_are_replayed(change, why):
    model = tiny_bert()
    assert graphs_unavailable(EAGER, model) is None
    assert graphs_unavailable(Plan("fp32", 8, 8, device="cuda"), model) is None
    assert why in graphs_unavailable(dataclasses.replace(EAGER, **change), model)


def test_a_model_with_a_hook_is_not_replayed():
    """A replay runs no Python: a hook that counts or records would silently stop."""
    model = tiny_bert()
    handle = model.bert.encoder.layer[1].register_forward_hook(lambda m, i, o: None)
    assert "bert.encoder.layer.1 has a hook" in graphs_unavailable(EAGER, model)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
    try:
        assert "a global module hook" in graphs_unavailable(EAGER, model)
    finally:
        handle.remove()
    assert graphs_unavailable(EAGER, model) is None


def test_a_parameter_hook_or_a_compiled_submodule_is_not_replayed():
    model = tiny_bert()
    handle = model.classifier.weight.register_hook(lambda g: g)
    assert "classifier.weight has a hook" in graphs_unavailable(EAGER, model)
    handle.remove()
    model.bert.encoder.layer[0].compile()  # the user's own: compiled at its first call, maybe at the capture
    assert "bert.encoder.layer.0 is compiled by torch.compile" in graphs_unavailable(EAGER, model)


def test_eager_steps_beside_replays_update_at_the_rate_a_replay_reads():
    """A replay's fused update reads its rate from an fp32 tensor; the eager steps of a run with
    graphs take the same rounded rate, and the groups keep the schedule's value outside the step."""
    import struct

    from tightfit.runtime.graphs import fp32_rates

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1e-4 / 3)
    rate = opt.param_groups[0]["lr"]
    with fp32_rates(opt):
        inside = opt.param_groups[0]["lr"]
    assert inside != rate and inside == torch.tensor(rate, dtype=torch.float32).item()
    assert inside == struct.unpack("f", struct.pack("f", inside))[0]  # an fp32 value: as the tensor holds it
    assert opt.param_groups[0]["lr"] == rate


def test_on_the_cpu_the_trainer_runs_eager_steps_and_says_why():
    w = Workload(tiny_bert(0.1), SyntheticBatches(16), None, 8)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1), progress=False)
    assert t._graphs is None and t.graphs_off == "not on a CUDA GPU"
    off = Trainer(Workload(tiny_bert(0.1), SyntheticBatches(16), None, 8), Plan("fp32", 8, 8),
                  TrainConfig(epochs=1, cuda_graphs="off"), progress=False)
    assert off.graphs_off == "--cuda-graphs off"


# ---------------------------------------------------------------------------------------- on a GPU
KEPT = ("type", "step", "epoch", "loss", "lr", "grad_norm", "stepped", "micro_batch", "accuracy", "eval_loss")


def _run(tmp_path, name, graphs="auto", plan=EAGER, data=None, model=None, epochs=3, resume=None, log_every=1,
         **cfg):
    """Train ``tiny_bert`` (dropout 0.1) on CUDA with bf16 autocast and fused AdamW; returns the
    trainer and its metrics records (timings left out)."""
    records = []
    w = Workload((model or tiny_bert(0.1, 0)).cuda(), data or SyntheticBatches(84, seq_len=12),
                 SyntheticBatches(8, seed=1), plan.effective_batch)
    torch.manual_seed(5)
    t = Trainer(w, plan, TrainConfig(epochs=epochs, lr=1e-3, seed=3, log_every=log_every, cuda_graphs=graphs,
                                     checkpoint_dir=str(tmp_path / name), checkpoint_every=12, **cfg),
                log=records.append, progress=False)
    if resume:
        t.resume(resume)
    t.fit()
    return t, _kept(records)


def _kept(records: list) -> str:
    """The records' values that must not change, as JSON (a NaN loss equals a NaN loss there)."""
    return json.dumps([{k: v for k, v in r.items() if k in KEPT} for r in records if r.get("type") != "event"])


@pytest.mark.gpu
@pytest.mark.parametrize("log_every", [1, 10])
def test_steps_replayed_as_cuda_graphs_train_exactly_as_eager_steps(tmp_path, log_every):
    """Windows of 8 samples padded to their longest text (several shapes) and a last window of 4:
    with dropout on and the learning rate moving every step, the replayed run logs the same losses,
    rates and gradient norms and ends with the same weights, bit for bit. ``log_every=10``: most
    steps are queued before the last one's values are read (the default run-ahead)."""
    graphed, graphed_records = _run(tmp_path, "graphed", log_every=log_every)
    eager, eager_records = _run(tmp_path, "eager", graphs="off", log_every=log_every)
    assert eager._graphs is None and eager.result.graphed_steps == 0
    assert graphed.result.step_graphs >= 2 and graphed.result.graphed_steps >= 20, graphed.result
    assert graphed._graphs.off is None
    assert len({r["lr"] for r in json.loads(graphed_records) if r["type"] == "train"}) > 20 // log_every
    assert graphed_records == eager_records
    assert_same_params(params_of(graphed.model), params_of(eager.model))
    assert any("CUDA graphs:" in e for e in graphed.result.events)
    # the optimizer as the eager run left it: its groups (a float learning rate, capturable as it was)
    # and its state (moments and step counters), bit for bit
    a, b = graphed.optimizer.state_dict(), eager.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for k in a["state"][i]:
            assert torch.equal(a["state"][i][k], b["state"][i][k]), (i, k)


@pytest.mark.gpu
def test_a_run_resumed_with_cuda_graphs_continues_exactly(tmp_path):
    full, full_records = _run(tmp_path, "full", keep_last=10)
    resumed, resumed_records = _run(tmp_path, "resumed", resume=str(tmp_path / "full" / "ckpt-12"), keep_last=10)
    assert resumed.result.graphed_steps > 0
    assert_same_params(params_of(resumed.model), params_of(full.model))
    after = [r for r in json.loads(full_records) if r["step"] > 12]
    assert json.loads(resumed_records) == after


@pytest.mark.gpu
def test_the_checkpoint_at_the_end_holds_the_state_the_run_ended_with(tmp_path):
    """The end's checkpoint is copied from the GPU by the writer thread while the model is
    evaluated (tightfit.runtime.async_checkpoint, ``last``): it holds the weights and the
    optimizer state the run ended with, bit for bit."""
    from safetensors.torch import load_file

    from tightfit.runtime.checkpoint import read_state, verify_checkpoint

    t, _ = _run(tmp_path, "end", keep_last=10)
    end = tmp_path / "end" / f"ckpt-{t.step}"
    assert t.step % 12 and verify_checkpoint(end)  # not also a checkpoint of the grid: the end's own
    weights = load_file(end / "model.safetensors")
    assert all(torch.equal(weights[k], v.cpu()) for k, v in t.model.state_dict().items() if k in weights)
    state = read_state(end)["optimizer"]["state"]
    for i, p in enumerate(t.optimizer.param_groups[0]["params"]):
        assert torch.equal(state[i]["exp_avg_sq"], t.optimizer.state[p]["exp_avg_sq"].cpu())


@pytest.mark.gpu
def test_a_graphed_run_leaves_no_memory_behind(tmp_path):
    """Run after run in one process (a notebook, a test suite, a bench), the memory allocated
    afterwards does not grow: the captures' stream, whose cuBLAS workspaces live as long as the
    process, is made once (a stream per run left 65 MiB behind each time on an H100)."""
    import gc

    after = []
    for name in ("first", "second", "third"):
        t, _ = _run(tmp_path, name, epochs=1)
        assert t.result.graphed_steps > 0
        del t
        gc.collect()
        torch.cuda.empty_cache()
        after.append(torch.cuda.memory_allocated())
    assert after[1] == after[0] and after[2] == after[0], after


class _PoisonedBatches(SyntheticBatches):
    """Every seventh sample starts with token 49, whose embedding is made huge (finite, so that
    checkpoints take it): windows holding one overflow to non-finite gradients, the others train."""

    def __init__(self, n):
        super().__init__(n, seq_len=12)
        self.ids = torch.where(self.ids == 49, 48, self.ids)
        self.ids[::7, 0] = 49


@pytest.mark.gpu
def test_a_nonfinite_step_replayed_is_skipped_on_the_device_as_the_eager_step_skips_it(tmp_path):
    def model():
        m = tiny_bert(0.1, 0)
        with torch.no_grad():
            m.bert.embeddings.word_embeddings.weight[49] = 3e38
        return m

    graphed, graphed_records = _run(tmp_path, "graphed", data=_PoisonedBatches(84), model=model(),
                                    max_skipped_steps=1000)
    eager, eager_records = _run(tmp_path, "eager", graphs="off", data=_PoisonedBatches(84), model=model(),
                                max_skipped_steps=1000)
    assert graphed.result.graphed_steps > 0 and 0 < graphed.result.skipped_steps < graphed.result.steps
    assert graphed_records == eager_records
    assert_same_params(params_of(graphed.model), params_of(eager.model))


@pytest.mark.gpu
def test_no_capture_where_the_budget_cannot_hold_the_graphs(tmp_path):
    """A budget just above what the weights and state take: every key is declined, the run is eager."""
    tight = dataclasses.replace(EAGER, budget_bytes=16 * 2**20)
    t, records = _run(tmp_path, "tight", plan=tight, epochs=1)
    eager, eager_records = _run(tmp_path, "eager", graphs="off", plan=tight, epochs=1)
    assert t._graphs is not None and t.result.graphed_steps == 0 and t._graphs._declined
    assert t.result.graphs_off == "the budget cannot hold a step's graph beside an eager step"
    assert records == eager_records


def _run_with_loss(around, graphs: str):
    """Two epochs of ``tiny_bert`` (dropout on) whose task loss is wrapped: ``around(loss_fn, model,
    batch)`` returns the loss; returns the trainer and its records."""
    records = []
    w = Workload(tiny_bert(0.1, 0).cuda(), SyntheticBatches(84, seq_len=12), None, 8)
    task_loss = w.loss_sum
    w.loss_sum = lambda model, batch: around(task_loss, model, batch)
    torch.manual_seed(5)
    t = Trainer(w, EAGER, TrainConfig(epochs=2, lr=1e-3, seed=3, log_every=1, cuda_graphs=graphs),
                log=records.append, progress=False)
    t.fit()
    return t, _kept(records)


def _syncing(loss_fn, model, batch):
    loss = loss_fn(model, batch)
    float(loss.detach())  # a host sync: forbidden while capturing
    return loss


def _drawing_on_the_cpu(loss_fn, model, batch):
    keep = float(torch.rand(())) < 2.0  # a CPU draw (always True), as LayerDrop decides a layer
    return loss_fn(model, batch) * keep


@pytest.mark.gpu
@pytest.mark.parametrize("around, why", [(_syncing, "the step reads a value on the host"),
                                         (_drawing_on_the_cpu, "the step draws random numbers on the CPU")])
def test_a_step_that_a_replay_would_not_repeat_is_not_captured_and_trains_as_eager(around, why):
    """A loss that reads a value on the host cannot be captured (the capture would fail, and torch
    2.11 then keeps its memory); one that draws on the CPU generator (LayerDrop) would have its
    capture's draw repeated by every replay. The watched eager steps see either: graphs turn off
    before any capture, and the run trains exactly as without graphs."""
    graphed, graphed_records = _run_with_loss(around, "auto")
    eager, eager_records = _run_with_loss(around, "off")
    assert graphed._graphs.captured == 0 and graphed.result.graphed_steps == 0
    assert graphed._graphs.off.startswith(why)
    assert any(e.startswith(f"CUDA graphs not used: {why}") for e in graphed.result.events)
    assert graphed_records == eager_records
    assert_same_params(params_of(graphed.model), params_of(eager.model))


def test_host_syncs_takes_this_threads_sync_warnings_only(monkeypatch):
    """The watch on an eager step: torch's sync warnings from this thread are taken (not shown),
    any other warning, and another thread's sync warning, are shown as usual; the mode comes back."""
    import threading
    import warnings

    from tightfit.runtime import graphs

    modes = [0]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append(m))
    found = []
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with graphs.host_syncs(found):
            assert modes[-1] == "warn"
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("called a synchronizing CUDA operation")
            warnings.warn("something else", DeprecationWarning)
            other = threading.Thread(target=lambda: warnings.warn("called a synchronizing CUDA operation"))
            other.start()
            other.join()
    assert found == ["called a synchronizing CUDA operation"] * 2
    assert sorted(str(w.message) for w in shown) == ["called a synchronizing CUDA operation", "something else"]
    assert modes[-1] == 0


def test_the_summary_says_a_graphed_run_is_measured_against_an_eager_probe():
    """The planner's probe times eager steps: a run that replayed graphs says so beside its ratio,
    and its summary counts the replays; an eager run's rows say neither."""
    from types import SimpleNamespace

    from tightfit.report.speed import speed_record, speed_rows
    from tightfit.report.summary import summary_rows

    ends = [(0.01 * s, 32 * s) for s in range(1, 31)]
    result = SimpleNamespace(step_ends=ends, samples_per_s=3200.0, eval_seconds=0.5, checkpoint_seconds=0.1,
                             checkpoint_write_seconds=1.0, graphed_steps=28, step_graphs=2, graph_pool_bytes=2**20)
    rows = dict(speed_rows(speed_record(result, 1.0, {"probed_samples_per_s": 1000.0})))
    assert rows["steady / probed"] == "3.20 (the probe timed eager steps; this run replayed CUDA graphs)"
    eager = dict(speed_rows(speed_record(SimpleNamespace(**{**vars(result), "graphed_steps": 0}), 1.0,
                                         {"probed_samples_per_s": 1000.0})))
    assert eager["steady / probed"] == "3.20"
    info = SimpleNamespace(majority=0.5, budget_bytes=None, peak_rss_bytes=None, max_temp_c=None)
    base = dict(eval=None, steps=30, samples=960, train_seconds=0.3, samples_per_s=3200.0, final_loss=0.1,
                peak_reserved_bytes=None,
                skipped_steps=0, oom_recoveries=0, plan=None)
    graphed = dict(summary_rows(SimpleNamespace(**base, graphed_steps=28, step_graphs=2, graph_pool_bytes=2**20), info))
    assert graphed["CUDA graphs"].startswith("28 steps replayed from 2 captured step graphs")
    assert "CUDA graphs" not in dict(summary_rows(SimpleNamespace(**base, graphed_steps=0), info))


def test_the_summary_says_why_a_gpu_run_replayed_no_cuda_graphs():
    """A run on CUDA that replayed no step says why (the plan, the step, the budget) in its summary
    and summary.json's speed record; a CPU run, where graphs never apply, has no such row."""
    from types import SimpleNamespace

    from tightfit.report.speed import speed_record
    from tightfit.report.summary import summary_rows

    info = SimpleNamespace(majority=0.5, budget_bytes=None, peak_rss_bytes=None, max_temp_c=None)
    why = "the plan accumulates several micro-batches per step"
    base = dict(eval=None, steps=30, samples=960, train_seconds=0.3, samples_per_s=3200.0, final_loss=0.1,
                peak_reserved_bytes=None, skipped_steps=0, oom_recoveries=0, graphed_steps=0, graphs_off=why)
    rows = dict(summary_rows(SimpleNamespace(**base, plan=Plan("bf16", 8, 16, device="cuda")), info))
    assert rows["CUDA graphs"] == f"not used: {why}"
    assert "CUDA graphs" not in dict(summary_rows(SimpleNamespace(**base, plan=Plan("fp32", 8, 16)), info))
    stopped = dict(summary_rows(SimpleNamespace(**{**base, "graphed_steps": 5, "step_graphs": 1,
                                                   "graph_pool_bytes": 2**20, "graphs_off": "capture failed: X"},
                                                plan=Plan("bf16", 8, 8, device="cuda")), info))
    assert stopped["CUDA graphs"].endswith("; then off: capture failed: X")
    result = SimpleNamespace(step_ends=[], samples_per_s=1.0, eval_seconds=0.0, checkpoint_seconds=0.0,
                             checkpoint_write_seconds=0.0, graphed_steps=0, graphs_off=why)
    assert speed_record(result, 1.0, {})["graphs_off"] == why


def test_a_trainer_records_why_its_steps_were_not_replayed(tmp_path):
    w = Workload(tiny_bert(0.1), SyntheticBatches(16), None, 8)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, checkpoint_dir=None), progress=False)
    assert t.fit().graphs_off == "not on a CUDA GPU"


# ------------------------------------------------- StepGraphs' decisions, on the CPU, with a fake CUDA
class _FakeGraph:
    def __init__(self):
        self.replays = self.resets = 0

    def replay(self):
        self.replays += 1

    def reset(self):
        self.resets += 1


class _Fake:
    """A fake CUDA around :class:`StepGraphs`: the allocator's counters, a capture that runs the
    (fake) step once in place, and a step that records what it saw (the learning rate, whether it
    ran under capture) and can sync, draw on the CPU or create the optimizer's state."""

    def __init__(self, monkeypatch):
        import contextlib
        import warnings

        from tightfit.runtime import graphs

        self.allocated, self.need, self.reserved_growth = 1000, 100, 50
        self.reserved, self.capturing, self.sync, self.draw, self.fail = 0, False, False, False, False
        self.calls, self.generator_resets = [], 0
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.allocated + self.need)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: ("pool",))
        monkeypatch.setattr(cuda, "CUDAGraph", _FakeGraph)
        monkeypatch.setattr(cuda, "get_sync_debug_mode", lambda: 0)
        monkeypatch.setattr(cuda, "set_sync_debug_mode", lambda mode: None)
        self.stream_made, self.stream_error, self.streams_made = True, None, 0

        def capture_stream(device):
            if self.stream_error is not None:
                raise self.stream_error
            self.streams_made += not self.stream_made
            self.stream_made = True
            return "stream"
        monkeypatch.setattr(graphs, "capture_stream", capture_stream)
        monkeypatch.setattr(graphs, "_stream_made", lambda device: self.stream_made)
        monkeypatch.setattr(graphs, "_end_generator_capture", lambda device: setattr(
            self, "generator_resets", self.generator_resets + 1))

        @contextlib.contextmanager
        def capture(graph, pool=None, stream=None, capture_error_mode=None):
            assert pool == ("pool",) and stream == "stream" and capture_error_mode == "thread_local"
            self.capturing = True
            try:
                yield
            finally:
                self.capturing = False
                self.reserved += self.reserved_growth
        monkeypatch.setattr(cuda, "graph", capture)

        def step(model, micro_batches, loss_sum, normaliser, optimizer, scaler, autocast_ctx, max_grad_norm,
                 defer=False):
            next(iter(micro_batches))
            group = optimizer.param_groups[0]
            self.calls.append(("capture" if self.capturing else "eager", group["lr"], group["capturable"]))
            if self.fail and self.capturing:
                raise RuntimeError("operation not permitted when stream is capturing")
            if self.sync:
                warnings.warn("called a synchronizing CUDA operation")
            if self.draw:
                torch.rand(())
            if not optimizer.state:  # the first step makes the state
                optimizer.state[group["params"][0]] = {"step": torch.zeros(())}
            from tightfit.step import PendingStep
            return PendingStep(torch.tensor([1.0, 0.5]))
        monkeypatch.setattr(graphs, "training_step", step)

    def graphs(self, budget=10**6):
        from tightfit.runtime.graphs import StepGraphs

        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1e-4 / 3)
        return StepGraphs(torch.nn.Linear(2, 2), opt, None, None, None, 1.0, budget)


def _batch(n=4, t=8):
    return iter([{"input_ids": torch.zeros(n, t, dtype=torch.long), "labels": torch.zeros(n, dtype=torch.long)}])


def test_a_shape_is_captured_at_its_first_measured_step_then_replayed(monkeypatch):
    """Step 1 makes the optimizer's state (not measured), step 2 is measured and watched clean,
    step 3 captures and replays, step 4 replays; the capture sees the rate as a tensor and
    capturable on, the eager steps the fp32-rounded rate, and the groups get their own back."""
    fake = _Fake(monkeypatch)
    sg = fake.graphs()
    rate = sg.optimizer.param_groups[0]["lr"]
    for _ in range(4):
        sg.step(_batch(), 4)
    rounded = torch.tensor(rate, dtype=torch.float32).item()
    assert [c[0] for c in fake.calls] == ["eager", "eager", "capture"]
    assert fake.calls[0][1] == fake.calls[1][1] == rounded != rate and fake.calls[0][2] is False
    assert torch.is_tensor(fake.calls[2][1]) and fake.calls[2][2] is True
    assert sg.optimizer.param_groups[0]["lr"] == rate and sg.optimizer.param_groups[0]["capturable"] is False
    assert sg.captured == 1 and sg.replayed == 2 and sg.pool_bytes == sg.pool_peak == 50 and sg.off is None
    assert sg._lrs[0].item() == rounded  # written before the replays
    other = _batch(4, 16)  # a new shape: eager, measured (no watch once a step was seen clean), then captured
    sg.step(other, 4)
    sg.step(_batch(4, 16), 4)
    assert [c[0] for c in fake.calls][-2:] == ["eager", "capture"] and sg.captured == 2
    sg.release()
    assert sg.pool_bytes == 0 and sg.pool_peak == 100 and not sg._graphs
    sg.step(_batch(), 4)  # known and measured: captured again at once
    assert fake.calls[-1][0] == "capture" and sg.captured == 3


def test_a_shape_the_budget_cannot_hold_runs_eagerly(monkeypatch):
    fake = _Fake(monkeypatch)
    sg = fake.graphs(budget=1150)  # 1000 allocated + 2 x 100 needed > 95% of 1150
    for _ in range(5):
        sg.step(_batch(), 4)
    assert [c[0] for c in fake.calls] == ["eager"] * 5 and sg.captured == 0 and sg._declined
    assert sg.why_none() == "the budget cannot hold a step's graph beside an eager step"


def test_a_run_whose_shapes_never_came_again_says_so(monkeypatch):
    fake = _Fake(monkeypatch)
    sg = fake.graphs()
    for t in (8, 16, 24):  # the first makes the optimizer's state; each later shape is seen once
        sg.step(_batch(4, t), 4)
    assert sg.replayed == 0 and sg.off is None and sg.why_none().startswith("no batch shape came again")
    assert "(3 steps in this session;" in sg.why_none()


class _BackedOffGraphs:
    """Stands in for StepGraphs on the CPU: runs out of memory on micro-batches over 4 samples."""

    def __init__(self):
        from tightfit.runtime.graphs import StepGraphs

        self.why_none = StepGraphs.why_none.__get__(self)
        self.replayed = self.captured = self.pool_peak = self.declined = self.seen = 0
        self.off, self.calls = None, 0

    def release(self):
        pass

    def step(self, micro_batches, normaliser):
        from tightfit.step import PendingStep

        batch = next(micro_batches)
        self.seen += 1
        if batch["labels"].shape[0] > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        self.replayed += 1
        return PendingStep(torch.tensor([1.0, 0.5]))


def test_a_run_whose_back_off_split_its_steps_says_so():
    """After an out-of-memory back-off the windows run as several micro-batches, eagerly: the run
    says that, not that no batch shape came twice."""
    w = Workload(tiny_bert(0.1), SyntheticBatches(32), None, 8)
    t = Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, grow_back_after=0), progress=False)
    t._graphs = _BackedOffGraphs()
    r = t.fit()
    assert r.oom_recoveries == 1 and t._graphs.seen == 1 and r.steps == 4
    assert r.graphs_off == "since an out-of-memory back-off the steps run as micro-batches of 4, eagerly"


def test_the_captures_stream_is_counted_before_it_is_made_and_its_failure_turns_graphs_off(monkeypatch):
    """Where the captures' stream is not made yet, the check counts its cuBLAS workspaces first: a
    budget that holds the graph but not them declines without making the stream; one that holds
    both makes it, then captures. A stream that cannot be made (out of memory) turns graphs off
    and the step runs eagerly: no error reaches the trainer, whose back-off would halve the
    micro-batch for an allocation the step never made."""
    from tightfit.runtime.graphs import FIT, STREAM_WORKSPACE_BYTES

    fake = _Fake(monkeypatch)
    fake.stream_made = False
    sg = fake.graphs(budget=int((1000 + 2 * 100 + STREAM_WORKSPACE_BYTES) / FIT) - 1)
    for _ in range(4):
        sg.step(_batch(), 4)
    assert sg.declined == 1 and fake.streams_made == 0 and sg.replayed == 0
    fake = _Fake(monkeypatch)
    fake.stream_made = False
    sg = fake.graphs(budget=int((1000 + 2 * 100 + STREAM_WORKSPACE_BYTES) / FIT) + 1)
    for _ in range(4):
        sg.step(_batch(), 4)
    assert fake.streams_made == 1 and sg.captured == 1 and sg.replayed == 2
    fake = _Fake(monkeypatch)
    fake.stream_made, fake.stream_error = False, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32 MiB")
    sg = fake.graphs(budget=10**9)
    for _ in range(4):
        sg.step(_batch(), 4)
    assert sg.off.startswith("the captures' stream could not be made: OutOfMemoryError")
    assert [c[0] for c in fake.calls] == ["eager"] * 4 and sg.captured == 0


def test_steps_that_sync_twice_turn_graphs_off_before_any_capture(monkeypatch):
    fake = _Fake(monkeypatch)
    fake.sync = True
    sg = fake.graphs()
    sg.step(_batch(), 4)
    assert sg.off is None  # once may be a lazy initialisation
    for _ in range(4):
        sg.step(_batch(), 4)
    assert sg.off.startswith("the step reads a value on the host (called a synchronizing CUDA operation)")
    assert [c[0] for c in fake.calls] == ["eager"] * 5


def test_a_step_that_draws_on_the_cpu_turns_graphs_off_at_once(monkeypatch):
    fake = _Fake(monkeypatch)
    fake.draw = True
    sg = fake.graphs()
    for _ in range(3):
        sg.step(_batch(), 4)
    assert sg.off.startswith("the step draws random numbers on the CPU") and sg.captured == 0


def test_a_capture_that_fails_turns_graphs_off_and_that_step_runs_eagerly(monkeypatch):
    fake = _Fake(monkeypatch)
    fake.fail = True
    sg = fake.graphs()
    for _ in range(4):
        sg.step(_batch(), 4)
    assert [c[0] for c in fake.calls] == ["eager", "eager", "capture", "eager", "eager"]
    assert sg.off.startswith("capture failed: RuntimeError") and fake.generator_resets == 1
    assert sg.optimizer.param_groups[0]["lr"] == 1e-4 / 3 and sg.captured == 0 and sg._pool is None
