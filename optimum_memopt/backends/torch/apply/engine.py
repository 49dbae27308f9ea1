"""The engine: each layer's forward run under its `LayerPolicy` (kept, planned ops recomputed from recipes, or the
whole layer checkpointed), and the first training step profiled into a `ModelProfile`."""

import logging
from functools import partial
from typing import List, Optional, Tuple

import torch
from torch import nn

from ....memory import READABLE_DEVICES
from .. import _torch_api
from ..measure.live import meter_for
from ..measure.profile import LayerProfile, ModelProfile
from ..measure.watch import StepReadings, StepWatch, first_grad_tensor
from ..nested import tensors_in
from ..policy import KEEP, LAYER, OPS, RecomputePolicy
from .checkpoint import checkpointed, holds_cache, without_cache
from .hooks import finish, tracked
from .layers import LayerForwards, run_order_problem, towers, whole_layers_flag
from .routing import Routing, aux_loss_problem
from .tracking import LayerRun

logger = logging.getLogger(__name__)

# steps a layer list's first layer may be missing from before it is said (`RecomputeState._check_layers_ran`)
FIRST_LAYER_STEPS = 3


class RecomputeState:
    """Attached to the model as `_memopt_recompute`: the layers, the policy they run under, what step one measured."""

    def __init__(self, layers: List[nn.Module], policy: RecomputePolicy, model: Optional[nn.Module] = None):
        if len(policy.layers) != len(layers):
            raise ValueError(f"a policy for {len(policy.layers)} layers given to a model with {len(layers)} layers")
        self.layers = layers
        self.policy = policy
        self.profile: Optional[ModelProfile] = None  # filled by the first training forward
        self._recording: Optional[List[LayerProfile]] = None
        self._forwards = LayerForwards(layers)
        self.routing = Routing(layers)  # an MoE's routing, kept under every plan (`routing`)
        self.watch: Optional[StepWatch] = None  # reads step one's memory at each layer's marks
        self.planner = None  # told when a new step starts (`planner.BudgetPlanner`)
        self.reset_peaks = True  # False: CUDA's peak counter is the Trainer's (`--skip_memory_metrics false`)
        # True where a trainer calls `step_done` after each optimizer step (`TorchBackend.wrap`, or a loop of one's
        # own through the handle's `step_done`); elsewhere a step ends where the first training forward after a
        # backward starts (each backward ends a step: one micro-batch per optimizer step)
        self.steps_reported = False
        self._step_ended = False
        self._backward_ended = False  # the backward of the last training forward ended (steps not reported)
        self._model = model  # whose forward and backward are read op by op in the steps measured (`StepReadings`)
        self._readings: Optional[StepReadings] = None
        self._aux_check = None  # the hook that checks step one's aux loss keeps its gradient (an MoE's)
        self._aux_checked = False
        self.levers: dict = {}  # the levers beyond the layers running on this model, by name (`levers/`): held here
        self.lever_problems: dict = {}  # why a lever could not run or measure, by name (said in the table's notes)
        self._levers_measured = False
        self._inner_marks: list = []  # the hooks marking the levers' modules inside the layers (`mark_inside`)
        self.optimizer = None  # the trainer's, where it says (`TorchBackend.on_optimizer_ready`): `auto`'s dry run
        self._ran: List[int] = []  # the layers whose training forward ran in this step, in order (first steps)
        self._orders: List[List[int]] = []  # the first steps' `_ran`, where their first layer did not run
        self._ran_closed = False  # this step's first forward has ended: its later micro-batches are not recorded
        self._cache_said = False  # the message that the engine drops a KV cache in training, said once
        # the layers a training step runs, in the list's order, where a dry run of the step saw it leave some out (a
        # vision-language model's tower on text alone; `fake_step.layer_order`); None: every layer. A step
        # starts at the first, its forward ends at the last, and step one is measured over them
        self.running: Optional[List[int]] = None
        self._ran_checked = False

    @property
    def first(self) -> int:
        """The first layer a step runs (where it starts)."""
        return self.running[0] if self.running else 0

    @property
    def last(self) -> int:
        """The last layer a step's forward runs."""
        return self.running[-1] if self.running else len(self.layers) - 1

    @property
    def layer_lists(self) -> List[str]:
        """Where the layers come from, where they come from several lists (a VLM's towers): one line a list."""
        return towers(self._model, self.layers) if self._model is not None else []

    @property
    def originals(self):
        return self._forwards.originals

    def install(self) -> None:
        self._forwards.install(lambda i: partial(self.layer_forward, i))
        self.routing.install()
        if self._model is not None:
            self._readings = StepReadings(self._model, self.measuring, self._before_training_forward)
            if any(self.routing.layers) and self.routing.trained():  # the aux loss's gradient, asserted in step one
                self._aux_check = self._model.register_forward_hook(self._check_aux_loss)

    def uninstall(self) -> None:
        self._forwards.uninstall()
        for handle in self._inner_marks:
            handle.remove()
        self._inner_marks = []
        self.routing.remove()
        if self._readings is not None:
            self._readings.remove()
            self._readings = None
        if self._aux_check is not None:
            self._aux_check.remove()
            self._aux_check = None

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

        self._inner_marks += [
            module.register_forward_pre_hook(before),
            module.register_forward_hook(after, always_call=True),
        ]

    def _check_aux_loss(self, module, args, output) -> None:
        """After step one's training forward (an MoE whose routers train): its aux loss carries a gradient, or the
        step stops, saying why (`routing.aux_loss_problem`). Once."""
        if self._aux_checked or not (module.training and torch.is_grad_enabled()):
            return
        self._aux_checked = True  # (the hook stays till `uninstall`: one taken off inside its own call is not safe)
        problem = aux_loss_problem(module, output)
        if problem is not None:
            raise RuntimeError(problem)

    def _before_training_forward(self, args, kwargs) -> None:
        """Before a training forward of the model runs (and before it is counted): the run's first is where `auto`
        may start from a dry run of it (`planner.before_step_one`). In the first steps, the layers the last forward ran
        are its step's (`_check_layers_ran`): a loop that does not report steps ends one with each backward; in one
        that does, a later micro-batch of the step runs the same layers again, and is not recorded."""
        if self._ran and not self._ran_checked:
            if self.steps_reported:
                self._ran_closed = True
            else:
                self._check_layers_ran()
        if self.planner is not None and self.planner.waits_for_step_one and self.profile is None:
            self.planner.before_step_one(self, self._model, args, kwargs)

    def measuring(self) -> bool:
        """Whether the training step about to start may have its memory measured: step one (profiled and watched),
        and the steps the budget planner measures until it is done (the step after its last check is read too)."""
        return self.profile is None or (self.planner is not None and not self.planner.settled)

    def set_policy(self, policy: RecomputePolicy) -> None:
        """Run the layers under another policy from the next forward on (call it between steps)."""
        if len(policy.layers) != len(self.layers):
            raise ValueError(f"a policy for {len(policy.layers)} layers given to a model with {len(self.layers)}")
        self.policy = policy

    def step_done(self) -> None:
        """The trainer's word that an optimizer step ended: the next training forward starts a new step, and step
        one's memory, watched since its first layer, is complete (`profile.memory`)."""
        self._step_ended = True
        self._check_layers_ran()
        self._close_watch()
        if self.profile is not None and not self._levers_measured:
            self._levers_measured = True  # after step one, between steps: each lever measures what it would do
            for lever in self.levers.values():
                lever.after_step_one(self.profile, self.reset_peaks)

    def _check_layers_ran(self) -> None:
        """After a step: the layer list is the model's, and a step may not run all of it. Where its first layer did
        not run (a vision or audio tower listed before the language layers, which a text-only step leaves out), no
        step was measured from its start; once `FIRST_LAYER_STEPS` steps ran the same layers in the list's order (a
        model that drops layers at random in training, LayerDrop, skips its first one in a step now and then), the
        next step is measured over them (`running`), as step one: the table, and `auto`'s choice, count them (said).
        Where the steps ran their layers out of the list's order or one several times, no step can be measured layer
        by layer: `auto` stops, saying why, and plans run with no table (said once)."""
        if self._ran_checked or not self._ran:
            return
        order, self._ran, self._ran_closed = self._ran, [], False
        owner = type(self._model).__name__ if self._model is not None else "the model"
        if self.first in order:
            self._ran_checked, self._orders = True, []
            problem = run_order_problem(order, self.layers, owner)
            if problem is not None and self.planner is not None and not self.planner.settled:
                raise RuntimeError(
                    f"`--memory_opt_config auto` measures step one layer by layer, but {problem}; nothing was "
                    f"chosen. Recompute whole layers instead (`--memory_opt_level 1`)"
                )
            return
        self._orders.append(order)
        if len(self._orders) < FIRST_LAYER_STEPS:
            return
        self._ran_checked = True
        orders, self._orders = self._orders, []
        ran = sorted(set(order))
        where = self._idle_first(ran, f"in the first {FIRST_LAYER_STEPS} training steps")
        problem = run_order_problem(order, self.layers, owner)
        if problem is None and any(o != order for o in orders):
            problem = f"the first {FIRST_LAYER_STEPS} steps ran different layers ({'; '.join(map(str, orders))})"
        auto = self.planner is not None and self.planner.waits_for_step_one
        if problem is None:
            self.running = order
            logger.warning(
                "optimum-memopt: %s. The next step is measured over those as step one (%s)%s",
                where,
                "the plan table and `auto`'s choice count them" if auto else "the plan table counts them",
                "" if auto else self._idle_plans(set(ran)),  # `auto`'s own step one policy names every layer
            )
            return
        flag = whole_layers_flag(ran, len(self.layers))
        if auto:
            raise RuntimeError(
                f"`--memory_opt_config auto` measures step one layer by layer, but {where}, and {problem}; nothing "
                f"was measured or chosen. Pass plans for the layers that run instead, as in {flag}"
            )
        logger.warning(
            "optimum-memopt: %s, and %s. The plans run on the layers that run; no plan table is made%s",
            where,
            problem,
            self._idle_plans(set(ran)),
        )

    def _idle_first(self, ran: List[int], when: str) -> str:
        first = type(self.layers[0]).__name__
        kinds = sorted({type(self.layers[i]).__name__ for i in ran})
        return (
            f"the layer list's first layer ({first}, layer 0 of {len(self.layers)}) did not run {when}; layers "
            f"{', '.join(map(str, ran))} ({', '.join(kinds)}) did. The list holds modules these steps do not run (a "
            f"vision or audio tower listed before the language layers, which a text-only step leaves out)"
        )

    def first_layer_idle(self) -> Optional[Tuple[str, str]]:
        """Where the steps run so far ran layers but not the list's first (a dry run's step, which `auto` reads
        before step one): what to say, and the flag for the layers that ran; else None."""
        if self._ran_checked or not self._ran or self.first in self._ran:
            return None
        ran = sorted(set(self._ran))
        return self._idle_first(ran, "in a dry run of step one"), whole_layers_flag(ran, len(self.layers))

    def _idle_plans(self, ran: set) -> str:
        """What the policy asks of layers that did not run, which recomputes nothing (said after the layer list's
        warning), and whether any layer that ran has a plan at all."""
        idle = [i for i, p in enumerate(self.policy.layers) if p.mode != KEEP and i not in ran]
        if not idle:
            return ""
        asked = sorted({"whole" if self.policy.layers[i].mode == LAYER else "+".join(sorted(self.policy.layers[i].ops))
                        for i in idle})  # fmt: skip
        text = (
            f". The plans on layers {', '.join(map(str, idle))} ({'; '.join(asked)}) recompute nothing: those layers "
            f"did not run"
        )
        if all(self.policy.layers[i].mode == KEEP for i in ran):
            flag = whole_layers_flag(sorted(ran), len(self.layers))
            text += f"; no layer that ran has a plan, so nothing is recomputed: name the layers that run, as in {flag}"
        return text

    def _close_watch(self) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            memory = watch.close()
            if self.profile is not None:
                self.profile.memory, self.profile.memory_problem = memory, watch.problem
            if self.planner is None:
                watch.meter.close()

    def layer_forward(self, index: int, *args, **kwargs):
        layer = self.layers[index]
        original = self.originals[index]
        if not (layer.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        _check_alone(layer, index)
        if not self._ran_checked and not self._ran_closed:
            self._ran.append(index)
        starts = index == self.first  # the step's first layer: a step starts here
        if starts and self.watch is not None and self.watch.backward_ended and not self.steps_reported:
            self._close_watch()  # step two of a loop that does not report steps: step one ended before it
        if starts and self._backward_ended and not self.steps_reported:
            self._step_ended = True  # a loop that does not report steps: the last step's backward has ended
        self._backward_ended = False
        if starts:
            if self.planner is not None and (self._step_ended or self.planner.waits_for_step_one):
                self.planner.at_step_start(self, _device(args, kwargs))
                if self._readings is not None and not self.measuring():  # its last check read: this step is not
                    self._readings.stop()
            self._step_ended = False
            if self.profile is None and self._recording is None:
                self._recording = [LayerProfile() for _ in self.layers]
                device = _device(args, kwargs)
                if self.watch is None and device in READABLE_DEVICES:
                    resets = self.reset_peaks or device == "cpu"
                    self.watch = StepWatch(len(self.layers), meter_for(device), resets, self.running)
        watch = self.watch
        if watch is not None:
            watch.layer_forward(index)
        record = self._recording[index] if self._recording is not None else None
        if record is not None and not record.shape:
            first = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
            record.shape = tuple(first.shape) if first is not None else ()
        policy = self.policy.layers[index]
        if policy.mode != LAYER and holds_cache(layer, args, kwargs):  # the whole-layer recompute drops it itself
            args, kwargs = without_cache(layer, args, kwargs)
            if not self._cache_said:
                self._cache_said = True
                logger.warning(
                    "optimum-memopt: %s's training forward builds a KV cache (`use_cache` on); the layers the torch "
                    "backend runs drop it in training, as a layer it recomputes whole must: a cache filled by some "
                    "layers and not others is of no use, and its keys and values would be held through backward. "
                    "Pass `use_cache=False` (the Trainer does) to build none",
                    type(self._model).__name__,
                )
        if policy.mode == LAYER:
            out = checkpointed(layer, original, record, args, kwargs, self.routing.layers[index])
        elif policy.mode == OPS or record is not None:
            run = LayerRun(policy.ops, record, outer_hooks=_torch_api.top_saved_tensors_hooks())
            with tracked(run):
                out = original(*args, **kwargs)
            finish(run, out, (args, kwargs))
        else:
            out = original(*args, **kwargs)
        if record is not None and index == self.last:
            self.profile, self._recording = ModelProfile(self._recording, autocast=_autocast(args, kwargs)), None
        if watch is not None:
            _mark_backward(watch, index, out, index == self.first)
            if index == self.last:
                watch.forward_done()
        if starts and self.planner is not None and not self.steps_reported:
            _at_backward_end(out, self._ended)
        return out

    def _ended(self) -> None:
        self._backward_ended = True


def _check_alone(layer, index: int) -> None:
    """Refuse a layer recomputed by something besides the backend, found as it runs (turned on after the model was
    wrapped; the wrap refuses what it can see then), before it is recomputed twice over."""
    around = _torch_api.foreign_recompute()
    if around is not None:
        cause = (
            f"ran {around}: something outside the backend recomputes it (a `checkpoint_wrapper` or a checkpoint call "
            f"around the layers), and the backend would recompute it again; remove that checkpointing"
        )
    elif getattr(layer, "gradient_checkpointing", False) is True:
        cause = (
            "has transformers' activation checkpointing turned on since the backend wrapped the model "
            "(`model.activation_checkpointing_enable()` or `gradient_checkpointing_enable()` called after the Trainer "
            "was built), so it would be recomputed twice over; call `model.activation_checkpointing_disable()`"
        )
    else:
        return
    raise RuntimeError(
        f"optimum-memopt: layer {index} ({type(layer).__name__}) of the torch backend {cause}, and use the backend's "
        f"`--memory_opt_level 1` (every layer) or `--memory_opt_config 'Layer+:1:-1@every2'` (every other layer) "
        f"for whole-layer recompute"
    )


def _autocast(args, kwargs) -> Optional[str]:
    """The dtype autocast runs this layer's device in ("bfloat16"), or None where it is off."""
    device = _device(args, kwargs)
    if device not in ("cpu", "cuda") or not torch.is_autocast_enabled(device):
        return None
    return str(torch.get_autocast_dtype(device)).replace("torch.", "")


def _device(args, kwargs) -> str:
    """The device kind of a layer's first tensor argument."""
    first = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
    return first.device.type if first is not None else "cpu"


def _at_backward_end(out, fn) -> None:
    """Call `fn()` as the backward that reaches this layer output ends."""
    first = first_grad_tensor(out)
    if first is not None:
        first.register_hook(lambda grad: _torch_api.at_backward_end(fn))


def _mark_backward(watch: StepWatch, index: int, out, starts: bool) -> None:
    """Tell `watch` when backward reaches this layer's output (its backward starts), and, at the layer the step
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
