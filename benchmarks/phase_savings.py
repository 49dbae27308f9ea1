#!/usr/bin/env python
"""What the memory phases show on the GLUE recipe's default model, and how a plan's measured saving compares
with the saving ORT predicts for it.

Runs examples/run_glue/run_glue.py (small DeBERTa-v2 built in code, sequences padded to a fixed length so
every batch has the first batch's shapes) once per configuration, each in a fresh process, with
`--print_memory_stats`, then reads `memory_phases.csv` and `memory_plans.json`:

* held after forward = post_forward - pre_forward (activations kept for backward), median over the
  recorded steps after the first `--skip` ones;
* released by backward = post_forward - post_backward;
* measured saving of a plan = held without recompute - held with it, set beside ORT's predicted saving
  of the plans it applied (for the first batch, which here has every batch's shapes).

    python benchmarks/phase_savings.py --out docs/PHASE_SAVINGS.md
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = os.path.join(ROOT, "examples", "run_glue", "run_glue.py")
CONFIGS = [
    ("PyTorch (no ORT)", ["--use_ort", "false"]),
    ("ORT, no recompute", []),
    ("ORT, Gelu+:1:-1", ["--memory_opt_config", "Gelu+:1:-1"]),
    ("ORT, level 1", ["--memory_opt_level", "1"]),
]


def run(label, flags, a, work):
    out = os.path.join(work, label.replace(" ", "_").replace(",", "").replace(":", "").replace("+", ""))
    cmd = [
        sys.executable,
        GLUE,
        "--output_dir",
        out,
        "--overwrite_output_dir",
        "--do_train",
        "--do_eval",
        "false",
        "--model_size",
        a.size,
        "--max_steps",
        str(a.steps),
        "--per_device_train_batch_size",
        str(a.batch),
        "--max_seq_length",
        str(a.seq),
        "--pad_to_max_length",
        "--offline_train_samples",
        "600",
        "--logging_steps",
        "1000",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--disable_tqdm",
        "true",
        "--print_memory_stats",
        "--seed",
        "42",
        *([] if a.cuda else ["--use_cpu"]),
        *flags,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"{label} failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "memory_phases.csv")) as f:
        rows = list(csv.DictReader(f))
    by_step = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), {})[r["phase"]] = float(r["in_use_mb"])
    steady = [p for s, p in sorted(by_step.items()) if s >= a.skip and len(p) == 4]
    held = statistics.median(p["post_forward"] - p["pre_forward"] for p in steady)
    released = statistics.median(p["post_forward"] - p["post_backward"] for p in steady)
    plans_path = os.path.join(out, "memory_plans.json")
    predicted = None
    if os.path.exists(plans_path):
        with open(plans_path) as f:
            report = json.load(f)
        predicted = sum(p["saving_bytes"] or 0 for p in report["plans"] if p["enabled"]) / 2**20
    return {
        "label": label,
        "held": held,
        "released": released,
        "predicted": predicted,
        "steps": len(steady),
        "rows": [(s, p) for s, p in sorted(by_step.items())],
    }


def fmt(x):
    return "-" if not x else f"{x:.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="recorded steps left out at the start (export, warm-up)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    import torch

    a.cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as work:
        results = [run(label, flags, a, work) for label, flags in CONFIGS]
    base = next(r for r in results if r["label"] == "ORT, no recompute")
    lines = [
        f"Command: `python benchmarks/phase_savings.py {' '.join(sys.argv[1:] if argv is None else argv)}`".strip(),
        "",
        f"Model `{a.size}` DeBERTa-v2, batch {a.batch}, sequences padded to {a.seq}; "
        f"{'CUDA allocated' if a.cuda else 'CPU allocator bytes in use (mallinfo2)'}; medians over steps "
        f">= {a.skip} of {a.steps}.",
        "",
        "| configuration | held after forward MiB | released by backward MiB | measured saving MiB "
        "| ORT's predicted saving MiB | measured / predicted |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        saving = base["held"] - r["held"] if r["label"].startswith("ORT") else None
        ratio = saving / r["predicted"] if saving is not None and r["predicted"] else None
        lines.append(
            f"| {r['label']} | {r['held']:.1f} | {r['released']:.1f} | "
            f"{'-' if saving is None or r is base else f'{saving:.1f}'} | "
            f"{fmt(r['predicted'])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    for r in results:
        print(r["label"], [(s, {k: round(v, 1) for k, v in ph.items()}) for s, ph in r["rows"][:6]])
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
