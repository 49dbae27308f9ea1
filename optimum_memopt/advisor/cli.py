"""`memopt-probe`: measure which memory-optimizer plans are worth it for a training script.

    memopt-probe [options] -- SCRIPT.py [the script's own arguments]

The script must parse `MemoptTrainingArguments` (as the recipes in examples/ do) and train with
`MemoptTrainer` / `MemoptTrainerMixin`. It is run several times for a few steps each, in fresh
processes, with the memory flags, batch size, output directory and step count overridden.

Exit status: 0 with a report; 2 for bad options (before anything runs); 1 when the script's own run
failed or nothing fits the budget (the report says why); 128+N when stopped by signal N.
"""

import argparse
import math
import os
import signal
import sys
from typing import List, Optional

from .measure import run_child
from .pipeline import Advice, advise, write_reports
from .probe import format_table


# -- parser ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memopt-probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--batch_size",
        type=int,
        help="batch size to probe at (default: the script's --per_device_train_batch_size, else 8)",
    )
    p.add_argument("--steps", type=int, default=6, help="training steps per configuration (the first 2 are warm-up)")
    p.add_argument(
        "--max_plans", type=int, default=6, help="probe this many of the plans found, largest predicted saving first"
    )
    p.add_argument(
        "--levels",
        default=None,
        help="memory_opt_levels to probe, comma-separated from 1 and 2 ('' for none; default: the backend's levels, "
        "1 and 2 with ORT, 1 with the torch backend)",
    )
    p.add_argument("--include_pytorch", action="store_true", help="also measure the script without ORT")
    p.add_argument(
        "--budget_mb", type=float, help="choose the cheapest plans that fit this peak (MiB) and verify them"
    )
    p.add_argument(
        "--search_batch_size",
        action="store_true",
        help="with --budget_mb: the largest batch size that fits, with and without the chosen plans",
    )
    p.add_argument("--report_dir", default="memopt_probe", help="where probe.json, probe.md and probe.png go")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py [its arguments]")
    return p


class UsageError(ValueError):
    pass


def _script_batch_size(script_args: List[str], default: int = 8) -> int:
    value = None
    for i, a in enumerate(script_args):
        if a == "--per_device_train_batch_size" and i + 1 < len(script_args):
            value = script_args[i + 1]
        elif a.startswith("--per_device_train_batch_size="):
            value = a.split("=", 1)[1]
    if value is None:
        return default
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"the script's --per_device_train_batch_size is {value!r}; expected a positive integer")
    return int(value)


def validate(args) -> dict:
    """Everything checked before the first run; returns the settings for `gather`."""
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise UsageError("give the training script after '--', as in `memopt-probe -- examples/run_glue/run_glue.py`")
    if not os.path.isfile(script[0]):
        raise UsageError(
            f"the training script {script[0]!r} is not a file; give its path after '--', as in "
            f"`memopt-probe -- examples/run_glue/run_glue.py`"
        )
    levels = None if args.levels is None else []
    for part in (x.strip() for x in (args.levels or "").split(",")):
        if not part:
            continue
        if part not in ("1", "2"):
            raise UsageError(
                f"--levels {args.levels!r} has {part!r}; expected levels 1 and/or 2 separated by commas, "
                f"as in `--levels 1,2`, or `--levels ''` for none"
            )
        if int(part) not in levels:
            levels.append(int(part))
    if args.steps < 1:
        raise UsageError(f"--steps is {args.steps}; expected a positive integer, as in `--steps 6`")
    if args.max_plans < 0:
        raise UsageError(f"--max_plans is {args.max_plans}; expected 0 or more, as in `--max_plans 6`")
    if args.batch_size is not None and args.batch_size < 1:
        raise UsageError(f"--batch_size is {args.batch_size}; expected a positive integer, as in `--batch_size 16`")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        raise UsageError(f"--timeout is {args.timeout}; expected a positive number of seconds, as in `--timeout 1800`")
    if args.budget_mb is not None and not (math.isfinite(args.budget_mb) and args.budget_mb > 0):
        raise UsageError(
            f"--budget_mb is {args.budget_mb}; expected a positive, finite number of MiB, as in `--budget_mb 4000`"
        )
    if args.search_batch_size and args.budget_mb is None:
        raise UsageError("--search_batch_size needs --budget_mb, as in `--budget_mb 4000 --search_batch_size`")
    if os.path.exists(args.report_dir) and not os.path.isdir(args.report_dir):
        raise UsageError(f"--report_dir {args.report_dir!r} is a file; expected a directory (created when missing)")
    parent = os.path.abspath(args.report_dir)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"--report_dir {args.report_dir!r} cannot be created or written (in {parent!r})")
    batch = args.batch_size or _script_batch_size(script[1:])
    return {"script": script, "batch": batch, "levels": levels}


# -- gather ----------------------------------------------------------------------------------------
def gather(args, settings: dict, runner=run_child) -> Advice:
    return advise(
        settings["script"],
        settings["batch"],
        budget_mb=args.budget_mb,
        steps=args.steps,
        max_plans=args.max_plans,
        levels=settings["levels"],
        include_pytorch=args.include_pytorch,
        budget_flag="--budget_mb",
        search_batch_size=args.search_batch_size,
        timeout=args.timeout,
        runner=runner,
    )


# -- render ----------------------------------------------------------------------------------------
def render(advice: Advice, report_dir: str) -> List[str]:
    print(format_table(advice.probe))
    if advice.budget_mb is not None:
        print(
            f"\nUnder {advice.budget_mb:,.1f} MiB: " + (advice.choice.describe() if advice.choice else advice.no_fit)
        )
    for b in advice.batch_search:
        sps = f" ({b.samples_per_s:.1f} samples/s)" if b.samples_per_s else ""
        print(f"max batch size under {advice.budget_mb:,.1f} MiB, {b.label}: {b.batch_size}{sps}")
    paths = write_reports(advice, report_dir)
    print("\nreports: " + ", ".join(paths))
    return paths


def exit_status(advice: Advice) -> int:
    base = advice.probe.baseline
    if base is None or not base.measurement.ok:
        return 1
    if advice.budget_mb is not None and advice.choice is None:
        return 1
    return 0


def _stop_on_sigterm():
    def handler(signum, frame):
        raise SystemExit(128 + signum)  # unwinds: the running child is stopped, temporary files removed

    signal.signal(signal.SIGTERM, handler)


def main(argv: Optional[List[str]] = None, runner=run_child) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = validate(args)
    except UsageError as e:
        print(f"memopt-probe: {e}", file=sys.stderr)
        return 2
    _stop_on_sigterm()
    advice = gather(args, settings, runner=runner)
    render(advice, args.report_dir)
    status = exit_status(advice)
    if status:
        base = advice.probe.baseline
        why = (
            f"the script's run without recompute failed: {base.measurement.error}"
            if base and not base.measurement.ok
            else advice.no_fit
        )
        print(f"memopt-probe: {why}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
