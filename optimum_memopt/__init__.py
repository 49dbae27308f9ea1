"""optimum-memopt: bigger batches in the same memory for Hugging Face Trainer runs, through ONNX
Runtime Training's memory optimizer, with per-step memory visibility on rank 0."""

from . import _early_imports  # noqa: F401  (must run before transformers' model classes load)
from .memory_config import MemoryOptEntry, parse_memory_opt_config
from .trainer_args import MemoptTrainingArguments

__version__ = "0.1.0"

__all__ = [
    "MemoptTrainingArguments",
    "MemoptTrainer",
    "MemoptTrainerMixin",
    "MemoryOptEntry",
    "parse_memory_opt_config",
]


def __getattr__(name):
    # The trainer pulls in transformers' Trainer; load it on first use.
    if name in ("MemoptTrainer", "MemoptTrainerMixin"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
