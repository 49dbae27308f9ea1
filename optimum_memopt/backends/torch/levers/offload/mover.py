"""What the offload lever does to a layer's saved tensors: each storage autograd saves in an offloaded layer's
training forward copied to the host as it is saved (on a stream of its own where the device has streams), the
device's let go of, and fetched back ahead of the backward that needs it.

The rules (tests/test_offload.py):

- Offloaded: the storage of every plain tensor autograd saves in the layer's training forward (its input above all), on
  the layer's device; a parameter (the weights stay where they are), a tensor subclass (FSDP2's DTensor) and a sparse
  tensor stay where they are. A storage saved several times in a layer (views of it) is copied once, and each saved
  tensor comes back as the same view of its copy (sizes, strides and offset as saved: the backward's kernels see what
  they would have seen).
- In a dry run for a card (fake tensors, counted as the card counts: the count knows the card's link to the host) the
  copy is its bytes alone: no tensor stands for the host's (the count would take it for the card's), the device's
  fake storage is let go of as a card's would be, and the fetch makes the device's again. So the dry run's step holds
  what the card's does, and `on_host` what the host would. In a dry run of the CPU's step the copy is a fake tensor
  the count sees, as the CPU's own count sees a real run's copies (the host is the device).
- The copy is a copy: gradients are bitwise those of the run without the lever, dropout included.
- The device's storage is let go of once its copy is made (on a card, once the copy queued on the side stream ran:
  `record_stream`), unless something else holds it (the layer's output, another layer's input).
- A layer's tensors come back when backward reaches the layer `ahead` layers after it (`Mover.reached`, from a
  pre-hook of the node that made that layer's output: after the hooks on the output itself), or at the latest when
  backward unpacks one; each storage once a step.
- In a dry run that replays alike layers, a replayed layer's copies are made again from a recorded one's sizes
  (`stand_in`): counted on the host, fetched and let go of as the recorded layer's were.
- A saved tensor changed in place after it was saved is refused at backward, as autograd refuses it, where the
  change is seen: the tensor still alive at backward, or its storage saved again at another version (saved-tensor
  hooks turn autograd's own check off: torch's `save_on_cpu` refuses none; docs/STACK.md). Gradients are then those
  of the values as saved.
- Nothing stays on the host once the step's graph is let go of: the copies live in autograd's graph.

On the CPU the host is the device: the copies are made all the same and the streams are none (`Streams`), so the
CPU's tests run the path a card runs, copies, order and release included.
"""

import contextlib
import weakref
from typing import Dict, Optional

import torch

from ... import _torch_api
from ...measure.storages import counting


class Streams:
    """The copies' stream and its order against the compute's on `device`: on a card, a stream of its own, each copy
    queued after what the compute queued before it and the compute waiting on a fetch before it reads it; elsewhere
    none (each copy done when made)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device) if self.cuda else None

    def copying(self):
        """The context a copy is queued in: the side stream, after the compute's work so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        return torch.cuda.stream(self.side)

    def copied(self, used: torch.Tensor) -> Optional[object]:
        """After a copy queued: `used` (a device tensor the copy reads or writes) kept until the copy ran, and the
        event the compute waits on before reading the copy (None: done)."""
        if not self.cuda:
            return None
        used.record_stream(self.side)
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def ready(self, event: Optional[object]) -> None:
        """The compute waits for a copy (`copied`'s event) before it reads what it made."""
        if event is not None:
            torch.cuda.current_stream(self.side.device).wait_event(event)


class _Copy:
    """One storage on the host: its bytes, the version it was copied at, and, once fetched, its bytes on the
    device again."""

    __slots__ = ("host", "nbytes", "version", "device", "source", "fetched", "event", "changed", "__weakref__")

    def __init__(self, host: Optional[torch.Tensor], nbytes: int, t: torch.Tensor):
        self.host = host  # None in a dry run: its bytes alone
        self.nbytes = nbytes
        self.version = _torch_api.version(t)
        self.device = t.device
        self.source = weakref.ref(t)  # while it lives, so does the storage: its address names no other one
        self.fetched: Optional[torch.Tensor] = None
        self.event = None
        self.changed = False  # saved again at another version: the tensors saved before it were changed in place


class _Saved:
    """What autograd holds for one saved tensor: its storage's copy and the view to make of it."""

    __slots__ = ("copy", "dtype", "size", "stride", "offset", "source", "version", "mover", "__weakref__")

    def __init__(self, copy: _Copy, t: torch.Tensor, mover: "Mover"):
        self.copy = copy
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        self.source = weakref.ref(t)
        self.version = _torch_api.version(t)
        self.mover = mover


class Mover:
    """The offload of one model's chosen layers (`layers`: index -> how many layers ahead their tensors are fetched):
    the saved-tensor hooks a layer's training forward runs under (`saving(index)`), and the fetch as backward reaches
    a layer (`reached(index)`). `moved_bytes`: what the last forward of each layer copied to the host."""

    def __init__(self, layers: Dict[int, int], device: torch.device):
        self.layers = dict(layers)
        self.streams = Streams(device)
        self.device = device
        self.moved_bytes: Dict[int, int] = {}
        self.host_bytes = 0  # what the copies alive hold on the host now
        self.host_peak = 0  # and at their most (a step's, at the end of its last offloaded layer's forward)
        # each layer's copies this step (what backward fetches), and by the address of the storage copied (a storage
        # saved again is copied once); held weakly: a copy lives as long as autograd holds a tensor saved from it (its
        # node not yet run), and goes with the last of them
        self._copies: Dict[int, weakref.WeakSet] = {}
        self._by_address: Dict[int, weakref.WeakValueDictionary] = {}

    def saving(self, index: int):
        """The saved-tensor hooks layer `index`'s training forward runs under."""
        self._copies[index] = weakref.WeakSet()
        self._by_address[index] = weakref.WeakValueDictionary()
        self.moved_bytes[index] = 0
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(index, t), _unpack)

    def stand_in(self, index: int, sizes, hosts, like: torch.Tensor) -> list:
        """Layer `index`'s copies made again in a dry run that replays the layer (`measure.replay`): one of each of
        `sizes` bytes on the host, counted as `_pack` counts a copy, fetched as a copy is; `hosts`: each one's host
        tensor where the count sees the host's copies (the CPU's step), else None; `like`: a tensor of the layer's
        device. They live as long as what holds the returned list (the replayed layer, until its backward)."""
        self._copies[index] = weakref.WeakSet()
        self._by_address[index] = weakref.WeakValueDictionary()
        self.moved_bytes[index] = 0
        made = []
        for nbytes, host in zip(sizes, hosts):  # a host stand-in holds the storage's counted bytes (whole blocks)
            copy = _Copy(None if host is None else host[:nbytes], nbytes, like)
            self._copies[index].add(copy)
            self.moved_bytes[index] += nbytes
            self.host_bytes += nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)
            weakref.finalize(copy, self._released, nbytes)
            made.append(copy)
        return made

    def copies_of(self, index: int) -> list:
        """The copies of layer `index`'s last forward alive now."""
        return list(self._copies.get(index, ()))

    def _pack(self, index: int, t: torch.Tensor):
        fake = _torch_api.is_fake(t)
        if not (type(t) is torch.Tensor or fake) or t.device != self.device or t.layout != torch.strided:
            return t  # a parameter, a subclass (FSDP2's DTensor), another device's, sparse
        storage = t.untyped_storage()
        if storage.nbytes() % t.element_size():
            return t  # a storage that is not a whole number of this dtype's elements cannot be read back as them
        key = _torch_api.storage_identity(storage)
        copies = self._by_address[index]
        copy = copies.get(key)
        if copy is not None and copy.source() is None:
            copy = None  # the tensor it was copied from is gone: the address may be another storage's now
        if copy is not None and copy.version != _torch_api.version(t):
            copy.changed = True  # saved again after an in-place change: what was saved before is not what it was
            copy = None
        if copy is None:
            copy = copies[key] = self._copy_out(storage, t, fake)
            self._copies[index].add(copy)
            self.moved_bytes[index] += copy.nbytes
            self.host_bytes += copy.nbytes
            self.host_peak = max(self.host_peak, self.host_bytes)
            weakref.finalize(copy, self._released, copy.nbytes)
        return _Saved(copy, t, self)

    def _copy_out(self, storage, t: torch.Tensor, fake: bool) -> _Copy:
        count = counting()
        if fake and count is not None and count.host_link is not None:  # a dry run for a card: the bytes alone
            return _Copy(None, storage.nbytes(), t)
        if fake:  # a dry run of the CPU's step: a storage the count sees, nothing to copy (a fake `set_` would hold
            return _Copy(torch.empty(storage.nbytes(), dtype=torch.uint8), storage.nbytes(), t)  # the source's)
        whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        host = torch.empty(whole.numel(), dtype=torch.uint8, pin_memory=self.streams.cuda)
        with self.streams.copying():
            host.copy_(whole, non_blocking=self.streams.cuda)
        copy = _Copy(host, host.numel(), t)
        copy.event = self.streams.copied(whole)
        return copy

    def fetch(self, copy: _Copy) -> None:
        """`copy` brought back to the device (once a step), queued on the side stream."""
        if copy.fetched is not None:
            return
        back = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
        if copy.host is None:  # a dry run's: the device's bytes made again, nothing to copy
            copy.fetched = back
            return
        with self.streams.copying():  # on the stream its copy out was queued on: after it
            back.copy_(copy.host, non_blocking=self.streams.cuda)
        copy.event = self.streams.copied(back)
        copy.fetched = back

    def reached(self, index: int) -> None:
        """Backward reached layer `index`'s output: its tensors, and those of the layers up to `ahead` before it,
        fetched (each offloaded layer's own `ahead`)."""
        for i in sorted(self._copies, reverse=True):  # the layer whose backward starts first, then the ones before
            if i <= index and index - i <= self.layers.get(i, 0):
                for copy in list(self._copies[i]):
                    self.fetch(copy)

    def _released(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def on_host(self) -> int:
        """The bytes the host holds now for the copies of each offloaded layer's last forward (0 once its graph is let
        go of)."""
        return self.host_bytes


def _unpack(saved) -> torch.Tensor:
    if not isinstance(saved, _Saved):
        return saved
    copy = saved.copy
    source = saved.source()
    if copy.changed or (source is not None and _torch_api.version(source) != saved.version):
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: a "
            f"tensor of {tuple(saved.size)} saved in a layer `Offload+` offloads was changed in place after it was "
            "saved (autograd refuses the same without the lever); drop `Offload+` on that layer to see autograd's own "
            "message, or do not change the tensor in place"
        )
    saved.mover.fetch(copy)
    saved.mover.streams.ready(copy.event)
    out = copy.fetched.view(saved.dtype).as_strided(saved.size, saved.stride, saved.offset)
    _torch_api.set_version(out, saved.version)  # the tensor saved, as it was: a recompute's checks compare versions
    return out
