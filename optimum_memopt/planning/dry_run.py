"""`memopt-plan`'s dry run: the torch backend's fake step (`backends.torch.fake_step`, the one a training run's `auto`
runs before its step one) handed the package's `optimize_memory` and a device's roofline (`instruments`). One code
path: a plan's `auto` row and a run's own dry run of the same step choose the same and predict the same figure
(tests/test_plan_file.py)."""

from typing import Optional

# the planning side's names for the step and its figures
from ..backends.torch.fake_step import NOT_SEEN, OPTIMIZERS, PARTS, DryRun, Instruments, LayerOrderError, StepSpec, run  # noqa: F401

# What `optimize_memory` imports when first called, imported before any dry run enters its fake mode: a module first
# imported under `FakeTensorMode` makes its tensors fake for the rest of the process (transformers' trainer modules
# pull in PEFT, whose LoHa `HadaWeight.forward` takes `scale=torch.tensor(1)` as a default: a dry run counted it,
# and a later real LoHa step in the same process met a fake tensor).
from ..callbacks import base as _callbacks  # noqa: F401
from .devices import DEFAULT_DEVICE, DEVICES


def _wrap(model, plans, level, budget_mb, host_mb=None):
    """The backend on a dry run's model as `optimize_memory` puts it on a training loop's: steps reported by the
    driver, nothing said (the dry run's caller says what it found); `host_mb`: what `auto` may offload to the host."""
    import optimum_memopt

    return optimum_memopt.optimize_memory(
        model, plans, level=level, budget_mb=budget_mb, reports_steps=True, say=lambda text: None,
        host_memory_mb=host_mb if plans == "auto" and budget_mb is not None else None,
    )  # fmt: skip


def instruments(cost_device=None) -> Instruments:
    """The fake step's instruments: the package's `optimize_memory`, and the ops timed on `cost_device`'s roofline (a
    `devices.Device`; None: `devices.DEFAULT_DEVICE`'s, what a run's own dry run weighs recompute by)."""
    return Instruments(wrap=_wrap, device=cost_device or DEVICES[DEFAULT_DEVICE])


def dry_run(spec: StepSpec, plans: Optional[str] = None, cost_device=None, **options) -> DryRun:
    """`spec`'s step on fake tensors under one configuration (`backends.torch.fake_step.run`, whose keywords
    `options` are: `level`, `checkpointing`, `budget_mb`, `backend`, `fake`, `device`, `held_bytes`, `kernels`,
    `peak_only`, ...), its ops timed on `cost_device`'s roofline and, with one given, the last step's ops priced on it
    (`DryRun.step_seconds`)."""
    return run(spec, instruments(cost_device), plans, price_step=cost_device is not None, **options)
