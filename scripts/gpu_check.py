#!/usr/bin/env python
"""The GPU kit (`bash scripts/gpu_check.sh`): on a machine with a CUDA GPU where torch and transformers are already
installed (other minor versions than the pins allowed) and nothing can be downloaded, run every GPU test and the
GPU benchmarks at GPU size, and write one report file (Markdown, its raw figures in a JSON block at the end).

1. The environment: the GPU, its memory, the versions of everything the plugin touches; what is missing is said
   (DeepSpeed's test is skipped without it, the LoRA test without PEFT).
2. The GPU tests: `tests/test_gpu_torch.py` (dropout's random state, bf16 / fp16 autocast, memory phases, `Loss+`,
   `auto` under a budget with its picture, ZeRO-2 with FusedAdam) and `tests/test_random_streams.py` (a run with
   dropout and LoRA dropout, with plans, level 1, `Loss+` and `auto`, against the run without the plugin), on CUDA.
3. The benchmarks, each configuration a fresh process (the advisor's `run_child`: CUDA's peak of tensor bytes, the
   median step after the warm-up), `--rounds` interleaved rounds:
   a. whole-layer recompute: eager, transformers' checkpointing and our level 1 on the decoder of
      benchmarks/level1_vs_checkpointing_h100.json (8 layers, hidden 1024, sequence 2048, bf16, batch 8);
   b. the loss in the solve: the same decoder with a vocabulary 32 times its hidden size, eager at `--base_batch`
      (its peak is the budget), then at twice and four times that batch (`--multiples`): checkpointing,
      checkpointing with the loss chunked by hand, and `auto` under the budget (its choice, its predicted and
      measured peak);
   c. the dry run (`optimum_memopt.planning`) of benchmark a's decoder beside what the device measured, and on CUDA
      the same steps on real tensors under the dry run's count beside CUDA's own peak counter.

Without a GPU it stops at once, saying so (exit 2); `--cpu` runs the same steps on the CPU at a tiny size, which is
how the suite checks this script (tests/test_gpu_kit.py).

    bash scripts/gpu_check.sh                      # report in gpu_check/gpu_check.md (or $OUT/ where set)
    python scripts/gpu_check.py --out DIR --rounds 1 --skip_tests
"""

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DECODER = os.path.join(ROOT, "benchmarks", "decoder.py")
GPU_TESTS = ["tests/test_gpu_torch.py", "tests/test_random_streams.py"]
# the decoder of benchmarks/level1_vs_checkpointing_h100.json, and a CPU size small enough for the suite
SIZES = {
    "gpu": ["--layers", "8", "--hidden", "1024", "--intermediate", "2816", "--heads", "16", "--seq", "2048"],
    "cpu": ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "2", "--seq", "64"],
}
PACKAGES = ["torch", "transformers", "accelerate", "peft", "deepspeed", "trl", "matplotlib", "pytest"]


def environment(device: str) -> dict:
    env = {"python": platform.python_version(), "packages": {}, "missing": []}
    for name in PACKAGES:
        try:
            env["packages"][name] = importlib.import_module(name).__version__
        except Exception as e:  # not installed, or broken: said in the report
            env["missing"].append(f"{name} ({type(e).__name__})")
    import torch

    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_mib"] = round(props.total_memory / 2**20)
        env["cuda"] = torch.version.cuda
        env["capability"] = "{}.{}".format(*torch.cuda.get_device_capability())
    return env


def run_tests(out: str, selection, timeout: float) -> dict:
    """The GPU tests in a pytest process of their own; each test's outcome, read from its JUnit XML."""
    xml = os.path.join(out, "gpu_tests.xml")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={xml}", *selection]
    began = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, tail = done.returncode, (done.stdout + done.stderr)[-6000:]
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code, tail = "timeout", f"pytest ran past {timeout:.0f} s: {out[-3000:]}"
    result = {"command": " ".join(command[1:]), "exit": code, "seconds": round(time.perf_counter() - began, 1)}
    cases = []
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                found = case.find(kind)
                if found is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    if kind == "skipped" and found.get("type") == "pytest.xfail":  # junit writes an xfail as skipped
                        outcome = "xfailed"
                    message = (found.get("message") or found.text or "")[:800]
                    break
            name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
        os.remove(xml)
    result["cases"] = cases
    kinds = ("passed", "failed", "error", "skipped", "xfailed")
    result["counts"] = {k: sum(c["outcome"] == k for c in cases) for k in kinds}
    if code not in (0, 5) or not cases:  # 5: nothing collected
        result["tail"] = tail
    return result


def measure(script, label: str, flags, batch: int, steps: int) -> dict:
    from optimum_memopt.advisor import run_child

    m = run_child(script, label, flags, batch, steps)
    row = {"config": label, "batch": batch, "ok": m.ok, "peak_mib": m.peak_mb, "step_s": m.step_time_s}
    if not m.ok:
        row["error"] = m.error
        row["out_of_memory"] = m.oom
    if m.auto is not None:
        row["auto"] = m.auto
    print(
        f"  {label} at batch {batch}: "
        + (f"{m.peak_mb:,.1f} MiB, {m.step_time_s:.4f} s/step" if m.ok else f"failed: {m.error}"),
        flush=True,
    )
    return row


def interleaved(rounds: int, runs) -> list:
    """`runs`: (label, script, flags, batch); each measured once a round, the rounds interleaved; medians."""
    seen = {}
    for r in range(rounds):
        print(f"[round {r + 1} of {rounds}]", flush=True)
        for label, script, flags, batch, steps in runs:
            seen.setdefault((label, batch), []).append(measure(script, label, flags, batch, steps))
    rows = []
    for (label, batch), ms in seen.items():
        ok = [m for m in ms if m["ok"]]
        row = {"config": label, "batch": batch, "rounds": ms}
        if ok:
            row["peak_mib"] = max(m["peak_mib"] for m in ok)
            row["step_s"] = statistics.median(m["step_s"] for m in ok)
            row["samples_per_s"] = batch / row["step_s"]
        row["failed"] = len(ms) - len(ok)
        rows.append(row)
    return rows


def benchmarks(a, device: str, save) -> dict:
    """`save(out)` is called after each part, so that a run stopped midway leaves the parts it finished."""
    base = [DECODER, "--seed", "42", *SIZES["gpu" if device == "cuda" else "cpu"]]
    if device == "cpu":
        base.append("--use_cpu")
    half = ["--bf16", "true"] if device == "cuda" else []
    plain = ["--memory_opt_backend", "none", *half]
    torch_flags = ["--memory_opt_backend", "torch", *half]
    whole = [
        ("eager", base, plain, a.batch, a.steps),
        ("transformers checkpointing", base, plain + ["--gradient_checkpointing", "true"], a.batch, a.steps),
        ("ours: level 1", base, torch_flags + ["--memory_opt_level", "1"], a.batch, a.steps),
    ]
    print("benchmark a: whole-layer recompute", flush=True)
    out = {"whole_layers": {"decoder": " ".join(base[1:] + half), "rows": interleaved(a.rounds, whole)}}
    save(out)
    print("benchmark c: the dry run of benchmark a's decoder beside the device", flush=True)
    measured = {r["config"]: r.get("peak_mib") for r in out["whole_layers"]["rows"]}
    out["dry_run"] = dry_run_check(device, a.batch, measured)
    save(out)

    hidden = int(dict(zip(base[3::2], base[4::2]))["--hidden"])
    vocab_script = base + ["--vocab", str(32 * hidden)]
    print("benchmark b: the loss in the solve (eager's peak at the base batch is the budget)", flush=True)
    eager = measure(vocab_script, "eager", plain, a.base_batch, a.steps)
    result = {"decoder": " ".join(vocab_script[1:] + half), "eager_at_base": eager, "rows": []}
    if eager["ok"]:
        budget = eager["peak_mib"]
        result["budget_mib"] = budget
        runs = []
        for batch in (m * a.base_batch for m in a.multiples):
            runs += [
                ("transformers checkpointing", vocab_script, plain + ["--gradient_checkpointing", "true"], batch),
                (
                    "whole layers + the loss chunked by hand (Layer+:1:-1,Loss+:1:-1@chunks8)",
                    vocab_script,
                    torch_flags + ["--memory_opt_config", "Layer+:1:-1,Loss+:1:-1@chunks8"],
                    batch,
                ),
                (
                    "ours: auto",
                    vocab_script,
                    torch_flags + ["--memory_opt_config", "auto", "--memory_budget_mb", f"{budget:.1f}"],
                    batch,
                ),
            ]
        result["rows"] = interleaved(a.rounds, [(*r, a.steps) for r in runs])
        for row in result["rows"]:
            if "peak_mib" in row:
                row["fits"] = row["peak_mib"] <= budget
    out["loss_in_the_solve"] = result
    save(out)
    return out


def dry_run_check(device: str, batch: int, measured: dict) -> dict:
    """Benchmark a's decoder dry-run on fake tensors (on the CPU, counted as CUDA counts) beside what the device
    measured; and, on CUDA, the same steps on real tensors under the same count beside CUDA's own peak counter: what
    the count cannot see (the libraries' workspaces, an op's scratch) is their difference."""
    from transformers import LlamaConfig

    from optimum_memopt.planning.devices import WORKSPACES_MIB
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    size = dict(
        zip(SIZES["gpu" if device == "cuda" else "cpu"][::2], SIZES["gpu" if device == "cuda" else "cpu"][1::2])
    )
    hidden, heads = int(size["--hidden"]), int(size["--heads"])
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=int(size["--intermediate"]),
        num_hidden_layers=int(size["--layers"]),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=int(size["--seq"]),
    )
    spec = StepSpec(config, batch=batch, seq=int(size["--seq"]), autocast="bfloat16" if device == "cuda" else None)
    rows = []
    for label, kw in (
        ("eager", dict(backend=False)),
        ("transformers checkpointing", dict(checkpointing=True)),
        ("ours: level 1", dict(level=1)),
    ):
        row = {"config": label, "measured_mib": measured.get(label)}
        fake = dry_run(spec, **kw, held_bytes=int(WORKSPACES_MIB * 2**20) if device == "cuda" else 0)
        row["dry_run_mib"] = fake.peak_bytes / 2**20
        row["dry_run_seconds"] = fake.seconds
        if device == "cuda":
            row.update(beside_the_allocator(spec, kw))
        rows.append(row)
        print(f"  {label}: {row}", flush=True)
    return {"decoder": f"{size} batch {batch}", "rows": rows}


def beside_the_allocator(spec, kw) -> dict:
    """The dry run's steps on CUDA's real tensors under the dry run's count, CUDA's caching allocator read around every
    op: its peak over the run beside the count's (what the count cannot see is their difference), the count when the
    device was at its highest, and the ops that allocate most inside themselves and free it before they return
    (workspaces and scratch: the count sees an op's outputs only)."""
    import torch

    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch import fake_step as module
    from optimum_memopt.backends.torch.measure.live import make_library_workspaces
    from optimum_memopt.planning.dry_run import dry_run

    class AllocatorBeside(module.PartsCount):
        def __init__(self, device: str = "cpu"):
            super().__init__(device)
            self.inside = {}  # op -> (the most it held inside itself past its inputs and outputs, its inputs then)
            self.device_top, self.counted_then, self.op_then, self.where_then = 0, 0, "", ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before, counted = torch.cuda.memory_allocated(), self.current
            torch.cuda.reset_peak_memory_stats()
            out = super().__torch_dispatch__(func, types, args, kwargs)
            top, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            name = _torch_api.op_name(func)
            held = top - max(before, after)
            if held > self.inside.get(name, (0, ""))[0]:
                shapes = [f"{str(t.dtype)[6:]}{list(t.shape)}" for t in module.tensors_in(args)]
                self.inside[name] = (held, f"{', '.join(shapes)} {kwargs or ''}".strip())
            if top > self.device_top:
                self.device_top, self.counted_then = top, max(counted, self.current)
                self.op_then, self.where_then = name, f"step {self.step}, {self.where}"
            return out

    seen = {}

    class Kept(AllocatorBeside):
        def __init__(self, device: str = "cpu"):
            super().__init__(device)
            seen["count"] = self

    torch.cuda.empty_cache()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # made again below, and measured
    if clear is not None:
        clear()
    start = torch.cuda.memory_allocated()
    made = make_library_workspaces(torch.device("cuda"))
    original, module.PartsCount = module.PartsCount, Kept
    try:
        real = dry_run(spec, fake=False, device="cuda", held_bytes=made, **kw)
    finally:
        module.PartsCount = original
    count = seen["count"]
    mib = 2**20
    inside = sorted(((n, b, a) for n, (b, a) in count.inside.items() if b > 0), key=lambda x: -x[1])[:6]
    return {
        "workspaces_mib": made / mib,
        "real_count_mib": real.peak_bytes / mib,
        "cuda_peak_mib": (count.device_top - start) / mib,
        "count_at_cuda_peak_mib": count.counted_then / mib,
        "unseen_at_cuda_peak_mib": (count.device_top - start - count.counted_then) / mib,
        "op_at_cuda_peak": f"{count.op_then} ({count.where_then})",
        "scratch_inside_ops_mib": {name: round(b / mib, 2) for name, b, _ in inside},
        "scratch_inside_ops_inputs": {name: inputs for name, _, inputs in inside},
    }


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "# GPU check",
        "",
        f"{report['when']}; {env.get('gpu', report['device'])}"
        + (
            f" ({env['gpu_memory_mib']:,} MiB, CUDA {env['cuda']}, capability {env['capability']})"
            if "gpu" in env
            else ""
        )
        + f"; Python {env['python']}; "
        + ", ".join(f"{k} {v}" for k, v in env["packages"].items())
        + (f"; missing: {', '.join(env['missing'])}" if env["missing"] else "")
        + f". {report['seconds']:.0f} s in all"
        + ("." if report.get("finished", True) else ", and not finished: the parts below are those that ended."),
        "",
    ]
    tests = report.get("tests")
    if tests is not None:
        c = tests["counts"]
        lines += [
            "## Tests",
            "",
            f"`{tests['command']}`: exit {tests['exit']}, {c['passed']} passed, {c['failed']} failed, "
            f"{c['error']} errors, {c['skipped']} skipped, {c.get('xfailed', 0)} expected to fail and failed "
            f"({tests['seconds']:.0f} s)",
            "",
            "| test | outcome | s | message |",
            "|---|---|---|---|",
        ]
        for case in tests["cases"]:
            message = case["message"].replace("|", "/").replace("\n", " ")[:200]
            lines.append(f"| {case['test']} | {case['outcome']} | {case['seconds']:.1f} | {message} |")
        if "tail" in tests:
            lines += ["", "```text", tests["tail"][-3000:], "```"]
        lines.append("")
    bench = report.get("benchmarks")
    if bench is not None:
        lines += ["## Benchmarks", "", "Peak: the device's peak over the run (MiB); s/step: the median step.", ""]
        for key, title in (("whole_layers", "Whole-layer recompute"), ("loss_in_the_solve", "The loss in the solve")):
            part = bench.get(key)
            if part is None:
                continue
            lines += [f"### {title}", "", f"`benchmarks/decoder.py {part['decoder']}`", ""]
            if key == "loss_in_the_solve":
                e = part["eager_at_base"]
                if not e["ok"]:
                    lines += [f"eager at batch {e['batch']} failed: {e.get('error')}", ""]
                    continue
                lines += [f"Budget: eager's peak at batch {e['batch']}, {part['budget_mib']:,.1f} MiB.", ""]
            lines += ["| configuration | batch | peak MiB | s/step | samples/s | note |", "|---|---|---|---|---|---|"]
            for row in part["rows"]:
                if "peak_mib" not in row:
                    note = row["rounds"][0].get("error", "failed")
                    lines.append(f"| {row['config']} | {row['batch']} | - | - | - | {note[:120]} |")
                    continue
                note = []
                if "fits" in row:
                    note.append("fits" if row["fits"] else "over the budget")
                auto = row["rounds"][-1].get("auto")
                if auto:
                    note.append(
                        f"chose `{auto['config'] or 'nothing'}`, predicted {auto['predicted_peak_mb']:,.1f} MiB"
                        + (f", checked {auto['measured_peak_mb']:,.1f}" if auto.get("measured_peak_mb") else "")
                    )
                lines.append(
                    f"| {row['config']} | {row['batch']} | {row['peak_mib']:,.1f} | {row['step_s']:.4f} | "
                    f"{row['samples_per_s']:,.1f} | {'; '.join(note)} |"
                )
            lines.append("")
    dry = (bench or {}).get("dry_run")
    if dry is not None:
        lines += [
            "### The dry run beside the device",
            "",
            "Benchmark a's decoder. Dry run: fake tensors on the CPU, storages counted as CUDA counts them (the whole "
            "run's peak, weights included), with cuBLAS's workspaces as a plan for a card counts them "
            "(`devices.WORKSPACES_MIB`, on CUDA only). Real count: the same steps on CUDA under the same count, with "
            "the workspaces made and measured before them; CUDA's peak: `max_memory_allocated` over them, the level "
            "before the workspaces taken off; unseen: CUDA's peak less the count at that moment (an op's scratch, the "
            "allocator's whole blocks). Measured: benchmark a's peak.",
            "",
            "| configuration | measured MiB | dry run MiB | dry vs measured | real count MiB | CUDA's peak MiB "
            "| unseen at CUDA's peak MiB | the op then | most scratch inside one op |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in dry["rows"]:
            m = row.get("measured_mib")
            diff = f"{100 * (row['dry_run_mib'] - m) / m:+.1f}%" if m else "-"
            real = row.get("real_count_mib")
            cuda = row.get("cuda_peak_mib")
            unseen = row.get("unseen_at_cuda_peak_mib")
            scratch = row.get("scratch_inside_ops_mib") or {}
            top = next(iter(scratch.items()), None)
            lines.append(
                f"| {row['config']} | {m or 0:,.1f} | {row['dry_run_mib']:,.1f} | {diff} | "
                f"{'-' if real is None else f'{real:,.1f}'} | {'-' if cuda is None else f'{cuda:,.1f}'} | "
                f"{'-' if unseen is None else f'{unseen:,.1f}'} | {row.get('op_at_cuda_peak', '-')} | "
                f"{'-' if top is None else f'{top[0]}: {top[1]:,.1f} MiB'} |"
            )
        lines.append("")
    lines += ["## Raw figures", "", "```json", json.dumps(report, indent=1, default=str), "```", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu_check"))
    p.add_argument("--cpu", action="store_true", help="the same steps on the CPU at a tiny size (the suite's check)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="training steps a run (the first two are the warm-up)")
    p.add_argument("--batch", type=int, default=8, help="benchmark a's batch")
    p.add_argument("--base_batch", type=int, default=4, help="benchmark b: eager's batch, whose peak is the budget")
    p.add_argument(
        "--multiples", type=int, nargs="+", default=[2, 4], help="benchmark b: its batches, as multiples of eager's"
    )
    p.add_argument("--skip_tests", action="store_true")
    p.add_argument("--skip_benchmarks", action="store_true")
    p.add_argument("--tests", nargs="*", default=None, help=f"what pytest runs (default: {' '.join(GPU_TESTS)})")
    p.add_argument("--test_timeout", type=float, default=900)
    a = p.parse_args(argv)
    import torch

    device = "cpu" if a.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: torch {torch.__version__} sees no CUDA device here (`torch.cuda.is_available()` is False); "
            f"run it on a machine with an NVIDIA GPU and a CUDA build of torch, or pass --cpu to check the kit",
            file=sys.stderr,
        )
        return 2
    os.makedirs(a.out, exist_ok=True)
    began = time.perf_counter()
    report = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": device,
        "environment": environment(device),
    }
    path = os.path.join(a.out, "gpu_check.md")

    def save(part=None, done=False):
        """The report so far (each part as it ends, so a run stopped midway leaves what it finished)."""
        if part is not None:
            report["benchmarks"] = part
        report["seconds"] = time.perf_counter() - began
        report["finished"] = done
        with open(path, "w", encoding="utf-8") as f:
            f.write(markdown(report))

    if not a.skip_tests:
        print("gpu_check: the GPU tests", flush=True)
        report["tests"] = run_tests(a.out, a.tests if a.tests is not None else GPU_TESTS, a.test_timeout)
        save()
    if not a.skip_benchmarks:
        benchmarks(a, device, save)
    save(done=True)
    print(f"gpu_check: the report is in {path}", flush=True)
    failed = report.get("tests", {}).get("exit") not in (None, 0, 5)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
