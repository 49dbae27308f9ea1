"""What the plugin's callbacks share: a buffer of numeric metrics that `MemoptTrainerMixin.log`
merges into the trainer's logs, so every reporter (TensorBoard, W&B, JSON log history) sees them."""

import logging
import os
from typing import Dict

from transformers import TrainerCallback

logger = logging.getLogger("optimum_memopt")


class MetricsCallback(TrainerCallback):
    def __init__(self):
        self._pending: Dict[str, float] = {}

    def pop_metrics(self) -> Dict[str, float]:
        out, self._pending = self._pending, {}
        return out

    @staticmethod
    def output_path(args, name: str) -> str:
        os.makedirs(args.output_dir, exist_ok=True)
        return os.path.join(args.output_dir, name)


def unwrap_to_hookable(model):
    """The module whose forward runs once per training micro-batch: the ORTModule or the plain model,
    inside any DDP / DeepSpeed wrapper (their forward calls it)."""
    for _ in range(8):
        inner = getattr(model, "module", None)
        if inner is None or type(model).__name__ == "ORTModule":
            return model
        model = inner
    return model


def ensure_visible_logging() -> None:
    """Show the plugin's INFO lines (plan table, density table) when the script set up no logging.

    Only the package logger gets a handler; ORT's and transformers' verbosity are left alone, and
    the callbacks only log on rank 0.
    """
    import sys

    if logger.handlers or logging.getLogger().handlers:
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[memopt] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
