"""The recipes end to end in tiny form, as subprocesses, like a user runs them."""

import csv
import json
import os
import subprocess
import sys

import pytest
from helpers import BEST_AT_END_IN_GRAPH, free_port, load_without_ort

pytestmark = [pytest.mark.slow, pytest.mark.ort]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLUE = os.path.join(ROOT, "examples", "run_glue", "run_glue.py")
MLM = os.path.join(ROOT, "examples", "run_mlm", "run_mlm.py")
TINY = [
    "--model_size",
    "tiny",
    "--max_steps",
    "4",
    "--logging_steps",
    "2",
    "--report_to",
    "none",
    "--do_train",
    "--do_eval",
    "--save_strategy",
    "no",
    "--disable_tqdm",
    "true",
    "--use_cpu",
]


def run(script, out, *extra, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(
        [sys.executable, script, "--output_dir", str(out), *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-5000:]
    return res


def results(out, split):
    return json.loads((out / f"{split}_results.json").read_text())


@pytest.mark.parametrize(
    "extra,ort_on",
    [
        (["--memory_opt_config", "Gelu+:1:-1", "--print_input_density", "--print_memory_stats"], True),
        (["--memory_opt_level", "1", "--model_type", "roberta", "--offline_pairs"], True),
        (["--memory_opt_backend", "none", "--print_memory_stats"], False),
    ],
    ids=["deberta-config", "roberta-level1-pairs", "pytorch"],
)
def test_glue_offline(tmp_path, extra, ort_on):
    res = run(GLUE, tmp_path, "--offline_train_samples", "200", *extra)
    assert results(tmp_path, "eval")["eval_loss"] > 0
    assert (tmp_path / "config.json").exists()
    assert (tmp_path / "memory_plans.json").exists() == ort_on
    if "--print_memory_stats" in extra:
        assert (tmp_path / "memory_phases.csv").exists() and (tmp_path / "memory_phases.png").exists()
    if ort_on:
        plans = json.loads((tmp_path / "memory_plans.json").read_text())
        on = [p["config"] for p in plans["plans"] if p["enabled"]]
        assert on == ["Gelu+:1:-1"] if "--memory_opt_config" in extra else len(on) >= 5
        assert (res.stdout + res.stderr).count("recompute plan(s) found") == 1


def test_glue_from_local_csv_and_local_model(tmp_path):
    from optimum_memopt.offline_defaults import classification_rows

    for split, seed in (("train", 0), ("dev", 1)):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["sentence1", "sentence2", "label"])
            w.writeheader()
            w.writerows(classification_rows(48, seed=seed, pairs=True))
    first = tmp_path / "first"
    run(GLUE, first, "--train_file", str(tmp_path / "train.csv"), "--validation_file", str(tmp_path / "dev.csv"))
    # the saved directory is a model a new user can start from, with its tokenizer
    second = tmp_path / "second"
    run(
        GLUE,
        second,
        "--model_name_or_path",
        str(first),
        "--train_file",
        str(tmp_path / "train.csv"),
        "--validation_file",
        str(tmp_path / "dev.csv"),
        "--memory_opt_config",
        "Gelu+:1:-1",
    )
    plans = json.loads((second / "memory_plans.json").read_text())
    assert [p["config"] for p in plans["plans"] if p["enabled"]] == ["Gelu+:1:-1"]  # a local model, plans reached ORT
    assert (second / "tokenizer.json").exists() and "eval_accuracy" in results(second, "eval")


def test_glue_loss_in_graph_best_model_at_end_with_smoothing(tmp_path):
    """The recipe with `--ort_loss_in_graph --load_best_model_at_end --label_smoothing_factor 0.1` ends with a saved
    final model that loads where onnxruntime cannot be imported."""
    run(GLUE, tmp_path, "--offline_train_samples", "200", *BEST_AT_END_IN_GRAPH, "--memory_opt_config", "Gelu+:1:-1")
    assert load_without_ort(tmp_path) == "DebertaV2ForSequenceClassification"
    assert json.loads((tmp_path / "trainer_state.json").read_text())["best_model_checkpoint"]


def test_glue_missing_file_is_named(tmp_path):
    res = subprocess.run(
        [sys.executable, GLUE, "--output_dir", str(tmp_path), *TINY, "--train_file", str(tmp_path / "no.csv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert "`--train_file`" in res.stderr and "no.csv' does not exist" in res.stderr


def test_mlm_from_local_text_file(tmp_path):
    from optimum_memopt.offline_defaults import text_lines

    (tmp_path / "train.txt").write_text("\n".join(text_lines(200, seed=0)))
    (tmp_path / "valid.txt").write_text("\n".join(text_lines(40, seed=1)))
    run(
        MLM,
        tmp_path / "out",
        "--train_file",
        str(tmp_path / "train.txt"),
        "--validation_file",
        str(tmp_path / "valid.txt"),
        "--max_seq_length",
        "64",
        "--print_input_density",
        "--memory_opt_config",
        "Gelu+:1:-1",
    )
    with open(tmp_path / "out" / "input_density.csv") as f:
        rows = list(csv.DictReader(f))
    embed = [float(r["density_pct"]) for r in rows if r["input_type"] == "EMBED"]
    label = [float(r["density_pct"]) for r in rows if r["input_type"] == "LABEL"]
    assert embed and all(d == 100.0 for d in embed)  # packed: no padding
    assert label and all(5.0 < d < 30.0 for d in label)  # ~15% masked
    assert results(tmp_path / "out", "eval")["eval_loss"] > 0


@pytest.mark.multiprocess
def test_glue_accelerate_launch_two_processes_zero2(tmp_path):
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        os.path.join(ROOT, "examples", "configs", "accelerate_cpu_2proc.yaml"),
        "--main_process_port",
        str(port),
        GLUE,
        "--output_dir",
        str(tmp_path),
        *TINY,
        "--offline_train_samples",
        "200",
        "--deepspeed",
        os.path.join(ROOT, "examples", "configs", "ds_zero2.json"),
        "--memory_opt_config",
        "Gelu+:1:-1",
        "--print_memory_stats",
        "--ddp_backend",
        "gloo",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stderr[-6000:]
    assert (res.stdout + res.stderr).count("recompute plan(s) found") == 1
    assert (tmp_path / "memory_plans.json").exists() and (tmp_path / "memory_phases.csv").exists()
