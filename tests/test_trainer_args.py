import json
import os
import subprocess
import sys

import pytest
from transformers import HfArgumentParser

from optimum_memopt import MemoptTrainingArguments, ort

BASE = ["--output_dir", "unused_out", "--report_to", "none", "--use_cpu"]


def parse(*flags):
    (args,) = HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(BASE + list(flags))
    return args


def test_help_exits_zero():
    code = "from transformers import HfArgumentParser; from optimum_memopt import MemoptTrainingArguments; HfArgumentParser(MemoptTrainingArguments).parse_args(['--help'])"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    for flag in ("--memory_opt_config", "--memory_opt_level", "--ort_log_level", "--print_memory_stats",
                 "--print_input_density", "--ort_fallback_policy", "--ort_save_onnx_dir", "--ort_cache_dir",
                 "--use_ort", "--ort_loss_in_graph", "--memory_budget_mb"):
        assert flag in res.stdout


def test_good_config_is_parsed():
    args = parse("--memory_opt_config", "BiasGelu+:1:-1,Cast+:2:-1")
    assert [str(e) for e in args.memory_opt_entries] == ["BiasGelu+:1:-1", "Cast+:2:-1"]
    assert args.memory_opt_level == 0
    assert args.memory_opt_summary == "BiasGelu+:1:-1,Cast+:2:-1"


def test_json_file_config(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(["Gelu+:1:-1"]))
    assert [str(e) for e in parse("--memory_opt_config", str(path)).memory_opt_entries] == ["Gelu+:1:-1"]


BAD_FLAGS = [
    (["--memory_opt_config", "BiasGelu+:3:-1"], r"^`--memory_opt_config` entry 'BiasGelu\+:3:-1' has optimization type 3; expected 0 \(none\), 1 \(recompute\) or 2 \(recompute with compromise\), as in 'BiasGelu\+:1:-1'$"),
    (["--memory_opt_config", "Gelu+:1:-1", "--memory_opt_level", "1"], r"^`--memory_opt_level 1` and `--memory_opt_config Gelu\+:1:-1` were both given, but at level 1 or 2 ONNX Runtime ignores the config"),
    (["--memory_opt_config", "auto"], r"^`--memory_opt_config auto` needs a budget: add `--memory_budget_mb`"),
    (["--memory_opt_config", "auto", "--memory_budget_mb", "-5"], r"^`--memory_budget_mb` is -5.0; expected a positive number of MiB$"),
    (["--use_ort", "false", "--memory_opt_config", "Gelu+:1:-1"], r"^`--memory_opt_config` configure ONNX Runtime's memory optimizer, but `--use_ort false` trains in plain PyTorch"),
    (["--use_ort", "false", "--memory_opt_level", "2", "--ort_loss_in_graph"], r"^`--memory_opt_level`, `--ort_loss_in_graph` configure ONNX Runtime's memory optimizer"),
    (["--gradient_checkpointing"], r"^`--gradient_checkpointing` uses torch.utils.checkpoint, which ORTModule cannot export; use ORT's recompute instead, as in `--memory_opt_level 1`"),
    (["--input_density_table_steps", "0"], r"^`--input_density_table_steps` is 0; expected a positive integer$"),
]


@pytest.mark.parametrize("flags,pattern", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flags(flags, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse(*flags)


def test_bad_level_is_refused_by_the_parser():
    res = subprocess.run(
        [sys.executable, "-c",
         "from transformers import HfArgumentParser; from optimum_memopt import MemoptTrainingArguments;"
         "HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(['--output_dir','x','--memory_opt_level','3'])"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2
    assert "invalid choice: 3 (choose from 0, 1, 2)" in res.stderr


def test_environment_is_a_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1")
    assert [str(e) for e in parse().memory_opt_entries] == ["Gelu+:1:-1"]
    # the flag wins over the environment
    assert [str(e) for e in parse("--memory_opt_config", "Cast+:2:-1").memory_opt_entries] == ["Cast+:2:-1"]


def test_bad_environment_value_names_its_source(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:9:-1")
    with pytest.raises(ValueError, match=r"has optimization type 9.*\(value read from \$ORTMODULE_MEMORY_OPT_CONFIG\)$"):
        parse()
    monkeypatch.delenv("ORTMODULE_MEMORY_OPT_CONFIG")
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "high")
    with pytest.raises(ValueError, match=r"^`--memory_opt_level` read from \$ORTMODULE_MEMORY_OPT_LEVEL='high'; expected 0, 1 or 2"):
        parse()
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "2")
    assert parse().memory_opt_level == 2


def test_adamw_ort_fused_is_accepted_and_replaced_on_cpu():
    args = parse("--optim", "adamw_ort_fused")
    assert args.ort_fused_adam
    if ort.cuda_available():
        assert args.optimizer_note.startswith("FusedAdam")
    else:
        assert args.optim == "adamw_torch_fused"
        assert "needs CUDA, which is not available; using torch.optim.AdamW (fused=True" in args.optimizer_note


def test_ort_not_installed(monkeypatch):
    monkeypatch.setattr(ort, "_onnxruntime_dir", lambda: None)
    with pytest.raises(ValueError, match=r"^`--use_ort` \(on by default\) needs ONNX Runtime Training: onnxruntime-training is not installed; install it with: pip install 'optimum-memopt\[cpu\]'.*Or pass `--use_ort false`"):
        parse()
    # plain PyTorch needs no ORT
    assert parse("--use_ort", "false").use_ort is False


def test_ort_extensions_not_built(monkeypatch, tmp_path):
    (tmp_path / "training" / "ortmodule" / "torch_cpp_extensions").mkdir(parents=True)
    monkeypatch.setattr(ort, "_onnxruntime_dir", lambda: str(tmp_path))
    with pytest.raises(ValueError, match=r"ORTModule's C\+\+ extensions are not built; build them once with: .* -m onnxruntime\.training\.ortmodule\.torch_cpp_extensions\.install"):
        parse()


def test_real_install_is_detected():
    assert ort.is_ort_training_installed()
    assert ort.ort_extensions_built()
    assert ort.ort_problem() is None


def test_zero3_is_refused_with_the_reason(tmp_path):
    cfg = tmp_path / "ds_zero3.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}))
    with pytest.raises(ValueError, match=r"^`--deepspeed` selects ZeRO stage 3, which ORTModule cannot run with the pinned stack: .*_apply_to_tensors_only.*Use ZeRO stage 1 or 2"):
        parse("--deepspeed", str(cfg))


def test_zero3_import_really_fails_with_the_pinned_deepspeed():
    # The reason given above, checked against the installed DeepSpeed.
    code = "from deepspeed.runtime.zero.parameter_offload import _apply_to_tensors_only"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "ImportError" in res.stderr
