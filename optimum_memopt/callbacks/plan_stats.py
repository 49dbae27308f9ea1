"""`PlanStatsCallback`: the recompute plans ORT found, once, after the first training step.

Reads ORTModule's runtime inspector (structured data, not log text) and, on rank 0 only:

* logs a table (config, ON/OFF, frequency, saving for the first batch, symbolic form);
* writes `<output_dir>/memory_plans.json`;
* adds these metrics to the next training log:
  - `memopt/plans_found`: recompute plans ORT found;
  - `memopt/plans_on`: plans applied in this run;
  - `memopt/planned_saving_mb`: ORT's predicted saving of the applied plans for the first batch (MiB);
  - `memopt/available_saving_mb`: the predicted saving of all plans found (MiB).
"""

import json

from .. import ort
from .base import MetricsCallback, logger

MIB = 1024.0 * 1024.0


def format_plan_table(stats: dict) -> str:
    plans = stats["plans"]
    rows = [("#", "STATE", "CONFIG", "FREQ", "SAVING (B)", "SAVING SYMBOLIC (B)")]
    for i, p in enumerate(plans, 1):
        saving = f"{p['saving_bytes']:,.0f}" if p["saving_bytes"] is not None else "?"
        rows.append((str(i), "ON" if p["enabled"] else "OFF", p["config"], str(p["frequency"]), saving, p["saving_symbolic"]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    dims = ", ".join(f"{k}={v}" for k, v in stats["symbolic_dims_first_batch"].items())
    head = (
        f"Memory optimizer {'ON' if stats['memory_optimizer_enabled'] else 'OFF'} (level {stats['level']}); "
        f"{len(plans)} recompute plan(s) found, {sum(p['enabled'] for p in plans)} ON"
    )
    return "\n".join([head] + lines + [f"Savings are for the first batch: {dims}"])


class PlanStatsCallback(MetricsCallback):
    def __init__(self):
        super().__init__()
        self.stats = None
        self._done = False

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        if self._done:
            return
        self._done = True
        ort_model = ort.find_ort_module(model)
        if ort_model is None:
            logger.info("memory plans: ORTModule is not in use, no recompute plans to report")
            return
        stats = ort.read_plan_stats(ort_model)
        if stats is None:
            return
        self.stats = stats
        with open(self.output_path(args, "memory_plans.json"), "w", encoding="utf-8") as f:
            json.dump(stats, f, indent=2)
        logger.info("%s", format_plan_table(stats))
        plans = stats["plans"]
        self._pending.update(
            {
                "memopt/plans_found": float(len(plans)),
                "memopt/plans_on": float(sum(p["enabled"] for p in plans)),
                "memopt/planned_saving_mb": sum(p["saving_bytes"] or 0.0 for p in plans if p["enabled"]) / MIB,
                "memopt/available_saving_mb": sum(p["saving_bytes"] or 0.0 for p in plans) / MIB,
            }
        )
