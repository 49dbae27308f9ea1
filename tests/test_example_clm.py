"""The causal-LM recipe (examples/run_clm/run_clm.py) end to end on the modern stack, as a user runs it: its
offline default in tiny form with the torch backend and a chained plan against the same command without the plugin,
then a local pretrained Qwen3 and local text files with `--use_peft` and layer recompute. Each run is a subprocess."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.torch_backend]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLM = os.path.join(ROOT, "examples", "run_clm", "run_clm.py")
TINY = [
    "--model_size", "tiny", "--max_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "4",
    "--block_size", "64", "--offline_lines", "400", "--report_to", "none", "--do_train", "--do_eval",
    "--save_strategy", "no", "--disable_tqdm", "true", "--use_cpu",
]  # fmt: skip
CHAIN = "MatMul+silu+Mul+:1:-1"


def run(out, *extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    res = subprocess.run(
        [sys.executable, CLM, "--output_dir", str(out), *TINY, *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout + res.stderr


def ops(config):
    return sorted(config.split(":")[0].strip("+").split("+"))


def losses(out):
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def without_the_plugin(code: str):
    """Run `code` in a fresh process that never imports optimum_memopt (asserted at its end)."""
    code += "\nassert not any(m.startswith('optimum_memopt') for m in sys.modules), 'the plugin was imported'\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_offline_default_with_a_chained_plan_trains_as_eager_and_reports(tmp_path):
    """The README's check: `--memory_opt_backend torch` and a chained plan on the recipe's built-in Llama print the
    plan table and the memory phases, train with the losses and weights of the same command without the plugin,
    and save a model that loads with transformers alone."""
    from safetensors.torch import load_file

    eager = run(tmp_path / "eager", "--memory_opt_backend", "none")
    log = run(
        tmp_path / "plan", "--memory_opt_backend", "torch", "--memory_opt_config", CHAIN, "--print_memory_stats",
        "--print_input_density",
    )  # fmt: skip
    assert log.count(f"Memory optimizer (torch) ON: {CHAIN}") == 1 and "STATE  CONFIG" not in log
    assert "STATE  CONFIG" in (tmp_path / "plan" / "memory_plans.txt").read_text()  # the table: in the file
    assert "Memory optimizer" not in eager
    report = json.loads((tmp_path / "plan" / "memory_plans.json").read_text())
    assert report["requested"] == [CHAIN] and sorted(report["applied"]) == ["MatMul+:1:-1", "Mul+:1:-1", "silu+:1:-1"]
    # the table's row for the three chained together (named in its own order of ops)
    chain = next(p for p in report["plans"] if p["combination"] and ops(p["config"]) == ops(CHAIN))
    assert chain["enabled"] and chain["applied_count"] == 2 and chain["saving_bytes"] > 0
    # the head and loss are not run between steps where `Loss+` and `auto` were not asked: no rows, and the notes say
    # how to see them
    assert not [p for p in report["plans"] if p["config"].startswith("Loss+")]
    assert any("add 'Loss+:1:-1' to the plans to run the head in chunks and see each way's row" in n
               for n in report["notes"])  # fmt: skip
    phases = (tmp_path / "plan" / "memory_phases.csv").read_text()
    assert "post_forward" in phases and "post_backward" in phases
    assert (tmp_path / "plan" / "input_density.csv").exists()
    assert len(losses(tmp_path / "plan")) == 4 and losses(tmp_path / "plan") == losses(tmp_path / "eager")
    ours, plain = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("plan", "eager"))
    assert ours.keys() == plain.keys() and all((ours[k] == plain[k]).all() for k in ours)
    printed = without_the_plugin(
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'plan')!r})\n"
        f"tok = AutoTokenizer.from_pretrained({str(tmp_path / 'plan')!r})\n"
        "ids = tok('the film was good', return_tensors='pt')['input_ids']\n"
        "print('LOADED', type(model).__name__, float(model(ids, labels=ids).loss) > 0)\n"
    )
    assert "LOADED LlamaForCausalLM True" in printed


@pytest.fixture
def local_qwen3(tmp_path):
    """A 2-layer Qwen3 and its tokenizer saved as a user's pretrained checkpoint, and text files beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    from optimum_memopt.offline_defaults import model_config, text_lines, train_tokenizer

    lines = text_lines(300, seed=0)
    tokenizer = train_tokenizer(lines)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config("qwen3", "tiny", len(tokenizer), tokenizer.pad_token_id))
    model.save_pretrained(tmp_path / "qwen3")
    tokenizer.save_pretrained(tmp_path / "qwen3")
    (tmp_path / "train.txt").write_text("\n".join(lines))
    (tmp_path / "valid.txt").write_text("\n".join(text_lines(60, seed=1)))
    return tmp_path


def test_lora_on_a_local_checkpoint_with_layer_recompute_saves_an_adapter_peft_loads(local_qwen3):
    """`--model_name_or_path` a local directory, `--train_file` / `--validation_file` local text, `--use_peft` and
    level 1: the same losses as without the plugin, and `save_model` writes a LoRA adapter (its trained weights only)
    that PEFT loads onto the base checkpoint in a process that never imports the plugin."""
    root = local_qwen3
    data = ["--model_name_or_path", str(root / "qwen3"), "--train_file", str(root / "train.txt")]
    data += ["--validation_file", str(root / "valid.txt"), "--use_peft", "--lora_r", "4", "--lora_dropout", "0"]
    plain = run(root / "plain", *data, "--memory_opt_backend", "none")
    log = run(root / "lora", *data, "--memory_opt_backend", "torch", "--memory_opt_level", "1")
    assert "trainable params" in plain and "trainable params" in log
    assert log.count("Memory optimizer (torch) ON: level 1") == 1
    assert losses(root / "lora") == losses(root / "plain") and len(losses(root / "lora")) == 4
    assert (root / "lora" / "adapter_config.json").exists() and not (root / "lora" / "model.safetensors").exists()
    assert json.loads((root / "lora" / "eval_results.json").read_text())["eval_loss"] > 0
    printed = without_the_plugin(
        "import torch\n"
        "from peft import PeftModel\n"
        "from safetensors.torch import load_file\n"
        "from transformers import AutoModelForCausalLM\n"
        f"base = AutoModelForCausalLM.from_pretrained({str(root / 'qwen3')!r})\n"
        f"model = PeftModel.from_pretrained(base, {str(root / 'lora')!r})\n"
        f"saved = load_file({str(root / 'lora' / 'adapter_model.safetensors')!r})\n"
        "loaded = {k: v for k, v in model.state_dict().items() if 'lora_' in k}\n"
        "assert len(saved) == len(loaded) > 0 and all('lora_' in k for k in saved)\n"
        "assert any(float(v.abs().sum()) > 0 for k, v in saved.items() if 'lora_B' in k)  # trained from zeros\n"
        "ids = torch.tensor([[2, 10, 11, 12]])\n"
        "print('LOADED', type(model).__name__, bool(torch.isfinite(model(ids, labels=ids).loss)))\n"
    )
    assert "LOADED PeftModelForCausalLM True" in printed
