"""optimum's own `ORTTrainer` (optimum 1.27, the last release with it) under `MemoptTrainerMixin`: the model is
wrapped once, by ORTTrainer's loop through this plugin's backend, so the memory flags reach ORT, and the reports
(plans, density, phases) come out as with `MemoptTrainer`. Needs optimum 1.27 and torch-ort, which the ORT stack's
set-up installs (`scripts/setup_env.sh`)."""

import csv
import json

import pytest
from helpers import ClsData, LossRecordingMixin, make_args, tiny_model

from optimum_memopt.ort_trainer_parts import is_optimum_ort_trainer
from optimum_memopt.trainer import MemoptTrainerMixin

pytestmark = pytest.mark.ort

ort_trainer = pytest.importorskip("optimum.onnxruntime.trainer", reason="needs optimum <= 1.27 (ORTTrainer)")
pytest.importorskip("torch_ort", reason="needs torch-ort (optimum's ORTTrainer imports ORTModule from it)")


class OptimumTrainer(LossRecordingMixin, MemoptTrainerMixin, ort_trainer.ORTTrainer):
    pass


def _train(cls, out, *flags, steps=6):
    args = make_args(
        out, "--max_steps", str(steps), "--logging_steps", "2", "--print_memory_stats", "--print_input_density", *flags
    )
    trainer = cls(model=tiny_model("deberta"), args=args, train_dataset=ClsData(n=8 * steps))
    trainer.train()
    return trainer


def _ort_modules(model):
    from onnxruntime.training.ortmodule import ORTModule

    found = []
    for _ in range(8):
        if model is None:
            break
        if isinstance(model, ORTModule):
            found.append(model)
            model = model.module
        else:
            model = getattr(model, "module", None)
    return found


@pytest.mark.slow
def test_optimum_ort_trainer_reports_and_applies_the_plans(tmp_path):
    from helpers import LossRecordingTrainer

    assert is_optimum_ort_trainer(OptimumTrainer) and not is_optimum_ort_trainer(LossRecordingTrainer)
    flags = ["--memory_opt_config", "Gelu+:1:-1"]
    theirs = _train(OptimumTrainer, tmp_path / "optimum", *flags)
    ours = _train(LossRecordingTrainer, tmp_path / "ours", *flags)

    # wrapped once, by ORTTrainer's own loop; the plain model is what saving and evaluation use
    assert len(_ort_modules(theirs.model_wrapped)) == 1
    assert theirs.ort_model is not None and theirs.ort_model.module is theirs.plain_model
    # the flag reached ORT: the plan is on and applied, as in MemoptTrainer's run of the same model
    report = json.loads((tmp_path / "optimum" / "memory_plans.json").read_text())
    gelu = [p for p in report["plans"] if p["config"] == "Gelu+:1:-1"]
    assert gelu and gelu[0]["enabled"] and gelu[0]["applied_count"] > 0, report
    mine = json.loads((tmp_path / "ours" / "memory_plans.json").read_text())
    assert [p for p in mine["plans"] if p["config"] == "Gelu+:1:-1"] == gelu
    assert max(abs(a - b) for a, b in zip(theirs.losses, ours.losses)) <= 1e-5, (theirs.losses, ours.losses)
    # density and phases, every step
    for name in ("input_density.csv", "memory_phases.csv"):
        rows = list(csv.DictReader(open(tmp_path / "optimum" / name)))
        assert {int(r["step"]) for r in rows} == set(range(6)), name
    # the saved model is the plain Hugging Face model
    theirs.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_use_module_with_loss_trains_with_the_in_graph_loss_under_ort_trainer(tmp_path):
    """optimum's own `ModuleWithLoss` cannot be built on transformers >= 4.46; here the flag is the in-graph loss."""
    trainer = _train(OptimumTrainer, tmp_path, "--use_module_with_loss", steps=4)
    assert trainer.args.ort_loss_in_graph and trainer.args.use_module_with_loss
    assert type(trainer.ort_model.module).__name__ == "LossInGraph"
    assert len(trainer.losses) == 4 and all(x == x for x in trainer.losses)


def test_what_ort_trainer_cannot_do_is_refused_before_training(tmp_path):
    from types import SimpleNamespace

    from optimum_memopt.ort_trainer_parts import check_ort_trainer_args as _check_ort_trainer_args

    with pytest.raises(
        ValueError, match=r"^`--memory_opt_backend none` with optimum's ORTTrainer: ORTTrainer always trains"
    ):
        OptimumTrainer(model=tiny_model("deberta"), args=make_args(tmp_path, "--memory_opt_backend", "none"))
    # the torch backend needs torch >= 2.5, where ORTTrainer cannot run: the check itself
    torch_args = SimpleNamespace(memory_opt_on=True, memory_opt=SimpleNamespace(backend="torch"))
    with pytest.raises(ValueError, match=r"^`--memory_opt_backend torch` with optimum's ORTTrainer"):
        _check_ort_trainer_args(torch_args)
