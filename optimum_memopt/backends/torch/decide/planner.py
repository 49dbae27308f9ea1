"""`--memory_opt_config auto` on the torch backend, in the training process: measure one step, choose, apply, verify.

1. Step one runs with every layer recomputed whole (the policy that needs the least memory, so the step fits if
   anything does); the engine profiles it (each layer's graph, op times) and watches its memory (`watch`).
2. At step two's start (the trainer says when a step ended: `RecomputeState.step_done`), what is held that step one
   did not hold yet (the optimizer's state; gradients under accumulation) is read, the budget solver (`budget.fit`)
   chooses per layer the configuration of least recompute time whose predicted peak fits, and the engine runs it
   from this forward on. The choice, its predicted peak and cost are said (`say`) and written to `solver.json`.
3. Step two's peak is measured; at step three's start it is compared with the prediction. Over the budget, the
   solver chooses once more for a budget lowered by the miss and `MARGIN` of it; a second miss falls back to the
   least peak recompute reaches, and a miss there stops training with the figures. A check under its prediction
   lends nothing to a second solve: what it measured less comes from the step the check ran, and a choice that
   recomputes less can peak elsewhere, where the difference is not (docs/STACK.md, "A check's slack is its own").

Nothing fits (the floor of recompute, or a peak outside the layers, over the budget): RuntimeError with the figures.

Every choice is made and checked for one batch's shape (`planned_shape`). A later batch of more tokens (batches
padded each to their longest) is planned for again at a step's start, as step one was, by a planner handed what this
one started from (`batch_arrives`; the engine makes the step about to run its step one): by a dry run of it, or
where none can be made by measuring that step as step one was; a longer micro-batch inside a step, where no dry run
can plan for it, is said once (`_say_beyond`).

Under a multi-process launch (DDP, DeepSpeed) every process measures its own step one; one rank chooses from all of
them (the one whose step one ran the most tokens, rank 0 where all ran alike: `StepOne.chooser`; the budget is per
device: a peak predicted on any rank counts) and the others run its choice (`Ranks`), so every process trains under
one policy and stops with the same message when nothing fits. A dry run, before step one, is rank 0's.
"""

import copy
import gc
import json
import logging
import math
import os
import weakref
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable, Dict, List, Optional

from ....callbacks.base import atomic_write
from ....memory import MIB, READABLE_DEVICES, MemoryMeter
from ..measure.live import held_outside, make_library_workspaces, meter_for
from ..measure.profile import BACKWARD, FORWARD, StepMemory
from ..measure.watch import StepWatch
from ..ranks import Ranks
from ..steps import Orders, StepStart
from . import messages as said
from .budget import (
    Corrections,
    Fit,
    Prediction,
    as_kept,
    fit,
    fit_of_plans,
    fit_share,
    freed_bytes,
    matched,
    merged,
    predict,
    segment_peaks,
    weigh,
)
from .solver import candidates

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """Why a run stops before step one, found by its dry run (every rank raises it; not a fallback to measuring
    step one, which a reason given as text is)."""

    text: str


MARGIN = 0.005  # of the budget, kept by a re-plan after a check over its prediction
PROBE_ROUNDS = 4  # at most this many solves of a dry run's first choice with its layers read alone (`_probed`)
SEARCH_CHECKS = 4  # a dry run's choices checked by a step each, at most (`BudgetPlanner.search`)
CHECK_WAITS = 8  # steps of shorter batches than the one planned for a check reads on through, at most (`_waits`)


class Stage(str, Enum):
    """Where `auto` is in a run (`BudgetPlanner.stage`), in order; each equal to its value's text."""

    START = "start"  # before step one (armed at its first layer's forward)
    MEASURE = "measure"  # step one running, watched
    VERIFY = "verify"  # a choice running, its step checked against its prediction
    DONE = "done"  # the choice checked: nothing more measured


@dataclass
class Start:
    """How `auto`'s step one starts (`BudgetPlanner.before_step_one`), set when the backend wraps the model: from a
    `--memory_plan_file`'s choice (`plan_file`: `planning.plan_file.PlanFile`); else from a dry run of the step (the
    model's `twin` on the meta device, trained on fake copies of the batch by the `instruments` the run was handed,
    `fake_step.Instruments`, with the run's micro-batches, autocast and DistributedDataParallel's processes, whose
    gradient buckets it holds); else, where there is neither (`no_dry_run`: why, said), measuring with every layer
    recomputed whole. A dry run's choice is handed to `keep_plan` where there is one, kept as a file a later run of
    the same step starts from (`--memory_plan_file`)."""

    plan_file: object = None
    twin: object = None
    instruments: object = None
    no_dry_run: Optional[str] = None
    grad_accum: int = 1
    autocast: Optional[str] = None
    ddp: int = 1
    keep_plan: Optional[Callable[..., Optional[str]]] = None
    optimizer: object = None  # the trainer's, once it says (`BudgetPlanner.optimizer_ready`); let go of at step one
    host_mb: Optional[float] = None  # `--memory_host_mb`: what the dry run's offload may hold on the host
    # (args, kwargs, whether the mask attends to every token) of a batch longer than step one's own that an earlier
    # step ran, which the dry run plans for in its place (`BudgetPlanner.batch_arrives`); let go of at step one
    batch: Optional[tuple] = None


@dataclass(frozen=True)
class Ask:
    """The budget as the user asked it: a peak in bytes, or at most a share of the layers' activations (one of them);
    `given_mb`: `--memory_budget_mb` as the user wrote it, quoted in messages (1e-09 is not 0)."""

    budget_bytes: Optional[int]
    share: Optional[float] = None
    given_mb: Optional[float] = None

    @property
    def budget_mb(self) -> Optional[float]:
        return None if self.budget_bytes is None else self.budget_bytes / MIB

    @property
    def flag(self) -> str:
        """The budget as the user gave it, as a flag."""
        if self.share is not None:
            return f"`--activation_memory_budget {self.share:g}`"
        return f"`--memory_budget_mb {self.budget_mb if self.given_mb is None else self.given_mb:g}`"


@dataclass
class Reading:
    """The device's readings, from step one's start: its meter (CUDA's counter, or the CPU's tensor storages counted:
    one unit), the watch of step one, the processes choosing together, and what the device held as the step being
    checked started. `resets`: whether the device's peak counter may be reset (False: CUDA's is the Trainer's)."""

    resets: bool = True
    meter: Optional[MemoryMeter] = None
    watch: Optional[StepWatch] = None
    ranks: Optional[Ranks] = None  # where any process group is up, every process's step one in one choice
    device: Optional[str] = None
    start_bytes: int = 0


@dataclass(frozen=True)
class StepOne:
    """What step one measured, on every rank, with what later steps hold more (`BudgetPlanner._gather`): what the
    solver chooses from."""

    memory: StepMemory  # this process's step one, by segment
    extra: int  # what later steps hold that step one did not (the optimizer's state; gradients across micro-batches)
    policy: object  # the `RecomputePolicy` step one ran under
    freed: list  # bytes that policy freed per layer
    solved: StepMemory  # every rank's step one in one (`budget.merged`): what `fit` reads
    per_layer: list  # each layer's candidates (`solver.candidates`)
    levers: Dict[str, list]  # each lever's options (`budget.LeverChoice`), from what it measured after step one
    layer_lists: List[str]  # where the layers come from several lists (a VLM's towers), one line a list
    levers_ran: str  # the levers step one ran, as plans (said with the choice)
    # each rank's own step one with what its later steps hold more, as it measured it (rank order): where ranks ran
    # batches of other shapes (a longer one on one of them), `solved` moves every rank by the choosing one's freed
    # bytes, which may stand above or below what the others measure under the policy they run (`_confirmed` reads
    # these)
    own: List[Prediction] = field(default_factory=list)
    ran: Optional[tuple] = None  # the longest batch (batch, tokens) step one ran, of every rank's; None: not read
    # the rank that ran it (the first of the most tokens), which chooses for all: `solved` moves every rank by its
    # freed bytes, exact for the rank whose step holds the most. A shorter rank is predicted above what it will hold
    # where the choice recomputes less than its step one ran (the kept tensors added are the chooser's, larger), below
    # where it recomputes more; under one policy its step holds less than the longest's wherever none of its tensors
    # is larger (one model, fewer tokens), so the highest of all stays the longest rank's
    chooser: int = 0
    chooser: int = 0


@dataclass
class Choices:
    """Each choice in the order made (`fits`) with its check (`verified`), and step one's own where it ran one
    (`planned`: a dry run's, a plan file's)."""

    fits: List[Fit] = field(default_factory=list)
    verified: List[dict] = field(default_factory=list)
    planned: Optional[Fit] = None
    planned_choice: str = "the dry run's choice"  # what step one runs, in the messages
    why_lower: str = ""  # why a re-plan solves for less than the budget (said with its choice)
    why_replanned: str = ""  # why step one did not confirm the planned choice (said with the solver's)
    pending: object = None  # the `RecomputePolicy` the step about to start runs (`Orders.policy`), set by `_run`


@dataclass
class Search:
    """A dry run driving the planner (`fake_step`), whose steps count what the card would to the byte: each choice is
    checked by a step of its own, watched segment by segment, and the next solved with what the checks read, until
    the least recompute whose step fits is found (`BudgetPlanner._search`); its figure is the step's, not a
    prediction's.
    `alone`: choose for this process alone whatever group is up (a dry run of a run's own step)."""

    alone: bool
    peaked_where: Callable[[int], str]  # where the step of a check peaked (0: the first check's)
    tried: List[tuple] = field(default_factory=list)  # (the choice, its step's measured peak in bytes), in order
    searched: Optional[Fit] = None  # the answer, its `predicted` the peak its step measured
    # a check read as its step ended (`check_ended`): the next step starts what it decided, the next check or the
    # answer (`finish_next`: an earlier check's choice, run again as the last step)
    decided: bool = False
    finish_next: bool = False
    answer_at: Optional[int] = None  # where `finish_next`: the answer's place in `tried` (0: the first check)
    watch: Optional[StepWatch] = None  # the step now checking a choice, watched segment by segment
    corrections: Corrections = field(default_factory=Corrections)  # what the checks read beyond their predictions
    last_start: Optional[StepStart] = None  # the engine's last word that a step starts (step one's profile in it)


class BudgetPlanner:
    """`auto` in one process (the module's docstring): told where steps start (`at_step_start`), it answers with
    the engine's orders for the step (`steps.Orders`), and writes no other object's fields."""

    search_checks = SEARCH_CHECKS  # what a dry run driving the search reads (`fake_step.run`)

    def __init__(
        self,
        budget_bytes: Optional[int],
        say: Callable[[str], None] = print,
        share: Optional[float] = None,
        out_dir: Optional[str] = None,
        grad_bytes: int = 0,
        resets: bool = True,
        given_mb: Optional[float] = None,
        detail: Callable[[str], None] = logger.debug,
        start: Optional[Start] = None,
        words: Optional[Callable[[str], str]] = None,
    ):
        if (budget_bytes is None) == (share is None):
            raise ValueError("a budget planner takes a peak in bytes or a share of the activations, one of them")
        self.ask = Ask(None if budget_bytes is None else int(budget_bytes), share, given_mb)
        self.say = say  # the choice and its check, a line each
        self.detail = detail  # the figures behind a choice, in words (a file and the verbose log: `PlanLog`)
        self.words = words  # a stop's message in the caller's words (`Budget.words`); None: as written
        self.out_dir = out_dir  # where solver.json goes
        self.grad_bytes = grad_bytes  # held across micro-batches under gradient accumulation (0 without)
        self.start = start or Start()  # how step one starts (its twin let go once its dry run ran)
        self.stage = Stage.START
        self.reading = Reading(resets)
        self.step_one: Optional[StepOne] = None  # from step two's start
        self._weighed: Optional[tuple] = None  # (step one, what every fit of it shares: `budget.weigh`)
        self._beyond_said = False  # a batch of more tokens than the choice's said (`_say_beyond`)
        self._measured_why: Optional[str] = None  # why step one was measured where a dry run of it was made
        # what plans again for a batch of more tokens than the choice's (`batch_arrives`): (the twin as this planner's
        # dry run found it, the run's optimizer, held weakly: a finished run's is not kept alive by it)
        self._again: Optional[tuple] = None
        # the longest batch since, where longer than step one's: (its shape, its tensors on the meta device with
        # whether its mask attended to every token, whether it ran inside a step: a later micro-batch)
        self._longest: Optional[tuple] = None
        # each step's longest micro-batch (batch, tokens): the last step's, this one's
        self._step_shapes: tuple = (None, None)
        self._check_waited = 0  # steps of shorter batches the check read on through (`_waits`)
        self._checked_ran: Optional[tuple] = None  # the longest batch of the step a check reads, of every rank's
        self.planned_shape: Optional[tuple] = None  # (batch, tokens) every choice is made and checked for
        self.earlier: List[dict] = []  # the choices made for shorter batches before this planner's, in order
        self.choices = Choices()
        self.search: Optional[Search] = None  # where a dry run drives the planner (`driven_by_a_dry_run`)

    @property
    def waits_for_step_one(self) -> bool:
        """Whether the run's step one has not started yet (what comes before it: its dry run, its plan file)."""
        return self.stage is Stage.START

    @property
    def plans_again(self) -> bool:
        """Whether a batch of more tokens than the choice's is planned for again, by a dry run of it (`batch_arrives`):
        a twin of the model is kept for one (a run started from its own dry run or from a plan file)."""
        return self._again is not None

    @property
    def settled(self) -> bool:
        """Whether the choice was checked: no step is measured any more."""
        return self.stage is Stage.DONE

    # -- read from outside: the budget, the choices, step one ---------------------------------------------------------
    @property
    def budget_bytes(self) -> Optional[int]:
        return self.ask.budget_bytes

    @property
    def budget_mb(self) -> Optional[float]:
        return self.ask.budget_mb

    def batch_arrives(self, args, kwargs, step_starts: bool) -> Optional["BudgetPlanner"]:
        """A training forward after step one, of `args` and `kwargs`; `step_starts`: it is its step's first (not a
        later micro-batch). Every choice is made and checked for step one's batch; where this one, or a micro-batch an
        earlier step ran, has more tokens (SFT padded to each batch's longest: TRL without packing), `auto` plans
        again for the longest, as for step one, at a step's start: returned is a planner that does (handed the twin
        as step one's dry run found it, the run's optimizer and the longest batch), whose step one is the step
        about to run: a dry run of the longest batch chooses, the step runs it and is measured and checked. A
        micro-batch of more tokens inside a step runs under the choice it finds (said with the new plan). Where no
        dry run can be made (`plans_again` false: FSDP, DeepSpeed, `--memory_auto_dry_run false`, a loop of one's
        own), a step whose first batch has more tokens is measured again as such a run's step one was, with every
        layer recomputed whole (`measures_again`); a longer micro-batch inside a step is then said once
        (`_say_beyond`). Under several processes every step's start gathers each one's longest, and all plan for
        the longest of them (its tensors, on the meta device, sent to rank 0, whose dry run chooses for all). None
        where nothing is planned again: no batch longer, not at a step's start, or a budget given as a share."""
        shape = batch_shape(args, kwargs)
        if shape is not None:  # each step's longest micro-batch, the last step's kept for its check (`_verify`)
            last, now = self._step_shapes
            if step_starts:
                self._step_shapes = (now, shape)
            elif now is None or math.prod(shape) > math.prod(now):
                self._step_shapes = (last, shape)
        if self.stage is Stage.START or self.planned_shape is None:
            return None
        measures = not self.plans_again
        beyond = shape is not None and math.prod(shape) > math.prod(self.planned_shape)
        if measures and beyond and not (step_starts and self.measures_again) and self.stage is not Stage.MEASURE:
            self._say_beyond(shape, self.planned_shape)  # runs under a choice made for less (a measured step: counted)
        if not (self.plans_again or self.measures_again):
            return None
        if measures:  # only the step about to run can be measured: its own first batch, where longer
            longest = (shape, None, False) if step_starts and beyond else None
        else:
            longest = self._longest
            if shape is not None and math.prod(shape) > math.prod(longest[0] if longest else self.planned_shape):
                longest = (shape, _meta_batch(args, kwargs), not step_starts)
                self._longest = longest
        if not step_starts:
            return None
        ranks, src = self.reading.ranks, None
        if ranks is not None and ranks.size > 1:  # every process's longest: the longest of all planned for, by all
            most, src = ranks.most(math.prod(longest[0]) if longest is not None else 0)
            if most > 0:
                longest = ranks.from_rank(longest, src)  # its tensors on the meta device, as a dry run reads them
            else:
                src = None
        if longest is None:
            return None
        longer, batch, inside = longest
        if measures:
            why = self._why_measured()
            start = replace(self.start, twin=None, optimizer=None, batch=None, plan_file=None, no_dry_run=why)
        else:
            twin, optimizer = self._again[0], self._again[1]()
            if optimizer is None:  # the run's optimizer let go of: not this run's forward (on every rank alike)
                return None
            if not inside and (src is None or src == ranks.rank):  # this very batch: its own tensors, its mask read
                batch = (args, kwargs, None)
            start = replace(self.start, twin=twin, optimizer=optimizer, batch=batch, plan_file=None, no_dry_run=None)
        if self.stage is Stage.VERIFY and self.search is None:  # the choice's steps ran, its check not read yet:
            self._checked_ran = self._last_ran()  # read now, for the shorter batches it was made for
            self._read_check()
        fresh = BudgetPlanner(
            self.budget_bytes, say=self.say, out_dir=self.out_dir, grad_bytes=self.grad_bytes,
            resets=self.reading.resets, given_mb=self.ask.given_mb, detail=self.detail, start=start, words=self.words,
        )  # fmt: skip
        fresh.earlier = self.earlier + [self._as_earlier()]
        if self.reading.meter is not None:
            self.reading.meter.close()
        self.stage = Stage.DONE
        measured = start.no_dry_run if measures else None
        chosen = bool(self.choices.fits) or self.choices.planned is not None  # else replaced before step two chose
        self.say(said.planning_again(longer, self.planned_shape, self.asked, inside, src, measured, chosen))
        return fresh

    @property
    def measures_again(self) -> bool:
        """Whether, with no dry run to plan again (`plans_again`), a step whose first batch has more tokens than the
        choice's is measured again as step one was, with every layer recomputed whole (`batch_arrives`): a budget in
        bytes (a share of the activations is solved from step one alone)."""
        return self.budget_bytes is not None

    def _why_measured(self) -> str:
        """Why a longer batch is measured again rather than dry-run (`batch_arrives`), as step one was."""
        if self.start.no_dry_run is not None:
            return self.start.no_dry_run
        if self._measured_why is not None:  # a dry run was made, and chose nothing
            return self._measured_why
        if self.start.plan_file is not None:
            return "the run started from `--memory_plan_file` and keeps no twin of the model for a dry run"
        return "step one was measured without a dry run of it"

    @property
    def _after_shorter(self) -> str:
        """Where this planner plans again for a longer batch than earlier ones, what a stop says of it."""
        if not self.earlier or self.planned_shape is None:
            return ""
        return said.stopped_for_longer(self.planned_shape, self.earlier)

    def _as_earlier(self) -> dict:
        """This planner's batch and its last choice (its check where one ran), for the planner after it."""
        last = self.summary()
        planned = self.choices.planned
        if last is None and planned is not None and planned.choice is not None:  # replaced before step two chose
            last = dict(config=planned.config(), predicted_peak_mb=planned.predicted.peak_mb, measured_peak_mb=None)
        return dict(batch=list(self.planned_shape), **(last or {}))

    def batch_reached(self, shape: tuple, planned: tuple) -> None:
        """A training forward after step one reached the layers with input of `shape`; step one's was `planned`. Where
        the batch's own shape is not read (`batch_shape`: no `input_ids`, `inputs_embeds` or tensor of two
        dimensions), a layer input of more tokens than step one's is said once here, as `batch_arrives` says a batch
        no dry run or measured step plans for (`_say_beyond`)."""
        if self.planned_shape is not None or self._again is not None or len(shape) < 2 or len(planned) < 2:
            return
        if math.prod(shape[:-1]) > math.prod(planned[:-1]):
            self._say_beyond(shape[:-1], planned[:-1], said.NO_BATCH_SHAPE)

    def _say_beyond(self, shape: tuple, planned: tuple, why: Optional[str] = None) -> None:
        """A batch of `shape` (batch, tokens) runs under a choice made and checked for `planned`, of fewer tokens, and
        nothing plans for it (a later micro-batch of a step where no dry run can be made; a budget as a share): it
        holds more than any figure said. Said once, with why and what to do (the run goes on: its steps are the
        user's)."""
        if self._beyond_said:
            return
        self._beyond_said = True
        fit = self.choices.fits[-1] if self.choices.fits else self.choices.planned
        predicted = fit.predicted.peak_mb if fit is not None and fit.predicted is not None else None
        tokens, planned_tokens = math.prod(shape), math.prod(planned)
        why = why or self._why_once()
        self.say(said.batch_beyond_planned(shape, tokens, planned, planned_tokens, self.asked, predicted, why))

    def _why_once(self) -> str:
        """Why a longer batch than the choice's is not planned for here (`batch_arrives` cannot plan again for it)."""
        if self.budget_bytes is None:
            return "a budget given as a share of the activations is solved from step one alone"
        return (
            f"{self._why_measured()}; a step whose first batch is longer is measured again, and this one is a later "
            f"micro-batch of its step, which runs under the choice it finds"
        )

    def _stop(self, text: str) -> RuntimeError:
        """The error that stops the run, its message in the caller's words (`words`)."""
        return RuntimeError(self.words(text) if self.words is not None else text)

    @property
    def asked(self) -> str:
        """The budget as the user gave it."""
        return self.ask.flag

    @property
    def fits(self) -> List[Fit]:
        return self.choices.fits

    @property
    def verified(self) -> List[dict]:
        return self.choices.verified

    @property
    def planned(self) -> Optional[Fit]:
        return self.choices.planned

    @property
    def searched(self) -> Optional[Fit]:
        return self.search.searched if self.search is not None else None

    @property
    def meter(self) -> Optional[MemoryMeter]:
        return self.reading.meter

    @property
    def device(self) -> Optional[str]:
        return self.reading.device

    @property
    def memory(self) -> Optional[StepMemory]:
        return self.step_one.memory if self.step_one is not None else None

    @property
    def solved(self) -> Optional[StepMemory]:
        return self.step_one.solved if self.step_one is not None else None

    @property
    def per_layer(self) -> list:
        return self.step_one.per_layer if self.step_one is not None else []

    @property
    def levers(self) -> Dict[str, list]:
        return self.step_one.levers if self.step_one is not None else {}

    @property
    def measured_policy(self):
        return self.step_one.policy if self.step_one is not None else None

    def optimizer_ready(self, optimizer) -> None:
        """The trainer's optimizer, for step one's dry run to train with one like it and for what the process holds
        outside the step to leave its state out; let go of once step one started (`before_step_one`)."""
        self.start.optimizer = optimizer

    def driven_by_a_dry_run(self, alone: bool, grad_bytes: int, peaked_where: Callable[[int], str]) -> None:
        """A dry run drives this planner (`fake_step.run`), whose steps count what the card would to the byte: each
        choice is checked by a step of its own (`search`). `alone`: it is a run's own step, dry-run in one of its
        processes (no collective); `grad_bytes`: the gradients held across micro-batches (0 without accumulation);
        `peaked_where(k)`: where the step of the k-th check peaked (0: the first)."""
        self.search = Search(alone, peaked_where)
        if grad_bytes:
            self.grad_bytes = grad_bytes

    def _alone(self) -> bool:
        """Whether this process chooses alone whatever group is up (a dry run of a run's own step)."""
        return self.search is not None and self.search.alone

    def arm(self, step: StepStart) -> StepWatch:
        """The watch for the step about to start (step one) on `step.device` ('cuda' or 'cpu')."""
        device = step.device
        if device not in READABLE_DEVICES:
            raise self._stop(said.not_readable(device))
        self.reading.ranks = Ranks(alone=self._alone())
        self.reading.meter = meter_for(device)  # CUDA's counter, or the CPU's tensor storages counted (`live`)
        self.reading.device = device
        resets = self.reading.resets or device == "cpu"  # the CPU's sampler is the meter's own; CUDA's is shared
        self.reading.watch = StepWatch(step.n_layers, self.reading.meter, resets, step.running)
        self.stage = Stage.MEASURE
        return self.reading.watch

    def _current(self) -> int:
        return int(round((self.reading.meter.read().current_mb or 0.0) * MIB))

    def at_step_start(self, step: StepStart) -> Orders:
        """Called by the engine as the first layer's forward starts the run's first step and each step after one
        ended (`RecomputeState.step_done`). The step about to run is measured (step one, then each check): the
        process's garbage is collected first, so that nothing an earlier computation left in a reference cycle is
        freed by chance inside it, which would lower its readings and the prediction made from them."""
        if self.stage is not Stage.DONE:
            gc.collect()
        if self.search is not None:
            self.search.last_start = step
            if self.search.decided:  # the check before was read as its step ended: carry out what it decided
                self.search.decided = False
                if self.search.finish_next:
                    self._finish()
                else:
                    self._next_check_starts()
                return Orders(watch=self._check_watch(step), policy=self._chosen())
        watch = None
        if self.stage == Stage.START:
            watch = self.arm(step)
        elif self.stage == Stage.MEASURE:
            self._choose(step)
            watch = self._check_watch(step)
        elif self.stage == Stage.VERIFY and not self._waits():
            self._verify(step)
        return Orders(watch=watch, policy=self._chosen())

    def _waits(self) -> bool:
        """Whether the check reads on through the next step too: the step that just ended ran a shorter batch than
        the one the choice was made for (batches padded each to their longest), whose step holds less than the
        prediction, and `CHECK_WAITS` such steps have not passed yet. The meter's peak is not reset meanwhile: the
        check reads the highest of every step since it started, the first of the planned length among them."""
        ran, planned = self._last_ran(), self.planned_shape
        self._checked_ran = ran  # said with the check
        if self.search is not None or ran is None or planned is None or math.prod(ran) >= math.prod(planned):
            return False
        if self._check_waited >= CHECK_WAITS:
            return False
        self._check_waited += 1
        return True

    def _last_ran(self) -> Optional[tuple]:
        """The longest micro-batch (batch, tokens) the last step ran, of every rank's: every rank decides on it alike
        (a check is a collective)."""
        ran, ranks = self._step_shapes[0], self.reading.ranks
        if ranks is not None and ranks.size > 1:
            ran = max((r for r in ranks.gather(ran) if r is not None), key=math.prod, default=None)
        return ran

    def _check_watch(self, step: StepStart) -> Optional[StepWatch]:
        """A dry run's check about to run is watched segment by segment, as step one was, on the same meter: what it
        reads beyond the prediction in each segment corrects the solves after it (`Corrections`). None elsewhere (a
        run's own steps are watched once: step one)."""
        search = self.search
        if search is None or self.stage is not Stage.VERIFY or self.reading.watch is None:
            search_watch = None
        else:
            search_watch = StepWatch(step.n_layers, self.reading.meter, self.reading.watch.resets, step.running)
        if search is not None:
            search.watch = search_watch
        return search_watch

    def _chosen(self):
        """The choice made since the last orders, for the step about to run (None: none)."""
        policy, self.choices.pending = self.choices.pending, None
        return policy

    def before_step_one(self, step: StepStart, model, args, kwargs) -> Optional[Orders]:
        """At the first training forward of `model`, before any of it runs: the choice from a dry run of this step,
        which step one then runs (`from_plan`), with what the process holds on the device outside the step counted
        from its start (`live.held_outside`: every reading of the step counts it); where there is none, why, in the
        plan's file, and step one measures with every layer recomputed whole. Once, on rank 0 (the others wait for
        its choice, which every rank runs: a dry run on each would cost every process its CPU time for nothing)."""
        twin, self.start.twin = self.start.twin, None
        optimizer, self.start.optimizer = self.start.optimizer, None  # not kept past the dry run
        batch, self.start.batch = self.start.batch, None
        self._step_shapes = (None, batch_shape(args, kwargs))  # step one's first micro-batch (`batch_arrives`)
        ranks = Ranks(alone=self._alone())
        first = None  # under several processes: (the longest of every rank's first batch's shape, its rank)
        if batch is None and ranks.size > 1 and not ranks.mirrored:
            dry = self.start.plan_file is None and self.start.no_dry_run is None and twin is not None
            batch, first = self._longest_first(ranks, args, kwargs, dry and self.budget_bytes is not None)
        if self.start.plan_file is not None:
            self._from_plan_file(step, model, args, kwargs, optimizer, first, ranks.rank)
            if twin is not None and optimizer is not None and self.search is None:  # no dry run trained it: kept
                self._again = (twin, weakref.ref(optimizer))  # to plan for a batch longer than the file's
            return Orders(policy=self._chosen())
        # the batch the dry run plans for: this step's, or a longer one an earlier step ran (`batch_arrives`)
        dry_args, dry_kwargs, attends_all = batch if batch is not None else (args, kwargs, None)
        self.planned_shape = first[0] if first is not None else batch_shape(dry_args, dry_kwargs)
        why = self.start.no_dry_run
        if why is None and self.budget_bytes is None:
            return None
        if why is None and twin is None:
            return None
        if why is None and optimizer is None:
            why = "the run's optimizer is not known here (a loop of one's own)"
        fit, dry, held, libraries, running = None, None, 0, 0, None
        spare = None  # the twin before the dry run trains it: to plan again for a longer batch (`batch_arrives`)
        if why is None and self.search is None and self.budget_bytes is not None:
            spare = copy.deepcopy(twin)
        if why is None and ranks.rank == 0:
            from .from_plan import LayerOrderError, dry_run_choice

            try:
                device, held, libraries = self._outside(model, args, kwargs, optimizer)
                found: list = []  # the layers the step runs, known before its dry run's steps (which may raise)
                try:
                    dry = dry_run_choice(
                        self.start,
                        twin,
                        dry_args,
                        dry_kwargs,
                        optimizer,
                        self.budget_mb,
                        held,
                        running_into=found,
                        device=device,
                        mask_attends_all=attends_all,
                    )
                finally:
                    running = found[0] if found else None
                fit = dry.fit
                if dry.first_layer_idle is not None:
                    why = Refusal(said.first_layer_idle(*dry.first_layer_idle))
                elif fit is None or fit.choice is None:
                    why = said.dry_run_found_nothing(self.asked, fit.why_not if fit is not None else None)
                elif fit.predicted.peak_bytes > self.budget_bytes:  # the least any check measured, over the budget
                    why = said.dry_run_checked_nothing(self.asked, fit.predicted.peak_mb, fit.config())
            except LayerOrderError as e:  # step one could not be measured either: stop before it
                why = Refusal(said.cannot_measure(e))
            except Exception as e:  # the dry run's own failure costs the run nothing but the step
                why = said.dry_run_failed(e)
        # what the levers measured of this very step in the dry run: taken over after step one, not run again
        measured = dict(dry.profile.levers) if why is None and dry is not None and dry.profile is not None else None
        fit, why, running, measured, self.planned_shape = ranks.from_rank0(
            (fit if why is None else None, why, running, measured, self.planned_shape)
        )  # the batch rank 0's dry run planned for, every rank's (each process's own may be another)
        if isinstance(why, Refusal):  # every rank stops, before step one
            raise self._stop(why.text + self._after_shorter)
        if fit is None:
            self._measured_why = why
            self.detail(said.measures_whole(why))
            return Orders(running=running)  # step one is measured over the layers the step runs
        if spare is not None:  # a dry run of this step ran: one of a longer batch can (the optimizer held weakly)
            self._again = (spare, weakref.ref(optimizer))
        self.choices.planned = fit
        self._run(fit)
        kept = ""
        if ranks.rank == 0 and self.start.keep_plan is not None:
            kept = self._keep(fit, held, libraries, self.planned_shape)
        seconds = dry.seconds if dry is not None else None
        whose = said.first_of_rank(*first, ranks.size) if first is not None and first[1] != ranks.rank else ""
        again = self.planned_shape if self.earlier else None  # planning again for a longer batch
        chose = said.dry_run_chose(
            seconds, fit.config(), self.budget_mb, fit.predicted, held, libraries, kept, whose, again
        )
        self.say(chose)
        return Orders(policy=self._chosen(), running=running, measured=measured)

    def _longest_first(self, ranks: Ranks, args, kwargs, dry: bool) -> tuple:
        """Under several processes, before step one: every rank runs the one choice, so it is made for the longest of
        every rank's first batch (the first rank's of the most tokens): rank 0's dry run plans for it (`dry`: one
        will be made), a plan file is held to it on every rank alike, and it is the batch planned for. Returned: that
        batch as the dry run reads it (its tensors on the meta device, whether its mask attends to every token) where
        `dry` and it is another rank's than rank 0, else None; and (its shape, its rank), or None where no rank's
        shape is read."""
        shapes = ranks.gather(batch_shape(args, kwargs))
        tokens = [math.prod(s) if s is not None else 0 for s in shapes]
        src = tokens.index(max(tokens))
        first = (shapes[src], src) if shapes[src] is not None else None
        if src == 0 or not dry:
            return None, first
        return ranks.from_rank(_meta_batch(args, kwargs) if ranks.rank == src else None, src), first

    def _keep(self, fit: Fit, held: int, libraries: int, shape: Optional[tuple]) -> str:
        """The dry run's choice handed to `Start.keep_plan`, as `memopt-plan --json` writes it: its step's peak for a
        process holding nothing else but the workspaces made for it (what this process held outside the step taken
        out, as a run from the file puts its own back in; workspaces this process made before are taken out with the
        rest, and the file's figure is that much lower, which the run from it counts back with what it holds), and
        the batch's shape. Returns where it went and how a run
        starts from it, said with the choice; a batch whose shape cannot be read is not kept (the file plans one)."""
        if shape is None:
            self.detail(said.NOT_KEPT_NO_SHAPE)
            return ""
        peak_mb = (fit.predicted.peak_bytes - held + libraries) / MIB
        budget = self.ask.given_mb if self.ask.given_mb is not None else self.budget_mb
        try:
            path = self.start.keep_plan(
                choice=fit.config(), peak_mb=peak_mb, peak_at=fit.predicted.where, budget_mb=budget,
                workspaces_mb=libraries / MIB, batch=shape[0], seq=shape[1],
            )  # fmt: skip
        except OSError as e:  # keeping it is a convenience: the run goes on without it, saying why
            return said.could_not_keep(e)
        return said.kept_in(path) if path else ""

    def _outside(self, model, args, kwargs, optimizer) -> tuple:
        """Before step one: (the model's device, the bytes the process holds there outside the step, the libraries'
        workspaces made now among them). The process's garbage is collected first, so that none waiting to be freed
        is counted, and the workspaces are made before the step, so that what is held counts them
        (`live.held_outside`, `live.make_library_workspaces`)."""
        gc.collect()
        device = next(iter(model.parameters())).device
        libraries = make_library_workspaces(device)
        trained = bool(self.earlier)  # planning again for a longer batch: the run's steps ran here before
        return device, held_outside(model, (args, kwargs), device, optimizer, self.start.ddp, trained), libraries

    def _from_plan_file(
        self, step: StepStart, model, args, kwargs, optimizer, first: Optional[tuple], rank: int = 0
    ) -> None:
        """`--memory_plan_file`: step one runs the file's choice, checked after it as a dry run's is; refused here,
        before step one, where the batch is not the file's (a longer sequence holds more than the file planned; under
        several processes the longest of every rank's first batch, `first`: (its shape, its rank), is held to it on
        every rank alike). The figure said is the file's with what this process holds outside the step in place of the
        workspaces the file counted (`live.held_outside`, as a run's own dry run counts it): the file planned a
        process that holds nothing else."""
        plan = self.start.plan_file
        flag = f"`--memory_plan_file {plan.path}`"
        shape = batch_shape(args, kwargs) if first is None else first[0]  # the longest of every rank's first
        planned = plan.step
        self.planned_shape = (planned.batch, planned.seq)
        shorter = ""
        if shape is None:
            shorter = said.PLAN_FILE_NO_SHAPE
        elif shape[0] != planned.batch or shape[1] > planned.seq:
            whose = first[1] if first is not None and first[1] != rank else None
            raise self._stop(said.plan_file_other_batch(flag, planned, shape, whose))
        elif shape[1] < planned.seq:
            shorter = said.plan_file_shorter(shape[1], planned.seq)
        _, held, _ = self._outside(model, args, kwargs, optimizer)
        peak = int(round((plan.peak_mb - plan.workspaces_mb) * MIB)) + held
        predicted = Prediction(peak, plan.peak_at or "memopt-plan's dry run")
        least = Prediction(int(round(plan.least_mb * MIB)), "the least any row of the plan file reaches") if (
            plan.least_mb is not None
        ) else predicted  # fmt: skip
        self.choices.planned_choice = f"the choice of {flag}"
        fit = fit_of_plans(plan.choice, step.n_layers, self.budget_bytes, predicted, least)
        self.choices.planned = fit
        self._run(fit)
        self.say(said.plan_file_chose(flag, plan, self.budget_mb, held, predicted, self.budget_bytes, shorter))

    def _choose(self, step: StepStart, budget_bytes: Optional[int] = None) -> None:
        if self.step_one is None:
            self._gather(step)
        result = None
        chooser = self.step_one.chooser  # the rank whose step one ran the most tokens (rank 0 where all ran alike)
        if self.reading.ranks.rank == chooser:
            try:
                result = self._confirmed(step, budget_bytes)
                if result is None:
                    self._measured_here(step)
                    result = self._probed(step, self._fit(step, budget_bytes))
            except Exception as e:  # said to every rank before it is raised, so that none waits for a choice
                result = e
        # with why step one's own choice was not kept, where it was not (said by rank 0, which may not be the chooser)
        result, why = self.reading.ranks.from_rank((result, self.choices.why_replanned), chooser)
        self.choices.why_replanned = why
        if isinstance(result, Exception):
            if self.reading.ranks.rank == chooser:
                raise result
            raise self._stop(said.chooser_failed(result, chooser))
        self.choices.fits.append(result)
        self._write()
        if result.choice is None:
            unweighed = [why for lever in step.levers.values() if (why := lever.unweighed(step.profile))]
            raise self._stop(said.nothing_fits(self.asked, result, self.out_dir, unweighed) + self._after_shorter)
        self._run(result)
        self.say(said.chose(self, result))
        self.detail(said.described(self, result, step.profile.shape))
        if self.reading.watch.resets:
            self.reading.meter.reset_peak()
        self.reading.start_bytes = self._current()
        self.stage = Stage.VERIFY

    def _probed(self, step: StepStart, result: Fit) -> Fit:
        """A dry run's first choice, its layers' own segments read before any check (`StepStart.probe`): each
        configuration the choice gives a layer is run alone in one layer of each structure (`graph.signature`), beside
        the configuration step one ran there, and what its forward and backward held beyond what `budget.predict`
        moves them by is laid on every layer of that structure (`Corrections.own`); the choice is solved again for the
        budget with them, until every configuration it gives is read (at most `PROBE_ROUNDS`). A layer alone holds
        what it holds in the step (the storages it makes and keeps, one for one, on the tests' decoders), so the first
        check lands where the step's other segments are exact. Where a probe cannot run, or the corrected solve finds
        nothing, the first choice as it was."""
        if step.probe is None or self.search is None or result.choice is None or self.ask.share is not None:
            return result
        if self.reading.ranks is not None and self.reading.ranks.size > 1:
            return result  # several processes' segments: the solver's are every process's, a probe this one's
        try:
            return self._probe_rounds(step, result)
        except Exception as e:  # a layer that cannot run alone: the first choice as it was, its check reads them
            logger.warning(
                "optimum-memopt: a dry run's layers could not be run alone before its first check (%s: %s); the first "
                "choice is checked as solved from step one",
                type(e).__name__,
                e,
            )
            return result

    def _probe_rounds(self, step: StepStart, result: Fit) -> Fit:
        one = self.step_one
        groups: Dict[object, List[int]] = {}
        for i, rec in enumerate(step.profile.layers):
            if rec.graph is not None and i < len(one.per_layer):
                groups.setdefault(rec.graph.signature(), []).append(i)
        sample = {i: members[1] if len(members) > 1 else members[0] for members in groups.values() for i in members}
        read: Dict[tuple, tuple] = {}  # (sampled layer, label) -> (forward, backward) held alone
        corrections = self.search.corrections
        for _ in range(PROBE_ROUNDS):
            wanted = {(sample[i], c.label): c for i, c in enumerate(result.choice) if i in sample}
            wanted = {key: c for key, c in wanted.items() if key not in read}
            if not wanted:
                return result
            for (k, label), c in wanted.items():
                ran = step.policy.layers[k]
                for key, policy in (((k, None), ran), ((k, label), c.layer_policy())):
                    if key not in read and key[1] is not None and (policy.mode, policy.ops) == (ran.mode, ran.ops):
                        read[key] = read[k, None]  # the configuration step one ran there: read once
                    if key not in read:
                        got = step.probe(k, policy)
                        if got is None:
                            return result
                        read[key] = got
                ran_forward, ran_backward = read[k, None]
                forward, backward = read[k, label]
                for i in (i for i, s in sample.items() if s == k):
                    same = next((o for o in one.per_layer[i] if o.label == label), None)
                    if same is None:
                        continue
                    moved = one.freed[i] - same.freed_bytes  # what `predict` moves the layer's own forward by
                    corrections.own[i, label, FORWARD] = forward - ran_forward - moved
                    corrections.own[i, label, BACKWARD] = backward - ran_backward
            again = self._fit(step, self.budget_bytes, corrections)
            if again.choice is None:
                return result
            result = again
        return result

    def _confirmed(self, step: StepStart, budget_bytes: Optional[int]) -> Optional[Fit]:
        """The dry run's choice, which step one ran, kept where step one's own memory with what later steps hold more
        fits the budget (`source` says so); else None, and the solver chooses from step one as after a step measured
        with every layer recomputed (a profile measured under another policy than the floor predicts a layer's own
        segments less surely: `budget.predict_range`, so the choice it ran is kept where it can be)."""
        planned = self.choices.planned
        if planned is None or self.choices.fits or budget_bytes is not None or self.budget_bytes is None:
            return None
        mine = self.step_one.freed
        real = max(self.step_one.own, key=lambda p: p.peak_bytes)  # every rank's step one as it measured it
        ran, shape = self.step_one.ran, self.planned_shape
        if ran is not None and shape is not None and math.prod(ran) < math.prod(shape) and planned.predicted:
            # step one ran a shorter batch than the one planned for (a longer micro-batch or rank's before it): what
            # it held says less than the planned batch's step, which the dry run counted
            real = max(real, planned.predicted, key=lambda p: p.peak_bytes)
        if real.peak_bytes > self.budget_bytes:
            self.choices.why_replanned = said.step_one_over(self.choices.planned_choice, real)
            return None
        if self.start.plan_file is not None:  # what the file's choice frees and costs, as step one's profile offers it
            offered = matched(planned, step.profile, self.step_one.levers)
            if offered is None:
                self.choices.why_replanned = said.step_one_offers_less(self.choices.planned_choice)
                return None
            planned = offered
        source = said.confirmed_source(self.choices.planned_choice)
        return replace(
            planned, budget_bytes=self.budget_bytes, measured=real, predicted=real, source=source,
            segments=segment_peaks(self.step_one.solved, mine, mine),
        )  # fmt: skip

    def _run(self, result: Fit) -> None:
        """`result`'s choice runs from the step about to start on: the layers' plans and each lever's option, chosen
        with them (`Orders.policy`)."""
        self.choices.pending = result.policy()

    def _measured_here(self, step: StepStart) -> None:
        """Before a choice is made again from step one: where its levers took their measurements over from the run's
        dry run (`StepStart.remeasure`), they measure on the device now, and their options are read again: the solver
        weighs the layers' op times as step one's clock read them, and the levers' seconds so too."""
        if step.remeasure is None:
            return
        step.remeasure()
        one = self.step_one
        levers = {name: lever.choices(step.profile, step.policy) for name, lever in step.levers.items()}
        self.step_one = replace(one, levers=levers)

    def _gather(self, step: StepStart) -> None:
        """Step one's memory on every rank, with what its later steps hold more, in one (`budget.merged`)."""
        memory = step.profile.memory if step.profile is not None else None
        mine, extra, freed = None, 0, []
        if memory is None:
            why = (step.profile.memory_problem if step.profile is not None else None) or "no step one recorded"
        else:
            extra = self._current() - memory.start_bytes + self.grad_bytes
            freed = freed_bytes(step.profile, step.policy)
            mine, why = as_kept(memory, freed, extra), None
        own = predict(merged([mine], freed), freed, freed) if mine is not None else None
        everyone = self.reading.ranks.gather((mine, why, own, self._step_shapes[0]))
        missing = [(rank, why) for rank, (kept, why, _, _) in enumerate(everyone) if kept is None]
        if missing:
            raise self._stop(said.step_one_not_located(missing, self.reading.ranks.size > 1))
        ran = [lever.plan() for lever in step.levers.values() if lever.plan()]
        self.step_one = StepOne(
            memory=memory,
            extra=extra,
            policy=step.policy,
            freed=freed,
            solved=merged([kept for kept, _, _, _ in everyone], freed),
            per_layer=candidates(step.profile),
            levers={name: lever.choices(step.profile, step.policy) for name, lever in step.levers.items()},
            layer_lists=list(step.layer_lists),
            levers_ran=said.levers_ran(ran),
            own=[
                replace(p, where=f"{p.where} on rank {rank}") if len(everyone) > 1 else p
                for rank, (_, _, p, _) in enumerate(everyone)
            ],
            ran=max((r for _, _, _, r in everyone if r is not None), key=math.prod, default=None),
            chooser=max(range(len(everyone)), key=lambda r: (math.prod(everyone[r][3] or (0,)), -r)),
        )

    def _fit(self, step: StepStart, budget_bytes: Optional[int], corrections: Optional[Corrections] = None) -> Fit:
        one = self.step_one
        if self.ask.share is not None:
            return fit_share(step.profile, one.solved, self.ask.share, one.policy, 0, one.per_layer)
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        levers = list(one.levers.values())
        if self._weighed is None or self._weighed[0] is not one:  # what every fit of step one shares, weighed once
            self._weighed = (one, weigh(step.profile, one.solved, one.policy, 0, one.per_layer, levers))
        weighed = self._weighed[1]
        return fit(step.profile, one.solved, budget, one.policy, 0, one.per_layer, levers, corrections, weighed)

    def _read_check(self) -> tuple:
        """The check of the last choice: the most its steps held since the check began (the meter's peak, or a dry
        run's watch's highest reading), on every rank, recorded in `verified` and said. Returns (the highest, where,
        the choice)."""
        watch = self.search.watch if self.search is not None else None
        if watch is not None and watch.resets:  # the meter's peak reset at each mark: the watch's highest reading
            read = max(watch.most, int(round((self.reading.meter.read().peak_mb or 0.0) * MIB)))
        else:
            read = int(round((self.reading.meter.read().peak_mb or 0.0) * MIB))
        mine = max(read, self.reading.start_bytes)
        peaks = self.reading.ranks.gather(mine)
        peak = max(peaks)
        result = self.choices.fits[-1]
        self.choices.verified.append(
            {"measured_peak_mb": peak / MIB, "predicted_peak_mb": result.predicted.peak_bytes / MIB}
            | ({"returned_mb": result.returned / MIB} if result.returned else {})
            | ({"measured_peak_mb_by_rank": [p / MIB for p in peaks]} if len(peaks) > 1 else {})
        )
        where = said.on_ranks(peaks, peak)
        verdict = said.verdict(self.asked, peak, self.budget_bytes, self.budget_mb)
        ran, planned = self._checked_ran, self.planned_shape
        shorter = ran if ran is not None and planned is not None and math.prod(ran) < math.prod(planned) else None
        waited, self._check_waited = self._check_waited, 0
        self.say(said.checked(self.reading.watch.resets, peak, where, result, verdict, shorter, planned, waited))
        return peak, where, result

    def _verify(self, step: StepStart, at_end: bool = False) -> None:
        peak, where, result = self._read_check()
        predicted = result.predicted.peak_bytes
        if self.search is not None and self.budget_bytes is not None:
            self._search(step, result, peak, at_end)
            return
        over_budget = self.budget_bytes is not None and peak > self.budget_bytes  # every rank saw the same peaks
        if over_budget:
            over = (peak - predicted) / MIB
            floor = result.floor
            if len(self.choices.fits) == 1:
                lowered = self.budget_bytes - (peak - predicted) - int(MARGIN * self.budget_bytes)
                to_floor = lowered < floor.peak_bytes
                self.choices.why_lower = said.budget_lowered(self.budget_mb, over, MARGIN, to_floor)
                self._choose(step, max(lowered, floor.peak_bytes))
                return
            if result.predicted.peak_bytes > floor.peak_bytes:
                self.choices.why_lower = said.missed_again(over)
                self._choose(step, floor.peak_bytes)
                return
            self._write()
            self.stage = Stage.DONE
            self.reading.meter.close()
            stop = said.cannot_keep(self.asked, result, peak, where, self.budget_bytes, self.out_dir)
            raise self._stop(stop + self._after_shorter)
        self._finish()

    def check_ended(self) -> bool:
        """A dry run's check read as its step ends (`fake_step.run`, which calls this after each step it reports
        ended), not as the next step starts: where the search then ends with the step just read as its answer, no
        step need run that choice again (the dry run's steps are exact and the same each time they run), and the
        dry run stops there. Returns whether it did; else the next step runs what the check decided (the next
        choice to check, or an earlier check's choice as the answer)."""
        search = self.search
        if search is None or self.budget_bytes is None or self.stage is not Stage.VERIFY or search.last_start is None:
            return False
        self._verify(search.last_start, at_end=True)
        search.decided = not self.settled
        return self.settled

    def _next_check_starts(self) -> None:
        """The step about to start checks the choice just made: its peak read from here."""
        if self.reading.watch.resets:
            self.reading.meter.reset_peak()
        self.reading.start_bytes = self._current()

    def _search(self, step: StepStart, result: Fit, peak: int, at_end: bool = False) -> None:
        """A dry run's next choice after a check that measured `peak` for `result` (exact: a dry run's step counts
        what the card's counter reads). The solver's predictions rest on step one, measured with every layer
        recomputed whole and the head in chunks, and stand above what a choice that keeps more holds (a layer's own
        forward, which `budget.predict` moves by all of its change, and a head run whole, weighed by its bound:
        `levers.loss.choices`): from them alone `auto` recomputed where the plain step fit. So each check's step is
        watched segment by segment, what each segment read beyond the prediction is kept (`_learn`:
        `budget.Corrections`), and the next choice is solved for the budget itself with it; a choice already checked
        is the answer. Where a check's segments could not be read (or nothing fits so corrected), the budget the
        solver is given moves by what the check measured instead: up by the room a choice left under the budget,
        down by what one went over it (and `MARGIN`), no lower than the floor. Until a choice recomputes nothing,
        comes again, recomputes no less than one that fitted, or `SEARCH_CHECKS` were checked. The answer
        (`searched`) is the least recompute whose step fitted, its figure the one that step measured (where none
        fitted, the least peak measured, over the budget: the caller says nothing fits); the step after the last check
        runs it, unless that check was read as its step ended (`at_end`: `check_ended`) and is the answer: its step
        was the answer's."""
        self.search.tried.append((result, peak))
        budget = self.budget_bytes
        given = result.budget_bytes
        learned = self._learn(result)
        if peak <= budget:
            following = given + (budget - peak) if result.recompute_seconds > 0 else None
        else:
            following = max(given - (peak - budget) - int(MARGIN * budget), result.floor.peak_bytes)
        checked = {f.config() for f, _ in self.search.tried}
        # the least recompute a check measured within the budget: a choice that recomputes no less is not checked (a
        # corrected solve, counting bytes in rounded units, may return one: at 8B it returned 153.3 ms of recompute
        # where the check it learned from, 153.0 ms, fitted by its corrected figure too)
        fitted = min((f.recompute_seconds for f, p in self.search.tried if p <= budget), default=None)
        candidate = None
        if len(self.search.tried) < SEARCH_CHECKS and (peak > budget or result.recompute_seconds > 0):
            if learned:  # solved for the budget itself with what the checks read: a choice checked is the answer
                candidate = self._fit(step, budget, self.search.corrections)
            if (candidate is None or candidate.choice is None) and following is not None and following != given:
                candidate = self._fit(step, following)  # nothing read, or nothing fits so corrected: the budget moved
        if candidate is not None and fitted is not None and candidate.recompute_seconds >= fitted:
            candidate = None  # no less recompute than a choice that fitted: that one is the answer
        if candidate is not None:
            if candidate.choice is not None and candidate.config() not in checked:
                self.choices.fits.append(candidate)
                self._write()
                self._run(candidate)
                if not at_end:  # read as the next step starts: it is that step's
                    self._next_check_starts()
                return  # checked by the next step, as the first choice was
        within = [(f, p) for f, p in self.search.tried if p <= budget]
        if within:
            best, measured = min(within, key=lambda fp: (fp[0].recompute_seconds, fp[1]))
        else:
            best, measured = min(self.search.tried, key=lambda fp: fp[1])
        answer_at = next(k for k, (f, _) in enumerate(self.search.tried) if f is best)
        where = self.search.peaked_where(answer_at) or best.predicted.where
        self.search.searched = replace(best, predicted=Prediction(measured, where))
        if at_end and best is self.search.tried[-1][0]:  # the step just read ran it: the dry run ends there
            self._finish()
            return
        self._run(best)
        if at_end:
            self.search.finish_next = True  # the next step runs it, and is the dry run's last
            self.search.answer_at = answer_at
        else:
            self._finish()

    def end_at_earlier_check(self) -> Optional[int]:
        """Where a dry run's search found its answer in an earlier check than the last (`Search.finish_next`): the
        search ends without a step running it again, its figure that check's step's (a dry run's steps are exact and
        the same each time a choice runs); the check's place in the order made (0: the first). None, and nothing
        changed, where the search has not ended so."""
        search = self.search
        if search is None or not search.finish_next or search.answer_at is None:
            return None
        search.finish_next = search.decided = False
        self.choices.pending = None  # no step runs it here
        self._finish()
        return search.answer_at

    def _learn(self, result: Fit) -> bool:
        """What the check just read beyond `result`'s prediction, segment by segment (`Corrections.learn`), from its
        step's watch (`_check_watch`); whether it was read (a step whose marks came out of order is not, nor one of
        several processes': the solver's segments are then every process's, the watch's this one's)."""
        watch = self.search.watch
        memory = watch.memory if watch is not None else None
        several = self.reading.ranks is not None and self.reading.ranks.size > 1
        if memory is None or not result.choice or self.step_one is None or several:
            return False
        one = self.step_one
        freed = [c.freed_bytes for c in result.choice]
        predicted = segment_peaks(one.solved, one.freed, freed, result.returned, result.levers)
        self.search.corrections.learn(predicted, memory, result.choice, result.levers)
        return True

    def _finish(self) -> None:
        self._write()
        self.stage = Stage.DONE
        self.reading.meter.close()

    def summary(self) -> Optional[dict]:
        """The last choice and its check (`Backend.auto_choice`); None before one was made."""
        if not self.choices.fits or self.choices.fits[-1].choice is None:
            return None
        fits, verified = self.choices.fits, self.choices.verified
        last = self.searched or fits[-1]  # a dry run's search: its answer, measured by the step that checked it
        if self.searched is not None:
            measured = self.searched.predicted.peak_mb
        else:
            measured = verified[-1]["measured_peak_mb"] if len(verified) == len(fits) else None
        return {
            "config": last.config(),
            "predicted_peak_mb": last.predicted.peak_mb,
            "recompute_ms": last.recompute_seconds * 1000,
            "measured_peak_mb": measured,
            "choices": len(self.choices.fits),
            # the dry run's figure for the choice step one ran, said before it (None: step one measured instead)
            "dry_run_peak_mb": self.choices.planned.predicted.peak_mb if self.choices.planned is not None else None,
            "checks": [  # every choice with its check, in order (a re-plan after a miss)
                {
                    "config": f.config(),
                    "predicted_peak_mb": f.predicted.peak_mb,
                    "measured_peak_mb": v["measured_peak_mb"],
                }
                for f, v in zip(self.choices.fits, self.choices.verified)
                if f.predicted is not None
            ],
        }

    def solver_data(self) -> dict:
        """The solver's figures: what `memory_auto/solver.json` holds (and the step-memory picture draws)."""
        one = self.step_one
        return {
            "budget_mb": self.budget_mb,
            "activation_memory_budget": self.ask.share,
            "processes": self.reading.ranks.size if self.reading.ranks is not None else 1,
            # the rank that chose for all of them (`StepOne.chooser`): the fits are its solves; the step one, its
            # freed bytes and the candidates below are this process's own (rank 0's), as it measured them
            "chosen_on_rank": one.chooser if one is not None else 0,
            "memory": None
            if self.memory is None
            else {
                "device": self.memory.device,
                "how": self.memory.how,
                "start_mb": self.memory.start_bytes / MIB,
                "segments": [
                    {
                        "name": s.name,
                        "place": s.place.as_dict(),
                        "layers_held": s.held,
                        "start_mb": s.start_bytes / MIB,
                        "peak_mb": s.peak_bytes / MIB,
                    }
                    for s in self.memory.segments
                ],
            },
            "layer_lists": one.layer_lists if one is not None else [],
            "later_steps_hold_more_mb": (one.extra if one is not None else 0) / MIB,
            "step_one_freed_mb": [q / MIB for q in (one.freed if one is not None else [])],  # per layer, its policy
            "candidates": [
                [{"config": c.label, "freed_mb": c.freed_bytes / MIB, "recompute_ms": c.seconds * 1000} for c in opts]
                for opts in self.per_layer
            ],
            "lever_candidates": {
                name: [{"config": c.label, "freed_mb": c.less_mb(), "recompute_ms": c.cost * 1000} for c in options]
                for name, options in self.levers.items()
            },
            "fits": [f.as_dict() for f in self.choices.fits],
            "verified": self.choices.verified,
            "batch": list(self.planned_shape) if self.planned_shape is not None else None,
            # the choices for shorter batches this run planned for before (`batch_arrives`), in order
            "earlier_batches": self.earlier,
        }

    def _write(self) -> None:
        if not self.out_dir:
            return
        data = self.solver_data()
        path = os.path.join(self.out_dir, "solver.json")

        def write(tmp):
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=2)

        try:
            os.makedirs(self.out_dir, exist_ok=True)
            atomic_write(path, write)
        except OSError as e:  # a report must never cost the run
            logger.error("could not write %s (%s); training goes on without it", path, e)


def _meta_batch(args, kwargs) -> tuple:
    """(args, kwargs, whether the attention mask attends to every token) of a forward, its tensors copied onto the
    meta device (`from_plan.copied_batch`), the mask read here where it is real."""
    from .from_plan import attends_all, copied_batch

    return (*copied_batch(args, kwargs, "meta"), attends_all(kwargs))


def batch_shape(args, kwargs) -> Optional[tuple]:
    """(batch, tokens) of a forward's inputs: `input_ids`, `inputs_embeds`, or its first tensor argument of two or more
    dimensions; None where none is given."""
    import torch

    for name in ("input_ids", "inputs_embeds"):
        t = kwargs.get(name)
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return tuple(t.shape[:2])
    for t in args:
        if isinstance(t, torch.Tensor) and t.dim() >= 2:
            return tuple(t.shape[:2])
    return None
