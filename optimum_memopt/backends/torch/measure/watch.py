"""Where a training step's memory goes: the memory read at each mark the engine passes (a layer's forward starting,
the layers' forward done, a layer's backward starting, backward done, the next step starting) and the peak between
two marks, as `Segment`s of a `StepMemory`. The budget (`budget`) predicts from them what any policy does to the
step's peak: a segment moves by what the layers whose kept tensors it holds free more or less.

Marks are expected in a training step's order (layers 0..L-1 forward, then L-1..0 backward); a model that runs its
layers otherwise (twice, or not all of them) leaves `problem` set, and nothing is predicted from its segments.
Micro-batches after the first (gradient accumulation) and the optimizer step fall in the last segment, which holds
no layer's kept tensors.

On the CPU the peak between two marks is what the allocator read at its highest. In the steps the backend measures
(step one, and the steps the budget planner checks), `StepReadings` reads it after every op of the model's forward
and of its backward (a recompute's included), with the 2 ms sampler threads paused there (`memory.read_at_ops`): a
peak at an op's end (its output made, its inputs not yet let go of) cannot be missed, and the same step reads the
same figures every run. What runs outside the model's forward and the backward of its graph (a loss computed
outside the model, the optimizer step) is still sampled; a temporary inside one op is not seen.
"""

import logging
import weakref
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from ....memory import MIB, MemoryMeter, observe_all, read_at_ops
from .. import _torch_api
from ..nested import tensors_in
from .profile import HEAD_SEGMENT, Segment, StepMemory
from .storages import counting

logger = logging.getLogger(__name__)

READ_AT_OPS = "the allocator read after every op of the model's forward and backward, sampled every 2 ms outside them"


def first_grad_tensor(output) -> Optional[torch.Tensor]:
    """The first tensor of a layer's output that backward reaches (the hidden states)."""
    values = output if isinstance(output, (tuple, list)) else [output]
    if isinstance(output, dict):
        values = list(output.values())
    return next((v for v in values if torch.is_tensor(v) and v.requires_grad), None)


class StepWatch:
    """Reads one training step's memory at the engine's marks (see the module's docstring)."""

    def __init__(self, layers: int, meter: MemoryMeter, resets: bool = True):
        self.layers = layers
        self.meter = meter
        self.resets = resets  # False: the peak counter is someone else's (only the marks' readings are used)
        self.segments: List[Segment] = []
        self.start_bytes: Optional[int] = None
        self.problem: Optional[str] = None
        self._open: Optional[Tuple[str, int, int, Optional[int]]] = None  # (name, held, start bytes, own layer)
        self._stage = "waiting"  # -> forward -> head -> backward -> after -> done
        self._last = -1

    @property
    def how(self) -> str:
        if not self.resets:
            return "readings at the marks only (the peak counter is not reset)"
        own = getattr(self.meter, "how", None)  # a count of tensor storages says its own (`storages`)
        if own is not None:
            return own
        return "CUDA's peak counter" if self.meter.device == "cuda" else READ_AT_OPS

    @property
    def backward_ended(self) -> bool:
        """The step's backward has ended (what follows is the optimizer step and the next batch)."""
        return self._stage == "after" and self.problem is None

    def _read(self) -> Tuple[int, int]:
        r = self.meter.read()
        current = int(round((r.current_mb or 0.0) * MIB))
        peak = int(round((r.peak_mb or 0.0) * MIB)) if self.resets else current
        return current, max(peak, current)

    def _mark(self, name: Optional[str], held: int = 0, own: Optional[int] = None) -> int:
        current, peak = self._read()
        if self._open is not None:
            opened, opened_held, start, opened_own = self._open
            self.segments.append(Segment(opened, opened_held, start, max(peak, start, current), opened_own))
        if self.resets:
            self.meter.reset_peak()
        self._open = (name, held, current, own) if name is not None else None
        return current

    def _wrong(self, what: str) -> None:
        if self.problem is None:
            self.problem = f"the layers ran out of a training step's order ({what})"
        self._stage = "after"  # stop marking: the rest of the step is one segment

    def layer_forward(self, index: int) -> None:
        if self._stage == "after":
            return  # a later micro-batch (gradient accumulation): part of the last segment
        if (self._stage, index) == ("waiting", 0) or (self._stage == "forward" and index == self._last + 1):
            current = self._mark(f"layer {index} forward", index + 1, index)
            if index == 0:
                self.start_bytes = current
            self._stage, self._last = "forward", index
            if index == self.layers - 1:
                self._stage = "forward-last"
        elif self._stage != "done":
            self._wrong(f"layer {index}'s forward after layer {self._last}'s {self._stage.split('-')[0]}")

    def forward_done(self) -> None:
        if self._stage == "forward-last":
            self._mark(HEAD_SEGMENT, self.layers)
            self._stage = "head"

    def layer_backward(self, index: int) -> None:
        expected = self.layers - 1 if self._stage == "head" else self._last - 1
        if self._stage in ("head", "backward") and index == expected:
            self._mark(f"layer {index} backward", index, index)
            self._stage, self._last = "backward", index
        elif self._stage not in ("after", "done"):
            self._wrong(f"layer {index}'s backward where layer {expected}'s was due")

    def backward_done(self) -> None:
        if self._stage == "backward" and self._last == 0:
            self._mark("after backward: the optimizer step and the next batch", 0)
            self._stage = "after"

    def close(self) -> Optional[StepMemory]:
        """At the next step's start: the step's memory, or None when its marks did not come in order (`problem`)."""
        if self._stage == "done":
            return None
        if self._stage != "after" and self.problem is None:
            self.problem = f"the step's marks stopped at {self._stage} (a layer's backward was not seen)"
        self._mark(None)
        self._stage = "done"
        if self.problem is not None or self.start_bytes is None:
            return None
        return StepMemory(self.meter.device, self.segments, self.start_bytes, self.how)


class OpReadings(_torch_api.TorchDispatchMode):
    """Reads the allocator for every sampler of the process after each aten op (`memory.observe_all`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        observe_all()
        return out


_PAUSED: "weakref.WeakSet[_BackwardReadings]" = weakref.WeakSet()  # backwards that paused the samplers


def resume_stale() -> None:
    """Resume the samplers every earlier backward paused and did not resume: a backward that raises runs no end
    callback, and its graph (held by the error's traceback, or in a reference cycle) may outlive it. Called as a
    model's next training forward starts, when no backward of its can be running."""
    for readings in list(_PAUSED):
        readings.end()


class _BackwardReadings:
    """Reads after every op of each node of one forward's graph (a recipe's or a checkpoint's recompute inside it
    included), from the node that starts its backward to the backward's end, with the samplers paused meanwhile.
    The op readings are a dispatch mode entered by each node's pre-hook and left by its post-hook (autograd gives
    each node the mode stack backward started with: one left on by an error is gone at backward's end). Held by the
    nodes' hooks only: a graph freed without a backward takes it along, and a pause with it."""

    def __init__(self):
        self._resume = None
        self._modes: List[OpReadings] = []

    def before(self, grad_outputs) -> None:
        if self._resume is None:
            read_at_ops(True)
            self._resume = weakref.finalize(self, read_at_ops, False)  # resumed at backward's end, or if dropped
            _torch_api.at_backward_end(self.end)
            _PAUSED.add(self)
        if self._resume.alive:
            mode = OpReadings()
            mode.__enter__()
            self._modes.append(mode)

    def end(self) -> None:
        """Resume the samplers (once; at backward's end, or as the next forward starts: `resume_stale`)."""
        if self._resume is not None:
            self._resume()
        _PAUSED.discard(self)

    def after(self, grad_inputs, grad_outputs) -> None:
        if self._modes:
            mode = self._modes.pop()
            observe_all()
            if _torch_api.dispatch_mode_on_top(mode):
                mode.__exit__(None, None, None)


def read_backward(output) -> int:
    """Hook every node of the graph behind `output`'s tensors to read after each of its ops (`_BackwardReadings`);
    the number of nodes hooked."""
    readings = _BackwardReadings()
    seen = set()
    todo = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(readings.before)
        node.register_hook(readings.after)
        todo.extend(n for n, _ in node.next_functions)
    return len(seen)


class StepReadings:
    """Reads the CPU allocator after every op of `model`'s training forward and of its backward, in the
    steps `wanted()` says are measured (see the module's docstring); elsewhere, and on CUDA (whose peak counter
    misses nothing), it does nothing. The forward's op readings are a dispatch mode entered by a forward pre-hook and
    left by a forward hook that runs even when the forward raises: entered and left in the training code's own flow."""

    def __init__(self, model: nn.Module, wanted: Callable[[], bool]):
        self.wanted = wanted
        self._mode: Optional[OpReadings] = None
        self._stale: Optional[OpReadings] = None  # ours, left under a mode entered in the forward and not left
        self._depth = 0  # the model's forward called inside itself
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ]

    def remove(self) -> None:
        resume_stale()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            resume_stale()
        if self._stale is not None and _torch_api.dispatch_mode_on_top(self._stale):
            self._stale.__exit__(None, None, None)
            self._stale = None
        if self._mode is not None:
            self._depth += 1
            return None
        if not (module.training and torch.is_grad_enabled() and self.wanted()) or counting() is not None:
            return None  # not measured, or a count of tensor storages reads after every op already
        first = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
        if first is None or first.device.type != "cpu":
            return None
        read_at_ops(True)
        self._mode = OpReadings()
        self._mode.__enter__()
        return None

    def _after(self, module, args, kwargs, output):
        if self._mode is None:
            return None
        if self._depth:
            self._depth -= 1
            return None
        mode, self._mode = self._mode, None
        if _torch_api.dispatch_mode_on_top(mode):
            mode.__exit__(None, None, None)
        else:  # leaving ours would take the other off the stack in its place
            self._stale = mode
            logger.warning(
                "optimum-memopt: a dispatch mode entered inside the model's forward was still on at its end; the "
                "backend's memory readings stay on under it (reading the allocator after every op) until the "
                "model's next forward finds it left"
            )
        read_at_ops(False)
        if output is not None:
            read_backward(output)
        return None
