"""Device profiles: one GPU's facts (memory, compute capability, precision rates) and budgets.

Rates are dense peak TFLOP/s from the vendors' spec sheets (NVIDIA Pascal/Turing/Ampere/Ada/
Hopper whitepapers and datasheets); tensor-core figures use fp32 accumulation, which is what
``torch.autocast`` training runs. A card that cannot hold its peak within its power limit has a
measured ``sustained_share``. docs/planner.md tabulates every figure with its source. Users can add cards, or correct a built-in one, with a small JSON file (:func:`load_profiles`).
"""

from __future__ import annotations

import math

import json
import logging
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from .errors import TightfitError
from .units import GiB, MiB, format_bytes, format_bytes_pair, parse_size

log = logging.getLogger(__name__)

# Memory the CUDA context, cuBLAS/cuDNN handles and the driver take outside PyTorch's caching
# allocator on a typical consumer card (measured by users at 300-500 MiB; we keep the upper end).
CUDA_CONTEXT_BYTES = 500 * MiB
# Share of the remaining memory kept free for fragmentation and other processes (display, etc.).
SAFETY_MARGIN = 0.05
# The most memory a profile may give its card: 1 PiB, thousands of times any GPU's; a profile
# file's total_bytes above it has a wrong number or unit and would plan for memory no card has.
MAX_TOTAL_BYTES = 2**50


@dataclass(frozen=True)
class DeviceProfile:
    """One GPU's facts.

    Attributes:
        key: short name used on the command line, e.g. ``"gtx-1650-ti"``.
        name: marketing name.
        total_bytes: card memory in bytes.
        compute_capability: ``(major, minor)``, e.g. ``(7, 5)``.
        fp16_tensor_cores: whether fp16 matrix products run on tensor cores.
        bf16: whether bf16 runs natively (compute capability >= 8.0; not emulated).
        fp32_tflops, fp16_tflops, bf16_tflops: dense peak rates (bf16 0 when unsupported).
        host_link_bytes_per_s: host-to-device bandwidth (PCIe), bytes/s.
        memory_bytes_per_s: device memory bandwidth, bytes/s (0: unknown).
        sm_count: streaming multiprocessors (0: unknown); sizes the staging buffers of
            PyTorch's multi-block reductions (:func:`tightfit.memory.scratch.reduction_staging_bytes`).
        sustained_share: share of the peak rates that a long run of matrix products sustains
            within the card's power limit (1.0 unless measured lower; the 70 W T4 holds about
            24 of its 65 fp16 TFLOPS, see docs/planner.md).
    """

    key: str
    name: str
    total_bytes: int
    compute_capability: tuple[int, int]
    fp16_tensor_cores: bool
    bf16: bool
    fp32_tflops: float
    fp16_tflops: float
    bf16_tflops: float
    host_link_bytes_per_s: float
    memory_bytes_per_s: float = 0.0
    sm_count: int = 0
    sustained_share: float = 1.0

    def __post_init__(self):
        # Facts that contradict each other would let the planner choose what the card cannot run.
        rates = (self.fp32_tflops, self.fp16_tflops, self.bf16_tflops, self.host_link_bytes_per_s,
                 self.sustained_share)
        if not all(math.isfinite(r) for r in rates):
            raise ValueError("rates must be finite numbers")
        if not 0 < self.sustained_share <= 1:
            raise ValueError(f"sustained_share must be in (0, 1], not {self.sustained_share}")
        if self.total_bytes <= 0 or self.fp32_tflops <= 0 or self.fp16_tflops <= 0 or self.bf16_tflops < 0:
            raise ValueError("total_bytes, fp32_tflops and fp16_tflops must be positive, bf16_tflops not negative")
        if self.total_bytes > MAX_TOTAL_BYTES:
            raise ValueError(f"total_bytes {self.total_bytes:.4g} bytes is more than 1 PiB, far beyond any GPU's "
                             "memory: check the number and its unit (e.g. 24GiB)")
        if self.budget_bytes() < MiB:  # the smallest budget --budget takes
            raise ValueError(f"total_bytes {format_bytes(self.total_bytes)} leaves less than 1 MiB for tensors after "
                             f"the {format_bytes(CUDA_CONTEXT_BYTES)} the CUDA context takes and the safety margin")
        if self.bf16 and tuple(self.compute_capability) < (8, 0):
            raise ValueError(f"bf16 needs compute capability >= 8.0, not {self.compute_capability}")
        if self.bf16 != (self.bf16_tflops > 0):
            raise ValueError("bf16_tflops must be positive exactly when bf16 is true")

    @property
    def max_threads_per_sm(self) -> int:
        """Resident threads per SM by compute capability (CUDA C Programming Guide, "Compute
        Capabilities" table): 1024 on 7.5, 1536 on 8.6/8.7/8.9, 2048 elsewhere from 6.0."""
        cc = self.compute_capability
        return 1024 if cc == (7, 5) else 1536 if cc in ((8, 6), (8, 7), (8, 9)) else 2048

    def budget_bytes(self) -> int:
        """Bytes the process may hold in tensors: card memory minus the CUDA context and a
        safety margin (:data:`CUDA_CONTEXT_BYTES`, :data:`SAFETY_MARGIN`)."""
        return int((self.total_bytes - CUDA_CONTEXT_BYTES) * (1 - SAFETY_MARGIN))

    def to_dict(self) -> dict:
        """JSON-serialisable form."""
        d = asdict(self)
        d["compute_capability"] = list(self.compute_capability)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DeviceProfile":
        """Inverse of :meth:`to_dict`; ``total_bytes`` may be a size string ("6GiB").

        Raises:
            TightfitError: on missing or unknown fields (one line naming them), a field of the wrong
                type or shape (:func:`_check_field_types`), or a bad value.
        """
        try:
            if not isinstance(d, dict):
                raise TypeError("each profile must be a JSON object")
            d = dict(d)
            known = {f.name: f for f in fields(cls)}
            missing = [k for k, f in known.items() if k not in d and f.default is MISSING]
            unknown = [k for k in d if k not in known]
            if missing or unknown:
                raise ValueError("; ".join(([f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"]
                                            if missing else [])
                                           + ([f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}"]
                                              if unknown else [])))
            _check_field_types(d)
            try:
                d["total_bytes"] = parse_size(d["total_bytes"])
            except TightfitError as e:
                raise ValueError(f"total_bytes: {e}") from None
            d["compute_capability"] = tuple(d["compute_capability"])
            return cls(**d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            key = d.get("key", "?") if isinstance(d, dict) else d
            raise TightfitError(f"malformed GPU profile {key!r}: {e}") from None


def _shown(value) -> str:
    """A JSON value as a profile file wrote it, cut short: ``'7.5'``, ``[9]``, ``"no"``."""
    text = json.dumps(value) if isinstance(value, (list, dict, str, bool)) or value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_field_types(d: dict) -> None:
    """Check each field of a profile read from a file against its type and shape, in the order
    :class:`DeviceProfile` declares them, so that a bad one is named before it is used: ``int("7.5")``
    or a one-item ``compute_capability`` would otherwise fail deep in the planner, and JSON ``"no"``
    would count as true where a bool is expected. ``total_bytes`` is :func:`parse_size`'s to read.

    Raises:
        ValueError: the first field of the wrong type or out of range, naming it and its value.
    """
    positive = {"fp32_tflops", "fp16_tflops", "host_link_bytes_per_s", "sustained_share"}
    for name in ("key", "name"):
        value = d[name]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{name} must be a non-empty string, not {_shown(value)}")
    key = d["key"]
    if key != key.strip().lower().replace("_", "-").replace(" ", "-"):
        # --gpu names are lower-cased and dashed before the look-up: any other key is never found
        raise ValueError(f"key must be lower case with dashes, e.g. \"my-card\", not {_shown(key)}")
    cc = d["compute_capability"]
    if (not isinstance(cc, (list, tuple)) or len(cc) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                      for x in cc)
            or cc[0] < 1 or cc[1] < 0):
        raise ValueError(f"compute_capability must be [major, minor] integers, e.g. [7, 5] for 7.5, not {_shown(cc)}")
    for name in ("fp16_tensor_cores", "bf16"):
        if not isinstance(d[name], bool):
            raise ValueError(f"{name} must be true or false, not {_shown(d[name])}")
    for name in ("fp32_tflops", "fp16_tflops", "bf16_tflops", "host_link_bytes_per_s", "memory_bytes_per_s",
                 "sustained_share"):
        if name not in d:
            continue  # optional, with a default
        value = d[name]
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, not {_shown(value)}")
        if value < 0 or (value == 0 and name in positive):
            raise ValueError(f"{name} must be {'positive' if name in positive else 'zero or more'}, not {value:g}")
    if "sm_count" in d:
        sm = d["sm_count"]
        if not (isinstance(sm, int) and not isinstance(sm, bool)) or sm < 0:
            raise ValueError(f"sm_count must be a whole number, zero or more (0: unknown), not {_shown(sm)}")


PCIE3_X16 = 12e9   # bytes/s, measured pinned H2D on PCIe 3.0 x16 (theoretical 15.75 GB/s)
PCIE4_X16 = 24e9
PCIE5_X16 = 50e9

# Dense peak rates, TFLOP/s (no structured sparsity), and memory bandwidth; derivations and
# sources per card in docs/planner.md ("Card table"). Tensor-core rates are those with fp32
# accumulation, which autocast's matrix products use: half the fp16-accumulate rate on GeForce
# Turing/Ampere/Ada cards, the full rate on data-centre cards.
_BUILTIN = [
    # TU117 has no tensor cores: autocast's fp16 matrix products accumulate in fp32 and run at the
    # fp32 rate (its 2x fp16 rate needs fp16 accumulation), so fp16 pays only through memory.
    DeviceProfile("gtx-1650-ti", "NVIDIA GeForce GTX 1650 Ti", 4 * GiB, (7, 5), False, False, 3.0, 3.0, 0.0, PCIE3_X16, 192e9, sm_count=16),
    DeviceProfile("gtx-1080-ti", "NVIDIA GeForce GTX 1080 Ti", 11 * GiB, (6, 1), False, False, 11.3, 11.3 / 64, 0.0, PCIE3_X16, 484e9, sm_count=28),
    DeviceProfile("rtx-2060", "NVIDIA GeForce RTX 2060", 6 * GiB, (7, 5), True, False, 6.45, 25.8, 0.0, PCIE3_X16, 336e9, sm_count=30),
    DeviceProfile("rtx-3060", "NVIDIA GeForce RTX 3060", 12 * GiB, (8, 6), True, True, 12.7, 25.5, 25.5, PCIE4_X16, 360e9, sm_count=28),
    DeviceProfile("rtx-3090", "NVIDIA GeForce RTX 3090", 24 * GiB, (8, 6), True, True, 35.6, 71.0, 71.0, PCIE4_X16, 936e9, sm_count=82),
    DeviceProfile("rtx-4090", "NVIDIA GeForce RTX 4090", 24 * GiB, (8, 9), True, True, 82.6, 165.2, 165.2, PCIE4_X16, 1008e9, sm_count=128),
    # 70 W board: a long run of fp16 matrix products holds ~24 of the datasheet's 65 TFLOPS.
    DeviceProfile("t4", "NVIDIA Tesla T4", 15 * GiB, (7, 5), True, False, 8.1, 65.0, 0.0, PCIE3_X16, 320e9, sm_count=40,
                  sustained_share=24 / 65),
    DeviceProfile("a100-40gb", "NVIDIA A100 40GB", 40 * GiB, (8, 0), True, True, 19.5, 312.0, 312.0, PCIE4_X16, 1555e9, sm_count=108),
    DeviceProfile("a100-80gb", "NVIDIA A100 80GB", 80 * GiB, (8, 0), True, True, 19.5, 312.0, 312.0, PCIE4_X16, 2039e9, sm_count=108),
    DeviceProfile("h100", "NVIDIA H100 80GB", 80 * GiB, (9, 0), True, True, 67.0, 989.0, 989.0, PCIE5_X16, 3350e9, sm_count=132),
    DeviceProfile("h200", "NVIDIA H200", 143771 * MiB, (9, 0), True, True, 67.0, 989.0, 989.0, PCIE5_X16, 4800e9, sm_count=132),
]


def load_profiles(extra_file: str | Path | None = None) -> dict[str, DeviceProfile]:
    """All known profiles by key: the built-ins plus those in ``extra_file`` or in the JSON file
    named by the environment variable ``TIGHTFIT_GPU_PROFILES`` (a list of profile dicts, see
    :meth:`DeviceProfile.from_dict`). A file's profile with a built-in's key replaces the built-in
    (e.g. to correct a card's memory; :func:`get_profile` notes it).

    Raises:
        TightfitError: if the extra file is missing or malformed (naming the file), or lists a key
            twice.
    """
    profiles = {p.key: p for p in _BUILTIN}
    extra_file = extra_file or os.environ.get("TIGHTFIT_GPU_PROFILES")
    if extra_file:
        path = Path(extra_file)
        if not path.is_file():
            raise TightfitError(f"GPU profile file not found: {path}")
        try:
            entries = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise TightfitError(f"GPU profile file {path} is not valid JSON: {e}") from None
        if not isinstance(entries, list):
            raise TightfitError(f"GPU profile file {path} must hold a JSON list of profiles")
        seen = set()
        for entry in entries:
            try:
                p = DeviceProfile.from_dict(entry)
            except TightfitError as e:
                raise TightfitError(f"GPU profile file {path}: {e}") from None
            if p.key in seen:
                raise TightfitError(f"GPU profile file {path}: key {p.key!r} is listed twice; keep one of them")
            seen.add(p.key)
            profiles[p.key] = p
    return profiles


def get_profile(key: str) -> DeviceProfile:
    """The profile named ``key`` (case-insensitive; spaces and underscores read as dashes). A
    profile of the ``TIGHTFIT_GPU_PROFILES`` file that replaces a built-in one with other facts is
    noted on the ``tightfit`` logger (``note: ...``).

    Raises:
        TightfitError: if no such profile exists (the message lists the known ones), or the
            profile file is malformed (:func:`load_profiles`).
    """
    profiles = load_profiles()
    norm = key.strip().lower().replace("_", "-").replace(" ", "-")
    if norm not in profiles:
        raise TightfitError(f"unknown GPU profile {key!r}; known: {', '.join(sorted(profiles))}")
    builtin = next((p for p in _BUILTIN if p.key == norm), None)
    if builtin is not None and profiles[norm] != builtin:
        log.warning(f"note: GPU profile {norm!r} in {os.environ.get('TIGHTFIT_GPU_PROFILES')} replaces the built-in "
                    f"{builtin.name} ({profiles[norm].name}, {format_bytes(profiles[norm].total_bytes)})")
    return profiles[norm]


def card_budget(profile: DeviceProfile, budget: int | None, named: bool = True) -> tuple[int, list[str]]:
    """The budget a plan for card ``profile`` holds to, in bytes, and a note where it was lowered:
    ``budget`` (None: the card's usable memory, :meth:`DeviceProfile.budget_bytes`); a ``budget``
    above that usable memory but within the card is lowered to it (the CUDA context and the safety
    margin take the rest), where the card was ``named`` (``--gpu``; ``tightfit plan`` without it
    only borrows the H200's rates). ``tightfit plan``/``estimate``, ``tightfit train`` and
    :func:`tightfit.plan` decide it here alike.

    Raises:
        TightfitError: a ``budget`` above the card's total memory.
    """
    usable = profile.budget_bytes()
    if budget is None:
        return usable, []
    if budget > profile.total_bytes:
        shown = format_bytes_pair(budget, profile.total_bytes)
        raise TightfitError(f"budget {shown[0]} is more than the {shown[1]} of the {profile.name}")
    if named and budget > usable:
        shown = format_bytes_pair(budget, usable)
        return usable, [f"budget {shown[0]} is more than the {shown[1]} usable on the {profile.name}; "
                        f"planning for {shown[1]}"]
    return budget, []


def _has_fp16_tensor_cores(name: str, cc: tuple[int, int]) -> bool:
    # Turing's GTX 16xx chips (TU116/TU117) are sm_75 but have no tensor cores.
    return cc >= (7, 0) and "GTX 16" not in name.upper()


# Words of a card's name that do not tell its chip apart: vendor and brand, and the board's form
# factor or memory type (torch names one A100 "NVIDIA A100-SXM4-80GB", another "NVIDIA A100-PCIE-40GB").
_NAME_NOISE = frozenset({"nvidia", "geforce", "tesla", "sxm", "sxm2", "sxm4", "sxm5", "pcie", "nvl",
                         "hbm2", "hbm2e", "hbm3", "hbm3e"})
_MEMORY_WORD = re.compile(r"\d+gb")


def _name_words(name: str) -> tuple[tuple[str, ...], str | None]:
    """A card's name as its model's words and its memory word: ``"NVIDIA A100-SXM4-80GB"`` ->
    ``(("a100",), "80gb")``, ``"NVIDIA GeForce RTX 3060 Ti"`` -> ``(("rtx", "3060", "ti"), None)``."""
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in _NAME_NOISE]
    memory = next((w for w in words if _MEMORY_WORD.fullmatch(w)), None)
    return tuple(w for w in words if not _MEMORY_WORD.fullmatch(w)), memory


def builtin_for(name: str, total_bytes: int) -> DeviceProfile | None:
    """The built-in profile of the card torch names ``name`` (with ``total_bytes`` of memory), or
    None: the same model words (a "Ti" or "SUPER" is another card: an RTX 3060 Ti is no RTX 3060),
    whatever the form factor (SXM, PCIe), and the same memory where both names give it; of several
    (an "A100" of unnamed memory), the one closest in memory."""
    model, memory = _name_words(name)

    def same(p: DeviceProfile) -> bool:
        words, its_memory = _name_words(p.name)
        return words == model and (memory is None or its_memory is None or memory == its_memory)

    found = [p for p in _BUILTIN if same(p)]
    return min(found, key=lambda p: abs(p.total_bytes - total_bytes), default=None)


def detect(index: int = 0) -> DeviceProfile | None:
    """Profile of the local CUDA GPU ``index`` from torch (and the built-in profile of the same card
    for the rates, :func:`builtin_for`), or None when there is no CUDA GPU. An unknown card gets
    its generation's typical rates: fp16 faster than fp32 only on tensor cores (DESIGN invariant 7;
    Turing's GTX 16xx have none), at 1/64 of it on Pascal's sm_61."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    cc = (props.major, props.minor)
    p = builtin_for(props.name, props.total_memory)
    if p is not None:
        return replace(p, total_bytes=props.total_memory, name=props.name, sm_count=props.multi_processor_count)
    tc = _has_fp16_tensor_cores(props.name, cc)
    # Unknown card: rates only matter as ratios; use the generation's typical ones. Without tensor
    # cores autocast's fp16 matrix products accumulate in fp32, at the fp32 rate (the GTX 1650 Ti's)
    fp16_ratio = 8.0 if tc else (1 / 64 if cc == (6, 1) else 1.0)
    return DeviceProfile(
        key="local", name=props.name, total_bytes=props.total_memory, compute_capability=cc,
        fp16_tensor_cores=tc, bf16=cc >= (8, 0), fp32_tflops=10.0, fp16_tflops=10.0 * fp16_ratio,
        bf16_tflops=10.0 * fp16_ratio if cc >= (8, 0) else 0.0, host_link_bytes_per_s=PCIE3_X16,
        memory_bytes_per_s=500e9, sm_count=props.multi_processor_count)
