"""`--memory_plan_file` (issue 53, a start in seconds): a training run starts from `memopt-plan --json`'s file instead
of a dry run of its own step: step one runs the file's choice and checks it; a file planned for another step, batch,
budget or flags is refused before any step, each difference said."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import LossRecordingTrainer, Tokens, make_args
from transformers import LlamaConfig, LlamaForCausalLM

import optimum_memopt
from optimum_memopt.backends.torch.decide.budget import Prediction, fit_of_plans
from optimum_memopt.planning.dry_run import StepSpec, dry_run
from optimum_memopt.planning.plan_file import PlannedStep, differences
from optimum_memopt.trainer_args import MemoptTrainingArguments

# the grammar and the comparison: the fast tier; the runs: the slow one, on one worker (`planned`: one memopt-plan run)
pytestmark = [pytest.mark.torch_backend, pytest.mark.one_worker]

SEQ, BATCH = 128, 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(hidden=64):
    # the smallest decoder whose head is a large part of its step (vocabulary 16x hidden), so that the budget below
    # takes a choice with a lever and per-layer recompute apart, not all or nothing
    c = LlamaConfig(
        vocab_size=1024, hidden_size=hidden, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="sdpa",
    )  # fmt: skip
    c.architectures = ["LlamaForCausalLM"]
    return c


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """memopt-plan's file for the decoder's step on the CPU under 85% of the eager step's peak (a dry run's)."""
    spec = StepSpec(config(), batch=BATCH, seq=SEQ, optimizer="adamw_torch")
    budget = float(int(0.85 * dry_run(spec, backend=False).peak_bytes / 2**20))
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    kw = dict(batch=BATCH, seq=SEQ, optim="adamw_torch", search=False, device="cpu", budget_mb=budget)
    optimum_memopt.plan(config(), **kw).write_json(str(path))
    return path, json.loads(path.read_text()), budget


class _Longer(torch.utils.data.IterableDataset):
    """Rows of 64 tokens, then of `SEQ` from row `at` on, in that order (no sampler shuffles an iterable dataset)."""

    def __init__(self, at: int, n: int = 16):
        self.at, self.n = at, n

    def __iter__(self):
        for i in range(self.n):
            ids = torch.randint(0, 1024, (64 if i < self.at else SEQ,), generator=torch.Generator().manual_seed(i))
            yield {"input_ids": ids, "labels": ids}


def train(tmp_path, *flags, model_config=None, batch=BATCH, steps=3, data=None):
    torch.manual_seed(0)
    model = LlamaForCausalLM(model_config or config())
    args = make_args(
        tmp_path / "out", "--max_steps", str(steps), "--per_device_train_batch_size", str(batch),
        "--memory_opt_backend", "torch", "--optim", "adamw_torch", *flags,
    )  # fmt: skip
    data = data if data is not None else Tokens(n=16, seq=SEQ, vocab=1024)
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def run_from_the_file(path, out):
    """The run with the file and the same choice given by hand, in this process: what the test reads of them."""
    trainer = train(out / "file", "--memory_plan_file", str(path))
    planner = trainer.memopt_handle.planner
    by_hand = train(out / "hand", "--memory_opt_config", planner.planned.config())
    return {
        "plans_again": planner.plans_again,
        "search": planner.search,
        "planned": planner.planned.config(),
        "summary": planner.summary(),
        "verified": planner.verified,
        "source": planner.fits[0].source,
        "recompute_seconds": planner.fits[0].recompute_seconds,
        "losses": trainer.losses,
        "by_hand": by_hand.losses,
    }


@pytest.mark.slow
def test_a_run_starts_from_the_files_choice_without_a_dry_run(tmp_path, planned):
    """In a fresh process, as a training script runs: the file planned a process that holds nothing but the step (a
    worker of the suite holds other tests' tensors, which the run counts and the file cannot)."""
    path, record, budget = planned
    (auto,) = [c for c in record["configurations"] if c["name"] == "auto"]
    assert auto["choice"], auto  # the budget is below eager's peak: something is recomputed or chunked
    child = subprocess.run(
        [sys.executable, __file__, str(path), str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},  # this checkout's package, whatever the environment installed
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    run = json.loads((tmp_path / "run.json").read_text())
    # no dry run: the file's choice ran from step one, and step one confirmed it (a twin kept for a longer batch)
    assert run["plans_again"] and not run["search"] and run["planned"] == auto["choice"]
    summary = run["summary"]
    assert summary["config"] == auto["choice"] and summary["dry_run_peak_mb"] == pytest.approx(
        auto["peak_mb"], abs=0.1
    )
    said = child.stdout
    assert f"`--memory_plan_file {path}` chose `--memory_opt_config {auto['choice']}` under the budget" in said
    assert "no dry run here: step one runs it" in said
    assert f"step one running the choice of `--memory_plan_file {path}` to check it" in said
    assert "a dry run of step one" not in said and "a dry run's choice" not in said
    # the file's figure against what the step measured (the CPU counts storages as the dry run does)
    (check,) = run["verified"]
    assert check["measured_peak_mb"] <= budget
    assert abs(auto["peak_mb"] - check["measured_peak_mb"]) <= 0.01 * check["measured_peak_mb"], (auto, check)
    # the choice kept carries what step one measured it frees and costs
    assert run["source"].startswith(f"the choice of `--memory_plan_file {path}`") and run["recompute_seconds"] > 0
    # the same losses as the choice given by hand
    assert run["losses"] == run["by_hand"]


@pytest.mark.slow
def test_a_runs_own_dry_run_is_kept_for_the_next_run_of_the_step(tmp_path, planned):
    """`auto`'s dry run at a run's start keeps its choice as a plan file in the output directory: the next run of the
    same step given it runs that choice from step one without a dry run, training as the first run did, and a run
    of another step is refused it as memopt-plan's file is."""
    from optimum_memopt.planning.plan_file import read

    _, _, budget = planned
    first = train(tmp_path / "first", "--memory_opt_config", "auto", "--memory_budget_mb", str(budget))
    path = tmp_path / "first" / "out" / "memory_auto" / "plan.json"
    chose, losses = first.memopt_handle.planner.planned.config(), first.losses
    del first  # what the first run holds would be held outside the next one's step (the budget is 8 MiB)
    gc.collect()
    said = (tmp_path / "first" / "out" / "memory_plans.txt").read_text()
    assert "a dry run of step one" in said and f"; kept in {path}: `--memory_plan_file {path}` starts the next" in said
    kept = read(str(path))
    assert (kept.choice, kept.budget_mb, kept.step.batch, kept.step.seq) == (chose, budget, BATCH, SEQ)
    again = train(tmp_path / "again", "--memory_plan_file", str(path))
    planner = again.memopt_handle.planner
    assert planner.plans_again and planner.planned.config() == chose
    assert not (tmp_path / "again" / "out" / "memory_auto" / "plan.json").exists()  # a file's run keeps none
    assert again.losses == losses
    with pytest.raises(RuntimeError, match=rf"planned batches of {BATCH} x {SEQ} tokens, and this run's first is 4 x"):
        train(tmp_path / "batch", "--memory_plan_file", str(path), batch=4)


@pytest.mark.slow
def test_a_run_from_a_file_plans_again_for_a_batch_longer_than_the_files(tmp_path, planned):
    """A plan file's choice is for the batch it names; a later batch of more tokens is planned for by a dry run of
    it, as a run's own would be (the model's twin made for it), checked within the file's budget."""
    _, _, budget = planned
    first = train(tmp_path / "first", "--memory_opt_config", "auto", "--memory_budget_mb", str(budget),
                  data=Tokens(n=16, seq=64, vocab=1024))  # fmt: skip
    path = tmp_path / "first" / "out" / "memory_auto" / "plan.json"
    del first
    gc.collect()
    again = train(tmp_path / "again", "--memory_plan_file", str(path), data=_Longer(at=2 * BATCH), steps=5)
    planner = again.memopt_handle.planner
    said = (tmp_path / "again" / "out" / "memory_plans.txt").read_text()
    assert f"planning again for {BATCH} x {SEQ}" in said and f"more than the {BATCH} x 64" in said, said[-3000:]
    assert planner.planned_shape == (BATCH, SEQ) and [e["batch"] for e in planner.earlier] == [[BATCH, 64]]
    assert planner.verified and all(c["measured_peak_mb"] <= budget for c in planner.verified), planner.verified


@pytest.mark.slow
def test_a_file_for_another_step_is_refused_before_any_step(tmp_path, planned):
    path, record, budget = planned
    with pytest.raises(
        ValueError,
        match=r"planned another step than this run's: the model's config: head_dim 16 there, 24 here, hidden_size 64 there, 96 here\.",
    ):
        train(tmp_path / "model", "--memory_plan_file", str(path), model_config=config(hidden=96))
    with pytest.raises(ValueError, match=r"`--gradient_accumulation_steps`: the file's 1, this run's 2"):
        train(tmp_path / "accum", "--memory_plan_file", str(path), "--gradient_accumulation_steps", "2")
    with pytest.raises(RuntimeError, match=rf"planned batches of {BATCH} x {SEQ} tokens, and this run's first is 4 x"):
        train(tmp_path / "batch", "--memory_plan_file", str(path), batch=4)


@pytest.mark.slow
def test_the_flags_are_checked_against_the_file(tmp_path, planned):
    path, record, budget = planned

    def parse(*flags):
        return MemoptTrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, report_to="none", memory_opt_backend="torch", **dict(flags)
        )

    args = parse(("memory_plan_file", str(path)))
    assert args.memory_opt.auto and args.memory_opt.budget_mb == budget  # auto under the file's budget, implied
    with pytest.raises(ValueError, match=rf"chose under {budget:g} MiB, but `--memory_budget_mb 1` was given"):
        parse(("memory_plan_file", str(path)), ("memory_budget_mb", 1.0))
    with pytest.raises(ValueError, match=r"and `--memory_opt_config Layer\+:1:-1` asks for other plans"):
        parse(("memory_plan_file", str(path)), ("memory_opt_config", "Layer+:1:-1"))
    with pytest.raises(ValueError, match=r"`--memory_plan_file .*missing.json` cannot be read"):
        parse(("memory_plan_file", str(tmp_path / "missing.json")))
    no_auto = tmp_path / "no_auto.json"  # memopt-plan's file where it was given no budget: the rows, no `auto`
    record["configurations"] = [c for c in record["configurations"] if c["name"] != "auto"]
    record["run"]["auto_budget_mb"] = None
    no_auto.write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"has no `auto` row: memopt-plan plans `auto` under a budget"):
        parse(("memory_plan_file", str(no_auto)))


def test_a_choice_in_the_plan_grammar_comes_back_as_it_was_written():
    predicted = Prediction(1, "x")
    for written in ("Layer+:1:-1@0,Mul+silu+:1:-1@1-2,Loss+:1:-1@chunks2", "", "Layer+:1:-1@0-2"):
        assert fit_of_plans(written, 3, 10, predicted, predicted).config() == written


def test_lora_left_to_peft_s_default_is_peft_s_default():
    step = dict(model={"model_type": "llama"}, dtype="bfloat16", autocast="bfloat16", optimizer="adamw_torch_fused")
    step.update(grad_accum=1, fsdp=1, ddp=1)
    file_lora = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05}  # memopt-plan --use_peft without targets
    run_lora = {"r": 16, "lora_dropout": 0.05, "target_modules": ["v_proj", "q_proj"]}
    assert differences(PlannedStep(**step, lora=file_lora), PlannedStep(**step, lora=run_lora)) == []
    run_lora["target_modules"] = ["q_proj", "k_proj", "v_proj"]
    (said,) = differences(PlannedStep(**step, lora=file_lora), PlannedStep(**step, lora=run_lora))
    assert said.startswith("LoRA: the file's {'r': 16, 'lora_dropout': 0.05, 'target_modules': ['q_proj', 'v_proj']}")


def test_memopt_plan_plans_the_cpus_step_under_a_budget_only(capsys):
    from optimum_memopt.planning.cli import main

    assert main(["--model_name_or_path", "./nowhere", "--device", "cpu"]) == 2
    assert "give the budget, as in `--device cpu --memory_budget_mb 2000`" in capsys.readouterr().err


if __name__ == "__main__":  # the fresh process of test_a_run_starts_from_the_files_choice_without_a_dry_run
    report = run_from_the_file(Path(sys.argv[1]), Path(sys.argv[2]))
    (Path(sys.argv[2]) / "run.json").write_text(json.dumps(report))
