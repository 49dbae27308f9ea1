#!/usr/bin/env python
"""Issue 17's check of the budget solver against every combination of its candidates, on the issue's decoder
(benchmarks/decoder.py) at batch 16 under eager's peak at batch 8.

1. One `auto` run gives the solver's figures (`memory_auto/solver.json`): step one's memory by segment, what later
   steps hold more, and per layer its candidates (MiB freed, ms recomputed).
2. Every combination of the candidates (one per layer: 78,336 on that decoder) is predicted with the same peak
   model (`budget.predict`); the cheapest predicted to fit must be the solver's choice (the dynamic programme is
   exact: this says so on a real profile, as tests/test_torch_budget.py does on small ones).
3. What the model cannot see is measured: the solver's choice, the next cheapest combinations predicted to fit, and
   the cheapest ones predicted to miss the budget by at most `--near` (a model that errs high would hide faster
   fitting configurations there), each in fresh processes, in `--rounds` interleaved rounds (medians). The target:
   the choice's samples/s within 3% of the best measured configuration that fits.

    python benchmarks/solver_exhaustive.py            # about 15 minutes on 2 CPU cores
"""

import argparse
import itertools
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from budget_decoder import DECODER, TORCH, budget_of, solve  # noqa: E402

from optimum_memopt.advisor import run_child  # noqa: E402
from optimum_memopt.backends.torch.decide.budget import plan_entries  # noqa: E402
from optimum_memopt.backends.torch.decide.solver import Candidate  # noqa: E402


def candidate(c: dict) -> Candidate:
    label = c["config"]
    ops = frozenset() if label in ("keep", "Layer+") else frozenset(label.rstrip("+").split("+"))
    return Candidate(ops, label == "Layer+", c["freed_mb"], c["recompute_ms"])


def config_of(choice) -> str:
    return ",".join(str(e) for e in plan_entries(choice))


def every_combination(solver: dict):
    """(predicted peak MiB, recompute ms, choice) for every combination of the candidates, from solver.json's
    figures: each segment moves by what the layers it holds free, against step one's whole layers."""
    per_layer = [[candidate(c) for c in opts] for opts in solver["candidates"]]
    whole = solver["step_one_freed_mb"]  # what step one's whole layers freed, per layer
    segments = solver["memory"]["segments"]
    extra = solver["later_steps_hold_more_mb"]
    out = []
    for choice in itertools.product(*per_layer):
        freed = [c.freed_bytes for c in choice]
        peak = max(
            s["peak_mb"] + (extra if k < len(segments) - 1 else 0) + sum(whole[: s["layers_held"]])
            - sum(freed[: s["layers_held"]])
            for k, s in enumerate(segments)
        )  # fmt: skip
        out.append((peak, sum(c.seconds for c in choice), choice))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--budget_mb", type=float, default=None, help="instead of eager's peak at half the batch")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--others", type=int, default=3, help="the next cheapest combinations predicted to fit")
    p.add_argument("--near", type=float, default=0.05, help="and those predicted over the budget by at most this")
    p.add_argument("--near_count", type=int, default=3)
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "solver_exhaustive.json"))
    a = p.parse_args(argv)
    a.device_flags = ["--use_cpu"]
    flags = a.device_flags + ["--seed", "42"]
    budget = budget_of(a, flags)
    solver = solve(a, budget)
    fit = solver["fits"][-1]
    combos = every_combination(solver)
    fitting = sorted((c for c in combos if c[0] <= budget), key=lambda c: c[1])
    best_predicted = fitting[0]
    chosen = fit["config"]
    print(
        f"{len(combos):,} combinations, {len(fitting):,} predicted to fit; the cheapest: "
        f"{config_of(best_predicted[2])} ({best_predicted[1]:.1f} ms); the solver chose {chosen} "
        f"({fit['recompute_ms']:.1f} ms)",
        flush=True,
    )
    rows, seen = [("the solver's choice", chosen, fit["predicted_peak_mb"], fit["recompute_ms"])], {chosen}
    for peak, ms, choice in fitting:
        if len(rows) > a.others:
            break
        cfg = config_of(choice)
        if cfg not in seen:
            seen.add(cfg)
            rows.append((f"predicted to fit, #{len(rows) + 1} by cost", cfg, peak, ms))
    near = sorted((c for c in combos if budget < c[0] <= budget * (1 + a.near)), key=lambda c: c[1])
    for peak, ms, choice in near:
        if len(rows) > a.others + a.near_count:
            break
        cfg = config_of(choice)
        if cfg not in seen and ms < fit["recompute_ms"]:
            seen.add(cfg)
            rows.append((f"predicted {peak / budget * 100 - 100:+.1f}% over, cheaper", cfg, peak, ms))
    runs = {cfg: [] for _, cfg, _, _ in rows}
    for r in range(a.rounds):
        for label, cfg, _, _ in rows:
            m = run_child([DECODER], label, TORCH + ["--memory_opt_config", cfg] + flags, a.batch, a.steps)
            runs[cfg].append(m)
            print(f"[round {r + 1}] {label}: " + (f"{m.peak_mb:.1f} MiB, {m.step_time_s:.2f} s/step" if m.ok
                  else f"failed: {m.error}"), flush=True)  # fmt: skip
    table = []
    for label, cfg, peak, ms in rows:
        ok = [m for m in runs[cfg] if m.ok]
        if not ok:
            table.append({"label": label, "config": cfg, "error": runs[cfg][0].error})
            continue
        measured = statistics.median(m.peak_mb for m in ok)
        table.append({
            "label": label, "config": cfg, "predicted_peak_mb": peak, "predicted_recompute_ms": ms,
            "peak_mb": measured, "step_s": statistics.median(m.step_time_s for m in ok),
            "samples_per_s": statistics.median(m.samples_per_s for m in ok), "fits": measured <= budget,
        })  # fmt: skip
    ours = table[0]
    best = max((r for r in table if r.get("fits")), key=lambda r: r["samples_per_s"], default=None)
    report = {
        "batch": a.batch, "budget_mb": budget, "rounds": a.rounds, "combinations": len(combos),
        "predicted_to_fit": len(fitting), "cheapest_predicted": config_of(best_predicted[2]),
        "cheapest_predicted_ms": best_predicted[1], "choice": chosen, "choice_ms": fit["recompute_ms"],
        "rows": table,
    }  # fmt: skip
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    print(
        f"\n| at batch {a.batch}, budget {budget:.1f} MiB | config | predicted MiB | ms | peak MiB | s/step | fits |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        if "error" in r:
            print(f"| {r['label']} | `{r['config']}` | failed: {r['error'][:60]} | | | | |")
            continue
        print(f"| {r['label']} | `{r['config']}` | {r['predicted_peak_mb']:.1f} | {r['predicted_recompute_ms']:.0f} | "
              f"{r['peak_mb']:.1f} | {r['step_s']:.2f} | {'yes' if r['fits'] else 'no'} |")  # fmt: skip
    if best is not None and "samples_per_s" in ours:
        print(f"\nthe solver's choice: {ours['samples_per_s'] / best['samples_per_s']:.3f}x the samples/s of the best "
              f"measured configuration that fits ({best['label']})")  # fmt: skip
    print(f"written: {a.json}")


if __name__ == "__main__":
    main()
