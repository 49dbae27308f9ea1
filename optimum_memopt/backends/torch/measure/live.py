"""The CPU's memory in the unit CUDA counts: the live tensor storages of a real training process, in the steps the
backend measures.

CUDA's `memory_allocated` counts the tensors' blocks in its caching allocator: weights, gradients, optimizer state,
activations, the batch. The C allocator's bytes (`memory.allocator_bytes_in_use`) count all that and what else the
process mallocs: the math library's kept buffers (MKL keeps about 10 MiB from the first matmul of each shape on),
Python's heap. So a CPU step measured by the allocator was a few percent above what the same step holds in tensors,
and what step one made once and kept (MKL's buffers) was counted twice by the budget solver (in step one's segments
and in what later steps hold more). `LiveCount` counts the process's tensor storages instead, as `StorageCount`
counts a dry run's: one unit on the CPU, on CUDA and in a dry run.

How: the count starts from the model's tensors (`seed`: its parameters and buffers, each one's gradient among them),
at the first forward the backend measures; from then on a dispatch mode (`LiveCount.ops`) counts each op's outputs and
first-used inputs (a tensor made where the count was not on is counted at its first use under it), in the model's
forward, in its backward (`watch.StepReadings`: the whole backward where it is started through
`torch.autograd.backward`, as `Tensor.backward` starts it, the gradients autograd's engine sums between nodes
included; otherwise every node of it), in the optimizer's step (torch's optimizer step hooks) and in the work the
levers measure aside. Every storage counted is given back the moment it is freed, counted or not; one resized in place
(FSDP2 empties and gathers weights so) is counted at its new size as the resize is made while ops are counted, else
as they are counted again or the count is read (`LiveCount.resync`). Not seen: what runs outside those (a loss
computed outside the model, a tensor made and freed between steps), what one op holds inside itself (as on CUDA) and
the storages only C++ holds until an op uses them (DDP's gradient buckets, counted at their first use in backward,
where CUDA counts them from DDP's start).

One count a process (`live_count`), as CUDA has one counter; each reader (the step watch, the budget planner) reads it
through a meter of its own (`LiveMeter`), with a peak of its own that another's reset does not cut short.
"""

import weakref
from typing import Optional

import torch

from ....memory import MIB, MemoryMeter, MemoryReading
from .. import _torch_api
from ..nested import tensors_in
from .storages import StorageCount, block_bytes, counting, watch_resizes

try:  # private: `torch._subclasses.fake_tensor.FakeTensor`; without it, no fake tensor is made here either
    from torch._subclasses.fake_tensor import FakeTensor as _FAKE
except ImportError:  # pragma: no cover
    _FAKE = None

LIVE_HOW = (
    "the process's tensor storages counted after every op of the model's forward, its backward and the optimizer's "
    "step, in CUDA's 512-byte blocks"
)


class CountOps(_torch_api.TorchDispatchMode):
    """A dispatch mode counting each op into `count` (`StorageCount.after_op`), and storages resized in place while it
    is on the dispatch stack (`storages.watch_resizes` finds it there: a mode autograd drops without leaving it
    follows nothing after)."""

    follows_resizes = True

    def __init__(self, count: StorageCount):
        super().__init__()
        self.count = count

    def __enter__(self):
        out = super().__enter__()
        watch_resizes()
        resync = getattr(self.count, "resync", None)
        if resync is not None:  # a live count: its storages resized while no op of it was counted
            resync()
        return out

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        watch_resizes()
        return out

    @_torch_api.answers_fake_device
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _torch_api.returns_no_tensor(func):  # a query of metadata makes no storage
            self.count.after_op(out, args, kwargs)
        return out


class LiveCount(StorageCount):
    """A real process's tensor storages on the CPU (see the module's docstring); never a dispatch mode itself."""

    how = LIVE_HOW

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self.meters: "weakref.WeakSet[LiveMeter]" = weakref.WeakSet()
        self._resized_before: set = set()  # storages seen resized in place (`resync`)

    def __enter__(self):
        raise TypeError("a live count is not entered: its ops are counted under `ops()`")

    def see(self, t: torch.Tensor) -> None:
        """As `StorageCount.see`, but a fake tensor (a dry run's, made under a count of its own while this one's ops
        are on below it: `auto` starting from the plan inside a counted run) or a meta one (a copy of the dry run's
        twin, kept to plan again) holds no memory of the process."""
        if (_FAKE is not None and isinstance(t, _FAKE)) or t.device.type == "meta":
            return
        super().see(t)

    def ops(self) -> CountOps:
        return CountOps(self)

    def _resized_in_place(self, key: int) -> None:
        self._resized_before.add(key)

    def resized(self, storage) -> None:
        super().resized(storage)
        self._resized_before.add(_torch_api.storage_identity(storage))

    def resync(self) -> int:
        """Count again, at their sizes now, the storages counted before that were resized in place since (FSDP2's
        gathered weights): the bytes the count grew by. Called as the count's ops start being counted (`CountOps`),
        for what was resized while none was: FSDP2 gathers the root module's weights (the embeddings, the head)
        again, into storages it emptied after the last backward, in the root's forward pre-hook, before the first
        layer's forward counts any op, and empties them after the backward has ended. A step that saw the head's
        again only at its first use, and missed its emptying, read one head's weight over its prediction from
        there on (2 MiB at a vocabulary of 4,096 and hidden size 128; tests/test_multiprocess.py,
        `test_fsdp2_auto_...`). Only storages seen resized before are looked at (none where nothing resizes one in
        place)."""
        grown = 0
        for key in list(self._resized_before):
            storage = self._refs[key]() if key in self._refs else None
            if storage is None:
                self._resized_before.discard(key)
                continue
            grown += self.count(storage)
        self.peak = max(self.peak, self.current)
        return grown

    def seed(self, tensors) -> int:
        """Count the storages of `tensors` on this device not counted yet (a model's parameters and buffers, and each
        one's gradient, which only C++ may hold); the bytes the count grew by. Any other tensor made before the count
        began is counted at its first use under it. (A scan of every object the garbage collector holds, with a
        collection first, was tried: it took seconds a training in the test suite's long-lived process.)"""
        grown = 0
        for t in tensors:
            grown += self._seed(t)
        self.peak = max(self.peak, self.current)
        return grown

    def _seed(self, t: torch.Tensor) -> int:
        if _torch_api.is_fake(t):
            return 0
        inner = _torch_api.wrapped_tensors(t)
        if inner is not None:
            return sum(self._seed(part) for part in inner)
        try:
            if t.device.type != self.device or t.is_sparse:
                return 0
            grown = self.count(t.untyped_storage())
            grad = t.grad if t.is_leaf and t.requires_grad else None
        except Exception:  # a tensor without a storage of its own (a subclass): counted as its ops use its parts
            return 0
        return grown + (self._seed(grad) if grad is not None else 0)


class LiveMeter:
    """A reader's face of the live count (that of `memory.MemoryMeter`): the count now, and its peak since this
    meter's last `reset_peak`. A reset folds the peak so far into every other open meter's before the count's peak
    starts again from now (as `memory` does for CUDA's one counter)."""

    allocator = "storages"
    how = LIVE_HOW

    def __init__(self, count: LiveCount):
        self.count = count
        self.device = count.device
        self.folded = 0  # the count's peak before another meter's reset, since this one's
        count.meters.add(self)

    def read(self) -> MemoryReading:
        count = self.count
        count.resync()  # what was resized since the count's ops were last counted (`LiveCount.resync`)
        return MemoryReading(self.device, count.current / MIB, max(self.folded, count.peak, count.current) / MIB)

    def see(self, t: torch.Tensor) -> None:
        """Count `t` now, if it is not counted yet (a tensor made where no op was counted)."""
        self.count.see(t)
        self.count.peak = max(self.count.peak, self.count.current)

    def reset_peak(self) -> None:
        count = self.count
        for other in list(count.meters):
            if other is not self:
                other.folded = max(other.folded, count.peak)
        count.peak = count.current
        self.folded = 0

    def close(self) -> None:
        self.count.meters.discard(self)


_LIVE: Optional[LiveCount] = None


def live_count() -> LiveCount:
    """The process's count of CPU tensor storages (made at the first call; `seed` it before reading it)."""
    global _LIVE
    if _LIVE is None:
        _LIVE = LiveCount()
    return _LIVE


def make_library_workspaces(device: torch.device) -> int:
    """On CUDA, make the workspaces cuBLAS keeps on `device` for a training step's two threads (this one, which runs
    the forward, and autograd's, which runs the backward), as the step's first matmuls would, and give the bytes made:
    blocks of the caching allocator that CUDA's counter reads from then on and that no tensor storage shows (65 MiB
    on an H200 with torch's defaults: 32 a thread, and 1 more), so that `held_outside`, read after, counts them. A
    small product with and without a bias, forward and backward; nothing is made where they exist already.
    Elsewhere 0: the CPU's libraries keep no tensor."""
    if device.type != "cuda":
        return 0
    with torch.cuda.device(device):
        before = torch.cuda.memory_allocated(device)
        x = torch.ones(16, 16, device=device, requires_grad=True)
        bias = torch.zeros(16, device=device, requires_grad=True)
        (torch.addmm(bias, x, x) + x @ x).sum().backward()
        del x, bias
        return torch.cuda.memory_allocated(device) - before


def held_outside(
    model: torch.nn.Module, inputs, device: torch.device, optimizer=None, ddp: int = 1, trained: bool = False
) -> int:
    """The bytes the process holds on `device` outside a training step about to run on `model` with `inputs` (its
    forward's arguments): what the device's count reads, less what a dry run of the step counts itself: the model's
    parameters, buffers and gradients, the inputs, `optimizer`'s state (loaded before step one where a run resumes)
    and, under DistributedDataParallel over `ddp` processes, its gradient buckets (made on the device when DDP wraps
    the model: as many bytes as the trained parameters). Another model, tensors a notebook keeps: every reading of the
    step counts them too. On the CPU, the storages the process's live count has seen that are alive (none in a
    process that counted nothing before; DDP's buckets are first seen in backward: where the model `trained` in this
    process already, as before a step planned again for a longer batch, they are left out as on CUDA); on CUDA,
    `torch.cuda.memory_allocated`'s figure."""
    mine = {}

    def add(t) -> None:
        inner = _torch_api.wrapped_tensors(t)
        if inner is not None:
            for part in inner:
                add(part)
            return
        if t.device != device or _torch_api.is_fake(t):
            return
        storage = t.untyped_storage()
        mine[_torch_api.storage_identity(storage)] = storage
        grad = t.grad if t.is_leaf and t.requires_grad else None
        if grad is not None:
            add(grad)

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper's
    state = list(getattr(inner, "state", {}).values())
    for t in list(model.parameters()) + list(model.buffers()) + tensors_in(inputs) + tensors_in(state):
        add(t)
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) if ddp > 1 else 0
    if device.type == "cpu":
        return max(0, live_count().held_except(mine) - (buckets if trained else 0))
    if device.type == "cuda":
        own = sum(block_bytes(s.nbytes()) for s in mine.values())
        return max(0, torch.cuda.memory_allocated(device) - own - buckets)
    return 0


def meter_for(device: str):
    """The meter a measured step reads: a dry run's count where one is on, else on the CPU the process's live count
    of tensor storages, on CUDA the device's counter."""
    count = counting()
    if count is not None:
        return count
    return LiveMeter(live_count()) if device == "cpu" else MemoryMeter(device)
