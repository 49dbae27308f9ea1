#!/usr/bin/env python
"""Issue 41's benchmark: the longest sequence under one budget. A Llama-style decoder with a realistic shape
(benchmarks/decoder.py: vocabulary 32x and MLP 3.5x the hidden size; 4 layers, hidden 256, MLP 896, vocabulary 8192,
SDPA), batch 1, under eager's peak at `--base_seq` tokens (the budget, measured first in the same run): for each way
a current-PyTorch user has to fit it, the longest sequence that fits, and samples/s (and tokens/s) at two lengths
where several fit. The ways: eager; transformers' checkpointing (whole layers); checkpointing with the loss chunked
by hand (`Layer+:1:-1,Loss+:1:-1@chunksN`); checkpointing + the loss + the tiled MLP by hand (ALST's recipe without
offload: `Layer+:1:-1,Loss+:1:-1@chunksN,MLP+:1:-1@tilesK`); TRL's selective checkpointing (transformers'
checkpointing with the attention's output saved); `torch.compile` with `activation_memory_budget`; and
`--memory_opt_config auto` under the budget.

Each run is a fresh process (the advisor's `run_child`: peak = the tensors' bytes above their level before training
(on the CPU the process's tensor storages counted as CUDA counts them; CUDA's max allocated on a GPU); step time =
median of the steps after two warm-up steps). The longest sequence is searched in steps of `--seq_step`: two
measured lengths give a line, the line's guess is checked with the next one up, and where it undershoots the length
grows by doubling strides, then the last stride is halved down to one step. Speeds: `--rounds` interleaved rounds
at each length, medians. `auto`'s predicted peak is read from its `memory_auto/solver.json` (its checks).

    python benchmarks/long_context.py                   # hours on 2 CPU cores (the sequence is searched per way)
    python benchmarks/long_context.py --rounds 1 --compile_budgets --max_seq 8192   # a quicker look
    python benchmarks/long_context.py --only "ours:" --rounds 0      # one configuration's search alone
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
PLAIN = ["--memory_opt_backend", "none"]
TORCH = ["--memory_opt_backend", "torch"]


def shape(a) -> list:
    return ["--layers", str(a.layers), "--hidden", str(a.hidden), "--intermediate", str(a.hidden * 7 // 2),
            "--heads", str(a.heads), "--vocab", str(a.hidden * 32), "--samples", "16"]  # fmt: skip


def configurations(a, budget):
    hand = f"Layer+:1:-1,Loss+:1:-1@chunks{a.hand_chunks}"
    rows = [
        ("eager", [DECODER], PLAIN),
        ("transformers: --activation_checkpointing (whole layers)", [DECODER], PLAIN + ["--activation_checkpointing"]),
        (f"whole layers + the loss chunked by hand ({hand})", [DECODER], TORCH + ["--memory_opt_config", hand]),
        (
            f"+ the tiled MLP by hand (ALST without offload: {hand},MLP+:1:-1@tiles{a.hand_tiles})",
            [DECODER],
            TORCH + ["--memory_opt_config", f"{hand},MLP+:1:-1@tiles{a.hand_tiles}"],
        ),
        (
            "TRL: selective checkpointing (attention's output saved)",
            [DECODER],
            PLAIN + ["--activation_checkpointing", "--sac", "trl"],
        ),
    ]
    for b in a.compile_budgets:
        rows.append(
            (f"torch.compile, activation_memory_budget {b}", [COMPILE, str(b), DECODER], PLAIN + ["--torch_compile"])
        )
    rows.append(
        ("ours: auto", [DECODER], TORCH + ["--memory_opt_config", "auto", "--memory_budget_mb", f"{budget:.1f}"])
    )
    return rows


def measure(a, script, label, flags, seq):
    m = run_child(script, label, [*flags, *a.script_flags, "--seq", str(seq)], 1, a.steps)
    print(
        f"  {label} at {seq} tokens: "
        + (f"{m.peak_mb:.1f} MiB, {m.step_time_s:.2f} s/step" if m.ok else f"failed: {m.error}"),
        flush=True,
    )
    return m


def longest(a, budget, script, label, flags, seen):
    """The longest sequence (a multiple of `--seq_step`) whose peak fits the budget, and every measurement made."""

    def measured(seq):
        if seq not in seen:
            seen[seq] = measure(a, script, label, flags, seq)
        return seen[seq]

    return largest_fitting(measured, a.seq_step, a.max_seq, budget)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--base_seq", type=int, default=2048, help="eager's length: the budget is its peak")
    p.add_argument("--seq_step", type=int, default=1024)
    p.add_argument("--max_seq", type=int, default=32768)
    p.add_argument("--lengths", type=int, nargs=2, default=None, help="the two lengths timed (default: 2x, 4x base)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hand_chunks", type=int, default=8)
    p.add_argument("--hand_tiles", type=int, default=4)
    p.add_argument("--compile_budgets", type=float, nargs="*", default=[0.0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--speeds_only",
        nargs="*",
        default=None,
        help="skip the search: time these configurations (their labels' first words, as in `whole +` or `ours:`) at "
        "`--lengths`, in `--rounds` interleaved rounds",
    )
    p.add_argument(
        "--only",
        nargs="*",
        default=None,
        help="search and time these configurations only (their labels' first words), the others left out of the run",
    )
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "long_context.json"))
    a = p.parse_args(argv)
    a.script_flags = shape(a) + (["--use_cpu"] if a.device == "cpu" else []) + ["--seed", "42"]

    base = measure(a, [DECODER], "eager (the budget)", PLAIN, a.base_seq)
    if not base.ok:
        raise SystemExit(f"eager at {a.base_seq} tokens failed: {base.error}")
    budget = base.peak_mb
    print(f"budget: eager's peak at {a.base_seq} tokens, batch 1: {budget:.1f} MiB", flush=True)
    rows = configurations(a, budget)

    lengths = a.lengths or [2 * a.base_seq, 4 * a.base_seq]
    if a.only is not None:
        rows = [r for r in rows if any(r[0].startswith(prefix) for prefix in a.only)]
    found, seen_by = {}, {}
    if a.speeds_only is not None:  # the lengths taken as fitting (a search's answer read before), timed only
        rows = [r for r in rows if any(r[0].startswith(prefix) for prefix in a.speeds_only)]
        found = {label: max(lengths) for label, _, _ in rows}
        seen_by = {label: {} for label, _, _ in rows}
    else:
        print("\nthe longest sequence that fits", flush=True)
    for label, script, flags in rows if a.speeds_only is None else []:
        seen_by[label] = seen = {}
        if label == "eager":
            seen[a.base_seq] = base
        found[label] = longest(a, budget, script, label, flags, seen)
        print(f"-> {label}: {found[label]}", flush=True)

    print(f"\nsamples/s at {lengths} tokens", flush=True)
    speed = {n: {label: [] for label, _, _ in rows} for n in lengths}
    for r in range(a.rounds):
        for n in lengths:
            for label, script, flags in rows:
                if found[label] < n:
                    continue
                first = r == 0 and n in seen_by[label]
                m = seen_by[label][n] if first else measure(a, script, label, flags, n)
                if m.ok and m.peak_mb <= budget:  # a run over the budget does not fit: no speed for it
                    speed[n][label].append(m)

    table = []
    for label, _, _ in rows:
        row = {"configuration": label, "longest_seq": found[label] if a.speeds_only is None else None}
        for n in lengths:
            ok = speed[n][label]
            if ok:
                row[f"samples_per_s_{n}"] = statistics.median(m.samples_per_s for m in ok)
                row[f"peak_mb_{n}"] = statistics.median(m.peak_mb for m in ok)
        table.append(row)
    auto_out = [(seq, m) for seq, m in seen_by.get("ours: auto", {}).items() if m.ok]
    auto_out += [(n, m) for n in lengths for m in speed[n].get("ours: auto", [])]
    report = {
        "budget_mb": budget,
        "base_seq": a.base_seq,
        "device": a.device,
        "rounds": a.rounds,
        "shape": shape(a),
        "rows": table,
        "measurements": {
            label: {str(n): {"ok": m.ok, "peak_mb": m.peak_mb, "step_s": m.step_time_s} for n, m in seen.items()}
            for label, seen in seen_by.items()
        },
        "auto_runs": [{"seq": seq, "peak_mb": m.peak_mb, "choice": m.auto} for seq, m in auto_out],
    }
    with open(a.json, "w") as f:
        json.dump(report, f, indent=2)
    head = " | ".join(f"samples/s at {n}" for n in lengths)
    print(f"\n| under {budget:.1f} MiB (eager's peak at {a.base_seq} tokens) | longest sequence | {head} |")
    print("|---|---|" + "---|" * len(lengths))
    for row in table:
        cells = " | ".join(f"{row[f'samples_per_s_{n}']:.3f}" if f"samples_per_s_{n}" in row else "-" for n in lengths)
        print(f"| {row['configuration']} | {row['longest_seq']} | {cells} |")
    for seq, m in auto_out:
        for k, c in enumerate((m.auto or {}).get("checks", [])):
            predicted, checked = c["predicted_peak_mb"], c["measured_peak_mb"]
            print(
                f"auto at {seq} tokens, choice {k + 1}: `{c['config']}`, predicted {predicted:.1f} MiB, its check "
                f"measured {checked:.1f} ({(predicted / checked - 1) * 100:+.1f}%)"
                + (f"; the run's peak {m.peak_mb:.1f}" if k + 1 == len(m.auto["checks"]) else "")
            )
    print(f"written: {a.json}")


if __name__ == "__main__":
    main()
