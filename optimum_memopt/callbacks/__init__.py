"""The plugin's callbacks, one per module; each works alone and only acts on rank 0."""

from .input_density import InputDensityCallback
from .memory_phases import MemoryPhaseCallback
from .plan_stats import PlanStatsCallback
from .step_memory import StepMemoryCallback

__all__ = [
    "InputDensityCallback",
    "MemoryPhaseCallback",
    "PlanStatsCallback",
    "StepMemoryCallback",
    "default_callbacks",
]


def default_callbacks(args, trainer=None):
    """The callbacks `MemoptTrainingArguments` asks for."""
    callbacks = []
    if getattr(args, "memory_opt_on", False) and getattr(args, "log_memory_plans", False):
        callbacks.append(PlanStatsCallback(trainer))
    if getattr(args, "print_input_density", False):
        callbacks.append(InputDensityCallback(args.input_density_table_steps, trainer))
    if getattr(args, "print_memory_stats", False):
        callbacks.append(MemoryPhaseCallback(trainer))
    config = getattr(args, "memory_opt", None)
    if getattr(args, "memory_opt_on", False) and config is not None and config.auto and config.backend == "torch":
        callbacks.append(StepMemoryCallback(trainer))  # auto chosen in the training process: its picture
    return callbacks
