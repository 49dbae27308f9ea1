"""Memory counted from the tensors themselves: every live tensor storage, in the blocks CUDA's caching allocator
hands out (512 bytes at least, in steps of 512), which is what `torch.cuda.memory_allocated` counts for them.

`StorageCount` is a dispatch mode: after each op it adds the storages it has not seen yet among the op's outputs and
inputs (a tensor made before the count began is counted at its first use; a wrapper subclass, a DTensor, by the
tensors it wraps: its own storage is the whole tensor's size and holds nothing), and a weak reference on each
storage takes its bytes back the moment the storage is freed, whether the count is on or not. A storage resized in
place from Python (FSDP2 frees a layer's gathered weights by resizing their storage to 0, and gathers them again
into it) is counted again at its new size as it is resized. The peak is read after every op, as the CUDA counter's
would be at an op's end; what one op holds inside itself (a kernel's workspace) and what the device's allocator adds
on top (a block's rounding beyond 512 bytes, fragmentation, a library's workspaces, the CUDA context) are not seen:
a dry run states them as a margin.

On fake tensors (`torch._subclasses.fake_tensor.FakeTensorMode`) a storage has its size and no memory: the same count
is then the dry run's meter (`fake_step`), a step at real size on any machine. It has the face of a
`memory.MemoryMeter` (`read`, `reset_peak`, `close`, `device`, `allocator`), so the step watch and the budget planner
read it as they read a device.

While a count is on (`counting()`), work read aside (`aside.held_aside`) reads it instead of the device's own counter,
and where it carries a `clock` (a dry run's roofline), the ops' times step one's profile and the levers record are the
clock's, not the wall's.
"""

import weakref
from functools import partial
from typing import Callable, Dict, Optional, Tuple

import torch

from ....memory import MIB, MemoryReading
from .. import _torch_api
from ..nested import tensors_in

BLOCK = 512  # CUDA's caching allocator rounds every block up to a multiple of this (its smallest block)

HOW = "tensor storages counted after every op, in CUDA's 512-byte blocks"

_ACTIVE: list = []  # the counts on now as dispatch modes (dry runs), innermost last
_FOLLOWING: list = []  # counts following storages resized in place now (`follow_resizes`): those above


def block_bytes(nbytes: int) -> int:
    """The bytes a storage of `nbytes` takes in CUDA's caching allocator's count (0 for an empty one)."""
    return 0 if nbytes <= 0 else -(-nbytes // BLOCK) * BLOCK


def _following() -> list:
    """The counts a storage resized now is told to: those following (`follow_resizes`), and those whose op-counting
    modes are on the dispatch stack now (`follows_resizes`: `live.CountOps`), each once."""
    counts = list(_FOLLOWING) + [m.count for m in _torch_api.dispatch_modes() if getattr(m, "follows_resizes", False)]
    return list({id(c): c for c in counts}.values())


def _resized(storage) -> None:
    for count in _following():
        count.resized(storage)


def watch_resizes() -> None:
    """Wrap `UntypedStorage.resize_` while any count follows (`_following`), and give torch's back when none does.
    Called where a count starts or stops following. A mode autograd drops from its stack without leaving it (one a
    node entered and did not leave) stops following with it: it is no longer on the stack to be found."""
    _torch_api.watch_storage_resizes(_resized if _following() else None)


def follow_resizes(count: "StorageCount", on: bool) -> None:
    """Have `count` follow the storages resized in place from Python (`on`) or stop (calls nest, a count per call)."""
    if on:
        _FOLLOWING.append(count)
    elif count in _FOLLOWING:
        _FOLLOWING.remove(count)
    watch_resizes()


def counting() -> Optional["StorageCount"]:
    """The innermost count on now as a dispatch mode (a dry run's), or None."""
    return _ACTIVE[-1] if _ACTIVE else None


class StorageCount(_torch_api.TorchDispatchMode):
    """Live tensor storages' bytes, now and at their highest since `reset_peak` (see the module's docstring)."""

    allocator = "storages"
    how = HOW

    def __init__(self, device: str = "cuda"):
        super().__init__()
        self.device = device  # the device whose count this stands for (said with its readings)
        self.current = 0
        self.peak = 0
        # where the count stands for a device the ops do not run on (a dry run), an op's seconds there, which the
        # engine's profile and the levers' measurements take in place of the wall clock's: (func, args, kwargs, out)
        self.clock: Optional[Callable] = None
        # where the count stands for a card (a dry run for one): its link to the host's memory, (bytes/s each way, in
        # words), which an offload's copies are priced by in place of copies timed (`devices.Device.host_link`)
        self.host_link: Optional[Tuple[float, str]] = None
        self.aside = 0  # > 0 while work read aside runs (`aside.held_aside`): its peak is given back after it
        # the device type whose storages alone are counted, where real tensors on a card are (a dry run's real step
        # on CUDA: the host scalars some kernels make, a flash kernel's random state without dropout, are not the
        # card's); None: every storage (fake tensors, which stand for the card's wherever they are)
        self.only: Optional[str] = None
        # True while a replayed layer's tensors are made (`measure.replay`): a storage first seen is taken in at its
        # size without the count growing (the replayed record already counted its bytes)
        self.adopting = False
        self._live: Dict[int, int] = {}  # a storage's identity -> the bytes counted for it
        self._refs: Dict[int, weakref.ref] = {}

    def __enter__(self):
        _ACTIVE.append(self)
        follow_resizes(self, True)
        return super().__enter__()

    def __exit__(self, *exc):
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        follow_resizes(self, False)
        return super().__exit__(*exc)

    @_torch_api.answers_fake_device
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not _torch_api.returns_no_tensor(func):  # a query of metadata makes no storage
            self.after_op(out, args, kwargs)
        return out

    def after_op(self, out, args, kwargs) -> None:
        """An op has run: count the storages it made or first used, and take the count now into the peak."""
        for t in tensors_in(out):
            self.see(t)
        for t in tensors_in(args) + tensors_in(kwargs or {}):
            self.see(t)
        if self.current > self.peak:
            self.peak = self.current

    def see(self, t: torch.Tensor) -> None:
        """Count `t`'s storage if it is not counted yet (and its new size, where an op resized it); a wrapper's (a
        DTensor's) storage holds nothing, so the tensors it wraps are counted instead."""
        inner = _torch_api.wrapped_tensors(t)
        if inner is not None:
            for part in inner:
                self.see(part)
            return
        try:
            storage = t.untyped_storage()
        except Exception:  # a tensor subclass without a storage of its own: its parts are counted as they are made
            return
        self.count(storage)

    def count(self, storage) -> int:
        """Count `storage` at its size now; the bytes the count grew by (less than 0: it shrank)."""
        if self.only is not None and storage.device.type != self.only:
            return 0
        key = _torch_api.storage_identity(storage)
        nbytes = block_bytes(storage.nbytes())
        known = self._live.get(key)
        if known is None:
            self._refs[key] = weakref.ref(storage, partial(self._gone, key))
            if self.adopting:
                self._live[key] = nbytes
                self._grew(key, 0)
                return 0
        elif known == nbytes:
            return 0
        else:
            self._resized_in_place(key)
        self._live[key] = nbytes
        grown = nbytes - (known or 0)
        self.current += grown
        self._grew(key, grown)
        return grown

    def _resized_in_place(self, key: int) -> None:
        """A storage counted before is counted at another size (resized in place since). By default nothing."""

    def _grew(self, key: int, nbytes: int) -> None:
        """A storage's count changed by `nbytes` (a subclass keeps it by part)."""

    def resized(self, storage) -> None:
        """A storage resized in place outside any op (FSDP2 freeing or gathering a layer's weights)."""
        self.count(storage)
        self.peak = max(self.peak, self.current)

    def forget(self, t: torch.Tensor) -> None:
        """Take `t`'s storage out of the count without its bytes leaving it: a replayed record (`measure.replay`) lets
        go of them where the layer it stands for did, and the storage's end, whenever it comes, takes nothing back."""
        key = _torch_api.storage_identity(t.untyped_storage())
        self._live.pop(key, None)
        self._refs.pop(key, None)

    def held_except(self, identities) -> int:
        """The bytes counted now for storages other than those `identities` (`_torch_api.storage_identity`) name."""
        return sum(nbytes for key, nbytes in self._live.items() if key not in identities)

    def _gone(self, key: int, _ref) -> None:
        self.current -= self._live.pop(key, 0)
        self._refs.pop(key, None)

    def add_peak(self, nbytes: int) -> None:
        """Take `nbytes` above the current count into the peak (what an op is known to hold inside itself)."""
        self.peak = max(self.peak, self.current + nbytes)

    # the face of `memory.MemoryMeter`
    def read(self) -> MemoryReading:
        self.peak = max(self.peak, self.current)
        return MemoryReading(self.device, self.current / MIB, self.peak / MIB)

    def reset_peak(self) -> None:
        self.peak = self.current

    def close(self) -> None:
        """Nothing to stop (the count is a mode its owner leaves)."""
