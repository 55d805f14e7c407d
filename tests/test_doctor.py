"""``tightfit doctor``'s report, with the GPU and NVML stood in for (no GPU needed)."""

import sys
import types

import torch

from tightfit import doctor
from tightfit.devices import get_profile


def _report_with_gpu(monkeypatch, cuda_driver_version: int) -> str:
    """The doctor's text on one stand-in H100 whose NVML reports ``cuda_driver_version``
    (``nvmlSystemGetCudaDriverVersion_v2``'s integer: 1000 x major + 10 x minor)."""
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda: "550.54.15",
                                 nvmlSystemGetCudaDriverVersion_v2=lambda: cuda_driver_version)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (70 * 2**30, 80 * 2**30))
    monkeypatch.setattr(doctor, "detect", lambda i: get_profile("h100"))
    return doctor.doctor_report()


def test_the_cuda_driver_version_is_read_as_nvml_encodes_it(monkeypatch):
    """NVML gives 12040 for CUDA 12.4 (1000 x major + 10 x minor): divided by 1000 and shown to
    one decimal it read "12.0" (and 11080, CUDA 11.8, read "11.1")."""
    for encoded, shown in ((12040, "12.4"), (11080, "11.8"), (12000, "12.0"), (12080, "12.8")):
        text = _report_with_gpu(monkeypatch, encoded)
        assert f"CUDA driver API {shown}" in text.splitlines()[1], text
