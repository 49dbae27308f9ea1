"""`--memory_opt_config auto`: probe the running script, choose plans under the budget, train with them.

Called from `MemoptTrainerMixin.resolve_memory_plan`, at `train()`; it changes no argument: the trainer
keeps the choice (`trainer.memory_plan`) and the reports go to `<output_dir>/memory_auto/`.
"""

import os
from typing import Callable, List, Tuple

from ..plans import PlanEntry, parse_inline
from .measure import Runner, run_child
from .pipeline import advise, write_reports
from .probe import format_table


def choose_for_script(
    args, script_argv: List[str], progress: Callable[[str], None] = print, runner: Runner = run_child
) -> Tuple[List[PlanEntry], int, str]:
    config = args.memory_opt
    budget = float(config.budget_mb)
    progress(
        f"memory_opt_config auto: probing {script_argv[0]} under {budget:,.1f} MiB (a few short runs of this script)"
    )
    advice = advise(
        script_argv,
        args.per_device_train_batch_size,
        budget_mb=budget,
        steps=config.probe_steps,
        max_plans=config.probe_max_plans,
        progress=progress,
        runner=runner,
    )
    out = os.path.join(args.output_dir, "memory_auto")
    write_reports(advice, out)
    progress(format_table(advice.probe))
    if advice.choice is None:
        raise RuntimeError(
            f"`--memory_opt_config auto` found nothing that fits `--memory_budget_mb {budget:g}`: "
            f"{advice.no_fit} (reports in {out})"
        )
    c = advice.choice
    progress(f"memory_opt_config auto chose {c.describe()} (reports in {out})")
    return (parse_inline(c.config) if c.config else []), c.level, c.reason
