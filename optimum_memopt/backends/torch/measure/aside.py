"""Memory read aside: the most a piece of work (a forward and its backward, run by the caller) holds above the level
it starts at, read after every op, unseen by every other reading of the process.

The levers that measure what they would do by running it (the loss lever's chunkings) run between steps, where no
step is watched; what they allocate must not show in the readings of the phases around them either. So: the 2 ms
sampler threads are paused (`memory.read_at_ops`), each op's end is read by a dispatch mode of its own (entered
before the work, so the backward the work starts runs under it too), and on CUDA, where the backend may reset the
peak counter, the peak so far is folded into every open meter first and the counter reset after, so the work's
peak reaches none of them. The process's random generators (CPU and device) are given back as the work found
them. Where a count of tensor storages is read (a dry run's, `storages.StorageCount`, or on the CPU the process's live
count, `live.LiveCount`, which counts the work's ops here), its peak is given back as the work found it. Where the
counter is someone else's (`resets` False: the Trainer's own memory metrics) it is left alone, and the work's peak is
in it: said by the caller. Temporaries inside one op are not seen.
"""

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Tuple

import torch

from ....memory import fold_cuda_peak, read_at_ops
from .. import _torch_api
from .live import LiveCount, live_count
from .storages import StorageCount, counting


def _count(device: str) -> Optional[StorageCount]:
    """The count of tensor storages the work is read by: a dry run's where one is on, the process's live count on the
    CPU; None on CUDA (its own counter)."""
    count = counting()
    if count is None and device == "cpu":
        count = live_count()
    return count


def _reader(device: str) -> Callable[[], int]:
    count = _count(device)
    if isinstance(count, LiveCount):  # storages resized in place since (FSDP2's weights gathered for the work)

        def read() -> int:
            count.resync()
            return count.current

        return read
    if count is not None:
        return lambda: count.current
    return torch.cuda.memory_allocated


def current_bytes(device: str) -> int:
    """What the device holds now, as `held_aside` reads it: its tensors (CUDA's counter; on the CPU the live count of
    tensor storages, `live.LiveCount`; under a dry run, its count)."""
    return _reader(device)()


def _synchronize(device: str) -> None:
    if device == "cuda" and counting() is None:
        torch.cuda.synchronize()


class _MostAfterOps(_torch_api.TorchDispatchMode):
    def __init__(self, read: Callable[[], int], clock=None, live: Optional[LiveCount] = None):
        super().__init__()
        self.read = read
        self.most = 0
        self.clock = clock  # a count's clock (a dry run): the ops' seconds on the device it stands for
        self.clocked = 0.0
        self.live = live  # the CPU's live count, which counts the work's ops here (a dry run's counts its own)

    @_torch_api.answers_fake_device
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _torch_api.returns_no_tensor(func):  # a query of metadata: nothing made, no time
            return out
        if self.live is not None:
            self.live.after_op(out, args, kwargs)
        self.most = max(self.most, self.read())
        if self.clock is not None:
            self.clocked += self.clock(func, args, kwargs or {}, out)
        return out


@contextmanager
def _unseen(device: str, resets: bool) -> Iterator[None]:
    read_at_ops(True)
    count = _count(device)
    peak_before = count.peak if count is not None else 0
    if count is not None:
        count.aside += 1
    resets = resets and count is None  # under a count of storages the device's counter is not read
    if device == "cuda" and resets:
        fold_cuda_peak()
    devices = [torch.cuda.current_device()] if device == "cuda" and torch.cuda.is_available() else []
    try:
        # the work's random ops (a dropout in a LoRA on the head) draw from the process's generators, which are
        # given back as they were: every mask the run draws after is the one the run without the plugin draws
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        if device == "cuda" and resets:
            torch.cuda.reset_peak_memory_stats()
        if count is not None:
            count.peak = max(peak_before, count.current)  # the work's peak reaches no reading around it
            count.aside -= 1
        read_at_ops(False)


def held_aside(work: Callable[[], None], device: str, resets: bool = True) -> Tuple[int, float]:
    """Run `work()` aside (see the module's docstring): the most it held above the level at its start, in bytes,
    and the seconds it took."""
    read = _reader(device)
    with _unseen(device, resets):
        _synchronize(device)
        start = read()
        count = _count(device)
        live = count if isinstance(count, LiveCount) else None
        mode = _MostAfterOps(read, count.clock if count is not None else None, live)
        began = time.perf_counter()
        with mode:
            work()
        _synchronize(device)
        seconds = mode.clocked if mode.clock is not None else time.perf_counter() - began
    return max(0, mode.most - start), seconds
