"""Import DeepSpeed before training when a run uses it.

With torch 2.4, a first `import deepspeed` that happens lazily in the middle of training (transformers
and accelerate do this) runs into a circular import inside `torch._dynamo` and leaves a half-built
module; accelerate then fails with "module 'deepspeed' has no attribute 'runtime'". The arguments call
`import_early()` when `--deepspeed` (or accelerate's DeepSpeed plugin) is in use, before the Trainer's
own set-up, so user scripts need nothing special and runs without DeepSpeed never import it.
"""

import importlib.util
import os


def requested(deepspeed_arg) -> bool:
    return bool(deepspeed_arg) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")


def import_early() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        return  # the Trainer reports a missing DeepSpeed itself
    import deepspeed  # noqa: F401
