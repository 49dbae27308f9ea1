"""optimum-memopt: bigger batches in the same memory for Hugging Face Trainer runs and loops of one's own
(`optimize_memory`), by recomputing chosen activations instead of keeping them, with per-step memory visibility on
rank 0.

Importing the package is light: transformers' Trainer, onnxruntime and DeepSpeed load on first use.
"""

__version__ = "0.2.0"

__all__ = [
    "MemoptTrainingArguments",
    "MemoptTrainer",
    "MemoptTrainerMixin",
    "MemoryOptConfig",
    "MemoptHandle",
    "PlanEntry",
    "PlanReport",
    "optimize_memory",
    "parse_plans",
    "plan",
    "with_memory_flags",
]

from . import plans as _plans  # noqa: E402 - the plan grammar, light: no backend, no torch

# the levers' plan words, read by the grammar from the torch backend's registry (imported at the first lever looked up)
_plans.register_levers("optimum_memopt.backends.torch.levers")

_LAZY = {
    "MemoptTrainingArguments": "trainer_args",
    "MemoptTrainer": "trainer",
    "MemoptTrainerMixin": "trainer",
    "MemoryOptConfig": "config",
    "MemoptHandle": "api",
    "optimize_memory": "api",
    "plan": "planning.plan",
    "PlanEntry": "plans",
    "PlanReport": "plans",
    "parse_plans": "plans",
    "with_memory_flags": "trainer_args",
}


def _deprecated_name(old: str, module) -> None:
    """Make the module named `old` be `module` itself (same object: imports and attribute patches keep working),
    warning once, as it is first imported (FutureWarning, shown by default), which module to import instead."""
    import sys
    import warnings

    said = f"{old} is deprecated and will be removed: import {module.__name__} (the same module)"
    warnings.warn(said, FutureWarning, stacklevel=3)
    sys.modules[old] = module


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
