"""Memory-optimizer backends behind one interface (`Backend`, in `base`)."""

from .base import Backend, WrapSettings

__all__ = ["Backend", "WrapSettings", "get_backend"]


def get_backend(name: str) -> Backend:
    if name == "ort":
        from .ort import OrtBackend

        return OrtBackend()
    raise ValueError(f"unknown memory-optimizer backend {name!r}; expected 'ort'")
