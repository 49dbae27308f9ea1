#!/usr/bin/env python
"""The torch backend's benchmark, on the modern stack, in one run, on the same models and data:

  PyTorch eager | the Trainer's gradient checkpointing | torch.compile with
  `torch._functorch.config.activation_memory_budget` | the torch backend's level 1 | its single plans (the probe) |
  the plans `auto` chooses

For each: peak memory (allocator-level and resident) and samples/s at the base batch size, the largest batch under
a fixed budget, and samples/s there; for each plan, its measured saving next to its table figure. The budget is
PyTorch eager's peak at the base batch (+5% for run-to-run noise); `auto` chooses plans so that twice the base
batch fits in it, and the run compares them with gradient checkpointing at that batch (the target: >= 1.15x its
samples/s at no more memory).

Every figure is a fresh process of examples/run_glue/run_glue.py's offline default (optimum_memopt.advisor.measure).
Writes its section of BENCHMARKS.md (between the `torch-backend` markers; the ORT benchmark keeps it) and
benchmarks/torch_backend.json.

    MEMOPT_STACK=torch bash -c 'source scripts/setup_env.sh && $MEMOPT_VENV/bin/python benchmarks/torch_backend.py'
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_benchmark import base_parser, machine, rows_json  # noqa: E402

from optimum_memopt.advisor import advise, format_table, max_batch_size, memory_flags, run_child  # noqa: E402

GLUE = os.path.join(ROOT, "examples", "run_glue", "run_glue.py")
COMPILE = os.path.join(ROOT, "benchmarks", "compile_budget.py")
NO_GC = ["--gradient_checkpointing", "false"]
START, END = "<!-- torch-backend:start -->", "<!-- torch-backend:end -->"


def bench_arch(arch, a, log):
    script = [GLUE, "--model_type", arch, "--model_size", a.size, "--offline_train_samples", str(a.samples)]
    script += ["--max_seq_length", str(a.seq), "--pad_to_max_length", "--seed", "42", "--use_cpu"]
    script += ["--memory_opt_backend", "torch"]
    compiled = [COMPILE, str(a.compile_budget), *script]
    B = a.batch
    modes = [
        ("PyTorch eager", script, memory_flags(False, extra=NO_GC)),
        ("PyTorch + gradient checkpointing", script, memory_flags(False, extra=["--gradient_checkpointing", "true"])),
        (
            f"torch.compile, activation_memory_budget {a.compile_budget:g}",
            compiled,
            memory_flags(False, extra=[*NO_GC, "--torch_compile", "true"]),
        ),
        ("torch backend level 1", script, memory_flags(True, level=1, extra=NO_GC)),
    ]
    rows = {}
    for label, argv, flags in modes:
        log(f"[{arch}] {label}: batch {B}")
        rows[label] = {"argv": argv, "flags": flags, "base": run_child(argv, label, flags, B, a.steps)}
    eager = rows["PyTorch eager"]["base"]
    if not eager.ok:
        raise SystemExit(f"PyTorch eager failed at batch {B}: {eager.error}")
    budget = eager.peak_mb * (1 + a.headroom)
    log(f"[{arch}] budget = eager peak at batch {B} + {a.headroom:.0%}: {budget:,.1f} MiB; advice for batch {2 * B}")
    advice = advise(script, 2 * B, budget_mb=budget, steps=a.steps, max_plans=a.max_plans, levels=(1,), progress=log)
    choice = advice.choice
    if choice is not None:
        flags = memory_flags(True, config=choice.config, level=choice.level, extra=NO_GC)
        rows["torch backend + auto plans"] = {
            "argv": script,
            "flags": flags,
            "base": run_child(script, "auto", flags, B, a.steps),
        }
    for label, row in rows.items():
        steps = 4 if "compile" in label else max(3, a.steps - 1)
        best, tried = max_batch_size(
            row["argv"], row["flags"], budget, B, steps=steps, limit=a.max_batch, progress=log
        )
        row["max_batch"], row["at_max"], row["tried"] = best, (tried.get(best) if best else None), tried
    # the target: at twice the base batch, under the budget, auto's plans against gradient checkpointing
    at_2b = {}
    for label in ("PyTorch + gradient checkpointing", "torch backend + auto plans"):
        if label in rows:
            row = rows[label]
            m = row["tried"].get(2 * B) or run_child(row["argv"], f"{label} @ {2 * B}", row["flags"], 2 * B, a.steps)
            at_2b[label] = m
    # and at 1.5x, where plans alone may fit: auto asked for that batch, against gradient checkpointing there
    mid = (3 * B) // 2
    log(f"[{arch}] advice for batch {mid} under the same budget")
    advice_mid = advise(script, mid, budget_mb=budget, steps=a.steps, max_plans=a.max_plans, levels=(1,), progress=log)
    at_mid = {}
    if advice_mid.choice is not None:
        c = advice_mid.choice
        auto_flags = memory_flags(True, config=c.config, level=c.level, extra=NO_GC)
        gc_flags = rows["PyTorch + gradient checkpointing"]["flags"]
        at_mid["PyTorch + gradient checkpointing"] = run_child(script, f"gc @ {mid}", gc_flags, mid, a.steps)
        at_mid["torch backend + auto plans"] = run_child(script, f"auto @ {mid}", auto_flags, mid, a.steps)
    return {
        "arch": arch,
        "budget_mb": budget,
        "rows": rows,
        "advice": advice,
        "at_2b": at_2b,
        "advice_mid": advice_mid,
        "at_mid": at_mid,
    }


def _versus(r, key, batch, what):
    gc, auto = r[key].get("PyTorch + gradient checkpointing"), r[key].get("torch backend + auto plans")
    if gc is None or auto is None or not (gc.ok and auto.ok):
        return f"At batch {batch}: no comparison (a run failed, or auto found nothing that fits)."
    fits = auto.peak_mb <= r["budget_mb"] and gc.peak_mb <= r["budget_mb"]
    return (
        f"At batch {batch} ({what}) under the budget: auto's choice {fmt(auto.samples_per_s, 2)} samples/s at peak "
        f"{fmt(auto.peak_mb)} MiB, gradient checkpointing {fmt(gc.samples_per_s, 2)} at {fmt(gc.peak_mb)} MiB: "
        f"**{auto.samples_per_s / gc.samples_per_s:.2f}x**"
        + ("" if fits else " (one of the two is over the budget in this run)")
        + "."
    )


def fmt(x, d=1):
    return "-" if x is None else f"{x:,.{d}f}"


def render(results, a, cmd, elapsed, host):
    out = [
        START,
        "## The torch backend (modern stack)",
        "",
        f"Machine: {host}  ",
        f"Command: `{cmd}`  ",
        f"Wall time: {elapsed / 60:.1f} min, one run of the command above.",
        "",
        "As above, each figure is a fresh process of the GLUE recipe (offline data, sequences padded to "
        f"{a.seq} tokens, model size `{a.size}`), here on torch 2.13 / transformers 5.23 with "
        "`--memory_opt_backend torch`; peak = allocator bytes in use (mallinfo2) above the pre-training level, "
        "resident peak beside it; budget = PyTorch eager's peak at the base batch + 5%. torch.compile's rows "
        "include no compile time (step time is the median after 2 warm-up steps).",
        "",
    ]
    for r in results:
        rows, B = r["rows"], a.batch
        eager = rows["PyTorch eager"]
        e_sps = eager["base"].samples_per_s
        e_max = eager["at_max"].samples_per_s if eager.get("at_max") else None
        c = r["advice"].choice
        out += [
            f"### {r['arch']}",
            "",
            f"Base batch {B}; budget {r['budget_mb']:,.1f} MiB. `auto` for batch {2 * B}: "
            + (c.describe() if c else r["advice"].no_fit),
            "",
            "| mode | peak MiB @ base | resident peak MiB | samples/s @ base | vs eager | max batch under budget | "
            "samples/s @ max batch | vs eager @ its max |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, row in rows.items():
            m = row["base"]
            mx = row.get("at_max")
            if not m.ok:
                out.append(f"| {label} | failed: {m.error} | | | | | | |")
                continue
            out.append(
                f"| {label} | {fmt(m.peak_mb)} | {fmt(m.resident_peak_mb)} | {fmt(m.samples_per_s, 2)} | "
                f"{m.samples_per_s / e_sps:.2f}x | {row.get('max_batch') or '-'} | "
                f"{fmt(mx.samples_per_s, 2) if mx else '-'} | "
                f"{(mx.samples_per_s / e_max):.2f}x |"
                if mx and e_max
                else f"| {label} | {fmt(m.peak_mb)} | {fmt(m.resident_peak_mb)} | {fmt(m.samples_per_s, 2)} | "
                f"{m.samples_per_s / e_sps:.2f}x | {row.get('max_batch') or '-'} | - | - |"
            )
        cm = r["advice_mid"].choice
        out += [
            "",
            _versus(r, "at_2b", 2 * B, "twice eager's; the target is >= 1.15x")
            + f" auto chose: {c.config or f'level {c.level}'}."
            if c
            else _versus(r, "at_2b", 2 * B, "twice eager's"),
            "",
            _versus(r, "at_mid", (3 * B) // 2, "1.5x eager's")
            + (f" auto chose: {cm.describe()}" if cm else f" auto: {r['advice_mid'].no_fit}"),
        ]
        out += [
            "",
            f"Probe at batch {2 * B} (each plan alone; the table figure is the bytes the first step measured):",
            "",
            format_table(r["advice"].probe, markdown=True),
            "",
        ]
    out.append(END)
    return "\n".join(out) + "\n"


def write_section(path, section):
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section.rstrip("\n") + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(path, "w") as f:
        f.write(text)


def main(argv=None):
    p = base_parser(__doc__)
    p.add_argument("--compile_budget", type=float, default=0.5)
    a = p.parse_args(argv)
    t0 = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    results = [bench_arch(arch, a, log) for arch in a.archs.split(",")]
    cmd = "python benchmarks/torch_backend.py " + " ".join(sys.argv[1:] if argv is None else argv)
    section = render(results, a, cmd.strip(), time.time() - t0, machine())
    write_section(a.out, section)
    data = [
        {
            "arch": r["arch"],
            "budget_mb": r["budget_mb"],
            "advice": r["advice"].to_dict(),
            "at_2b": {k: v.as_dict() for k, v in r["at_2b"].items()},
            "advice_mid": r["advice_mid"].to_dict(),
            "at_mid": {k: v.as_dict() for k, v in r["at_mid"].items()},
            "rows": rows_json(r["rows"]),
        }
        for r in results
    ]
    with open(os.path.join(ROOT, "benchmarks", "torch_backend.json"), "w") as f:
        json.dump(data, f, indent=2)
    print(section)


if __name__ == "__main__":
    main()
