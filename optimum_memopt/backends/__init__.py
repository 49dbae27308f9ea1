"""Memory-optimizer backends behind one interface (`Backend`, in `base`)."""

from .base import Backend, WrapSettings

__all__ = ["Backend", "WrapSettings", "get_backend"]


def get_backend(name: str) -> Backend:
    if name == "ort":
        from .ort import OrtBackend

        return OrtBackend()
    if name == "torch":
        from .torch_recompute import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown memory-optimizer backend {name!r}; expected 'ort' or 'torch'")


def default_backend() -> str:
    """`ort` where ONNX Runtime Training is usable, else `torch` where the torch backend can run, else `ort`
    (whose error then says what to install)."""
    from . import ort, torch_recompute

    if ort.is_installed():
        return "ort"
    if torch_recompute.torch_problem() is None:
        return "torch"
    return "ort"
