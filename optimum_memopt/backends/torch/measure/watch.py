"""Where a training step's memory goes: the memory read at each mark the engine passes (a layer's forward starting,
the layers' forward done, a layer's backward starting, backward done, the next step starting) and the peak between
two marks, as `Segment`s of a `StepMemory`. The budget (`budget`) predicts from them what any policy does to the
step's peak: a segment moves by what the layers whose kept tensors it holds free more or less.

Marks are expected in a training step's order: the layers a step runs (`running`, in the list's order: all of them,
or those a dry run of the step saw run, where a vision-language model trained on text alone leaves its tower out)
forward, then backward in reverse; a model that runs its layers otherwise (twice, out of order, or not those) leaves
`problem` set, and nothing is predicted from its segments. A segment holds the kept tensors of the layers up to its
own in the list, those that did not run holding none.
Micro-batches after the first (gradient accumulation) are no segment's: each runs the layers as the first did,
holding the gradients the first made, which the planner adds to every segment but the last (`budget`'s `extra`), so a
policy moves them as it moves the first's (read into the last segment instead, they would stand as a floor no
recompute lowers: tests/test_auto_dry_run.py, the floor under gradient accumulation is one micro-batch's). The
optimizer step falls in the last segment, which holds no layer's kept tensors: what it read between the first
micro-batch's backward and the next's forward, and after the last one's.

On CUDA the peak between two marks is the device's peak counter's. On the CPU it is the process's tensor storages
counted after every op (`live.LiveCount`, the unit CUDA counts in): in the steps the backend measures (step one, and
the steps the budget planner checks), `StepReadings` counts every op of the model's forward, of its backward (a
recompute's included) and of the optimizer's step, so a peak at an op's end (its output made, its inputs not yet let
go of) cannot be missed and the same step reads the same figures every run. A loss computed outside the model and
its backward are not counted; a temporary inside one op is not seen (as on CUDA).
"""

import itertools
import logging
import weakref
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ....memory import MIB, MemoryMeter
from .. import _torch_api
from ..nested import tensors_in
from .live import CountOps, LiveCount, live_count
from .profile import AFTER_PLACE, HEAD_PLACE, Place, Segment, StepMemory
from .storages import counting, watch_resizes

logger = logging.getLogger(__name__)


def first_grad_tensor(output) -> Optional[torch.Tensor]:
    """The first tensor of a layer's output that backward reaches (the hidden states)."""
    values = output if isinstance(output, (tuple, list)) else [output]
    if isinstance(output, dict):
        values = list(output.values())
    return next((v for v in values if torch.is_tensor(v) and v.requires_grad), None)


def as_node_runs(t: torch.Tensor, fn: Callable[[], None]) -> None:
    """`fn()` as backward reaches `t`, after every hook on `t` itself: a pre-hook of the node that made `t` (autograd
    runs a tensor's hooks, then its node's pre-hooks in the order they were put on), or a hook on `t` where no node
    made it. What a lever does as backward reaches a layer (an offload's fetch) falls after the step's marks of that
    instant, and between two layers' stretches a dry run records (`measure.replay`)."""
    node = t.grad_fn
    if node is None:
        t.register_hook(lambda grad: fn())
        return

    def reached(grad_outputs):
        fn()  # the gradients as they are

    node.register_prehook(reached)


class StepWatch:
    """Reads one training step's memory at the engine's marks (see the module's docstring)."""

    def __init__(self, layers: int, meter: MemoryMeter, resets: bool = True, running: Optional[List[int]] = None):
        self.layers = layers
        self.running = list(running) if running is not None else list(range(layers))  # the layers a step runs
        self.meter = meter
        self.resets = resets  # False: the peak counter is someone else's (only the marks' readings are used)
        self.segments: List[Segment] = []
        self.memory: Optional[StepMemory] = None  # the step's, once closed in order (`close`)
        # the highest reading of the step so far, the segments' and a later micro-batch's (which no segment keeps)
        self.most = 0
        self.start_bytes: Optional[int] = None
        self.problem: Optional[str] = None
        self._open: Optional[Tuple[Place, int, int, Optional[int]]] = None  # (place, held, start bytes, own layer)
        self._stage = "waiting"  # -> forward -> head -> backward -> after -> done
        self._last = -1
        self._parts: List[Tuple[str, int]] = []  # the open segment's stretches between inner marks, closed so far
        self._part = ""  # the mark that opened the open stretch ("" the segment's start)
        self._after_most = 0  # the last segment's highest before a later micro-batch's readings (`_micro_batch`)

    @property
    def how(self) -> str:
        if not self.resets:
            return "readings at the marks only (the peak counter is not reset)"
        own = getattr(self.meter, "how", None)  # a count of tensor storages says its own (`storages`, `live`)
        return own if own is not None else "CUDA's peak counter"

    @property
    def backward_ended(self) -> bool:
        """The step's backward has ended (what follows is the optimizer step and the next batch)."""
        return self._stage == "after" and self.problem is None

    def _read(self) -> Tuple[int, int]:
        r = self.meter.read()
        current = int(round((r.current_mb or 0.0) * MIB))
        peak = int(round((r.peak_mb or 0.0) * MIB)) if self.resets else current
        return current, max(peak, current)

    def _mark(self, place: Optional[Place], held: int = 0, own: Optional[int] = None) -> int:
        current, peak = self._read()
        if self._open is not None:
            opened, opened_held, start, opened_own = self._open
            parts = tuple(self._parts + [(self._part, max(peak, current))]) if self._parts else ()
            after = self._after_most if opened == AFTER_PLACE else 0  # a later micro-batch's readings left out
            most = max([peak, start, current, after] + [p for _, p in parts])
            self.segments.append(Segment(opened, opened_held, start, most, opened_own, parts))
            self.most = max(self.most, most)
        if self.resets:
            self.meter.reset_peak()
        self._open = (place, held, current, own) if place is not None else None
        self._parts, self._part = [], ""
        return current

    def inside(self, mark: str) -> None:
        """An inner mark in a layer's forward or backward segment, or the head's (a lever's module starting or ending
        its forward or its backward: `engine.mark_inside`): the stretch since the last mark closes with its peak, and
        one named `mark` opens; the segment keeps each stretch's peak (`Segment.parts`), its own the highest of them.
        Only where the peak counter is reset at the marks (else a stretch's peak cannot be told from the segment's)."""
        if not self.resets or self._open is None or self._stage not in ("forward", "forward-last", "head", "backward"):
            return
        current, peak = self._read()
        self._parts.append((self._part, max(peak, current)))
        self.meter.reset_peak()
        self._part = mark

    def _wrong(self, what: str) -> None:
        if self.problem is None:
            self.problem = f"the layers ran out of a training step's order ({what})"
        self._stage = "after"  # stop marking: the rest of the step is one segment

    def _next(self, index: int, by: int) -> int:
        """The layer the step runs after (`by` 1) or before (-1) `index`; -1 where there is none."""
        k = self.running.index(index) + by
        return self.running[k] if 0 <= k < len(self.running) else -1

    def _micro_batch(self) -> None:
        """A later micro-batch starts (gradient accumulation): the last segment keeps what it read so far, and the
        micro-batch's own readings are none of the step's (see the module's docstring) until its backward ends."""
        current, peak = self._read()
        self._after_most = max(self._after_most, peak, current)
        self._stage = "micro"

    def layer_forward(self, index: int) -> None:
        if self._stage == "after" and self.problem is None and index == self.running[0]:
            self._micro_batch()
        if self._stage in ("after", "micro"):
            return
        first = self.running[0]
        if (self._stage, index) == ("waiting", first) or (
            self._stage == "forward" and index == self._next(self._last, 1)
        ):
            current = self._mark(Place.forward(index), index + 1, index)
            if index == first:
                self.start_bytes = current
            self._stage, self._last = "forward", index
            if index == self.running[-1]:
                self._stage = "forward-last"
        elif self._stage != "done":
            self._wrong(f"layer {index}'s forward after layer {self._last}'s {self._stage.split('-')[0]}")

    def forward_done(self) -> None:
        if self._stage == "forward-last":
            self._mark(HEAD_PLACE, self.layers)
            self._stage = "head"

    def layer_backward(self, index: int, grad: Optional[torch.Tensor] = None) -> None:
        """Layer `index`'s backward starts; `grad`, the gradient reaching its output, is counted first where the meter
        counts storages: autograd's engine sums the gradients of a tensor several ops read (a residual's) outside
        any node, where the CPU's count of a real step does not see it made (`live`)."""
        expected = -1
        if self._stage == "head":
            expected = self.running[-1]
        elif self._stage == "backward":
            expected = self._next(self._last, -1)
        if grad is not None and hasattr(self.meter, "see"):
            self.meter.see(grad)
        if self._stage in ("head", "backward") and index == expected:
            self._mark(Place.backward(index), index, index)
            self._stage, self._last = "backward", index
        elif self._stage not in ("after", "micro", "done"):
            self._wrong(f"layer {index}'s backward where layer {expected}'s was due")

    def backward_done(self) -> None:
        if self._stage == "micro":  # a later micro-batch's backward ended: the last segment reads on from here
            if self.resets:
                self.most = max([self.most, *self._read()])  # none of a segment's, but the step's
                self.meter.reset_peak()
            self._stage = "after"
            return
        if self._stage == "backward" and self._last == self.running[0]:
            self._mark(AFTER_PLACE, 0)
            self._stage = "after"

    def close(self) -> Optional[StepMemory]:
        """At the next step's start: the step's memory, or None when its marks did not come in order (`problem`)."""
        if self._stage == "done":
            return None
        if self._stage == "micro":  # a later micro-batch's backward not seen ending: what it read is the last's
            self._stage = "after"
        if self._stage != "after" and self.problem is None:
            self.problem = f"the step's marks stopped at {self._stage} (a layer's backward was not seen)"
        self._mark(None)
        self._stage = "done"
        if self.problem is None and self.start_bytes is not None:
            self.memory = StepMemory(self.meter.device, self.segments, self.start_bytes, self.how)
        return self.memory


class _BackwardCount:
    """Counts every op of each node of one forward's graph (a recipe's or a checkpoint's recompute inside it
    included) into the live count: a dispatch mode entered by each node's pre-hook and left by its post-hook.
    Autograd gives each node the mode stack backward started with, so one left on by a node that raised is gone at
    backward's end. Held by the nodes' hooks only."""

    def __init__(self, count: LiveCount):
        self.count = count
        self._modes: List[CountOps] = []

    def before(self, grad_outputs) -> None:
        mode = self.count.ops()
        mode.__enter__()
        self._modes.append(mode)

    def after(self, grad_inputs, grad_outputs) -> None:
        if self._modes:
            mode = self._modes.pop()
            if _torch_api.dispatch_mode_on_top(mode):
                mode.__exit__(None, None, None)


class _BackwardCalls:
    """`torch.autograd.backward` (which `Tensor.backward`, so accelerate's and DeepSpeed's backward, calls) run under
    the live count's dispatch mode where a counted forward waits for its backward: autograd gives the whole backward
    the mode stack it started with, so the ops its engine runs between nodes are counted too. Those are the gradients
    it sums where a tensor feeds several ops: a weight tied to the input embeddings gets the head's gradient in the
    head's backward and keeps it, summed chunk by chunk where the head runs in chunks, until the embeddings' backward,
    the last; counted by the nodes' hooks alone, that sum was missed through every layer's backward (64 KiB at the
    tests' tiny size, under the own head's in the steps after: `auto` chose over its budget). Installed while a
    `StepReadings` is (the function put back after the last one, unless another wrapped it since); without a waiting
    forward it is torch's call as it was."""

    def __init__(self):
        self.original: Optional[Callable] = None
        self.waiting: "weakref.WeakSet[StepReadings]" = weakref.WeakSet()  # forwards counted, their backward not run
        self.users = 0

    def install(self) -> None:
        self.users += 1
        if self.original is None:
            self.original = torch.autograd.backward
            torch.autograd.backward = self.backward

    def uninstall(self) -> None:
        self.users -= 1
        if self.users == 0 and self.original is not None:
            if torch.autograd.backward is self.backward:
                torch.autograd.backward = self.original
                self.original = None

    def backward(self, *args, **kwargs):
        reader = next(iter(self.waiting), None)
        if reader is None or reader.count is None or counting() is not None:
            return self.original(*args, **kwargs)
        self.waiting.discard(reader)
        with reader.count.ops():
            return self.original(*args, **kwargs)


_BACKWARD = _BackwardCalls()


def count_backward(output, count: LiveCount) -> int:
    """Hook every node of the graph behind `output`'s tensors to count its ops into `count` (`_BackwardCount`); the
    number of nodes hooked."""
    counting_ops = _BackwardCount(count)
    seen = set()
    todo = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(counting_ops.before)
        node.register_hook(counting_ops.after)
        todo.extend(n for n, _ in node.next_functions)
    return len(seen)


def _called_weakly(method: Callable) -> Callable:
    """A function calling `method` through a weak reference to its object (nothing once the object is gone): a hook
    registered for the whole process keeps no model alive."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def _remove_all(handles) -> None:
    for handle in handles:
        handle.remove()


class StepReadings:
    """Counts the CPU's tensor storages (`live.LiveCount`) in the steps `wanted()` says are measured: after every op of
    `model`'s training forward, of its backward and of the optimizer's step (see `live`'s docstring); the count is
    seeded with the model's tensors at the first such forward. Elsewhere, under a dry run's count, and on
    CUDA (whose counter misses nothing) it does nothing. The forward's count is a dispatch mode entered by a forward
    pre-hook and left by a forward hook that runs even when the forward raises: entered and left in the training
    code's own flow; the optimizer's, by torch's optimizer step hooks (every optimizer of the process: the trainer's
    is not known here), in a step whose forward was counted."""

    def __init__(self, model: nn.Module, wanted: Callable[[], bool], before: Optional[Callable] = None):
        self.wanted = wanted
        self.before = before  # called with a training forward's arguments before it runs (not nested), uncounted
        self.count: Optional[LiveCount] = None  # from the first forward counted
        self._mode: Optional[CountOps] = None
        self._stale: Optional[CountOps] = None  # ours, left under a mode entered in the forward and not left
        self._depth = 0  # the model's forward called inside itself
        self._counted = False  # a forward of this step was counted: its optimizer step is counted too
        self._optimizer_mode: Optional[CountOps] = None
        self._model = weakref.ref(model)  # whose optimizer's step is counted (another model's optimizer is not)
        # torch's optimizer step hooks are the process's: they hold this weakly, and go with it (a trained model,
        # its trainer and its optimizer's state are not kept for the rest of the process, nor read by later steps)
        hooks = [
            register_optimizer_step_pre_hook(_called_weakly(self._before_optimizer)),
            register_optimizer_step_post_hook(_called_weakly(self._after_optimizer)),
        ]
        weakref.finalize(self, _remove_all, list(hooks))
        self._handles = [
            model.register_forward_pre_hook(self._before, with_kwargs=True),
            model.register_forward_hook(self._after, with_kwargs=True, always_call=True),
        ] + hooks
        _BACKWARD.install()
        self._uninstall = weakref.finalize(self, _BACKWARD.uninstall)  # once: at `remove` or when let go of

    def remove(self) -> None:
        self._after_optimizer()
        self._uninstall()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def stop(self) -> None:
        """Count no more of the step under way: the steps measured are over at its first layer (`auto`'s last check
        read there). Its forward's mode is left where it is on top (its backward and optimizer step then run
        uncounted, at the speed of a step not measured)."""
        mode = self._mode
        if mode is not None and _torch_api.dispatch_mode_on_top(mode):
            mode.__exit__(None, None, None)
            self._mode, self._depth, self._counted = None, 0, False

    def _before(self, module, args, kwargs):
        if self._stale is not None and _torch_api.dispatch_mode_on_top(self._stale):
            self._stale.__exit__(None, None, None)
            self._stale = None
        if self._optimizer_mode is not None:  # an optimizer step that raised runs no post-hook: its count is left here
            self._after_optimizer()
        if self._mode is not None:
            self._depth += 1
            return None
        _BACKWARD.waiting.discard(self)  # a forward counted before this one whose backward never ran
        if self.before is not None and module.training and torch.is_grad_enabled():
            self.before(args, kwargs)
        if not (module.training and torch.is_grad_enabled() and self.wanted()) or counting() is not None:
            return None  # not measured, or a dry run's count reads after every op already
        first = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
        if first is None or first.device.type != "cpu":
            return None
        if self.count is None:
            self.count = live_count()
            self.count.seed(itertools.chain(module.parameters(), module.buffers()))
        self.count.seed(tensors_in(args) + tensors_in(kwargs))  # the batch, there before the forward as on a device
        self._counted = True
        self._mode = self.count.ops()
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
                "backend's count of tensor storages stays on under it until the model's next forward finds it left"
            )
        if output is not None:
            count_backward(output, self.count)  # a backward not through `torch.autograd.backward`: node by node
            _BACKWARD.waiting.add(self)
        return None

    def _steps_mine(self, optimizer) -> bool:
        """Whether `optimizer` (one of torch's: the hooks are given the inner one of accelerate's wrapper) steps any
        of the model's parameters: only its step belongs to the model's counted step."""
        model = self._model()
        if model is None or optimizer is None:
            return optimizer is None
        mine = {id(p) for p in model.parameters()}
        return any(id(p) in mine for group in getattr(optimizer, "param_groups", []) for p in group["params"])

    def _before_optimizer(self, optimizer=None, args=None, kwargs=None):
        if self._counted and self._optimizer_mode is None and counting() is None and self._steps_mine(optimizer):
            self._optimizer_mode = self.count.ops()
            self._optimizer_mode.__enter__()

    def _after_optimizer(self, optimizer=None, args=None, kwargs=None):
        waiting = self._counted and self._optimizer_mode is None  # a counted step whose optimizer has not stepped
        if waiting and optimizer is not None and not self._steps_mine(optimizer):
            return  # another model's optimizer: this model's step is not over (asked in counted steps only)
        self._counted = False
        _BACKWARD.waiting.discard(self)
        mode, self._optimizer_mode = self._optimizer_mode, None
        if mode is not None and _torch_api.dispatch_mode_on_top(mode):
            mode.__exit__(None, None, None)
        watch_resizes()  # a backward node's mode that autograd dropped unleft follows nothing now: torch's back
