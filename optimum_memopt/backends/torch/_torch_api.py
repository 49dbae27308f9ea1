"""Every private PyTorch access of the torch backend, in one place.

Each name below reaches into something torch does not promise to keep (an underscore module, attribute or
function). tests/test_torch_api.py checks each against the installed torch, so a release that moves one fails
CI, not a user's run; where a public fallback exists, it is used when the private path is gone.
"""

import functools
import weakref
from typing import Callable, Optional

import torch

try:  # torch >= 2.0: the base class of Python dispatch modes (the tracker subclasses it at import)
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 (re-exported for the tracker)
except ImportError as e:  # pragma: no cover - checked by tests/test_torch_api.py
    raise ImportError(
        f"optimum-memopt's torch backend needs torch.utils._python_dispatch.TorchDispatchMode, which torch "
        f"{torch.__version__} does not have ({e}); use the torch version of constraints-torch.txt"
    ) from e

# Ops whose outputs alias an input, for torches whose op schemas cannot be read (the fallback of `returns_alias`).
_ALIASING = frozenset(
    "view _unsafe_view alias as_strided t transpose permute expand slice select unsqueeze squeeze reshape "
    "unbind split chunk narrow diagonal view_as unflatten flatten detach".split()
)


def top_saved_tensors_hooks():
    """The (pack, unpack) saved-tensor hooks active now (torch.utils.checkpoint's, inside a checkpointed layer), or
    None. Private: `torch._C._autograd._top_saved_tensors_default_hooks`; without it, None (nothing to chain)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    return top(False)


def profiling() -> bool:
    """Whether torch's profiler records now (private `torch.autograd._profiler_enabled`; without it, False: the
    backend's marks in a profile are left out, nothing else)."""
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return bool(enabled()) if enabled is not None else False


def returns_alias(func) -> bool:
    """Whether an aten op's outputs alias its inputs (views, in-place and out= ops), read from its schema (private
    `OpOverload._schema`); without a schema, from its name (views listed above, in-place ops end in `_`)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return any(r.alias_info is not None for r in schema.returns)
    name = op_name(func)
    return name.endswith("_") or name in _ALIASING


_NO_TENSOR: dict = {}


def returns_no_tensor(func) -> bool:
    """Whether an aten op answers with values other than tensors alone (`prim.device`, a size, a bool), read from its
    schema (private `OpOverload._schema`, cached per op): it reads its tensors' metadata, not their bytes, and makes
    no storage (a fake tensor dispatches `prim.device` for each device its C++ callers ask of it: 132,000 of them in
    an 8B step's dry run). False for an op that returns nothing (an in-place `_foreach_` op works on its arguments)
    and where no schema can be read."""
    known = _NO_TENSOR.get(func)
    if known is None:
        schema = getattr(func, "_schema", None)
        known = bool(schema is not None and schema.returns) and not any(
            "Tensor" in str(r.type) for r in schema.returns
        )
        _NO_TENSOR[func] = known
    return known


_WRITES: dict = {}


def written_args(func, args, kwargs) -> list:
    """The tensor arguments an aten op writes to (in-place and out= ops), read from its schema (private
    `OpOverload._schema`, cached per op); without a schema, the first argument of an op whose name ends in `_`."""
    where = _WRITES.get(func)
    if where is None:
        schema = getattr(func, "_schema", None)
        if schema is None:
            where = ((0,), ()) if op_name(func).endswith("_") else ((), ())
        else:
            written = [(i, a.name) for i, a in enumerate(schema.arguments) if a.alias_info and a.alias_info.is_write]
            where = (tuple(i for i, _ in written), tuple(n for _, n in written))
        _WRITES[func] = where
    positions, names = where
    if not positions and not names:
        return []
    found = [args[i] for i in positions if i < len(args)] + [kwargs[n] for n in names if n in kwargs]
    return [t for t in found if isinstance(t, torch.Tensor)]


def op_name(func) -> str:
    """The overload packet's name of an aten op (`gelu` for `aten.gelu.default`)."""
    return func.overloadpacket.__name__


try:  # a weak reference to a storage (not to one tensor object viewing it)
    from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef
except ImportError:  # pragma: no cover - checked by tests/test_torch_api.py
    _StorageWeakRef = None


class _TensorRef:
    """The fallback of `storage_ref`: a weak reference to the tensor object (which may die before its storage)."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor):
        self.ref = weakref.ref(t)

    def expired(self) -> bool:
        return self.ref() is None


def storage_ref(t: torch.Tensor):
    """A weak reference to a tensor's storage: `expired()` once the storage is freed, whichever tensors viewed it
    (nn.Linear on a 3-D input returns `_unsafe_view` of its matmul's output, and the matmul's own tensor object dies
    at once). Private: `torch.multiprocessing.reductions.StorageWeakRef` over `Storage._weak_ref`; without it, a weak
    reference to the tensor object."""
    if _StorageWeakRef is not None:
        try:
            return _StorageWeakRef(t.untyped_storage())
        except Exception:  # tensor subclasses without a storage
            pass
    return _TensorRef(t)


def storage_identity(storage) -> int:
    """One storage's identity among the live ones, the same for every tensor viewing it: its C++ object's address
    (private `UntypedStorage._cdata`), which a fake tensor's storage has too (its data pointer is 0); without it, the
    data pointer (0 for every fake storage)."""
    key = getattr(storage, "_cdata", None)
    return key if isinstance(key, int) else storage.data_ptr()


def view_base(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was taken of (private `Tensor._base`), or the tensor itself; without it, the tensor."""
    base = getattr(t, "_base", None)
    return base if base is not None else t


def version(t: torch.Tensor) -> int:
    """Autograd's version counter of a tensor (private `Tensor._version`): bumped by every in-place change."""
    return t._version


def set_version(t: torch.Tensor, value: int) -> None:
    """Set autograd's version counter of `t` (shared with its views) to `value`: a tensor the offload lever brings
    back stands for the one saved, at the version it was saved at, which the engine's checks compare (private
    `torch._C._autograd._unsafe_set_version_counter`, a sequence of tensors and one of versions)."""
    torch._C._autograd._unsafe_set_version_counter((t,), (value,))


def at_backward_end(fn) -> None:
    """Run `fn()` when the backward pass now running ends (private `Variable._execution_engine.queue_callback`, as
    DDP and FSDP use it); call it from a backward hook."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def foreign_recompute() -> Optional[str]:
    """How code running now is under someone else's recompute, or None: a non-reentrant `torch.utils.checkpoint`
    (its saved-tensor hooks are the innermost: its first forward, or its recompute in backward), or a forward run
    inside a backward pass (a reentrant checkpoint's recompute). Private: the hooks' qualified names in
    torch.utils.checkpoint, and `torch._C._current_graph_task_id` (-1 outside backward)."""
    top = top_saved_tensors_hooks()
    pack = top[0] if top is not None else None
    if getattr(pack, "__module__", None) == "torch.utils.checkpoint":
        name = getattr(pack, "__qualname__", "")
        if name.startswith("_recomputation_hook"):
            return "inside torch.utils.checkpoint's recompute"
        return "inside torch.utils.checkpoint"
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is not None and task() != -1:
        return "during a backward pass (a recompute: torch.utils.checkpoint with use_reentrant=True)"
    return None


def in_backward() -> bool:
    """Whether a backward pass runs now (on this thread: a recompute inside it). Private:
    `torch._C._current_graph_task_id` (-1 outside backward); without it, False."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


try:  # private: the class of a dry run's tensors (`is_fake`, `answers_fake_device`)
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # pragma: no cover - checked by tests/test_torch_api.py
    _FakeTensor = None


def is_fake(t: torch.Tensor) -> bool:
    """Whether `t` is a fake tensor (a dry run's: no memory behind it). Private:
    `torch._subclasses.fake_tensor.FakeTensor`; without it, False."""
    return _FakeTensor is not None and isinstance(t, _FakeTensor)


def split_keyed_alike(t: torch.Tensor, rows: int) -> tuple:
    """`t.split(rows)`; where `t` is a fake tensor that no gradient flows through, each piece viewed from the start
    of `t`'s storage instead (the same storage, shapes and strides; a fake tensor has no values to read). FakeTensor's
    cache keys an op by its inputs' storage offsets, so every op on each piece of a split misses it and runs in full
    (an 8B dry run's labels: about 1,700 ops in its ~140 head chunks); viewed from one offset, the pieces of a size
    are one key. Any other tensor: its split."""
    pieces = t.split(rows)
    if not is_fake(t) or t.requires_grad:
        return pieces
    return tuple(t.as_strided(p.shape, p.stride(), 0) for p in pieces)


_DEVICE_QUERY = torch.ops.prim.device.default


def answers_fake_device(dispatch: Callable) -> Callable:
    """A dispatch mode's `__torch_dispatch__` that answers `prim.device` asked of a fake tensor itself, as the fake
    mode does (`FakeTensor.device`: its fake device, `meta` inside a kernel), instead of passing the query down
    through every mode under it: the autograd engine and ops ask it in C++ of every tensor they take (66,000 of the
    107,000 dispatches of an 8B dry run, about a tenth of its time). Every other op, and the query of a tensor that is
    not fake, goes to `dispatch`."""

    @functools.wraps(dispatch)
    def answered(self, func, types, args=(), kwargs=None):
        if func is _DEVICE_QUERY and len(args) == 1 and is_fake(args[0]):
            return args[0].device
        return dispatch(self, func, types, args, kwargs)

    return answered


def flatten(value) -> tuple:
    """`value`'s leaves (tensors, values, objects torch's pytree does not open) and its structure, to make it again
    with `unflatten`: a layer's output made again in the order forward (`fake_step._layers_replayed`). Private:
    `torch.utils._pytree` (tuples, lists, dicts, namedtuples, and the classes registered with it: transformers
    registers its `ModelOutput`s); no public fallback (there the order forward runs every layer)."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten(value)


def unflatten(leaves: list, spec) -> object:
    """`flatten`'s inverse: the structure `spec` with `leaves` in it."""
    from torch.utils._pytree import tree_unflatten

    return tree_unflatten(leaves, spec)


try:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as _is_wrapper
except ImportError:  # pragma: no cover - checked by tests/test_torch_api.py
    _is_wrapper = None


def wrapped_tensors(t: torch.Tensor) -> Optional[list]:
    """The tensors `t` wraps where it is a wrapper subclass (a DTensor, as FSDP2's sharded parameters and gradients
    are: its own storage is as big as the whole tensor and holds nothing, the local shard it wraps holds the data),
    else None. Private: `torch.utils._python_dispatch.is_traceable_wrapper_subclass` and `__tensor_flatten__`;
    without them, None (every tensor counted by its own storage)."""
    if _is_wrapper is None or not _is_wrapper(t):  # read for every tensor of every op a count sees: imported once
        return None
    names, _ = t.__tensor_flatten__()
    return [inner for inner in (getattr(t, name) for name in names) if isinstance(inner, torch.Tensor)]


_RESIZE_CALLBACK: Optional[Callable] = None  # what `watch_storage_resizes` calls, while it is set


def watch_storage_resizes(callback: Optional[Callable]) -> None:
    """Call `callback(storage)` after every `UntypedStorage.resize_` made from Python (FSDP2 frees a layer's
    gathered weights by resizing their storage to 0 and gathers them again into the same storage: no op a dispatch
    mode sees); None stops. Not private, but a patch of torch's class: `UntypedStorage.resize_` is wrapped while a
    callback is set, and given back after."""
    global _RESIZE_CALLBACK
    original = vars(torch.UntypedStorage).get("_memopt_resize_")
    if callback is None:
        if original is not None:
            torch.UntypedStorage.resize_ = original
            del torch.UntypedStorage._memopt_resize_
        _RESIZE_CALLBACK = None
        return
    _RESIZE_CALLBACK = callback
    if original is None:
        resize = torch.UntypedStorage.resize_

        def resize_(self, size):
            out = resize(self, size)
            if _RESIZE_CALLBACK is not None:
                _RESIZE_CALLBACK(self)
            return out

        torch.UntypedStorage._memopt_resize_ = resize
        torch.UntypedStorage.resize_ = resize_


def fake_process_group(world_size: int) -> None:
    """Start a process group of `world_size` processes in this one, whose collectives move nothing (a dry run's:
    rank 0 of them, as every rank would run it). Private: `torch.testing._internal.distributed.fake_pg.FakeStore`;
    there is no public fallback (a sharded dry run needs it)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def fake_mode():
    """A mode under which tensors have shapes, dtypes and storages' sizes and no memory (a dry run's). Private:
    `torch._subclasses.fake_tensor.FakeTensorMode`; there is no public fallback (a dry run needs it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def compiled_by(model) -> Optional[str]:
    """How `model` is `torch.compile`'s wrapper (private `torch._dynamo.eval_frame.OptimizedModule`, which forwards
    attribute writes to the module it compiled, `_orig_mod`), or None. Without that class, read from the
    `_orig_mod` attribute it keeps."""
    dynamo = getattr(torch, "_dynamo", None)
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    if (optimized is not None and isinstance(model, optimized)) or "_orig_mod" in getattr(model, "_modules", {}):
        return f"{type(model).__name__} (torch.compile's wrapper of {type(model._orig_mod).__name__})"
    return None


def dispatch_modes() -> list:
    """The Python dispatch modes on now, outermost first (private
    `torch.utils._python_dispatch._get_current_dispatch_mode_stack`); without it, none."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:  # pragma: no cover - checked by tests/test_torch_api.py
        return []
    return list(_get_current_dispatch_mode_stack())


def dispatch_mode_on_top(mode) -> bool:
    """Whether `mode` is the innermost Python dispatch mode now (private
    `torch.utils._python_dispatch._get_current_dispatch_mode`); without it, True (the caller's own bookkeeping)."""
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode
    except ImportError:  # pragma: no cover - checked by tests/test_torch_api.py
        return True
    return _get_current_dispatch_mode() is mode
