#!/usr/bin/env python
"""Issue 30's benchmark: a Llama-style decoder whose vocabulary is 32 times its hidden size (benchmarks/decoder.py:
8 layers, hidden 256, MLP 768, vocabulary 8192, sequence 512, SDPA), under eager's peak at batch 8 (the budget,
measured first in the same run): for each way a current-PyTorch user has to fit it, the largest batch that fits,
and samples/s at 2x and 3x eager's batch where it fits. The ways: eager; transformers' checkpointing (whole
layers); whole layers with the loss chunked by hand (`Layer+:1:-1,Loss+:1:-1@chunks8`); `torch.compile` with
`activation_memory_budget`; the torch backend's level 1; and `--memory_opt_config auto` under the budget (the
solver choosing the layers' plans and the head's chunking from the run's own step one).

Each run is a fresh process (the advisor's `run_child`: peak = allocator bytes in use above their level before
training on the CPU, CUDA's max allocated on a GPU; step time = median of the steps after two warm-up steps).
The largest batch is searched in steps of `--batch_step`: the peak is near a line in the batch, so two measured
batches predict the largest that fits, which is then checked, with the next one up; where the line undershoots
(`auto`'s peak is near the budget at every batch) the batch grows by doubling strides, then the last stride is
halved down to one step. Speeds: `--rounds`
interleaved rounds at each batch, medians. `auto`'s predicted peak is read from its `memory_auto/solver.json`.

    python benchmarks/loss_decoder.py                  # about an hour on 2 CPU cores
    python benchmarks/loss_decoder.py --rounds 1 --compile_budgets    # a quicker look, without torch.compile
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from optimum_memopt.advisor import run_child  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fit_search import largest_fitting  # noqa: E402

DECODER = os.path.join(ROOT, "benchmarks", "decoder.py")
COMPILE = os.path.join(ROOT, "benchmarks", "compile_budget.py")
SHAPE = ["--layers", "8", "--hidden", "256", "--intermediate", "768", "--heads", "4", "--seq", "512"]
SHAPE += ["--vocab", "8192"]
PLAIN = ["--memory_opt_backend", "none"]
TORCH = ["--memory_opt_backend", "torch"]


def configurations(a, budget):
    rows = [
        ("eager", [DECODER], PLAIN),
        ("transformers: --activation_checkpointing (whole layers)", [DECODER], PLAIN + ["--activation_checkpointing"]),
        (
            f"whole layers + the loss chunked by hand (Layer+:1:-1,Loss+:1:-1@chunks{a.hand_chunks})",
            [DECODER],
            TORCH + ["--memory_opt_config", f"Layer+:1:-1,Loss+:1:-1@chunks{a.hand_chunks}"],
        ),
    ]
    for b in a.compile_budgets:
        rows.append(
            (f"torch.compile, activation_memory_budget {b}", [COMPILE, str(b), DECODER], PLAIN + ["--torch_compile"])
        )
    rows += [
        ("ours: level 1 (whole layers)", [DECODER], TORCH + ["--memory_opt_level", "1"]),
        ("ours: auto", [DECODER], TORCH + ["--memory_opt_config", "auto", "--memory_budget_mb", f"{budget:.1f}"]),
    ]
    return rows


def measure(a, script, label, flags, batch):
    m = run_child(script, label, flags + a.script_flags, batch, a.steps)
    print(
        f"  {label} at batch {batch}: "
        + (f"{m.peak_mb:.1f} MiB, {m.step_time_s:.2f} s/step" if m.ok else f"failed: {m.error}"),
        flush=True,
    )
    return m


def largest(a, budget, script, label, flags, seen):
    """The largest batch (a multiple of `--batch_step`) whose peak fits the budget, and every measurement made."""

    def measured(batch):
        if batch not in seen:
            seen[batch] = measure(a, script, label, flags, batch)
        return seen[batch]

    return largest_fitting(measured, a.batch_step, a.max_batch, budget)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base_batch", type=int, default=8, help="eager's batch: the budget is its peak")
    p.add_argument("--batch_step", type=int, default=4)
    p.add_argument("--max_batch", type=int, default=96)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hand_chunks", type=int, default=8)
    p.add_argument("--compile_budgets", type=float, nargs="*", default=[0.0, 0.1, 0.5])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "loss_decoder.json"))
    a = p.parse_args(argv)
    a.script_flags = SHAPE + (["--use_cpu"] if a.device == "cpu" else []) + ["--seed", "42"]

    base = measure(a, [DECODER], "eager (the budget)", PLAIN, a.base_batch)
    if not base.ok:
        raise SystemExit(f"eager at batch {a.base_batch} failed: {base.error}")
    budget = base.peak_mb
    print(f"budget: eager's peak at batch {a.base_batch}: {budget:.1f} MiB", flush=True)
    rows = configurations(a, budget)

    print("\nthe largest batch that fits", flush=True)
    found, seen_by = {}, {}
    for label, script, flags in rows:
        seen_by[label] = seen = {}
        if label == "eager":
            seen[a.base_batch] = base
        found[label] = largest(a, budget, script, label, flags, seen)
        print(f"-> {label}: {found[label]}", flush=True)

    batches = [2 * a.base_batch, 3 * a.base_batch]
    print(f"\nsamples/s at batches {batches}", flush=True)
    speed = {b: {label: [] for label, _, _ in rows} for b in batches}
    for r in range(a.rounds):
        for b in batches:
            for label, script, flags in rows:
                if found[label] < b:
                    continue
                first = r == 0 and b in seen_by[label]
                m = seen_by[label][b] if first else measure(a, script, label, flags, b)
                if m.ok:
                    speed[b][label].append(m)

    table = []
    for label, _, _ in rows:
        row = {"configuration": label, "largest_batch": found[label]}
        for b in batches:
            ok = speed[b][label]
            if ok:
                row[f"samples_per_s_{b}"] = statistics.median(m.samples_per_s for m in ok)
                row[f"peak_mb_{b}"] = statistics.median(m.peak_mb for m in ok)
        table.append(row)
    auto_out = [m for m in seen_by["ours: auto"].values() if m.ok]
    auto_out += [m for b in batches for m in speed[b]["ours: auto"]]
    report = {
        "budget_mb": budget,
        "base_batch": a.base_batch,
        "device": a.device,
        "rounds": a.rounds,
        "shape": SHAPE,
        "rows": table,
        "measurements": {
            label: {str(b): {"ok": m.ok, "peak_mb": m.peak_mb, "step_s": m.step_time_s} for b, m in seen.items()}
            for label, seen in seen_by.items()
        },
        "auto_runs": [{"batch": m.batch_size, "peak_mb": m.peak_mb, "choice": m.auto} for m in auto_out],
    }
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    head = " | ".join(f"samples/s at {b}" for b in batches)
    print(f"\n| under {budget:.1f} MiB (eager's peak at batch {a.base_batch}) | largest batch | {head} |")
    print("|---|---|" + "---|" * len(batches))
    for row in table:
        cells = " | ".join(f"{row[f'samples_per_s_{b}']:.2f}" if f"samples_per_s_{b}" in row else "-" for b in batches)
        print(f"| {row['configuration']} | {row['largest_batch']} | {cells} |")
    for m in auto_out:
        for k, c in enumerate((m.auto or {}).get("checks", [])):
            predicted, checked = c["predicted_peak_mb"], c["measured_peak_mb"]
            print(
                f"auto at batch {m.batch_size}, choice {k + 1}: `{c['config']}`, predicted {predicted:.1f} MiB, "
                f"its check measured {checked:.1f} "
                f"({(predicted / checked - 1) * 100:+.1f}%)"
                + (f"; the run's peak {m.peak_mb:.1f}" if k + 1 == len(m.auto["checks"]) else "")
            )
    print(f"written: {a.json}")


if __name__ == "__main__":
    main()
