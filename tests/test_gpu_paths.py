"""fp16 / FusedAdam / CUDA memory: the decisions everywhere, the CUDA runs where a GPU exists."""

import csv
from types import SimpleNamespace

import pytest
import torch

from helpers import train
from optimum_memopt.trainer import fp16_optimizer_decision

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DECISIONS = [
    (dict(use_ort=False, fp16=True), True, True, False, "--use_ort false"),
    (dict(use_ort=True, fp16=False), True, True, False, "--fp16 is off"),
    (dict(use_ort=True, fp16=True), True, False, False, "fp16 training needs CUDA"),
    (dict(use_ort=True, fp16=True), False, True, False, "with torch AMP the GradScaler already does that work"),
    (dict(use_ort=True, fp16=True), True, True, True, "applied to DeepSpeed's ZeRO fp16 optimizer"),
]


@pytest.mark.parametrize("args,ds,cuda,apply,reason", DECISIONS)
def test_fp16_optimizer_decision(args, ds, cuda, apply, reason):
    got_apply, got_reason = fp16_optimizer_decision(SimpleNamespace(**args), ds, cuda)
    assert got_apply is apply
    assert reason in got_reason


@pytest.mark.slow
def test_adamw_ort_fused_on_this_machine(tmp_path):
    trainer = train("deberta", out=tmp_path, steps=2, flags=["--optim", "adamw_ort_fused"])
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    if torch.cuda.is_available():
        assert type(opt).__name__ == "FusedAdam"
    else:
        assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] is True
    # the Trainer's weight-decay groups reach the optimizer
    assert len(opt.param_groups) == 2
    assert {g["weight_decay"] for g in opt.param_groups} == {0.0, trainer.args.weight_decay}


@pytest.mark.gpu
@needs_cuda
def test_cuda_fp16_fused_adam_and_memory_phases(tmp_path):
    trainer = train("deberta", out=tmp_path, steps=12,
                    flags=["--optim", "adamw_ort_fused", "--fp16", "--print_memory_stats", "--memory_opt_level", "1"])
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert type(opt).__name__ == "FusedAdam"
    with open(tmp_path / "memory_phases.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["device"] == "cuda" and r["reserved_mb"] != "" for r in rows)
    post_fwd = [float(r["current_mb"]) for r in rows if r["phase"] == "post_forward"]
    pre_fwd = [float(r["current_mb"]) for r in rows if r["phase"] == "pre_forward"]
    # activations are held between forward and backward
    assert all(b >= a for a, b in zip(pre_fwd, post_fwd))
    assert trainer.losses[-1] < trainer.losses[0]
