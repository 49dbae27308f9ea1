"""Memory readings on CUDA and on CPU, each with a peak that can be reset between phases.

CUDA: `torch.cuda.memory_allocated` (bytes held by live tensors), `max_memory_allocated` (its peak
since the last `reset_peak_memory_stats`) and `memory_reserved` (what the caching allocator holds).

CPU: bytes in use at the allocator level, from glibc's `mallinfo2()` (`uordblks + hblkhd`: small
blocks handed out plus large blocks served by mmap). Unlike resident memory, this figure drops when
tensors are freed, so it shows activations being held after forward and released after backward.
Its peak within a phase is not kept by glibc: it is sampled at every phase boundary and, while a
phase runs, by a light sampler thread (every `SAMPLE_INTERVAL_S`), so a short spike between two
samples can be missed; the resident high-water mark (VmHWM, reset through `/proc/self/clear_refs`)
is reported beside it as the second, conservative column. Where a caller knows when memory can peak
(the torch backend after each op of the model's forward and each node of its backward, in the steps it
measures: `backends.torch.measure.watch`), it pauses every sampler of the process (`read_at_ops`) and reads
for all of them at those moments (`observe_all`): the same step then reads the same peaks every run.

For ORTModule on CPU this is exact only when ORT allocates through glibc: its CPU arena keeps freed
blocks, so the ORT backend turns the arena off whenever memory is measured (see
`optimum_memopt.backends.ort`).

Where `mallinfo2` is missing (glibc < 2.33, macOS), the allocator columns are empty and only the
resident figures are given; `MemoryMeter.allocator` says which.
"""

import ctypes
import ctypes.util
import resource
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

MIB = float(1024 * 1024)
SAMPLE_INTERVAL_S = 0.002


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _load_mallinfo2()


def allocator_bytes_in_use() -> Optional[int]:
    """Bytes the C allocator has handed out and not taken back (None where mallinfo2 is missing)."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.uordblks + info.hblkhd)


@dataclass
class MemoryReading:
    device: str
    current_mb: Optional[float]  # CUDA: allocated; CPU: allocator bytes in use (None without mallinfo2)
    peak_mb: Optional[float]  # the peak of current_mb since the last reset
    resident_mb: Optional[float] = None  # CPU: resident set (VmRSS)
    resident_peak_mb: Optional[float] = None  # CPU: resident high-water mark since the last reset
    reserved_mb: Optional[float] = None  # CUDA: held by the caching allocator


def _proc_status_kb(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


_SAMPLERS: "weakref.WeakSet[_PeakSampler]" = weakref.WeakSet()  # every sampler of the process
_PAUSE = threading.Lock()  # held by a sampler thread while it reads, and by `read_at_ops` while it counts
_read_at_ops = 0  # > 0: a caller reads at every op (`observe_all`) and the sampler threads read nothing


def read_at_ops(on: bool) -> None:
    """Pause (`on`) or resume every sampler thread of the process, for a caller that reads after every op with
    `observe_all` meanwhile (calls nest). Once this returns with `on`, no sampler reads until it is resumed: a
    reading at a chance moment (inside an op) would make the peaks of the same step differ run to run."""
    global _read_at_ops
    with _PAUSE:
        _read_at_ops = max(0, _read_at_ops + (1 if on else -1))


def reading_at_ops() -> bool:
    return _read_at_ops > 0


def observe_all() -> None:
    """Take the allocator's reading now into every sampler's peak (one mallinfo2 call, about 11 us here)."""
    samplers = list(_SAMPLERS)
    if samplers:
        now = allocator_bytes_in_use() or 0
        for sampler in samplers:
            if now > sampler.peak:
                sampler.peak = now


class _PeakSampler:
    """Keeps the highest allocator reading seen since the last reset, sampled by a daemon thread (paused while
    a caller reads at every op: `read_at_ops`)."""

    def __init__(self, interval: float = SAMPLE_INTERVAL_S):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        _SAMPLERS.add(self)

    def start(self):
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="memopt-peak-sampler", daemon=True)
            self._thread.start()

    def _run(self):
        while not self._stop.wait(self.interval):
            with _PAUSE:
                if not _read_at_ops:
                    self.observe()

    def observe(self) -> int:
        now = allocator_bytes_in_use() or 0
        if now > self.peak:
            self.peak = now
        return now

    def reset(self) -> int:
        self.peak = 0
        return self.observe()

    def stop(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=1.0)
            self._thread = None


READABLE_DEVICES = ("cuda", "cpu")


class _CudaPeaks:
    """CUDA keeps one peak counter per process; each `MemoryMeter` reads its own peak from it. A meter that resets
    the counter first folds the peak so far into every other open meter's, so one meter's phases (the memory-phase
    callback's) and another's finer marks (the torch backend's step watch) do not cut each other's peaks short."""

    def __init__(self):
        self.folded: "weakref.WeakKeyDictionary[MemoryMeter, int]" = weakref.WeakKeyDictionary()

    def open(self, meter) -> None:
        self.folded[meter] = 0

    def reset(self, meter) -> None:
        peak = torch.cuda.max_memory_allocated()
        for other in list(self.folded):
            if other is not meter:
                self.folded[other] = max(self.folded[other], peak)
        torch.cuda.reset_peak_memory_stats()
        self.folded[meter] = 0

    def peak(self, meter) -> int:
        return max(self.folded.get(meter, 0), torch.cuda.max_memory_allocated())

    def close(self, meter) -> None:
        self.folded.pop(meter, None)


_CUDA_PEAKS = _CudaPeaks()


def fold_cuda_peak() -> None:
    """Fold CUDA's peak so far into every open meter's own, so that a reset of the counter after work read aside
    (`backends/torch/measure/aside.py`) takes from no meter what it saw before."""
    peak = torch.cuda.max_memory_allocated()
    for meter in list(_CUDA_PEAKS.folded):
        _CUDA_PEAKS.folded[meter] = max(_CUDA_PEAKS.folded[meter], peak)


def training_device(args=None, model=None) -> str:
    """The kind of device the training runs on: where the model's parameters are, else the arguments' device.

    Not `torch.cuda.is_available()`: a run with `--use_cpu` on a machine that has a GPU trains on the CPU, and
    reading CUDA's counters there would report nothing held."""
    if model is not None:
        try:
            return next(model.parameters()).device.type
        except (StopIteration, AttributeError, TypeError):
            pass
    if args is not None and getattr(args, "device", None) is not None:
        return torch.device(args.device).type
    return "cuda" if torch.cuda.is_available() else "cpu"


class MemoryMeter:
    """Reads memory for one device kind; `reset_peak()` starts a new phase; `close()` stops the sampler."""

    def __init__(self, device: Optional[str] = None, sample: bool = True):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in READABLE_DEVICES:
            raise ValueError(f"memory readings support {' and '.join(READABLE_DEVICES)}, not {device!r}")
        self.device = device
        self.resident_peak_resets = device == "cpu" and self._clear_refs()
        self.allocator = "cuda" if device == "cuda" else ("mallinfo2" if _MALLINFO2 is not None else None)
        self._sampler = _PeakSampler() if device == "cpu" and self.allocator else None
        if device == "cuda":
            _CUDA_PEAKS.open(self)
        if self._sampler is not None:
            self._sampler.reset()
            if sample:
                self._sampler.start()

    @staticmethod
    def _clear_refs() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _proc_status_kb("VmHWM") is not None
        except OSError:
            return False

    def reset_peak(self) -> None:
        if self.device == "cuda":
            _CUDA_PEAKS.reset(self)
            return
        if self._sampler is not None:
            self._sampler.reset()
        if self.resident_peak_resets:
            self.resident_peak_resets = self._clear_refs()

    def read(self) -> MemoryReading:
        if self.device == "cuda":
            return MemoryReading(
                "cuda",
                torch.cuda.memory_allocated() / MIB,
                _CUDA_PEAKS.peak(self) / MIB,
                reserved_mb=torch.cuda.memory_reserved() / MIB,
            )
        current = peak = None
        if self._sampler is not None:
            current = self._sampler.observe() / MIB
            peak = self._sampler.peak / MIB
        rss = _proc_status_kb("VmRSS")
        hwm = _proc_status_kb("VmHWM")
        if rss is None:
            # Not Linux: ru_maxrss is the only portable resident figure (KiB on Linux, bytes on macOS).
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
            return MemoryReading("cpu", current, peak, maxrss, maxrss)
        return MemoryReading("cpu", current, peak, rss / 1024.0, (hwm if hwm is not None else rss) / 1024.0)

    def __del__(self):
        try:
            self.close()  # a meter dropped without close() stops its sampler thread
        except Exception:
            pass

    def close(self) -> None:
        if self.device == "cuda":
            _CUDA_PEAKS.close(self)
        if self._sampler is not None:
            self._sampler.stop()
