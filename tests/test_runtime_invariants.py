"""More runtime invariants (DESIGN "Invariants the runtime keeps"): token-level accumulation with
padding, checkpointing with dropout and frozen inputs, flat memory over a long logging loop,
thermal cool-down, and health monitoring without NVML."""

import gc
import os
import signal
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from conftest import LMBatches, SyntheticBatches, tiny_bert, tiny_gpt2
from tightfit.levers.checkpointing import set_activation_checkpointing
from tightfit.plan import Plan
from tightfit.runtime.health import HealthMonitor
from tightfit.runtime.trainer import TrainConfig, Trainer
from tightfit.workload import Workload, causal_lm_loss_sum, count_target_tokens


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("micro_batch", [1, 3, 4])
def test_token_level_accumulation_with_padding_equals_one_big_batch(micro_batch):
    data = LMBatches(n=10, seq_len=16)
    window = list(range(10))
    model = tiny_gpt2(dropout=0.0)
    big = data.collate(window)
    logits = model(input_ids=big["input_ids"], attention_mask=big["attention_mask"]).logits[:, :-1]
    # the token-level mean over every non-padding target of the window
    F.cross_entropy(logits.reshape(-1, 50), big["labels"][:, 1:].reshape(-1), ignore_index=-100).backward()
    ref = _grads(model)
    model.zero_grad(set_to_none=True)
    w = Workload(model, data, None, 10, loss_sum=causal_lm_loss_sum, count=count_target_tokens)
    Trainer(w, Plan("fp32", micro_batch, 10), TrainConfig(), progress=False)._forward_backward(window)
    got = _grads(model)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)
    # per-micro-batch means would weight short sequences wrongly: make sure this data can tell
    assert len({data.lengths[i] for i in window}) > 3


def _bert_grads(checkpointing, freeze_embeddings=False):
    model = tiny_bert(dropout=0.1, seed=0)
    if freeze_embeddings:
        for p in model.bert.embeddings.parameters():
            p.requires_grad_(False)
    set_activation_checkpointing(model, checkpointing)
    model.train()
    batch = SyntheticBatches(8).collate(list(range(8)))
    torch.manual_seed(123)  # same dropout masks in both runs only if recomputation replays them
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    return _grads(model)


@pytest.mark.parametrize("freeze", [False, True])
def test_checkpointing_recomputes_same_dropout_and_works_with_frozen_inputs(freeze):
    ref, ck = _bert_grads(False, freeze), _bert_grads(True, freeze)
    assert ref.keys() == ck.keys()
    assert any(n.startswith("bert.encoder.layer.0.") for n in ck)  # blocks after frozen embeddings train
    assert any(n.startswith("bert.embeddings.") for n in ck) == (not freeze)
    for n in ref:
        torch.testing.assert_close(ck[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_checkpointing_turns_the_kv_cache_off():
    model = tiny_gpt2(dropout=0.0)
    assert model.config.use_cache
    set_activation_checkpointing(model, True)
    assert model.config.use_cache is False


@pytest.mark.parametrize("prefetch", [False, True])
def test_logging_loop_keeps_memory_flat(prefetch):
    """1,000 logged steps: the records hold Python numbers only and no tensors accumulate (with
    prefetch, the one or two batches in flight make the count jitter by a few tensors)."""
    records, live = [], {}

    def log(rec):
        records.append(rec)
        if rec.get("step") in (100, 900):
            gc.collect()
            with warnings.catch_warnings():  # isinstance() on torch's deprecated module attributes warns
                warnings.simplefilter("ignore")
                live[rec["step"]] = sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=1, intermediate_size=16,
                                                     max_position_embeddings=32))
    w = Workload(model, SyntheticBatches(2000, seq_len=6), None, 2)
    cfg = TrainConfig(epochs=1, lr=1e-4, log_every=1, prefetch=prefetch)
    Trainer(w, Plan("fp32", 2, 2), cfg, log=log, progress=False).fit()
    assert len([r for r in records if r["type"] == "train"]) == 1000
    for r in records:
        assert all(isinstance(v, (int, float, str, bool, list)) or v is None for v in r.values()), r
    if prefetch:
        assert abs(live[900] - live[100]) <= 8, live
    else:
        assert live[900] == live[100], live


class FakeHealth:
    available = True

    def __init__(self, temps):
        self.temps = list(temps)

    def sample(self, force=False):
        return {"temp_c": self.temps.pop(0)}


def test_cool_down_pauses_until_5_degrees_below_the_limit(make_workload):
    t = Trainer(make_workload(), Plan("fp32", 4, 8), TrainConfig(cooldown_temp_c=85.0), progress=False)
    slept = []
    t.health = FakeHealth([90, 88, 84, 79, 70])
    assert t._cool_down(sleep=slept.append) == 6.0  # 88 and 84 are still above 80; 79 is not
    assert len(slept) == 3 and t.health.temps == [70]
    assert any("cool down" in e for e in t.result.events)
    t.health = FakeHealth([84])
    assert t._cool_down(sleep=slept.append) == 0.0  # below the limit: no pause


def test_a_cool_down_that_cannot_cool_the_gpu_ends_the_pauses(make_workload):
    """--cooldown-temp 20 on a GPU at rest at 35 C: every step paused the whole 300 s, the run stalled.
    A pause that runs its whole length without cooling the GPU ends the cool-downs, with an event."""
    t = Trainer(make_workload(), Plan("fp32", 4, 8), TrainConfig(cooldown_temp_c=20.0, cooldown_max_s=10.0),
                progress=False)
    slept = []
    t.health = FakeHealth([35] * 6 + [35] * 6)
    assert t._cool_down(sleep=slept.append) == 10.0  # one whole pause: 5 samples of 2 s, none at 15 C
    assert any("no more cool-down pauses" in e and "limit of 20 C" in e for e in t.result.events)
    assert t._cool_down(sleep=slept.append) == 0.0 and len(slept) == 5  # the next step: no pause
    t = Trainer(make_workload(), Plan("fp32", 4, 8), TrainConfig(cooldown_temp_c=85.0, cooldown_max_s=10.0),
                progress=False)
    t.health = FakeHealth([90, 88, 84, 79, 90, 79])
    assert t._cool_down(sleep=slept.append) == 6.0 and t._cool_down(sleep=slept.append) == 2.0  # it cooled: again


def test_health_without_nvml_is_off_not_fatal():
    m = HealthMonitor()
    if m.available:
        pytest.skip("NVML is available here")
    assert m.status.startswith("off") and m.sample() is None


def test_health_reads_the_gpu_that_the_cuda_index_names_under_cuda_visible_devices(monkeypatch):
    """Under ``CUDA_VISIBLE_DEVICES=2,3`` (a job given two of a machine's GPUs; torchrun's rank 0 on
    ``cuda:0``) the monitor read NVML's GPU 0, another job's card: its temperature, power and the
    cool-down pauses were that card's. NVML numbers every GPU of the machine; ``cuda:0`` is its 2."""
    import types

    opened = []
    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: opened.append(i) or i)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert HealthMonitor(0).available and HealthMonitor(1).available
    assert opened == [2, 3]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    HealthMonitor(1)
    assert opened[-1] == 1


def test_health_finds_the_card_by_its_pci_bus_id_whatever_the_device_order(monkeypatch):
    """CUDA numbers the visible cards fastest first (unless CUDA_DEVICE_ORDER=PCI_BUS_ID), NVML by
    PCI bus: on a machine of mixed cards ``cuda:0`` can be NVML's 1 with no CUDA_VISIBLE_DEVICES
    set. The monitor opens the card whose bus id CUDA gives for the index."""
    import types

    opened = []
    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: opened.append(i) or i,
                                 nvmlDeviceGetHandleByPciBusId=lambda b: opened.append(b) or b)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x65 if i == 0 else 0x17,
                                                        pci_device_id=0))
    assert HealthMonitor(0).available and HealthMonitor(1).available
    assert opened == ["00000000:65:00.0", "00000000:17:00.0"]


def test_checkpointing_a_subset_of_blocks_gives_the_same_gradients():
    ref = _bert_grads(False)
    model = tiny_bert(dropout=0.1, seed=0)
    set_activation_checkpointing(model, True, blocks=(1,))
    from tightfit.levers.blocks import find_blocks
    blocks = find_blocks(model)
    assert "_tightfit_forward" in blocks[1].__dict__ and "_tightfit_forward" not in blocks[0].__dict__
    batch = SyntheticBatches(8).collate(list(range(8)))
    torch.manual_seed(123)
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]).loss.backward()
    got = _grads(model)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)
    set_activation_checkpointing(model, False, blocks=())
    assert not any("_tightfit_forward" in b.__dict__ for b in blocks)


def test_models_without_an_hf_hook_checkpoint_every_block_with_the_same_gradients():
    # HF's ResNet has no gradient_checkpointing_enable: tightfit wraps its blocks instead
    from transformers import ResNetConfig, ResNetForImageClassification

    from tightfit.levers.blocks import find_blocks

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 2], num_labels=3)

    def grads(checkpointing):
        torch.manual_seed(0)
        model = ResNetForImageClassification(cfg).train()
        assert not model.supports_gradient_checkpointing
        set_activation_checkpointing(model, checkpointing)
        blocks = find_blocks(model)
        assert sum("_tightfit_forward" in b.__dict__ for b in blocks) == (len(blocks) if checkpointing else 0)
        x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        F.cross_entropy(model(pixel_values=x).logits, torch.tensor([0, 2])).backward()
        out = {n: p.grad.clone() for n, p in model.named_parameters()}
        set_activation_checkpointing(model, False)
        assert not any("_tightfit_forward" in b.__dict__ for b in blocks)
        return out

    ref, got = grads(False), grads(True)
    assert len(find_blocks(ResNetForImageClassification(cfg))) == 3
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("sig, again", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_stop_signal_is_announced_with_what_a_second_one_does(sig, again):
    """SIGTERM's note read "(Ctrl-C again to stop at once)", a hint for SIGINT only. The handler
    logs nothing itself: a SIGTERM arriving during a write to metrics.jsonl crashed the run with
    "reentrant call inside BufferedWriter" (the loop logs the note); a second SIGTERM is ignored."""
    from types import SimpleNamespace

    from tightfit.runtime.trainer import Trainer

    def no_logging(message, show=True):
        raise AssertionError("a signal handler must not log through buffered streams")

    fake = SimpleNamespace(_stop_signal=None, _stop_note=None, _event=no_logging)
    note = f"{sig.name} received: stopping after the current step" + (
        " (Ctrl-C again to stop at once)" if again else "")
    with Trainer._stop_on_signals(fake):
        os.kill(os.getpid(), sig)
        if sig == signal.SIGTERM:
            os.kill(os.getpid(), sig)
    assert fake._stop_signal == sig.name
    assert fake._stop_note == note  # the loop logs it at the step's end
