"""Deprecated old name of `optimum_memopt.eager_attention`: this module *is* that one (same object), so
`from optimum_memopt.model_compat import ...` and attribute patches keep working; importing it warns once
(FutureWarning, shown by default) naming the new module. To be removed in a later release."""

import sys
import warnings

from . import eager_attention

warnings.warn(
    "optimum_memopt.model_compat is deprecated and will be removed: import optimum_memopt.eager_attention "
    "(the same module)",
    FutureWarning,
    stacklevel=2,
)
sys.modules[__name__] = eager_attention
