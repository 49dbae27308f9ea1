"""Deprecated old name of `optimum_memopt.offline_defaults` (the same module); importing it warns once.
To be removed in a later release."""

from . import _deprecated_name, offline_defaults

_deprecated_name(__name__, offline_defaults)
