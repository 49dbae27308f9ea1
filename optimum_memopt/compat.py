"""Deprecated old name of `optimum_memopt.transformers_releases`: this module *is* that one (same object), so
`from optimum_memopt.compat import ...` and attribute patches keep working; importing it warns once
(FutureWarning, shown by default) naming the new module. To be removed in a later release."""

import sys
import warnings

from . import transformers_releases

warnings.warn(
    "optimum_memopt.compat is deprecated and will be removed: import optimum_memopt.transformers_releases "
    "(the same module)",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = transformers_releases
