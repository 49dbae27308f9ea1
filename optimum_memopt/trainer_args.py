"""`MemoptTrainingArguments`: the Trainer's arguments plus the memory-optimizer flags.

They describe and validate; they probe nothing. Each bad value stops here, before a model is loaded,
with a message that names the flag (or the environment variable the value came from), quotes the
value and shows an accepted form. Installation, device and precision checks run when the trainer is
built (`MemoptTrainerMixin`).
"""

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from . import _deepspeed, compat
from .backends.ort import FALLBACK_POLICIES, LOG_LEVELS, ORT_FUSED
from .config import BACKEND_FLAG, BACKENDS, CONFIG_FLAG, LEVEL_FLAG, MemoryOptConfig
from .plans import EXAMPLE

compat.check_arguments_types()

ENV_CONFIG = "ORTMODULE_MEMORY_OPT_CONFIG"
ENV_LEVEL = "ORTMODULE_MEMORY_OPT_LEVEL"
# Flags that only mean something when the model trains through ORTModule, with their defaults.
ORT_ONLY_FLAGS = {
    "memory_opt_backend": None,
    "memory_opt_config": None,
    "memory_opt_level": None,
    "memory_budget_mb": None,
    "ort_loss_in_graph": False,
    "ort_save_onnx_dir": None,
    "ort_cache_dir": None,
    "ort_log_level": "WARNING",
    "ort_fallback_policy": "disable",
    # optimum ORTTrainer's names for some of them
    "use_module_with_loss": False,
    "save_onnx": False,
    "onnx_prefix": None,
    "onnx_log_level": None,
}
# Of those, the ones that configure ONNX Runtime itself: refused with the torch backend.
_SHARED = ("memory_opt_backend", "memory_opt_config", "memory_opt_level", "memory_budget_mb")
ORT_BACKEND_FLAGS = {k: v for k, v in ORT_ONLY_FLAGS.items() if k not in _SHARED}


def _zero_stage(config) -> Optional[float]:
    """The ZeRO stage of a DeepSpeed config (dict or JSON path); None when it sets none."""
    if isinstance(config, str):
        try:
            with open(config, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None  # DeepSpeed reports a missing or broken file itself
    if not isinstance(config, dict):
        return None
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        return None
    stage = zero.get("stage")
    try:
        return float(stage)
    except (TypeError, ValueError):
        return None


def _check_dir_flag(flag: str, path: Optional[str]) -> None:
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"`{flag}` is {path!r}, which is a file; expected a directory (created when missing), as in "
            f"`{flag} outputs/ort`"
        )
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(
            f"`{flag}` is {path!r}, but {parent!r} cannot be written; give a writable directory, as in "
            f"`{flag} outputs/ort`"
        )


@dataclass
class MemoptTrainingArguments(TrainingArguments):
    """
    `TrainingArguments` for training through ONNX Runtime Training's ORTModule with its memory optimizer.

    Args:
        use_ort (`bool`, defaults to `True`):
            Train through ORTModule. `--use_ort false` trains the same script in plain PyTorch, to compare.
        memory_opt_config (`str`, *optional*):
            Recompute plans, as `SubgraphStr:OptimizationType:RequestApplyCount` entries separated by commas
            (`Gelu+:1:-1,Cast+:2:-1`), or the path of a JSON file holding a list of such strings.
            Type 0 = none, 1 = recompute, 2 = recompute with compromise; count -1 = every occurrence.
            `auto` lets the advisor pick plans from measurements under `--memory_budget_mb`.
            Falls back to the environment variable `ORTMODULE_MEMORY_OPT_CONFIG` when not given.
        memory_opt_level (`int`, *optional*):
            0 = the plans of `memory_opt_config`; 1 = recompute every transformer layer's recomputable
            subgraphs; 2 = as 1, plus plans that save part of an activation. Falls back to
            `ORTMODULE_MEMORY_OPT_LEVEL`, then 0.
        memory_budget_mb (`float`, *optional*):
            With `--memory_opt_config auto`: the peak memory (MiB) the chosen plans must fit under.
        memory_probe_max_plans (`int`, defaults to 6), memory_probe_steps (`int`, defaults to 6):
            With `--memory_opt_config auto`: how many plans to measure, and for how many steps each.
        ort_log_level (`str`, defaults to `"WARNING"`):
            ORTModule's log level: VERBOSE, DEVINFO, INFO, WARNING, ERROR or FATAL.
        log_memory_plans (`bool`, defaults to `True`):
            After the first step, log the recompute plans found and write `memory_plans.json`.
        print_memory_stats (`bool`, defaults to `False`):
            Record memory at pre/post forward and pre/post backward of each step (first ten, powers of two,
            logging steps) as metrics, `memory_phases.csv` and `memory_phases.png`.
        print_input_density (`bool`, defaults to `False`):
            Record the share of non-padding input tokens and of labels that are not ignored.
        input_density_table_steps (`int`, defaults to 10):
            With `print_input_density`, log a density table every this many steps.
        ort_fallback_policy (`str`, defaults to `"disable"`):
            `disable`: an ORT failure stops training. `default`: ORT's own policy, which may fall back to PyTorch.
        ort_save_onnx_dir (`str`, *optional*):
            Save the ONNX graphs ORTModule exports and optimizes into this directory, for debugging.
        ort_cache_dir (`str`, *optional*):
            Cache the exported ONNX model here to skip the export on later runs.
        ort_loss_in_graph (`bool`, defaults to `False`):
            Wrap the model so that only the loss leaves ORT's graph (logits stay inside, label smoothing is
            computed inside), which lets ORT's label-sparsity optimization apply.
        memory_measure_out (`str`, *optional*):
            Used by the advisor's measuring runs: write this run's peak memory, step times and plan report to
            this JSON file at the end of training (and skip saving the model).
    """

    # Redeclared so argparse accepts `adamw_ort_fused`, which transformers 4.46 no longer lists. The value
    # stays as written; the optimizer it stands for is decided when the optimizer is built.
    optim: str = field(
        default="adamw_torch",
        metadata={
            "help": "The optimizer to use; `adamw_ort_fused` is ONNX Runtime's FusedAdam (CUDA; elsewhere the fused "
            "torch AdamW is used instead, and the log says so).",
            "choices": [o.value for o in OptimizerNames] + [ORT_FUSED],
        },
    )
    use_ort: bool = field(
        default=True,
        metadata={
            "help": "Train through the memory-optimizer backend (ORTModule, or the torch backend). `--use_ort false` "
            "trains the same script in plain PyTorch, to compare."
        },
    )
    memory_opt_backend: Optional[str] = field(
        default=None,
        metadata={
            "help": "What applies the plans: `ort` (ONNX Runtime Training's ORTModule; torch <= 2.4) or `torch` "
            "(current PyTorch, torch >= 2.5). Default: `ort` where onnxruntime-training is installed, else `torch`.",
            "choices": [None, *BACKENDS],
        },
    )
    memory_opt_config: Optional[str] = field(
        default=None,
        metadata={
            "help": "Recompute plans: comma-separated `SubgraphStr:OptimizationType:RequestApplyCount` entries "
            "(e.g. `Gelu+:1:-1,Cast+:2:-1`; type 0 none, 1 recompute, 2 recompute with compromise; count -1 "
            "= all), a path to a JSON file holding a list of such strings, or `auto` (choose from measurements "
            "under --memory_budget_mb). Falls back to $ORTMODULE_MEMORY_OPT_CONFIG."
        },
    )
    memory_opt_level: Optional[int] = field(
        default=None,
        metadata={
            "help": "0: the plans of --memory_opt_config; 1: layer-wise recompute; 2: layer-wise recompute with "
            "compromise. Falls back to $ORTMODULE_MEMORY_OPT_LEVEL, then 0.",
            "choices": [0, 1, 2],
        },
    )
    memory_budget_mb: Optional[float] = field(
        default=None,
        metadata={"help": "With --memory_opt_config auto: peak memory in MiB the chosen plans must fit under."},
    )
    memory_probe_max_plans: int = field(
        default=6, metadata={"help": "With --memory_opt_config auto: how many plans to measure, largest first."}
    )
    memory_probe_steps: int = field(
        default=6, metadata={"help": "With --memory_opt_config auto: training steps per measured configuration."}
    )
    ort_log_level: str = field(
        default="WARNING",
        metadata={"help": "ORTModule log level. INFO and below add ORT's own output.", "choices": list(LOG_LEVELS)},
    )
    log_memory_plans: bool = field(
        default=True,
        metadata={"help": "After the first step, log the recompute plans found and write memory_plans.json."},
    )
    print_memory_stats: bool = field(
        default=False,
        metadata={
            "help": "Record memory at pre/post forward and pre/post backward (metrics, memory_phases.csv, plot)."
        },
    )
    print_input_density: bool = field(
        default=False,
        metadata={"help": "Record the share of non-padding tokens and of labels that are not ignored (-100)."},
    )
    input_density_table_steps: int = field(
        default=10, metadata={"help": "With --print_input_density, log a density table every this many steps."}
    )
    ort_fallback_policy: str = field(
        default="disable",
        metadata={
            "help": "disable: an ORT failure stops training; default: ORT's policy, which may fall back to PyTorch.",
            "choices": list(FALLBACK_POLICIES),
        },
    )
    ort_save_onnx_dir: Optional[str] = field(
        default=None, metadata={"help": "Save the ONNX graphs ORTModule exports into this directory (debugging)."}
    )
    ort_cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Cache the exported ONNX model here to skip the export on later runs."}
    )
    ort_loss_in_graph: bool = field(
        default=False,
        metadata={
            "help": "Only the loss leaves ORT's graph (logits stay inside), so label-sparsity optimizations apply."
        },
    )
    memory_measure_out: Optional[str] = field(
        default=None,
        metadata={
            "help": "Used by the advisor's measuring runs: write peak memory, step times and the plan report "
            "to this JSON file, and do not save the model."
        },
    )
    # The names optimum's ORTTrainingArguments (1.27) used, so a script moves here by changing its imports.
    use_module_with_loss: bool = field(
        default=False, metadata={"help": "optimum ORTTrainer's name for --ort_loss_in_graph (accepted, said once)."}
    )
    save_onnx: bool = field(
        default=False,
        metadata={
            "help": "optimum ORTTrainer's switch for saving ORT's graphs: here --ort_save_onnx_dir "
            "($ORTMODULE_SAVE_ONNX_PATH, else --output_dir); needs --onnx_prefix, as there."
        },
    )
    onnx_prefix: Optional[str] = field(
        default=None, metadata={"help": "With --save_onnx: the prefix of the saved graphs' file names."}
    )
    onnx_log_level: Optional[str] = field(
        default=None,
        metadata={"help": "optimum ORTTrainer's name for --ort_log_level.", "choices": [None, *LOG_LEVELS]},
    )
    # Derived: the validated memory settings, built from the flags above (and ORT's variables) in __post_init__,
    # and one line per ORTTrainer name that was translated (logged once, on rank 0, when the trainer is built).
    memory_opt: Optional[MemoryOptConfig] = field(init=False, default=None, repr=False)
    ort_trainer_notes: List[str] = field(init=False, default_factory=list, repr=False)
    memory_opt_notes: List[str] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self):
        self._check_ort_only()
        self._resolve_backend()
        self._translate_ort_trainer_names()
        self._check_choices()
        self.memory_opt = self._build_memory_config()
        if self.use_ort and self.memory_opt.backend == "torch":
            self._check_torch_conflicts()
        elif self.use_ort:
            self._check_ort_conflicts()
        # transformers no longer lists `adamw_ort_fused`: the parent validates a stand-in, and the value is put back.
        if _deepspeed.requested(self.deepspeed):
            _deepspeed.import_early()
        asked = getattr(self.optim, "value", self.optim)
        if asked == ORT_FUSED:
            self.optim = "adamw_torch"
        super().__post_init__()
        if asked == ORT_FUSED:
            self.optim = ORT_FUSED

    def _resolve_backend(self):
        notes = []
        if self.memory_opt_backend is not None and self.memory_opt_backend not in BACKENDS:
            raise ValueError(
                f"`{BACKEND_FLAG}` is {self.memory_opt_backend!r}; expected one of {', '.join(map(repr, BACKENDS))}, "
                f"as in `{BACKEND_FLAG} torch`"
            )
        if self.use_ort and self.memory_opt_backend is None:
            from .backends import default_backend

            self.memory_opt_backend = default_backend()
            if self.memory_opt_backend == "torch":
                notes.append(
                    f"memory optimizer: the torch backend (onnxruntime-training is not installed; `{BACKEND_FLAG} "
                    f"ort` needs it, with torch <= 2.4)"
                )
        if self.use_ort and self.memory_opt_backend == "torch":
            given = [f"--{k}" for k, default in ORT_BACKEND_FLAGS.items() if getattr(self, k) != default]
            if getattr(self.optim, "value", self.optim) == ORT_FUSED:
                given.append(f"--optim {ORT_FUSED}")
            if given:
                raise ValueError(
                    f"`{'`, `'.join(given)}` configure ONNX Runtime, but `{BACKEND_FLAG} torch` trains without it; "
                    f"drop them (for the optimizer: `--optim adamw_torch_fused`), or use `{BACKEND_FLAG} ort`"
                )
            ignored = [v for v in (ENV_CONFIG, ENV_LEVEL) if os.environ.get(v)]
            if ignored:
                notes.append(
                    f"${' and $'.join(ignored)} set in the environment: ONNX Runtime's variables, not read by the "
                    f"torch backend; give `{CONFIG_FLAG}` / `{LEVEL_FLAG}` instead"
                )
        self.memory_opt_notes = notes

    def _check_torch_conflicts(self):
        if self.gradient_checkpointing:
            raise ValueError(
                "`--gradient_checkpointing` with the torch backend would recompute the same layers twice over; use "
                f"the backend's whole-layer recompute instead, as in `{LEVEL_FLAG} 1`, or pass `--use_ort false`"
            )
        if self.torch_compile:
            raise ValueError(
                "`--torch_compile` with the torch backend: its recompute runs in Python hooks (a dispatch mode and "
                "saved-tensor hooks) that torch.compile would trace or break around; drop `--torch_compile`, or pass "
                "`--use_ort false` to compile plain PyTorch"
            )
        stage = _zero_stage(self.deepspeed) if self.deepspeed else None
        if stage == 3:
            raise ValueError(
                "`--deepspeed` selects ZeRO stage 3 with the torch backend, which is not tested with it (ZeRO-3 "
                "gathers parameters inside the layers the backend recomputes); use ZeRO stage 1 or 2 "
                "(examples/configs/ds_zero2.json), or `--use_ort false`"
            )

    def _translate_ort_trainer_names(self):
        notes = []
        if self.use_module_with_loss:
            self.ort_loss_in_graph = True
            notes.append(
                "`--use_module_with_loss` (optimum's ORTTrainer) is `--ort_loss_in_graph` here: the loss is "
                "computed inside ORT's graph"
            )
        if self.onnx_log_level is not None:
            if self.ort_log_level not in ("WARNING", self.onnx_log_level):
                raise ValueError(
                    f"`--onnx_log_level {self.onnx_log_level}` and `--ort_log_level {self.ort_log_level}` "
                    f"disagree; give one of them, as in `--ort_log_level {self.onnx_log_level}`"
                )
            self.ort_log_level = self.onnx_log_level
            notes.append(f"`--onnx_log_level {self.onnx_log_level}` (optimum's ORTTrainer) is `--ort_log_level` here")
        if self.save_onnx:
            if not self.onnx_prefix:
                raise ValueError(
                    "`--save_onnx` needs `--onnx_prefix`, as in optimum's ORTTrainer (`--save_onnx "
                    "--onnx_prefix my_model`); or give the directory alone, as in `--ort_save_onnx_dir "
                    "outputs/onnx`"
                )
            if not self.ort_save_onnx_dir:
                self.ort_save_onnx_dir = os.environ.get("ORTMODULE_SAVE_ONNX_PATH") or self.output_dir
            notes.append(
                f"`--save_onnx` (optimum's ORTTrainer) is `--ort_save_onnx_dir {self.ort_save_onnx_dir}` "
                f"here, file names prefixed {self.onnx_prefix!r}"
            )
        elif self.onnx_prefix and not self.ort_save_onnx_dir:
            notes.append(
                f"`--onnx_prefix {self.onnx_prefix}` has no effect without `--save_onnx` (or `--ort_save_onnx_dir`)"
            )
        self.ort_trainer_notes = notes

    # -- checks that need nothing but the values -------------------------------------------------------
    def _check_choices(self):
        """The constructor checks what the command line's `choices` check."""
        for name, allowed in (("ort_log_level", LOG_LEVELS), ("ort_fallback_policy", FALLBACK_POLICIES)):
            value = getattr(self, name)
            if value not in allowed:
                near = [a for a in allowed if isinstance(value, str) and a.lower() == value.strip().lower()]
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ValueError(
                    f"`--{name}` is {value!r}; expected one of {', '.join(map(repr, allowed))}, as in "
                    f"`--{name} {allowed[0]}`{hint}"
                )
        # the budget and the probe limits are MemoryOptConfig's to check
        value = self.input_density_table_steps
        if type(value) is not int or value < 1:
            raise ValueError(
                f"`--input_density_table_steps` is {value!r}; expected a positive integer, as in "
                f"`--input_density_table_steps 10`"
            )
        _check_dir_flag("--ort_save_onnx_dir", self.ort_save_onnx_dir)
        _check_dir_flag("--ort_cache_dir", self.ort_cache_dir)

    def _check_ort_only(self):
        if self.use_ort:
            return
        given = [f"--{k}" for k, default in ORT_ONLY_FLAGS.items() if getattr(self, k) != default]
        if given:
            raise ValueError(
                f"`{'`, `'.join(given)}` configure ONNX Runtime's memory optimizer, but `--use_ort false` trains in "
                f"plain PyTorch; drop `--use_ort false`, or drop those flags"
            )

    def _build_memory_config(self) -> MemoryOptConfig:
        # Precedence: a flag wins; ORT's own ORTMODULE_* variables are read only when the flag is not given,
        # and only when training through ORT.
        sources = {}
        plans = self.memory_opt_config
        ort = self.use_ort and self.memory_opt_backend == "ort"
        if plans is None and ort and os.environ.get(ENV_CONFIG):
            plans, sources["plans"] = os.environ[ENV_CONFIG], f"${ENV_CONFIG}"
        level = self.memory_opt_level
        if level is None and ort and os.environ.get(ENV_LEVEL):
            text = os.environ[ENV_LEVEL].strip()
            sources["level"] = f"${ENV_LEVEL}"
            level = int(text) if text in ("0", "1", "2") else text
        if level is None:
            level = 0
        config = MemoryOptConfig(
            plans=plans,
            level=level,
            backend=self.memory_opt_backend or "ort",
            budget_mb=self.memory_budget_mb,
            probe_max_plans=self.memory_probe_max_plans,
            probe_steps=self.memory_probe_steps,
            sources=sources,
        )
        if config.auto and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Checked before the parent's __post_init__, which would start the distributed setup.
            raise ValueError(
                f"`{CONFIG_FLAG} auto` probes the script in single-process runs and cannot run under a multi-process "
                f"launch; run `memopt-probe --budget_mb MIB -- SCRIPT ...` once and pass the plans it chooses, as in "
                f"`{CONFIG_FLAG} {EXAMPLE}`"
            )
        return config

    def _check_ort_conflicts(self):
        stage = _zero_stage(self.deepspeed) if self.deepspeed else None
        via = "`--deepspeed`"
        if (
            stage is None
            and not self.deepspeed
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")
        ):
            path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
            if path and path != "none":
                stage, via = _zero_stage(path), f"accelerate's deepspeed_config_file {path!r}"
            if stage is None:
                try:
                    stage, via = (
                        float(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")),
                        "accelerate's zero_stage",
                    )
                except ValueError:
                    stage = None
        if stage == 3:
            # Checked before the parent's __post_init__, which would start DeepSpeed's distributed setup.
            raise ValueError(
                f"{via} selects ZeRO stage 3, which ORTModule cannot run with the pinned stack: ORT 1.19's stage-3 "
                f"support imports `_apply_to_tensors_only` from deepspeed.runtime.zero.parameter_offload, which "
                f"DeepSpeed 0.15 renamed (ImportError). Use ZeRO stage 1 or 2 (examples/configs/ds_zero2.json), or "
                f"`--use_ort false`"
            )
        if self.gradient_checkpointing:
            raise ValueError(
                "`--gradient_checkpointing` uses torch.utils.checkpoint, which ORTModule cannot export; use ORT's "
                f"recompute instead, as in `{LEVEL_FLAG} 1`, or pass `--use_ort false`"
            )
        if self.torch_compile:
            raise ValueError(
                "`--torch_compile` with ORTModule: dynamo traces ORT's own export (75-105 s before the first step on "
                "the small recipe model) and speeds nothing up, since ORT runs the graph; drop `--torch_compile`, or "
                "pass `--use_ort false`"
            )

    # -- what the run was asked to do ------------------------------------------------------------------
    @property
    def memory_opt_summary(self) -> str:
        if not self.use_ort:
            return "plain PyTorch (ORTModule off)"
        return self.memory_opt.summary() + (" (torch backend)" if self.memory_opt.backend == "torch" else "")

    def to_dict(self):
        """The parent's dictionary (what TensorBoard / W&B store), `optim` as asked, and the resolved memory config."""
        d = super().to_dict()
        d["optim"] = getattr(self.optim, "value", self.optim)
        d["memory_opt"] = self.memory_opt.to_dict() if self.use_ort else None
        return d
