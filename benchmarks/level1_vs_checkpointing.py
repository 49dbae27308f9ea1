#!/usr/bin/env python
"""Whole-layer recompute, side by side: the torch backend's `--memory_opt_level 1` against transformers' own
activation checkpointing (`--gradient_checkpointing true`) and eager, on a Llama-style decoder (benchmarks/
decoder.py: 4 layers, hidden 256, intermediate 768, sequence 512, SDPA, CPU by default).

Each configuration runs in a fresh process (the advisor's `run_child`: allocator-level peak above the pre-training
level, median step time after the warm-up); the configurations are interleaved, `--repeats` rounds, and the table
gives each one's median over the rounds and its speed relative to transformers' checkpointing. Writes
benchmarks/level1_vs_checkpointing.json and prints a Markdown table.

    MEMOPT_STACK=torch bash -c 'source scripts/setup_env.sh && \
        $MEMOPT_VENV/bin/python benchmarks/level1_vs_checkpointing.py'
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_benchmark import machine  # noqa: E402

from optimum_memopt.advisor import run_child  # noqa: E402

DECODER = os.path.join(ROOT, "benchmarks", "decoder.py")
MODES = {
    "eager": ["--memory_opt_backend", "none"],
    "transformers checkpointing": ["--memory_opt_backend", "none", "--gradient_checkpointing", "true"],
    "torch backend level 1": ["--memory_opt_backend", "torch", "--memory_opt_level", "1"],
}
REFERENCE = "transformers checkpointing"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="training steps per run (the first is the warm-up)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decoder_args", default="", help="extra arguments for benchmarks/decoder.py, e.g. '--seq 256'")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "level1_vs_checkpointing.json"))
    a = p.parse_args(argv)
    script = [DECODER, "--use_cpu", "--seed", "42", *a.decoder_args.split()]
    runs = {m: [] for m in MODES}
    t0 = time.perf_counter()
    for r in range(a.repeats):
        for mode, flags in MODES.items():
            m = run_child(script, mode, flags, a.batch, a.steps)
            if not m.ok:
                raise SystemExit(f"{mode}: {m.error}")
            runs[mode].append(m)
            print(f"[round {r + 1}] {mode}: {m.step_time_s:.3f} s/step, peak {m.peak_mb:.0f} MiB", flush=True)
    med = {
        m: {
            "step_s": statistics.median(x.step_time_s for x in ms),
            "step_s_all": [round(x.step_time_s, 4) for x in ms],
            "peak_mb": statistics.median(x.peak_mb for x in ms),
            "peak_mb_all": [round(x.peak_mb, 1) for x in ms],
        }
        for m, ms in runs.items()
    }
    ref = med[REFERENCE]["step_s"]
    lines = [
        f"Llama-style decoder, batch {a.batch}, CPU; {a.repeats} interleaved fresh-process rounds, medians "
        f"({time.perf_counter() - t0:.0f} s; {machine()})",
        "",
        "| configuration | s/step (median) | s/step, each round | peak MiB (median) | speed vs transformers' "
        "checkpointing |",
        "|---|---|---|---|---|",
    ]
    for mode, v in med.items():
        rounds = ", ".join(f"{s:.2f}" for s in v["step_s_all"])
        lines.append(f"| {mode} | {v['step_s']:.3f} | {rounds} | {v['peak_mb']:.0f} | {ref / v['step_s']:.2f}x |")
    print("\n".join(lines))
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "machine": machine(), "medians": med}, f, indent=2)


if __name__ == "__main__":
    main()
