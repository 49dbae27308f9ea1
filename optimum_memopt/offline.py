"""Old name of `optimum_memopt.offline_defaults`, kept importable: this module *is* that one (same object), so
`from optimum_memopt.offline import ...` and attribute patches keep working."""

import sys

from . import offline_defaults

sys.modules[__name__] = offline_defaults
