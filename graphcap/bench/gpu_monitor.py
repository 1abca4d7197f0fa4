"""NVML sampling (nvidia-ml-py) of GPU utilization, power and SM clock while a benchmark row runs."""
from __future__ import annotations

import statistics
import threading
import time


class GpuMonitor:
    """`with GpuMonitor() as m: ...` then `m.summary()`; a no-op (summary of Nones) where NVML is unavailable."""

    def __init__(self, index: int = 0, period_s: float = 0.02) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, float, float]] = []  # (util %, power W, SM MHz)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:  # no driver, no GPU, no package: run without samples
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._handle is not None

    def _sample(self) -> None:
        n, h = self._nvml, self._handle
        while not self._stop.is_set():
            try:
                util = n.nvmlDeviceGetUtilizationRates(h).gpu
                power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
                clock = n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)
                self.samples.append((float(util), power, float(clock)))
            except Exception:
                return
            time.sleep(self.period_s)

    def __enter__(self) -> GpuMonitor:
        if self.available:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def summary(self) -> dict[str, float | None]:
        if not self.samples:
            return {"util_pct": None, "power_w": None, "sm_mhz": None}
        util, power, clock = zip(*self.samples)
        return {"util_pct": statistics.fmean(util), "power_w": statistics.fmean(power), "sm_mhz": statistics.fmean(clock)}
