"""Step one's recorder: each layer's graph and op times (`ModelProfile`, filled as step one's layers run) and the
step's memory at each layer's marks (`StepWatch`), with the CPU's storages counted op by op in the steps measured
(`StepReadings`).

The rules (tests/test_torch_profile.py, tests/test_step_memory.py, tests/test_torch_budget.py):

- The profile is recorded once, over the first training step's layers (`running`: those a step runs), and is complete
  when the step's last layer's forward ends; its memory (`profile.memory`) when the step's watch closes.
- A step is watched from its first layer's forward: by the watch `auto`'s planner hands the engine for the steps it
  measures, else, in step one, by one of the recorder's own where the device's memory can be read.
- The backward's marks are each layer output's gradient arriving (its backward starts) and, at the step's first
  layer, the backward pass ending.
- A module a lever acts on inside a layer (`mark_inside`) is watched apart: its forward, its backward.
- An MoE whose routers train: step one's aux loss must carry a gradient, or the step stops with why.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ....memory import READABLE_DEVICES
from .. import _torch_api
from ..measure.live import meter_for
from ..measure.profile import LayerProfile, ModelProfile
from ..measure.watch import StepReadings, StepWatch, first_grad_tensor
from ..nested import map_instances, map_tensors, tensors_in
from .routing import aux_loss_problem
from .tracking import storage_bytes, storage_key


@dataclass(frozen=True)
class TensorShape:
    """A tensor of a dry run's step one as its shape alone: what a layer run alone is given again (`made`)."""

    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorShape":
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)

    def made(self) -> torch.Tensor:
        """A tensor of this shape (under a dry run's fake mode: no memory, no values); one that required grad made
        the output of an op, as a layer's input is the layer before's output (a leaf that requires grad is taken for
        a parameter by the engine's rule: `tracking.is_param`)."""
        t = torch.empty_strided(self.size, self.stride, dtype=self.dtype)
        return t.requires_grad_(True).clone() if self.requires_grad and t.is_floating_point() else t


def made_again(shapes):
    """`shapes` (nested lists, tuples and dicts holding `TensorShape`s) with each shape made a tensor."""
    return map_instances(shapes, TensorShape, TensorShape.made)


class StepRecorder:
    """Step one's profile and the watched steps' memory, for a model of `n_layers` layers. `reset_peaks`: whether the
    device's peak counter may be reset (False: CUDA's is the Trainer's, `--skip_memory_metrics false`)."""

    def __init__(self, n_layers: int, model: Optional[nn.Module], reset_peaks: bool = True):
        self.n_layers = n_layers
        self.model = model  # whose forward and backward are read op by op in the steps measured (`StepReadings`)
        self.reset_peaks = reset_peaks
        self.profile: Optional[ModelProfile] = None  # step one's, complete at its last layer's forward
        self.watch: Optional[StepWatch] = None  # reads the step now measured at each layer's marks
        self._step_one_watched = False  # step one's watch closed: its memory is the profile's
        self._recording: Optional[List[LayerProfile]] = None  # step one's layers, as they run
        self._readings: Optional[StepReadings] = None
        self._hooks: list = []  # the aux loss's check, the marks inside the layers (`mark_inside`)
        self._aux_checked = False
        # where the model's code lets go of each layer's input, found before step one (`fake_step.layer_order`)
        self.inputs_gone: Dict[int, int] = {}
        # a dry run's step one: each layer's arguments as shapes (`TensorShape` for each tensor), what a layer run
        # alone is given (`engine.RecomputeState.probe`); none in a real step (nothing of its tensors is kept)
        self.argument_shapes: Dict[int, tuple] = {}

    def install(self, measuring: Callable[[], bool], before_forward: Callable, routers_train: bool) -> None:
        """Read the steps `measuring()` says are measured; `before_forward(args, kwargs)` before each training forward
        of the model; `routers_train`: an MoE's routers train, and step one's aux loss is checked."""
        if self.model is None:
            return
        self._readings = StepReadings(self.model, measuring, before_forward)
        if routers_train:
            self._hooks.append(self.model.register_forward_hook(self._check_aux_loss))

    def uninstall(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self._readings is not None:
            self._readings.remove()
            self._readings = None

    def mark_inside(self, module: nn.Module, name: str) -> None:
        """Mark `module`'s stretches inside its layer in the steps watched (`StepWatch.inside`): its training forward
        starting ("NAME forward", in a layer's recompute too) and ending ("after NAME forward"), its backward starting
        (the gradient of its output made: "NAME backward") and ending (its input's: "after NAME backward"). A lever
        acting inside a layer (`Lever.marks`) is weighed by the stretches its module runs in."""

        def before(mod, args):
            watch = self.watch
            if watch is None or not (mod.training and torch.is_grad_enabled()):
                return
            watch.inside(f"{name} forward")
            first = next((t for t in tensors_in(args) if t.requires_grad), None)
            if first is not None and not _torch_api.in_backward():  # a recompute's tensors see no backward
                first.register_hook(lambda grad: watch.inside(f"after {name} backward"))

        def after(mod, args, output):
            watch = self.watch
            if watch is None or not (mod.training and torch.is_grad_enabled()):
                return
            watch.inside(f"after {name} forward")
            first = first_grad_tensor(output) if output is not None else None
            if first is not None and not _torch_api.in_backward():
                first.register_hook(lambda grad: watch.inside(f"{name} backward"))

        self._hooks += [
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after, always_call=True),
        ]

    def _check_aux_loss(self, module, args, output) -> None:
        """After step one's training forward: its aux loss carries a gradient, or the step stops, saying why
        (`routing.aux_loss_problem`). Once (the hook stays till `uninstall`: one taken off inside its own call is not
        safe)."""
        if self._aux_checked or not (module.training and torch.is_grad_enabled()):
            return
        self._aux_checked = True
        problem = aux_loss_problem(module, output)
        if problem is not None:
            raise RuntimeError(problem)

    def watch_with(self, watch: Optional[StepWatch]) -> None:
        """Watch the step about to start with `watch` (`auto`'s planner's, for a step it measures; None: nothing)."""
        self.watch = watch

    def restart(self) -> None:
        """The next step is step one again (`auto` plans again for a longer batch): recorded and watched as the
        first was; nothing of the earlier step one is kept here."""
        if self.watch is not None:
            self.watch.meter.close()
        self.profile, self.watch, self._recording, self._step_one_watched = None, None, None, False
        self.argument_shapes = {}

    def stop_readings(self) -> None:
        """No later step is measured: the CPU's op-by-op count stops."""
        if self._readings is not None:
            self._readings.stop()

    def step_starts(self, device: str, running: Optional[List[int]]) -> None:
        """A step starts on `device`: step one is recorded, and watched where nothing watches it yet."""
        if self.profile is not None or self._recording is not None:
            return
        self._recording = [LayerProfile() for _ in range(self.n_layers)]
        for i, at in self.inputs_gone.items():
            if i < self.n_layers:
                self._recording[i].input_gone_at = at
        if self.watch is None and device in READABLE_DEVICES:
            self.watch = StepWatch(self.n_layers, meter_for(device), self.reset_peaks or device == "cpu", running)

    def layer_starts(self, index: int, args, kwargs) -> Optional[LayerProfile]:
        """Layer `index`'s training forward starts: marked; its record in step one (its first input's shape read),
        else None."""
        if self.watch is not None:
            self.watch.layer_forward(index)
        record = self._recording[index] if self._recording is not None else None
        if record is not None and not record.shape:
            positional, named = tensors_in(args), tensors_in(kwargs)
            tensors = positional + named
            first = (positional or named or [None])[0]
            record.shape = tuple(first.shape) if first is not None else ()
            record.input_bytes = storage_bytes(first) if first is not None else 0
            storages = {storage_key(t): storage_bytes(t) for t in tensors if not isinstance(t, torch.nn.Parameter)}
            record.arguments_bytes = sum(b for key, b in storages.items() if key)
            if first is not None and _torch_api.is_fake(first):
                self.argument_shapes[index] = map_tensors((args, kwargs), TensorShape.of)
        return record

    def layer_ends(self, index: int, out, autocast: Callable[[], Optional[str]], first: int, last: int) -> None:
        """Layer `index`'s training forward returned `out`: at the step's `last` layer step one's profile is complete
        (`autocast()`: the dtype the layers ran in) and the forward's marks end; the backward's marks set."""
        if self._recording is not None and index == last:
            self.profile, self._recording = ModelProfile(self._recording, autocast=autocast()), None
        watch = self.watch
        if watch is None:
            return
        _mark_backward(watch, index, out, index == first)
        if index == last:
            watch.forward_done()

    def close_watch(self, keep_meter: bool) -> None:
        """The watched step ended: its memory goes to step one's profile where it is step one's (a later step watched,
        a dry run's check, keeps its own: `StepWatch.memory`, read by whoever handed the watch); the watch's meter is
        closed unless `keep_meter` (the planner's, read again at the next step)."""
        watch, self.watch = self.watch, None
        if watch is None:
            return
        memory = watch.close()
        if self.profile is not None and not self._step_one_watched:
            self.profile.memory, self.profile.memory_problem = memory, watch.problem
            self._step_one_watched = True
        if not keep_meter:
            watch.meter.close()


def _mark_backward(watch: StepWatch, index: int, out, starts: bool) -> None:
    """Tell `watch` when backward reaches this layer output (its backward starts), and, at the layer the step
    `starts` at, when the backward pass ends."""
    first = first_grad_tensor(out)
    if first is None:
        return

    def reached(grad):
        watch.layer_backward(index, grad)
        if starts:
            _torch_api.at_backward_end(watch.backward_done)
        return grad

    first.register_hook(reached)
