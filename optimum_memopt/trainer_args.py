"""`MemoptTrainingArguments`: the Trainer's arguments plus the memory-optimizer flags.

They describe and validate; they probe nothing. Each bad value stops here, before a model is loaded,
with a message that names the flag (or the environment variable the value came from), quotes the
value and shows an accepted form. Installation, device and precision checks run when the trainer is
built (`MemoptTrainerMixin`).
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from . import _deepspeed, transformers_releases
from .backends import (
    CLASS_DEFAULTS,
    NAMES,
    NONE,
    BackendFlags,
    all_backends,
    backend_flags,
    get_backend,
    optimizer_names,
)
from .config import BACKEND_FLAG, CONFIG_FLAG, LEVEL_FLAG, MemoryOptConfig, check_host_mb
from .plans import EXAMPLE

transformers_releases.check_arguments_types()

# The memory flags every backend reads, with their defaults; with `--memory_opt_backend none` they are refused,
# as are the backends' own flags (`backends.backend_flags()`).
SHARED_FLAGS = {
    "memory_opt_backend": None,
    "memory_opt_config": None,
    "memory_opt_level": None,
    "memory_budget_mb": None,
    "activation_memory_budget": None,
    "memory_plan_file": None,
    "memory_host_mb": None,
}


OPTIM_METADATA = {
    "help": "The optimizer to use; `adamw_ort_fused` is ONNX Runtime's FusedAdam (CUDA; elsewhere the fused torch "
    "AdamW is used instead, and the log says so).",
    "choices": [o.value for o in OptimizerNames] + list(optimizer_names()),
}


def _default_optim(config_cls) -> str:
    default = {f.name: f for f in dataclasses.fields(config_cls)}["optim"].default
    return getattr(default, "value", default)


@dataclass
class MemoptTrainingArguments(BackendFlags, TrainingArguments):
    """
    `TrainingArguments` for training with a memory backend: the torch backend (current PyTorch) or ONNX Runtime
    Training's ORTModule.

    Args:
        memory_opt_backend (`str`, *optional*):
            `torch`, `ort` or `none` (the same script in plain PyTorch, to compare). Default: `ort` where
            onnxruntime-training is installed, else `torch`.
        use_ort (`bool`, *optional*):
            Deprecated alias: `--use_ort false` is `--memory_opt_backend none`, `--use_ort true` the default.
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
        activation_memory_budget (`float`, *optional*):
            With `--memory_opt_config auto` on the torch backend, instead of `--memory_budget_mb`: the share (0 to 1)
            of the bytes the layers keep for backward without recompute that the chosen plans may keep (as
            `torch.compile`'s `activation_memory_budget`); the least recompute time that keeps no more.
        memory_auto_dry_run (`bool`, defaults to `True`):
            With `--memory_opt_config auto --memory_budget_mb` on the torch backend: choose before step one from a
            dry run of it on fake tensors (`backends/torch/decide/from_plan.py`), step one checking the choice;
            `false`: step one measures with every layer recomputed whole and the choice runs from step two (also
            what runs where no dry run of the run's own step can be made: FSDP, DeepSpeed, a loop of one's own).
        memory_host_mb (`float`, *optional*):
            With `--memory_opt_config auto --memory_budget_mb` on the torch backend: the host memory (MiB) the layers'
            offloaded tensors may hold (`Offload+`); default: what the host has available as step one ends.
        memory_plan_file (`str`, *optional*):
            `memopt-plan --json`'s file: `auto` on the torch backend runs its choice from step one, which checks it,
            instead of a dry run of its own (`planning/plan_file.py`); the budget is the file's (`--memory_budget_mb`
            may be left out) and `--memory_opt_config auto` is implied. Refused before training where the file
            planned another step (model, batch, sequence, precision, optimizer, accumulation, LoRA, processes).
        memory_probe_max_plans (`int`, defaults to 6), memory_probe_steps (`int`, defaults to 6):
            With `--memory_opt_config auto`: how many plans to measure, and for how many steps each.
        ort_log_level (`str`, defaults to `"WARNING"`):
            ORTModule's log level: VERBOSE, DEVINFO, INFO, WARNING, ERROR or FATAL.
        log_memory_plans (`bool`, defaults to `True`):
            After the first step, say in two lines what runs and where step one peaked, and write the recompute plans
            found to `memory_plans.json` and, as a table with its notes, to `memory_plans.txt`.
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

    # Redeclared so argparse accepts `adamw_ort_fused`, which transformers 4.46 no longer lists, with the installed
    # transformers' default (4.46: `adamw_torch`; 5.x: `adamw_torch_fused`). The value stays as written; the
    # optimizer it stands for is decided when the optimizer is built.
    optim: str = field(default=_default_optim(TrainingArguments), metadata=OPTIM_METADATA)
    use_ort: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Deprecated: `--use_ort false` is `--memory_opt_backend none` (and `--use_ort true` the default); "
            "`memory_opt_on` says whether a backend trains."
        },
    )
    memory_opt_backend: Optional[str] = field(
        default=None,
        metadata={
            "help": "The switch: what applies the plans. `torch` (current PyTorch, torch >= 2.5), `ort` (ONNX Runtime "
            "Training's ORTModule; torch <= 2.4) or `none` (the same script in plain PyTorch, to compare). Default: "
            "`ort` where onnxruntime-training is installed, else `torch`.",
            "choices": [None, *NAMES, NONE],
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
    activation_memory_budget: Optional[float] = field(
        default=None,
        metadata={
            "help": "With --memory_opt_config auto on the torch backend, instead of --memory_budget_mb: the share "
            "(0 to 1) of the layers' activations the chosen plans may keep, as torch.compile's "
            "activation_memory_budget."
        },
    )
    memory_auto_dry_run: bool = field(
        default=True,
        metadata={
            "help": "With --memory_opt_config auto --memory_budget_mb on the torch backend: choose before step one "
            "from a dry run of it on fake tensors, and check the choice in step one (true, the default); false: step "
            "one measures with every layer recomputed whole and the choice runs from step two."
        },
    )
    memory_host_mb: Optional[float] = field(
        default=None,
        metadata={
            "help": "With --memory_opt_config auto --memory_budget_mb on the torch backend: the host memory in MiB "
            "the layers' offloaded tensors (Offload+) may hold; default: what the host has available as step one ends."
        },
    )
    memory_plan_file: Optional[str] = field(
        default=None,
        metadata={
            "help": "memopt-plan --json's file: auto (torch backend) runs its choice from step one, which checks it, "
            "with no dry run at the start; the budget is the file's. Refused where the file planned another step."
        },
    )
    memory_probe_max_plans: int = field(
        default=6, metadata={"help": "With --memory_opt_config auto: how many plans to measure, largest first."}
    )
    memory_probe_steps: int = field(
        default=6, metadata={"help": "With --memory_opt_config auto: training steps per measured configuration."}
    )
    log_memory_plans: bool = field(
        default=True,
        metadata={
            "help": "After the first step, say what runs and where step one peaked, and write the recompute plans "
            "found to memory_plans.json and memory_plans.txt (the table; in the log too at --log_level info)."
        },
    )
    print_memory_stats: bool = field(
        default=False,
        metadata={
            "help": "Record memory at pre/post forward and pre/post backward (metrics, memory_phases.csv, plot)."
        },
    )
    log_all_memory_metrics: bool = field(
        default=False,
        metadata={
            "help": "Put every memopt/* figure into each training log line (each phase's in-use, peak and resident "
            "MiB, token and label counts). By default a line carries the step peak, what forward held, the densities "
            "and, once, the plans; the rest is in memory_phases.csv, input_density.csv and memory_plans.json."
        },
    )
    print_input_density: bool = field(
        default=False,
        metadata={"help": "Record the share of non-padding tokens and of labels that are not ignored (-100)."},
    )
    input_density_table_steps: int = field(
        default=10, metadata={"help": "With --print_input_density, log a density table every this many steps."}
    )
    memory_measure_out: Optional[str] = field(
        default=None,
        metadata={
            "help": "Used by the advisor's measuring runs: write peak memory, step times and the plan report "
            "to this JSON file, and do not save the model."
        },
    )
    # Derived: the validated memory settings, built from the flags above (and ORT's variables) in __post_init__,
    # and one line per ORTTrainer name that was translated (logged once, on rank 0, when the trainer is built).
    memory_opt: Optional[MemoryOptConfig] = field(init=False, default=None, repr=False)
    memory_opt_warnings: List[str] = field(init=False, default_factory=list, repr=False)
    memory_opt_notes: List[str] = field(init=False, default_factory=list, repr=False)

    def __post_init__(self):
        deprecated = self._use_ort_alias()
        self._check_no_backend_flags()
        self._resolve_backend()
        self._check_choices()
        self.memory_opt = self._build_memory_config()
        check_host_mb(self.memory_host_mb, self.memory_opt)
        # The chosen backend checks its own flags and what it cannot run with (before the parent's __post_init__,
        # which would start the distributed set-up); its notes are logged once, on rank 0, by the trainer.
        checked = get_backend(self.memory_opt.backend).check_args(self) if self.memory_opt_on else []
        self.memory_opt_warnings = deprecated + checked
        if _deepspeed.requested(self.deepspeed):
            _deepspeed.import_early()
        # transformers does not list the backends' optimizers: the parent validates a stand-in, and the value is put
        # back; the optimizer it stands for is decided when the optimizer is built.
        asked = getattr(self.optim, "value", self.optim)
        if asked in optimizer_names():
            self.optim = "adamw_torch"
        super().__post_init__()
        if asked in optimizer_names():
            self.optim = asked

    @property
    def memory_opt_on(self) -> bool:
        """Whether a memory backend trains (`--memory_opt_backend` is not `none`)."""
        return self.memory_opt_backend != NONE

    def _use_ort_alias(self) -> List[str]:
        """`--use_ort`, the switch's old name: `false` is `--memory_opt_backend none`, `true` the default. Said once
        (a warning the trainer logs on rank 0; `memory_opt_on` says whether a backend trains)."""
        given, notes = self.use_ort, []
        if given is not None:
            if given is False and self.memory_opt_backend not in (None, NONE):
                raise ValueError(
                    f"`--use_ort false` (the deprecated name of `{BACKEND_FLAG} none`) and `{BACKEND_FLAG} "
                    f"{self.memory_opt_backend}` say opposite things; pass one: `{BACKEND_FLAG} none` or "
                    f"`{BACKEND_FLAG} {self.memory_opt_backend}`"
                )
            if given is True and self.memory_opt_backend == NONE:
                raise ValueError(
                    f"`--use_ort true` (deprecated: a backend trains) and `{BACKEND_FLAG} none` say opposite things; "
                    f"pass `{BACKEND_FLAG} none` alone, or `{BACKEND_FLAG} torch`"
                )
            if given is False:
                self.memory_opt_backend = NONE
            notes.append(
                f"`--use_ort {str(given).lower()}` is deprecated and will be removed: "
                + (f"pass `{BACKEND_FLAG} none`" if given is False else "drop it (a backend trains by default)")
                + f"; `{BACKEND_FLAG}` (torch, ort, none) is the switch"
            )
        return notes

    def _resolve_backend(self):
        notes = []
        if self.memory_opt_backend is not None and self.memory_opt_backend not in (*NAMES, NONE):
            raise ValueError(
                f"`{BACKEND_FLAG}` is {self.memory_opt_backend!r}; expected one of "
                f"{', '.join(map(repr, (*NAMES, NONE)))}, as in `{BACKEND_FLAG} torch`"
            )
        if self.memory_opt_on and self.memory_opt_backend is None:
            from .backends import default_backend

            self.memory_opt_backend = default_backend()
            self._memopt_backend_by_default = True  # for messages: "(the default here)"
            if self.memory_opt_backend == "torch":
                notes.append(
                    f"memory optimizer: the torch backend (onnxruntime-training is not installed; `{BACKEND_FLAG} "
                    f"ort` needs it, with torch <= 2.4)"
                )
        if self.memory_opt_on:
            chosen = get_backend(self.memory_opt_backend)
            optim = getattr(self.optim, "value", self.optim)
            for other in all_backends():
                if other.name == chosen.name:
                    continue
                given = [f"--{k}" for k, default in other.flags.items() if getattr(self, k) != default]
                if optim in other.optimizers:
                    given.append(f"--optim {optim}")
                if given:
                    raise ValueError(
                        f"`{'`, `'.join(given)}` configure {other.title}, but `{BACKEND_FLAG} {chosen.name}` trains "
                        f"without it; drop them (for the optimizer: `--optim adamw_torch_fused`), or use "
                        f"`{BACKEND_FLAG} {other.name}`"
                    )
                ignored = [v for v in (other.env_plans, other.env_level) if v and os.environ.get(v)]
                if ignored:
                    notes.append(
                        f"${' and $'.join(ignored)} set in the environment: {other.title}'s variables, not read by "
                        f"{chosen.title}; give `{CONFIG_FLAG}` / `{LEVEL_FLAG}` instead"
                    )
        self.memory_opt_notes = notes

    # -- checks that need nothing but the values -------------------------------------------------------
    def _check_choices(self):
        """The constructor checks what the command line's `choices` check (the backends check their own flags);
        the budget and the probe limits are MemoryOptConfig's to check."""
        value = self.input_density_table_steps
        if type(value) is not int or value < 1:
            raise ValueError(
                f"`--input_density_table_steps` is {value!r}; expected a positive integer, as in "
                f"`--input_density_table_steps 10`"
            )

    def _check_no_backend_flags(self):
        if self.memory_opt_on:
            return
        flags = {**SHARED_FLAGS, **backend_flags()}
        given = [
            f"--{k}"
            for k, default in flags.items()
            if getattr(self, k) != default and not (k == "memory_opt_backend" and getattr(self, k) == NONE)
        ]
        if given:
            raise ValueError(
                f"`{'`, `'.join(given)}` configure a memory backend, but `{BACKEND_FLAG} none` trains in plain "
                f"PyTorch; drop `{BACKEND_FLAG} none`, or drop those flags"
            )

    def _build_memory_config(self) -> MemoryOptConfig:
        # Precedence: a flag wins; ORT's own ORTMODULE_* variables are read only when the flag is not given,
        # and only when training through ORT.
        sources = {}
        plans = self.memory_opt_config
        backend = self.memory_opt_backend if self.memory_opt_backend in NAMES else "ort"
        env_plans, env_level = (None, None)
        if self.memory_opt_on:
            chosen = get_backend(backend)
            env_plans, env_level = chosen.env_plans, chosen.env_level
        if plans is None and env_plans and os.environ.get(env_plans):
            plans, sources["plans"] = os.environ[env_plans], f"${env_plans}"
        level = self.memory_opt_level
        if level is None and env_level and os.environ.get(env_level):
            text = os.environ[env_level].strip()
            sources["level"] = f"${env_level}"
            level = int(text) if text in ("0", "1", "2") else text
        if level is None:
            level = 0
        budget_mb = self.memory_budget_mb
        if self.memory_plan_file is not None:
            plans, budget_mb = self._from_plan_file(plans, backend)
        config = MemoryOptConfig(
            plans=plans,
            level=level,
            backend=backend,
            budget_mb=budget_mb,
            activation_budget=self.activation_memory_budget,
            probe_max_plans=self.memory_probe_max_plans,
            probe_steps=self.memory_probe_steps,
            sources=sources,
        )
        in_process = (
            self.memory_opt_on and config.backend == "torch"
        )  # chosen from the run's own first step, on rank 0
        if config.auto and not in_process and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Checked before the parent's __post_init__, which would start the distributed setup.
            raise ValueError(
                f"`{CONFIG_FLAG} auto` probes the script in single-process runs, so it cannot run under a "
                f"multi-process launch; run it once on one process (or `memopt-probe --budget_mb MIB -- SCRIPT ...`) "
                f"and pass the plans it chooses, as in `{CONFIG_FLAG} {EXAMPLE}`, or choose in the training process "
                f"with `--memory_opt_backend torch`"
            )
        return config

    def _from_plan_file(self, plans: Optional[str], backend: str) -> Tuple[str, float]:
        """`--memory_plan_file`: `auto` under the file's budget; ValueError where the file cannot be read or the
        flags ask for something else (other plans, another budget, another backend)."""
        from .planning.plan_file import FLAG, PlanFileError, read

        path = self.memory_plan_file
        if backend != "torch":
            raise ValueError(
                f"`{FLAG} {path}` starts the torch backend's `auto` from memopt-plan's choice, but "
                f"`{BACKEND_FLAG} {backend}` trains; add `{BACKEND_FLAG} torch`"
            )
        if plans is not None and plans != "auto":
            raise ValueError(
                f"`{FLAG} {path}` runs `auto`'s choice from the file, and `{CONFIG_FLAG} {plans}` asks for other "
                f"plans; drop one of them (with the file, `{CONFIG_FLAG} auto` may be left out)"
            )
        if self.activation_memory_budget is not None:
            raise ValueError(
                f"`{FLAG} {path}` chose under the file's peak budget, and `--activation_memory_budget "
                f"{self.activation_memory_budget:g}` asks for another; drop `--activation_memory_budget`"
            )
        try:
            planned = read(path)
            return "auto", planned.budget(self.memory_budget_mb)
        except PlanFileError as e:
            raise ValueError(str(e)) from None

    # -- what the run was asked to do ------------------------------------------------------------------
    @property
    def memory_opt_summary(self) -> str:
        if not self.memory_opt_on:
            return "plain PyTorch (no backend)"
        return self.memory_opt.summary() + (" (torch backend)" if self.memory_opt.backend == "torch" else "")

    def to_dict(self):
        """The parent's dictionary (what TensorBoard / W&B store), `optim` as asked, and the resolved memory config."""
        d = super().to_dict()
        d["optim"] = getattr(self.optim, "value", self.optim)
        d["memory_opt"] = self.memory_opt.to_dict() if self.memory_opt_on else None
        return d


_COMBINED: dict = {}


def with_memory_flags(config_cls: type, name: Optional[str] = None) -> type:
    """`config_cls` (a `TrainingArguments` subclass with defaults of its own, such as TRL's `SFTConfig`) with the
    memory flags added, its defaults kept.

        SFTArgs = with_memory_flags(SFTConfig)
        args = HfArgumentParser(SFTArgs).parse_args_into_dataclasses()[0]

    The class subclasses both (`isinstance(args, SFTConfig)` and `isinstance(args, MemoptTrainingArguments)`), so
    both trainers accept it; one class per config class (asking again gives the same one), and its instances pickle
    (the Trainer saves them beside each checkpoint). Where `config_cls` changes a `TrainingArguments` default, the
    new class keeps its value and remembers whose it is, so a refusal can say where it came from (TRL turns
    `gradient_checkpointing` on). Writing `class Args(MemoptTrainingArguments, SFTConfig)` instead would reset
    those defaults to transformers' own.
    """
    if not (isinstance(config_cls, type) and issubclass(config_cls, TrainingArguments)):
        raise TypeError(f"with_memory_flags({config_cls!r}): expected a TrainingArguments subclass, as in SFTConfig")
    if issubclass(config_cls, MemoptTrainingArguments):
        return config_cls
    name = name or f"Memopt{config_cls.__name__}"
    if (config_cls, name) in _COMBINED:
        return _COMBINED[config_cls, name]
    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    changed = {}
    for f in dataclasses.fields(config_cls):
        if f.name in base and f.default is not dataclasses.MISSING and f.default != base[f.name].default:
            changed[f.name] = (config_cls.__name__, f.default)

    def __reduce__(self):
        return _rebuild, (config_cls, name, self.__dict__)

    optim = field(default=_default_optim(config_cls), metadata=OPTIM_METADATA)
    cls = dataclasses.make_dataclass(
        name,
        [("optim", str, optim)],
        bases=(config_cls, MemoptTrainingArguments),
        namespace={"__module__": __name__, CLASS_DEFAULTS: changed, "__reduce__": __reduce__},
    )
    cls.__doc__ = f"{config_cls.__name__} with optimum-memopt's memory flags (`with_memory_flags`)."
    _COMBINED[config_cls, name] = cls
    return cls


def _rebuild(config_cls: type, name: str, state: dict):
    """Unpickling an instance of a `with_memory_flags` class: the class made again, the instance's fields set."""
    obj = object.__new__(with_memory_flags(config_cls, name))
    obj.__dict__.update(state)
    return obj
