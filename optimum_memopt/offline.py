"""Deprecated old name of `optimum_memopt.offline_defaults`: this module *is* that one (same object), so
`from optimum_memopt.offline import ...` and attribute patches keep working; importing it warns once
(FutureWarning, shown by default) naming the new module. To be removed in a later release."""

import sys
import warnings

from . import offline_defaults

warnings.warn(
    "optimum_memopt.offline is deprecated and will be removed: import optimum_memopt.offline_defaults "
    "(the same module)",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = offline_defaults
