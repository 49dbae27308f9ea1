"""The probe, plan selection under a budget, the batch-size search and `--memory_opt_config auto`."""

import json
import os
import subprocess
import sys

import pytest

from optimum_memopt.advisor import (
    Advice,
    Measurement,
    NoFit,
    ProbeReport,
    ProbeRow,
    choose,
    cli,
    max_batch_size,
    memory_flags,
    probe,
    verify,
    write_reports,
)
from optimum_memopt.advisor.measure import WARMUP_STEPS, child_command, steady_times, strip_flags
from optimum_memopt.plans import FoundPlan, PlanReport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = os.path.join(ROOT, "examples", "run_glue", "run_glue.py")
TINY = [GLUE, "--model_size", "tiny", "--offline_train_samples", "200", "--use_cpu"]
# the probe's size: the tiny model at 128 tokens a row, batch 16, the smallest at which each probed plan and level 1
# measure a saving well clear of a run's noise (2026-11-27: modern stack, tensor storages, counted exactly: no recompute
# 80.3 MiB, the plans 44.1 and 44.6, level 1 48.8; ORT stack, the allocator's bytes, within 0.1 MiB over three runs:
# 76.2, 68.8 and 73.3, level 1 52.8). Each probed configuration is a fresh process: a larger model adds its steps alone.
PROBED = [*TINY, "--max_seq_length", "128", "--pad_to_max_length"]


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


def test_a_runs_speed_is_read_from_steps_after_the_warm_up_and_autos_checks():
    """The steps a speed's median is over: after the warm-up, and after every step `auto` measured, checked or reported
    on (the picture of its choice, drawn at the end of the third step, took 0.8 s of a tiny run's 0.02 s steps on the
    CPU); where none is left, the steps after the warm-up, said unsteady."""
    times = [9.0, 2.0, 5.0, 1.0, 1.1, 1.2]
    assert WARMUP_STEPS == 2
    assert steady_times(times, 1) == ([5.0, 1.0, 1.1, 1.2], True)  # nothing to settle: the warm-up alone
    assert steady_times(times, 3) == ([1.0, 1.1, 1.2], True)
    assert steady_times(times, 6) == ([5.0, 1.0, 1.1, 1.2], False)  # settled as the run ended
    assert steady_times(times, None) == ([5.0, 1.0, 1.1, 1.2], False)  # never settled
    assert steady_times([3.0], None) == ([3.0], False)


def test_a_step_on_a_card_is_timed_to_its_kernels_end(monkeypatch):
    """The measurement waits for the card's queue at each step's edges (the Trainer reads nothing back each step, so the
    host's clock alone times the queueing); on the CPU there is nothing to wait for."""
    import types

    import torch

    from optimum_memopt.advisor.measure import MeasureCallback

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waited.append(1))
    state = types.SimpleNamespace(is_world_process_zero=True)
    for device, waits in (("cuda", 2), ("cpu", 0)):
        waited.clear()
        callback = MeasureCallback("unused.json")
        callback.meter = types.SimpleNamespace(device=device)
        callback.on_step_begin(None, state, None)
        callback.on_step_end(None, state, None)
        assert len(waited) == waits and len(callback.times) == 1, (device, waited)


def test_no_plans_when_baseline_fits():
    c = choose(_report(_row("Gelu+:1:-1", "plan", 450, 1.1)), budget_mb=600)
    assert (c.config, c.level) == ("", 0) and "already fits" in c.reason


def test_cheapest_plans_first_until_the_budget_is_met():
    report = _report(
        _row("Gelu+:1:-1", "plan", 460, 1.02),  # 40 MiB for 0.02 s: 2000 MiB/s
        _row("Cast+:1:-1", "plan", 480, 1.20),  # 20 MiB for 0.20 s: 100 MiB/s
        _row("FusedMatMul+:1:-1", "plan", 430, 1.05),  # 70 MiB for 0.05 s: 1400 MiB/s
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


def test_plans_made_unnecessary_by_a_later_one_are_dropped_again():
    # the benchmark's DeBERTa case: cheap plans first, then a large costly one makes one cheap plan redundant
    report = _report(
        _row("FusedMatMul+Add+Reshape+:1:-1", "plan", 452.3, 0.99),  # 47.7 MiB, no cost measured
        _row("FusedMatMul+Add+:1:-1", "plan", 436.2, 1.002),  # 63.8 MiB, 0.002 s
        _row("Gelu+:1:-1", "plan", 436.3, 1.035),  # 63.7 MiB, 0.035 s
        _row("Tile+:1:-1", "plan", 376.1, 1.445),  # 123.9 MiB, 0.445 s
    )
    c = choose(report, 268.1)  # needs 231.9 MiB: all four reach it, and without Gelu+ the others still do (235.4)
    assert c.config == "FusedMatMul+Add+Reshape+:1:-1,FusedMatMul+Add+:1:-1,Tile+:1:-1"
    assert "Gelu+:1:-1 dropped again" in c.reason and c.estimated_peak_mb == pytest.approx(500 - 235.4)


def test_plans_sharing_a_subgraph_are_not_combined():
    report = _report(
        _row("Cast+:1:-1", "plan", 460, 1.01),
        _row("Cast+:2:-1", "plan", 470, 1.02),
        _row("Gelu+:1:-1", "plan", 450, 1.05),
    )
    # needs 90: Cast+:1 (40, cheapest), not Cast+:2 (same subgraph), then Gelu+ (50)
    assert choose(report, 410).config == "Cast+:1:-1,Gelu+:1:-1"


def test_noise_level_extra_time_counts_as_no_cost(tmp_path):
    report = _report(_row("Gelu+:1:-1", "plan", 460, 0.97), _row("Cast+:1:-1", "plan", 440, 1.10))
    assert report.ranked_plans()[0].config == "Gelu+:1:-1"
    paths = write_reports(Advice(report), str(tmp_path))
    assert "no cost measured" in (tmp_path / "probe.md").read_text()
    assert json.loads((tmp_path / "probe.json").read_text())["probe"]["ranking"] == ["Gelu+:1:-1", "Cast+:1:-1"]
    assert os.path.getsize(paths[2]) > 1000


@pytest.mark.both_stacks  # probes the backend of each stack
# -- real runs of the recipe ----------------------------------------------------------------------
@pytest.mark.slow
def test_probe_choose_and_verify_for_real(tmp_path):
    lines = []
    report = probe(PROBED, batch_size=16, steps=3, max_plans=1, levels=(1,), progress=lines.append)
    assert any("[probe 1/" in line for line in lines)
    base = report.baseline.measurement
    assert base.ok and base.peak_mb > 0 and base.step_time_s > 0 and base.device == "cpu"
    plans = [r for r in report.rows if r.kind == "plan"]
    assert len(plans) == 1 and all(r.measurement.ok for r in plans)  # several plans ranked: the tests above
    assert all(r.predicted_saving_mb > 0 for r in plans)  # the backend's figure, from the child's plan report
    level1 = next(r for r in report.rows if r.kind == "level")
    # layer-wise recompute keeps fewer activations than no recompute, measured
    assert level1.measurement.peak_mb < base.peak_mb
    write_reports(Advice(report), str(tmp_path / "report"))
    label = "ORT" if report.backend == "ort" else "torch backend"  # the backend of this stack
    assert json.loads((tmp_path / "report" / "probe.json").read_text())["probe"]["rows"][0]["label"] == (
        f"{label}, no recompute"
    )

    # a budget the best probed plan meets with room (half its measured saving to spare), below no recompute's peak:
    # plans are chosen and measured together in a fresh run, and the test holds what that run measured
    best = max(report.ranked_plans(), key=lambda r: r.measured_saving_mb)
    assert best.measured_saving_mb > 0, [(r.config, r.measured_saving_mb) for r in report.ranked_plans()]
    budget = base.peak_mb - best.measured_saving_mb / 2
    choice = verify(report, choose(report, budget), budget, steps=3, progress=lines.append)
    assert choice.verified is not None and choice.verified.ok, choice.reason
    assert choice.verified.peak_mb <= budget < base.peak_mb and (choice.config or choice.level), choice.reason


def test_the_batch_search_doubles_then_bisects_to_within_an_eighth_of_the_largest_batch_that_fits():
    # each trial is a whole run (the probe above holds a real child at a batch size given); here a runner whose peak is
    # 10 + 3 MiB a row, out of memory from 40 rows on, shows which batches the search tries and what it answers
    calls = []

    def runner(argv, label, flags, batch, steps, timeout):
        calls.append(batch)
        if batch >= 40:
            return Measurement(label, list(flags), batch, False, oom=True, error="CUDA out of memory")
        return Measurement(label, list(flags), batch, True, peak_mb=10.0 + 3.0 * batch, step_time_s=1.0)

    lines = []
    # 100 MiB holds 30 rows: 4, 8, 16 fit, 32 is over, then 24, 28, 30 (within 16 // 8 = 2 of 32)
    found, tried = max_batch_size(["x.py"], [], budget_mb=100, start=4, runner=runner, progress=lines.append)
    assert found == 30 and calls == [4, 8, 16, 32, 24, 28, 30] and sorted(tried) == sorted(calls)
    assert "[batch search] batch 32: peak 106.0 MiB, over budget" in lines
    # out of memory stops the doubling as a missed budget does: 32 fits, 64 fails, then 48 and 40 fail, 36 fits
    calls.clear()
    assert max_batch_size(["x.py"], [], budget_mb=1e6, start=4, runner=runner, progress=lines.append)[0] == 36
    assert calls == [4, 8, 16, 32, 64, 48, 40, 36]
    assert "[batch search] batch 64: failed (out of memory)" in lines
    # a start over the budget halves first: 64 and 32 miss, 16 fits, then up to 30 again
    calls.clear()
    assert max_batch_size(["x.py"], [], budget_mb=100, start=64, runner=runner, progress=lines.append)[0] == 30
    assert calls == [64, 32, 16, 24, 28, 30]
    # the limit stops the doubling; nothing that fits answers None
    calls.clear()
    assert max_batch_size(["x.py"], [], budget_mb=1e6, start=4, limit=8, runner=runner, progress=lines.append)[0] == 8
    assert calls == [4, 8]
    assert max_batch_size(["x.py"], [], budget_mb=5, start=4, runner=runner, progress=lines.append)[0] is None


@pytest.mark.slow
@pytest.mark.ort  # the torch backend chooses in the training process: tests/test_torch_budget.py
def test_memory_opt_config_auto_trains_with_what_it_chose(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        *TINY,
        "--output_dir",
        str(out),
        "--do_train",
        "--max_steps",
        "3",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
        "--memory_opt_config",
        "auto",
        "--memory_budget_mb",
        "100000",
        "--memory_probe_max_plans",
        "1",
        "--memory_probe_steps",
        "3",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    choice = json.loads((out / "memory_auto" / "probe.json").read_text())["choice"]
    assert choice["config"] == "" and choice["level"] == 0 and "already fits" in choice["reason"]
    assert "memory_opt_config auto chose no recompute" in res.stdout + res.stderr
    assert (out / "memory_auto" / "probe.md").exists()
    plans = json.loads((out / "memory_plans.json").read_text())
    assert plans["optimizer_enabled"] is False


def test_auto_by_fresh_probes_is_refused_under_a_multiprocess_launch(monkeypatch):
    """ORT's `auto` re-runs the script in single processes; the torch backend's chooses in the training process on
    rank 0 and is accepted (tests/test_multiprocess.py runs it on two processes)."""
    from transformers import HfArgumentParser

    from optimum_memopt import MemoptTrainingArguments

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"^`--memory_opt_config auto` probes the script in single-process runs.*"
                       r"cannot run under a multi-process.*`--memory_opt_backend torch`"):  # fmt: skip
        HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(
            [
                "--output_dir",
                "x",
                "--use_cpu",
                "--memory_opt_backend",
                "ort",
                "--memory_opt_config",
                "auto",
                "--memory_budget_mb",
                "100",
            ]  # fmt: skip
        )


# -- the CLI end to end, with a stubbed runner (no training) -------------------------------------------
class FakeRunner:
    """Stands in for `run_child`: a fixed peak and step time per configuration, and ORT's plan report."""

    PEAKS = {
        "": (500.0, 1.00),
        "Gelu+:1:-1": (460.0, 1.02),
        "FusedMatMul+Add+:1:-1": (430.0, 1.05),
        "Gelu+:1:-1,FusedMatMul+Add+:1:-1": (395.0, 1.07),
        "level 1": (300.0, 1.4),
        "level 2": (290.0, 1.5),
    }

    def __init__(self, fail_baseline=False):
        self.calls = []
        self.fail_baseline = fail_baseline

    def __call__(self, script_argv, label, flags, batch_size, steps=6, timeout=1800):
        self.calls.append((label, list(flags), batch_size))
        f = dict(zip(flags[::2], flags[1::2]))
        key = (
            f"level {f['--memory_opt_level']}"
            if f.get("--memory_opt_level", "0") != "0"
            else f.get("--memory_opt_config", "")
        )
        if self.fail_baseline and key == "":
            return Measurement(label, list(flags), batch_size, False, error="RuntimeError: boom")
        peak, step = self.PEAKS[key]
        peak *= batch_size / 16  # activations grow with the batch
        report = PlanReport(
            "ort",
            bool(key),
            0,
            [],
            [],
            [FoundPlan("Gelu+:1:-1", False, 3, 40 * 2**20), FoundPlan("FusedMatMul+Add+:1:-1", False, 3, 70 * 2**20)],
        )
        return Measurement(
            label,
            list(flags),
            batch_size,
            True,
            peak_mb=peak,
            step_time_s=step,
            samples_per_s=batch_size / step,
            device="cpu",
            plans=report,
        )


def test_cli_end_to_end_with_a_stubbed_runner(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("# stands in for a training script\n")
    runner = FakeRunner()
    status = cli.main(
        [
            "--budget_mb",
            "400",
            "--search_batch_size",
            "--report_dir",
            str(tmp_path / "rep"),
            "--steps",
            "4",
            "--",
            str(script),
            "--per_device_train_batch_size",
            "16",
            "--memory_opt_backend",  # the stub answers as ORT would; the labels follow the script's backend
            "ort",
        ],
        runner=runner,
    )
    out = capsys.readouterr().out
    assert status == 0, out
    labels = [c[0] for c in runner.calls]
    assert labels[:5] == ["ORT, no recompute", "FusedMatMul+Add+:1:-1", "Gelu+:1:-1", "level 1", "level 2"]
    assert "Under 400.0 MiB: plans Gelu+:1:-1,FusedMatMul+Add+:1:-1" in out
    advice = json.loads((tmp_path / "rep" / "probe.json").read_text())
    assert advice["schema"] == "optimum-memopt/advice/1"
    assert advice["choice"]["config"] == "Gelu+:1:-1,FusedMatMul+Add+:1:-1"
    assert advice["choice"]["verified_peak_mb"] == 395.0
    searched = {b["label"]: b["batch_size"] for b in advice["max_batch_size"]}
    # no recompute: 500 * b / 16 <= 400 -> 12 (to within 1/8); the chosen plans: 395 * b / 16 <= 400 -> 16
    assert (
        searched["ORT, no recompute"] in (8, 9, 10, 11, 12) and searched["ORT, Gelu+:1:-1,FusedMatMul+Add+:1:-1"] == 16
    )


def test_cli_exits_non_zero_when_nothing_fits_or_the_script_fails(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    ort = [str(script), "--memory_opt_backend", "ort"]  # the stub answers as ORT would
    assert cli.main(["--budget_mb", "100", "--report_dir", str(tmp_path / "a"), "--", *ort], runner=FakeRunner()) == 1
    err = capsys.readouterr().err
    assert "no probed configuration fits 100.0 MiB" in err and "raise `--budget_mb`" in err  # the probe's own flag
    torch = ["--budget_mb", "100", "--batch_size", "32", "--report_dir", str(tmp_path / "t"), "--", str(script),
             "--memory_opt_backend", "torch"]  # fmt: skip
    assert cli.main(torch, runner=FakeSolverRunner()) == 1
    assert (
        "the budget solver's run under 100.0 MiB stopped: RuntimeError: found nothing that fits"
        in capsys.readouterr().err
    )
    assert (
        cli.main(["--report_dir", str(tmp_path / "b"), "--", str(script)], runner=FakeRunner(fail_baseline=True)) == 1
    )
    assert "the script's run without recompute failed: RuntimeError: boom" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--", "nope.py"], "the training script 'nope.py' is not a file"),
        ([], "give the training script after '--'"),
        (["--levels", "1,3", "--", "SCRIPT"], "--levels '1,3' has '3'; expected levels 1 and/or 2"),
        (["--levels", "one", "--", "SCRIPT"], "--levels 'one' has 'one'"),
        (["--steps", "0", "--", "SCRIPT"], "--steps is 0; expected a positive integer"),
        (["--budget_mb", "nan", "--", "SCRIPT"], "--budget_mb is nan; expected a positive, finite number"),
        (["--budget_mb", "-1", "--", "SCRIPT"], "--budget_mb is -1.0; expected a positive, finite number"),
        (["--search_batch_size", "--", "SCRIPT"], "--search_batch_size needs --budget_mb"),
        (["--batch_size", "0", "--", "SCRIPT"], "--batch_size is 0; expected a positive integer"),
        (["--report_dir", "FILE", "--", "SCRIPT"], "is a file; expected a directory"),
        (["--", "SCRIPT", "--per_device_train_batch_size", "x"], "the script's --per_device_train_batch_size is 'x'"),
    ],
)
def test_cli_checks_its_options_before_running_anything(tmp_path, capsys, argv, message):
    script = tmp_path / "train.py"
    script.write_text("")
    (tmp_path / "FILE").write_text("")
    argv = [a.replace("SCRIPT", str(script)).replace("FILE", str(tmp_path / "FILE")) for a in argv]
    runner = FakeRunner()
    assert cli.main(argv, runner=runner) == 2
    assert message in capsys.readouterr().err
    assert runner.calls == []


@pytest.mark.slow
def test_cli_stops_its_child_and_cleans_up_on_sigterm(tmp_path):
    script = tmp_path / "slow_train.py"
    marker = tmp_path / "child_started"
    script.write_text(f"import time, pathlib; pathlib.Path({str(marker)!r}).write_text('x'); time.sleep(120)\n")
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp")}
    os.makedirs(env["TMPDIR"])
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimum_memopt.advisor.cli", "--report_dir", str(tmp_path / "r"), "--", str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    import time

    deadline = time.time() + 60
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists()
    proc.terminate()
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + 15
    assert os.listdir(env["TMPDIR"]) == []  # the child's work directory is gone
    import psutil

    assert not [p for p in psutil.process_iter(["cmdline"]) if str(script) in " ".join(p.info["cmdline"] or [])]


def test_measuring_children_do_not_inherit_the_advisors_flags():
    argv = [
        "train.py",
        "--memory_opt_config",
        "auto",
        "--memory_budget_mb=4000",
        "--ort_loss_in_graph",
        "--ort_log_level",
        "INFO",
        "--seed",
        "3",
        "--ort_loss_in_graph",
        "true",
        "--x",
    ]
    assert strip_flags(argv[1:], {"--memory_opt_config": True, "--memory_budget_mb": True}) == argv[4:]
    cmd = child_command(argv, memory_flags(False), 8, 3, "/w", "/w/m.json", python="py")
    assert cmd[:4] == ["py", "train.py", "--seed", "3"] and cmd[4] == "--x"
    assert "auto" not in cmd and "--ort_log_level" not in cmd and "--ort_loss_in_graph" not in cmd
    assert cmd[cmd.index("--memory_measure_out") + 1] == "/w/m.json"
    cmd = child_command(argv, memory_flags(True, config="Gelu+:1:-1"), 8, 3, "/w", "/w/m.json", python="py")
    assert "--ort_log_level" in cmd and cmd[-1] == "Gelu+:1:-1"


# -- the torch backend: the budget solver chooses, the probe checks -------------------------------------
class FakeSolverRunner(FakeRunner):
    """A torch-backend script: the solver's runs (`--memory_opt_config auto`) answer with a choice for the budget
    they were given; its first choice misses a 400 MiB budget when run as given, the second (for 390) meets it."""

    CHOICES = {"400.000": ("Mul+:1:-1@0", 398.0), "390.000": ("MatMul+Mul+:1:-1@0-1", 388.0)}
    RUN = {"Mul+:1:-1@0": 410.0, "MatMul+Mul+:1:-1@0-1": 385.0}

    def __call__(self, script_argv, label, flags, batch_size, steps=6, timeout=1800):
        f = dict(zip(flags[::2], flags[1::2]))
        config = f.get("--memory_opt_config", "")
        if config == "auto":
            self.calls.append((label, list(flags), batch_size))
            if batch_size > 24:  # the solver's own refusal, as the script prints it
                return Measurement(
                    label, list(flags), batch_size, False, error="RuntimeError: found nothing that fits"
                )
            chosen, predicted = self.CHOICES[f["--memory_budget_mb"]] if batch_size == 16 else ("Layer+:1:-1", 300.0)
            auto = {"config": chosen, "predicted_peak_mb": predicted, "recompute_ms": 12.5, "choices": 1}
            return Measurement(label, list(flags), batch_size, True, peak_mb=predicted * batch_size / 16,
                               step_time_s=1.2, samples_per_s=batch_size / 1.2, device="cpu", auto=auto)  # fmt: skip
        if config in self.RUN:
            self.calls.append((label, list(flags), batch_size))
            return Measurement(label, list(flags), batch_size, True, peak_mb=self.RUN[config], step_time_s=1.1,
                               device="cpu")  # fmt: skip
        return super().__call__(script_argv, label, flags, batch_size, steps, timeout)


def test_memopt_probe_on_the_torch_backend_asks_the_budget_solver(tmp_path, capsys):
    """The choice under `--budget_mb` is the solver's (a run of the script with `auto`), checked in a fresh run as
    given; a check over the budget solves again for the budget lowered by the miss; the batch search lets the
    solver choose again at each batch size."""
    script = tmp_path / "train.py"
    script.write_text("")
    runner = FakeSolverRunner()
    argv = ["--budget_mb", "400", "--search_batch_size", "--levels", "1", "--report_dir", str(tmp_path / "rep"), "--",
            str(script), "--per_device_train_batch_size", "16", "--memory_opt_backend", "torch"]  # fmt: skip
    assert cli.main(argv, runner=runner) == 0
    out = capsys.readouterr().out
    calls = [(label, batch) for label, _, batch in runner.calls]
    first = calls.index(("solver", 16))
    assert calls[first : first + 5] == [
        ("solver", 16), ("Mul+:1:-1@0", 16), ("solver", 16), ("MatMul+Mul+:1:-1@0-1", 16), ("batch 16", 16),
    ]  # fmt: skip
    solved = runner.calls[first : first + 3 : 2]
    solver_budgets = [dict(zip(f[::2], f[1::2]))["--memory_budget_mb"] for _, f, _ in solved]
    assert solver_budgets == ["400.000", "390.000"]  # 400 - (410 - 400)
    advice = json.loads((tmp_path / "rep" / "probe.json").read_text())
    choice = advice["choice"]
    assert choice["config"] == "MatMul+Mul+:1:-1@0-1" and choice["verified_peak_mb"] == 385.0
    assert choice["estimated_peak_mb"] == 388.0
    assert "the budget solver chose it from one measured step (after Mul+:1:-1@0 measured 410.0 MiB" in out
    assert "solved again for 390.0 MiB)" in out
    searched = {b["label"]: (b["batch_size"], b["flags"]) for b in advice["max_batch_size"]}
    batch, flags = searched["torch backend, the solver's choice at each batch (auto)"]
    assert flags[-4:] == ["--memory_opt_config", "auto", "--memory_budget_mb", "400.000"]
    assert batch in (20, 21)  # the stub: peak 300 MiB * b / 16 <= 400 up to 21, found to within 1/8


@pytest.mark.slow
@pytest.mark.torch_backend
def test_a_solver_run_hands_its_choice_to_the_probe(tmp_path):
    """A real run of the recipe with `auto` (torch backend): the measuring child reports what the solver chose,
    and its peak meets the budget."""
    from optimum_memopt.advisor import run_child

    argv = [*PROBED, "--memory_opt_backend", "torch"]
    base = run_child(argv, "base", memory_flags(True), 16, steps=3)
    assert base.ok and base.auto is None
    budget = round(base.peak_mb * 0.7, 1)
    m = run_child(argv, "solver", memory_flags(True, "auto", extra=["--memory_budget_mb", str(budget)]), 16, steps=4)
    assert m.ok, m.error
    assert m.auto["config"] and m.auto["predicted_peak_mb"] <= budget and m.auto["recompute_ms"] > 0
    assert m.peak_mb <= budget and m.auto["measured_peak_mb"] <= budget
