"""bf16 autocast through the Trainer (`--bf16`; on CPU, accelerate's CPU autocast): with the torch backend every
plan found, the chains, all of them and level 1 give the losses of the plain bf16 run, and each output a plan
recomputes equals the first forward's, bitwise and in its dtype. CUDA's bf16 / fp16 run in test_gpu_torch.py."""

import json

import pytest
import torch
from helpers import CausalData, LossRecordingTrainer, make_args, small_decoder

pytestmark = pytest.mark.torch_backend

STEPS = 4


def train(out, arch, *flags):
    args = make_args(out, "--max_steps", str(STEPS), "--logging_steps", "4", "--bf16", *flags)
    trainer = LossRecordingTrainer(model=small_decoder(arch), args=args, train_dataset=CausalData(n=8 * STEPS))
    trainer.train()
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_autocast_recomputes_bitwise_and_trains_as_plain_autocast(tmp_path, arch, recomputed_as_first):
    plain = train(tmp_path / "plain", arch, "--memory_opt_backend", "none")
    assert plain.accelerator.mixed_precision == "bf16"
    train(tmp_path / "table", arch, "--memory_opt_backend", "torch")
    plans = json.loads((tmp_path / "table" / "memory_plans.json").read_text())["plans"]
    found = [p["config"] for p in plans if not p["combination"] and not p["lever"]]  # the layers' (bitwise)
    chains = [p["config"] for p in plans if p["combination"]]
    assert found and chains
    runs = [["--memory_opt_config", c] for c in found + chains + [",".join(found)]] + [["--memory_opt_level", "1"]]
    dtypes = set()
    for i, flags in enumerate(runs):
        recomputed_as_first.clear()
        run = train(tmp_path / f"r{i}", arch, "--memory_opt_backend", "torch", *flags)
        assert run.losses == plain.losses, (flags, run.losses, plain.losses)  # bitwise
        if flags[0] == "--memory_opt_config":
            assert recomputed_as_first, flags  # the plan recomputed something
            assert all(same and made == back for _, made, back, same in recomputed_as_first), (
                flags,
                recomputed_as_first,
            )
            dtypes |= {made for _, made, _, _ in recomputed_as_first}
    assert torch.bfloat16 in dtypes  # autocast's outputs were among those recomputed
