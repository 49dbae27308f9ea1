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
    "with_memory_flags",
]

_LAZY = {
    "MemoptTrainingArguments": "trainer_args",
    "MemoptTrainer": "trainer",
    "MemoptTrainerMixin": "trainer",
    "MemoryOptConfig": "config",
    "MemoptHandle": "api",
    "optimize_memory": "api",
    "PlanEntry": "plans",
    "PlanReport": "plans",
    "parse_plans": "plans",
    "with_memory_flags": "trainer_args",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
