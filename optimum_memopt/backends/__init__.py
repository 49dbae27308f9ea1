"""Memory-optimizer backends behind one interface (`Backend`, in `base`).

The rest of the package reaches a backend only through this module: `get_backend(name)`, the flags each backend
declares (`BackendFlags`, which the arguments inherit), the `--optim` names they provide (`optimizer_names`,
`optimizer_for`). Importing it loads no backend's engine (no onnxruntime, no torch dispatch mode).
"""

from typing import Dict, List, Optional, Tuple

from .base import CLASS_DEFAULTS as CLASS_DEFAULTS
from .base import Backend, WrapSettings
from .ort_flags import OrtFlags

__all__ = ["Backend", "BackendFlags", "WrapSettings", "get_backend", "NAMES", "NONE"]

NAMES = ("ort", "torch")  # the backends, by `--memory_opt_backend` name
NONE = "none"  # `--memory_opt_backend none`: no backend, plain PyTorch (what `--memory_opt_backend none` says)


class BackendFlags(OrtFlags):
    """Every backend's own flags (today only ONNX Runtime has some), joined into `MemoptTrainingArguments`."""


def get_backend(name: str) -> Backend:
    if name == "ort":
        from .ort import OrtBackend

        return OrtBackend()
    if name == "torch":
        from .torch.backend import TorchBackend

        return TorchBackend()
    raise ValueError(f"unknown memory-optimizer backend {name!r}; expected 'ort' or 'torch'")


def all_backends() -> List[Backend]:
    return [get_backend(name) for name in NAMES]


def backend_flags() -> Dict[str, object]:
    """Every backend's own flags with their defaults."""
    return {k: v for b in all_backends() for k, v in b.flags.items()}


def optimizer_names() -> Tuple[str, ...]:
    """The `--optim` names the backends add to transformers' own."""
    return tuple(name for b in all_backends() for name in b.optimizers)


def optimizer_for(args) -> Optional[Tuple[type, dict, str]]:
    """(class, kwargs, log line) for a backend's `--optim` name, or None for the Trainer's own optimizers."""
    optim = getattr(args, "optim", None)
    for backend in all_backends():
        if optim in backend.optimizers:
            return backend.optimizer(args)
    return None


def default_backend() -> str:
    """`ort` where ONNX Runtime Training is usable, else `torch` where the torch backend can run, else `ort`
    (whose error then says what to install)."""
    from . import ort
    from .torch import torch_problem

    if ort.is_installed():
        return "ort"
    if torch_problem() is None:
        return "torch"
    return "ort"
