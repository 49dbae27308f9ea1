"""Choosing plans under a memory budget from the probe's measurements, then checking the choice."""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from ..plans import parse_inline as parse_entries
from .measure import Measurement, Runner, memory_flags, run_child
from .probe import ProbeReport


@dataclass
class Choice:
    config: str  # inline plans ("" = none)
    level: int
    reason: str
    estimated_peak_mb: Optional[float]
    verified: Optional[Measurement] = None
    considered: List[str] = field(default_factory=list)

    @property
    def flags(self) -> List[str]:
        return memory_flags(True, config=self.config, level=self.level)

    def describe(self) -> str:
        what = f"level {self.level}" if self.level else (f"plans {self.config}" if self.config else "no recompute")
        return f"{what}: {self.reason}"


class NoFit(ValueError):
    pass


def choose(report: ProbeReport, budget_mb: float, budget_flag: str = "--memory_budget_mb") -> Choice:
    """The cheapest configuration whose measured (or, for plan sets, estimated) peak fits the budget.

    Plans are added in the probe's ranking order (most memory saved per second of extra step time
    first); a set's saving is estimated as the sum of its plans' measured savings, which `verify`
    then checks with a real run. Levels 1 and 2 are the fallback when no plan set reaches the budget.
    """
    base = report.baseline
    if base is None or not base.measurement.ok:
        raise NoFit("the probe's baseline run failed; nothing to choose from")
    base_peak = base.measurement.peak_mb
    if base_peak <= budget_mb:
        return Choice(
            "",
            0,
            f"{report.label} without recompute already fits: peak {base_peak:,.1f} MiB <= budget {budget_mb:,.1f} MiB",
            base_peak,
        )
    need = base_peak - budget_mb
    chosen, saved, considered = [], 0.0, []
    subgraphs = set()
    for row in report.ranked_plans():
        entries = parse_entries(row.config)
        if any(e.subgraph in subgraphs for e in entries):
            continue
        considered.append(row.config)
        chosen.append(row)
        subgraphs.update(e.subgraph for e in entries)
        saved += row.measured_saving_mb
        if saved >= need:
            # Greedy by MiB per second overshoots: a cheap plan taken early can become unnecessary once a large
            # one is added. Drop plans, the costliest first, while the rest still save what is needed.
            dropped = []
            for row in sorted(chosen, key=lambda r: -max(r.extra_time_s or 0.0, 0.0)):
                if saved - row.measured_saving_mb >= need and max(row.extra_time_s or 0.0, 0.0) > 0:
                    chosen.remove(row)
                    dropped.append(row.config)
                    saved -= row.measured_saving_mb
            extra = sum(max(r.extra_time_s or 0.0, 0.0) for r in chosen)
            config = ",".join(r.config for r in chosen)
            note = f"; {', '.join(dropped)} dropped again: the others save enough without it" if dropped else ""
            return Choice(
                config,
                0,
                (
                    f"needs {need:,.1f} MiB below {report.label}'s {base_peak:,.1f} MiB; these {len(chosen)} plan(s) "
                    f"saved {saved:,.1f} MiB measured one by one, for about {extra:.3f} s more per step, "
                    f"the least extra time per MiB among the plans probed{note}"
                ),
                base_peak - saved,
                considered=considered,
            )
    levels = sorted(
        (r for r in report.rows if r.kind == "level" and r.measurement.ok),
        key=lambda r: r.measurement.step_time_s or 0.0,
    )
    for row in levels:
        if row.measurement.peak_mb <= budget_mb:
            return Choice(
                "",
                row.level,
                (
                    f"the probed plans together save {saved:,.1f} MiB, short of the {need:,.1f} MiB "
                    f"needed; level {row.level} measured {row.measurement.peak_mb:,.1f} MiB"
                ),
                row.measurement.peak_mb,
                considered=considered,
            )
    best = min([r.measurement.peak_mb for r in report.rows if r.measurement.ok])
    raise NoFit(
        f"no probed configuration fits {budget_mb:,.1f} MiB: the lowest measured peak is {best:,.1f} MiB "
        f"({report.label} without recompute: {base_peak:,.1f} MiB); lower the batch size or raise `{budget_flag}`"
    )


def solve(
    report: ProbeReport,
    budget_mb: float,
    steps: int,
    progress: Callable[[str], None] = print,
    timeout: float = 1800,
    runner: Runner = run_child,
    budget_flag: str = "--memory_budget_mb",
) -> Choice:
    """The torch backend's choice: its budget solver, in one run of the script (`--memory_opt_config auto`: step one
    measured, then per layer the least recompute whose predicted peak fits), checked in a fresh run of the plans as
    a user would pass them. A check over the budget solves once more for the budget lowered by the miss (as `auto`
    does in the training process); levels the probe measured under the budget are the last resort."""
    base = report.baseline
    if base is None or not base.measurement.ok:
        raise NoFit("the probe's baseline run failed; nothing to choose from")
    if base.measurement.peak_mb <= budget_mb:
        return choose(report, budget_mb, budget_flag)  # nothing to recompute: said as for any backend
    target, misses = budget_mb, []
    for _ in range(2):
        progress(f"[auto] the budget solver under {target:,.1f} MiB at batch {report.batch_size} ...")
        flags = memory_flags(True, config="auto", extra=["--memory_budget_mb", f"{target:.3f}"])
        m = runner(report.script_argv, "solver", flags, report.batch_size, steps=steps, timeout=timeout)
        if not m.ok or not m.auto:
            why = m.error if not m.ok else "the run trained without choosing (no step after the first)"
            raise NoFit(f"the budget solver's run under {target:,.1f} MiB stopped: {why}")
        config = m.auto["config"]
        progress(f"[auto] verifying the solver's choice {config or '(nothing to recompute)'} in a fresh run ...")
        check = runner(
            report.script_argv, config, memory_flags(True, config=config), report.batch_size, steps, timeout=timeout
        )
        if not check.ok:
            raise NoFit(f"the solver's choice {config} failed when run as given: {check.error}")
        misses.append(f"{config or 'nothing'} measured {check.peak_mb:,.1f} MiB")
        if check.peak_mb <= budget_mb:
            note = f" (after {misses[0]}: solved again for {target:,.1f} MiB)" if len(misses) > 1 else ""
            return Choice(
                config,
                0,
                f"the budget solver chose it from one measured step{note}: predicted peak "
                f"{m.auto['predicted_peak_mb']:,.1f} MiB, {m.auto['recompute_ms']:,.1f} ms of recompute per step "
                f"(op time measured in step one); verified in a fresh run: peak {check.peak_mb:,.1f} MiB <= "
                f"{budget_mb:,.1f} MiB",
                m.auto["predicted_peak_mb"],
                check,
                considered=[config],
            )
        target -= check.peak_mb - budget_mb
    level = _measured_level(
        report, budget_mb, f"the solver's choices missed the budget when run ({'; '.join(misses)})"
    )
    if level is not None:
        return level
    raise NoFit(
        f"the solver's choices missed {budget_mb:,.1f} MiB when run ({'; '.join(misses)}), and no level fits; "
        f"lower the batch size or raise `{budget_flag}`"
    )


def verify(
    report: ProbeReport,
    choice: Choice,
    budget_mb: float,
    steps: int,
    progress: Callable[[str], None] = print,
    timeout: float = 1800,
    runner: Runner = run_child,
) -> Choice:
    """Measure the chosen combination; if it misses the budget, add the next ranked plans, then try the levels."""
    if not choice.config:
        return choice
    ranked = [r.config for r in report.ranked_plans()]
    config = choice.config
    while True:
        progress(f"[auto] verifying {config} at batch {report.batch_size} ...")
        m = runner(
            report.script_argv,
            config,
            memory_flags(True, config=config),
            report.batch_size,
            steps=steps,
            timeout=timeout,
        )
        if m.ok and m.peak_mb <= budget_mb:
            if config != choice.config:
                added = config[len(choice.config) + 1 :]
                choice.reason += (
                    f"; measured together they missed the budget, so the next ranked plan(s) {added} were added"
                )
            choice.config, choice.verified = config, m
            choice.reason += f"; verified together: peak {m.peak_mb:,.1f} MiB <= {budget_mb:,.1f} MiB"
            return choice
        used = {e.subgraph for e in parse_entries(config)}
        nxt = next((c for c in ranked if not ({e.subgraph for e in parse_entries(c)} & used)), None)
        if nxt is None:
            break
        config = f"{config},{nxt}"
    level = _measured_level(report, budget_mb, "the plan sets missed the budget when measured together")
    if level is not None:
        return level
    raise NoFit(f"the chosen plans measured above {budget_mb:,.1f} MiB together, and no level fits either")


def _measured_level(report: ProbeReport, budget_mb: float, why: str) -> Optional[Choice]:
    """The lowest level the probe measured under the budget, as the last resort after `why`; None if none fits."""
    for row in sorted((r for r in report.rows if r.kind == "level" and r.measurement.ok), key=lambda r: r.level):
        if row.measurement.peak_mb <= budget_mb:
            return Choice(
                "",
                row.level,
                f"{why}; level {row.level} measured {row.measurement.peak_mb:,.1f} MiB",
                row.measurement.peak_mb,
                row.measurement,
            )
    return None


def max_batch_size(
    script_argv: Sequence[str],
    flags: Sequence[str],
    budget_mb: float,
    start: int,
    steps: int = 4,
    limit: int = 4096,
    progress: Callable[[str], None] = print,
    timeout: float = 1800,
    runner: Runner = run_child,
):
    """The largest batch size whose run succeeds with its peak under the budget.

    Doubles from ``start`` until a run misses the budget (or fails: out of memory), then bisects.
    Returns (best batch size or None, measurements by batch size).
    """
    tried = {}

    def fits(b):
        progress(f"[batch search] batch {b} ...")
        m = runner(script_argv, f"batch {b}", flags, b, steps=steps, timeout=timeout)
        tried[b] = m
        ok = m.ok and m.peak_mb <= budget_mb
        progress(
            f"[batch search] batch {b}: "
            + (
                f"peak {m.peak_mb:,.1f} MiB, {'fits' if ok else 'over budget'}"
                if m.ok
                else f"failed ({'out of memory' if m.oom else m.error})"
            )
        )
        return ok

    lo, hi = None, None
    b = max(1, start)
    while b <= limit:
        if fits(b):
            lo = b
            b *= 2
        else:
            hi = b
            break
    if lo is None:
        b = start // 2
        while b >= 1 and lo is None:
            if fits(b):
                lo = b
            else:
                hi = b
                b //= 2
        if lo is None:
            return None, tried
    if hi is None:
        return lo, tried
    while hi - lo > max(1, lo // 8):  # to within 1/8 of the answer: each trial is a whole run
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried
