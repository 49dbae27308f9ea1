"""`--memory_plan_file`: a training run that starts from `memopt-plan --json`'s file instead of a dry run of its own.

`memopt-plan`'s `auto` row is the dry run a run makes before its step one (one code path: `backends.torch.fake_step`),
so a run given the file can skip its own: step one runs the file's choice and checks it as it checks a dry run's
(within the budget with what later steps hold more, or the solver chooses again from what step one measured). The
start then costs no dry run.

Rules:
- The file holds the step it planned (`PlannedStep`: the model's config, batch and sequence, the weights' dtype,
  autocast, the optimizer, gradient accumulation, LoRA, the processes and how they share the model) and the budget
  `auto` chose under. A run whose step differs in any of them is refused before it trains, each difference named
  with the file's value and the run's: a choice made for another step can run over the budget, or recompute what
  fits.
- The run's budget is the file's: `--memory_budget_mb` may be left out; given, it must be the file's.
- A file without `auto`'s choice (no budget or device given to `memopt-plan`, or nothing fitted) is refused with
  what to run instead.
- The model is compared by its config's scalar entries (nested configs flattened), without those that do not
  change what a step holds (`IGNORED`): a checkpoint and the config `memopt-plan` read from it compare equal.
"""

import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

FLAG = "--memory_plan_file"
CPU = "cpu"  # `memopt-plan --device cpu`: the CPU's kernels, as a run on the CPU runs them
EXAMPLE = (
    "memopt-plan --model_name_or_path ./model --per_device_train_batch_size 1 --block_size 8192 --bf16 "
    "--memory_budget_mb 70000 --json plan.json"
)
# a config's entries that change nothing a training step holds (names, versions, what the Trainer or a loader sets)
IGNORED = {
    "_name_or_path",
    "name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "_attn_implementation",
    "_attn_implementation_internal",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "_commit_hash",
    "architectures",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "torchscript",
    "tokenizer_class",
    "problem_type",
    "id2label",
    "label2id",
}


class PlanFileError(ValueError):
    """The file cannot start this run (unreadable, no `auto` choice, or planned for another step)."""


def model_facts(config) -> Dict[str, object]:
    """What of a transformers config decides a step's memory: its scalar entries, nested configs' flattened with
    dotted names, without `IGNORED`."""
    out: Dict[str, object] = {}

    def walk(d: dict, prefix: str) -> None:
        for key, value in d.items():
            if key in IGNORED:
                continue
            name = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{name}.")
            elif value is None or isinstance(value, (bool, int, float, str)):
                out[name] = value

    walk(config.to_dict(), "")
    return out


@dataclass
class PlannedStep:
    """A step as `memopt-plan` planned it, or as a run is about to train it: what a choice depends on."""

    model: Dict[str, object]  # `model_facts` of the config
    dtype: str  # the weights' dtype as loaded (the most bytes of the parameters, a LoRA adapter's aside)
    autocast: Optional[str]  # "bfloat16", "float16" or None
    optimizer: str  # --optim
    grad_accum: int
    lora: Optional[dict]  # r, lora_dropout, target_modules (sorted); None without LoRA
    fsdp: int  # processes FSDP2 shards over (1: none)
    ddp: int  # processes DDP replicates over (1: none)
    kernels: str = ""  # the attention and dropout kernels: "cpu", or a CUDA card's compute capability ("cuda 9.0")
    batch: Optional[int] = None  # per device; None where not known yet (checked at step one)
    seq: Optional[int] = None


def _lora(lora: Optional[dict], model_type: object) -> Optional[dict]:
    """LoRA's settings that change a step's memory; target modules left out are PEFT's default for the model type
    (what `memopt-plan --use_peft` and PEFT both take)."""
    if lora is None:
        return None
    targets = lora.get("target_modules")
    if targets is None:
        try:
            from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS
        except ImportError:  # without PEFT no run has LoRA: the file's settings are compared as written
            DEFAULTS = {}
        targets = DEFAULTS.get(model_type)
    if isinstance(targets, str):  # a regular expression, compared as written
        targets = [targets]
    return {
        "r": int(lora.get("r", 8)),
        "lora_dropout": float(lora.get("lora_dropout", 0.0)),
        "target_modules": sorted(targets) if targets is not None else None,
    }


def kernels_of(device) -> str:
    """The kernels a step on `device` (a torch.device) runs, as `PlannedStep.kernels` names them."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return CPU if device.type == "cpu" else device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda {major}.{minor}"


def run_step(
    model, *, device, autocast: Optional[str], optimizer: str, grad_accum: int, fsdp: int, ddp: int
) -> PlannedStep:
    """The step a training run of `model` (a transformers model, or PEFT's around one) on `device` is about to train,
    as far as it is known before its first batch (the batch's shape is read at step one: `PlannedStep.batch`,
    `seq`)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise PlanFileError(f"`{FLAG}` plans a transformers model; {type(model).__name__} has no config to compare")
    by_dtype: Dict[str, int] = {}
    for p in model.parameters():
        name = str(p.dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + p.numel()
    lora = None
    peft = getattr(model, "peft_config", None)
    if isinstance(peft, dict) and peft:
        adapter = peft.get("default", next(iter(peft.values())))
        targets = getattr(adapter, "target_modules", None)
        lora = {
            "r": getattr(adapter, "r", 8),
            "lora_dropout": getattr(adapter, "lora_dropout", 0.0),
            "target_modules": sorted(targets) if isinstance(targets, (set, list, tuple)) else targets,
        }
    return PlannedStep(
        model=model_facts(config),
        dtype=max(by_dtype, key=by_dtype.get) if by_dtype else "float32",
        autocast=autocast,
        optimizer=optimizer,
        grad_accum=grad_accum,
        lora=lora,
        fsdp=fsdp,
        ddp=ddp,
        kernels=kernels_of(device),
    )


def differences(planned: PlannedStep, run: PlannedStep) -> List[str]:
    """Each way `run` is not the step `planned` planned, in words ("batch: the file's 1, this run's 4"); [] where it
    is. A field `run` does not know yet (None) is not compared."""
    out = []
    changed = sorted(k for k in set(planned.model) | set(run.model) if planned.model.get(k) != run.model.get(k))
    if changed:
        said = ", ".join(f"{k} {planned.model.get(k)!r} there, {run.model.get(k)!r} here" for k in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        out.append(f"the model's config: {said}{more}")
    for name, label in (
        ("batch", "per-device batch"),
        ("seq", "tokens per sequence"),
        ("dtype", "weights' dtype"),
        ("autocast", "autocast (`--bf16` / `--fp16`)"),
        ("optimizer", "`--optim`"),
        ("grad_accum", "`--gradient_accumulation_steps`"),
        ("fsdp", "processes FSDP shards over"),
        ("kernels", "the device's attention and dropout kernels"),
        ("ddp", "processes DDP replicates over"),
    ):
        a, b = getattr(planned, name), getattr(run, name)
        if b is not None and a != b:
            out.append(f"{label}: the file's {a}, this run's {b}")
    a, b = _lora(planned.lora, planned.model.get("model_type")), _lora(run.lora, run.model.get("model_type"))
    if a != b:
        out.append(f"LoRA: the file's {a or 'none'}, this run's {b or 'none'}")
    return out


@dataclass
class PlanFile:
    """`auto`'s row of a `memopt-plan --json` file and the step it planned."""

    path: str
    choice: str  # in the plan grammar; "" for nothing recomputed
    peak_mb: float  # the dry run's peak of the choice's step (what step one runs)
    peak_at: str
    budget_mb: float  # what `auto` chose under
    step: PlannedStep
    least_mb: Optional[float] = None  # the least memory any row of the file reaches (its floor), where it has one
    workspaces_mb: float = 0.0  # a card's cuBLAS workspaces the file's figures count (`--device`), 0 without
    made: Dict[str, object] = field(default_factory=dict)  # the file's model name and device, for messages

    @property
    def config_flag(self) -> str:
        return f"`--memory_opt_config {self.choice}`" if self.choice else "nothing recomputed"

    def check(self, run: PlannedStep) -> None:
        """PlanFileError naming every way `run` is not the step the file planned."""
        found = differences(self.step, run)
        if found:
            raise PlanFileError(
                f"`{FLAG} {self.path}` planned another step than this run's: {'; '.join(found)}. Its choice "
                f"({self.config_flag}) is for that step; plan this one (as in `{EXAMPLE}` with this run's flags), "
                f"or drop `{FLAG}` to let `auto` dry-run the step itself"
            )

    def budget(self, given: Optional[float]) -> float:
        """The run's budget: the file's; PlanFileError where `--memory_budget_mb` gives another."""
        if given is not None and not math.isclose(given, self.budget_mb, abs_tol=0.5):
            raise PlanFileError(
                f"`{FLAG} {self.path}` chose under {self.budget_mb:g} MiB, but `--memory_budget_mb {given:g}` was "
                f"given; drop `--memory_budget_mb` (the file's budget is the run's), or plan under this one, as in "
                f"`memopt-plan ... --memory_budget_mb {given:g} --json {self.path}`"
            )
        return self.budget_mb


def write(path: str, step: PlannedStep, *, choice: str, peak_mb: float, peak_at: str, budget_mb: float,
          workspaces_mb: float, batch: int, seq: int, model: Optional[str] = None) -> str:  # fmt: skip
    """`step` planned with `auto`'s choice under `budget_mb`, written to `path` as `memopt-plan --json` writes what
    `read` takes (the `auto` row, the step, the model's config as `model_facts` gives it, the kernels): a run's own dry
    run kept for the next run of the same step. The file's peak is its step's for a process holding nothing else but
    `workspaces_mb`, as memopt-plan's. Returns `path`."""
    record = {
        "written_by": "a training run's dry run of its step one (`--memory_opt_config auto`)",
        "model": model,
        "step": {
            "batch": batch,
            "seq": seq,
            "dtype": step.dtype,
            "autocast": step.autocast,
            "optimizer": step.optimizer,
            "grad_accum": step.grad_accum,
            "lora": step.lora,
            "fsdp": step.fsdp,
            "ddp": step.ddp,
        },
        "budget_mb": budget_mb,
        "workspaces_mb": workspaces_mb,
        "configurations": [{"name": "auto", "choice": choice, "peak_mb": peak_mb, "peak_at": peak_at}],
        "run": {"model_config": step.model, "kernels": step.kernels, "auto_budget_mb": budget_mb},
    }
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    return path


def keeper(path: str, step: PlannedStep, model: Optional[str] = None):
    """What a run hands its dry run (`Budget.keep_plan`): writes the choice it is given with `step` to `path`."""

    def keep(**choice) -> str:
        return write(path, step, model=model, **choice)

    return keep


def read(path: str) -> PlanFile:
    """The plan file at `path`; PlanFileError with what is wrong and what to run instead."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except OSError as e:
        raise PlanFileError(f"`{FLAG} {path}` cannot be read ({e.strerror or e}); give the file `{EXAMPLE}` wrote")
    except ValueError as e:
        raise PlanFileError(f"`{FLAG} {path}` is not JSON ({e}); give the file `{EXAMPLE}` wrote") from None
    if not isinstance(record, dict) or "configurations" not in record or "step" not in record:
        raise PlanFileError(f"`{FLAG} {path}` is not a `memopt-plan --json` file; give the one `{EXAMPLE}` wrote")
    run = record.get("run")
    if not isinstance(run, dict) or "model_config" not in run:
        raise PlanFileError(
            f"`{FLAG} {path}` was written by a memopt-plan that did not record the model's config; write it again "
            f"with this version, as in `{EXAMPLE}`"
        )
    auto = next((c for c in record["configurations"] if c.get("name") == "auto"), None)
    if auto is None or run.get("auto_budget_mb") is None:
        raise PlanFileError(
            f"`{FLAG} {path}` has no `auto` row: memopt-plan plans `auto` under a budget; give it one "
            f"(`--memory_budget_mb MIB` or `--device NAME`), as in `{EXAMPLE}`"
        )
    if auto.get("choice") is None or auto.get("peak_mb") is None:
        why = auto.get("problem") or "no choice was recorded"
        raise PlanFileError(
            f"`{FLAG} {path}`: `auto` chose nothing there ({why}); plan with a larger budget, a smaller batch or "
            f"shorter sequences"
        )
    step = record["step"]
    planned = PlannedStep(
        model=dict(run["model_config"]),
        dtype=step["dtype"],
        autocast=step.get("autocast"),
        optimizer=step["optimizer"],
        grad_accum=int(step.get("grad_accum", 1)),
        lora=step.get("lora"),
        fsdp=int(step.get("fsdp", 1)),
        ddp=int(step.get("ddp", 1)),
        kernels=run.get("kernels", ""),
        batch=int(step["batch"]),
        seq=int(step["seq"]),
    )
    peaks = [c["peak_mb"] for c in record["configurations"] if c.get("peak_mb") is not None]
    return PlanFile(
        path=path,
        choice=auto["choice"],
        peak_mb=float(auto["peak_mb"]),
        peak_at=auto.get("peak_at") or "",
        budget_mb=float(run["auto_budget_mb"]),
        step=planned,
        least_mb=min(peaks) if peaks else None,
        workspaces_mb=float(record.get("workspaces_mb") or 0.0),
        made={"model": record.get("model"), "device": (record.get("device") or {}).get("name")},
    )
