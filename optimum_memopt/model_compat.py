"""Deprecated old name of `optimum_memopt.eager_attention` (the same module); importing it warns once.
To be removed in a later release."""

from . import _deprecated_name, eager_attention

_deprecated_name(__name__, eager_attention)
