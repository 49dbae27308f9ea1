"""Import DeepSpeed early, when it is installed.

With torch 2.4, a first `import deepspeed` that happens lazily in the middle of training (transformers
and accelerate do this) runs into a circular import inside `torch._dynamo` and leaves a half-built
module; accelerate then fails with "module 'deepspeed' has no attribute 'runtime'". Importing it
here, when the user imports this package, avoids that, so user scripts need nothing special.
"""

import importlib.util
import os

if importlib.util.find_spec("deepspeed") is not None and os.environ.get("MEMOPT_SKIP_DEEPSPEED_IMPORT") != "1":
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # a broken DeepSpeed must not break the CPU path without it
        import logging

        logging.getLogger("optimum_memopt").warning("DeepSpeed is installed but failed to import: %s", e)
