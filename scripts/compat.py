#!/usr/bin/env python
"""The compatibility matrix: a representative slice of the suite on each transformers minor release.

For each version, the release and whatever of its requirements the project's environment does not
already satisfy are installed with `pip install --target .compat/transformers-<version>` (no
dependencies pulled beyond those), and the slice runs with that directory first on `PYTHONPATH`.
Everything else — torch, onnxruntime-training and its built extensions, DeepSpeed — is the project
environment's own, so nothing big is downloaded or built again.

    .venv/bin/python scripts/compat.py                       # every minor, writes docs/COMPATIBILITY.md
    .venv/bin/python scripts/compat.py --versions 4.57.6     # one release (what CI runs beside the pinned set)
    .venv/bin/python scripts/compat.py --versions 4.46.3,4.57.6 --pythons python3.10,python3.12
        # other interpreters: for each, scripts/setup_env.sh builds the pinned ORT stack in its own venv under
        # .compat/ (torch, ORT and its extensions are per Python), and the slice runs there on those releases;
        # their rows go to the "Other Python versions" section of docs/COMPATIBILITY.md, the rest is kept
"""

import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
import zipfile

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATEST_PATCHES = [
    "4.46.3",
    "4.47.1",
    "4.48.3",
    "4.49.0",
    "4.50.3",
    "4.51.3",
    "4.52.4",
    "4.53.3",
    "4.54.1",
    "4.55.4",
    "4.56.2",
    "4.57.6",
]
# Needed at run time although transformers does not declare it (the newest rule that applies is used):
# 4.52+ calls `accelerator.unwrap_model(..., keep_torch_compile=False)`, which accelerate 1.3 introduced;
# 4.56+ annotates a field with accelerate's `ParallelismConfig`, imported only from accelerate 1.10.1, and
# HfArgumentParser cannot resolve the arguments' types without it.
XDIST = ["-n", "auto", "--dist", "loadgroup"]
EXTRA = [(Version("4.52"), ["accelerate>=1.3,<1.4"]), (Version("4.56"), ["accelerate>=1.10.1,<1.11"])]
SLICE = [
    "tests/test_trainer_args.py",
    "tests/test_callbacks.py",
    "tests/test_hook.py",
    "tests/test_backend_ort.py",
    "tests/test_trainer.py::test_requested_plan_is_on_in_orts_structured_data",
    "tests/test_trainer.py::test_resume_continues_with_uninterrupted_losses",
    "tests/test_trainer.py::test_saved_model_loads_without_onnxruntime",
    "tests/test_trainer.py::test_callbacks_order_files_and_evaluation",
    "tests/test_trainer.py::test_loss_in_graph_with_best_model_at_end_saves_a_final_model_and_counts_right",
    "tests/test_trainer.py::test_gradient_accumulation_reports_every_micro_batch",
    "tests/test_multiprocess.py::test_two_processes[zero2-DeepSpeedEngine]",
    "tests/test_examples.py::test_glue_offline[deberta-config]",
]


def pip(*args):
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True
    )


def missing_requirements(wheel: str) -> list:
    """The release's own requirements (no extras) that the running environment does not satisfy."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            out.append(str(Requirement(f"{req.name}{req.specifier}")))
    return out


def prepare(version: str, base: str) -> tuple:
    target = os.path.join(base, f"transformers-{version}")
    stamp = os.path.join(target, ".memopt-ready")
    wheels = os.path.join(base, "wheels")
    if not os.path.exists(stamp):
        res = pip("download", "--no-deps", "-q", "-d", wheels, f"transformers=={version}")
        if res.returncode:
            raise RuntimeError(res.stderr[-2000:])
        wheel = next(os.path.join(wheels, f) for f in os.listdir(wheels) if f.startswith(f"transformers-{version}-"))
        extra = missing_requirements(wheel)
        rules = [reqs for floor, reqs in EXTRA if Version(version) >= floor]
        if rules:
            extra += [r for r in rules[-1] if not _satisfied(r)]
        res = pip("install", "-q", "--no-deps", "--target", target, wheel, *extra)
        if res.returncode:
            raise RuntimeError(res.stderr[-2000:])
        with open(stamp, "w") as f:
            f.write(" ".join(extra))
    with open(stamp) as f:
        return target, f.read().split()


def _satisfied(req_text: str) -> bool:
    req = Requirement(req_text)
    try:
        return req.specifier.contains(md.version(req.name), prereleases=True)
    except md.PackageNotFoundError:
        return False


def run_slice(version: str, target: str, log_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([target, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    check = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        env=env,
    )
    seen = check.stdout.strip()
    t0 = time.time()
    res = subprocess.run(
        # on pytest-xdist's workers, as README's test command runs the suite (tests/README.md)
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--timeout", "1200", *XDIST, *SLICE],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    log = os.path.join(log_dir, f"transformers-{version}.log")
    with open(log, "w") as f:
        f.write(res.stdout + res.stderr)
    tail = [line for line in res.stdout.splitlines() if " passed" in line or " failed" in line or " error" in line]
    failed = [line.split(" ")[1] for line in res.stdout.splitlines() if line.startswith("FAILED ")]
    return {
        "version": version,
        "imported": seen,
        "ok": res.returncode == 0 and seen == version,
        "summary": tail[-1].strip("= ") if tail else f"exit {res.returncode}",
        "failed": failed,
        "minutes": (time.time() - t0) / 60,
        "log": log,
    }


# What the rows need explained (found with this script; the details are in docs/STACK.md).
NOTES = [
    "4.52: saving a model imports `DTensor` from `torch.distributed.tensor` (public there from torch 2.5 only), so "
    "every `save_model` / checkpoint fails on torch 2.4; `setup.cfg` excludes 4.52.* for that reason.",
    "4.53 and later refuse `torch.load` below torch 2.6 (CVE-2025-32434), so a checkpoint's optimizer and RNG state "
    "cannot be restored on the ORT stack (torch <= 2.4): the hook refuses `resume_from_checkpoint` before training "
    "with that reason, and the resume test checks the refusal there. Saving, reloading and best-model loading "
    "(safetensors) work.",
    "4.51-4.52 load the RNG state with `weights_only=True` and allowlist numpy's types on torch >= 2.6 only; the hook "
    "sets the same allowlist on torch 2.4 for the duration of that load.",
    "4.52-4.55 need accelerate >= 1.3 (`unwrap_model(keep_torch_compile=...)`) and 4.56-4.57 accelerate >= 1.10.1 "
    "(`ParallelismConfig`); neither floor is declared by transformers, and the hook names the one missing.",
    "From 4.50 the model classes' import pulls in `torch._dynamo`, which imports onnxruntime and, through it, "
    "DeepSpeed: the arguments re-import a DeepSpeed left half-built by that chain when a run uses DeepSpeed.",
]


def fresh_install(base: str) -> dict:
    """`pip install '.[cpu,examples]'` into a new venv without the constraints file: what a user gets today.
    Then ORTModule's extensions are built and the GLUE recipe trains a few steps with a plan."""
    venv = os.path.join(base, "fresh-venv")
    py = os.path.join(venv, "bin", "python")
    t0 = time.time()
    steps = [
        [sys.executable, "-m", "venv", "--clear", venv],
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "setuptools", "wheel", "ninja"],
        [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{ROOT}[cpu,examples]"],
        [py, "-m", "onnxruntime.training.ortmodule.torch_cpp_extensions.install"],
        [
            py,
            os.path.join(ROOT, "examples", "run_glue", "run_glue.py"),
            "--output_dir",
            os.path.join(base, "fresh-run"),
            "--overwrite_output_dir",
            "--do_train",
            "--model_size",
            "tiny",
            "--max_steps",
            "4",
            "--use_cpu",
            "--report_to",
            "none",
            "--save_strategy",
            "no",
            "--offline_train_samples",
            "200",
            "--memory_opt_config",
            "Gelu+:1:-1",
            "--print_memory_stats",
        ],
    ]
    for cmd in steps:
        res = subprocess.run(
            cmd, capture_output=True, text=True, cwd=venv if "torch_cpp_extensions" in " ".join(cmd) else ROOT
        )
        if res.returncode:
            return {
                "ok": False,
                "step": " ".join(cmd[:4]),
                "error": (res.stderr or res.stdout)[-1500:],
                "minutes": (time.time() - t0) / 60,
            }
    freeze = subprocess.run([py, "-m", "pip", "freeze"], capture_output=True, text=True).stdout.splitlines()
    wanted = ("torch==", "transformers==", "accelerate==", "onnxruntime-training-cpu==", "numpy==", "tokenizers==")
    resolved = [line for line in freeze if line.lower().startswith(wanted)]
    plans = os.path.join(base, "fresh-run", "memory_plans.json")
    return {"ok": os.path.exists(plans), "resolved": resolved, "minutes": (time.time() - t0) / 60}


def render(results, cmd) -> str:
    py = platform.python_version()
    lines = [
        "# Compatibility",
        "",
        f"transformers minor releases (latest patch of each) with the project's pinned torch, ORT, accelerate "
        f"and DeepSpeed (`constraints.txt`), Python {py}, CPU. Each row runs the same slice of the suite "
        f"(arguments, callbacks, hook, ORT backend, plan data, resume, save/reload without ORT, loss in graph "
        f"with best model at end, gradient accumulation, one 2-process ZeRO-2 run, one recipe).",
        "",
        f"Run {datetime.date.today().isoformat()} with `{cmd}`.",
        "",
        "| transformers | result | tests | also installed | minutes |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        extra = ", ".join(r.get("extra") or []) or "-"
        what = "pass" if r["ok"] else ("FAIL: " + ", ".join(r["failed"][:4]) if r["failed"] else "FAIL")
        lines.append(f"| {r['version']} | {what} | {r['summary']} | {extra} | {r['minutes']:.1f} |")
    lines += ["", "Notes:", ""] + [f"- {n}" for n in NOTES]
    return "\n".join(lines) + "\n"


PY_START, PY_END = "<!-- pythons:start -->", "<!-- pythons:end -->"


def _section(path: str):
    """The other-Python section of an existing table file, markers included ('' if none)."""
    try:
        text = open(path).read()
    except OSError:
        return ""
    if PY_START in text and PY_END in text:
        return text[text.index(PY_START) : text.index(PY_END) + len(PY_END)]
    return ""


def _write(path: str, main_text: str = None, section: str = None) -> None:
    """Write the main table and/or the other-Python section, keeping whichever is not given."""
    old = open(path).read() if os.path.exists(path) else ""
    if main_text is None:
        main_text = old.replace(_section(path), "").rstrip() + "\n" if old else "# Compatibility\n"
    if section is None:
        section = _section(path)
    with open(path, "w") as f:
        f.write(main_text.rstrip() + "\n" + (f"\n{section}\n" if section else ""))


# What makes the ORT stack (constraints.txt's versions of these are kept for the other Pythons; the rest of that
# file is the verified set for Python 3.11 and may not exist for another, e.g. pandas 3 needs Python >= 3.11).
STACK_PINS = {
    "pip", "setuptools", "wheel", "ninja", "torch", "onnxruntime-training-cpu", "transformers", "accelerate",
    "deepspeed", "numpy", "tokenizers", "safetensors", "trl", "optimum", "torch-ort", "datasets",
}  # fmt: skip


def stack_pins(path: str) -> str:
    """A constraints file with constraints.txt's pins of the stack's own packages only."""
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        keep = [line for line in f if "==" in line and line.split("==")[0].strip().lower() in STACK_PINS]
    with open(path, "w") as f:
        f.write("# constraints.txt's pins of the ORT stack's own packages (scripts/compat.py --pythons)\n")
        f.writelines(keep)
    return path


def _failed(python: str, versions: str, summary: str, setup_minutes: float) -> dict:
    return {"python": python, "version": versions, "ok": False, "summary": summary, "failed": [], "minutes": 0.0,
            "extra": [], "setup_minutes": setup_minutes}  # fmt: skip


def other_python(interp: str, versions: str, base: str) -> list:
    """Build the pinned ORT stack for another interpreter with scripts/setup_env.sh and run the slice there."""
    try:
        res = subprocess.run(
            [interp, "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True
        )
    except OSError as e:  # not there, or not a program
        return [_failed(interp, versions, f"cannot run it: {e}", 0.0)]
    if res.returncode:
        why = (res.stderr or res.stdout).strip().splitlines()[:1] or [f"exit {res.returncode}"]
        return [_failed(interp, versions, f"cannot run it: {why[0]}", 0.0)]
    full = res.stdout.strip()
    short = ".".join(full.split(".")[:2])
    venv = os.path.join(base, f"venv-py{short}")
    t0 = time.time()
    env = {**os.environ, "MEMOPT_STACK": "ort", "MEMOPT_PYTHON": interp, "MEMOPT_VENV": venv}
    env["MEMOPT_CONSTRAINTS"] = stack_pins(os.path.join(base, f"constraints-py{short}.txt"))
    print(f"[compat] Python {full}: setting up {venv} (scripts/setup_env.sh)", flush=True)
    setup = subprocess.run(
        ["bash", "-c", f"source {ROOT}/scripts/setup_env.sh"], capture_output=True, text=True, env=env, cwd=ROOT
    )
    setup_minutes = (time.time() - t0) / 60
    if setup.returncode:
        tail = (setup.stderr or setup.stdout).strip().splitlines()[-3:]
        return [_failed(full, versions, "set-up failed: " + " / ".join(tail), setup_minutes)]
    out = os.path.join(base, f"py{short}.json")
    cmd = [os.path.join(venv, "bin", "python"), os.path.abspath(__file__), "--versions", versions]
    cmd += ["--dir", os.path.join(base, f"py{short}"), "--no_write", "--json_out", out]
    subprocess.run(cmd, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    rows = json.load(open(out)) if os.path.exists(out) else []
    for r in rows:
        r["python"], r["setup_minutes"] = full, setup_minutes
    return rows or [_failed(full, versions, "the slice did not run", setup_minutes)]


def render_pythons(rows, cmd) -> str:
    lines = [
        PY_START,
        "## Other Python versions",
        "",
        "The same slice at the oldest and newest transformers of the range, each interpreter with its own venv of "
        "the ORT stack built by `scripts/setup_env.sh` (torch, onnxruntime-training and ORTModule's extensions are "
        "built per Python), with `constraints.txt`'s pins of "
        + ", ".join(sorted(STACK_PINS - {"pip", "setuptools", "wheel", "ninja"}))
        + "; their other requirements resolved by pip for that Python (`constraints.txt` is the verified set for "
        "Python 3.11, and some of its pins, such as networkx 3.6 and pandas 3, need 3.11). Set-up minutes are this "
        "run's own: a venv left by an earlier run is reused, and only what changed is installed.",
        "",
        f"Run {datetime.date.today().isoformat()} with `{cmd}`.",
        "",
        "| Python | transformers | result | tests | set-up minutes | slice minutes |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        what = "pass" if r["ok"] else ("FAIL: " + ", ".join(r["failed"][:4]) if r["failed"] else "FAIL")
        lines.append(
            f"| {r['python']} | {r['version']} | {what} | {r['summary']} | {r['setup_minutes']:.1f} | "
            f"{r['minutes']:.1f} |"
        )
    return "\n".join(lines + ["", PY_END])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", default=",".join(LATEST_PATCHES))
    p.add_argument("--dir", default=os.path.join(ROOT, ".compat"))
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "COMPATIBILITY.md"))
    p.add_argument("--no_write", action="store_true", help="print the table only")
    p.add_argument("--json_out", help="also write the rows as JSON here")
    p.add_argument(
        "--pythons",
        default="",
        help="other interpreters (names or paths, comma-separated): build the pinned stack for each and run the "
        "slice there on --versions; writes the 'Other Python versions' section only",
    )
    p.add_argument("--newest", action="store_true", help="print the newest release in the matrix and exit")
    p.add_argument(
        "--fresh_install",
        action="store_true",
        help="also install the package into a new venv without constraints.txt and train with it",
    )
    a = p.parse_args(argv)
    if a.newest:
        print(LATEST_PATCHES[-1])
        return 0
    os.makedirs(a.dir, exist_ok=True)
    cmd = "python scripts/compat.py" + (
        "" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    if a.pythons:
        rows = []
        for interp in [x.strip() for x in a.pythons.split(",") if x.strip()]:
            these = other_python(interp, a.versions, a.dir)
            rows += these
            ok = all(x["ok"] for x in these)
            print(f"[compat] Python {these[0]['python']}: {'pass' if ok else 'FAIL'}", flush=True)
        section = render_pythons(rows, cmd)
        print(section)
        if not a.no_write:
            _write(a.out, section=section)
        return 0 if all(r["ok"] for r in rows) else 1
    results = []
    for version in [v.strip() for v in a.versions.split(",") if v.strip()]:
        print(f"[compat] transformers {version}: preparing", flush=True)
        try:
            target, extra = prepare(version, a.dir)
        except RuntimeError as e:
            results.append(
                {
                    "version": version,
                    "ok": False,
                    "summary": f"install failed: {e}",
                    "failed": [],
                    "minutes": 0.0,
                    "extra": [],
                }
            )
            continue
        print(f"[compat] transformers {version}: running the slice", flush=True)
        r = run_slice(version, target, a.dir)
        r["extra"] = extra
        results.append(r)
        print(
            f"[compat] transformers {version}: {'pass' if r['ok'] else 'FAIL'} ({r['summary']}; log {r['log']})",
            flush=True,
        )
    text = render(results, cmd)
    fresh = None
    if a.fresh_install:
        print(
            "[compat] fresh venv without constraints.txt: installing, building ORT's extensions, training", flush=True
        )
        fresh = fresh_install(a.dir)
        if fresh["ok"]:
            text += (
                f"\n## A fresh install without constraints\n\n`pip install '.[cpu,examples]'` into a new venv "
                f"(no `constraints.txt`), ORT's extension build, then the GLUE recipe trained 4 steps with "
                f"`Gelu+:1:-1`: pass, {fresh['minutes']:.1f} min with pip's cache warm. It resolved: "
                f"{', '.join(fresh['resolved'])}.\n"
            )
        else:
            text += (
                f"\n## A fresh install without constraints\n\nFAILED at `{fresh['step']}`:\n\n```\n"
                f"{fresh['error']}\n```\n"
            )
    print(text)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(results, f, indent=2)
    if not a.no_write:
        _write(a.out, main_text=text)
    return 0 if all(r["ok"] for r in results) and (fresh is None or fresh["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
