"""Memory readings on CUDA and on CPU, with a resettable peak.

CUDA: `torch.cuda.memory_allocated` / `max_memory_allocated` / `memory_reserved`, and
`reset_peak_memory_stats` to start a new peak.

CPU: the process's resident set (VmRSS) and its high-water mark (VmHWM) from
`/proc/self/status`. Writing `5` to `/proc/self/clear_refs` resets VmHWM on Linux, which gives
the peak within a phase; where that file cannot be written, the peak is the process's peak
since start (`peak_resets` says which).
"""

import resource
from dataclasses import dataclass
from typing import Optional

import torch

MIB = float(1024 * 1024)


@dataclass
class MemoryReading:
    device: str
    current_mb: float  # CUDA: allocated; CPU: resident set
    peak_mb: float  # CUDA: max allocated; CPU: high-water mark since the last reset
    reserved_mb: Optional[float] = None  # CUDA only: held by the caching allocator


def _proc_status_kb(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class MemoryMeter:
    """Reads memory for one device kind; `reset_peak()` starts a new phase."""

    def __init__(self, device: Optional[str] = None):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.peak_resets = self._probe_reset()

    def _probe_reset(self) -> bool:
        if self.device == "cuda":
            return True
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _proc_status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset_peak(self) -> None:
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.peak_resets:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.peak_resets = False

    def read(self) -> MemoryReading:
        if self.device == "cuda":
            return MemoryReading(
                "cuda",
                torch.cuda.memory_allocated() / MIB,
                torch.cuda.max_memory_allocated() / MIB,
                torch.cuda.memory_reserved() / MIB,
            )
        rss = _proc_status_kb("VmRSS")
        hwm = _proc_status_kb("VmHWM")
        if rss is None:
            # Not Linux: ru_maxrss is the only portable figure (KiB on Linux, bytes on macOS).
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
            return MemoryReading("cpu", peak, peak)
        return MemoryReading("cpu", rss / 1024.0, (hwm if hwm is not None else rss) / 1024.0)

