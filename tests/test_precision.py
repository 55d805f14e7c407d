import pytest
import torch

from tightfit.devices import get_profile
from tightfit.errors import TightfitError
from tightfit.levers.precision import check_precision, fallback_precisions, preferred_precision


@pytest.mark.parametrize("key,expected", [
    ("gtx-1080-ti", "fp32"),   # Pascal: fp16 at 1/64 rate
    ("gtx-1650-ti", "fp32"),   # Turing without tensor cores
    ("rtx-2060", "fp16"), ("t4", "fp16"),  # tensor cores, no bf16
    ("rtx-3060", "bf16"), ("rtx-4090", "bf16"), ("a100-40gb", "bf16"), ("h100", "bf16"),
])
def test_preferred_precision_per_card(key, expected):
    assert preferred_precision(get_profile(key))[0] == expected


def test_cpu_is_fp32():
    assert preferred_precision(None)[0] == "fp32"


def test_no_bf16_below_ampere():
    for key in ("gtx-1080-ti", "gtx-1650-ti", "rtx-2060", "t4"):
        p = get_profile(key)
        assert "bf16" not in fallback_precisions(p, preferred_precision(p)[0])
        with pytest.raises(TightfitError, match="compute capability"):
            check_precision("bf16", p)


def test_pascal_falls_back_to_fp16_only_for_memory():
    p = get_profile("gtx-1080-ti")
    assert fallback_precisions(p, "fp32") == ["fp32", "fp16"]
    with pytest.raises(TightfitError):
        check_precision("fp16", None)  # no autocast on the CPU


def test_autocast_keeps_no_cache_of_cast_weights():
    """torch's cache would hold the low-precision copy of every weight until the forward ends
    (on top of an accumulation window's gradients, and for recomputed blocks for nothing)."""
    from tightfit.levers.precision import autocast

    with autocast("bf16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and not torch.is_autocast_cache_enabled()
