"""Memory read aside: the most a piece of work (a forward and its backward, run by the caller) holds above the level
it starts at, read after every op, unseen by every other reading of the process.

The levers that measure what they would do by running it (the loss lever's chunkings) run between steps, where no
step is watched; what they allocate must not show in the readings of the phases around them either. So: the 2 ms
sampler threads are paused (`memory.read_at_ops`), each op's end is read by a dispatch mode of its own (entered
before the work, so the backward the work starts runs under it too), and on CUDA, where the backend may reset the
peak counter, the peak so far is folded into every open meter first and the counter reset after, so the work's
peak reaches none of them. The process's random generators (CPU and device) are given back as the work found
them. Where the counter is someone else's (`resets` False: the Trainer's own memory metrics)
it is left alone, and the work's peak is in it: said by the caller. Temporaries inside one op are not seen.
"""

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Tuple

import torch

from ....memory import allocator_bytes_in_use, fold_cuda_peak, read_at_ops
from .. import _torch_api


def _reader(device: str) -> Callable[[], int]:
    if device == "cuda":
        return torch.cuda.memory_allocated
    return lambda: allocator_bytes_in_use() or 0


def current_bytes(device: str) -> int:
    """What the device holds now, as `held_aside` reads it (CUDA: tensors; the CPU: the allocator's bytes in use)."""
    return _reader(device)()


class _MostAfterOps(_torch_api.TorchDispatchMode):
    def __init__(self, read: Callable[[], int]):
        super().__init__()
        self.read = read
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.most = max(self.most, self.read())
        return out


@contextmanager
def _unseen(device: str, resets: bool) -> Iterator[None]:
    read_at_ops(True)
    if device == "cuda" and resets:
        fold_cuda_peak()
    devices = [torch.cuda.current_device()] if device == "cuda" else []
    try:
        # the work's random ops (a dropout in a LoRA on the head) draw from the process's generators, which are
        # given back as they were: every mask the run draws after is the one the run without the plugin draws
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        if device == "cuda" and resets:
            torch.cuda.reset_peak_memory_stats()
        read_at_ops(False)


def held_aside(work: Callable[[], None], device: str, resets: bool = True) -> Tuple[int, float]:
    """Run `work()` aside (see the module's docstring): the most it held above the level at its start, in bytes,
    and the seconds it took."""
    read = _reader(device)
    with _unseen(device, resets):
        if device == "cuda":
            torch.cuda.synchronize()
        start = read()
        mode = _MostAfterOps(read)
        began = time.perf_counter()
        with mode:
            work()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
    return max(0, mode.most - start), seconds
