"""The tracker: a dispatch mode that sees each aten op of a layer's forward and the storages its outputs create.

`LayerRun` is what the tracker and the saved-tensor hooks (`hooks`) share for one layer's forward pass: the
storages made (by which op, from which inputs, at which version), which of them autograd keeps as they are, and,
for ops the policy recomputes, the call to turn into a recipe. While step one is profiled, each op is timed.
"""

import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, FrozenSet, List, Optional

import torch
from torch import nn

from .. import _torch_api
from ..measure.profile import LayerProfile
from ..measure.storages import block_bytes, counting
from ..names import plan_name
from ..nested import map_tensors, tensors_in
from .recipe import Recipe, rng_state
from .routing import routing_op


def storage_key(t: torch.Tensor) -> int:
    """The identity of a tensor's storage among the live ones (`_torch_api.storage_identity`: a fake tensor's too, so a
    dry run's plans free what a real run's do); 0 for tensor subclasses without a storage, whose bytes are then counted
    nowhere: a save of one is recorded in `LayerProfile.unread` and said in the table's notes."""
    try:
        return _torch_api.storage_identity(t.untyped_storage())
    except Exception:
        return 0


def storage_bytes(t: torch.Tensor) -> int:
    """The bytes a tensor's storage is counted at, as the step's count counts it (`storages.block_bytes`: whole blocks
    of 512 bytes, as CUDA's caching allocator hands them out): a layer's graph that weighed a kept scalar at its own
    8 bytes (cuDNN attention's random seed and offset, kept for its backward) stood 504 bytes under the step for each
    (at 8B, 1,008 bytes more for every layer planned by ops than the choice's prediction)."""
    try:
        return block_bytes(t.untyped_storage().nbytes())
    except Exception:
        return 0


def is_param(t: torch.Tensor) -> bool:
    """A parameter (or a leaf that requires grad), or a view of one (`w.t()`): there at backward whatever is saved."""
    base = _torch_api.view_base(t)
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


class Call:
    """An op call the policy recomputes: one recipe for all of its outputs (dropout's output and mask), built when
    autograd first keeps one of them, or when a planned op made from them needs it (a chain)."""

    __slots__ = ("func", "args", "kwargs", "rng", "recipe", "outputs", "refs", "__weakref__")

    def __init__(self, func, args, kwargs, rng):
        self.func, self.args, self.kwargs, self.rng = func, args, kwargs, rng
        self.recipe: Optional[Recipe] = None
        self.outputs = 0  # the outputs' storages still alive (`outlived_by`)
        self.refs: list = []

    def outlived_by(self, t: torch.Tensor) -> None:
        """Hold the inputs no longer than `t`'s storage and the call's other outputs': once every output is freed
        with no recipe made (none was saved: a LoRA branch's output scaled by a planned `mul` whose output is only
        added), nothing can ask for one, and inputs held here alone (that branch's output) would otherwise live to
        the layer's end: 16 MiB above what the step holds plainly, in a layer of README's main job. A planned op
        reading the output holds it, and so this call's inputs, for a chain."""
        try:  # the callback holds the call weakly: a cycle through it would keep the call (its inputs) to a collection
            self.refs.append(weakref.ref(t.untyped_storage(), partial(_output_freed, weakref.ref(self))))
        except Exception:  # no storage of its own (a tensor subclass): the inputs are held to the layer's end
            return
        self.outputs += 1

    def to_recipe(self, stand_in: Callable[[int, torch.Tensor], object]) -> Recipe:
        """The recipe, its k-th tensor input replaced by `stand_in(k, tensor)` (the tensor itself where autograd
        keeps it anyway, or a stand-in for a planned output recomputed in turn)."""
        if self.recipe is None:
            if self.args is None:  # pragma: no cover - an output was saved, so it is alive: see `outlived_by`
                raise RuntimeError(f"optimum-memopt: a recipe asked of {self.func} after every output was freed")
            count = iter(range(1 << 30))
            args, kwargs = map_tensors((self.args, self.kwargs), lambda t: stand_in(next(count), t))
            self.recipe = Recipe(self.func, args, kwargs, self.rng)
            self.args = self.kwargs = None  # the recipe holds the inputs now
        return self.recipe


def _output_freed(call_ref, _storage_ref) -> None:
    call = call_ref()
    if call is None:
        return
    call.outputs -= 1
    if call.outputs == 0 and call.recipe is None:
        call.args = call.kwargs = None


@dataclass
class Input:
    """A tensor input of an op: a weak reference, the storage's maker in this layer (if any) and the tensor's
    version when the op read it (a chain recomputes the maker's output only if the op read it unchanged)."""

    ref: object
    maker: Optional["Made"]
    version: int
    key: int = 0  # the storage's identity when read
    nbytes: int = 0  # its bytes, when step one records (a storage from outside the layer is a node of its graph)


@dataclass
class Made:
    """A storage an op created during this layer's forward."""

    plan: str
    storage: object  # a weak reference to the storage (`_torch_api.storage_ref`): expired once it is freed
    nbytes: int
    version: int
    index: int  # its place among the op's output tensors (`tensors_in` order: an output that is None has none)
    inputs: List[Optional[Input]]  # each tensor input in `tensors_in` order; None for parameters
    call: Optional[Call] = None  # when the op belongs to a plan applied here
    recipe: Optional[Recipe] = None
    recomputable: Optional[bool] = None  # decided when autograd first keeps it
    why_not: str = ""
    seconds: float = 0.0  # the op's time, when profiled
    op: int = 0  # the op call that made it (in step one's graph)
    key: int = 0  # the storage's identity (its address while alive)
    dtype: object = None
    own: bool = True  # at its first save: as the op made it (same version and dtype)
    routing: bool = False  # an MoE's routing (`routing.routing_op`): never planned, kept


class LayerRun:
    """One layer's forward pass under the backend."""

    def __init__(self, apply: FrozenSet[str], record: Optional[LayerProfile], outer_hooks=None, check_outer=False):
        self.apply = apply
        self.record = record
        self.made: Dict[int, Made] = {}
        # storages autograd keeps as they are, with a weak reference to the tensor kept: a node freed during the
        # forward (an unused output's) frees what it kept, and its address may be reused by a later storage
        self.kept: Dict[int, object] = {}
        self.counted: List[Made] = []  # each storage autograd kept, once, as it was first kept
        # the saved-tensor hooks active when the layer started (a user's `save_on_cpu`, an offloading hook; at level
        # 1 checkpoint's own): ours hand them every tensor kept as it is
        self.outer = outer_hooks
        self.handed: Dict[int, object] = {}  # storage key -> the hooks' package of its last save (`hooks.Handed`)
        self.check_outer = check_outer  # checkpoint's hooks: what they give back is checked for in-place changes
        self.stashed = False  # a recipe stands in for a saved tensor: ops writing to planned outputs are watched
        # step one only: every storage made, in order, and each storage's first save (a Made, or a storage from
        # outside the layer as (key, bytes)), for the layer's graph (`graph`)
        self.all_made: List[Made] = []
        self.saves: List[object] = []
        self.saved_keys: set = set()  # the record's id for a storage made here, else the storage's address
        self.ops = 0

    def on_op(self, func, args, kwargs, out, rng, seconds: float = 0.0) -> None:
        if self.record is not None:
            self.record.op_seconds += seconds
        if self.stashed:
            for t in _torch_api.written_args(func, args, kwargs):
                ptr = storage_key(t)
                made = self.made.get(ptr)
                # a planned output still alive and written to (a freed one's address may be a new storage now)
                if made is not None and made.recipe is not None and not made.storage.expired():
                    made.recipe.changed.setdefault(made.index, str(func))
        name = plan_name(_torch_api.op_name(func))
        routing = routing_op(func)
        applying = name in self.apply and not routing
        if not (applying or self.record is not None):
            return
        if _torch_api.returns_alias(func):
            return  # views and in-place ops create no storage
        inputs = [None if is_param(t) else self._input(t) for t in tensors_in((args, kwargs))]
        call = Call(func, args, kwargs, rng) if applying else None
        self.ops += 1
        for i, t in enumerate(tensors_in(out)):
            ptr = storage_key(t)
            if not ptr:
                continue
            known = self.made.get(ptr)
            if known is not None and not known.storage.expired():
                continue  # an op that returns an alias without saying so in its schema (`_unsafe_view`)
            made = Made(name, _torch_api.storage_ref(t), storage_bytes(t), _torch_api.version(t), i, inputs, call)
            if call is not None:
                call.outlived_by(t)
            made.seconds = seconds
            made.op, made.key, made.dtype, made.routing = self.ops, ptr, t.dtype, routing
            self.made[ptr] = made
            if self.record is not None:
                self.all_made.append(made)

    def _input(self, t: torch.Tensor) -> Input:
        ptr = storage_key(t)
        maker = self.made.get(ptr)
        if maker is not None and maker.storage.expired():
            maker = None  # a freed output's address, reused by a storage made elsewhere
        nbytes = storage_bytes(t) if self.record is not None and maker is None else 0
        return Input(weakref.ref(t), maker, _torch_api.version(t), ptr, nbytes)


def _synchronize(args, kwargs) -> None:
    device = next((t.device for t in tensors_in((args, kwargs)) if t.device.type != "cpu"), None)
    if device is not None:
        torch.get_device_module(device.type).synchronize(device)


class TrackingMode(_torch_api.TorchDispatchMode):
    def __init__(self, run: LayerRun):
        super().__init__()
        self.run = run

    @_torch_api.answers_fake_device
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _torch_api.returns_no_tensor(func):  # a query of metadata: nothing made, kept or timed
            return func(*args, **kwargs)
        planned = plan_name(_torch_api.op_name(func)) in self.run.apply and not routing_op(func)
        rng = rng_state(func, args, kwargs) if planned else None
        if self.run.record is None:
            out = func(*args, **kwargs)
            self.run.on_op(func, args, kwargs, out, rng)
            return out
        count = counting()
        if count is not None and count.clock is not None:  # a dry run: the op's time on the device it stands for
            out = func(*args, **kwargs)
            self.run.on_op(func, args, kwargs, out, rng, count.clock(func, args, kwargs, out))
            return out
        # profiling step one: each op timed (devices synchronized around it, so the time is the op's own)
        _synchronize(args, kwargs)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        _synchronize(args, kwargs)
        self.run.on_op(func, args, kwargs, out, rng, time.perf_counter() - start)
        return out
