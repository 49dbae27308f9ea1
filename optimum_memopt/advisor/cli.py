"""`memopt-probe`: measure which memory-optimizer plans are worth it for a training script.

    memopt-probe [options] -- SCRIPT.py [the script's own arguments]

The script must parse `MemoptTrainingArguments` (as the recipes in examples/ do) and train with
`MemoptTrainer` / `MemoptTrainerMixin`. It is run several times for a few steps each, in fresh
processes, with the memory flags, batch size, output directory and step count overridden.
"""

import argparse
import json
import os
import sys
from typing import List, Optional

from .measure import memory_flags
from .probe import format_table, probe, write_reports
from .select import NoFit, choose, max_batch_size, verify


def _script_batch_size(script_args: List[str], default: int = 8) -> int:
    for i, a in enumerate(script_args):
        if a == "--per_device_train_batch_size" and i + 1 < len(script_args):
            return int(script_args[i + 1])
        if a.startswith("--per_device_train_batch_size="):
            return int(a.split("=", 1)[1])
    return default


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memopt-probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch_size", type=int, help="batch size to probe at (default: the script's --per_device_train_batch_size, else 8)")
    p.add_argument("--steps", type=int, default=6, help="training steps per configuration (the first 2 are warm-up)")
    p.add_argument("--max_plans", type=int, default=6, help="probe this many of ORT's plans, largest predicted saving first")
    p.add_argument("--levels", default="1,2", help="memory_opt_levels to probe, comma-separated ('' for none)")
    p.add_argument("--include_pytorch", action="store_true", help="also measure the script without ORT")
    p.add_argument("--budget_mb", type=float, help="choose the cheapest plans that fit this peak (MiB) and verify them")
    p.add_argument("--search_batch_size", action="store_true", help="with --budget_mb: the largest batch size that fits, with and without the chosen plans")
    p.add_argument("--report_dir", default="memopt_probe", help="where probe.json, probe.md and probe.png go")
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed per run")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT.py [its arguments]")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script or not os.path.isfile(script[0]):
        print(f"memopt-probe: give the training script after '--', e.g. memopt-probe -- examples/run_glue/run_glue.py; got {script[:1]}",
              file=sys.stderr)
        return 2
    if args.search_batch_size and not args.budget_mb:
        print("memopt-probe: --search_batch_size needs --budget_mb", file=sys.stderr)
        return 2
    batch = args.batch_size or _script_batch_size(script[1:])
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    report = probe(script, batch, steps=args.steps, max_plans=args.max_plans, levels=levels,
                   include_pytorch=args.include_pytorch, timeout=args.timeout)
    print(format_table(report))
    extra = []
    summary = {}
    if args.budget_mb:
        try:
            choice = verify(report, choose(report, args.budget_mb), args.budget_mb, args.steps, timeout=args.timeout)
            print(f"\nUnder {args.budget_mb:,.1f} MiB: {choice.describe()}")
            extra.append(f"## Chosen under {args.budget_mb:,.1f} MiB\n\n{choice.describe()}")
            summary["choice"] = {"config": choice.config, "level": choice.level, "reason": choice.reason}
            if args.search_batch_size:
                rows = []
                for label, flags in (("ORT, no recompute", memory_flags(True)), (f"ORT, {choice.describe().split(':')[0]}", choice.flags)):
                    best, tried = max_batch_size(script, flags, args.budget_mb, batch, steps=max(3, args.steps - 2), timeout=args.timeout)
                    sps = tried[best].samples_per_s if best else None
                    rows.append((label, best, sps))
                    print(f"max batch size under {args.budget_mb:,.1f} MiB, {label}: {best}" + (f" ({sps:.1f} samples/s)" if sps else ""))
                summary["max_batch_size"] = [{"config": r[0], "batch_size": r[1], "samples_per_s": r[2]} for r in rows]
                extra.append("## Largest batch size under the budget\n\n| config | batch size | samples/s |\n|---|---|---|\n" + "\n".join(
                    f"| {r[0]} | {r[1]} | {'-' if r[2] is None else f'{r[2]:.1f}'} |" for r in rows))
        except NoFit as e:
            print(f"\n{e}")
            extra.append(f"## Budget {args.budget_mb:,.1f} MiB\n\n{e}")
    paths = write_reports(report, args.report_dir, extra_markdown="\n\n".join(extra))
    if summary:
        with open(os.path.join(args.report_dir, "choice.json"), "w") as f:
            json.dump(summary, f, indent=2)
    print("\nreports: " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
