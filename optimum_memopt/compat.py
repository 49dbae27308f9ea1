"""Old name of `optimum_memopt.transformers_releases`, kept importable: this module *is* that one (same object), so
`from optimum_memopt.compat import ...` and attribute patches keep working."""

import sys

from . import transformers_releases

sys.modules[__name__] = transformers_releases
