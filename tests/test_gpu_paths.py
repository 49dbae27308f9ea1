"""fp16 / FusedAdam / CUDA memory: the decisions everywhere, the CUDA runs where a GPU exists."""

import csv
from types import SimpleNamespace

import pytest
import torch
from helpers import train

from optimum_memopt.backends.ort import OrtBackend

pytestmark = pytest.mark.ort  # the ORT backend's own behaviour: the ORT stack's suite

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _args(**kw):
    base = dict(fp16=False, bf16=False, device=torch.device("cpu"), n_gpu=0)
    return SimpleNamespace(**{**base, **kw})


def test_fp16_optimizer_is_only_reported_applied_when_ort_changed_the_optimizer(monkeypatch):
    backend = OrtBackend()
    assert backend.on_optimizer_ready(object(), _args(fp16=False), deepspeed=True) is None
    if not torch.cuda.is_available():
        assert backend.on_optimizer_ready(object(), _args(fp16=True), deepspeed=True) == (
            "ORT's FP16_Optimizer not applied: fp16 training needs CUDA"
        )
    # DeepSpeed's real ZeRO stage 1/2 optimizer class (not initialised: no GPU here); imported before CUDA is
    # pretended below, so DeepSpeed picks the accelerator this machine has.
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "not applied: it complements DeepSpeed's fp16 optimizer" in backend.on_optimizer_ready(
        object(), _args(fp16=True), deepspeed=False
    )
    # ORT 1.19 compares the optimizer's methods with the DeepSpeed release it knows and leaves this one alone.
    zero = object.__new__(DeepSpeedZeroOptimizer)
    with pytest.warns(UserWarning):
        line = backend.on_optimizer_ready(zero, _args(fp16=True), deepspeed=True)
    assert line.startswith("ORT's FP16_Optimizer did not change DeepSpeedZeroOptimizer: ORT 1.19 only modifies")
    assert "applied" not in line


def test_fp16_and_bf16_with_ort_on_cpu_are_refused():
    for flag in ("fp16", "bf16"):
        with pytest.raises(ValueError, match=rf"^`--{flag}` with ORTModule on CPU: "):
            OrtBackend().check(_args(**{flag: True}))
    OrtBackend().check(_args())  # fp32 on CPU is fine


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
    trainer = train(
        "deberta",
        out=tmp_path,
        steps=12,
        flags=["--optim", "adamw_ort_fused", "--fp16", "--print_memory_stats", "--memory_opt_level", "1"],
    )
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert type(opt).__name__ == "FusedAdam"
    with open(tmp_path / "memory_phases.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["device"] == "cuda" and r["reserved_mb"] != "" for r in rows)
    post_fwd = [float(r["in_use_mb"]) for r in rows if r["phase"] == "post_forward"]
    pre_fwd = [float(r["in_use_mb"]) for r in rows if r["phase"] == "pre_forward"]
    # activations are held between forward and backward
    assert all(b >= a for a, b in zip(pre_fwd, post_fwd))
    assert trainer.losses[-1] < trainer.losses[0]
