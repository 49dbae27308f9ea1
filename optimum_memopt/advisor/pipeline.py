"""One pipeline for every piece of advice: probe -> choose under a budget -> verify -> batch search -> report.

`--memory_opt_config auto`, `memopt-probe` and the benchmark all call `advise` and write its one report
schema (`Advice.to_dict`) with `write_reports`.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from .measure import WARMUP_STEPS, Runner, memory_flags, run_child
from .probe import ProbeReport, format_table, plot, probe
from .select import Choice, NoFit, choose, max_batch_size, solve, verify

SCHEMA = "optimum-memopt/advice/1"


@dataclass
class BatchSearch:
    label: str
    flags: List[str]
    batch_size: Optional[int]
    samples_per_s: Optional[float]


@dataclass
class Advice:
    probe: ProbeReport
    budget_mb: Optional[float] = None
    choice: Optional[Choice] = None
    no_fit: Optional[str] = None  # why nothing fits the budget
    batch_search: List[BatchSearch] = field(default_factory=list)

    def to_dict(self) -> dict:
        c = self.choice
        return {
            "schema": SCHEMA,
            "probe": self.probe.as_dict(),
            "budget_mb": self.budget_mb,
            "choice": None
            if c is None
            else {
                "config": c.config,
                "level": c.level,
                "reason": c.reason,
                "estimated_peak_mb": c.estimated_peak_mb,
                "verified_peak_mb": c.verified.peak_mb if c.verified else None,
            },
            "no_fit": self.no_fit,
            "max_batch_size": [
                {"label": b.label, "flags": b.flags, "batch_size": b.batch_size, "samples_per_s": b.samples_per_s}
                for b in self.batch_search
            ],
        }

    def markdown(self) -> str:
        r = self.probe
        ranking = r.ranked_plans()
        md = [
            "# Memory-optimizer probe",
            "",
            f"Script: `{' '.join(r.script_argv)}`  ",
            f"Device: {r.device}, batch size {r.batch_size}, {r.steps} steps per configuration (median step time "
            f"after {WARMUP_STEPS} warm-up steps).",
            "",
            "Peak: CUDA max allocated; on CPU the process's tensor storages (the modern stack: the unit CUDA counts "
            "in, weights included), or with ORT the allocator's bytes in use (mallinfo2) above their level before "
            "training, with the resident peak beside it. Savings and extra time are against "
            f"{r.label} without recompute. "
            "The predicted saving is the backend's, for the first batch's shapes. An extra time at or below zero is "
            "within the step-to-step noise of this machine: no cost measured.",
            "",
            format_table(r, markdown=True),
            "",
            "Ranking (most memory saved per second of extra step time first): "
            + (", ".join(f"`{x.config}`" for x in ranking) if ranking else "no plan saved measurable memory."),
        ]
        if self.budget_mb is not None:
            md += [
                "",
                f"## Under {self.budget_mb:,.1f} MiB",
                "",
                self.choice.describe() if self.choice else (self.no_fit or ""),
            ]
        if self.batch_search:
            md += [
                "",
                "## Largest batch size under the budget",
                "",
                "| config | batch size | samples/s |",
                "|---|---|---|",
            ]
            md += [
                f"| {b.label} | {b.batch_size or '-'} | "
                f"{'-' if b.samples_per_s is None else f'{b.samples_per_s:.1f}'} |"
                for b in self.batch_search
            ]
        return "\n".join(md) + "\n"


def advise(
    script_argv: Sequence[str],
    batch_size: int,
    budget_mb: Optional[float] = None,
    steps: int = 6,
    max_plans: int = 6,
    levels: Optional[Sequence[int]] = None,
    include_pytorch: bool = False,
    search_batch_size: bool = False,
    timeout: float = 1800,
    progress: Callable[[str], None] = print,
    runner: Runner = run_child,
    budget_flag: str = "--memory_budget_mb",
) -> Advice:
    report = probe(
        script_argv,
        batch_size,
        steps=steps,
        max_plans=max_plans,
        levels=levels,
        include_pytorch=include_pytorch,
        progress=progress,
        timeout=timeout,
        runner=runner,
    )
    advice = Advice(report, budget_mb)
    if budget_mb is None:
        return advice
    try:
        if report.backend == "torch":  # the budget solver, from one measured step
            advice.choice = solve(report, budget_mb, steps, progress, timeout, runner, budget_flag)
        else:
            advice.choice = verify(
                report,
                choose(report, budget_mb, budget_flag),
                budget_mb,
                steps,
                progress=progress,
                timeout=timeout,
                runner=runner,
            )
    except NoFit as e:
        advice.no_fit = str(e)
        return advice
    if search_batch_size:
        c = advice.choice
        what = f"level {c.level}" if c.level else (c.config or "no recompute")
        name = report.label
        searches = [(f"{name}, no recompute", memory_flags(True)), (f"{name}, {what}", c.flags)]
        if report.backend == "torch":  # the solver chooses again at each batch size
            auto = memory_flags(True, config="auto", extra=["--memory_budget_mb", f"{budget_mb:.3f}"])
            searches[1] = (f"{name}, the solver's choice at each batch (auto)", auto)
        for label, flags in searches:
            best, tried = max_batch_size(
                script_argv,
                flags,
                budget_mb,
                batch_size,
                steps=max(3, steps - 2),
                progress=progress,
                timeout=timeout,
                runner=runner,
            )
            sps = tried[best].samples_per_s if best else None
            advice.batch_search.append(BatchSearch(label, list(flags), best, sps))
    return advice


def write_reports(advice: Advice, out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, n) for n in ("probe.json", "probe.md", "probe.png")]
    with open(paths[0], "w") as f:
        json.dump(advice.to_dict(), f, indent=2)
    with open(paths[1], "w") as f:
        f.write(advice.markdown())
    plot(advice.probe, paths[2])
    return paths
