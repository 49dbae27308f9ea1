"""The GPU kit (`scripts/gpu_check.sh` -> `scripts/gpu_check.py`) holds to working on a machine without a GPU: without
one it stops at once and says so; with `--cpu` it runs its steps at a tiny size (the GPU tests, which skip here,
and both benchmarks in fresh processes) and writes its one report with every figure."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.torch_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIT = os.path.join(ROOT, "scripts", "gpu_check.sh")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
def test_without_a_gpu_the_kit_stops_at_once_and_says_so(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    res = subprocess.run(["bash", KIT], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2
    assert "sees no CUDA device here (`torch.cuda.is_available()` is False)" in res.stderr
    assert "pass --cpu to check the kit" in res.stderr and not os.listdir(tmp_path)


@pytest.mark.slow
def test_on_the_cpu_the_kit_runs_its_steps_and_writes_one_report(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    command = ["bash", KIT, "--cpu", "--out", str(tmp_path), "--rounds", "1", "--steps", "3", "--batch", "2"]
    # benchmark b at one batch over eager's (--multiples 2): its rows at a second batch are the same code run again
    command += ["--base_batch", "2", "--multiples", "2", "--tests", "tests/test_gpu_torch.py"]
    res = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert os.listdir(tmp_path) == ["gpu_check.md"]
    text = (tmp_path / "gpu_check.md").read_text()
    report = json.loads(text.split("```json\n", 1)[1].split("\n```", 1)[0])
    assert report["device"] == "cpu" and report["environment"]["packages"]["torch"] == torch.__version__
    tests = report["tests"]
    assert tests["exit"] == 0 and tests["counts"]["skipped"] == len(tests["cases"]) > 0  # no CUDA: each skipped
    assert "| test_gpu_torch::test_cuda_auto_meets_its_budget_and_draws_its_picture | skipped |" in text
    whole = {r["config"]: r for r in report["benchmarks"]["whole_layers"]["rows"]}
    assert list(whole) == ["eager", "transformers checkpointing", "ours: level 1"]
    assert all(r["peak_mib"] > 0 and r["step_s"] > 0 and r["failed"] == 0 for r in whole.values())
    loss = report["benchmarks"]["loss_in_the_solve"]
    assert loss["budget_mib"] == loss["eager_at_base"]["peak_mib"] > 0
    assert {(r["config"].split(" (")[0], r["batch"]) for r in loss["rows"]} == {
        (c, b)
        for c in ("transformers checkpointing", "whole layers + the loss chunked by hand", "ours: auto")
        for b in (4,)
    }
    auto = [r for r in loss["rows"] if r["config"] == "ours: auto"]
    assert all(r["rounds"][0]["auto"]["config"] is not None for r in auto if r["failed"] == 0)
    assert f"Budget: eager's peak at batch 2, {loss['budget_mib']:,.1f} MiB." in text
    dry = {r["config"]: r for r in report["benchmarks"]["dry_run"]["rows"]}
    assert list(dry) == list(whole) and all(r["dry_run_mib"] > 0 for r in dry.values())
    assert all(r["measured_mib"] == whole[c]["peak_mib"] for c, r in dry.items())
    assert "### The dry run beside the device" in text
