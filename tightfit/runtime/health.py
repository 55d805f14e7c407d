"""GPU health through NVML (nvidia-ml-py): temperature, power, SM clock, throttle reasons.

Without NVML or a GPU the monitor is off and says so once; it never stops training.
"""

from __future__ import annotations

import time


def nvml_index(device_index: int) -> int:
    """NVML's index of CUDA device ``device_index``: under ``CUDA_VISIBLE_DEVICES=2,3`` (a job given
    two GPUs of a machine, each torchrun rank on one) ``cuda:0`` is NVML's GPU 2. PyTorch's own
    mapping (which also reads GPU UUIDs in the variable); the index itself where it cannot tell."""
    import torch

    try:
        return int(torch.cuda._get_nvml_device_index(device_index))
    except Exception:  # an older torch, an unreadable variable: NVML's order taken as CUDA's
        return device_index


def nvml_handle(pynvml, device_index: int):
    """NVML's handle of CUDA device ``device_index``, found by its PCI bus id (the card itself,
    whatever the order: CUDA numbers the visible cards fastest first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML numbers every card of the machine by bus); where the bus
    id cannot be read (an older torch), by :func:`nvml_index`.

    Raises:
        Whatever NVML raises for the index (no such GPU).
    """
    import torch

    try:
        props = torch.cuda.get_device_properties(device_index)
        bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
    except Exception:  # no bus id from torch, or NVML cannot find it: PyTorch's index mapping
        return pynvml.nvmlDeviceGetHandleByIndex(nvml_index(device_index))


class HealthMonitor:
    """Samples one GPU's health at most every ``interval_s`` seconds.

    Args:
        device_index: CUDA device index (as ``cuda:N`` names it: among the GPUs that
            ``CUDA_VISIBLE_DEVICES`` lists, in its order; NVML numbers every GPU of the machine).
        warn_temp_c: temperature (deg C) above which :meth:`sample` adds a warning (the
            articles' 82 deg C; GeForce cards start to throttle near 83 deg C).
        interval_s: minimum seconds between two NVML reads.
    """

    def __init__(self, device_index: int = 0, warn_temp_c: float = 82.0, interval_s: float = 5.0):
        self.warn_temp_c = warn_temp_c
        self.interval_s = interval_s
        self._last_t = -1e9
        self._last: dict | None = None
        self.max_temp_c: float | None = None
        self.max_power_w: float | None = None
        self.status = "off"
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = nvml_handle(pynvml, device_index)
            self.status = "on"
        except Exception as e:  # no library, no driver, or no GPU: the feature is off, not fatal
            self._nvml = None
            self.status = f"off (NVML unavailable: {type(e).__name__})"

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def sample(self, force: bool = False) -> dict | None:
        """Latest reading ``{"temp_c", "power_w", "sm_clock_mhz", "throttle_reasons", "warning"?}``
        (re-read if ``interval_s`` has passed or ``force``), or None when NVML is off."""
        if not self.available:
            return None
        now = time.monotonic()
        if not force and now - self._last_t < self.interval_s:
            return self._last
        n, h = self._nvml, self._handle
        try:
            reading = {
                "temp_c": float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU)),
                "power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "sm_clock_mhz": int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                "throttle_reasons": int(n.nvmlDeviceGetCurrentClocksEventReasons(h)),
            }
        except Exception as e:  # a read can fail on virtualised GPUs; keep training
            reading = {"error": f"{type(e).__name__}: {e}"}
        if "temp_c" in reading:
            self.max_temp_c = max(self.max_temp_c or 0.0, reading["temp_c"])
            self.max_power_w = max(self.max_power_w or 0.0, reading["power_w"])
            if reading["temp_c"] >= self.warn_temp_c:
                reading["warning"] = f"GPU at {reading['temp_c']:.0f} C (>= {self.warn_temp_c:.0f} C): expect throttling"
        self._last_t, self._last = now, reading
        return reading
