"""The three callbacks alone, driven by hand with the Trainer's real state and arguments and a stub backend."""

import builtins
import contextlib
import csv
import errno
import json
import logging

import pytest
import torch
from helpers import make_args
from torch import nn
from transformers import TrainerControl, TrainerState

from optimum_memopt.backends import WrapSettings
from optimum_memopt.callbacks import InputDensityCallback, MemoryPhaseCallback, PlanStatsCallback
from optimum_memopt.callbacks.memory_phases import should_record
from optimum_memopt.plans import FoundPlan, PlanReport, Unmatched

# the callbacks against the installed Trainer's events: both stacks' (and the compatibility slice's) transformers range
pytestmark = pytest.mark.both_stacks


class StubBackend:
    name = "ort"

    def __init__(self, report):
        self.report = report
        self.asked = []

    def find(self, model):
        return model

    def plan_report(self, wrapped, settings):
        self.asked.append(settings)
        return self.report


class FakeTrainer:
    def __init__(self, model, backend=None):
        self.plain_model = model
        self.memopt_backend = backend

    def memopt_wrap_settings(self):
        return WrapSettings()


def state(step=0, rank0=True):
    s = TrainerState()
    s.global_step = step
    s.is_world_process_zero = rank0
    return s


REPORT = PlanReport(
    "ort",
    True,
    0,
    ["Gelu+:1:-1", "Foo+:1:-1"],
    ["Gelu+:1:-1", "Foo+:1:-1"],
    [FoundPlan("Gelu+:1:-1", True, 3, 3 * 2**20, "x", 3), FoundPlan("Cast+:1:-1", False, 2, 2**20, "y", 0)],
    {"batch": 8},
    [Unmatched("Foo+:1:-1", ["Gelu+:1:-1", "Cast+:1:-1"], False)],
)


# -- plan stats ---------------------------------------------------------------------------------------
def test_plan_stats_table_json_metrics_and_unmatched_warning(tmp_path, caplog):
    args = make_args(tmp_path)
    cb = PlanStatsCallback(FakeTrainer(nn.Linear(2, 2), StubBackend(REPORT)))
    with caplog.at_level(logging.INFO, logger="optimum_memopt"):
        cb.on_step_end(args, state(1), TrainerControl(), model=nn.Linear(2, 2))
        cb.on_step_end(args, state(2), TrainerControl(), model=nn.Linear(2, 2))  # once only
    tables = [r for r in caplog.records if "recompute plan(s) found" in r.getMessage()]
    assert len(tables) == 1 and "2 recompute plan(s) found, 1 ON" in tables[0].getMessage()
    assert "3/3" not in tables[0].getMessage() and "memory_plans.txt" in tables[0].getMessage()  # a line, and where
    assert "3/3" in (tmp_path / "memory_plans.txt").read_text()  # the rest is: the table
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "requested plan 'Foo+:1:-1' matches no plan ORT found, so it is not applied; nothing similar; "
        "plans found: 'Gelu+:1:-1', 'Cast+:1:-1'"
    ]
    assert PlanReport.from_dict(json.loads((tmp_path / "memory_plans.json").read_text())) == REPORT
    assert cb.pop_metrics() == {
        "memopt/plans_found": 2.0,
        "memopt/plans_on": 1.0,
        "memopt/planned_saving_mb": 3.0,
        "memopt/available_saving_mb": 4.0,
    }
    assert cb.pop_metrics() == {}


def test_plan_stats_does_nothing_on_other_ranks(tmp_path):
    backend = StubBackend(REPORT)
    cb = PlanStatsCallback(FakeTrainer(nn.Linear(2, 2), backend))
    cb.on_step_end(make_args(tmp_path), state(1, rank0=False), TrainerControl(), model=nn.Linear(2, 2))
    assert backend.asked == [] and not (tmp_path / "memory_plans.json").exists()


def test_a_report_that_cannot_be_written_does_not_stop_training(tmp_path, caplog):
    (tmp_path / "memory_plans.json").mkdir()  # a directory in the way
    cb = PlanStatsCallback(FakeTrainer(nn.Linear(2, 2), StubBackend(REPORT)))
    with caplog.at_level(logging.ERROR, logger="optimum_memopt"):
        cb.on_step_end(make_args(tmp_path), state(1), TrainerControl(), model=nn.Linear(2, 2))
    assert any("could not write" in r.getMessage() and "memory_plans.json" in r.getMessage() for r in caplog.records)
    assert cb.pop_metrics()["memopt/plans_on"] == 1.0  # the rest of the report still happens


# -- input density ------------------------------------------------------------------------------------
class WithConfig(nn.Linear):
    def __init__(self, pad):
        super().__init__(2, 2)
        self.config = type("Config", (), {"pad_token_id": pad})()


def batch(valid_per_row, seq=8, pad=0, labels_valid=None):
    ids = torch.full((len(valid_per_row), seq), pad)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(valid_per_row):
        ids[i, :n] = 5
        mask[i, :n] = 1
    labels = torch.full((len(valid_per_row),), -100)
    labels[: labels_valid if labels_valid is not None else len(valid_per_row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_density_sees_every_micro_batch_and_sums_until_the_log(tmp_path, caplog):
    args = make_args(tmp_path)
    cb = InputDensityCallback(table_steps=2, trainer=FakeTrainer(WithConfig(pad=0)))
    st = state(0)
    cb.on_train_begin(args, st, TrainerControl(), model=None)
    with caplog.at_level(logging.INFO, logger="optimum_memopt"):
        for step in range(2):
            st.global_step = step
            cb.observe_batch(batch([8, 4]), st)  # micro-batch 0: 12 of 16
            cb.observe_batch(batch([2, 2], labels_valid=1), st)  # micro-batch 1: 4 of 16
            st.global_step = step + 1
            cb.on_step_end(args, st, TrainerControl())
    m = cb.pop_metrics()
    assert m["memopt/embed_valid_tokens"] == 32 and m["memopt/embed_total_tokens"] == 64
    assert m["memopt/embed_density_pct"] == 50.0
    assert m["memopt/label_valid"] == 6 and m["memopt/label_total"] == 8
    with open(tmp_path / "input_density.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["micro_batch"], r["input_type"]) for r in rows[:4]] == [
        ("0", "0", "EMBED"),
        ("0", "0", "LABEL"),
        ("0", "1", "EMBED"),
        ("0", "1", "LABEL"),
    ]
    assert len(rows) == 8 and rows[0]["pad_idx"] == "0" and rows[0]["density_pct"] == "75.00"
    table = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Input density")]
    assert len(table) == 1 and table[0].count("| EMBED") == 4
    # after a log, the next figures start from zero
    cb.observe_batch(batch([1, 1]), st)
    assert cb.pop_metrics()["memopt/embed_valid_tokens"] == 2


def test_density_without_pad_id_uses_the_mask_and_says_so(tmp_path):
    cb = InputDensityCallback(trainer=FakeTrainer(WithConfig(pad=None)))
    cb.on_train_begin(make_args(tmp_path), state(0), TrainerControl())
    cb.observe_batch(batch([3, 5]), state(0))
    with open(tmp_path / "input_density.csv") as f:
        row = next(csv.DictReader(f))
    assert row["pad_idx"] == "mask" and row["valid"] == "8"


def test_density_state_stays_bounded_however_rarely_the_trainer_logs(tmp_path):
    cb = InputDensityCallback(table_steps=1, trainer=FakeTrainer(WithConfig(pad=0)))
    cb.on_train_begin(make_args(tmp_path), state(0), TrainerControl())
    for step in range(300):
        cb.observe_batch(batch([4, 4]), state(step))
    assert len(cb.rows) == cb.rows.maxlen == 64  # a bounded window; sums are two counters per input type
    assert cb.pop_metrics()["memopt/embed_total_tokens"] == 300 * 16


def test_resume_appends_from_the_checkpoint_step(tmp_path):
    args = make_args(tmp_path)
    cb = InputDensityCallback(trainer=FakeTrainer(WithConfig(pad=0)))
    cb.on_train_begin(args, state(0), TrainerControl())
    for step in range(6):
        cb.observe_batch(batch([4]), state(step))
    resumed = InputDensityCallback(trainer=FakeTrainer(WithConfig(pad=0)))
    resumed.on_train_begin(args, state(3), TrainerControl())  # resumed from checkpoint-3
    for step in range(3, 5):
        resumed.observe_batch(batch([4]), state(step))
    with open(tmp_path / "input_density.csv") as f:
        steps = [r["step"] for r in csv.DictReader(f) if r["input_type"] == "EMBED"]
    assert steps == ["0", "1", "2", "3", "4"]


# -- memory phases ------------------------------------------------------------------------------------
def test_should_record():
    assert [s for s in range(40) if should_record(s, 0)] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32]
    assert should_record(24, 5) and not should_record(23, 5)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(6)])


def _step(model, cb, args, st, micro_batches=1):
    for _ in range(micro_batches):
        out = model(torch.randn(2048, 512))
        loss = out.square().mean()
        cb.observe_loss(loss)
        loss.backward()
        del out, loss
    cb.on_pre_optimizer_step(args, st, TrainerControl())
    for p in model.parameters():
        p.grad = None
    st.global_step += 1


def test_phases_show_activations_held_after_forward_and_freed_after_backward(tmp_path):
    model = _mlp().train()
    args = make_args(tmp_path, "--logging_steps", "100")
    cb = MemoryPhaseCallback(FakeTrainer(model))
    st = state(0)
    cb.on_train_begin(args, st, TrainerControl(), model=model)
    for _ in range(4):
        _step(model, cb, args, st, micro_batches=2)
    cb.on_train_end(args, st, TrainerControl())
    with open(tmp_path / "memory_phases.csv") as f:
        rows = list(csv.DictReader(f))
    # one set of four phases per step, even with two forwards per step
    assert [(r["step"], r["phase"]) for r in rows[:4]] == [
        ("0", p) for p in ("pre_forward", "post_forward", "pre_backward", "post_backward")
    ]
    assert len(rows) == 16
    activations = 6 * 2 * 2048 * 512 * 4 / 2**20  # Linear outputs + GELU outputs kept for backward: 48 MiB
    for step in ("2", "3"):
        r = {x["phase"]: float(x["in_use_mb"]) for x in rows if x["step"] == step}
        held = r["post_forward"] - r["pre_forward"]
        assert 0.8 * activations < held < 1.5 * activations, (held, activations)
        assert r["post_backward"] < r["post_forward"] - 0.5 * activations
        peak = {x["phase"]: float(x["in_use_peak_mb"]) for x in rows if x["step"] == step}
        assert peak["post_forward"] >= r["post_forward"] - 0.01
    assert all(float(x["resident_mb"]) > 0 for x in rows)
    m = cb.pop_metrics()
    assert m["memopt/mem_step_peak_mb"] >= m["memopt/mem_post_forward_mb"] > m["memopt/mem_pre_forward_mb"]
    assert (tmp_path / "memory_phases.png").stat().st_size > 1000


def test_phases_read_the_device_the_model_trains_on(tmp_path, monkeypatch, caplog):
    """A run on the CPU of a machine that has a GPU (`--use_cpu`) is read on the CPU, not from CUDA's counters,
    which would show nothing held; a device the plugin cannot read records no phases and says why."""
    model = _mlp().train()
    args = make_args(tmp_path, "--logging_steps", "100")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cb = MemoryPhaseCallback(FakeTrainer(model), plot=False)
    st = state(0)
    cb.on_train_begin(args, st, TrainerControl(), model=model)
    for _ in range(3):
        _step(model, cb, args, st)
    cb.on_train_end(args, st, TrainerControl())
    with open(tmp_path / "memory_phases.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["step"] == "2"]
    assert {r["device"] for r in rows} == {"cpu"}
    by = {r["phase"]: float(r["in_use_mb"]) for r in rows}
    assert by["post_forward"] - by["pre_forward"] > 20  # 48 MiB of activations (see the test above)

    monkeypatch.undo()
    meta = nn.Linear(4, 4, device="meta")
    out = tmp_path / "meta"
    cb = MemoryPhaseCallback(FakeTrainer(meta), plot=False)
    with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
        cb.on_train_begin(make_args(out), state(0), TrainerControl(), model=meta)
    cb.on_train_end(args, state(0), TrainerControl())
    assert "this run trains on 'meta'" in caplog.text and "no phases are recorded" in caplog.text
    assert not (out / "memory_phases.csv").exists()


def test_phases_with_a_custom_compute_loss_still_see_backward_start(tmp_path):
    # a custom compute_loss that never reaches the trainer's hook: backward is seen where it reaches the output
    model = _mlp().train()
    args = make_args(tmp_path)
    cb = MemoryPhaseCallback(FakeTrainer(model), plot=False)
    st = state(0)
    cb.on_train_begin(args, st, TrainerControl(), model=model)
    model(torch.randn(16, 512)).sum().backward()
    cb.on_pre_optimizer_step(args, st, TrainerControl())
    with open(tmp_path / "memory_phases.csv") as f:
        assert [r["phase"] for r in csv.DictReader(f)] == [
            "pre_forward",
            "post_forward",
            "pre_backward",
            "post_backward",
        ]


def test_phases_survive_an_unwritable_output_dir(tmp_path, caplog):
    model = _mlp().train()
    out = tmp_path / "out"
    args = make_args(out)
    out.mkdir()
    (out / "memory_phases.csv").mkdir()  # a directory in the way
    (out / "memory_phases.png").mkdir()
    cb = MemoryPhaseCallback(FakeTrainer(model))
    st = state(0)
    with caplog.at_level(logging.ERROR, logger="optimum_memopt"):
        cb.on_train_begin(args, st, TrainerControl(), model=model)
        _step(model, cb, args, st)
        _step(model, cb, args, st)
        cb.on_train_end(args, st, TrainerControl())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    csv_errors = [e for e in errors if "memory_phases.csv" in e]
    assert len(csv_errors) == 2  # said once, not every step, and at the end that it is absent
    assert "memory_phases.csv is absent: it could not be written since IsADirectoryError" in csv_errors[1]
    assert csv_errors[1].endswith("(8 rows not written)")  # 2 steps x 4 phases
    assert any("memory_phases.png" in e for e in errors)
    assert cb.pop_metrics()["memopt/mem_post_forward_mb"] > 0


@pytest.mark.parametrize("cls", [InputDensityCallback, MemoryPhaseCallback])
def test_other_ranks_record_nothing(tmp_path, cls):
    model = _mlp()
    cb = cls(trainer=FakeTrainer(model))
    cb.on_train_begin(make_args(tmp_path), state(0, rank0=False), TrainerControl(), model=model)
    if cls is InputDensityCallback:
        cb.observe_batch(batch([4]), state(0, rank0=False))
    else:
        model(torch.randn(4, 512))
    assert cb.pop_metrics() == {} and list(tmp_path.iterdir()) == []


# -- reports on a full disk: whole or absent ----------------------------------------------------------------------


def _csv_rows(path):
    """The report's rows as `csv.DictReader` reads them, checking the header is the first line."""
    with open(path, newline="") as f:
        lines = f.read().splitlines()
    assert lines and lines[0].startswith("step,"), lines[:2]
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _drive(tmp_path_out, steps, at_step=None):
    """Both CSV reports of a run, by hand: `at_step(step)` runs before each step (to fill or free the disk); after
    each step each report is checked whole (header first, every row since step 0) or absent."""
    model = WithConfig(pad=0)
    args = make_args(tmp_path_out)
    density = InputDensityCallback(trainer=FakeTrainer(model))
    mlp = _mlp().train()
    phases = MemoryPhaseCallback(FakeTrainer(mlp))
    st = state(0)
    if at_step:
        at_step(-1)
    density.on_train_begin(args, st, TrainerControl())
    phases.on_train_begin(args, st, TrainerControl(), model=mlp)
    seen = []
    for step in range(steps):
        if at_step:
            at_step(step)
        st.global_step = step
        density.observe_batch(batch([4, 3]), st)
        _step(mlp, phases, args, st)
        for name, per_step in (("input_density.csv", 2), ("memory_phases.csv", 4)):
            path = tmp_path_out / name
            if path.exists():
                rows = _csv_rows(path)
                assert [int(r["step"]) for r in rows] == sorted(s for s in range(step + 1) for _ in range(per_step))
        seen.append({n: (tmp_path_out / n).exists() for n in ("input_density.csv", "memory_phases.csv")})
    density.on_train_end(args, st, TrainerControl())
    phases.on_train_end(args, st, TrainerControl())
    return seen


class FullDisk:
    """`open` for the reports' module while the disk is "full": a file opened for writing takes half of what is
    written to it and raises ENOSPC, as a file system that runs out of room mid-write does."""

    def __init__(self):
        self.full = False

    def __call__(self, path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        if not (self.full and mode[:1] in "wa"):
            return f
        real_write = f.write

        def write(text):
            real_write(text[: len(text) // 2])
            f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        f.write = write
        return f


def test_a_report_cut_short_by_a_full_disk_is_removed_and_written_whole_when_room_comes_back(tmp_path, caplog):
    """Before: the rows of the steps the disk was full were lost and a half-written row left in the file; a report
    written 0 bytes at its start got its later rows with no header."""
    from optimum_memopt.callbacks import base

    disk = FullDisk()
    base.open = disk
    try:
        with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
            seen = _drive(tmp_path, 6, lambda step: setattr(disk, "full", step in (2, 3)))
    finally:
        del base.open
    assert [s["input_density.csv"] for s in seen] == [True, True, False, False, True, True]
    assert [s["memory_phases.csv"] for s in seen] == [True, True, False, False, True, True]
    said = [r.getMessage() for r in caplog.records]
    for name in ("input_density.csv", "memory_phases.csv"):
        lost = [m for m in said if m.startswith(f"could not write {tmp_path / name} (OSError: [Errno 28] No space")]
        assert len(lost) == 1 and "no file is left there, rather than one cut short" in lost[0]
        assert sum(f"{tmp_path / name} is written whole again" in m for m in said) == 1


def test_a_report_that_could_not_start_on_a_full_file_system_is_written_whole_later(tmp_path, caplog):
    """A real full file system (a 96 KiB tmpfs filled by a file, removed before step 2): the reports are absent
    while it is full, then whole from step 0."""
    import shutil
    import subprocess

    fs = tmp_path / "fs"
    fs.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(fs)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (the fault-injected test above covers the same logic)")
    try:
        out, filler = fs / "out", fs / "filler"
        out.mkdir()
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"x" * 4096)
                f.flush()
        with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
            seen = _drive(out, 5, lambda step: filler.unlink() if step == 2 else None)
        assert [s["input_density.csv"] for s in seen] == [False, False, True, True, True]
        assert len(_csv_rows(out / "input_density.csv")) == 5 * 2
        assert len(_csv_rows(out / "memory_phases.csv")) == 5 * 4
        assert not list(out.glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(fs)], check=False)
        shutil.rmtree(fs, ignore_errors=True)
