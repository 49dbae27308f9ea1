"""What differs between the transformers releases the hook supports, keyed on behaviour, not version strings.

The ORT stack pins torch 2.4 (ORTModule's last release needs torch <= 2.4); transformers 4.46-4.57 declare
that they allow it, but some of their code assumes a newer torch. This module holds the hook's answers:

* `resume_refusal()`: transformers 4.53+ refuse `torch.load` below torch 2.6 (CVE-2025-32434), so a
  checkpoint's optimizer, scheduler and RNG state cannot be restored on this stack; the hook says so
  before training starts instead of failing inside the Trainer.
* `accelerate_problem()` / `check_arguments_types()`: transformers 4.52+ call accelerate's
  `unwrap_model(..., keep_torch_compile=...)` (accelerate >= 1.3), and 4.56 annotates an argument with
  accelerate's `ParallelismConfig` (accelerate >= 1.10.1) without declaring either floor; the hook names
  the accelerate it needs instead of failing mid-run or in the argument parser.
* `numpy_safe_globals()`: transformers 4.51-4.52 load the RNG state with `weights_only=True` and allowlist
  numpy's types only on torch >= 2.6 (where `torch.serialization.safe_globals` exists); on torch 2.4 the
  same allowlist is set with `add_safe_globals` for the duration of the load, then restored.

docs/COMPATIBILITY.md has the matrix these were found with.
"""

import codecs
import contextlib
import pickle
from typing import Optional

import numpy as np
import torch


def resume_refusal() -> Optional[str]:
    """Why this transformers cannot resume from a checkpoint with this torch, or None when it can."""
    try:
        from transformers.utils.import_utils import check_torch_load_is_safe
    except ImportError:
        return None
    try:
        check_torch_load_is_safe()
    except ValueError:
        import transformers

        return (
            f"resuming from a checkpoint: transformers {transformers.__version__} refuses torch.load with torch "
            f"{torch.__version__} (it needs torch >= 2.6 since CVE-2025-32434), and ONNX Runtime training needs torch "
            f"<= 2.4, so the checkpoint's optimizer, scheduler and RNG state cannot be restored; resume with "
            f"transformers <= 4.52 (docs/COMPATIBILITY.md), or start a new run from the checkpoint's weights "
            f"(`--model_name_or_path CHECKPOINT_DIR`)"
        )
    return None


@contextlib.contextmanager
def numpy_safe_globals():
    """Allow numpy's array types in `torch.load(weights_only=True)` for the duration of the block (torch 2.4)."""
    if not hasattr(torch.serialization, "add_safe_globals") or hasattr(torch.serialization, "safe_globals"):
        yield
        return
    core = np._core if hasattr(np, "_core") else np.core
    saved = list(torch.serialization.get_safe_globals())
    # numpy's arrays and dtypes, as transformers allowlists them on torch >= 2.6, and codecs.encode, which numpy's
    # pickled RNG state uses and newer torch releases allow by default
    allow = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)), codecs.encode]
    torch.serialization.add_safe_globals(allow)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


UNPICKLING_ERRORS = (pickle.UnpicklingError,)


def accelerate_problem() -> Optional[str]:
    """Why the installed accelerate cannot run this transformers' Trainer, with the fix; None when it can."""
    import inspect

    import accelerate
    import transformers
    from accelerate import Accelerator
    from transformers import Trainer

    try:
        needs = "keep_torch_compile" in inspect.getsource(Trainer._wrap_model)
    except (OSError, TypeError):
        return None
    has = "keep_torch_compile" in inspect.signature(Accelerator.unwrap_model).parameters
    if needs and not has:
        return (
            f"transformers {transformers.__version__} calls accelerate's unwrap_model(keep_torch_compile=...), "
            f"which accelerate {accelerate.__version__} does not have; install accelerate >= 1.3, as in "
            f"`pip install 'accelerate>=1.3,<1.11'`"
        )
    return None


def check_arguments_types() -> None:
    """Fail at import, with the fix, where the argument parser would fail to resolve TrainingArguments' types."""
    import transformers.training_args as ta

    annotation = getattr(ta.TrainingArguments, "__annotations__", {}).get("parallelism_config")
    if annotation is not None and "ParallelismConfig" in str(annotation) and not hasattr(ta, "ParallelismConfig"):
        import accelerate

        raise ImportError(
            f"transformers {transformers_version()} annotates its arguments with accelerate's ParallelismConfig, "
            f"which accelerate {accelerate.__version__} does not have (HfArgumentParser would fail to resolve the "
            f"arguments' types); install accelerate >= 1.10.1, as in `pip install 'accelerate>=1.10.1,<1.11'`"
        )


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def overwrite_output_dir_flag() -> list:
    """`--overwrite_output_dir` where the Trainer's arguments still have it (transformers 4.x; 5.x removed it and
    refuses the flag): the measuring runs and the recipes' offline defaults pass it only there."""
    from dataclasses import fields

    from transformers import TrainingArguments

    known = any(f.name == "overwrite_output_dir" for f in fields(TrainingArguments))
    return ["--overwrite_output_dir"] if known else []
