"""`--memory_opt_config auto`: probe the running script, choose plans under the budget, train with them."""

import json
import logging
import os
import sys
from typing import List, Optional

from ..memory_config import parse_entries
from .measure import ENV_CHILD
from .probe import format_table, probe, write_reports
from .select import choose, verify

logger = logging.getLogger("optimum_memopt")


def resolve_auto(args, script_argv: Optional[List[str]] = None) -> str:
    """Fill ``args.memory_opt_entries`` / ``args.memory_opt_level`` from measurements; return the explanation."""
    if os.environ.get(ENV_CHILD):
        raise RuntimeError("`--memory_opt_config auto` reached a probe child; the probe must override it")
    script_argv = list(script_argv if script_argv is not None else sys.argv)
    budget = float(args.memory_budget_mb)
    logger.info("memory_opt_config auto: probing %s under %.1f MiB (a few short runs of this script)", script_argv[0], budget)
    steps = args.memory_probe_steps
    report = probe(script_argv, args.per_device_train_batch_size, steps=steps, max_plans=args.memory_probe_max_plans,
                   progress=logger.info)
    choice = verify(report, choose(report, budget), budget, steps, progress=logger.info)
    out = os.path.join(args.output_dir, "memory_auto")
    write_reports(report, out, extra_markdown=f"## Chosen under {budget:,.1f} MiB\n\n{choice.describe()}")
    with open(os.path.join(out, "choice.json"), "w") as f:
        json.dump({"budget_mb": budget, "config": choice.config, "level": choice.level, "reason": choice.reason,
                   "estimated_peak_mb": choice.estimated_peak_mb,
                   "verified_peak_mb": choice.verified.peak_mb if choice.verified else None}, f, indent=2)
    args.memory_opt_entries = parse_entries(choice.config) if choice.config else []
    args.memory_opt_level = choice.level
    logger.info("%s", format_table(report))
    logger.info("memory_opt_config auto chose %s (reports in %s)", choice.describe(), out)
    return choice.describe()
