"""The backend seam: what the trainer hook asks of a memory-optimizer backend.

A backend turns validated settings into a wrapped model that recomputes what the plans say, and
reports, after the first training step, what it found and applied (`PlanReport`). The hook
(`optimum_memopt.trainer`) calls only the methods below, in this order:

1. `problem()` when the trainer is built: why the backend cannot run here, with the command that
   fixes it (None when it can);
2. `check(args)` when the trainer is built: refusals that need the environment (a device, a
   precision, a launch) and that the arguments alone could not decide;
3. `prepare(model)` before wrapping (and again for each model `model_init` builds): in-place
   changes the backend needs, returned as one log line each;
4. `wrap(model, settings)` inside `Trainer._wrap_model`, before DDP / DeepSpeed wrap the result;
5. `find(model)`: the backend's module inside DDP / DeepSpeed wrappers, or None;
6. `plan_report(wrapped, settings)` after the first training step;
7. `optimizer(args)` when the optimizer is built: a backend-specific optimizer for `args.optim`, or None;
8. `on_optimizer_ready(optimizer, args, deepspeed)` once the optimizer exists: backend-specific changes
   to it, returned as one honest log line (or None).

A new backend is one module implementing this class, registered in `optimum_memopt.backends`.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from torch import nn

from ..plans import PlanEntry, PlanReport


@dataclass
class WrapSettings:
    """Everything a backend needs to wrap a model, already validated."""

    entries: Sequence[PlanEntry] = ()
    level: int = 0
    measure_memory: bool = False  # memory is being measured: allocations must be visible to the meter
    options: dict = field(default_factory=dict)  # backend-specific, validated by the arguments


class Backend:
    name = "base"

    def problem(self) -> Optional[str]:
        raise NotImplementedError

    def check(self, args) -> None:
        pass

    def prepare(self, model: nn.Module) -> List[str]:
        return []

    def wrap(self, model: nn.Module, settings: WrapSettings) -> nn.Module:
        raise NotImplementedError

    def find(self, model) -> Optional[nn.Module]:
        raise NotImplementedError

    def describe(self, wrapped: nn.Module) -> str:
        """How the log names what the model trains through."""
        return type(wrapped).__name__

    def plan_report(self, wrapped: nn.Module, settings: WrapSettings) -> Optional[PlanReport]:
        raise NotImplementedError

    def optimizer(self, args) -> Optional[Tuple[type, dict, str]]:
        """(optimizer class, its keyword arguments, a log line) for ``args.optim``, or None for the Trainer's own."""
        return None

    def on_optimizer_ready(self, optimizer, args, deepspeed: bool) -> Optional[str]:
        return None
