"""The ONNX Runtime Training backend: ORTModule and its memory optimizer.

The only module of the package that imports `onnxruntime` (ORTModule, FusedAdam, FP16_Optimizer),
always inside functions, so importing it costs nothing where ORT is not installed. When an upstream
detail changes (a private attribute path, an environment variable), this is the one file to change.

How plans reach ORT: ORT 1.19 reads `ORTMODULE_MEMORY_OPT_CONFIG` as the path of a JSON file holding
a list of plan strings, when it builds the training session (first step, and again on any re-export).
Each process writes its file into its own directory under `<tmp>/optimum-memopt/`, removed at exit and
on SIGTERM; directories left by processes that no longer exist are swept when a new one is made. The
`ORTMODULE_*` variables are set only while ORTModule is constructed, then restored.

How plans come back: `plan_report` builds a `PlanReport` in memory from the settings it was given and
ORTModule's runtime inspector (structured data, not log text).
"""

import atexit
import contextlib
import glob
import importlib.util
import io
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _deepspeed
from .. import plans as grammar
from ..eager_attention import use_eager_attention
from ..plans import FoundPlan, PlanReport
from . import ort_flags
from .base import Backend, WrapSettings, checkpointing_asked
from .ort_flags import ENV_CONFIG, ENV_LEVEL, FALLBACK_POLICIES, LOG_LEVELS, ORT_FUSED  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "pip install 'optimum-memopt[cpu]' (CPU build: onnxruntime-training-cpu==1.19.2) or "
    "pip install 'optimum-memopt[gpu]' (CUDA 11.8 build: onnxruntime-training==1.19.2); never both"
)


def build_command() -> str:
    return f"{sys.executable} -m onnxruntime.training.ortmodule.torch_cpp_extensions.install"


def _onnxruntime_dir() -> Optional[str]:
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def is_installed() -> bool:
    """True when an onnxruntime build with the training frontend is installed (no heavy import)."""
    root = _onnxruntime_dir()
    return root is not None and os.path.isdir(os.path.join(root, "training", "ortmodule"))


def extensions_built() -> bool:
    """True when ORTModule's torch C++ extensions were compiled (ORTModule refuses to start otherwise)."""
    root = _onnxruntime_dir()
    if root is None:
        return False
    ext_dir = os.path.join(root, "training", "ortmodule", "torch_cpp_extensions")
    return bool(glob.glob(os.path.join(ext_dir, "*.so")) or glob.glob(os.path.join(ext_dir, "*.pyd")))


def problem() -> Optional[str]:
    """Why ORTModule cannot be used here, with the command that fixes it; None when it can."""
    if not is_installed():
        return f"onnxruntime-training is not installed; install it with: {INSTALL_HINT}"
    if not extensions_built():
        return f"ORTModule's C++ extensions are not built; build them once with: {build_command()}"
    return None


# -- the JSON files ORT reads ----------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ConfigFiles:
    """One private directory per process under ``<root>``; removed at exit and on SIGTERM, stale ones swept."""

    def __init__(self, root: Optional[str] = None):
        self.root = root or os.path.join(tempfile.gettempdir(), "optimum-memopt")
        self.dir: Optional[str] = None
        self._count = 0

    def sweep(self) -> List[str]:
        """Remove the directories of processes that no longer run (killed runs leave theirs)."""
        removed = []
        for path in glob.glob(os.path.join(self.root, "*-*")):
            pid = os.path.basename(path).split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def write(self, entries) -> str:
        if self.dir is None:
            os.makedirs(self.root, exist_ok=True)
            self.sweep()
            self.dir = tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=self.root)
            atexit.register(self.cleanup)
            _cleanup_on_sigterm(self.cleanup)
        path = os.path.join(self.dir, f"memory_opt_config_{self._count}.json")
        self._count += 1
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(grammar.to_json_list(entries), f)
        os.replace(tmp, path)
        return path

    def cleanup(self):
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _cleanup_on_sigterm(cleanup) -> None:
    """Run ``cleanup`` on SIGTERM, then let the signal do what it did before (default: end the process).

    Installed only from the main thread; a handler the program set itself is called after ``cleanup``.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_memopt_cleanup", False):
        return

    def handler(signum, frame):
        cleanup()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        else:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    handler._memopt_cleanup = True
    signal.signal(signal.SIGTERM, handler)


CONFIG_FILES = ConfigFiles()


# -- ORT's log ------------------------------------------------------------------------------------
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines ORT logs at WARNING that are no warning to a user of this plugin: its attribute-name notices (it
# wraps a Hugging Face model whose `to`, `float`... it forwards), the export's captured output (tracer
# warnings, its own failed import of DeepSpeed's ZeRO-3 helpers) and its start-up banner. Shown at
# `--ort_log_level INFO` and below.
_QUIET_AT_WARNING = (
    "collides with ORTModule's attribute name",
    "Filtered logs (",
    "] Full logs:",
    "is accelerating your model",
)


class _OrtLogFilter(logging.Filter):
    def __init__(self):
        super().__init__("memopt-ort")
        self.quiet = True

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if self.quiet and any(q in msg for q in _QUIET_AT_WARNING):
            return False
        if "\x1b[" in msg:  # no colour codes in log files
            record.msg, record.args = _ANSI.sub("", msg), ()
        return True


_ORT_LOG_FILTER = _OrtLogFilter()


def _filter_ort_log(log_level: str) -> None:
    _ORT_LOG_FILTER.quiet = log_level in ("WARNING", "ERROR", "FATAL")
    names = ["orttraining"]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        names.append(f"orttraining.rank-{torch.distributed.get_rank()}")
    for name in names:
        ort_logger = logging.getLogger(name)
        if _ORT_LOG_FILTER not in ort_logger.filters:
            ort_logger.addFilter(_ORT_LOG_FILTER)


def import_quietly(log_level: str = "WARNING"):
    """Import ORTModule (torch._dynamo imports it too, inside `Trainer.__init__`, when it is installed).

    At the default log level, what the import prints that is no warning to this run is
    held back: DeepSpeed's accelerator banner (ORT imports DeepSpeed when it is installed, used or not),
    ORT's failed import of DeepSpeed's renamed ZeRO-3 helper, and torch's note that no CUDA runtime exists
    on a CPU machine. Anything else it prints is passed on."""
    if "onnxruntime.training.ortmodule" in sys.modules or log_level not in ("WARNING", "ERROR", "FATAL"):
        import onnxruntime.training.ortmodule as ortmodule

        return ortmodule
    held = io.StringIO()
    previous_disable = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(held), contextlib.redirect_stdout(held):
            warnings.filterwarnings("ignore", message="DeepSpeed import error")
            import onnxruntime.training.ortmodule as ortmodule
    finally:
        logging.disable(previous_disable)
    rest = [line for line in held.getvalue().splitlines() if line.strip() and "No CUDA runtime is found" not in line]
    if rest:
        print("\n".join(rest), file=sys.stderr)
    return ortmodule


# -- the backend -----------------------------------------------------------------------------------
def _training_manager(ort_model):
    return ort_model._torch_module._execution_manager(True)


def _without_cpu_arena(manager) -> None:
    """Make ORT's CPU allocations go through the C allocator, where the memory meter sees them.

    ORT's CPU arena keeps freed blocks, so allocator-level readings would stay flat. The session is
    built at the first step, from `_get_session_config`, which is wrapped here for this one manager.
    """
    original = manager._get_session_config

    def session_config():
        session_options, providers, provider_options = original()
        session_options.enable_cpu_mem_arena = False
        return session_options, providers, provider_options

    manager._get_session_config = session_config


class OrtBackend(Backend):
    name = "ort"
    title = "ONNX Runtime"
    needs = "ONNX Runtime Training"
    flags = ort_flags.FLAGS
    optimizers = (ORT_FUSED,)
    env_plans, env_level = ENV_CONFIG, ENV_LEVEL

    def problem(self) -> Optional[str]:
        return problem()

    def check_args(self, args) -> List[str]:
        notes = ort_flags.translate_optimum_names(args)
        ort_flags.check_choices(args)
        stage, via = _deepspeed.zero_stage(args.deepspeed)
        if stage == 3:
            # Checked before the Trainer's own set-up, which would start DeepSpeed's distributed setup.
            raise ValueError(
                f"{via} selects ZeRO stage 3, which ORTModule cannot run with the pinned stack: ORT 1.19's stage-3 "
                f"support imports `_apply_to_tensors_only` from deepspeed.runtime.zero.parameter_offload, which "
                f"DeepSpeed 0.15 renamed (ImportError). Use ZeRO stage 1 or 2 (examples/configs/ds_zero2.json), or "
                f"`--memory_opt_backend none`"
            )
        asked = checkpointing_asked(args)
        if asked:
            name, what = asked
            raise ValueError(
                f"{what} uses torch.utils.checkpoint, which ORTModule cannot export; use ORT's recompute instead, "
                f"as in `--memory_opt_level 1 --{name} false`, or pass `--memory_opt_backend none`"
            )
        if args.torch_compile:
            raise ValueError(
                "`--torch_compile` with ORTModule: dynamo traces ORT's own export (75-105 s before the first step on "
                "the small recipe model) and speeds nothing up, since ORT runs the graph; drop `--torch_compile`, or "
                "pass `--memory_opt_backend none`"
            )
        return notes

    def options(self, args) -> dict:
        return {
            "log_level": args.ort_log_level,
            "fallback_policy": args.ort_fallback_policy,
            "save_onnx_dir": args.ort_save_onnx_dir,
            "cache_dir": args.ort_cache_dir,
            "onnx_prefix": args.onnx_prefix,
        }

    def before_trainer(self, args) -> None:
        if not _deepspeed.requested(args.deepspeed) and is_installed():
            # torch._dynamo imports onnxruntime inside Trainer.__init__, and ORT imports DeepSpeed where it is
            # installed; imported first here, without the banners of a DeepSpeed this run does not use.
            import_quietly(args.ort_log_level)

    def check(self, args) -> None:
        if args.fp16 and args.device.type == "cpu":
            raise ValueError(
                "`--fp16` with ORTModule on CPU: on CPU the Trainer turns on no fp16 autocast, so the run would train "
                "in fp32 while saying --fp16; drop `--fp16` on CPU, or train on a CUDA device"
            )
        if args.bf16 and args.device.type == "cpu":
            raise ValueError(
                "`--bf16` with ORTModule on CPU: the Trainer's CPU autocast exports bf16 MatMuls, for which ORT's CPU "
                "execution provider has no kernel (NOT_IMPLEMENTED when the first step builds the session); drop "
                "`--bf16` on CPU, train on a CUDA device, or pass `--memory_opt_backend none`"
            )
        if args.n_gpu > 1:
            raise ValueError(
                "ORTModule cannot run under torch.nn.DataParallel (several GPUs in one process); launch one "
                "process per GPU with `accelerate launch` or `torchrun`"
            )

    def prepare(self, model: nn.Module) -> List[str]:
        if use_eager_attention(model):
            return [
                f"Switched {type(model).__name__} from SDPA to eager attention: ONNX Runtime Training 1.19 "
                f"cannot build the gradient of the SDPA graph. Load the model with attn_implementation='eager' "
                f"to skip this switch."
            ]
        return []

    def wrap(self, model: nn.Module, settings: WrapSettings) -> nn.Module:
        from accelerate.utils import patch_environment

        opts = settings.options
        ortmodule = import_quietly(opts.get("log_level", "WARNING"))
        from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule
        from onnxruntime.training.ortmodule._fallback import _FallbackPolicy

        _filter_ort_log(opts.get("log_level", "WARNING"))
        enabled = [e for e in settings.entries if e.enabled]
        env: Dict[str, str] = {
            # Both are always set, so a stale value in the user's environment cannot reach ORT's C++ parser.
            "ORTMODULE_MEMORY_OPT_LEVEL": str(settings.level),
            "ORTMODULE_MEMORY_OPT_CONFIG": CONFIG_FILES.write(enabled) if enabled and settings.level == 0 else "",
        }
        if opts.get("cache_dir"):
            os.makedirs(opts["cache_dir"], exist_ok=True)
            env["ORTMODULE_CACHE_DIR"] = opts["cache_dir"]
        save_dir = opts.get("save_onnx_dir")
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
        debug = DebugOptions(
            log_level=LogLevel[opts.get("log_level", "WARNING")],
            save_onnx=bool(save_dir),
            onnx_prefix=(opts.get("onnx_prefix") or "memopt") if save_dir else "",
            save_path=save_dir or "",
        )
        old_policy = ortmodule.ORTMODULE_FALLBACK_POLICY
        if opts.get("fallback_policy", "disable") == "disable":
            # A silent fallback to PyTorch would train without the requested plans while our reports
            # claimed them; fail loudly instead.
            ortmodule.ORTMODULE_FALLBACK_POLICY = _FallbackPolicy.FALLBACK_DISABLE
            env["ORTMODULE_FALLBACK_POLICY"] = "FALLBACK_DISABLE"
        try:
            with patch_environment(**env), warnings.catch_warnings():
                # ORTModule reads every attribute of the model while it checks names, deprecated ones included.
                warnings.filterwarnings("ignore", category=FutureWarning)
                wrapped = ORTModule(model, debug)
        finally:
            ortmodule.ORTMODULE_FALLBACK_POLICY = old_policy
        if settings.measure_memory and not torch.cuda.is_available():
            _without_cpu_arena(_training_manager(wrapped))
        return wrapped

    @staticmethod
    def is_ort_module(model) -> bool:
        if "onnxruntime.training.ortmodule" not in sys.modules:
            return False
        from onnxruntime.training.ortmodule import ORTModule

        return isinstance(model, ORTModule)

    def find(self, model) -> Optional[nn.Module]:
        for _ in range(8):
            if model is None or self.is_ort_module(model):
                return model
            model = getattr(model, "module", None)
        return None

    def plan_report(self, wrapped: nn.Module, settings: WrapSettings) -> Optional[PlanReport]:
        """Plans ORT found for the training graph and which it applies; None before the first step."""
        manager = _training_manager(wrapped)
        if manager._execution_agent is None:
            return None
        inspector = manager._runtime_inspector.memory_ob
        options = manager._runtime_options
        requested = [str(e) for e in settings.entries if e.enabled]
        if settings.level == 0:
            applied = requested if options.memory_optimizer_is_enabled() else []
        else:
            # At levels 1 / 2 ORT chooses and records the plans in a file of its own; read ORT's record.
            applied = []
            own = getattr(inspector, "_json_file_for_layerwise_recompute", None)
            if own is not None:
                own.seek(0)
                applied = [p for item in json.load(own) for p in item.split(",") if p]
        applied_entries = {}
        for text in applied:
            entry = grammar.parse_entry(text, allow_zero_count=True)
            if entry.apply_count != 0:
                applied_entries[entry.key] = entry
        found = []
        for cluster_id, summary in inspector.cluster_id_combination_to_saving_symbolics_map.items():
            parts = [e for e in grammar.parse_cluster_id(cluster_id) if e.apply_count != 0]
            on = bool(parts) and all(e.key in applied_entries for e in parts)
            freq = int(summary.freq)
            count = None
            if on:
                counts = [applied_entries[e.key].apply_count for e in parts]
                count = min(freq if c == -1 else min(c, freq) for c in counts)
            saving = summary.evaluated_saving
            known = isinstance(saving, (int, float))
            # ORT reports one total per subgraph; applied to `count` of its `freq` occurrences, the applied share
            # is counted as count/freq of it (the occurrences of one subgraph in a model's layers have one shape).
            found.append(
                FoundPlan(
                    config=cluster_id,
                    enabled=on,
                    frequency=freq,
                    saving_bytes=float(saving) if known else None,
                    saving_symbolic=str(summary.simplified_symbolic_saving_expr),
                    applied_count=count if on else 0,
                    applied_saving_bytes=float(saving) * (count or 0) / freq if known and freq else None,
                )
            )
        report = PlanReport(
            backend=self.name,
            optimizer_enabled=bool(options.memory_optimizer_is_enabled()),
            level=int(options.memory_optimization_level),
            requested=requested,
            applied=applied,
            plans=found,
            dims={str(k): int(v) for k, v in inspector.symbolic_dim_name_to_value_map.items()},
        )
        if settings.level == 0:
            report.unmatched = grammar.match_requests(settings.entries, found)
        return report

    def optimizer(self, args) -> Optional[Tuple[type, dict, str]]:
        if args.optim != ORT_FUSED:
            return None
        kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
        if torch.cuda.is_available() and args.device.type == "cuda":
            from onnxruntime.training.optim import FusedAdam

            return FusedAdam, kwargs, "`--optim adamw_ort_fused`: FusedAdam from onnxruntime.training.optim (CUDA)"
        if _cpu_fused_adamw_works():
            return (
                torch.optim.AdamW,
                {**kwargs, "fused": True},
                (
                    "`--optim adamw_ort_fused` needs CUDA, which this run does not use; training with "
                    "torch.optim.AdamW(fused=True) (the CPU fused kernel) instead, the same AdamW update"
                ),
            )
        return (
            torch.optim.AdamW,
            kwargs,
            (
                "`--optim adamw_ort_fused` needs CUDA, which this run does not use; training with torch.optim.AdamW "
                "instead, the same AdamW update"
            ),
        )

    def on_optimizer_ready(self, optimizer, args, deepspeed: bool) -> Optional[str]:
        """ORT's FP16_Optimizer on DeepSpeed's ZeRO fp16 optimizer; the line says whether ORT changed it."""
        if not args.fp16:
            return None
        if not torch.cuda.is_available():
            return "ORT's FP16_Optimizer not applied: fp16 training needs CUDA"
        if not deepspeed:
            return (
                "ORT's FP16_Optimizer not applied: it complements DeepSpeed's fp16 optimizer; with torch AMP "
                "the GradScaler already does that work"
            )
        from onnxruntime.training.optim.fp16_optimizer import FP16_Optimizer

        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds DeepSpeed's optimizer
        before = {k: v for k, v in vars(inner).items() if callable(v)}
        FP16_Optimizer(inner)  # changes the instance in place when ORT recognises it
        after = {k: v for k, v in vars(inner).items() if callable(v)}
        changed = sorted(k for k in after if before.get(k) is not after[k])
        if changed:
            return f"ORT's FP16_Optimizer applied to {type(inner).__name__}: replaced {', '.join(changed)}"
        try:
            import deepspeed as ds

            version = ds.__version__
        except Exception:  # pragma: no cover - DeepSpeed is in use here
            version = "unknown"
        return (
            f"ORT's FP16_Optimizer did not change {type(inner).__name__}: ORT 1.19 only modifies DeepSpeed "
            f"optimizers whose code matches the DeepSpeed release it was written against (installed: DeepSpeed "
            f"{version}); DeepSpeed's own fp16 optimizer runs unchanged"
        )


def _cpu_fused_adamw_works() -> bool:
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        p.grad = torch.zeros(2)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except Exception:
        return False
