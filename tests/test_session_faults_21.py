"""Faults a review of the round-21 changes found, each kept as a test that fails when the fault
comes back."""

import sys

import pytest
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from tightfit.plan import Plan  # noqa: E402


def _bert_trainer():
    from conftest import SyntheticBatches, tiny_bert
    from tightfit.runtime.trainer import TrainConfig, Trainer
    from tightfit.workload import Workload

    w = Workload(tiny_bert(0.0, 0), SyntheticBatches(8), None, 8)
    return Trainer(w, Plan("fp32", 8, 8), TrainConfig(epochs=1, lr=1e-3, seed=3, grow_back_after=0), progress=False)


def test_an_oom_after_the_step_returned_is_not_redone_by_the_runtime(monkeypatch):
    """update_ran() marks an OOM raised inside apply_update after the optimizer's step, but the
    runtime's window goes on allocating after training_step returns: a step decided on the device
    (fused AdamW on CUDA: PendingStep.known is None) has its buffers restored with
    ``torch.where(applied, buffer, copy)``, a new device tensor per buffer. An OOM there was redone
    like one in the forward (fused AdamW takes no version snapshot), applying the update twice."""
    import tightfit.runtime.trainer as tr
    from conftest import params_of
    from tightfit.step import PendingStep

    ref = _bert_trainer()
    ref.fit()

    real_step, real_restore = tr.training_step, tr.restore_buffers

    def deferred(*args, **kwargs):  # as on CUDA: the verdict stays on the device (known is None)
        r = real_step(*args, **kwargs).result()
        return PendingStep(torch.tensor([r.grad_norm, r.loss], dtype=torch.float32))

    fired = []

    def restore(snapshot, unless=None):
        if unless is not None and not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        return real_restore(snapshot, unless)

    monkeypatch.setattr(tr, "training_step", deferred)
    monkeypatch.setattr(tr, "restore_buffers", restore)
    t = _bert_trainer()
    with pytest.raises(tr.PartialUpdateError):
        t.fit()
    assert fired and t.micro_batch == 8
    got, want = params_of(t.model), params_of(ref.model)
    assert all(torch.equal(got[n], want[n]) for n in want)  # one update, not two


@pytest.mark.parametrize("key", ["no_compile", "no_replan", "no_checkpointing", "no_cuda_graphs"])
def test_a_no_keyword_is_not_said_to_be_a_flag_that_does_not_exist(key):
    """TrainRequest's unknown keyword ``no_X`` was answered ``--no-X is X=False`` for every option
    X: only ``--no-progress`` exists; ``compile=False`` (a choice of auto|off|...) or ``replan=False``
    (the default of a store_true flag) is not what such a keyword means."""
    from tightfit.config import TrainRequest

    with pytest.raises(TypeError) as e:
        TrainRequest(**{key: True})
    assert "=False" not in str(e.value) and f"--{key.replace('_', '-')} is" not in str(e.value), str(e.value)
    with pytest.raises(TypeError, match=r"--no-progress is progress=False"):
        TrainRequest(no_progress=True)


def test_lists_side_by_side_in_one_module_or_of_single_layers_are_not_a_second_stack():
    """The second-stack rule of find_blocks took XLM's attention and feed-forward lists (side by side
    in one module, run interleaved) as two stacks, in registration order, and lists of plain Linear
    layers (detection heads) as blocks; an encoder-decoder's two lists, each held by its own module,
    stay two stacks."""
    from tightfit.levers.blocks import find_blocks

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.o = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    class FFN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    class XLMLike(torch.nn.Module):  # attentions[i] then ffns[i], layer by layer
        def __init__(self):
            super().__init__()
            self.attentions = torch.nn.ModuleList(Attention() for _ in range(3))
            self.ffns = torch.nn.ModuleList(FFN() for _ in range(3))
            self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))

    blocks = find_blocks(XLMLike())
    assert {type(b).__name__ for b in blocks} == {"FFN"}, [type(b).__name__ for b in blocks]

    class Side(torch.nn.Module):
        def __init__(self, cls):
            super().__init__()
            self.layers = torch.nn.ModuleList(cls() for _ in range(3))

    class EncoderDecoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.decoder = Side(Attention), Side(FFN)

    assert [type(b).__name__ for b in find_blocks(EncoderDecoder())] == ["Attention"] * 3 + ["FFN"] * 3
