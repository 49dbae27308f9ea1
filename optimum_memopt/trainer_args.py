"""`MemoptTrainingArguments`: the Trainer's arguments plus the memory-optimizer flags.

Parsing and validation only; nothing here touches the model.
"""

import os
from dataclasses import dataclass, field
from typing import List, Optional

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from . import memory_config
from .memory_config import FLAG as CONFIG_FLAG
from .memory_config import MemoryOptEntry, parse_memory_opt_config
from .ort import FALLBACK_POLICIES, LOG_LEVELS, cuda_available, ort_problem


ORT_FUSED = "adamw_ort_fused"
ENV_CONFIG = "ORTMODULE_MEMORY_OPT_CONFIG"
ENV_LEVEL = "ORTMODULE_MEMORY_OPT_LEVEL"
LEVEL_HELP = {0: "the plans of --memory_opt_config", 1: "layer-wise recompute", 2: "layer-wise recompute with compromise"}


def _cpu_fused_adamw_works() -> bool:
    import torch

    try:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except Exception:
        return False


@dataclass
class MemoptTrainingArguments(TrainingArguments):
    """
    `TrainingArguments` for training through ONNX Runtime Training's ORTModule with its memory optimizer.

    Args:
        use_ort (`bool`, defaults to `True`):
            Train through ORTModule. `--use_ort false` trains the same script in plain PyTorch, to compare.
        memory_opt_config (`str`, *optional*):
            Recompute plans, as `SubgraphStr:OptimizationType:RequestApplyCount` entries separated by commas
            (`BiasGelu+:1:-1,Cast+:2:-1`), or the path of a JSON file holding a list of such strings.
            Type 0 = none, 1 = recompute, 2 = recompute with compromise; count -1 = every occurrence.
            `auto` lets the advisor pick plans from measurements under `--memory_budget_mb`.
            Falls back to the environment variable `ORTMODULE_MEMORY_OPT_CONFIG` when not given.
        memory_opt_level (`int`, defaults to 0):
            0 = the plans of `memory_opt_config`; 1 = recompute every transformer layer's recomputable
            subgraphs; 2 = as 1, plus plans that save part of an activation. Falls back to
            `ORTMODULE_MEMORY_OPT_LEVEL` when not given.
        memory_budget_mb (`float`, *optional*):
            With `--memory_opt_config auto`: the peak memory (MiB; CUDA max allocated, or CPU resident above
            the pre-training level) the chosen plans must fit under.
        memory_probe_max_plans (`int`, defaults to 6), memory_probe_steps (`int`, defaults to 6):
            With `--memory_opt_config auto`: how many of ORT's plans to measure, and for how many steps each.
        ort_log_level (`str`, defaults to `"WARNING"`):
            ORTModule's log level: WARNING, INFO, DEVINFO or VERBOSE. Our own plan table is printed on rank 0
            at every level; INFO and below add ORT's own tables and export logs.
        log_memory_plans (`bool`, defaults to `True`):
            After the first step, log the recompute plans ORT found and write `memory_plans.json`.
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
    """

    # Redeclared so argparse accepts `adamw_ort_fused`, which transformers 4.46 no longer lists.
    optim: str = field(
        default="adamw_torch",
        metadata={
            "help": "The optimizer to use; `adamw_ort_fused` is ONNX Runtime's FusedAdam (CUDA; on CPU the fused "
            "torch AdamW is used instead).",
            "choices": [o.value for o in OptimizerNames] + [ORT_FUSED],
        },
    )
    use_ort: bool = field(
        default=True,
        metadata={"help": "Train through ORTModule. `--use_ort false` trains the same script in plain PyTorch, to compare."},
    )
    memory_opt_config: Optional[str] = field(
        default=None,
        metadata={
            "help": "Recompute plans: comma-separated `SubgraphStr:OptimizationType:RequestApplyCount` entries "
            "(e.g. `BiasGelu+:1:-1,Cast+:2:-1`; type 0 none, 1 recompute, 2 recompute with compromise; count -1 "
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
        default=6, metadata={"help": "With --memory_opt_config auto: how many of ORT's plans to measure, largest first."}
    )
    memory_probe_steps: int = field(
        default=6, metadata={"help": "With --memory_opt_config auto: training steps per measured configuration."}
    )
    ort_log_level: str = field(
        default="WARNING",
        metadata={
            "help": "ORTModule log level. Our plan table shows on rank 0 at every level; INFO and below add ORT's "
            "own output.",
            "choices": list(LOG_LEVELS),
        },
    )
    log_memory_plans: bool = field(
        default=True,
        metadata={"help": "After the first step, log the recompute plans ORT found and write memory_plans.json."},
    )
    print_memory_stats: bool = field(
        default=False,
        metadata={"help": "Record memory at pre/post forward and pre/post backward (metrics, memory_phases.csv, plot)."},
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
        metadata={"help": "Only the loss leaves ORT's graph (logits stay inside), so label-sparsity optimizations apply."},
    )

    def __post_init__(self):
        # transformers dropped `adamw_ort_fused` from OptimizerNames (4.46 no longer lists it), so it is
        # taken off before the parent validates `optim`, and resolved below.
        optim_text = getattr(self.optim, "value", self.optim)
        self.ort_fused_adam = optim_text == ORT_FUSED
        self.optimizer_note: Optional[str] = None
        if self.ort_fused_adam:
            self.optim = "adamw_torch"
        requested = self.memory_opt_config if self.memory_opt_config is not None else os.environ.get(ENV_CONFIG, "")
        if str(requested).strip().lower() == memory_config.AUTO and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Checked before the parent's __post_init__, which would start the distributed setup.
            raise ValueError(
                f"`{CONFIG_FLAG} auto` probes the script in single-process runs and cannot run under a multi-process "
                f"launch; run `memopt-probe --budget_mb MIB -- SCRIPT ...` once and pass the plans it chooses, as in "
                f"`{CONFIG_FLAG} BiasGelu+:1:-1`"
            )
        if self.use_ort and self._requested_zero_stage() == 3:
            # Checked before the parent's __post_init__, which would start DeepSpeed's distributed setup.
            raise ValueError(
                "`--deepspeed` selects ZeRO stage 3, which ORTModule cannot run with the pinned stack: ORT 1.19's "
                "stage-3 support imports `_apply_to_tensors_only` from deepspeed.runtime.zero.parameter_offload, "
                "which DeepSpeed 0.15 renamed (ImportError). Use ZeRO stage 1 or 2 (examples/configs/ds_zero2.json), "
                "or `--use_ort false`"
            )
        super().__post_init__()
        self._resolve_memory_settings()
        self._check_conflicts()

    def _requested_zero_stage(self) -> Optional[int]:
        import json

        config = self.deepspeed
        if isinstance(config, str):
            if not os.path.isfile(config):
                return None  # the parent reports the missing file
            try:
                with open(config, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError):
                return None
        if isinstance(config, dict):
            stage = config.get("zero_optimization", {}).get("stage")
            return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
            stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")
            return int(stage) if stage.isdigit() else None
        return None

    # -- parsing ---------------------------------------------------------------------------
    def _resolve_memory_settings(self):
        # Precedence: a command-line value wins; the ORTMODULE_* environment variable is read only
        # when the flag is not given.
        config_source = CONFIG_FLAG
        config = self.memory_opt_config
        if config is None and os.environ.get(ENV_CONFIG):
            config, config_source = os.environ[ENV_CONFIG], f"${ENV_CONFIG}"
        level = self.memory_opt_level
        if level is None and os.environ.get(ENV_LEVEL):
            text = os.environ[ENV_LEVEL].strip()
            if text not in ("0", "1", "2"):
                raise ValueError(
                    f"`--memory_opt_level` read from ${ENV_LEVEL}={text!r}; expected 0, 1 or 2, as in "
                    f"`--memory_opt_level 1`"
                )
            level = int(text)
        if level is None:
            level = 0
        if level not in LEVEL_HELP:
            raise ValueError(
                f"`--memory_opt_level` is {level!r}; expected 0 (the plans of {CONFIG_FLAG}), 1 (layer-wise "
                f"recompute) or 2 (layer-wise recompute with compromise), as in `--memory_opt_level 1`"
            )
        self.memory_opt_level = level
        self.memory_opt_auto = isinstance(config, str) and config.strip().lower() == memory_config.AUTO
        entries: List[MemoryOptEntry] = []
        if not self.memory_opt_auto:
            try:
                entries = parse_memory_opt_config(config)
            except ValueError as e:
                if config_source != CONFIG_FLAG:
                    raise ValueError(f"{e} (value read from {config_source})") from None
                raise
        self.memory_opt_entries = entries
        self.memory_opt_config = config

    def _check_conflicts(self):
        has_plans = bool(self.memory_opt_entries) or self.memory_opt_auto
        if self.memory_opt_level in (1, 2) and has_plans:
            raise ValueError(
                f"`--memory_opt_level {self.memory_opt_level}` and `{CONFIG_FLAG} {self.memory_opt_config}` were both "
                f"given, but at level 1 or 2 ONNX Runtime ignores the config and applies its own layer-wise plans; "
                f"give either `--memory_opt_level 1` or `{CONFIG_FLAG} BiasGelu+:1:-1`"
            )
        if self.memory_opt_auto and not self.memory_budget_mb:
            raise ValueError(
                f"`{CONFIG_FLAG} auto` needs a budget: add `--memory_budget_mb`, as in "
                f"`{CONFIG_FLAG} auto --memory_budget_mb 4000`"
            )
        if self.memory_budget_mb is not None and self.memory_budget_mb <= 0:
            raise ValueError(f"`--memory_budget_mb` is {self.memory_budget_mb}; expected a positive number of MiB")
        if self.input_density_table_steps < 1:
            raise ValueError(
                f"`--input_density_table_steps` is {self.input_density_table_steps}; expected a positive integer"
            )
        if not self.use_ort:
            ort_only = []
            if has_plans:
                ort_only.append(CONFIG_FLAG)
            if self.memory_opt_level:
                ort_only.append("--memory_opt_level")
            if self.ort_loss_in_graph:
                ort_only.append("--ort_loss_in_graph")
            if ort_only:
                raise ValueError(
                    f"`{'`, `'.join(ort_only)}` configure ONNX Runtime's memory optimizer, but `--use_ort false` "
                    f"trains in plain PyTorch; drop `--use_ort false`, or drop those flags"
                )
        else:
            problem = ort_problem()
            if problem:
                raise ValueError(
                    f"`--use_ort` (on by default) needs ONNX Runtime Training: {problem}. "
                    f"Or pass `--use_ort false` to train in plain PyTorch"
                )
            if self.gradient_checkpointing:
                raise ValueError(
                    "`--gradient_checkpointing` uses torch.utils.checkpoint, which ORTModule cannot export; use "
                    "ORT's recompute instead, as in `--memory_opt_level 1`, or pass `--use_ort false`"
                )
        if self.ort_fused_adam:
            if cuda_available():
                self.optimizer_note = "FusedAdam from onnxruntime.training.optim (CUDA)"
            elif _cpu_fused_adamw_works():
                self.optim = "adamw_torch_fused"
                self.optimizer_note = (
                    "`--optim adamw_ort_fused` needs CUDA, which is not available; using torch.optim.AdamW "
                    "(fused=True, the CPU fused kernel) instead, the same AdamW update"
                )
            else:
                self.optim = "adamw_torch"
                self.optimizer_note = (
                    "`--optim adamw_ort_fused` needs CUDA, which is not available; using torch.optim.AdamW instead"
                )
        if self.use_ort and self.n_gpu > 1:
            raise ValueError(
                "ORTModule cannot run under torch.nn.DataParallel (several GPUs in one process); launch one "
                "process per GPU with `accelerate launch` or `torchrun`"
            )

    @property
    def memory_opt_summary(self) -> str:
        if not self.use_ort:
            return "plain PyTorch (ORTModule off)"
        if self.memory_opt_level:
            return f"level {self.memory_opt_level} ({LEVEL_HELP[self.memory_opt_level]})"
        if self.memory_opt_auto:
            return f"auto under {self.memory_budget_mb:g} MiB"
        if self.memory_opt_entries:
            return memory_config.to_inline(self.memory_opt_entries)
        return "off"
