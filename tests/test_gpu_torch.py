"""The torch backend on CUDA: dropout's random state replayed on the GPU, autocast (bf16 / fp16), the CUDA memory
phases, and DeepSpeed ZeRO-2 with fp16 and DeepSpeed's FusedAdam. Skipped where no CUDA device is present; the CPU
side of the same code runs in test_backend_torch.py."""

import csv
import json
import os

import pytest
import torch
from helpers import ClsData, LossRecordingTrainer, make_args
from test_backend_torch import build_model

pytestmark = [pytest.mark.torch_backend, pytest.mark.gpu]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 12


def _train(out, *flags, dropout=0.0, steps=STEPS):
    args = make_args(out, "--max_steps", str(steps), "--logging_steps", "4", *flags)
    trainer = LossRecordingTrainer(model=build_model("bert", dropout=dropout), args=args, train_dataset=ClsData(n=96))
    trainer.train()
    return trainer


def _report(out):
    return json.loads((out / "memory_plans.json").read_text())


def _found(out):
    """Every plan the first step found on this device (run with an unknown request, so nothing is applied)."""
    _train(out, "--memory_opt_backend", "torch", "--memory_opt_config", "Nothing+:1:-1", dropout=0.1, steps=1)
    return sorted(p["config"] for p in _report(out)["plans"] if not p.get("head"))  # the layers' plans


@needs_cuda
def test_cuda_dropout_replays_its_random_state(tmp_path):
    """On CUDA dropout is one fused op (`native_dropout`); every plan the table finds, dropout's included, is
    recomputed with the generator state of its forward: losses equal plain PyTorch's under the same seed."""
    torch.backends.cuda.matmul.allow_tf32 = False
    found = _found(tmp_path / "probe")
    assert any(p.startswith("Dropout+") for p in found), found
    eager = _train(tmp_path / "eager", "--memory_opt_backend", "none", dropout=0.1).losses
    run = _train(
        tmp_path / "run", "--memory_opt_backend", "torch", "--memory_opt_config", ",".join(found), dropout=0.1
    )
    assert max(abs(a - b) for a, b in zip(run.losses, eager)) <= 1e-5, (run.losses, eager)
    on = {p["config"] for p in _report(tmp_path / "run")["plans"] if p["enabled"]}
    assert any(p.startswith("Dropout+") for p in on), on


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_autocast_plans_and_level_1(tmp_path, precision):
    """Under autocast the recipes hold the ops as dispatched (already in half precision): the recomputed values are
    the forward's, so losses equal the plain autocast run's; level 1 reruns the layer under the same autocast."""
    eager = _train(tmp_path / "eager", "--memory_opt_backend", "none", f"--{precision}").losses
    for name, flags in [
        ("plans", ["--memory_opt_config", "Gelu+:1:-1,LayerNormalization+:1:-1"]),
        ("l1", ["--memory_opt_level", "1"]),
    ]:
        run = _train(tmp_path / name, "--memory_opt_backend", "torch", f"--{precision}", *flags)
        assert max(abs(a - b) for a, b in zip(run.losses, eager)) <= 1e-4, (name, run.losses, eager)
        assert any(p["enabled"] for p in _report(tmp_path / name)["plans"])


@needs_cuda
def test_cuda_memory_phases_are_read_from_the_allocator(tmp_path):
    _train(tmp_path, "--memory_opt_backend", "torch", "--memory_opt_config", "Gelu+:1:-1", "--print_memory_stats")
    rows = list(csv.DictReader(open(tmp_path / "memory_phases.csv")))
    assert rows and all(r["device"] == "cuda" and float(r["reserved_mb"]) > 0 for r in rows)
    by_step = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), {})[r["phase"]] = float(r["in_use_mb"])
    # activations are held from the end of forward until backward frees them
    assert all(p["post_forward"] > p["pre_forward"] for p in by_step.values() if len(p) == 4)


@needs_cuda
def test_cuda_deepspeed_zero2_fp16_fused_adam(tmp_path, monkeypatch):
    """One GPU, DeepSpeed ZeRO-2 in fp16 with DeepSpeed's own Adam (FusedAdam on CUDA, built by DeepSpeed's op
    builder): the torch backend's plans apply inside the DeepSpeed engine and training goes down."""
    pytest.importorskip("deepspeed")
    saved = dict(os.environ)  # the Trainer's DeepSpeed set-up writes ACCELERATE_USE_DEEPSPEED and more here
    try:
        _zero2_fp16(tmp_path, monkeypatch)
    finally:
        # leave no DeepSpeed state behind for the tests and child processes that follow
        os.environ.clear()
        os.environ.update(saved)
        from accelerate.state import AcceleratorState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _zero2_fp16(tmp_path, monkeypatch):
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", "1")
    # DeepSpeed 0.19.8's op builder cannot parse arch-specific entries such as "9.0a" (docs/STACK.md): build
    # FusedAdam for this device's own compute capability.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "{}.{}".format(*torch.cuda.get_device_capability()))
    cfg = {
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": "auto", "initial_scale_power": 8},
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto"}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    trainer = _train(
        tmp_path / "run",
        "--memory_opt_backend",
        "torch",
        "--memory_opt_config",
        "Gelu+:1:-1",
        "--fp16",
        "--deepspeed",
        str(tmp_path / "ds.json"),
        "--print_memory_stats",
        steps=30,
    )
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    inner = getattr(inner, "optimizer", inner)
    assert type(inner).__name__ == "FusedAdam", type(inner)
    assert [p["config"] for p in _report(tmp_path / "run")["plans"] if p["enabled"]] == ["Gelu+:1:-1"]
    finite = [x for x in trainer.losses if x == x]
    assert len(finite) >= 20 and sum(finite[-5:]) / 5 < sum(finite[:5]) / 5, trainer.losses
