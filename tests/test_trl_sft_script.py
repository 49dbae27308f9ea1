"""TRL's own `sft.py` (the installed one, unchanged) switched to the plugin as README says, against the same script
unswitched: a tiny Qwen2 saved to disk, its tokenizer and a JSON-lines dataset, TRL's defaults (bf16 autocast,
gradient checkpointing on in the unswitched run) with LoRA. The switched run replaces TRL's checkpointing with the
backend's whole-layer recompute, or applies op plans; either way every logged loss and the saved adapter are those
of the unswitched run, the plan table is on screen (sft.py sets up no logging), and the adapter loads with PEFT in a
process that never imports the plugin."""

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.one_worker]  # one worker builds the model and the unswitched run once

trl = pytest.importorskip("trl")
pytest.importorskip("peft")
if int(trl.__version__.split(".")[0]) < 1:
    pytest.skip(f"TRL {trl.__version__}: its sft.py script is TRL 1.x's", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The script as installed, with README's switch: the config class gains the memory flags (its defaults kept) and
# the trainer gains the mixin. sft.py imports both from `trl` inside its functions, so the switch is made there.
RUN_SFT = """
import runpy, sys
import trl
if {switched}:
    from optimum_memopt import MemoptTrainerMixin, with_memory_flags
    trl.SFTConfig = with_memory_flags(trl.SFTConfig)
    trl.SFTTrainer = type("SFTTrainer", (MemoptTrainerMixin, trl.SFTTrainer), {{}})
sys.argv = ["sft.py"] + sys.argv[1:]
runpy.run_module("trl.scripts.sft", run_name="__main__")
"""


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    """A 2-layer Qwen2 and its tokenizer saved as a user's local model, and a dataset directory of text rows."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from optimum_memopt.offline_defaults import text_lines, train_tokenizer

    root = tmp_path_factory.mktemp("sft")
    lines = text_lines(200, seed=0)
    tokenizer = train_tokenizer(lines, vocab_size=300)
    tokenizer.eos_token = "[SEP]"  # TRL 1.x appends it to every text
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    return root


def sft(root, out, switched, *flags):
    argv = [
        "--model_name_or_path", str(root / "model"),
        "--dataset_name", str(root / "data"),
        "--dataset_text_field", "text",
        "--max_length", "64",
        "--max_steps", "4",
        "--per_device_train_batch_size", "4",
        "--logging_steps", "1",
        "--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "1e-3",
        "--report_to", "none",
        "--save_strategy", "no",
        "--use_cpu",
        "--disable_tqdm", "true",
        "--output_dir", str(out),
        *flags,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    res = subprocess.run(
        [sys.executable, "-c", RUN_SFT.format(switched=switched), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    losses = re.findall(r"'loss': '([0-9.e+-]+)'", res.stdout)
    assert len(losses) == 4, res.stdout[-3000:]
    return losses, res.stdout


def adapter(out):
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def unswitched(qwen2, tmp_path_factory):
    """The script unswitched, with TRL's defaults (its own gradient checkpointing): its losses and where it saved, once
    for the switched runs it is held against."""
    out = tmp_path_factory.mktemp("plain")
    losses, _ = sft(qwen2, out, False)
    return losses, out


@pytest.mark.parametrize(
    "flags", [("--memory_opt_level", "1"), ("--memory_opt_config", "silu+:1:-1,Cast+:1:-1")], ids=["level1", "plans"]
)
def test_trls_sft_script_switched_trains_what_it_trains_unswitched(qwen2, unswitched, tmp_path, flags):
    import torch

    plain_losses, plain_out = unswitched
    losses, stdout = sft(qwen2, tmp_path / "memopt", True, "--gradient_checkpointing", "false", *flags)
    assert losses == plain_losses
    plain, ours = adapter(plain_out), adapter(tmp_path / "memopt")
    assert plain.keys() == ours.keys() and all(torch.equal(plain[k], ours[k]) for k in plain)
    assert stdout.count("Memory optimizer (torch) ON") == 1 and "memory_plans.txt" in stdout
    assert "STATE  CONFIG" in (tmp_path / "memopt" / "memory_plans.txt").read_text()
    assert (tmp_path / "memopt" / "memory_plans.json").exists()

    reload = (
        "import sys, torch\n"
        "from peft import PeftModel\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(qwen2 / 'model')!r}), "
        f"{str(tmp_path / 'memopt')!r})\n"
        "ids = torch.tensor([[2, 10, 11, 12]])\n"
        "assert torch.isfinite(model(ids, labels=ids).loss)\n"
        "assert not any(m.startswith('optimum_memopt') for m in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", reload], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
