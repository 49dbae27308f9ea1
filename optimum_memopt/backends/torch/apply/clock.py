"""The step's clock: where a training step starts and ends, read from the layers' forwards, and which layers a step
runs.

The rules (tests/test_torch_budget.py, tests/test_vlm.py, tests/test_auto_dry_run.py):

- A step starts at the first layer it runs (`first`: the layer list's first, or the first of `running`).
- Where the trainer reports steps (`steps_reported`: the Trainer hook, a loop calling `handle.step_done()`), a step
  ends at its report, and a later micro-batch of the same step runs its layers again unrecorded; elsewhere a step
  ends with each backward (one micro-batch per optimizer step), seen as the next step's first layer starts.
- In the first steps the layers a step runs are recorded in order. A step that ran the list's first layer is checked
  at once (`run_order_problem`). Where the first did not run (a vision or audio tower listed before the language
  layers, left out on text alone), `FIRST_LAYER_STEPS` steps running the same layers in the list's order make them
  the ones a step runs (`running`, said); steps that ran them out of order, several times, or differently are said,
  and stop `auto`, which measures step one layer by layer.
"""

import logging
from typing import List, Optional, Tuple

from ..policy import KEEP, LAYER, RecomputePolicy
from .layers import run_order_problem, whole_layers_flag

logger = logging.getLogger(__name__)

# steps a layer list's first layer may be missing from before it is said (`StepClock.check_layers_ran`)
FIRST_LAYER_STEPS = 3


class StepClock:
    """The step boundaries and the layers a step runs, for one model's layer list (`kinds`: each layer's class
    name, in the list's order; `owner`: the model's, in messages)."""

    def __init__(self, kinds: List[str], owner: str, steps_reported: bool = False):
        self.kinds = kinds
        self.owner = owner
        # True where a trainer says where each optimizer step ends (`step_done`); else a backward ends a step
        self.steps_reported = steps_reported
        # the layers a training step runs, in the list's order, where some are left out (a VLM's tower on text alone:
        # found by the first steps here, or by a dry run of the step, `run_over`); None: every layer
        self.running: Optional[List[int]] = None
        self._step_ended = False  # the last step ended: the next first layer's forward starts a new one
        self._backward_ended = False  # the backward of the last training forward ended (steps not reported)
        self._ran: List[int] = []  # the layers whose training forward ran in this step, in order (first steps)
        self._orders: List[List[int]] = []  # the first steps' `_ran`, where their first layer did not run
        self._ran_closed = False  # this step's first forward ended: its later micro-batches are not recorded
        self._ran_checked = False  # the layers a step runs are known

    @property
    def first(self) -> int:
        """The first layer a step runs (where it starts)."""
        return self.running[0] if self.running else 0

    @property
    def last(self) -> int:
        """The last layer a step's forward runs."""
        return self.running[-1] if self.running else len(self.kinds) - 1

    def run_over(self, running: Optional[List[int]]) -> None:
        """A step runs these layers (a dry run of it found so, before step one); None: every layer."""
        self.running = running

    def layer_starts(self, index: int) -> Tuple[bool, bool]:
        """Layer `index`'s training forward starts: (whether a step starts here, whether the step before it ended).
        Recorded in the first steps (`check_layers_ran`)."""
        if not self._ran_checked and not self._ran_closed:
            self._ran.append(index)
        if index != self.first:
            self._backward_ended = False
            return False, False
        if self._backward_ended and not self.steps_reported:
            self._step_ended = True  # a loop that does not report steps: the last step's backward has ended
        self._backward_ended = False
        ended, self._step_ended = self._step_ended, False
        return True, ended

    def backward_ended(self) -> None:
        """The backward through the step's first layer ended (counted where steps are not reported)."""
        self._backward_ended = True

    def step_done(self) -> None:
        """The trainer said an optimizer step ended."""
        self._step_ended = True

    def model_forward_starts(self) -> bool:
        """A training forward of the model starts: where the last one ran layers not yet checked, its step's layers
        are checked now (returns True) or, where the trainer reports steps, a later micro-batch of the step is not
        recorded."""
        if not self._ran or self._ran_checked:
            return False
        if self.steps_reported:
            self._ran_closed = True
            return False
        return True

    def check_layers_ran(self, auto_measures: bool, auto_waits: bool, policy: RecomputePolicy) -> None:
        """After a step: the layers it ran, checked (the module's rules). `auto_measures`: `auto` has not settled yet
        (a step it measures cannot run its layers out of order); `auto_waits`: its step one has not started (it
        measures over the layers that run); `policy`: what the layers that did not run were asked (said)."""
        if self._ran_checked or not self._ran:
            return
        order, self._ran, self._ran_closed = self._ran, [], False
        if self.first in order:
            self._ran_checked, self._orders = True, []
            problem = run_order_problem(order, self.kinds, self.owner)
            if problem is not None and auto_measures:
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
        problem = run_order_problem(order, self.kinds, self.owner)
        if problem is None and any(o != order for o in orders):
            problem = f"the first {FIRST_LAYER_STEPS} steps ran different layers ({'; '.join(map(str, orders))})"
        if problem is None:
            self.running = order
            logger.warning(
                "optimum-memopt: %s. The next step is measured over those as step one (%s)%s",
                where,
                "the plan table and `auto`'s choice count them" if auto_waits else "the plan table counts them",
                "" if auto_waits else _idle_plans(policy, set(ran)),  # `auto`'s own step one policy names every layer
            )
            return
        flag = whole_layers_flag(ran, len(self.kinds))
        if auto_waits:
            raise RuntimeError(
                f"`--memory_opt_config auto` measures step one layer by layer, but {where}, and {problem}; nothing "
                f"was measured or chosen. Pass plans for the layers that run instead, as in {flag}"
            )
        logger.warning(
            "optimum-memopt: %s, and %s. The plans run on the layers that run; no plan table is made%s",
            where,
            problem,
            _idle_plans(policy, set(ran)),
        )

    def first_layer_idle(self) -> Optional[Tuple[str, str]]:
        """Where the steps run so far ran layers but not the list's first (a dry run's step, which `auto` reads
        before step one): what to say, and the flag for the layers that ran; else None."""
        if self._ran_checked or not self._ran or self.first in self._ran:
            return None
        ran = sorted(set(self._ran))
        return self._idle_first(ran, "in a dry run of step one"), whole_layers_flag(ran, len(self.kinds))

    def _idle_first(self, ran: List[int], when: str) -> str:
        kinds = sorted({self.kinds[i] for i in ran})
        return (
            f"the layer list's first layer ({self.kinds[0]}, layer 0 of {len(self.kinds)}) did not run {when}; layers "
            f"{', '.join(map(str, ran))} ({', '.join(kinds)}) did. The list holds modules these steps do not run (a "
            f"vision or audio tower listed before the language layers, which a text-only step leaves out)"
        )


def _idle_plans(policy: RecomputePolicy, ran: set) -> str:
    """What the policy asks of layers that did not run, which recomputes nothing (said after the layer list's
    warning), and whether any layer that ran has a plan at all."""
    idle = [i for i, p in enumerate(policy.layers) if p.mode != KEEP and i not in ran]
    if not idle:
        return ""
    asked = sorted({"whole" if policy.layers[i].mode == LAYER else "+".join(sorted(policy.layers[i].ops))
                    for i in idle})  # fmt: skip
    text = (
        f". The plans on layers {', '.join(map(str, idle))} ({'; '.join(asked)}) recompute nothing: those layers "
        f"did not run"
    )
    if all(policy.layers[i].mode == KEEP for i in ran):
        flag = whole_layers_flag(sorted(ran), len(policy.layers))
        text += f"; no layer that ran has a plan, so nothing is recomputed: name the layers that run, as in {flag}"
    return text
