"""The probe, plan selection under a budget, the batch-size search and `--memory_opt_config auto`."""

import json
import os
import subprocess
import sys

import pytest

from optimum_memopt.advisor import Measurement, NoFit, ProbeReport, choose, max_batch_size, memory_flags, probe, verify
from optimum_memopt.advisor.probe import ProbeRow, write_reports

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = os.path.join(ROOT, "examples", "run_glue", "run_glue.py")
SMALL = [GLUE, "--model_size", "small", "--offline_train_samples", "300", "--use_cpu", "--max_seq_length", "128",
         "--pad_to_max_length"]
TINY = [GLUE, "--model_size", "tiny", "--offline_train_samples", "200", "--use_cpu"]


# -- selection, on measurements given by hand ------------------------------------------------------
def _row(label, kind, peak, step, base=(500.0, 1.0), config=None, level=0):
    m = Measurement(label, [], 16, True, peak_mb=peak, step_time_s=step)
    row = ProbeRow(label, kind, config if config is not None else (label if kind == "plan" else ""), level, m)
    row.measured_saving_mb = base[0] - peak
    row.extra_time_s = step - base[1]
    return row


def _report(*rows):
    base = _row("ORT, no recompute", "baseline", 500.0, 1.0)
    return ProbeReport(["x.py"], 16, 6, "cpu", [base, *rows])


def test_no_plans_when_baseline_fits():
    c = choose(_report(_row("Gelu+:1:-1", "plan", 450, 1.1)), budget_mb=600)
    assert (c.config, c.level) == ("", 0) and "already fits" in c.reason


def test_cheapest_plans_first_until_the_budget_is_met():
    report = _report(
        _row("Gelu+:1:-1", "plan", 460, 1.02),          # 40 MiB for 0.02 s: 2000 MiB/s
        _row("Cast+:1:-1", "plan", 480, 1.20),          # 20 MiB for 0.20 s: 100 MiB/s
        _row("FusedMatMul+:1:-1", "plan", 430, 1.05),   # 70 MiB for 0.05 s: 1400 MiB/s
        _row("level 1", "level", 350, 1.6, level=1),
    )
    assert [r.config for r in report.ranked_plans()] == ["Gelu+:1:-1", "FusedMatMul+:1:-1", "Cast+:1:-1"]
    assert choose(report, 470).config == "Gelu+:1:-1"
    c = choose(report, 400)  # needs 100: 40 + 70
    assert c.config == "Gelu+:1:-1,FusedMatMul+:1:-1" and c.estimated_peak_mb == pytest.approx(390)
    c = choose(report, 380)  # all plans give 130 < 120 needed? 40+70+20 = 130 >= 120
    assert c.config == "Gelu+:1:-1,FusedMatMul+:1:-1,Cast+:1:-1"
    c = choose(report, 360)  # plans cannot reach 140: level 1 measured 350
    assert (c.config, c.level) == ("", 1)
    with pytest.raises(NoFit, match=r"no probed configuration fits 300.0 MiB: the lowest measured peak is 350.0 MiB"):
        choose(report, 300)


def test_plans_sharing_a_subgraph_are_not_combined():
    report = _report(_row("Cast+:1:-1", "plan", 460, 1.01), _row("Cast+:2:-1", "plan", 470, 1.02),
                     _row("Gelu+:1:-1", "plan", 450, 1.05))
    # needs 90: Cast+:1 (40, cheapest), not Cast+:2 (same subgraph), then Gelu+ (50)
    assert choose(report, 410).config == "Cast+:1:-1,Gelu+:1:-1"


def test_noise_level_extra_time_counts_as_no_cost(tmp_path):
    report = _report(_row("Gelu+:1:-1", "plan", 460, 0.97), _row("Cast+:1:-1", "plan", 440, 1.10))
    assert report.ranked_plans()[0].config == "Gelu+:1:-1"
    paths = write_reports(report, str(tmp_path))
    assert "no cost measured" in (tmp_path / "probe.md").read_text()
    assert json.loads((tmp_path / "probe.json").read_text())["ranking"] == ["Gelu+:1:-1", "Cast+:1:-1"]
    assert os.path.getsize(paths[2]) > 1000


# -- real runs of the recipe ----------------------------------------------------------------------
@pytest.mark.slow
def test_probe_choose_verify_and_batch_search_for_real(tmp_path):
    lines = []
    report = probe(SMALL, batch_size=16, steps=5, max_plans=2, levels=(1,), progress=lines.append)
    assert any("[probe 1/" in l for l in lines)
    base = report.baseline.measurement
    assert base.ok and base.peak_mb > 0 and base.step_time_s > 0 and base.device == "cpu"
    plans = [r for r in report.rows if r.kind == "plan"]
    assert len(plans) == 2 and all(r.measurement.ok for r in plans)
    assert all(r.predicted_saving_mb > 0 for r in plans)  # ORT's figure, from memory_plans.json
    level1 = next(r for r in report.rows if r.kind == "level")
    # layer-wise recompute keeps fewer activations than no recompute, measured
    assert level1.measurement.peak_mb < base.peak_mb
    write_reports(report, str(tmp_path / "report"))
    assert json.loads((tmp_path / "report" / "probe.json").read_text())["rows"][0]["label"] == "ORT, no recompute"

    best = max(report.ranked_plans(), key=lambda r: r.measured_saving_mb, default=None)
    if best is not None and best.measured_saving_mb > 20:
        budget = base.peak_mb - best.measured_saving_mb / 2
        choice = verify(report, choose(report, budget), budget, steps=5, progress=lines.append)
        assert choice.verified is None or choice.verified.peak_mb <= budget
        assert choice.config or choice.level

    found, tried = max_batch_size(TINY, memory_flags(True), budget_mb=1e6, start=4, steps=3, limit=8, progress=lines.append)
    assert found == 8 and sorted(tried) == [4, 8]


@pytest.mark.slow
def test_memory_opt_config_auto_trains_with_what_it_chose(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, *TINY, "--output_dir", str(out), "--do_train", "--max_steps", "3", "--report_to", "none",
           "--save_strategy", "no", "--memory_opt_config", "auto", "--memory_budget_mb", "100000",
           "--memory_probe_max_plans", "1", "--memory_probe_steps", "3"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    choice = json.loads((out / "memory_auto" / "choice.json").read_text())
    assert choice["config"] == "" and choice["level"] == 0 and "already fits" in choice["reason"]
    assert "memory_opt_config auto chose no recompute" in res.stderr
    assert (out / "memory_auto" / "probe.md").exists()
    plans = json.loads((out / "memory_plans.json").read_text())
    assert plans["memory_optimizer_enabled"] is False


def test_auto_is_refused_under_a_multiprocess_launch(monkeypatch):
    from transformers import HfArgumentParser

    from optimum_memopt import MemoptTrainingArguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^`--memory_opt_config auto` probes the script in single-process runs"):
        HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", "x", "--use_cpu", "--memory_opt_config", "auto", "--memory_budget_mb", "100"])


def test_cli_refuses_a_missing_script(tmp_path):
    from optimum_memopt.advisor.cli import main

    assert main(["--", str(tmp_path / "nope.py")]) == 2
