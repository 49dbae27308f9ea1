"""Recipes: how to recompute one op's outputs in backward (the op, its inputs, the RNG state of a random op), and
the stand-in autograd holds instead of a planned output."""

import contextlib
from typing import List, Optional

import torch

from .. import _torch_api
from ..names import plan_name
from ..nested import tensors_in


class StandIn:
    """What a recipe holds in place of an input tensor: `materialize()` gives the tensor at replay."""

    __slots__ = ()

    def materialize(self) -> torch.Tensor:  # pragma: no cover - every stand-in defines it
        raise NotImplementedError


def _materialized(value):
    """An op's arguments with each stand-in (`Stashed`: a planned output recomputed in turn; `hooks.FromHooks`: a
    tensor the hooks around the layer took) made a tensor."""
    if isinstance(value, StandIn):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        return type(value)(_materialized(v) for v in value)
    if isinstance(value, dict):
        return {k: _materialized(v) for k, v in value.items()}
    return value


def rng_state(func, args, kwargs) -> Optional[tuple]:
    """For a random op (dropout, bernoulli): the CPU and device generator states it will start from, else None."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return None
    device = next((t.device for t in tensors_in((args, kwargs)) if t.device.type != "cpu"), None)
    device_state = torch.get_device_module(device.type).get_rng_state(device) if device is not None else None
    return (torch.get_rng_state(), device, device_state)


_WHY = (
    "(optimum-memopt's torch backend saves this tensor through saved-tensor hooks and checks it as autograd does "
    "without them: plain PyTorch raises the same error here. Replace the in-place op with its out-of-place form, "
    "e.g. `u = u + 1` for `u.add_(1)`.)"
)
INPLACE = "one of the variables needed for gradient computation has been modified by an inplace operation"


def changed_in_place(t: torch.Tensor, saved_version: int) -> None:
    """Autograd's check of a saved tensor, which it skips for tensors saved through hooks: raise if `t` was changed
    in place since it was saved (at `saved_version`)."""
    now = _torch_api.version(t)
    if now != saved_version:
        last = f", last changed by {type(t.grad_fn).__name__}," if t.grad_fn is not None else ""
        raise RuntimeError(
            f"{INPLACE}: [{t.type()} {list(t.shape)}]{last} is at version {now}; expected version {saved_version} "
            f"instead. {_WHY}"
        )


def _without_autocast(inputs: List[torch.Tensor]) -> contextlib.ExitStack:
    """Autocast off for a replay: the op recorded is the kernel autocast chose in the forward, inputs already cast;
    under an autocast active in backward, an op that ran in fp32 (in a region with autocast off) would come back in
    bf16, a silently different value."""
    stack = contextlib.ExitStack()
    kinds = {"cpu"} | {t.device.type for t in inputs}
    for kind in sorted(kinds):
        stack.enter_context(torch.autocast(kind, enabled=False))
    return stack


# The profiler's names for the backend's recompute (a range on the CPU's timeline and, on a card, on the stream its
# kernels ran on): benchmarks/step_profile.py sums the time under each. Marked only while torch's profiler records.
RECOMPUTE_OPS = "optimum_memopt: recompute ops"
RECOMPUTE_LAYER = "optimum_memopt: recompute layer"


def marked(name: str):
    """A profiler range named `name` around the code under it while torch's profiler records; else nothing."""
    return torch.profiler.record_function(name) if _torch_api.profiling() else contextlib.nullcontext()


@contextlib.contextmanager
def _zero3_gathered(inputs: List[torch.Tensor]):
    """DeepSpeed ZeRO-3 parameters among a recipe's inputs (RMSNorm's weight, held by its `mul`) are released after
    their module's forward (`param.data` emptied to shape [0]) and gathered again only for that module's own
    backward, which may come after the recipe is asked for (q_proj's backward reads the norm's output first): gather
    the released ones for the replay and release them after, as DeepSpeed's own linear layer does in its backward.
    Every rank replays the same recipes in the same order, so the gathers (collectives) match."""
    released = [t for t in inputs if getattr(getattr(t, "ds_status", None), "name", "") == "NOT_AVAILABLE"]
    for p in released:
        p.all_gather()
    try:
        yield
    finally:
        for p in released:
            p.partition()


class Recipe:
    """How to recompute one op's outputs: the op, its inputs (kept alive by autograd anyway, or stand-ins for
    planned outputs recomputed in turn: a chain), the RNG state. Computed once per backward, when first asked for,
    and held until every holder (saved-tensor stand-ins, recipes made from it) has had it."""

    __slots__ = ("func", "args", "kwargs", "rng", "versions", "value", "pending", "changed", "__weakref__")

    def __init__(self, func, args, kwargs, rng):
        self.func, self.args, self.kwargs, self.rng = func, args, kwargs, rng
        self.changed = {}  # output index -> the op that wrote to that output after it was saved
        self.versions = [_torch_api.version(t) for t in tensors_in((args, kwargs))]
        self.value = None
        self.pending = 0

    def outputs(self):
        if self.value is None and self.args is None:  # computed and released (or never had inputs)
            raise RuntimeError(
                f"optimum-memopt torch backend: the output of {self.func} was recomputed and released already; a "
                f"second backward through the same graph (retain_graph=True) is not supported with plans, use "
                f"`--memory_opt_level 1` or no plans for it"
            )
        if self.value is None:
            inputs = tensors_in((self.args, self.kwargs))
            now = [_torch_api.version(t) for t in inputs]
            if now != self.versions:
                raise RuntimeError(
                    f"optimum-memopt torch backend: an input of {self.func} was modified in place after the forward "
                    f"pass, so its output cannot be recomputed for backward; drop the plan for "
                    f"{plan_name(_torch_api.op_name(self.func))!r}"
                )
            with torch.no_grad():
                # inputs recomputed in turn (a chain) or given back by the hooks around the layer are asked for once,
                # here, and let go of once this is computed
                args, kwargs = _materialized((self.args, self.kwargs))
            inputs = tensors_in((args, kwargs))
            with torch.no_grad(), _without_autocast(inputs), _zero3_gathered(inputs), marked(RECOMPUTE_OPS):
                if self.rng is None:
                    self.value = self.func(*args, **kwargs)
                else:
                    cpu_state, device, device_state = self.rng
                    devices = [device] if device is not None else []
                    with torch.random.fork_rng(devices=devices, device_type=device.type if device else "cuda"):
                        torch.set_rng_state(cpu_state)
                        if device is not None:
                            torch.get_device_module(device.type).set_rng_state(device_state, device)
                        self.value = self.func(*args, **kwargs)
            self.args = self.kwargs = None  # computed: its inputs are not needed again
        return self.value

    def release(self):
        self.pending -= 1
        if self.pending <= 0:
            self.value = None
            self.args = self.kwargs = None


class Stashed(StandIn):
    """What autograd (or a recipe made from it: a chain) holds instead of a planned output: the recipe and the
    tensor's geometry. Counted among the recipe's holders when made; `materialize` gives the tensor once."""

    __slots__ = ("recipe", "index", "size", "stride", "offset", "saved")

    def __init__(self, recipe, index, t, saved: bool = True):
        self.recipe, self.index = recipe, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()
        # saved for backward (checked for in-place changes after the save), or an input of a recipe, which read it
        # before any such change (the tracker checks the version it read)
        self.saved = saved
        recipe.pending += 1

    def materialize(self) -> torch.Tensor:
        changed_by = self.recipe.changed.get(self.index) if self.saved else None
        if changed_by is not None:
            raise RuntimeError(
                f"{INPLACE}: output {self.index} of {self.recipe.func} (shape {list(self.size)}), recomputed for "
                f"backward, was changed by {changed_by} after it was saved. {_WHY}"
            )
        # the index counts the op's output tensors as the tracker did (`tensors_in`): CUDA's attention kernels
        # return None among them (flash's cumulative sequence lengths), the CPU's do not
        out = tensors_in(self.recipe.outputs())[self.index]
        if out.size() != self.size or out.stride() != self.stride or out.storage_offset() != self.offset:
            out = out.as_strided(self.size, self.stride, self.offset)
        self.recipe.release()
        return out
