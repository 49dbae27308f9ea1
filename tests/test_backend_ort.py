"""The ORT backend's own parts, without training: the files ORT reads, and the plan report from a stub inspector."""

import io
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from optimum_memopt.backends import WrapSettings, get_backend
from optimum_memopt.backends.ort import ConfigFiles, OrtBackend
from optimum_memopt.plans import parse_inline

pytestmark = pytest.mark.ort  # the ORT backend's own behaviour: the ORT stack's suite


def test_config_file_is_what_ort_reads_and_goes_at_cleanup(tmp_path):
    files = ConfigFiles(str(tmp_path / "root"))
    path = files.write(parse_inline("Gelu+:1:-1,Cast+:2:3"))
    assert json.loads(open(path).read()) == ["Gelu+:1:-1", "Cast+:2:3"]
    assert os.path.basename(os.path.dirname(path)).startswith(f"{os.getpid()}-")
    files.cleanup()
    assert not os.path.exists(os.path.dirname(path))


def test_directories_of_dead_processes_are_swept(tmp_path):
    root = tmp_path / "root"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = root / f"{dead.stdout.strip()}-abc"
    live = root / f"{os.getppid()}-def"
    stale.mkdir(parents=True)
    live.mkdir()
    (stale / "memory_opt_config_0.json").write_text("[]")
    files = ConfigFiles(str(root))
    files.write(parse_inline("Gelu+:1:-1"))
    assert not stale.exists() and live.exists()
    files.cleanup()


def test_sigterm_removes_the_directory(tmp_path):
    # the child waits in short sleeps: importing torch starts a thread of its own, and where the kernel hands SIGTERM
    # to that thread, Python runs the handler in the main thread only when it next checks, which one sleep of 60 s
    # put off past this test's 30 s (once in the suite, 2026-11-28; SIGTERM sent to that thread alone with `tgkill`
    # leaves a 60 s sleep running, and ends this loop in 0.1 s)
    code = (
        "import sys, time\n"
        "from optimum_memopt.backends.ort import ConfigFiles\n"
        "from optimum_memopt.plans import parse_inline\n"
        f"f = ConfigFiles({str(tmp_path / 'root')!r})\n"
        "print(f.write(parse_inline('Gelu+:1:-1')), flush=True)\n"
        "for _ in range(1200):\n"
        "    time.sleep(0.05)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    path = proc.stdout.readline().strip()
    assert os.path.exists(path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # the signal still ends the process, as before
    assert not os.path.exists(os.path.dirname(path))


# -- the plan report, from a stub of ORTModule's inspector ----------------------------------------------
def _summary(freq, saving, expr="x"):
    return SimpleNamespace(freq=freq, evaluated_saving=saving, simplified_symbolic_saving_expr=expr)


def _stub(level=0, enabled=True, own=None, session=True):
    inspector = SimpleNamespace(
        cluster_id_combination_to_saving_symbolics_map={
            "Gelu+:1:-1": _summary(3, 3.0 * 2**20, "3.0*batch*seq"),
            "Cast+:1:-1,LayerNormalization+:2:0": _summary(2, 2.0 * 2**20),
            "Tile+:2:-1": _summary(4, "a*b"),  # ORT leaves some savings symbolic
        },
        symbolic_dim_name_to_value_map={"batch": 8, "seq": 32},
        _json_file_for_layerwise_recompute=own,
    )
    options = SimpleNamespace(memory_optimizer_is_enabled=lambda: enabled, memory_optimization_level=level)
    manager = SimpleNamespace(
        _execution_agent=object() if session else None,
        _runtime_options=options,
        _runtime_inspector=SimpleNamespace(memory_ob=inspector),
    )
    return SimpleNamespace(_torch_module=SimpleNamespace(_execution_manager=lambda training: manager))


def test_plan_report_from_the_settings_and_the_inspector():
    settings = WrapSettings(entries=parse_inline("Gelu+:1:2,Cast+:1:-1,BiasGelu+:1:-1"))
    report = OrtBackend().plan_report(_stub(), settings)
    by = {p.config: p for p in report.plans}
    assert by["Gelu+:1:-1"].enabled and by["Gelu+:1:-1"].applied_count == 2  # asked for 2 of 3
    assert by["Cast+:1:-1,LayerNormalization+:2:0"].enabled  # the count-0 part is not ORT's to apply
    assert by["Cast+:1:-1,LayerNormalization+:2:0"].applied_count == 2
    assert not by["Tile+:2:-1"].enabled and by["Tile+:2:-1"].saving_bytes is None
    assert report.applied == ["Gelu+:1:2", "Cast+:1:-1", "BiasGelu+:1:-1"]
    assert [u.requested for u in report.unmatched] == ["BiasGelu+:1:-1"]
    assert report.unmatched[0].closest == ["Gelu+:1:-1"]
    assert report.dims == {"batch": 8, "seq": 32}
    assert report.saving_mb(enabled_only=True) == 4.0  # Gelu on 2 of its 3 layers: 2 of 3 MiB, with Cast's 2


def test_plan_report_at_level_one_reads_orts_own_record():
    own = io.StringIO(json.dumps(["Gelu+:1:-1", "Cast+:1:-1", ""]))
    report = OrtBackend().plan_report(_stub(level=1, own=own), WrapSettings(level=1))
    assert {p.config: p.enabled for p in report.plans} == {
        "Gelu+:1:-1": True,
        "Cast+:1:-1,LayerNormalization+:2:0": True,
        "Tile+:2:-1": False,
    }
    assert report.unmatched == [] and report.requested == []


def test_no_report_before_the_first_step_and_none_claimed_when_the_optimizer_is_off():
    assert OrtBackend().plan_report(_stub(session=False), WrapSettings()) is None
    report = OrtBackend().plan_report(_stub(enabled=False), WrapSettings())
    assert report.plans_on == [] and report.applied == []


def test_unknown_backend():
    assert get_backend("ort").name == "ort"
    with pytest.raises(ValueError, match="unknown memory-optimizer backend 'x'"):
        get_backend("x")
