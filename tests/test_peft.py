"""Issue 18, point 1: a PEFT LoRA model (LoRA on every attention and MLP projection, base weights frozen) through
the torch backend: its layers are found through PEFT's wrappers, planned recompute and whole layers give the losses
of the same LoRA run in plain PyTorch, the frozen weights get no gradient, and the adapter saves as PEFT's own and
loads in a process that never imports the plugin."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import CausalData, LossRecordingTrainer, make_args
from transformers import LlamaConfig, LlamaForCausalLM

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.torch_backend

STEPS = 20
LOSS_ATOL = 1e-5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return peft.get_peft_model(LlamaForCausalLM(config), lora)


def train(tmp_path, name, *flags):
    args = make_args(tmp_path / name, "--max_steps", str(STEPS), "--logging_steps", "5", *flags)
    model = lora_llama()
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=CausalData(n=16 * STEPS))
    trainer.train()
    return trainer, model


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    trainer, _ = train(tmp_path_factory.mktemp("plain"), "plain", "--memory_opt_backend", "none")
    return trainer.losses


@pytest.mark.parametrize(
    "flags,modes",
    [
        (("--memory_opt_level", "1"), ["layer", "layer"]),
        (("--memory_opt_config", "MatMul+silu+Mul+:1:-1"), ["ops", "ops"]),
        (("--memory_opt_config", "Layer+:1:-1@0,MatMul+silu+Mul+:1:-1@1"), ["layer", "ops"]),
    ],
)
@pytest.mark.slow
def test_lora_trains_as_plain_pytorch_through_the_torch_backend(tmp_path, plain, flags, modes):
    trainer, model = train(tmp_path, "run", "--memory_opt_backend", "torch", *flags)
    assert max(abs(a - b) for a, b in zip(trainer.losses, plain)) <= LOSS_ATOL, (trainer.losses, plain)
    assert len(trainer.losses) == len(plain) == STEPS
    state = trainer.memopt_handle
    assert len(state.layers) == 2 and [p.mode for p in state.policy.layers] == modes
    for i, mode in enumerate(modes):
        if mode == "ops":  # the chain ran on the LoRA layer: its frozen projections' outputs were recomputed
            assert {"MatMul", "silu", "Mul"} <= set(state.profile.layers[i].applied)
    frozen = [p for n, p in model.named_parameters() if "lora_" not in n]
    assert frozen and all(not p.requires_grad and p.grad is None for p in frozen)  # no gradient asked of them
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.slow
def test_the_adapter_saves_as_peft_and_loads_without_the_plugin(tmp_path):
    trainer, model = train(
        tmp_path, "run", "--memory_opt_backend", "torch", "--memory_opt_config", "MatMul+silu+Mul+:1:-1"
    )
    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (
        sorted(os.listdir(out))[:2] == ["README.md", "adapter_config.json"]
        and (out / "adapter_model.safetensors").exists()
    )
    trained = sum(float(p.detach().double().sum()) for n, p in model.named_parameters() if "lora_" in n)
    code = (
        "import sys, torch\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "from peft import PeftModel\n"
        "torch.manual_seed(0)\n"
        "base = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, "
        "num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))\n"
        "model = PeftModel.from_pretrained(base, sys.argv[1])\n"
        "print(sum(float(p.detach().double().sum()) for n, p in model.named_parameters() if 'lora_' in n))\n"
        "print('plugin imported:', any(m.startswith('optimum_memopt') for m in sys.modules))\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    loaded, imported = res.stdout.strip().splitlines()[-2:]
    assert float(loaded) == pytest.approx(trained, abs=1e-9) and imported == "plugin imported: False"
