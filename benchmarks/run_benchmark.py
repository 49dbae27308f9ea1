#!/usr/bin/env python
"""Side-by-side benchmark, in one run, on the same models and data:

  PyTorch eager | PyTorch + the Trainer's gradient checkpointing | ORTModule | ORTModule level 1 |
  ORTModule with the plans `auto` chooses

For each: peak memory and samples/s at the base batch size, the largest batch size under a fixed
budget, and samples/s at that batch size. The budget is the peak PyTorch eager needs at the base
batch size ("in the memory eager needs for batch B, how large a batch fits?"); `auto` chooses
plans so that twice the base batch fits in it. It also measures the cost of the plugin's
callbacks (step time with and without the memory-phase and input-density callbacks).

Every figure is a fresh process running examples/run_glue/run_glue.py's offline default (see
optimum_memopt.advisor.measure). Writes BENCHMARKS.md (and benchmark.json beside it).

    python benchmarks/run_benchmark.py                       # minutes on 2 CPU cores
    python benchmarks/run_benchmark.py --size deberta-base-shape --seq 256 --batch 16   # full size
"""

import argparse
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from optimum_memopt.advisor import NoFit, choose, format_table, max_batch_size, memory_flags, probe, run_child, verify  # noqa: E402

GLUE = os.path.join(ROOT, "examples", "run_glue", "run_glue.py")
NO_GC = ["--gradient_checkpointing", "false"]


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}; {os.cpu_count()} cores; {mem:.0f} GiB RAM; GPU: {gpu}; Python {platform.python_version()}; torch {torch.__version__}"


def bench_arch(arch, a, log):
    script = [GLUE, "--model_type", arch, "--model_size", a.size, "--offline_train_samples", str(a.samples),
              "--max_seq_length", str(a.seq), "--pad_to_max_length", "--seed", "42"] + ([] if a.cuda else ["--use_cpu"])
    B = a.batch
    modes = [("PyTorch eager", memory_flags(False, extra=NO_GC)),
             ("PyTorch + gradient checkpointing", memory_flags(False, extra=["--gradient_checkpointing", "true"])),
             ("ORTModule", memory_flags(True, extra=NO_GC)),
             ("ORTModule level 1", memory_flags(True, level=1, extra=NO_GC))]
    rows = {}
    for label, flags in modes:
        log(f"[{arch}] {label}: batch {B}")
        rows[label] = {"flags": flags, "base": run_child(script, label, flags, B, a.steps)}
    eager = rows["PyTorch eager"]["base"]
    if not eager.ok:
        raise SystemExit(f"PyTorch eager failed at batch {B}: {eager.error}")
    # 5% headroom: a second run of the same configuration varies by a few percent on this kind of machine.
    budget = eager.peak_mb * (1 + a.headroom)
    log(f"[{arch}] budget = PyTorch eager peak at batch {B} + {a.headroom:.0%}: {budget:,.1f} MiB; probing plans at batch {2 * B}")
    report = probe(script, 2 * B, steps=a.steps, max_plans=a.max_plans, levels=(), progress=log)
    try:
        choice = verify(report, choose(report, budget), budget, a.steps, progress=log)
        auto_flags, auto_note = memory_flags(True, config=choice.config, level=choice.level, extra=NO_GC), choice.describe()
    except NoFit as e:
        choice, auto_flags, auto_note = None, None, str(e)
    if auto_flags:
        label = "ORTModule + auto plans"
        rows[label] = {"flags": auto_flags, "base": run_child(script, label, auto_flags, B, a.steps)}
    for label, row in rows.items():
        best, tried = max_batch_size(script, row["flags"], budget, B, steps=max(3, a.steps - 1), limit=a.max_batch, progress=log)
        row["max_batch"], row["at_max"] = best, (tried.get(best) if best else None)
    log(f"[{arch}] callback cost: ORTModule at batch {B} with memory phases + input density")
    with_cb = run_child(script, "callbacks on", memory_flags(True, extra=NO_GC + ["--print_memory_stats", "true",
                                                                               "--print_input_density", "true"]), B, a.steps + 4)
    without_cb = run_child(script, "callbacks off", memory_flags(True, extra=NO_GC), B, a.steps + 4)
    return {"arch": arch, "script": script, "budget_mb": budget, "rows": rows, "auto_note": auto_note,
            "auto_config": (choice.config or f"level {choice.level}" if choice and choice.level else (choice.config if choice else None)),
            "probe_table": report, "callbacks": (with_cb, without_cb)}


def fmt(x, d=1):
    return "-" if x is None else f"{x:,.{d}f}"


def render(results, a, cmd, elapsed, host):
    out = ["# Benchmarks", "",
           f"Machine: {host}  ", f"Command: `{cmd}`  ", f"Wall time: {elapsed / 60:.1f} min, one run of the command above.", "",
           "Each figure is a fresh process of `examples/run_glue/run_glue.py` (offline default data, sequences padded to "
           f"{a.seq} tokens, model size `{a.size}`) training {a.steps} steps; step time is the median after 2 warm-up steps. "
           "Peak memory: CUDA max allocated, or on CPU the process's resident peak above its level before training "
           "(model built, data ready). Budget for the batch-size search: the PyTorch eager peak at the base batch size "
           f"plus {a.headroom:.0%} (run-to-run noise). "
           "The batch search doubles from the base batch size, then bisects to within 1/8, capped at "
           f"{a.max_batch}. These machines are shared and noisy: compare ratios within a table, not across runs.", ""]
    for r in results:
        rows = r["rows"]
        eager = rows["PyTorch eager"]
        out += [f"## {r['arch']}", "",
                f"Base batch size {a.batch}; budget {r['budget_mb']:,.1f} MiB. `auto` (plans for batch {2 * a.batch} under the budget): "
                f"{r['auto_note']}", "",
                "| mode | peak MiB @ base | vs eager | samples/s @ base | vs eager | max batch under budget | samples/s @ max batch | vs eager @ its max |",
                "|---|---|---|---|---|---|---|---|"]
        e_sps_max = eager["at_max"].samples_per_s if eager.get("at_max") else None
        for label, row in rows.items():
            m = row["base"]
            if not m.ok:
                out.append(f"| {label} | failed: {m.error} | | | | | | |")
                continue
            at = row.get("at_max")
            out.append("| " + " | ".join([
                label, fmt(m.peak_mb), f"{m.peak_mb / eager['base'].peak_mb:.2f}x", fmt(m.samples_per_s, 2),
                f"{m.samples_per_s / eager['base'].samples_per_s:.2f}x", str(row.get("max_batch") or "none"),
                fmt(at.samples_per_s if at else None, 2),
                f"{at.samples_per_s / e_sps_max:.2f}x" if at and e_sps_max else "-"]) + " |")
        w, wo = r["callbacks"]
        if w.ok and wo.ok:
            out += ["", f"Callback cost (ORTModule, batch {a.batch}, {a.steps + 4} steps): step time {w.step_time_s:.3f} s with the "
                        f"memory-phase and input-density callbacks, {wo.step_time_s:.3f} s without: "
                        f"{w.step_time_s / wo.step_time_s:.3f}x."]
        out += ["", f"Probe at batch {2 * a.batch} (what `auto` chose from):", "", format_table(r["probe_table"], markdown=True), ""]
    return "\n".join(out) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="deberta-v2,roberta")
    p.add_argument("--size", default="small", choices=["tiny", "small", "deberta-base-shape", "large"])
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--max_plans", type=int, default=4)
    p.add_argument("--max_batch", type=int, default=128)
    p.add_argument("--headroom", type=float, default=0.05, help="budget = PyTorch eager peak at the base batch x (1 + this)")
    p.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
    a = p.parse_args(argv)
    import torch

    a.cuda = torch.cuda.is_available()
    t0 = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    results = [bench_arch(arch, a, log) for arch in a.archs.split(",")]
    cmd = "python benchmarks/run_benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(results, a, cmd.strip(), time.time() - t0, machine())
    with open(a.out, "w") as f:
        f.write(text)
    data = [{"arch": r["arch"], "budget_mb": r["budget_mb"], "auto": r["auto_note"],
             "rows": {k: {"base": v["base"].as_dict(), "max_batch": v.get("max_batch"),
                          "at_max": v["at_max"].as_dict() if v.get("at_max") else None} for k, v in r["rows"].items()}}
            for r in results]
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump(data, f, indent=2)
    print(text)


if __name__ == "__main__":
    main()
