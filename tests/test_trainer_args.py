"""Arguments: every bad value stops when the arguments are built, naming its flag or variable; what runs is recorded."""

import json
import math
import os
import pickle
import subprocess
import sys
from dataclasses import fields

import pytest
from transformers import HfArgumentParser

from optimum_memopt import MemoptTrainingArguments
from optimum_memopt._deepspeed import stage_of_config as _zero_stage
from optimum_memopt.backends import ort
from optimum_memopt.config import MemoryOptConfig

# the flags against the installed TrainingArguments, accelerate and DeepSpeed: both stacks' (and the compatibility
# slice's) transformers range
pytestmark = pytest.mark.both_stacks

BASE = ["--output_dir", "unused_out", "--report_to", "none", "--use_cpu"]


def parse(*flags):
    (args,) = HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(BASE + list(flags))
    return args


def build(**kwargs):
    return MemoptTrainingArguments(output_dir="unused_out", report_to="none", use_cpu=True, **kwargs)


@pytest.fixture(autouse=True)
def _no_ort_env(monkeypatch):
    for var in (
        "ORTMODULE_MEMORY_OPT_CONFIG",
        "ORTMODULE_MEMORY_OPT_LEVEL",
        "ACCELERATE_USE_DEEPSPEED",
        "ACCELERATE_DEEPSPEED_CONFIG_FILE",
        "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(autouse=True)
def _ort_is_the_default(monkeypatch):
    """These tests check the ORT backend's arguments, which probe nothing: the same on both stacks. The default
    where onnxruntime-training is missing is tested in test_backend_torch.py."""
    import optimum_memopt.backends as backends

    monkeypatch.setattr(backends, "default_backend", lambda: "ort")


def test_help_exits_zero(capsys):
    # argparse's `--help` prints and exits 0 in the process that parses, as a script's parser does
    with pytest.raises(SystemExit) as stop:
        HfArgumentParser(MemoptTrainingArguments).parse_args(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "--memory_opt_config",
        "--memory_opt_level",
        "--ort_log_level",
        "--print_memory_stats",
        "--print_input_density",
        "--ort_fallback_policy",
        "--ort_save_onnx_dir",
        "--ort_cache_dir",
        "--use_ort",
        "--ort_loss_in_graph",
        "--memory_budget_mb",
        "--memory_measure_out",
    ):
        assert flag in out
    assert "--memory_opt " not in out  # the derived config is no flag


def test_good_config_is_parsed():
    args = parse("--memory_opt_config", "Gelu+:1:-1,Cast+:2:-1")
    assert [str(e) for e in args.memory_opt.entries] == ["Gelu+:1:-1", "Cast+:2:-1"]
    assert args.memory_opt.level == 0
    assert args.memory_opt_summary == "Gelu+:1:-1,Cast+:2:-1"


def test_json_file_config(tmp_path):
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(["Gelu+:1:-1"]))
    assert [str(e) for e in parse("--memory_opt_config", str(path)).memory_opt.entries] == ["Gelu+:1:-1"]


def _file(tmp_path, name="a_file"):
    p = tmp_path / name
    p.write_text("x")
    return str(p)


# (how the value is given, a pattern the whole message must match). `cli` lists flags; `kw` calls the constructor.
BAD = [
    (
        "cli",
        ["--memory_opt_config", "BiasGelu+:3:-1"],
        r"^`--memory_opt_config` entry 'BiasGelu\+:3:-1' has optimization type 3; expected 0 \(none\), 1 \(recompute\) or 2 \(recompute with compromise\), as in 'Gelu\+:1:-1'$",
    ),
    (
        "cli",
        ["--memory_opt_config", "Gelu+:1:-1", "--memory_opt_level", "1"],
        r"^`--memory_opt_level` is 1 and `--memory_opt_config` is 'Gelu\+:1:-1', but at level 1 or 2 ONNX Runtime ignores the plans",
    ),
    ("cli", ["--memory_opt_config", "auto"], r"^`--memory_opt_config auto` needs a budget: add `--memory_budget_mb`"),
    (
        "cli",
        ["--memory_opt_config", "auto", "--memory_budget_mb", "-5"],
        r"^`--memory_budget_mb` is -5.0; expected a positive, finite number of MiB, as in `--memory_opt_config auto --memory_budget_mb 4000`$",
    ),
    (
        "cli",
        ["--memory_opt_config", "auto", "--memory_budget_mb", "0"],
        r"^`--memory_budget_mb` is 0.0; expected a positive, finite number",
    ),
    (
        "cli",
        ["--memory_opt_config", "auto", "--memory_budget_mb", "nan"],
        r"^`--memory_budget_mb` is nan; expected a positive, finite number",
    ),
    (
        "cli",
        ["--memory_opt_config", "auto", "--memory_budget_mb", "inf"],
        r"^`--memory_budget_mb` is inf; expected a positive, finite number",
    ),
    (
        "cli",
        ["--memory_budget_mb", "4000"],
        r"^`--memory_budget_mb 4000` is only used by `--memory_opt_config auto`, but `--memory_opt_config` is None; add `--memory_opt_config auto`, or drop `--memory_budget_mb`$",
    ),
    (
        "cli",
        ["--memory_opt_config", "Gelu+:1:-1", "--memory_budget_mb", "4000"],
        r"^`--memory_budget_mb 4000` is only used by `--memory_opt_config auto`, but `--memory_opt_config` is 'Gelu\+:1:-1'",
    ),
    (
        "cli",
        ["--memory_probe_steps", "0"],
        r"^`--memory_probe_steps` is 0; expected a positive integer, as in `--memory_probe_steps 6`$",
    ),
    ("cli", ["--input_density_table_steps", "0"], r"^`--input_density_table_steps` is 0; expected a positive integer"),
    (
        "cli",
        ["--gradient_checkpointing"],
        r"^`--gradient_checkpointing` uses torch.utils.checkpoint, which ORTModule cannot export; use ORT's recompute instead, as in `--memory_opt_level 1 --gradient_checkpointing false`, or pass `--memory_opt_backend none`$",
    ),
    (
        "cli",
        ["--torch_compile"],
        r"^`--torch_compile` with ORTModule: dynamo traces ORT's own export .* drop `--torch_compile`, or pass `--memory_opt_backend none`$",
    ),
    # the constructor checks what the command line's choices check
    (
        "kw",
        dict(ort_log_level="info"),
        r"^`--ort_log_level` is 'info'; expected one of 'WARNING', 'INFO', 'DEVINFO', 'VERBOSE', 'ERROR', 'FATAL', as in `--ort_log_level WARNING`; did you mean 'INFO'\?$",
    ),
    (
        "kw",
        dict(ort_fallback_policy="disabled"),
        r"^`--ort_fallback_policy` is 'disabled'; expected one of 'disable', 'default', as in `--ort_fallback_policy disable`$",
    ),
    (
        "kw",
        dict(memory_opt_level=True),
        r"^`--memory_opt_level` is True; expected the integer 0 \(the plans of --memory_opt_config\), 1 \(layer-wise recompute\) or 2",
    ),
    ("kw", dict(memory_opt_level=1.0), r"^`--memory_opt_level` is 1.0; expected the integer 0"),
    ("kw", dict(memory_opt_level=3), r"^`--memory_opt_level` is 3; expected the integer 0"),
    (
        "kw",
        dict(memory_opt_config="auto", memory_budget_mb=True),
        r"^`--memory_budget_mb` is True; expected a positive, finite number",
    ),
    (
        "kw",
        dict(memory_opt_config="auto", memory_budget_mb="4000"),
        r"^`--memory_budget_mb` is '4000'; expected a positive, finite number",
    ),
    ("kw", dict(input_density_table_steps=2.5), r"^`--input_density_table_steps` is 2.5; expected a positive integer"),
    (
        "kw",
        dict(memory_opt_config=5),
        r"^`--memory_opt_config` is 5 \(int\); expected plans as text or a list of them, as in `--memory_opt_config ",
    ),
    (
        "kw",
        dict(memory_opt_config=["Gelu+:1:-1", "Gelu+:2:-1"]),
        r"^`--memory_opt_config` names subgraph 'Gelu\+' twice",
    ),
    # directories that cannot be directories
    (
        "file",
        "--ort_save_onnx_dir",
        r"^`--ort_save_onnx_dir` is '.*a_file', which is a file; expected a directory \(created when missing\), as in `--ort_save_onnx_dir outputs/ort`$",
    ),
    ("file", "--ort_cache_dir", r"^`--ort_cache_dir` is '.*a_file', which is a file; expected a directory"),
    (
        "under_file",
        "--ort_save_onnx_dir",
        r"^`--ort_save_onnx_dir` is '.*a_file/sub', but '.*a_file' cannot be written; give a writable directory",
    ),
    ("under_file", "--ort_cache_dir", r"^`--ort_cache_dir` is '.*a_file/sub', but '.*a_file' cannot be written"),
    # where nothing can be created, not even by root (whom `os.access` tells yes)
    (
        "kw",
        dict(ort_cache_dir="/proc/memopt-cache"),
        r"^`--ort_cache_dir` is '/proc/memopt-cache', but '/proc' cannot be",
    ),
]
# every flag that only means something with a backend is refused with `--memory_opt_backend none`, by name
ORT_ONLY = [
    (["--memory_opt_config", "Gelu+:1:-1"], "--memory_opt_config"),
    (["--memory_opt_level", "1"], "--memory_opt_level"),
    (["--memory_opt_config", "auto", "--memory_budget_mb", "100"], "--memory_opt_config`, `--memory_budget_mb"),
    (["--ort_loss_in_graph"], "--ort_loss_in_graph"),
    (["--ort_save_onnx_dir", "some_dir"], "--ort_save_onnx_dir"),
    (["--ort_cache_dir", "some_dir"], "--ort_cache_dir"),
    (["--ort_log_level", "INFO"], "--ort_log_level"),
    (["--ort_fallback_policy", "default"], "--ort_fallback_policy"),
    (["--use_module_with_loss"], "--use_module_with_loss"),
    (["--save_onnx", "--onnx_prefix", "m"], "--save_onnx`, `--onnx_prefix"),
    (["--onnx_log_level", "INFO"], "--onnx_log_level"),
]


@pytest.mark.parametrize("how,value,pattern", BAD, ids=[f"{h}:{v}" for h, v, _ in BAD])
def test_bad_values_stop_with_their_message(tmp_path, how, value, pattern):
    with pytest.raises(ValueError) as info:
        if how == "cli":
            parse(*value)
        elif how == "kw":
            build(**value)
        elif how == "file":
            parse(value, _file(tmp_path))
        else:
            parse(value, os.path.join(_file(tmp_path), "sub"))
    assert __import__("re").match(pattern, str(info.value)), str(info.value)


@pytest.mark.parametrize("flags,named", ORT_ONLY, ids=[n for _, n in ORT_ONLY])
def test_ort_only_flags_are_refused_in_plain_pytorch(flags, named):
    with pytest.raises(
        ValueError,
        match=rf"^`{named}` configure a memory backend, but `--memory_opt_backend none` trains in plain PyTorch; drop `--memory_opt_backend none`, or drop those flags$",
    ):
        parse("--memory_opt_backend", "none", *flags)


def test_bad_level_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as stop:
        HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", "x", "--memory_opt_level", "3"]
        )
    assert stop.value.code == 2
    assert "invalid choice: 3 (choose from 0, 1, 2)" in capsys.readouterr().err


def test_environment_is_a_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_CONFIG", "Gelu+:1:-1")
    args = parse()
    assert [str(e) for e in args.memory_opt.entries] == ["Gelu+:1:-1"]
    assert args.memory_opt.sources == {"plans": "$ORTMODULE_MEMORY_OPT_CONFIG"}
    # the flag wins over the environment
    assert [str(e) for e in parse("--memory_opt_config", "Cast+:2:-1").memory_opt.entries] == ["Cast+:2:-1"]
    # and plain PyTorch ignores ORT's variables
    assert parse("--memory_opt_backend", "none").memory_opt.entries == []


@pytest.mark.parametrize(
    "var,value,pattern",
    [
        (
            "ORTMODULE_MEMORY_OPT_CONFIG",
            "Gelu+:9:-1",
            r"^`--memory_opt_config` \(read from \$ORTMODULE_MEMORY_OPT_CONFIG\) entry 'Gelu\+:9:-1' has optimization type 9",
        ),
        (
            "ORTMODULE_MEMORY_OPT_CONFIG",
            "missing_plans.json",
            r"^`--memory_opt_config` \(read from \$ORTMODULE_MEMORY_OPT_CONFIG\) file 'missing_plans.json' does not exist",
        ),
        (
            "ORTMODULE_MEMORY_OPT_LEVEL",
            "high",
            r"^`--memory_opt_level` \(read from \$ORTMODULE_MEMORY_OPT_LEVEL\) is 'high'; expected the integer 0",
        ),
        (
            "ORTMODULE_MEMORY_OPT_LEVEL",
            "1.0",
            r"^`--memory_opt_level` \(read from \$ORTMODULE_MEMORY_OPT_LEVEL\) is '1.0'; expected the integer 0",
        ),
    ],
)
def test_a_bad_environment_value_is_blamed_on_its_variable(monkeypatch, var, value, pattern):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=pattern):
        parse()


def test_level_conflict_blames_the_variable(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "2")
    assert parse().memory_opt.level == 2
    with pytest.raises(
        ValueError,
        match=r"^`--memory_opt_level` \(read from \$ORTMODULE_MEMORY_OPT_LEVEL\) is 2 and `--memory_opt_config` is 'Gelu\+:1:-1'",
    ):
        parse("--memory_opt_config", "Gelu+:1:-1")


# -- what is recorded ----------------------------------------------------------------------------------
def test_to_dict_records_what_was_asked_and_resolved():
    args = parse("--optim", "adamw_ort_fused", "--memory_opt_config", "Gelu+:1:-1,Cast+:2:3")
    assert args.optim == "adamw_ort_fused"  # stays as written; decided when the optimizer is built
    d = args.to_dict()
    assert d["optim"] == "adamw_ort_fused"
    assert d["memory_opt"]["entries"] == ["Gelu+:1:-1", "Cast+:2:3"]
    assert d["memory_opt"]["level"] == 0 and d["memory_opt"]["backend"] == "ort"
    json.dumps(d)  # what W&B / TensorBoard store must serialize


def test_to_dict_records_the_environment_fallback(monkeypatch):
    monkeypatch.setenv("ORTMODULE_MEMORY_OPT_LEVEL", "1")
    d = parse().to_dict()
    assert d["memory_opt"]["level"] == 1
    assert d["memory_opt"]["sources"] == {"level": "$ORTMODULE_MEMORY_OPT_LEVEL"}


def test_round_trips():
    args = parse(
        "--optim",
        "adamw_ort_fused",
        "--memory_opt_config",
        "auto",
        "--memory_budget_mb",
        "1234.5",
        "--memory_probe_steps",
        "4",
        "--print_memory_stats",
    )
    # pickle (what multiprocessing and accelerate do)
    again = pickle.loads(pickle.dumps(args))
    assert again.memory_opt == args.memory_opt and again.optim == "adamw_ort_fused"
    # to_dict -> constructor
    init = {f.name for f in fields(MemoptTrainingArguments) if f.init}
    d = args.to_dict()
    rebuilt = MemoptTrainingArguments(**{k: v for k, v in d.items() if k in init and not k.endswith("_token")})
    assert rebuilt.to_dict() == d
    # the memory config alone
    cfg = MemoryOptConfig(**{k: v for k, v in args.memory_opt.to_dict().items() if k not in ("entries", "auto")})
    assert cfg == args.memory_opt and cfg.auto and cfg.budget_mb == 1234.5


def test_memory_config_alone():
    assert MemoryOptConfig(plans="Gelu+:1:-1").summary() == "Gelu+:1:-1"
    assert MemoryOptConfig(level=2).summary() == "level 2 (layer-wise recompute with compromise)"
    assert not MemoryOptConfig().active
    with pytest.raises(ValueError, match=r"^`--memory_opt_backend` is 'tvm'; expected one of 'ort'"):
        MemoryOptConfig(backend="tvm")
    assert math.isfinite(MemoryOptConfig(plans="auto", budget_mb=10).budget_mb)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"activation_budget": 1.5}, r"^`--activation_memory_budget` is 1.5; expected the share of the layers' activations to keep, from 0 to 1, as in `--memory_opt_config auto --activation_memory_budget 0.3`$"),
        ({"activation_budget": float("nan")}, r"^`--activation_memory_budget` is nan; expected the share"),
        ({"activation_budget": 0.3, "plans": "Gelu+:1:-1"}, r"^`--activation_memory_budget 0.3` is only used by `--memory_opt_config auto`, but `--memory_opt_config` is 'Gelu\+:1:-1'; add `--memory_opt_config auto`, or drop `--activation_memory_budget`$"),
        ({"activation_budget": 0.3, "budget_mb": 4000}, r"^`--memory_budget_mb 4000` and `--activation_memory_budget 0.3` are two budgets; give one"),
        ({"activation_budget": 0.3, "backend": "ort"}, r"^`--activation_memory_budget` is chosen from the first step by the torch backend \(`--memory_opt_backend torch`\); the ort backend's `auto` measures fresh runs under a peak: use `--memory_budget_mb`"),
        ({"backend": "torch"}, r"^`--memory_opt_config auto` needs a budget: add `--memory_budget_mb`, as in `--memory_opt_config auto --memory_budget_mb 4000` \(or a share of the activations, `--activation_memory_budget 0.3`\)$"),
    ],
)  # fmt: skip
def test_a_share_of_the_activations_as_the_budget(kwargs, pattern):
    """`--activation_memory_budget`: with auto, on the torch backend, instead of a peak in MiB."""
    with pytest.raises(ValueError, match=pattern):
        MemoryOptConfig(**{"plans": "auto", "backend": "torch", **kwargs})
    config = MemoryOptConfig(plans="auto", backend="torch", activation_budget=0.25)
    assert config.summary() == "auto keeping 25% of the layers' activations"
    assert MemoryOptConfig(plans="auto", backend="torch", activation_budget=0).activation_budget == 0


def test_parsing_probes_nothing(monkeypatch):
    # installation, CUDA and kernel checks run when the trainer is built, not while parsing
    monkeypatch.setattr(ort, "_onnxruntime_dir", lambda: None)
    assert parse("--memory_opt_config", "Gelu+:1:-1").memory_opt_on


# -- ZeRO-3 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [3, 3.0, "3"])
def test_zero3_is_refused_with_the_reason(tmp_path, stage):
    cfg = tmp_path / "ds_zero3.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_batch_size": "auto"}))
    with pytest.raises(
        ValueError,
        match=r"^`--deepspeed` selects ZeRO stage 3, which ORTModule cannot run with the pinned stack: .*_apply_to_tensors_only.*Use ZeRO stage 1 or 2",
    ):
        parse("--deepspeed", str(cfg))


def test_zero3_through_accelerates_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "ds_zero3.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(cfg))
    with pytest.raises(
        ValueError, match=r"^accelerate's deepspeed_config_file '.*ds_zero3.json' selects ZeRO stage 3"
    ):
        parse()


@pytest.mark.parametrize(
    "config,stage",
    [
        ({"zero_optimization": None}, None),
        ({"zero_optimization": {}}, None),
        ({"zero_optimization": {"stage": "auto"}}, None),
        ({}, None),
        ({"zero_optimization": {"stage": 2}}, 2.0),
    ],
)
def test_zero_stage_reading_survives_odd_configs(config, stage):
    assert _zero_stage(config) == stage


@pytest.mark.slow
def test_zero3_import_really_fails_with_the_pinned_deepspeed():
    # The reason given above, checked against the installed DeepSpeed.
    code = "from deepspeed.runtime.zero.parameter_offload import _apply_to_tensors_only"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "ImportError" in res.stderr


@pytest.mark.ort
def test_real_install_is_detected():
    assert ort.is_installed() and ort.extensions_built() and ort.problem() is None


# -- moving from optimum's ORTTrainingArguments ---------------------------------------------------------
def test_ort_trainer_flags_are_accepted_and_translated(monkeypatch):
    monkeypatch.delenv("ORTMODULE_SAVE_ONNX_PATH", raising=False)
    args = parse(
        "--use_module_with_loss",
        "--save_onnx",
        "--onnx_prefix",
        "bert",
        "--onnx_log_level",
        "INFO",
        "--optim",
        "adamw_ort_fused",
    )
    assert args.ort_loss_in_graph and args.ort_log_level == "INFO" and args.optim == "adamw_ort_fused"
    assert args.ort_save_onnx_dir == "unused_out" and args.onnx_prefix == "bert"  # ORTTrainer saved to output_dir
    assert args.memory_opt_warnings == [
        "`--use_module_with_loss` (optimum's ORTTrainer) is `--ort_loss_in_graph` here: the loss is computed inside "
        "ORT's graph",
        "`--onnx_log_level INFO` (optimum's ORTTrainer) is `--ort_log_level` here",
        "`--save_onnx` (optimum's ORTTrainer) is `--ort_save_onnx_dir unused_out` here, file names prefixed 'bert'",
    ]
    monkeypatch.setenv("ORTMODULE_SAVE_ONNX_PATH", "onnx_here")
    assert parse("--save_onnx", "--onnx_prefix", "b").ort_save_onnx_dir == "onnx_here"


def test_ort_trainer_flags_that_cannot_work_say_why():
    with pytest.raises(ValueError, match=r"^`--save_onnx` needs `--onnx_prefix`, as in optimum's ORTTrainer"):
        parse("--save_onnx")
    with pytest.raises(ValueError, match=r"^`--onnx_log_level INFO` and `--ort_log_level VERBOSE` disagree"):
        parse("--onnx_log_level", "INFO", "--ort_log_level", "VERBOSE")
    assert parse("--onnx_prefix", "x").memory_opt_warnings == [
        "`--onnx_prefix x` has no effect without `--save_onnx` (or `--ort_save_onnx_dir`)"
    ]
