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
import os
import sys


def requested(deepspeed_arg) -> bool:
    return bool(deepspeed_arg) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true", "yes")


def _whole(module) -> bool:
    return module is not None and hasattr(module, "runtime") and hasattr(module, "comm")


def import_early() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        return  # the Trainer reports a missing DeepSpeed itself
    if not _whole(sys.modules.get("deepspeed")):
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]
    import deepspeed  # noqa: F401
