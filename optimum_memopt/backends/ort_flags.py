"""The ORT backend's own flags: declared here, as a dataclass the arguments inherit through the seam
(`optimum_memopt.backends.BackendFlags`), and checked by `OrtBackend.check_args`. No onnxruntime import."""

import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

LOG_LEVELS = ("WARNING", "INFO", "DEVINFO", "VERBOSE", "ERROR", "FATAL")
FALLBACK_POLICIES = ("disable", "default")
ORT_FUSED = "adamw_ort_fused"
ENV_CONFIG = "ORTMODULE_MEMORY_OPT_CONFIG"
ENV_LEVEL = "ORTMODULE_MEMORY_OPT_LEVEL"


@dataclass
class OrtFlags:
    ort_log_level: str = field(
        default="WARNING",
        metadata={"help": "ORTModule log level. INFO and below add ORT's own output.", "choices": list(LOG_LEVELS)},
    )
    ort_fallback_policy: str = field(
        default="disable",
        metadata={
            "help": "disable: an ORT failure stops training; default: ORT's policy, which may fall back to PyTorch.",
            "choices": list(FALLBACK_POLICIES),
        },
    )
    ort_save_onnx_dir: Optional[str] = field(
        default=None, metadata={"help": "Save the ONNX graphs ORTModule exports into this directory (debugging)."}
    )
    ort_cache_dir: Optional[str] = field(
        default=None, metadata={"help": "Cache the exported ONNX model here to skip the export on later runs."}
    )
    ort_loss_in_graph: bool = field(
        default=False,
        metadata={
            "help": "Only the loss leaves ORT's graph (logits stay inside), so label-sparsity optimizations apply."
        },
    )
    # The names optimum's ORTTrainingArguments (1.27) used, so a script moves here by changing its imports.
    use_module_with_loss: bool = field(
        default=False, metadata={"help": "optimum ORTTrainer's name for --ort_loss_in_graph (accepted, said once)."}
    )
    save_onnx: bool = field(
        default=False,
        metadata={
            "help": "optimum ORTTrainer's switch for saving ORT's graphs: here --ort_save_onnx_dir "
            "($ORTMODULE_SAVE_ONNX_PATH, else --output_dir); needs --onnx_prefix, as there."
        },
    )
    onnx_prefix: Optional[str] = field(
        default=None, metadata={"help": "With --save_onnx: the prefix of the saved graphs' file names."}
    )
    onnx_log_level: Optional[str] = field(
        default=None,
        metadata={"help": "optimum ORTTrainer's name for --ort_log_level.", "choices": [None, *LOG_LEVELS]},
    )


# Each flag of OrtFlags with its default: given with another backend (or none), they are refused.
FLAGS = {name: f.default for name, f in OrtFlags.__dataclass_fields__.items()}


def check_dir_flag(flag: str, path: Optional[str]) -> None:
    if not path:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"`{flag}` is {path!r}, which is a file; expected a directory (created when missing), as in "
            f"`{flag} outputs/ort`"
        )
    parent = os.path.abspath(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK) or not _can_create_in(parent):
        raise ValueError(
            f"`{flag}` is {path!r}, but {parent!r} cannot be written; give a writable directory, as in "
            f"`{flag} outputs/ort`"
        )


def _can_create_in(directory: str) -> bool:
    """Whether a directory can really be made in `directory`: `os.access` says yes to root everywhere, also in
    pseudo-filesystems such as /proc, where nothing can be created."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".memopt-check-", dir=directory))
        return True
    except OSError:
        return False


def check_choices(args) -> None:
    """The constructor checks what the command line's `choices` check."""
    for name, allowed in (("ort_log_level", LOG_LEVELS), ("ort_fallback_policy", FALLBACK_POLICIES)):
        value = getattr(args, name)
        if value not in allowed:
            near = [a for a in allowed if isinstance(value, str) and a.lower() == value.strip().lower()]
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(
                f"`--{name}` is {value!r}; expected one of {', '.join(map(repr, allowed))}, as in "
                f"`--{name} {allowed[0]}`{hint}"
            )
    check_dir_flag("--ort_save_onnx_dir", args.ort_save_onnx_dir)
    check_dir_flag("--ort_cache_dir", args.ort_cache_dir)


def translate_optimum_names(args) -> list:
    """optimum ORTTrainer's flag names turned into ours; one note per name translated."""
    notes = []
    if args.use_module_with_loss:
        args.ort_loss_in_graph = True
        notes.append(
            "`--use_module_with_loss` (optimum's ORTTrainer) is `--ort_loss_in_graph` here: the loss is "
            "computed inside ORT's graph"
        )
    if args.onnx_log_level is not None:
        if args.ort_log_level not in ("WARNING", args.onnx_log_level):
            raise ValueError(
                f"`--onnx_log_level {args.onnx_log_level}` and `--ort_log_level {args.ort_log_level}` "
                f"disagree; give one of them, as in `--ort_log_level {args.onnx_log_level}`"
            )
        args.ort_log_level = args.onnx_log_level
        notes.append(f"`--onnx_log_level {args.onnx_log_level}` (optimum's ORTTrainer) is `--ort_log_level` here")
    if args.save_onnx:
        if not args.onnx_prefix:
            raise ValueError(
                "`--save_onnx` needs `--onnx_prefix`, as in optimum's ORTTrainer (`--save_onnx "
                "--onnx_prefix my_model`); or give the directory alone, as in `--ort_save_onnx_dir "
                "outputs/onnx`"
            )
        if not args.ort_save_onnx_dir:
            args.ort_save_onnx_dir = os.environ.get("ORTMODULE_SAVE_ONNX_PATH") or args.output_dir
        notes.append(
            f"`--save_onnx` (optimum's ORTTrainer) is `--ort_save_onnx_dir {args.ort_save_onnx_dir}` "
            f"here, file names prefixed {args.onnx_prefix!r}"
        )
    elif args.onnx_prefix and not args.ort_save_onnx_dir:
        notes.append(
            f"`--onnx_prefix {args.onnx_prefix}` has no effect without `--save_onnx` (or `--ort_save_onnx_dir`)"
        )
    return notes
