"""Deprecated old name of `optimum_memopt.transformers_releases` (the same module); importing it warns once.
To be removed in a later release."""

from . import _deprecated_name, transformers_releases

_deprecated_name(__name__, transformers_releases)
