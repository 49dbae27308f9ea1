"""Issue 53's real-size benchmark (benchmarks/real_size.py) holds to working where no card is: at a tiny size on the
CPU it runs its fixed recipes and `auto` as fresh processes and writes every figure with `auto`'s verdicts."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.torch_backend, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_benchmark_runs_its_rows_and_judges_auto_by_them(tmp_path):
    out = tmp_path / "real_size.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "real_size.py"), "--tiny", "--setups", "tiny-lora"]
    command += ["--rounds", "1", "--steps", "4", "--budgets", "1", "--out", str(out)]
    res = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["liger"] != True  # noqa: E712 - no card: its row left out, said
    (setup,) = report["setups"]
    assert [r["label"] for r in setup["fixed"]] == ["eager", "transformers' checkpointing", "level 1 + Loss+"]
    assert all(r["ok"] and r["peak_mb"] > 0 and r["tokens_per_s"] > 0 for r in setup["fixed"]), setup["fixed"]
    (auto,) = setup["auto"]  # under the highest fixed peak: eager's
    assert auto["budget_mb"] == max(r["peak_mb"] for r in setup["fixed"])
    verdicts = auto["verdicts"]
    assert verdicts["within_budget"] and auto["auto"]["config"] == "", auto
    # speed from steady steps: a fixed row's after the warm-up (2 of 4), auto's after the steps it measured, checked
    # and reported on too (step one, the check after it, the step its picture was drawn at: 1 of 4 left)
    assert [(r["speed_steps"], r["speed_settled"]) for r in setup["fixed"]] == [(2, True)] * 3
    assert (auto["speed_steps"], auto["speed_settled"]) == (1, True), auto
    # the dry run's figure, said before step one, against the peak the run measured: within 1%
    assert abs(verdicts["dry_run_error"]) <= 0.01, verdicts
    # which recipe ran fastest is the CPU's clock, not a property (tiny steps: recomputing one layer in two costs
    # less than a round's noise); what holds is that the verdict names the fastest row that fitted and divides by it
    fits = [r for r in setup["fixed"] if r["peak_mb"] <= auto["budget_mb"]]
    fastest = max(fits, key=lambda r: r["tokens_per_s"])
    assert verdicts["fastest_fixed"] == fastest["label"]
    assert verdicts["speed_vs_fastest"] == pytest.approx(auto["tokens_per_s"] / fastest["tokens_per_s"])
    # `auto` from memopt-plan's file, planned by the same code under the budget in whole MiB: no dry run at its start
    (from_file,) = setup["from_file"]
    assert from_file["ok"] and from_file["budget_mb"] == float(int(auto["budget_mb"])) and from_file["plan_s"] > 0
    said = from_file["verdicts"]
    assert said["within_budget"] and abs(said["dry_run_error"]) <= 0.01, said
    assert from_file["auto"]["dry_run_peak_mb"] is not None and from_file["start_s"] is not None
    # what the levers' measurements after step one took of each start: none without the plugin, the head's alone
    # under a fixed `Loss+`; none under `auto` from its own dry run (taken over from it), those `auto` weighs from a
    # plan file (the MLPs; the link to the host is not timed on the CPU)
    levers = {r["label"]: r["levers_measured_s"] for r in setup["fixed"]}
    assert not levers["eager"] and not levers["transformers' checkpointing"], levers
    assert list(levers["level 1 + Loss+"]) == ["loss"] and levers["level 1 + Loss+"]["loss"] > 0, levers
    assert auto["levers_measured_s"] == {}, auto
    assert "mlp" in from_file["levers_measured_s"] and "offload" not in from_file["levers_measured_s"], from_file
    assert all(s > 0 for s in from_file["levers_measured_s"].values())


def test_recipes_name_the_fixed_rows_a_lease_runs():
    """`--recipes` runs the fixed rows it names, in the benchmark's order; a name not among them is refused with the
    names there are."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import real_size

    every = real_size.recipes(liger=False)
    assert real_size.fixed_recipes(False, None) == every
    chosen = real_size.fixed_recipes(False, ["level 1 + Loss+", "eager"])
    assert [label for label, _ in chosen] == ["eager", "level 1 + Loss+"]
    with pytest.raises(SystemExit, match=r"--recipes 'level1': the recipes are 'eager', .*'level 1 \+ Loss\+'"):
        real_size.fixed_recipes(False, ["level1"])
