"""Old name of `optimum_memopt.eager_attention`, kept importable: this module *is* that one (same object), so
`from optimum_memopt.model_compat import ...` and attribute patches keep working."""

import sys

from . import eager_attention

sys.modules[__name__] = eager_attention
