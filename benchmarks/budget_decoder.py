#!/usr/bin/env python
"""Issue 17's benchmark: a Llama-style decoder (benchmarks/decoder.py: 4 layers, hidden 256, MLP 768, sequence 512,
SDPA) at twice eager's batch, under eager's peak at the batch itself (the budget), every way a current-PyTorch user
has to fit it, in one run: eager; transformers' checkpointing, whole layers and `every_n_layers`; `torch.compile`
with `activation_memory_budget`; torchtitan's selective-checkpointing policy; the torch backend's level 1; and the
budget solver's choice (`--memory_opt_config auto`, chosen in the training process from one step).

Each configuration runs in a fresh process (the advisor's `run_child`: peak = allocator bytes in use above their
level before training on the CPU, CUDA's max allocated on a GPU; step time = median of the steps after two warm-up
steps), in `--rounds` interleaved rounds; the table gives medians over rounds. The solver's prediction (peak, and
step time = eager's step + the recompute it predicts) is read from the auto run's `memory_auto/solver.json`.

    python benchmarks/budget_decoder.py                 # about 25 minutes on 2 CPU cores
    python benchmarks/budget_decoder.py --rounds 1 --compile_budgets 0.15   # a quick look
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from optimum_memopt.advisor import run_child  # noqa: E402

DECODER = os.path.join(ROOT, "benchmarks", "decoder.py")
COMPILE = os.path.join(ROOT, "benchmarks", "compile_budget.py")
PLAIN = ["--memory_opt_backend", "none"]
TORCH = ["--memory_opt_backend", "torch"]


def configurations(a, choice):
    rows = [
        ("eager", [DECODER], PLAIN),
        ("transformers: --activation_checkpointing (whole layers)", [DECODER], PLAIN + ["--activation_checkpointing"]),
    ]
    for k in a.every_n:
        rows.append(
            (
                f"transformers: every_n_layers {k}",
                [DECODER],
                PLAIN
                + [
                    "--activation_checkpointing",
                    "--activation_checkpointing_kwargs",
                    json.dumps({"every_n_layers": k}),
                ],
            )
        )
    for b in a.compile_budgets:
        rows.append(
            (f"torch.compile, activation_memory_budget {b}", [COMPILE, str(b), DECODER], PLAIN + ["--torch_compile"])
        )
    rows += [
        ("torchtitan-style SAC (SDPA + every other matmul saved)", [DECODER], PLAIN + ["--sac", "titan"]),
        ("ours: level 1 (whole layers)", [DECODER], TORCH + ["--memory_opt_level", "1"]),
        ("ours: the solver's choice", [DECODER], TORCH + ["--memory_opt_config", choice]),
    ]
    return rows


def solve(a, budget):
    """One `auto` run (its own output dir): the choice and the prediction from solver.json."""
    out = tempfile.mkdtemp(prefix="memopt-auto-")
    cmd = [sys.executable, DECODER, "--output_dir", out, "--max_steps", "3", "--per_device_train_batch_size",
           str(a.batch), "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--seed", "42",
           *a.device_flags, *TORCH, "--memory_opt_config", "auto", "--memory_budget_mb", f"{budget:.1f}"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"the auto run failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "memory_auto", "solver.json")) as f:
        return json.load(f)


def budget_of(a, script_flags) -> float:
    """`--budget_mb`, else eager's peak at half the batch (measured now), said."""
    if a.budget_mb is not None:
        print(f"budget: {a.budget_mb:.1f} MiB (given)", flush=True)
        return a.budget_mb
    half = run_child([DECODER], "eager at half the batch", PLAIN + script_flags, a.batch // 2, a.steps)
    if not half.ok:
        raise SystemExit(f"eager at batch {a.batch // 2} failed: {half.error}")
    print(f"budget: eager's peak at batch {a.batch // 2}: {half.peak_mb:.1f} MiB", flush=True)
    return half.peak_mb


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="the batch to fit (the budget is eager's peak at half)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every_n", type=int, nargs="*", default=[2])
    p.add_argument("--compile_budgets", type=float, nargs="*", default=[0.1, 0.15, 0.3])
    p.add_argument("--budget_mb", type=float, default=None, help="instead of eager's peak at half the batch")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "budget_decoder.json"))
    a = p.parse_args(argv)
    a.device_flags = ["--use_cpu"] if a.device == "cpu" else []
    script_flags = a.device_flags + ["--seed", "42"]

    budget = budget_of(a, script_flags)
    solver = solve(a, budget)
    fit = solver["fits"][-1]
    choice = fit["config"]
    print(
        f"the solver chose {choice}: predicted {fit['predicted_peak_mb']:.1f} MiB, {fit['recompute_ms']:.0f} ms",
        flush=True,
    )

    rows = configurations(a, choice)
    runs = {label: [] for label, _, _ in rows}
    for r in range(a.rounds):
        for label, script, flags in rows:
            m = run_child(script, label, flags + script_flags, a.batch, a.steps)
            runs[label].append(m)
            print(
                f"[round {r + 1}] {label}: "
                + (f"{m.peak_mb:.1f} MiB, {m.step_time_s:.2f} s/step" if m.ok else f"failed: {m.error}"),
                flush=True,
            )

    table = []
    for label, _, flags in rows:
        ok = [m for m in runs[label] if m.ok]
        if not ok:
            table.append({"configuration": label, "error": runs[label][0].error})
            continue
        table.append(
            {
                "configuration": label,
                "peak_mb": statistics.median(m.peak_mb for m in ok),
                "step_s": statistics.median(m.step_time_s for m in ok),
                "samples_per_s": statistics.median(m.samples_per_s for m in ok),
                "first_step_s": statistics.median(m.first_step_s for m in ok if m.first_step_s is not None),
                "fits": statistics.median(m.peak_mb for m in ok) <= budget,
                "runs": len(ok),
            }
        )
    by = {row["configuration"]: row for row in table}
    eager, ours = by["eager"], by["ours: the solver's choice"]
    predicted_step = eager["step_s"] + fit["recompute_ms"] / 1000 if "step_s" in eager else None
    report = {
        "batch": a.batch,
        "budget_mb": budget,
        "device": a.device,
        "rounds": a.rounds,
        "choice": choice,
        "predicted_peak_mb": fit["predicted_peak_mb"],
        "predicted_step_s": predicted_step,
        "solver": solver,
        "rows": table,
    }
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\n| at batch {a.batch}, budget {budget:.1f} MiB | peak MiB | s/step | samples/s | first step s | fits |")
    print("|---|---|---|---|---|---|")
    for row in table:
        if "error" in row:
            print(f"| {row['configuration']} | failed: {row['error'][:80]} | | | | |")
            continue
        print(
            f"| {row['configuration']} | {row['peak_mb']:.1f} | {row['step_s']:.2f} | {row['samples_per_s']:.2f} | "
            f"{row['first_step_s']:.2f} | {'yes' if row['fits'] else 'no'} |"
        )
    if "peak_mb" in ours:
        print(
            f"\nthe solver's prediction: peak {fit['predicted_peak_mb']:.1f} MiB (measured {ours['peak_mb']:.1f}, "
            f"{(fit['predicted_peak_mb'] / ours['peak_mb'] - 1) * 100:+.1f}%), step {predicted_step:.2f} s (eager's "
            f"{eager['step_s']:.2f} + {fit['recompute_ms']:.0f} ms recompute; measured {ours['step_s']:.2f}, "
            f"{(predicted_step / ours['step_s'] - 1) * 100:+.1f}%)"
        )
        fitting = [r for r in table if r.get("fits") and r["configuration"] != "eager"]
        for r in sorted(fitting, key=lambda r: -r["samples_per_s"]):
            print(f"  fits: {r['configuration']}: {r['samples_per_s'] / ours['samples_per_s']:.2f}x ours' samples/s")
    print(f"written: {a.json}")


if __name__ == "__main__":
    main()
