"""Everything that touches ONNX Runtime Training: is it installed and built, how options reach
ORTModule, how a model is wrapped, and where ORTModule keeps the data we report.

When an upstream detail changes (a private attribute path, an environment variable), this is
the one file to change.
"""

import atexit
import contextlib
import glob
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from .memory_config import MemoryOptEntry, write_json_file

logger = logging.getLogger(__name__)

LOG_LEVELS = ("WARNING", "INFO", "DEVINFO", "VERBOSE")
FALLBACK_POLICIES = ("disable", "default")

INSTALL_HINT = (
    "pip install 'optimum-memopt[cpu]' (CPU build: onnxruntime-training-cpu==1.19.2) or "
    "pip install 'optimum-memopt[gpu]' (CUDA 11.8 build: onnxruntime-training==1.19.2); never both"
)
BUILD_COMMAND = f"{sys.executable} -m onnxruntime.training.ortmodule.torch_cpp_extensions.install"


def _onnxruntime_dir() -> Optional[str]:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def is_ort_training_installed() -> bool:
    """True when an onnxruntime build with the training frontend is installed (no heavy import)."""
    root = _onnxruntime_dir()
    return root is not None and os.path.isdir(os.path.join(root, "training", "ortmodule"))


def ort_extensions_dir() -> Optional[str]:
    root = _onnxruntime_dir()
    return None if root is None else os.path.join(root, "training", "ortmodule", "torch_cpp_extensions")


def ort_extensions_built() -> bool:
    """True when ORTModule's torch C++ extensions were compiled (ORTModule refuses to start otherwise)."""
    ext_dir = ort_extensions_dir()
    return bool(ext_dir) and bool(glob.glob(os.path.join(ext_dir, "*.so")) or glob.glob(os.path.join(ext_dir, "*.pyd")))


def ort_problem() -> Optional[str]:
    """Why ORTModule cannot be used here, with the command that fixes it; None when it can."""
    if not is_ort_training_installed():
        return f"onnxruntime-training is not installed; install it with: {INSTALL_HINT}"
    if not ort_extensions_built():
        return f"ORTModule's C++ extensions are not built; build them once with: {BUILD_COMMAND}"
    return None


def cuda_available() -> bool:
    return torch.cuda.is_available()


@dataclass
class OrtSettings:
    """What the user asked of ORTModule, already validated by the arguments."""

    entries: Sequence[MemoryOptEntry] = ()
    level: int = 0
    log_level: str = "WARNING"
    fallback_policy: str = "disable"
    save_onnx_dir: Optional[str] = None
    cache_dir: Optional[str] = None
    onnx_prefix: str = "memopt"
    extra_env: Dict[str, str] = field(default_factory=dict)


class _ConfigFiles:
    """The JSON files handed to ORT: one private directory per process, removed at exit.

    ORT reads the file when it builds the training session (first step, and again on any
    re-export), so it must live as long as the process may train.
    """

    def __init__(self):
        self._dir: Optional[str] = None

    def write(self, entries: Sequence[MemoryOptEntry]) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix=f"memopt-{os.getpid()}-")
            atexit.register(self.cleanup)
        path = os.path.join(self._dir, f"memory_opt_config_{len(os.listdir(self._dir))}.json")
        return write_json_file(entries, path)

    def cleanup(self):
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


CONFIG_FILES = _ConfigFiles()


@contextlib.contextmanager
def _scoped_env(values: Dict[str, Optional[str]]) -> Iterator[None]:
    """Set environment variables for the duration of ORTModule's construction only.

    ORTModule reads its ORTMODULE_* variables once, when it is built; the user's environment is
    left as it was afterwards. The values here already took the user's variables into account
    (the arguments read them as a fallback), so they replace them while ORTModule is built.
    """
    saved = {}
    try:
        for key, value in values.items():
            if value is None:
                continue
            saved[key] = os.environ.get(key)
            os.environ[key] = value
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def wrap_model(model: torch.nn.Module, settings: OrtSettings) -> torch.nn.Module:
    """Wrap ``model`` in ORTModule configured from ``settings``."""
    problem = ort_problem()
    if problem:
        raise RuntimeError(problem)
    from onnxruntime.training import ortmodule
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule
    from onnxruntime.training.ortmodule._fallback import _FallbackPolicy

    env: Dict[str, Optional[str]] = {}
    enabled = [e for e in settings.entries if e.enabled]
    # Both are always set, so a stale value in the user's environment cannot reach ORT's C++ parser.
    env["ORTMODULE_MEMORY_OPT_LEVEL"] = str(settings.level)
    env["ORTMODULE_MEMORY_OPT_CONFIG"] = CONFIG_FILES.write(enabled) if enabled and settings.level == 0 else ""
    if settings.cache_dir:
        os.makedirs(settings.cache_dir, exist_ok=True)
        env["ORTMODULE_CACHE_DIR"] = settings.cache_dir
    env.update(settings.extra_env)

    save_onnx = bool(settings.save_onnx_dir)
    if save_onnx:
        os.makedirs(settings.save_onnx_dir, exist_ok=True)
    debug = DebugOptions(
        log_level=LogLevel[settings.log_level],
        save_onnx=save_onnx,
        onnx_prefix=settings.onnx_prefix if save_onnx else "",
        save_path=settings.save_onnx_dir or "",
    )
    old_policy = ortmodule.ORTMODULE_FALLBACK_POLICY
    if settings.fallback_policy == "disable":
        # Silent fallback to PyTorch would train without the requested plans while our
        # reports claimed them; fail loudly instead.
        ortmodule.ORTMODULE_FALLBACK_POLICY = _FallbackPolicy.FALLBACK_DISABLE
        env["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
    try:
        with _scoped_env(env):
            wrapped = ORTModule(model, debug)
    finally:
        ortmodule.ORTMODULE_FALLBACK_POLICY = old_policy
    return wrapped


def is_ort_module(model) -> bool:
    if not is_ort_training_installed() or "onnxruntime.training.ortmodule" not in sys.modules:
        return False
    from onnxruntime.training.ortmodule import ORTModule

    return isinstance(model, ORTModule)


def find_ort_module(model) -> Optional[torch.nn.Module]:
    """The ORTModule inside DDP / DeepSpeed wrappers, or None."""
    seen = 0
    while model is not None and seen < 8:
        if is_ort_module(model):
            return model
        model = getattr(model, "module", None)
        seen += 1
    return None


def _training_manager(ort_model):
    return ort_model._torch_module._execution_manager(True)


@dataclass
class PlanStat:
    """One recompute opportunity ORT found, as ORT's runtime inspector holds it."""

    config: str
    enabled: bool
    frequency: int
    saving_bytes: Optional[float]
    saving_symbolic: str
    subgraphs: List[str]

    def as_dict(self):
        return {
            "config": self.config,
            "enabled": self.enabled,
            "frequency": self.frequency,
            "saving_bytes": self.saving_bytes,
            "saving_symbolic": self.saving_symbolic,
            "subgraphs": self.subgraphs,
        }


def _strip_count(plan: str) -> str:
    parts = plan.split(":")
    return ":".join(parts[:2])


def read_plan_stats(ort_model) -> Optional[dict]:
    """Plans ORT found for the training graph, read from its structured data.

    Returns None before the first training step (ORT builds the graph lazily).
    """
    import json

    manager = _training_manager(ort_model)
    observer = manager._runtime_inspector.memory_ob
    options = manager._runtime_options
    if manager._execution_agent is None:
        return None
    applied_path = options.memory_optimizer_config_file_path or ""
    applied: List[str] = []
    if applied_path and os.path.exists(applied_path):
        with open(applied_path, encoding="utf-8") as f:
            for item in json.load(f):
                applied.extend(p for p in item.split(",") if p and not p.endswith(":0"))
    applied_keys = {_strip_count(p) for p in applied}
    plans = []
    for cluster_id, summary in observer.cluster_id_combination_to_saving_symbolics_map.items():
        subgraphs = [p for p in cluster_id.split(",") if p]
        keys = [_strip_count(p) for p in subgraphs if not p.endswith(":0")]
        saving = summary.evaluated_saving
        plans.append(
            PlanStat(
                config=cluster_id,
                enabled=bool(keys) and all(k in applied_keys for k in keys),
                frequency=int(summary.freq),
                saving_bytes=float(saving) if isinstance(saving, (int, float)) else None,
                saving_symbolic=str(summary.simplified_symbolic_saving_expr),
                subgraphs=subgraphs,
            )
        )
    dims = {str(k): int(v) for k, v in observer.symbolic_dim_name_to_value_map.items()}
    return {
        "memory_optimizer_enabled": bool(options.memory_optimizer_is_enabled()),
        "level": int(options.memory_optimization_level),
        "probe_config": options.recompute_probe_config,
        "applied_config": applied,
        "symbolic_dims_first_batch": dims,
        "plans": [p.as_dict() for p in plans],
    }

