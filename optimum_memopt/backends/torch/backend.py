"""`TorchBackend`: the seam's face of the torch backend. It imports the engine only when it wraps a model, so that
building the arguments (which asks backends to check their flags) loads no dispatch mode or hook machinery."""

import logging
import os
import weakref
from typing import List, Optional

from torch import nn

from ...memory import MIB
from ...plans import PlanError, PlanReport, to_inline
from ..base import Backend, WrapSettings, checkpointing_asked
from .apply.layers import STATE, checkpointed_elsewhere, distinct, find_layers, repeated, towers
from .needs import torch_problem
from .policy import LayerPolicy, RecomputePolicy, check_requests

logger = logging.getLogger(__name__)


def _true(value) -> bool:
    return str(value).lower() in ("true", "1")


def _fsdp_checkpointing(args) -> Optional[str]:
    """How FSDP's own activation checkpointing is on for this run (`fsdp_config` or accelerate's config), or None."""
    if getattr(args, "fsdp", None) and _true(
        (getattr(args, "fsdp_config", None) or {}).get("activation_checkpointing")
    ):
        return "`fsdp_config['activation_checkpointing']`"
    if _true(os.environ.get("ACCELERATE_USE_FSDP")) and _true(os.environ.get("FSDP_ACTIVATION_CHECKPOINTING")):
        return "`fsdp_activation_checkpointing: true` in accelerate's config ($FSDP_ACTIVATION_CHECKPOINTING)"
    return None


def _one_plan_per_module(model, layers, policy: RecomputePolicy, shared, settings: WrapSettings) -> RecomputePolicy:
    """The policy for a layer list that holds one module at several positions: one module runs one plan for all
    its uses, so the plans must give its positions the same one; it then counts as one layer (at its first
    position), said in the notes. Positions given different plans, and `auto` (which chooses per position), are
    refused with what works."""
    where = "; ".join(f"one {type(layers[p[0]]).__name__} at positions {', '.join(map(str, p))}" for p in shared)
    held = f"{type(model).__name__}'s layer list holds {where}"
    every = f"'Layer+:1:-1@{'+'.join(map(str, shared[0]))}'"
    if settings.budget is not None:
        raise ValueError(
            f"{held}: `--memory_opt_config auto` chooses per position, and one module runs one plan for all its "
            f"uses; pass `--memory_opt_level 1`, or one plan on every position of that module, as in {every}"
        )

    def same(p: LayerPolicy, q: LayerPolicy) -> bool:
        return (p.mode, p.ops) == (q.mode, q.ops)

    for positions in shared:
        first = policy.layers[positions[0]]
        other = next((i for i in positions if not same(policy.layers[i], first)), None)
        if other is not None:
            raise ValueError(
                f"`--memory_opt_config` {to_inline(settings.entries)!r} gives position {positions[0]} ({first.mode}) "
                f"and position {other} ({policy.layers[other].mode}) different plans, but {held}, which runs one "
                f"plan for all its uses; pass `--memory_opt_level 1`, or the same plan on every position of that "
                f"module, as in {every}"
            )
    firsts = [i for i, layer in enumerate(layers) if layers.index(layer) == i]
    note = (
        f"{held}: it runs as one layer (the table's layer {firsts.index(shared[0][0])}), its plan applied at each "
        f"of its {len(shared[0])} uses a step; the table's figures for it are one use's"
    )
    return RecomputePolicy([policy.layers[i] for i in firsts], policy.requests, [*policy.notes, note], policy.levers)


def _build_levers(model: nn.Module, settings: WrapSettings, policy: RecomputePolicy):
    """Every registered lever built on the model (`levers.protocol.Lever.build`): those the plans ask for (the
    policy's option for each), installed; those `auto` measures; and why each other one was not, by name, for the
    table's notes."""
    from .levers import lever_classes

    built, why_not = {}, {}
    for cls in lever_classes():
        lever, why = cls.build(model, settings, policy.levers.get(cls.name), len(policy.layers))
        if lever is not None:
            built[cls.name] = lever
        elif why:
            why_not[cls.name] = (cls.syntax.what, why)
    return built, why_not


class TorchBackend(Backend):
    name = "torch"
    title = "the torch backend"
    needs = "torch >= 2.5 (the modern stack)"
    plans_in_process = True

    def __init__(self):
        self._mine = weakref.WeakSet()  # the states this backend installed

    def problem(self) -> Optional[str]:
        return torch_problem()

    def check_args(self, args) -> List[str]:
        asked = checkpointing_asked(args)
        if asked:
            name, what = asked
            raise ValueError(
                f"{what} with the torch backend would recompute the same layers twice over; use the backend's "
                f"whole-layer recompute instead, as in `--memory_opt_level 1 --{name} false`, or pass "
                f"`--memory_opt_backend none` to keep transformers' checkpointing"
            )
        fsdp_ac = _fsdp_checkpointing(args)
        if fsdp_ac:
            raise ValueError(
                f"{fsdp_ac} with the torch backend would recompute the same layers twice over (FSDP wraps them in "
                f"torch's `checkpoint_wrapper`); turn it off and use the backend's whole-layer recompute instead, as "
                f"in `--memory_opt_level 1`, or pass `--memory_opt_backend none` to keep FSDP's checkpointing"
            )
        if args.torch_compile:
            raise ValueError(
                "`--torch_compile` with the torch backend: its recompute runs in Python hooks (a dispatch mode and "
                "saved-tensor hooks) that torch.compile would trace or break around; drop `--torch_compile`, or pass "
                "`--memory_opt_backend none` to compile plain PyTorch"
            )
        check_requests(args.memory_opt.enabled_entries)
        return []

    def wrap(self, model: nn.Module, settings: WrapSettings) -> nn.Module:
        from ._torch_api import compiled_by

        compiled = compiled_by(model)
        if compiled is not None:
            raise ValueError(
                f"the model given is {compiled}: the torch backend's recompute runs in Python hooks (a dispatch mode "
                f"and saved-tensor hooks) that torch.compile would trace or break around, and the compiled wrapper "
                f"hands every attribute the backend sets to the inner model; give the model before `torch.compile` "
                f"(`model._orig_mod`) to train with the plans, or pass `--memory_opt_backend none` to train the "
                f"compiled model without them"
            )
        layers = find_layers(model)
        if not layers:
            raise ValueError(
                f"the torch backend recomputes inside transformer layers, but found no list of repeated layers in "
                f"{type(model).__name__} (an nn.ModuleList or nn.Sequential of blocks); train it with "
                f"`--memory_opt_backend none`"
            )
        twice = checkpointed_elsewhere(model, layers)
        if twice is not None:
            raise ValueError(twice)
        try:
            policy = RecomputePolicy.from_plans(settings.entries, settings.level, len(layers))
        except PlanError as e:  # a layer selector naming a layer this model does not have
            raise ValueError(f"`--memory_opt_config` {e}") from None
        shared = repeated(layers)
        if shared:
            policy = _one_plan_per_module(model, layers, policy, shared, settings)
        for note in policy.notes:
            logger.warning("%s", note)
        twin, no_twin = None, None
        budget = settings.budget
        if budget is not None and budget.budget_mb is not None and not budget.dry_run:
            no_twin = "`--memory_auto_dry_run false`"  # said where a longer batch's step is measured again
        elif budget is not None and budget.budget_mb is not None and budget.dry_run and budget.no_dry_run:
            no_twin = budget.no_dry_run  # FSDP, DeepSpeed: the model copied here is not the one that trains
        elif budget is not None and budget.budget_mb is not None and budget.dry_run and budget.instruments is None:
            no_twin = "no dry run's instruments were handed to the backend (`Budget.instruments`)"
        elif budget is not None and budget.budget_mb is not None and budget.dry_run:
            from .decide.from_plan import NoTwin, twin_of
            from .levers import lever_classes

            # for `auto` to start from a dry run of step one (made before the backend's hooks are on the model); from
            # a plan file, for a dry run of a batch longer than the file's alone (its step one runs the file's choice)
            try:
                twin = twin_of(model)
                for cls in lever_classes():  # what the twin dropped with every forward set on an instance (TRL's head)
                    cls.onto_twin(model, twin)
            except NoTwin as e:  # said with the choice: step one then measures with every layer recomputed
                twin, no_twin = None, str(e)
            except Exception as e:
                no_twin = f"the model could not be copied onto the meta device for it ({type(e).__name__}: {e})"
        planner = None
        if settings.budget is not None:
            from .decide.planner import BudgetPlanner, Start

            b = settings.budget
            start = Start(
                b.plan_file,
                twin,
                b.instruments,
                no_twin,
                b.grad_accum,
                b.autocast,
                b.ddp,
                b.keep_plan,
                host_mb=b.host_mb,
            )
            planner = BudgetPlanner(
                None if b.budget_mb is None else int(b.budget_mb * MIB),
                share=b.share,
                say=b.say,
                detail=b.detail,
                words=b.words,
                out_dir=b.report_dir,
                grad_bytes=b.grad_bytes,
                resets=settings.reset_peaks,
                given_mb=b.budget_mb,
                start=start,
            )
        self._take_off(model)  # a model wrapped before, by this trainer or another, starts clean
        levers, lever_problems = _build_levers(model, settings, policy)
        state = self.apply_policy(
            model,
            policy,
            levers=levers,
            lever_problems=lever_problems,
            planner=planner,
            steps_reported=settings.steps_reported,
            reset_peaks=settings.reset_peaks,
        )
        for lever in levers.values():  # the stretches a lever acts in inside the layers, read apart
            for module, name in lever.marks():
                state.mark_inside(module, name)
        return model

    def on_optimizer_ready(self, optimizer, args, deepspeed: bool) -> Optional[str]:
        """The trainer's optimizer, for `auto`'s dry run of step one to train with one like it (not DeepSpeed's), or
        for what the process holds outside the step to leave its state out: held only where that dry run, or the
        start from a plan file, is still to come, and let go of once it has run (`BudgetPlanner.before_step_one`)."""
        if not deepspeed:
            for state in list(self._mine):
                start = state.planner.start if state.planner is not None else None
                if start is not None and (start.twin is not None or start.plan_file is not None):
                    state.planner.optimizer_ready(optimizer)
        return None

    def auto_choice(self, wrapped: nn.Module) -> Optional[dict]:
        planner = getattr(wrapped, STATE).planner
        return planner.summary() if planner is not None else None

    def auto_settled(self, wrapped: nn.Module) -> bool:
        planner = getattr(wrapped, STATE).planner
        return planner is None or planner.settled

    def step_done(self, wrapped: nn.Module) -> None:
        getattr(wrapped, STATE).step_done()

    def smooths_labels(self, wrapped: nn.Module) -> bool:
        return any(lever.smooths_labels() for lever in getattr(wrapped, STATE).levers.values())

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The model as it was before `wrap`: its layers' forwards and the step readings' hooks taken off, the state
        dropped (a budget planner's meter closed)."""
        self._take_off(wrapped)
        return wrapped

    def _take_off(self, model: nn.Module) -> None:
        """What a wrap of `model` installed, by this backend or another's, taken off (`RecomputeState.take_off`)."""
        from .apply.engine import RecomputeState

        previous = vars(model).pop(STATE, None)
        if isinstance(previous, RecomputeState):
            previous.take_off()
            self._mine.discard(previous)

    def apply_policy(self, model: nn.Module, policy: RecomputePolicy, **parts):
        """Install `policy` on the model's layers (a model wrapped before starts clean: every lever and meter the
        earlier wrap installed is taken off first); `parts`: the rest of the engine (`RecomputeState`'s keywords: the
        levers, the planner, how steps are reported). Returns the engine's state."""
        from .apply.engine import RecomputeState

        self._take_off(model)
        state = RecomputeState(distinct(find_layers(model)), policy, model, **parts)
        state.install()
        setattr(model, STATE, state)
        self._mine.add(state)
        return state

    def find(self, model) -> Optional[nn.Module]:
        """The model this backend wrapped, inside DDP / DeepSpeed wrappers; a model another trainer's backend
        wrapped is not this one's."""
        for _ in range(8):
            if model is None:
                return None
            state = getattr(model, "__dict__", {}).get(STATE)
            if state is not None and state in self._mine:
                return model
            model = getattr(model, "module", None)
        return None

    def describe(self, wrapped: nn.Module) -> str:
        state = getattr(wrapped, STATE)
        return (
            f"{type(wrapped).__name__} with the torch backend ({len(state.layers)} layers, {state.policy.describe()})"
        )

    def plan_report(self, wrapped: nn.Module, settings: WrapSettings) -> Optional[PlanReport]:
        from .decide.planner import Stage
        from .decide.report import plan_report

        state = getattr(wrapped, STATE)
        if state.profile is None:
            return None
        report = plan_report(state.policy, state.profile, list(state.levers.values()))
        lists = towers(wrapped, state.layers)
        if lists:
            report.notes.append("the layers come from several lists (numbered in this order): " + "; ".join(lists))
        for what, problem in state.lever_problems.values():
            report.notes.append(f"{what} were not measured each way they can run: {problem}")
        planner = state.planner
        if planner is not None and planner.stage in (Stage.START, Stage.MEASURE) and planner.planned is not None:
            report.auto = planner.asked
            report.auto_ran = planner.planned.config() or "nothing recomputed"
            plan_file = planner.start.plan_file
            if plan_file is not None:
                report.auto_ran_as = f"the choice of `--memory_plan_file {plan_file.path}`"
            ran = report.auto_ran_as if plan_file is not None else "the choice of a dry run of it"
            report.notes.append(
                f"--memory_opt_config auto ({planner.asked}): this first step ran {ran} "
                f"(`{report.auto_ran}`), measured to check it: kept where its own memory with what later steps hold "
                f"more fits, else the solver chooses again from it at the next step (said then)"
            )
        elif planner is not None and planner.stage in (Stage.START, Stage.MEASURE):
            running = [lever.plan() for lever in state.levers.values() if lever.plan()]
            head = f" and {', '.join(running)}" if running else ""
            report.auto = planner.asked
            report.notes.append(
                f"--memory_opt_config auto ({planner.asked}): this first step ran with every "
                f"layer recomputed whole{head}, to measure; the solver's choice runs from the next step (said then)"
            )
        return report
