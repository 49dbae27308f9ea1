"""The backend seam: what the trainer hook asks of a memory-optimizer backend.

A backend turns validated settings into a wrapped model that recomputes what the plans say, and
reports, after the first training step, what it found and applied (`PlanReport`). The arguments
(`optimum_memopt.trainer_args`) and the hook (`optimum_memopt.trainer`) call only the methods below, in this order:

0. `check_args(args)` while the arguments are built (before the Trainer's own set-up): the backend's own flags and
   the conflicts it cannot run with, raised as `ValueError` naming the flag; returns notes to log once;
   `before_trainer(args)` just before `Trainer.__init__`;

1. `problem()` when the trainer is built: why the backend cannot run here, with the command that
   fixes it (None when it can);
2. `check(args)` when the trainer is built: refusals that need the environment (a device, a
   precision, a launch) and that the arguments alone could not decide;
3. `prepare(model)` before wrapping (and again for each model `model_init` builds): in-place
   changes the backend needs, returned as one log line each;
4. `wrap(model, settings)` inside `Trainer._wrap_model`, before DDP / DeepSpeed wrap the result (`options(args)`
   builds the backend's part of the settings);
5. `find(model)`: the backend's module inside DDP / DeepSpeed wrappers, or None;
6. `plan_report(wrapped, settings)` after the first training step;
7. `optimizer(args)` when the optimizer is built: a backend-specific optimizer for `args.optim`, or None;
8. `on_optimizer_ready(optimizer, args, deepspeed)` once the optimizer exists: backend-specific changes
   to it, returned as one honest log line (or None);
9. `step_done(wrapped)` after each optimizer step.

`--memory_opt_config auto`: a backend with `plans_in_process` gets the budget in `WrapSettings.budget` and chooses
its plans from the run's own first step (it starts with the policy that needs the least memory); the others get the
plans the advisor chose in fresh runs of the script (`optimum_memopt.advisor`), as `entries` / `level`.

A new backend is one module implementing this class, registered in `optimum_memopt.backends`; its own flags
(if any) are a dataclass joined into `optimum_memopt.backends.BackendFlags`.
"""

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from ..plans import PlanEntry, PlanReport

CLASS_DEFAULTS = "_memopt_class_defaults"  # on an arguments class from `with_memory_flags`: {field: config class}


def checkpointing_asked(args) -> Optional[Tuple[str, str]]:
    """How transformers' own activation checkpointing is on for this run, or None: (the field, in words). Read before
    `TrainingArguments.__post_init__` joins `gradient_checkpointing` (the deprecated 4.x name) to
    `activation_checkpointing` (5.x); a default of the config class the flags were added to (TRL's `SFTConfig` turns
    it on) is named as such, not as a flag the user passed."""
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        if getattr(args, name, None):
            owner = getattr(type(args), CLASS_DEFAULTS, {}).get(name)
            if owner is not None and getattr(args, name) == owner[1]:
                return name, f"`{name}=True` ({owner[0]}'s default, unless you passed it)"
            return name, f"`--{name}`"
    return None


@dataclass
class Budget:
    """`--memory_opt_config auto` chosen in the training process (a backend with `plans_in_process`)."""

    budget_mb: Optional[float]  # the peak to fit under, or None with `share`
    share: Optional[float] = (
        None  # instead: the share of the layers' activations to keep (`--activation_memory_budget`)
    )
    say: Callable[[str], None] = print  # the choice and its check, a line each (rank 0; a no-op elsewhere)
    detail: Callable[[str], None] = lambda text: None  # the figures behind a choice in words (`PlanLog.detail`)
    # a stop's message (the RuntimeError `auto` raises) in the caller's words: `optimize_memory`'s keywords where the
    # text names the Trainer's flags (`api._as_keywords`); as written where None
    words: Optional[Callable[[str], str]] = None
    report_dir: Optional[str] = None  # where the solver's figures go (rank 0)
    grad_bytes: int = 0  # gradients held across micro-batches (gradient accumulation), 0 without
    grad_accum: int = 1  # micro-batches a step (`--gradient_accumulation_steps`), for a dry run of the step
    autocast: Optional[str] = None  # "bfloat16" / "float16" under `--bf16` / `--fp16`, for a dry run of the step
    dry_run: bool = False  # choose before step one from a dry run of it (the Trainer's `--memory_auto_dry_run`)
    no_dry_run: Optional[str] = None  # why no dry run of the run's own step can be made (FSDP, DeepSpeed), said
    # the processes DistributedDataParallel replicates the model over (1: none), for a dry run of the step: each holds
    # DDP's gradient buckets
    ddp: int = 1
    # `--memory_plan_file`, read and checked against the run (`planning.plan_file.PlanFile`): step one runs its choice
    # instead of a dry run's
    plan_file: Optional[object] = None
    # with `dry_run`: what the backend's dry run of the step is handed from above (the torch backend's
    # `fake_step.Instruments`: how the backend is put on a model, the device its ops are timed on)
    instruments: Optional[object] = None
    # with `dry_run`: where the dry run's choice is kept as a file `--memory_plan_file` takes, so that the next run of
    # the same step starts without one; called on rank 0 with the choice and the step's batch, returns the path
    # (`planning.plan_file.keeper`); None: not kept
    keep_plan: Optional[Callable[..., Optional[str]]] = None
    # the host memory an offload's copies may hold, in MiB (`--memory_host_mb`); None: what the host has available
    # when step one ends (`/proc/meminfo`'s MemAvailable)
    host_mb: Optional[float] = None


@dataclass
class WrapSettings:
    """Everything a backend needs to wrap a model, already validated."""

    entries: Sequence[PlanEntry] = ()
    level: int = 0
    measure_memory: bool = False  # memory is being measured: allocations must be visible to the meter
    options: dict = field(default_factory=dict)  # backend-specific, validated by the arguments
    budget: Optional[Budget] = None  # choose the plans from the run's first step (`plans_in_process`)
    reset_peaks: bool = True  # False: CUDA's peak counter is the Trainer's (`--skip_memory_metrics false`)
    label_smoothing: float = 0.0  # the Trainer's `label_smoothing_factor` (a loss computed in the forward applies it)
    loss_reader: Optional[str] = None  # what computes the loss from the logits outside the model (`compute_loss_func`)
    # the trainer says where each optimizer step ends (`Backend.step_done`: the Trainer hook, a loop passing
    # `reports_steps=True`); False: a loop of one's own that does not, where each backward ends a step
    steps_reported: bool = True
    # the loop lets go of the model's outputs before its backward (the Trainer's own `training_step` and
    # `compute_loss`): a model's own head's logits are not held through the step; False: a loop that may keep them
    outputs_dropped: bool = False


class Backend:
    name = "base"
    title = "the base backend"  # how messages name what the backend runs
    flags: Dict[str, object] = {}  # the backend's own flags with their defaults (refused with another backend)
    optimizers: Tuple[str, ...] = ()  # `--optim` names the backend provides (`optimizer(args)` builds them)
    plans_in_process = False  # `auto` chosen from the run's own first step (`WrapSettings.budget`), not fresh runs
    env_plans: Optional[str] = None  # environment variables read when `--memory_opt_config` / `_level` are absent
    env_level: Optional[str] = None

    needs = "its libraries"  # what the backend needs to run, as its refusal names it

    def problem(self) -> Optional[str]:
        raise NotImplementedError

    def refusal(self, by_default: bool = False) -> Optional[str]:
        """Why a run cannot train through this backend here, whole (the flag, what it needs, the fix, the way out),
        or None where it can; `by_default`: the backend was not asked for by name."""
        problem = self.problem()
        if problem is None:
            return None
        how = " (the default here)" if by_default else ""
        return (
            f"`--memory_opt_backend {self.name}`{how} needs {self.needs}: {problem}. Or pass `--memory_opt_backend "
            f"none` to train in plain PyTorch"
        )

    def check_args(self, args) -> List[str]:
        return []

    def options(self, args) -> dict:
        return {}

    def before_trainer(self, args) -> None:
        pass

    def check(self, args) -> None:
        pass

    def prepare(self, model: nn.Module) -> List[str]:
        return []

    def wrap(self, model: nn.Module, settings: WrapSettings) -> nn.Module:
        raise NotImplementedError

    def unwrap(self, wrapped: nn.Module) -> nn.Module:
        """The model `wrap` was given, trained plainly again from the next forward on."""
        raise NotImplementedError(f"{self.title} cannot be taken off a model it wrapped; build the model again")

    def find(self, model) -> Optional[nn.Module]:
        raise NotImplementedError

    def describe(self, wrapped: nn.Module) -> str:
        """How the log names what the model trains through."""
        return type(wrapped).__name__

    def plan_report(self, wrapped: nn.Module, settings: WrapSettings) -> Optional[PlanReport]:
        raise NotImplementedError

    def optimizer(self, args) -> Optional[Tuple[type, dict, str]]:
        """(optimizer class, its keyword arguments, a log line) for ``args.optim``, or None for the Trainer's own."""
        return None

    def on_optimizer_ready(self, optimizer, args, deepspeed: bool) -> Optional[str]:
        return None

    def auto_choice(self, wrapped: nn.Module) -> Optional[dict]:
        """What `auto` chose in this process (`plans_in_process`): its plans in the grammar ("config"), the predicted
        and measured peaks (MiB) and the recompute per step (ms); None where nothing was chosen here."""
        return None

    def auto_settled(self, wrapped: nn.Module) -> bool:
        """Whether `auto`'s choice is settled in this process: no later step is measured, checked or reported on by
        it (True where nothing is chosen here)."""
        return True

    def smooths_labels(self, wrapped: nn.Module) -> bool:
        """Whether the wrapped model's training forward computes the loss with the Trainer's label smoothing itself
        (the Trainer then hands it the labels instead of smoothing the logits, which it no longer returns)."""
        return False

    def step_done(self, wrapped: nn.Module) -> None:
        """After each optimizer step (the next training forward starts a new step)."""
