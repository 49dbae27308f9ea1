"""The public call for a training loop of one's own (accelerate, Lightning, plain PyTorch): the torch backend on a
model, without the `Trainer`.

    import optimum_memopt

    memopt = optimum_memopt.optimize_memory(model, "auto", budget_mb=20000)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(memopt.table())  # the plan table of the first step
    memopt.picture("step_memory.png")  # auto: where the step's memory goes, the budget, the choice
    memopt.config          # the plans running now (auto: the solver's choice, from step two)
    memopt.remove()        # the model trains plainly again

The Trainer's hook (`optimum_memopt.trainer`) wraps through the same `attach`.

Steps: the first step is profiled, and `auto` chooses at the second step's start and checks its choice's peak at the
third's. By default each backward ends a step (the next training forward starts the next one): right for one
micro-batch per optimizer step. A loop that accumulates gradients over several forwards passes `reports_steps=True`
and calls `memopt.step_done()` after each optimizer step; steps then end there only.
"""

import re
from typing import Optional, Union

from torch import nn

from .backends.base import Backend, Budget, WrapSettings
from .config import BUDGET_FLAG, CONFIG_FLAG, HOST_FLAG, LEVEL_FLAG, SHARE_FLAG, MemoryOptConfig, check_host_mb
from .plans import PlanReport

# the flags' names in messages built for the command line, and the keyword each is here
_KEYWORDS = {
    CONFIG_FLAG: "plans",
    LEVEL_FLAG: "level",
    BUDGET_FLAG: "budget_mb",
    SHARE_FLAG: "activation_budget",
    HOST_FLAG: "host_memory_mb",
}


class MemoptHandle:
    """A model under a memory backend (`optimize_memory`, or the Trainer's hook): what it found and runs."""

    def __init__(self, backend: Backend, model: nn.Module, settings: WrapSettings, config: MemoryOptConfig):
        self.backend = backend
        self.model = model  # what the backend wrapped (the model itself, for the torch backend)
        self.settings = settings
        self.asked = config  # what was asked, validated
        self._removed = False
        self._wrapped = getattr(model, "_memopt_recompute", None)  # the torch backend's state this wrap installed

    @property
    def config(self) -> Optional[str]:
        """The plans running now, in `--memory_opt_config`'s grammar (`''`: nothing recomputed); with `auto`, None
        until the solver has chosen (at the second step's start)."""
        if self.asked.auto:
            choice = self.auto
            return None if choice is None else choice["config"]
        if self.asked.level:
            return f"level {self.asked.level}"
        return self.asked.summary() if self.asked.entries else ""

    @property
    def auto(self) -> Optional[dict]:
        """`auto`'s last choice and its check (config, predicted and measured peak, recompute time), or None."""
        return self.backend.auto_choice(self.model) if self.asked.auto else None

    @property
    def _state(self):
        state = getattr(self.model, "_memopt_recompute", None)
        if state is None:
            why = "it was removed" if self._removed else f"{self.backend.title} keeps no such state"
            raise RuntimeError(f"optimum-memopt: the model holds no torch backend's state ({why})")
        return state

    @property
    def layers(self) -> list:
        """The transformer layers the backend runs (each module once)."""
        return list(self._state.layers)

    @property
    def policy(self):
        """What each layer runs now (torch backend): `policy.layers[i].mode` ('keep', 'ops' or 'layer') and `.ops`,
        the plan names recomputed there."""
        return self._state.policy

    @property
    def profile(self):
        """What the first training step measured (torch backend), None before it: per layer, the bytes kept for
        backward by plan and the op times (`profile.layers`), and the step's memory by segment (`profile.memory`)."""
        return self._state.profile

    @property
    def planner(self):
        """`auto`'s planner in this process (torch backend): `fits` (each choice: `config()`, `predicted`, `floor`,
        `levers`), `verified` (each check's measured and predicted peaks), `per_layer` and `levers` (the candidates);
        None without `auto`."""
        return self._state.planner

    @property
    def levers(self) -> dict:
        """The levers beyond the layers on this model (torch backend), by name (`levers/`; each `option`, `plan()`):
        `"loss"`, the head and loss (`chunking`, `installed`, `calls`, `last`: how the last training forward ran
        it)."""
        return dict(self._state.levers)

    def solver_figures(self) -> Optional[dict]:
        """`auto`'s figures, as `solver.json` holds them (step one by segment, every choice with its prediction, every
        check), or None where `auto` did not run or has not measured step one yet."""
        planner = getattr(self._state, "planner", None)
        return planner.solver_data() if planner is not None and planner.memory is not None else None

    def report(self) -> Optional[PlanReport]:
        """The plan table's data once the first training step ran (None before)."""
        return self.backend.plan_report(self.model, self.settings)

    def table(self) -> str:
        """The plan table as the Trainer logs it, or why there is none yet."""
        from .callbacks.plan_stats import format_plan_table

        report = self.report()
        if report is None:
            return "memory plans: no training step has run through the model yet"
        return format_plan_table(report)

    def picture(self, path: str):
        """Draw the step's memory as `auto` saw it (step one by layer mark, the budget, the peak predicted with the
        choice and the one measured after it, the plans per layer) to a PNG at `path`; the matplotlib figure."""
        from .callbacks.step_memory import draw_step_memory

        planner = getattr(getattr(self.model, "_memopt_recompute", None), "planner", None)
        if planner is None or planner.memory is None or not planner.fits:
            raise RuntimeError(
                "optimum-memopt: the step-memory picture is drawn from `auto`'s choice, which needs "
                "optimize_memory(model, 'auto', budget_mb=...) and two training steps"
            )
        return draw_step_memory(planner.solver_data(), path)

    def step_done(self) -> None:
        """Say an optimizer step ended (with `reports_steps=True`: where several forwards make one step)."""
        try:
            self.backend.step_done(self.model)
        except (RuntimeError, ValueError) as e:
            if type(e) not in (RuntimeError, ValueError):
                raise
            raise type(e)(_as_keywords(str(e))) from None

    def remove(self) -> nn.Module:
        """Take the backend off: the model trains plainly from its next forward. Returns the model. A handle whose
        wrap a later one replaced (a second `optimize_memory` or Trainer on the model took this one's off already)
        leaves the later wrap on."""
        if not self._removed:
            self._removed = True
            if getattr(self.model, "_memopt_recompute", None) is self._wrapped:
                self.model = self.backend.unwrap(self.model)
        return self.model

    def __enter__(self) -> "MemoptHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attach(backend: Backend, model: nn.Module, settings: WrapSettings, config: MemoryOptConfig) -> MemoptHandle:
    """Wrap `model` with `backend` under validated `settings`: the one path of `optimize_memory` and the Trainer."""
    return MemoptHandle(backend, backend.wrap(model, settings), settings, config)


def optimize_memory(
    model: nn.Module,
    plans: Union[str, None] = None,
    *,
    level: int = 0,
    budget_mb: Optional[float] = None,
    activation_budget: Optional[float] = None,
    output_dir: Optional[str] = None,
    reports_steps: bool = False,
    say=None,
    host_memory_mb: Optional[float] = None,
) -> MemoptHandle:
    """Recompute activations of `model`'s transformer layers in backward instead of keeping them (torch backend).

    Args:
        plans: plans in `--memory_opt_config`'s grammar (`"MatMul+Mul+silu+:1:-1"`, `"Layer+:1:-1@every2"`), or
            `"auto"` with `budget_mb` or `activation_budget`: the least recompute whose peak fits, chosen from the
            first step.
        level: 1 recomputes every layer whole (instead of plans).
        budget_mb: with `"auto"`, the peak to fit under (MiB of the device's tensors: CUDA's counter, or on the CPU
            the process's tensor storages counted as CUDA counts them, weights included).
        activation_budget: with `"auto"`, instead: the share (0 to 1) of the layers' activations to keep.
        output_dir: with `"auto"`, where the solver writes `solver.json` (rank 0).
        reports_steps: the loop calls `step_done()` after each optimizer step (needed where several forwards make
            one step: gradient accumulation); by default each backward ends a step.
        say: where `auto`'s choice and its check are said, a line each (rank 0); default: printed. The figures
            behind the choice, in words, go to the `optimum_memopt` logger at DEBUG.
        host_memory_mb: with `"auto"` and `budget_mb`, the host memory (MiB) the layers' offloaded tensors may hold
            (`Offload+`); default: what the host has available when step one ends.

    Returns the handle: `table()`, `report()`, `config`, `auto`, `step_done()`, `remove()` (also a context manager
    that removes it). Errors name the argument, quote the value and show an accepted form.
    """
    from .backends import get_backend
    from .backends.torch.policy import check_requests
    from .backends.torch.ranks import Ranks
    from .callbacks.base import logger, show

    try:
        config = MemoryOptConfig(
            plans=plans, level=level, backend="torch", budget_mb=budget_mb, activation_budget=activation_budget
        )
        check_requests(config.enabled_entries)
        check_host_mb(host_memory_mb, config)
    except ValueError as e:
        raise ValueError(_as_keywords(str(e))) from None
    backend = get_backend("torch")
    problem = backend.problem()
    if problem is not None:
        raise RuntimeError(f"optimum-memopt: {problem}")
    rank0 = Ranks().rank == 0
    budget = None
    if config.auto:
        budget = Budget(
            budget_mb=None if budget_mb is None else float(budget_mb),
            share=activation_budget,
            say=(say or (lambda text: show(_as_keywords(text)))) if rank0 else (lambda text: None),
            detail=(lambda text: logger.debug("%s", _as_keywords(text))) if rank0 else (lambda text: None),
            words=_as_keywords,
            report_dir=output_dir if rank0 else None,
            host_mb=None if host_memory_mb is None else float(host_memory_mb),
        )
    # `auto`'s step one runs every layer recomputed whole, as the Trainer's does: the least memory any choice needs
    level = 1 if config.auto else config.level
    settings = WrapSettings(
        entries=config.enabled_entries, level=level, budget=budget, steps_reported=bool(reports_steps)
    )
    try:
        return attach(backend, model, settings, config)
    except ValueError as e:
        raise ValueError(_as_keywords(str(e))) from None


def _as_keywords(message: str) -> str:
    """A message written for the command line with this call's keywords: `--memory_opt_config auto
    --memory_budget_mb 4000` reads `plans='auto', budget_mb=4000`; a span naming anything else is left as it is."""

    def span(match: re.Match) -> str:
        tokens = match.group(1).split()
        if not tokens or tokens[0] not in _KEYWORDS:
            return match.group(0)
        parts = []
        while tokens:
            flag = tokens.pop(0)
            if flag not in _KEYWORDS:
                return match.group(0)
            keyword = _KEYWORDS[flag]
            if not tokens or tokens[0] in _KEYWORDS:
                parts.append(keyword)
                continue
            value = tokens.pop(0)
            if len(value) > 1 and value[0] == value[-1] == "'":  # the shell's quotes around a plan
                value = value[1:-1]
            if tokens and tokens[0] not in _KEYWORDS:
                return match.group(0)
            parts.append(f"{keyword}={value!r}" if keyword == "plans" else f"{keyword}={value}")
        return "`" + ", ".join(parts) + "`"

    # the way out that is no backend: for a call, not calling it
    message = message.replace("train it with `--memory_opt_backend none`", "train it without `optimize_memory`")
    message = message.replace("pass `--memory_opt_backend none`", "leave `optimize_memory` out")
    # what a call changes instead of the Trainer's flags: the loop's own batch; and no dry run of a loop's step is
    # made (the Trainer's alone)
    message = message.replace("lower `--per_device_train_batch_size`", "lower the loop's batch size")
    message = message.replace(
        ". A dry run of step one weighs every way (`--memory_auto_dry_run true`, the default, where one can run); or "
        "give plans by hand",
        ". Or give plans by hand",
    )
    return re.sub(r"`([^`]*)`", span, message)
