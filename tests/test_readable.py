"""What a user sees: the plan table on screen whatever the script set up for logging (rank 0 only), log lines that
carry a few rounded figures (the rest behind `--log_all_memory_metrics` and in the CSVs), report files written whole
or not at all, and the advisor's smaller promises (the backend's own levels, the probe's own flag)."""

import logging

import pytest
from helpers import ClsData, LossRecordingTrainer, make_args, tiny_model

from optimum_memopt.callbacks import base
from optimum_memopt.trainer import LOG_LINE_METRICS


@pytest.fixture
def no_handlers(monkeypatch):
    """A script that set up no logging: no handler anywhere on the plugin logger's way up. Call it in the test's
    body: pytest adds its own capturing handler to the root logger when the test starts."""

    def clear():
        root = logging.getLogger()
        monkeypatch.setattr(root, "handlers", [])
        monkeypatch.setattr(base.logger, "handlers", [])
        return root

    return clear


@pytest.fixture
def info_level():
    """The plugin's logger at INFO (as `--log_level info` sets it), put back after the test."""
    old = base.logger.level
    base.logger.setLevel(logging.INFO)
    yield
    base.logger.setLevel(old)


def test_a_table_is_printed_where_no_handler_would_show_it(no_handlers, info_level, capsys):
    no_handlers()
    base.show("TABLE one")
    assert capsys.readouterr().out == "TABLE one\n"


def test_a_table_is_logged_where_a_handler_shows_info(capsys, caplog):
    with caplog.at_level(logging.INFO, logger="optimum_memopt"):
        base.show("TABLE two")
    assert "TABLE two" in caplog.text and capsys.readouterr().out == ""


def test_a_handler_that_drops_info_does_not_count(no_handlers, info_level, capsys):
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    no_handlers().handlers = [handler]
    base.show("TABLE three")
    assert capsys.readouterr().out == "TABLE three\n"


def test_the_plan_table_reaches_a_script_without_logging(tmp_path, no_handlers, capfd):
    """(capfd: ORT redirects the process's stdout file descriptor while it exports.)"""
    no_handlers()
    args = make_args(tmp_path, "--max_steps", "2", "--memory_opt_level", "1")
    LossRecordingTrainer(model=tiny_model(), args=args, train_dataset=ClsData(n=16)).train()
    out = capfd.readouterr().out
    assert out.count("Memory optimizer (") == 1 and "recompute plan(s) found" in out


def _logged(tmp_path, *flags):
    args = make_args(
        tmp_path, "--max_steps", "3", "--logging_steps", "1", "--print_memory_stats", "--print_input_density", *flags
    )
    trainer = LossRecordingTrainer(model=tiny_model(), args=args, train_dataset=ClsData(n=32))
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def test_a_log_line_carries_a_few_rounded_figures(tmp_path):
    logged = _logged(tmp_path / "few", "--memory_opt_level", "1")
    keys = {k for h in logged for k in h if k.startswith("memopt/")}
    assert keys <= set(LOG_LINE_METRICS)
    assert {"memopt/mem_step_peak_mb", "memopt/mem_forward_held_mb", "memopt/embed_density_pct"} <= keys
    for h in logged:
        for k, v in h.items():
            if k.startswith("memopt/"):
                assert v == round(v, 2), (k, v)
    assert all(h["memopt/mem_step_peak_mb"] >= h["memopt/mem_forward_held_mb"] > 0 for h in logged)


def test_every_figure_is_behind_the_flag(tmp_path):
    logged = _logged(tmp_path / "all", "--log_all_memory_metrics")
    keys = {k for h in logged for k in h if k.startswith("memopt/")}
    assert {"memopt/mem_pre_forward_mb", "memopt/mem_post_backward_peak_mb", "memopt/embed_total_tokens"} <= keys


def test_a_report_that_fails_to_write_leaves_no_file(tmp_path):
    def half_then_full_disk(path):
        with open(path, "wb") as f:
            f.write(b"\x89PNG")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        base.atomic_write(str(tmp_path / "memory_phases.png"), half_then_full_disk)
    assert list(tmp_path.iterdir()) == []


def test_the_probe_measures_the_levels_the_backend_has(tmp_path):
    from test_advisor import FakeRunner

    from optimum_memopt.advisor import probe

    for backend, levels in (("torch", ["1"]), ("ort", ["1", "2"])):
        runner = FakeRunner()
        probe(
            ["train.py", "--memory_opt_backend", backend],
            16,
            steps=3,
            max_plans=0,
            progress=lambda s: None,
            runner=runner,
        )
        asked = [dict(zip(f[::2], f[1::2])).get("--memory_opt_level") for _, f, _ in runner.calls]
        assert [a for a in asked if a not in (None, "0")] == levels, backend


@pytest.mark.ort  # the torch backend's choice reaches the screen the same way (tests/test_torch_budget.py)
def test_auto_shows_its_progress_and_choice_to_a_script_without_logging(tmp_path, no_handlers, capsys, monkeypatch):
    """`--memory_opt_config auto` probes for a minute or more before training: TRL's sft.py (no logging set up)
    showed nothing of it. Its progress, probe table and choice are shown as the plan table is (the children's runs
    stubbed: FakeRunner's figures)."""
    from test_advisor import FakeRunner

    from optimum_memopt.advisor import auto
    from optimum_memopt.trainer import MemoptTrainer

    real = auto.advise
    monkeypatch.setattr(auto, "advise", lambda *a, **kw: real(*a, **{**kw, "runner": FakeRunner()}))
    no_handlers()
    args = make_args(tmp_path, "--memory_opt_config", "auto", "--memory_budget_mb", "450")
    trainer = MemoptTrainer(model=tiny_model(), args=args, train_dataset=ClsData(n=8))
    reason = trainer.resolve_memory_plan(script_argv=[__file__])
    out = capsys.readouterr().out
    assert f"probing {__file__} under 450.0 MiB" in out and "[probe 1/" in out
    assert "memory_opt_config auto chose" in out and reason in out


def test_the_plan_says_a_few_lines_and_keeps_the_rest_in_a_file(tmp_path, no_handlers, info_level, capsys):
    """`PlanLog`: `say` prints (and keeps) a line; `detail` keeps the rest in `memory_plans.txt` and logs it at DEBUG
    only; each `train()` starts the file anew; a file that cannot be written is said once, and training goes on."""
    no_handlers()
    log = base.PlanLog(str(tmp_path))
    log.say("what runs")
    log.detail("TABLE\nnotes")
    assert capsys.readouterr().out == "what runs\n"
    assert (tmp_path / "memory_plans.txt").read_text() == "what runs\n\nTABLE\nnotes\n\n"
    assert log.pointer() == f"the rest in {tmp_path / 'memory_plans.txt'} (in the log too with `--log_level debug`)"
    log.start()
    log.detail("second train()")
    assert (tmp_path / "memory_plans.txt").read_text() == "second train()\n\n"


def test_the_rest_of_the_plan_is_logged_at_debug_and_a_file_that_fails_is_said_once(tmp_path, caplog):
    log = base.PlanLog(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="optimum_memopt"):
        assert not base.verbose()
        log.detail("not shown at info")
    with caplog.at_level(logging.DEBUG, logger="optimum_memopt"):
        assert base.verbose()
        log.detail("shown at debug")
        assert log.pointer().endswith("(shown above)")
    assert "not shown at info" not in caplog.text and "shown at debug" in caplog.text
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "memory_plans.txt").mkdir()  # a directory in the way
    blocked = base.PlanLog(str(tmp_path / "blocked"))
    with caplog.at_level(logging.ERROR, logger="optimum_memopt"):
        blocked.detail("one")
        blocked.detail("two")
    assert caplog.text.count("could not write") == 1 and "could not be written" in blocked.pointer()
