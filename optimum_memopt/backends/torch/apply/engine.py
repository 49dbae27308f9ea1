"""The engine: each layer's forward run under its `LayerPolicy` (kept, planned ops recomputed from recipes, or the
whole layer checkpointed), the step's boundaries read from the layers' forwards, and the first training step
profiled into a `ModelProfile`: one owner each (`LayerRunner` here, `clock.StepClock`, `recorder.StepRecorder`), put
together on the model by `RecomputeState`, which alone carries events between them and `auto`'s planner (`steps`:
the planner is told a step starts and answers with orders, carried out before the step's first layer)."""

import contextlib
import dataclasses
import logging
import time
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _torch_api
from ..measure.profile import NOT_BETWEEN_STEPS, LayerProfile, ModelProfile
from ..measure.replay import RUN_ALWAYS
from ..measure.watch import first_grad_tensor
from ..nested import tensors_in
from ..policy import LAYER, OPS, RecomputePolicy
from ..steps import Orders, StepStart
from .checkpoint import checkpointed, holds_cache, without_cache
from .clock import StepClock
from .hooks import finish, tracked
from .layers import LayerForwards, towers
from .recorder import StepRecorder, made_again
from .routing import Routing
from .tracking import LayerRun

logger = logging.getLogger(__name__)


class LayerRunner:
    """The layers of one model run under a policy: each layer's forward kept, its planned ops recomputed from recipes,
    or the whole layer checkpointed (`LayerPolicy.mode`); an MoE's routing kept under every plan (`Routing`); the
    levers beyond the layers (`levers/`), each run as the policy's option for it."""

    def __init__(
        self,
        layers: List[nn.Module],
        policy: RecomputePolicy,
        model: Optional[nn.Module] = None,
        levers: Optional[Dict[str, object]] = None,
        lever_problems: Optional[Dict[str, tuple]] = None,
    ):
        _check_fits(policy, layers)
        self.layers = layers
        self.policy = policy
        self.model = model
        self.levers = dict(levers or {})  # the levers beyond the layers on this model, by name
        self.lever_problems = dict(lever_problems or {})  # why a lever could not run or measure (the table's notes)
        self.routing = Routing(layers)
        self._forwards = LayerForwards(layers)
        self._cache_said = False  # the message that the engine drops a KV cache in training, said once

    @property
    def originals(self):
        return self._forwards.originals

    def install(self, forward) -> None:
        """Each layer's forward replaced by `forward(index)`'s."""
        self._forwards.install(forward)
        self.routing.install()

    def uninstall(self) -> None:
        self._forwards.uninstall()
        self.routing.remove()

    def set_policy(self, policy: RecomputePolicy) -> None:
        """Run the layers under another policy from the next forward on (between steps)."""
        _check_fits(policy, self.layers)
        self.policy = policy

    def run_choice(self, policy: RecomputePolicy) -> None:
        """Run a choice from the next forward on: the layers' plans, and each lever as the policy's option for it
        (None: off)."""
        self.set_policy(policy)
        for name, lever in self.levers.items():
            lever.run_as(policy.levers.get(name))

    def run(self, index: int, args, kwargs, record: Optional[LayerProfile]):
        """Layer `index`'s training forward under its policy (`record`: step one's, filled as it runs), inside each
        lever's `around_layer`."""
        forward = partial(self._under_policy, index, args, kwargs, record)
        for lever in self.levers.values():
            forward = partial(lever.around_layer, index, forward)
        return forward()

    def _under_policy(self, index: int, args, kwargs, record: Optional[LayerProfile]):
        layer, original = self.layers[index], self.originals[index]
        policy = self.policy.layers[index]
        if policy.mode != LAYER and holds_cache(layer, args, kwargs):  # the whole-layer recompute drops it itself
            args, kwargs = without_cache(layer, args, kwargs)
            self._say_cache_dropped()
        if policy.mode == LAYER:
            return checkpointed(layer, original, record, args, kwargs, self.routing.layers[index])
        if policy.mode != OPS and record is None:
            return original(*args, **kwargs)
        run = LayerRun(policy.ops, record, outer_hooks=_torch_api.top_saved_tensors_hooks())
        with tracked(run):
            out = original(*args, **kwargs)
        finish(run, out, (args, kwargs))
        return out

    def _say_cache_dropped(self) -> None:
        if self._cache_said:
            return
        self._cache_said = True
        logger.warning(
            "optimum-memopt: %s's training forward builds a KV cache (`use_cache` on); the layers the torch backend "
            "runs drop it in training, as a layer it recomputes whole must: a cache filled by some layers and not "
            "others is of no use, and its keys and values would be held through backward. Pass `use_cache=False` "
            "(the Trainer does) to build none",
            type(self.model).__name__,
        )


class RecomputeState:
    """Attached to the model as `_memopt_recompute`: the layers' runner, the step's clock, step one's recorder, and
    `auto`'s planner where there is one, each built whole here. Events go one way: a layer's forward tells the clock,
    which says where a step starts; the planner is told and its orders carried out; the recorder marks the layer;
    the runner runs it. `steps_reported`: the trainer calls `step_done` after each optimizer step (else each backward
    ends a step); `reset_peaks`: False where CUDA's peak counter is the Trainer's (`--skip_memory_metrics false`)."""

    def __init__(
        self,
        layers: List[nn.Module],
        policy: RecomputePolicy,
        model: Optional[nn.Module] = None,
        *,
        levers: Optional[Dict[str, object]] = None,
        lever_problems: Optional[Dict[str, tuple]] = None,
        planner=None,
        steps_reported: bool = False,
        reset_peaks: bool = True,
    ):
        self.runner = LayerRunner(layers, policy, model, levers, lever_problems)
        # what step one runs where no dry run chose for it (`auto`: every layer whole), with each lever as it was built
        # to run it (`auto`'s head in chunks: `Lever.build`): a step one again (`_step_one_again`) runs the same
        first = {name: lever.option for name, lever in (levers or {}).items() if lever.option is not None}
        self._first_policy = dataclasses.replace(policy, levers={**first, **policy.levers})
        owner = type(model).__name__ if model is not None else "the model"
        self.clock = StepClock([type(layer).__name__ for layer in layers], owner, steps_reported)
        self.recorder = StepRecorder(len(layers), model, reset_peaks)
        self.planner = planner  # `auto`'s (`decide.planner.BudgetPlanner`): told where steps start
        # a dry run's alike layers replayed from records (`measure.replay.LayerReplay`), where the dry run puts one
        # here (step one's profile of a replayed layer filled as its kind's record's was)
        self.replay = None
        self._model = model
        self._levers_measured = False  # after step one, each lever measured what it would do
        self._dry_measured: Dict[str, object] = {}  # the run's dry run's measurements, to take over (`Orders`)
        self._adopted: List[str] = []  # the levers that took theirs over after step one (`Lever.adopt`)
        self._mid_step = False  # a forward of this step ran (the trainer reports steps): the next is a micro-batch's

    # -- what the others read ------------------------------------------------------------------------------------
    @property
    def layers(self) -> List[nn.Module]:
        return self.runner.layers

    @property
    def policy(self) -> RecomputePolicy:
        return self.runner.policy

    @property
    def levers(self) -> Dict[str, object]:
        return self.runner.levers

    @property
    def lever_problems(self) -> Dict[str, tuple]:
        return self.runner.lever_problems

    @property
    def originals(self):
        return self.runner.originals

    @property
    def profile(self) -> Optional[ModelProfile]:
        return self.recorder.profile

    @property
    def watch(self):
        return self.recorder.watch

    @property
    def running(self) -> Optional[List[int]]:
        return self.clock.running

    @property
    def steps_reported(self) -> bool:
        return self.clock.steps_reported

    @property
    def layer_lists(self) -> List[str]:
        """Where the layers come from, where they come from several lists (a VLM's towers): one line a list."""
        return towers(self._model, self.layers) if self._model is not None else []

    # -- put on, taken off ---------------------------------------------------------------------------------------
    def install(self) -> None:
        self.runner.install(lambda i: partial(self.layer_forward, i))
        routers_train = any(self.runner.routing.layers) and self.runner.routing.trained()
        self.recorder.install(self.measuring, self._before_training_forward, routers_train)

    def uninstall(self) -> None:
        self.runner.uninstall()
        self.recorder.uninstall()

    def take_off(self) -> None:
        """Everything on the model taken off: the layers' forwards, the readings' hooks, every lever beyond the
        layers, the watch's and the planner's meters (their sampler threads)."""
        self.uninstall()
        for lever in self.levers.values():
            lever.remove()
        self.runner.levers.clear()
        meters = {id(m): m for m in (getattr(self.watch, "meter", None), getattr(self.planner, "meter", None)) if m}
        for meter in meters.values():
            meter.close()
        self.recorder.watch_with(None)

    def mark_inside(self, module: nn.Module, name: str) -> None:
        """`module`'s stretches inside its layer marked in the steps watched (`StepRecorder.mark_inside`)."""
        self.recorder.mark_inside(module, name)

    def set_policy(self, policy: RecomputePolicy) -> None:
        """Run the layers under another policy from the next forward on (call it between steps)."""
        self.runner.set_policy(policy)

    # -- the events ----------------------------------------------------------------------------------------------
    def measuring(self) -> bool:
        """Whether the training step about to start may have its memory measured: step one (profiled and watched),
        and the steps the budget planner measures until it is done (the step after its last check is read too)."""
        return self.profile is None or (self.planner is not None and not self.planner.settled)

    def _before_training_forward(self, args, kwargs) -> None:
        """Before a training forward of the model runs (and before it is counted): in the first steps the layers the
        last forward ran are checked (`StepClock`); after step one, `auto`'s planner is told of the batch, and one of
        more tokens than its choice's makes the step about to run a step one again (`planner.batch_arrives`); a
        step one's first forward is where `auto` may start from a dry run of it or a plan file
        (`planner.before_step_one`)."""
        if self.clock.model_forward_starts():
            self._check_layers_ran()
        if self.planner is not None and self.profile is not None:  # a longer batch than the choice's: planned again
            again = self.planner.batch_arrives(args, kwargs, step_starts=not self._mid_step)
            if again is not None:
                self._step_one_again(again)
        self._mid_step = self.steps_reported
        if self.planner is not None and self.planner.waits_for_step_one and self.profile is None:
            self._carry_out(self.planner.before_step_one(self._step_start(None), self._model, args, kwargs))

    def _step_one_again(self, planner) -> None:
        """`auto` plans again for a longer batch (`BudgetPlanner.batch_arrives`): `planner` plans from here, and the
        step about to run is its step one, run as the run's first was (its dry run's choice, else every layer whole),
        recorded, watched and followed by the levers' measurements."""
        self.planner = planner
        self.recorder.restart()
        self._levers_measured, self._dry_measured, self._adopted = False, {}, []
        self.runner.run_choice(self._first_policy)  # as the run's first step, till the dry run's choice replaces it

    def _check_layers_ran(self) -> None:
        planner = self.planner
        auto_measures = planner is not None and not planner.settled
        auto_waits = planner is not None and planner.waits_for_step_one
        self.clock.check_layers_ran(auto_measures, auto_waits, self.policy)

    def first_layer_idle(self):
        """Where the steps so far ran layers but not the list's first: what to say and the flag (`StepClock`)."""
        return self.clock.first_layer_idle()

    def run_over(self, running: Optional[List[int]], inputs_gone: Optional[Dict[int, int]] = None) -> None:
        """A step runs these layers (a dry run of it found so, before step one), and the model's code lets go of
        their inputs where `inputs_gone` says (`fake_step.layer_order`; step one's profile keeps it)."""
        self.clock.run_over(running)
        if inputs_gone is not None:
            self.recorder.inputs_gone = dict(inputs_gone)

    def step_done(self) -> None:
        """The trainer's word that an optimizer step ended: the next training forward starts a new step, and step
        one's memory, watched since its first layer, is complete (`profile.memory`)."""
        self.clock.step_done()
        self._mid_step = False
        self._check_layers_ran()
        self.recorder.close_watch(keep_meter=self.planner is not None)
        if self.profile is not None and not self._levers_measured:
            self._levers_measured = True  # after step one, between steps: each lever measures what it would do
            if self.planner is not None:  # `auto`'s promise: its ways may hold up to it (`ModelProfile.room`)
                self.profile.budget_bytes = self.planner.budget_bytes
            dry, self._dry_measured = self._dry_measured, {}
            for lever in self.levers.values():
                found = dry.get(lever.name)
                if found is not None and lever.adopt(found, self.profile):  # the run's dry run measured the same
                    self._adopted.append(lever.name)
                else:
                    self._measure(lever)

    def _measure(self, lever) -> None:
        """`lever`'s measurement after step one (`Lever.after_step_one`), its seconds kept where they are the run's
        own clock's (a dry run's are not the device's) and it measured something."""
        from ..measure.storages import counting
        from ..sharding import gathered

        began = time.perf_counter()
        with gathered(lever.measured_modules(), self.runner.model):  # FSDP2's shards whole for it, on every rank
            lever.after_step_one(self.profile, self.recorder.reset_peaks)
        if counting() is None and lever.name in self.profile.levers:
            self.profile.lever_seconds[lever.name] = time.perf_counter() - began

    def _remeasure(self) -> None:
        """The levers that took step one's measurement over from the run's dry run measure it on the device now
        (`StepStart.remeasure`)."""
        adopted, self._adopted = self._adopted, []
        for name in adopted:
            self.profile.levers.pop(name, None)
            self._measure(self.levers[name])

    def layer_forward(self, index: int, *args, **kwargs):
        layer = self.layers[index]
        if not (layer.training and torch.is_grad_enabled()):
            return self.originals[index](*args, **kwargs)
        _check_alone(layer, index)
        starts, ended = self.clock.layer_starts(index)
        if starts:
            self._step_starts(ended, _device(args, kwargs))
            if self.planner is not None and self.profile is not None:  # a batch after step one's, to the planner
                x = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
                if x is not None:
                    self.planner.batch_reached(tuple(x.shape), self.profile.shape)
        record = self.recorder.layer_starts(index, args, kwargs)
        if self.replay is not None:  # a dry run's: the layer run, recorded or replayed
            out = self.replay.call(index, partial(self.runner.run, index, args, kwargs, record), args, kwargs, record)
        else:
            out = self.runner.run(index, args, kwargs, record)
        self.recorder.layer_ends(index, out, lambda: _autocast(args, kwargs), self.clock.first, self.clock.last)
        if starts and self.planner is not None and not self.steps_reported:
            _at_backward_end(out, self.clock.backward_ended)
        return out

    def alike_by(self, index: int):
        """What else two layers must share to be replayed one from the other's record: the policy each runs under,
        and what each lever does to it (`Lever.at_layer`); None where a lever needs the layer run."""
        states = tuple((name, lever.at_layer(index)) for name, lever in self.levers.items())
        if any(state == RUN_ALWAYS for _, state in states):
            return None
        return self.policy.layers[index], states

    def _step_starts(self, ended: bool, device: str) -> None:
        """A step starts at its first layer: the last one's watch closed where the loop does not report steps (its
        backward ended), the planner told and its orders carried out, step one recorded."""
        recorder, planner = self.recorder, self.planner
        if recorder.watch is not None and recorder.watch.backward_ended and not self.steps_reported:
            recorder.close_watch(keep_meter=planner is not None)  # step two of a loop that does not report steps
            if self.profile is not None and not self._levers_measured:  # no place between steps: said, not measured
                for name in self.levers:
                    if name not in self.profile.levers:
                        self.profile.lever_problems.setdefault(name, NOT_BETWEEN_STEPS)
        if planner is not None and not planner.settled and (ended or planner.waits_for_step_one):
            self._carry_out(planner.at_step_start(self._step_start(device)))
            if not self.measuring():  # its last check read: this step is not
                recorder.stop_readings()
        recorder.step_starts(device, self.running)

    def _step_start(self, device: Optional[str]) -> StepStart:
        probe = self.probe if self.recorder.argument_shapes else None
        return StepStart(
            device or "", len(self.layers), self.running, self.profile, self.policy, self.levers, self.layer_lists,
            probe, self._remeasure if self._adopted else None,
        )  # fmt: skip

    def probe(self, index: int, layer_policy) -> Optional[Tuple[int, int]]:
        """Layer `index` run alone under `layer_policy` (`policy.LayerPolicy`), in a dry run between steps, on step
        one's argument shapes made again (`recorder.TensorShape`): its forward, then its backward from a gradient of
        its output, each read aside (`aside.held_aside`: unseen by the step's readings, the generators given back).
        Returns (the most its forward held, the most its backward held), each above the level before its forward, or
        None where step one's arguments were not kept. Its input is let go of after the forward, as the step's is
        (unless an op saved it), its other arguments (the positions, one storage for every layer) after the backward,
        as a step keeps them while any layer recomputed whole is yet to run its backward (step one, every layer whole,
        kept them: a layer of op plans read alone without them stood one positions' storage under the check, 64 KiB
        at 8B, 8,192 tokens), and its parameters' gradients after the backward."""
        from ..measure.aside import current_bytes, held_aside
        from ..measure.storages import counting

        shapes = self.recorder.argument_shapes.get(index)
        if shapes is None:
            return None
        count = counting()
        if count is None:
            return None
        peak, count.aside = count.peak, count.aside + 1  # its arguments too: neither the step's peak nor its time
        try:
            return self._probe(index, layer_policy, shapes, current_bytes, held_aside)
        finally:
            count.aside -= 1
            count.peak = max(peak, count.current)

    def _probe(self, index: int, layer_policy, shapes, current_bytes, held_aside) -> Optional[Tuple[int, int]]:
        runner = self.runner
        before = runner.policy
        layers = list(before.layers)
        layers[index] = layer_policy
        runner.policy = dataclasses.replace(before, layers=layers)
        params = [p for p in self.layers[index].parameters() if p.grad is None]
        try:
            made = [made_again(shapes)]  # (args, kwargs): the input let go of after the forward
            others: list = []  # the other arguments (the positions), held through the backward
            outs: list = []
            start = current_bytes("cpu")
            dtype = self.profile.autocast if self.profile is not None else None

            def forward() -> None:
                args, kwargs = made.pop()
                given = tensors_in(args) + tensors_in(kwargs)
                others.extend(given[1:])
                as_step = (  # autocast as the step ran it (none where it ran without)
                    torch.autocast("cpu", dtype=getattr(torch, dtype), cache_enabled=False)
                    if dtype is not None
                    else contextlib.nullcontext()
                )
                with as_step:
                    outs.append(runner._under_policy(index, args, kwargs, None))

            forward_held, _ = held_aside(forward, "cpu")
            out = first_grad_tensor(outs.pop())
            if out is None:
                return None
            ends = [out, torch.empty_like(out)]  # the output and its gradient, let go of after the backward
            level = current_bytes("cpu") - start
            backward_held, _ = held_aside(lambda: torch.autograd.backward(*ends), "cpu")
            ends.clear()
            others.clear()
            return forward_held, level + backward_held
        finally:
            runner.policy = before
            for p in params:
                p.grad = None

    def _carry_out(self, orders: Optional[Orders]) -> None:
        """The planner's orders for the step about to run."""
        if orders is None:
            return
        if orders.running is not None:
            self.clock.run_over(orders.running)
        if orders.policy is not None:
            self.runner.run_choice(orders.policy)
        if orders.watch is not None:
            self.recorder.watch_with(orders.watch)
        if orders.measured:
            self._dry_measured = dict(orders.measured)


def _check_fits(policy: RecomputePolicy, layers: List[nn.Module]) -> None:
    if len(policy.layers) != len(layers):
        raise ValueError(f"a policy for {len(policy.layers)} layers given to a model with {len(layers)} layers")


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
