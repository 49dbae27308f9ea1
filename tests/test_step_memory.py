"""The picture of the step's memory after `auto`'s choice (torch backend, rank 0): written to
`memory_auto/step_memory.png` with solver.json's figures, sent to TensorBoard when the run reports there, and a
picture that cannot be written never stops training."""

import json
import logging

import pytest
from helpers import Tokens
from helpers import tiny_decoder as decoder

from optimum_memopt import MemoptTrainer, MemoptTrainingArguments
from optimum_memopt.callbacks.step_memory import IMAGE_TAG, StepMemoryCallback, draw_step_memory

pytestmark = pytest.mark.torch_backend


def train(out, budget_mb, report_to="none", steps=5):
    memory = {"memory_opt_backend": "none"}
    if budget_mb is not None:
        memory = {"memory_opt_backend": "torch", "memory_opt_config": "auto", "memory_budget_mb": budget_mb}
    args = MemoptTrainingArguments(
        output_dir=str(out), use_cpu=True, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-3,
        logging_steps=1, report_to=report_to, save_strategy="no", seed=0, **memory,
    )  # fmt: skip
    trainer = MemoptTrainer(model=decoder(), args=args, train_dataset=Tokens())
    trainer.train()
    return trainer


@pytest.mark.slow
def test_the_picture_draws_solver_json_and_goes_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tmp_path / "warm-up", None, steps=1)  # the process's first training keeps what libraries allocate once
    roomy = train(tmp_path / "roomy", 10**6)
    measured = roomy.memopt_handle.auto["measured_peak_mb"]
    floor = roomy.memopt_handle.solver_figures()["fits"][0]["floor_mb"]
    budget = round((measured + floor) / 2, 1)  # something must be recomputed
    out = tmp_path / "tight"
    trainer = train(out, budget, report_to="tensorboard")
    png = out / "memory_auto" / "step_memory.png"
    assert png.is_file() and trainer.memopt_handle.config
    data = json.loads((out / "memory_auto" / "solver.json").read_text())
    assert all(check["measured_peak_mb"] <= budget for check in data["verified"]), data["verified"]

    # the picture's data are solver.json's: drawn again from the file, every artist holds its figures
    figure = draw_step_memory(data, str(tmp_path / "again.png"))
    assert (tmp_path / "again.png").read_bytes() == png.read_bytes()
    ax = figure.axes[0]
    segments = data["memory"]["segments"]
    assert [b.get_height() for b in ax.patches] == [s["peak_mb"] for s in segments]
    # each stretch labelled from its place; a file written before segments carried one, from its name, the same
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[0] == "L0 fwd" and "head+loss" in labels and "L0 bwd" in labels and labels[-1] == "optimizer"
    older = json.loads(json.dumps(data))
    for s in older["memory"]["segments"]:
        del s["place"]
    assert [t.get_text() for t in draw_step_memory(older).axes[0].get_xticklabels()] == labels
    lines = {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}
    assert lines["predicted with the choice"] == [p["peak_mb"] for p in data["fits"][-1]["predicted_segments"]]
    assert lines[f"budget {budget:,.1f} MiB"] == [data["budget_mb"]] * 2 and round(data["budget_mb"], 1) == budget
    measured = data["verified"][-1]["measured_peak_mb"]
    assert lines[f"measured after the choice {measured:,.1f} MiB"] == [measured, measured]
    text = figure.texts[0].get_text()
    assert all(f"layer {i}: {label}" in text for i, label in enumerate(data["fits"][-1]["per_layer"]))

    for run in (out / "runs").iterdir():  # the Trainer's writer logs under runs/<date>_<host>
        events = EventAccumulator(str(run), size_guidance={"images": 0})
        events.Reload()
        if IMAGE_TAG in events.Tags()["images"]:
            break
    assert IMAGE_TAG in events.Tags()["images"]
    assert len(events.Images(IMAGE_TAG)) == 1


@pytest.mark.slow
def test_a_picture_that_cannot_be_written_never_stops_training(tmp_path, caplog):
    """A directory where the picture's temporary file goes: the write fails for real, is said, and training ends."""
    out = tmp_path / "blocked"
    (out / "memory_auto" / "step_memory.png.tmp").mkdir(parents=True)
    with caplog.at_level(logging.ERROR, logger="optimum_memopt"):
        trainer = train(out, 10**6)
    assert trainer.state.global_step == 5 and not (out / "memory_auto" / "step_memory.png").exists()
    said = [r.getMessage() for r in caplog.records if "step_memory.png" in r.getMessage()]
    assert len(said) == 1 and "training goes on without this report" in said[0]
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepMemoryCallback))
    assert callback.path == str(out / "memory_auto" / "step_memory.png")  # tried once, not at every step


@pytest.mark.slow
def test_a_second_train_gets_its_table_its_picture_and_its_wrap_check(tmp_path, monkeypatch):
    """`train()` twice on one Trainer (a second round of training, as hyperparameter trials and resumed scripts do):
    before, the second got no plan table, no picture and no check that the model it trains holds the backend."""
    from optimum_memopt.callbacks.plan_stats import PlanStatsCallback

    trainer = train(tmp_path / "twice", 10**6, steps=3)
    png = tmp_path / "twice" / "memory_auto" / "step_memory.png"
    tables = tmp_path / "twice" / "memory_plans.json"
    first = (png.stat().st_mtime_ns, tables.stat().st_mtime_ns)
    stats = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PlanStatsCallback))
    report = stats.report
    checked = []
    real = type(trainer)._memopt_check_wrapped

    def spy(self, model):
        if not self._memopt_wrap_seen:
            checked.append(type(model).__name__)
        return real(self, model)

    monkeypatch.setattr(type(trainer), "_memopt_check_wrapped", spy)
    trainer.train()
    assert stats.report is not None and stats.report is not report  # the table, made again
    assert png.stat().st_mtime_ns > first[0] and tables.stat().st_mtime_ns > first[1]  # the picture, the table
    assert checked == ["LlamaForCausalLM"]  # the wrap check ran once, on the second train()'s first step
