"""Import DeepSpeed before training when a run uses it, whole.

With torch 2.4, a first `import deepspeed` that happens while `torch._dynamo` is itself being imported
runs into a circular import. Who triggers it: transformers (lazily, during training, in 4.46) or, from
transformers 4.50, the model classes' own import (`flex_attention` imports `torch._dynamo`, whose ONNX
backend check imports onnxruntime, whose training package imports DeepSpeed). The failed import removes
`deepspeed` from `sys.modules` but leaves its submodules there, so a later `import deepspeed` builds a
package without its `runtime` attribute, and accelerate fails with "module 'deepspeed' has no attribute
'runtime'". The arguments call `import_early()` when `--deepspeed` (or accelerate's DeepSpeed plugin) is in
use, before the Trainer's own set-up: it drops such leftovers and imports DeepSpeed whole, so user scripts
need nothing special and runs without DeepSpeed never import it.
"""

import importlib.util
import json
import os
import sys
from typing import Optional, Tuple


def requested(deepspeed_arg) -> bool:
    return bool(deepspeed_arg) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")


def stage_of_config(config) -> Optional[float]:
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


def zero_stage(deepspeed_arg) -> Tuple[Optional[float], str]:
    """The ZeRO stage a run will use, whatever route its DeepSpeed config came by, and how a message names that
    route: `--deepspeed` (a JSON path or a dict), else accelerate's DeepSpeed plugin as `accelerate launch` passes
    it on (a config file's `deepspeed_config_file`, or its `zero_stage`)."""
    if deepspeed_arg:
        return stage_of_config(deepspeed_arg), "`--deepspeed`"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() not in ("1", "true", "yes"):
        return None, ""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path and path != "none":
        stage = stage_of_config(path)
        if stage is not None:
            return stage, f"accelerate's deepspeed_config_file {path!r}"
    try:
        return float(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "")), "accelerate's zero_stage"
    except ValueError:
        return None, ""


def _whole(module) -> bool:
    return module is not None and hasattr(module, "runtime") and hasattr(module, "comm")


def import_early() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        return  # the Trainer reports a missing DeepSpeed itself
    if not _whole(sys.modules.get("deepspeed")):
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
    import deepspeed  # noqa: F401
