"""``tightfit doctor``: what GPU is here, and which memory/speed techniques pay on it."""

from __future__ import annotations

from .devices import DeviceProfile, detect
from .levers.precision import preferred_precision
from .units import format_bytes


def advice(profile: DeviceProfile) -> list[str]:
    """Which techniques help on this card, one line each."""
    cc = profile.compute_capability
    lines = [f"precision: {preferred_precision(profile)[1]}"]
    if profile.bf16:
        lines.append("bf16 autocast halves activation memory with fp32's range: no loss scaling, few overflows")
    elif profile.fp16_tensor_cores:
        lines.append("fp16 autocast + GradScaler: faster matmuls on tensor cores and half the activation memory")
    else:
        ratio = profile.fp16_tflops / profile.fp32_tflops
        lines.append(f"no tensor cores: fp16 runs at {ratio:.3g}x fp32 here; use it only to fit memory")
    if profile.total_bytes <= 12 * 2**30:
        lines.append("small card: activation checkpointing and gradient accumulation let a large effective "
                     "batch fit; tightfit turns them on when needed")
    if cc < (7, 0):
        lines.append("Pascal or older: no torch.compile (Triton needs compute capability >= 7.0)")
    return lines


def doctor_report() -> str:
    """The doctor's text: torch/CUDA/driver versions, each GPU's facts and advice."""
    import torch

    out = [f"torch {torch.__version__}, CUDA runtime {torch.version.cuda or 'none (CPU build)'}"]
    if not torch.cuda.is_available():
        out.append("no CUDA GPU found: tightfit trains on the CPU (fp32, no memory budget)")
        return "\n".join(out)
    try:
        import pynvml

        pynvml.nvmlInit()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()  # 1000 x major + 10 x minor: 12040 is 12.4
        out.append(f"driver {pynvml.nvmlSystemGetDriverVersion()}, CUDA driver API {cuda // 1000}.{cuda % 1000 // 10}")
    except Exception as e:  # NVML is optional
        out.append(f"NVML unavailable ({type(e).__name__}): no driver version, temperature or power")
    for i in range(torch.cuda.device_count()):
        p = detect(i)
        free, total = torch.cuda.mem_get_info(i)
        cc = p.compute_capability
        out.append(f"GPU {i}: {p.name}")
        out.append(f"  memory              {format_bytes(total)} total, {format_bytes(free)} free, "
                   f"default budget {format_bytes(p.budget_bytes())}")
        out.append(f"  compute capability  {cc[0]}.{cc[1]}")
        out.append(f"  fp16 tensor cores   {'yes' if p.fp16_tensor_cores else 'no'}")
        out.append(f"  bf16                {'yes (native)' if p.bf16 else 'no (needs compute capability >= 8.0)'}")
        out += [f"  - {line}" for line in advice(p)]
    return "\n".join(out)
