"""Real ORTModule training of tiny models through the Trainer (CPU)."""

import csv
import json
import subprocess
import sys

import pytest
import torch
from helpers import (
    ALL_PHASES,
    BEST_AT_END_IN_GRAPH,
    ClsData,
    EventRecorder,
    LossRecordingTrainer,
    load_without_ort,
    make_args,
    phases_at,
    tiny_model,
    train,
)

from optimum_memopt import transformers_releases
from optimum_memopt.plans import PlanReport
from optimum_memopt.trainer import MemoptTrainer


def plan_report(trainer):
    return trainer.memopt_backend.plan_report(trainer.ort_model, trainer.memopt_wrap_settings())


pytestmark = [pytest.mark.slow, pytest.mark.ort]

# ORT's fused kernels sum in another order than PyTorch's; over 20 Adam steps at lr 1e-3 the
# losses of the two backends stay within this (measured: see docs/STACK.md).
PARITY_ATOL = 2e-3
# Recompute replays the same kernels on the same inputs, so it must not change a loss.
EXACT_ATOL = 1e-5


def test_requested_plan_is_on_in_orts_structured_data(tmp_path):
    trainer = train("deberta", flags=["--memory_opt_config", "Gelu+:1:-1"], out=tmp_path, steps=2)
    report = plan_report(trainer)
    plans = {p.config: p for p in report.plans}
    assert plans["Gelu+:1:-1"].enabled is True
    assert plans["Gelu+:1:-1"].frequency == 3  # one Gelu per layer (2 layers) + the ContextPooler's
    assert plans["Gelu+:1:-1"].applied_count == 3
    assert [c for c, p in plans.items() if p.enabled] == ["Gelu+:1:-1"]
    assert report.applied == ["Gelu+:1:-1"] and report.unmatched == []
    on_disk = PlanReport.from_dict(json.loads((tmp_path / "memory_plans.json").read_text()))
    assert on_disk == report
    logged = trainer.state.log_history[0]
    assert logged["memopt/plans_on"] == 1.0
    assert logged["memopt/plans_found"] == float(len(plans))
    assert logged["memopt/planned_saving_mb"] == pytest.approx(plans["Gelu+:1:-1"].saving_bytes / 2**20, abs=0.005)


@pytest.mark.parametrize("arch", ["deberta", "roberta"])
def test_ort_matches_pytorch(tmp_path, arch):
    ort_run = train(arch, out=tmp_path / "ort", steps=20)
    pt_run = train(arch, flags=["--memory_opt_backend", "none"], out=tmp_path / "pt", steps=20)
    assert ort_run.ort_model is not None and type(ort_run.ort_model).__name__ == "ORTModule"
    assert pt_run.ort_model is None and pt_run.memopt_backend is None
    assert len(ort_run.losses) == len(pt_run.losses) == 20
    diffs = [abs(a - b) for a, b in zip(ort_run.losses, pt_run.losses)]
    assert max(diffs) < PARITY_ATOL, diffs
    assert ort_run.losses[-1] < ort_run.losses[0]  # it learns


@pytest.mark.parametrize(
    "flags,min_on",
    [
        (["--memory_opt_level", "1"], 5),
        (["--memory_opt_config", "Gelu+:1:-1,FusedMatMul+Add+:1:-1,LayerNormalization+:1:-1"], 3),
    ],
    ids=["level1", "three-plans"],
)
def test_recompute_is_exact(tmp_path, flags, min_on):
    base = train("deberta", out=tmp_path / "base", steps=20)
    recompute = train("deberta", flags=flags, out=tmp_path / "re", steps=20)
    report = plan_report(recompute)
    assert len(report.plans_on) >= min_on
    assert plan_report(base).optimizer_enabled is False
    diffs = [abs(a - b) for a, b in zip(base.losses, recompute.losses)]
    assert max(diffs) <= EXACT_ATOL, diffs


def test_resume_continues_with_uninterrupted_losses(tmp_path):
    full = train("deberta", out=tmp_path / "full", steps=10, flags=["--memory_opt_config", "Gelu+:1:-1"])
    args = make_args(
        tmp_path / "part",
        "--max_steps",
        "10",
        "--logging_steps",
        "1",
        "--save_strategy",
        "steps",
        "--save_steps",
        "5",
        "--memory_opt_config",
        "Gelu+:1:-1",
        "--print_memory_stats",
        "--print_input_density",
    )
    first = LossRecordingTrainer(model=tiny_model(), args=args, train_dataset=ClsData())
    # stop two steps after the checkpoint at step 5, as an interrupted run would
    from transformers import TrainerCallback

    class StopAt7(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 7:
                control.should_training_stop = True

    first.add_callback(StopAt7())
    first.train()
    ckpt = tmp_path / "part" / "checkpoint-5"
    assert (ckpt / "model.safetensors").exists()
    resumed = LossRecordingTrainer(model=tiny_model(seed=123), args=args, train_dataset=ClsData())
    refusal = transformers_releases.resume_refusal()
    if refusal:  # transformers >= 4.53 on torch 2.4: said before training, with what to do instead
        with pytest.raises(RuntimeError, match=r"^resuming from a checkpoint: transformers .* refuses torch.load"):
            resumed.train(resume_from_checkpoint=str(ckpt))
        return
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.ort_model is not None
    assert len(resumed.losses) == 5
    diffs = [abs(a - b) for a, b in zip(full.losses[5:], resumed.losses)]
    assert max(diffs) <= EXACT_ATOL, (full.losses[5:], resumed.losses)
    # the reports continue from the checkpoint: the interrupted run's steps 5-6 are replaced, nothing is lost
    with open(tmp_path / "part" / "input_density.csv") as f:
        assert [r["step"] for r in csv.DictReader(f) if r["input_type"] == "EMBED"] == [str(s) for s in range(10)]
    with open(tmp_path / "part" / "memory_phases.csv") as f:
        assert [r["step"] for r in csv.DictReader(f) if r["phase"] == "pre_forward"] == [str(s) for s in range(10)]


def test_saved_model_loads_without_onnxruntime(tmp_path):
    trainer = train("roberta", out=tmp_path / "run", steps=3, flags=["--memory_opt_level", "1"])
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()
    probe = torch.tensor([[5, 6, 7, 8, 9]])
    trainer.plain_model.eval()
    with torch.no_grad():
        expected = trainer.plain_model(input_ids=probe).logits
    torch.save(expected, tmp_path / "expected.pt")
    code = (
        "import sys, torch\n"
        "sys.modules['onnxruntime'] = None  # make any import of ORT fail\n"
        "from transformers import AutoModelForSequenceClassification\n"
        f"m = AutoModelForSequenceClassification.from_pretrained({str(tmp_path / 'saved')!r}).eval()\n"
        f"exp = torch.load({str(tmp_path / 'expected.pt')!r})\n"
        "got = m(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits\n"
        "assert torch.allclose(got, exp, atol=1e-6), (got, exp)\n"
        "print('LOADED', type(m).__name__)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LOADED RobertaForSequenceClassification" in res.stdout


def test_callbacks_order_files_and_evaluation(tmp_path):
    recorder = EventRecorder()
    trainer = train(
        "deberta",
        out=tmp_path,
        steps=12,
        recorder=recorder,
        flags=[
            "--memory_opt_config",
            "Gelu+:1:-1",
            "--print_memory_stats",
            "--print_input_density",
            "--log_all_memory_metrics",
            "--logging_steps",
            "4",
        ],
    )
    names = [n for n, _ in recorder.events]
    assert names[:2] == ["on_init_end", "on_train_begin"]
    # per step: begin, pre-optimizer (post_backward reading), optimizer, end
    first_step = names[names.index("on_step_begin") : names.index("on_step_end") + 1]
    assert first_step == ["on_step_begin", "on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    assert names[-1] == "on_train_end"

    with open(tmp_path / "memory_phases.csv") as f:
        rows = list(csv.DictReader(f))
    steps = sorted({int(r["step"]) for r in rows})
    assert steps == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11]  # first ten, then logging step 12 (index 11)
    for s in steps:
        assert [r["phase"] for r in rows if int(r["step"]) == s] == [
            "pre_forward",
            "post_forward",
            "pre_backward",
            "post_backward",
        ]
    assert all(float(r["in_use_mb"]) > 0 and float(r["in_use_peak_mb"]) >= float(r["in_use_mb"]) - 0.05 for r in rows)
    assert all(float(r["resident_mb"]) > 0 for r in rows)
    assert (tmp_path / "memory_phases.png").stat().st_size > 1000

    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 3
    for h in logs:
        for phase in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
            assert h[f"memopt/mem_{phase}_mb"] > 0
        # ClsData pads each row to 32 tokens with 6..31 real ones: density strictly between 0 and 100
        assert 15 < h["memopt/embed_density_pct"] < 100
        assert h["memopt/label_density_pct"] == 100.0
        assert h["memopt/embed_total_tokens"] == 4 * 8 * 32
    with open(tmp_path / "input_density.csv") as f:
        dens = list(csv.DictReader(f))
    assert len(dens) == 2 * 12

    # evaluation runs the plain module, sharing the trained weights
    metrics = trainer.evaluate(ClsData(n=16))
    assert "eval_loss" in metrics and metrics["eval_loss"] > 0
    assert not any(k.startswith("memopt/") for k in metrics)


def test_loss_in_graph_with_label_smoothing(tmp_path):
    plain = train(
        "deberta",
        out=tmp_path / "a",
        steps=6,
        flags=["--label_smoothing_factor", "0.1", "--memory_opt_backend", "none"],
    )
    in_graph = train(
        "deberta", out=tmp_path / "b", steps=6, flags=["--label_smoothing_factor", "0.1", "--ort_loss_in_graph"]
    )
    diffs = [abs(a - b) for a, b in zip(plain.losses, in_graph.losses)]
    assert max(diffs) < PARITY_ATOL, diffs
    in_graph.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    for (k, v), (k2, v2) in zip(in_graph.plain_model.state_dict().items(), reloaded.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_loss_in_graph_with_best_model_at_end_saves_a_final_model_and_counts_right(tmp_path):
    """`--ort_loss_in_graph --load_best_model_at_end --label_smoothing_factor 0.1`: the best checkpoint is loaded,
    the final model saved and loadable without ORT; FLOPs, density and eval loss are those of the plain run."""
    model = tiny_model("deberta")
    args = make_args(
        tmp_path / "run", "--max_steps", "6", "--logging_steps", "1", "--print_input_density", *BEST_AT_END_IN_GRAPH
    )
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=ClsData(), eval_dataset=ClsData(n=16))
    out = trainer.train()
    assert trainer.state.best_model_checkpoint is not None
    assert trainer.state.total_flos > 0  # counted through the wrapper
    assert not any(k.startswith("memopt/") for k in out.metrics)  # per-step metrics stay in the log history
    trainer.save_model(str(tmp_path / "final"))
    with open(tmp_path / "run" / "input_density.csv") as f:
        rows = list(csv.DictReader(f))
    embed = [r for r in rows if r["input_type"] == "EMBED"]
    assert embed and all(r["pad_idx"] == "0" for r in embed)  # the pad id, found through the wrapper
    assert any(float(r["density_pct"]) < 100 for r in embed)
    assert [r for r in rows if r["input_type"] == "LABEL"]
    # evaluation with the smoothing applied, exactly as the plain PyTorch trainer computes it on the same weights
    in_graph_eval = trainer.evaluate()["eval_loss"]
    plain_args = make_args(tmp_path / "plain", "--label_smoothing_factor", "0.1", "--memory_opt_backend", "none")
    plain = MemoptTrainer(model=trainer.plain_model, args=plain_args, eval_dataset=ClsData(n=16))
    assert plain.evaluate()["eval_loss"] == pytest.approx(in_graph_eval, abs=1e-6)
    assert load_without_ort(tmp_path / "final") == "DebertaV2ForSequenceClassification"


def test_label_density_survives_the_label_smoother(tmp_path):
    trainer = train(
        "deberta",
        out=tmp_path,
        steps=3,
        flags=[
            "--label_smoothing_factor",
            "0.1",
            "--print_input_density",
            "--print_memory_stats",
            "--log_all_memory_metrics",
        ],
    )
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["memopt/label_total"] == 8 for h in logged)
    assert phases_at(tmp_path, 1) == ALL_PHASES


def test_a_custom_compute_loss_that_pops_the_labels_hides_nothing(tmp_path):
    class CustomLoss(LossRecordingTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):  # the documented pattern
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs["logits"], labels)
            return (loss, outputs) if return_outputs else loss

    args = make_args(
        tmp_path,
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--print_input_density",
        "--print_memory_stats",
        "--log_all_memory_metrics",
    )
    trainer = CustomLoss(model=tiny_model(), args=args, train_dataset=ClsData())
    trainer.train()
    assert all(h["memopt/label_total"] == 8 for h in trainer.state.log_history if "loss" in h)
    assert phases_at(tmp_path, 1) == ALL_PHASES


def test_gradient_accumulation_reports_every_micro_batch(tmp_path):
    trainer = train(
        "deberta",
        out=tmp_path,
        steps=2,
        flags=["--gradient_accumulation_steps", "2", "--print_input_density", "--print_memory_stats"],
    )
    with open(tmp_path / "input_density.csv") as f:
        embed = [(r["step"], r["micro_batch"]) for r in csv.DictReader(f) if r["input_type"] == "EMBED"]
    assert embed == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    with open(tmp_path / "memory_phases.csv") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["0"] * 4 + ["1"] * 4
    assert trainer.losses and len(trainer.losses) == 4


def test_model_init_builds_the_model_that_is_switched_wrapped_and_saved(tmp_path):
    built = []

    def model_init():
        built.append(tiny_model("roberta", attn="sdpa", seed=len(built)))
        return built[-1]

    args = make_args(tmp_path, "--max_steps", "3", "--memory_opt_level", "1")
    trainer = LossRecordingTrainer(model_init=model_init, args=args, train_dataset=ClsData(pad_id=1))
    trainer.train()
    assert trainer.plain_model is built[-1]
    assert trainer.plain_model.config._attn_implementation == "eager"
    assert not any("Sdpa" in type(m).__name__ for m in trainer.plain_model.modules())
    assert trainer.ort_model is not None and trainer.ort_model._torch_module._original_module is built[-1]
    trainer.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved"))
    assert all(torch.equal(a, b) for a, b in zip(built[-1].state_dict().values(), reloaded.state_dict().values()))


def test_requested_plans_that_match_nothing_are_warned_about(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
        trainer = train(
            "deberta", out=tmp_path, steps=2, flags=["--memory_opt_config", "BiasGelu+:1:-1,gelu+:1:-1,Foo+:1:-1"]
        )
    report = plan_report(trainer)
    assert report.plans_on == []  # nothing requested exists on CPU
    messages = [r.getMessage() for r in caplog.records if "matches no plan ORT found" in r.getMessage()]
    assert len(messages) == 3
    assert (
        "'BiasGelu+:1:-1' matches no plan ORT found, so it is not applied; closest plans found: 'Gelu+:1:-1'"
        in messages[0]
    )
    assert "'gelu+:1:-1'" in messages[1] and "'Gelu+:1:-1'" in messages[1]
    assert "'Foo+:1:-1'" in messages[2] and "nothing similar; plans found:" in messages[2]
    assert json.loads((tmp_path / "memory_plans.json").read_text())["unmatched"][0]["closest"] == ["Gelu+:1:-1"]


def test_level_one_reports_what_ort_applies(tmp_path):
    trainer = train("deberta", out=tmp_path, steps=2, flags=["--memory_opt_level", "1"])
    report = plan_report(trainer)
    assert report.level == 1 and report.optimizer_enabled
    # ORT's own record of its choice: every type-1 part of every cluster, nothing of type 2
    assert report.applied and all(":1:" in p for p in report.applied)
    for p in report.plans:
        types = {e.optimization_type for e in p.entries if e.apply_count != 0}
        assert p.enabled == (types == {1}), p
        assert p.applied_count == (p.frequency if p.enabled else 0)


def test_a_script_moved_from_optimums_ort_trainer_trains_with_its_flags(tmp_path):
    """An ORTTrainer script after `from optimum_memopt import MemoptTrainer as ORTTrainer, MemoptTrainingArguments as
    ORTTrainingArguments`: its flags work, and the graphs land where ORTTrainer put them."""
    from transformers import HfArgumentParser

    from optimum_memopt import MemoptTrainer as ORTTrainer  # noqa: N814
    from optimum_memopt import MemoptTrainingArguments as ORTTrainingArguments  # noqa: N814

    (args,) = HfArgumentParser(ORTTrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "--report_to",
            "none",
            "--max_steps",
            "2",
            "--save_strategy",
            "no",
            "--use_module_with_loss",
            "--save_onnx",
            "--onnx_prefix",
            "tiny",
            "--optim",
            "adamw_ort_fused",
            "--label_smoothing_factor",
            "0.1",
        ]
    )
    trainer = ORTTrainer(model=tiny_model(), args=args, train_dataset=ClsData())
    trainer.train()
    assert type(trainer.ort_model._torch_module._original_module).__name__ == "LossInGraph"
    saved = sorted(p.name for p in tmp_path.glob("tiny*.onnx"))
    assert saved and all(name.startswith("tiny") for name in saved)
