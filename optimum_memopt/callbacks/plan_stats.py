"""`PlanStatsCallback`: the recompute plans the backend found, once, after the first training step.

On rank 0 only, from the backend's `PlanReport` (structured data, not log text):

* says in two lines what runs (the table's first line: the plans asked for, how many found and on) and where step
  one peaked, with the file that holds the rest;
* writes the table (state, config, frequency, occurrences applied, saving for the first batch, peak drop, recompute
  time, symbolic form) and its notes to `<output_dir>/memory_plans.txt`, and logs them at DEBUG (`--log_level
  debug`; `PlanLog`);
* warns about each requested plan that matches no plan found, naming the closest ones found;
* writes `<output_dir>/memory_plans.json` (the `PlanReport` as a dictionary);
* adds these metrics to the next training log:
  - `memopt/plans_found`: recompute plans found;
  - `memopt/plans_on`: plans applied in this run;
  - `memopt/planned_saving_mb`: the backend's predicted saving of the applied layer plans for the first batch
    (MiB: bytes the layers keep for backward), over the layers they were applied to (a plan on 1 of 2 layers
    counts that layer: measured per layer on the torch backend; on ORT, which reports one total per subgraph, that
    share of the total);
  - `memopt/available_saving_mb`: the predicted saving of all plans found (MiB);
  - `memopt/planned_head_saving_mb`: what the head and loss, run as the run runs them, hold less at their most than
    the model's own head (MiB; where the head's ways were measured, after step one under `Loss+` or `auto`): a
    transient peak's bytes, not bytes kept for backward, so never added to the two above.
"""

import json
import os
from typing import Optional

from ..plans import HEAD_LEVER, PlanReport, lever_syntax
from .base import MetricsCallback, PlanLog, atomic_write, current_model, logger, show, verbose


def _drop(plan) -> str:
    """The PEAK DROP cell: the bytes, and by how much it may be less (-N) or more (+N) where that is not exact."""
    if plan.peak_drop_bytes is None:
        return "?"
    value = plan.peak_drop_bytes
    least = value if plan.peak_drop_min_bytes is None else plan.peak_drop_min_bytes
    most = value if plan.peak_drop_max_bytes is None else plan.peak_drop_max_bytes
    bounds = [f"-{value - least:,.0f}"] if least < value else []
    bounds += [f"+{most - value:,.0f}"] if most > value else []
    return f"{value:,.0f}" + (f" ({' '.join(bounds)})" if bounds else "")


def format_plan_table(report: PlanReport) -> str:
    timed = any(p.recompute_seconds is not None for p in report.plans)
    dropped = any(p.peak_drop_bytes is not None for p in report.plans)
    rows = [("#", "STATE", "CONFIG", "FREQ", "APPLIED", "SAVING (B)", "SAVING SYMBOLIC (B)")]
    if dropped:  # the backend located the first step's peak: what each row would take off it
        rows[0] = rows[0][:6] + ("PEAK DROP (B)",) + rows[0][6:]
    if timed:  # the backend measured what each plan's recompute costs
        rows[0] = rows[0][: 6 + dropped] + ("RECOMPUTE (ms)",) + rows[0][6 + dropped :]
    for i, p in enumerate(report.plans, 1):
        saving = f"{p.saving_bytes:,.0f}" if p.saving_bytes is not None else "?"
        applied = "-" if p.applied_count is None else f"{p.applied_count}/{p.frequency}"
        row = (str(i), "ON" if p.enabled else "OFF", p.config, str(p.frequency), applied, saving, p.saving_symbolic)
        if dropped:
            row = row[:6] + (_drop(p),) + row[6:]
        if timed:
            cost = "-" if p.recompute_seconds is None else f"{p.recompute_seconds * 1000:,.1f}"
            row = row[: 6 + dropped] + (cost,) + row[6 + dropped :]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    dims = ", ".join(f"{k}={v}" for k, v in report.dims.items()) or "none"
    if report.auto and report.auto_ran:  # the first step ran a dry run's choice for `auto`, and checks it
        how = f"auto ({report.auto}), step one running {report.auto_ran_as} to check it"
    elif report.auto:  # the first step measured for `auto`, whose choice runs from the next step
        how = f"auto ({report.auto}), step one at level {report.level} to measure"
    elif report.level:  # the level's plans are every layer's; a lever's beyond the layers (`Loss+`) is named beside
        levers = [r for r in report.requested if lever_syntax(r.partition(":")[0])]
        how = ", ".join([f"level {report.level}"] + levers)
    else:
        how = ", ".join(report.requested) or "no plans requested"
    head = (
        f"Memory optimizer ({report.backend}) {'ON' if report.optimizer_enabled else 'OFF'}: {how}; "
        f"{len(report.plans)} recompute plan(s) found, {len(report.plans_on)} ON"
    )
    notes = [f"  note: {n}" for n in report.notes]
    if not report.plans:
        return "\n".join([head] + notes)
    how_known = "measured in" if report.backend == "torch" else "predicted for"
    return "\n".join([head] + lines + [f"Savings are {how_known} the first batch: {dims}"] + notes)


class PlanStatsCallback(MetricsCallback):
    def __init__(self, trainer=None):
        super().__init__()
        self.trainer = trainer
        self.report: Optional[PlanReport] = None
        self._done = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._done = False  # each `train()` gets its table (a second one on the same Trainer too)
        self.report = None
        self._log(args).start()

    def _log(self, args) -> PlanLog:
        log = getattr(self.trainer, "memopt_log", None)
        if log is None:  # a callback added by hand, without the trainer that owns the run's log
            log = self._own = getattr(self, "_own", None) or PlanLog(args.output_dir)
        return log

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._done or not state.is_world_process_zero:
            return
        self._done = True
        backend = getattr(self.trainer, "memopt_backend", None)
        wrapped = backend.find(current_model(self.trainer, model)) if backend is not None else None
        if wrapped is None:
            logger.info("memory plans: no memory-optimizer backend in use, no recompute plans to report")
            return
        report = backend.plan_report(wrapped, self.trainer.memopt_wrap_settings())
        if report is None:
            logger.warning("memory plans: the backend had no plan data after the first step; nothing to report")
            return
        self.report = report
        self.write_report(
            os.path.join(args.output_dir, "memory_plans.json"), lambda p: _dump_json(report.to_dict(), p)
        )
        table = format_plan_table(report)
        log = self._log(args)
        log.detail(table)  # the file, and the log where INFO is shown
        if not verbose():  # what runs, where step one peaked (this rank's step: rank 0's), and where the rest is
            peak = report.peak + (" (rank 0)" if report.peak and args.world_size > 1 else "")
            show(table.splitlines()[0] + "\n  " + "; ".join(filter(None, [peak, log.pointer()])))
        for unmatched in report.unmatched:
            who = "ORT" if report.backend == "ort" else f"the {report.backend} backend"
            logger.warning("%s", unmatched.message(backend=who))
        self._pending.update(
            {
                "memopt/plans_found": float(len(report.plans)),
                "memopt/plans_on": float(len(report.plans_on)),
                "memopt/planned_saving_mb": report.saving_mb(enabled_only=True),
                "memopt/available_saving_mb": report.saving_mb(enabled_only=False),
            }
        )
        if any(p.lever == HEAD_LEVER for p in report.plans):  # the head's ways were measured (`Loss+` rows)
            self._pending["memopt/planned_head_saving_mb"] = report.head_saving_mb()


def _dump_json(data, path):
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)

    atomic_write(path, write)
