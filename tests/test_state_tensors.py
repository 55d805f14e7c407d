"""The trainer state split into its structure and its tensors (tightfit/runtime/state_tensors.py)."""

import io

import pytest
import torch

from tightfit.runtime.state_tensors import join_state, split_state


def _state():
    return {"optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 5),
                                        "mask": torch.tensor([True, False])},
                                    1: {"exp_avg": torch.randn(6, dtype=torch.bfloat16)}},
                          "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
            "rng": {"torch": torch.randint(0, 255, (16,), dtype=torch.uint8), "python": (3, (1, 2), None)},
            "strided": torch.randn(4, 6).t(),  # non-contiguous: safetensors cannot hold it, kept in the structure
            "plan": {"micro_batch": 8}, "none": None}


def _round_trip(state):
    structure, tensors = split_state(state)
    buf = io.BytesIO()
    torch.save(structure, buf)
    buf.seek(0)
    from safetensors.torch import load, save

    return join_state(torch.load(buf, weights_only=True), load(save(tensors))), structure, tensors


def test_split_and_join_give_the_state_back_bit_for_bit():
    state = _state()
    back, structure, tensors = _round_trip(state)
    assert len(tensors) == 5 and structure["optimizer"]["state"][0]["exp_avg"].device.type == "meta"
    assert structure["strided"].device.type == "cpu"  # kept whole
    flat = lambda s: [s["optimizer"]["state"][0][k] for k in ("step", "exp_avg", "mask")] + [
        s["optimizer"]["state"][1]["exp_avg"], s["rng"]["torch"], s["strided"]]
    for a, b in zip(flat(state), flat(back)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert back["rng"]["python"] == (3, (1, 2), None) and back["plan"] == {"micro_batch": 8} and back["none"] is None
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def test_a_tensor_subclass_keeps_its_type_with_its_inner_tensors_split_out():
    subclass = pytest.importorskip("torchao.optim.subclass_8bit")
    m = subclass.OptimState8bit.zeros((4, 256), signed=True, block_size=256, device="cpu")
    m.codes.random_(0, 255)
    m.scale.uniform_()
    back, structure, tensors = _round_trip({"exp_avg": m})
    assert len(tensors) == 3 and type(back["exp_avg"]) is type(m)
    for n in ("codes", "scale", "qmap"):
        assert torch.equal(getattr(back["exp_avg"], n), getattr(m, n))
    assert back["exp_avg"].signed == m.signed


def test_tensors_that_do_not_match_the_structure_are_refused():
    structure, tensors = split_state(_state())
    with pytest.raises(ValueError, match="tensor 1 is torch.float32 \\(3, 5\\), the state says torch.float32 \\(4, 5\\)"):
        join_state(structure, {**tensors, "1": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="tensor 0 is torch.float16"):
        join_state(structure, {**tensors, "0": torch.tensor(3.0, dtype=torch.float16)})
    with pytest.raises(ValueError, match="tensor 4 of the state is missing"):
        join_state(structure, {k: v for k, v in tensors.items() if k != "4"})
    with pytest.raises(ValueError, match="6 tensors for the state's 5 places"):
        join_state(structure, {**tensors, "5": torch.zeros(1)})
    with pytest.raises(ValueError, match="missing"):
        join_state(structure, None)
    whole = _state()
    assert join_state(whole, None) is not whole  # an older state.pt, every tensor in it: the same values
