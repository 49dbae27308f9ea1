"""`auto`'s choice before step one, from a dry run of that very step.

Rules (held by tests/test_auto_dry_run.py and tests/test_plan_file.py):
- When the model is wrapped, a twin of it is made on the meta device (`twin_of`: its modules and their parameters'
  shapes, nothing allocated, no hook and no forward set on an instance), what a lever knows the step runs put back
  (`Lever.onto_twin`: TRL's fused LM head, as TRL put it on the model; tests/test_trl.py).
- At the first training forward, before any of it runs, the twin trains that step on fake tensors (`dry_run_choice`,
  through `fake_step`: the batch's shapes, the run's optimizer, gradient accumulation, autocast and DDP processes,
  every storage counted as CUDA counts it, which is how the CPU counts a real step too: `measure.live`), and the
  solver chooses from it. Step one runs that choice and is measured; at step two's start the choice is kept where
  step one's own memory with what later steps hold more fits the budget, else the solver chooses again from step one
  (`planner`).
- Where no dry run can be made (parameters sharded or offloaded, an optimizer that is not torch's, a forward that
  reads its inputs' values, as TRL's fused head does on a GPU, anything the fake mode refuses), the reason is
  written to the plan's file and step one measures with every layer recomputed whole: the run loses that step's
  speed, nothing else. A step whose layers run out of the list's order or more than once (`LayerOrderError`) stops
  the run before step one instead.
"""

import copy
import inspect
from typing import Optional

import torch
from torch import nn

from .. import _torch_api
from ..fake_step import LayerOrderError  # noqa: F401 - what the dry run raises, for the planner to catch
from ..nested import map_tensors

_HOOKS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


class NoTwin(ValueError):
    """Why no twin of the model can stand for its step in a dry run, in words said with `auto`'s choice."""


def twin_of(model: nn.Module) -> nn.Module:
    """A copy of `model` that holds nothing: every parameter and buffer (and tensor attribute) a meta tensor of its
    shape, strides, dtype and `requires_grad` (tied ones stay tied), with no hook and no forward set on an instance
    (accelerate's autocast wrapper of `model.forward`, kept as it is, would run the original model's forward; TRL's
    fused LM head is put back by the lever that knows it: `Lever.onto_twin`). ValueError where the
    model's parameters are not plain tensors (a DTensor: sharded) or not all in memory."""
    memo = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if _torch_api.wrapped_tensors(t) is not None or _torch_api.is_fake(t) or t.is_sparse:
            raise ValueError(f"a {type(t).__name__} parameter or buffer (sharded, or not a plain tensor)")
        if t.device.type == "meta":
            raise ValueError("a parameter on the meta device (offloaded, or not loaded yet)")
        made = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
        return nn.Parameter(made, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else made

    for module in model.modules():
        for name in _HOOKS:  # copied empty: a hook bound to an outside object (a cache, accelerate's) is not copied
            hooks = getattr(module, name, None)
            if hooks is not None:
                memo[id(hooks)] = type(hooks)()
        if getattr(module, "_hf_hook", None) is not None:  # accelerate's (device maps, offload): its weights map too
            memo[id(module._hf_hook)] = None
        tensors = list(module._parameters.values()) + list(module._buffers.values())
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            if t is not None and id(t) not in memo:
                memo[id(t)] = meta(t)
    twin = copy.deepcopy(model, memo)
    for module in twin.modules():
        vars(module).pop("forward", None)
        for name in _HOOKS:
            hooks = getattr(module, name, None)
            if hooks is not None:
                hooks.clear()
    return twin


def copied_batch(args, kwargs, device: str) -> tuple:
    """(args, kwargs) of a forward with each tensor an empty one of its size, strides and dtype on `device` (a
    floating one keeps `requires_grad`): what a dry run reads of a batch (on "cpu" under its fake mode; on "meta", a
    batch kept to plan for later)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        made = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
        return made.requires_grad_(t.requires_grad) if t.is_floating_point() else made

    return map_tensors((tuple(args), dict(kwargs)), empty)


def attends_all(kwargs) -> bool:
    """Whether a forward's 2-D attention mask attends to every token (read from its values: a real batch's)."""
    mask = kwargs.get("attention_mask")
    return isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask != 0).all())


def optimizer_like(optimizer):
    """A maker of an optimizer like `optimizer` (accelerate's wrapper or torch's) for other parameters: its class with
    the defaults its constructor takes. ValueError where it is not one of torch's."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(f"the optimizer is a {type(inner).__name__}, not one of torch's")
    kind = type(inner)
    takes = inspect.signature(kind.__init__).parameters
    # the defaults it takes (AdamW's hold `decoupled_weight_decay`, which AdamW sets itself and does not take)
    defaults = {k: v for k, v in inner.defaults.items() if k in takes}
    return lambda params: kind(params, **defaults)


def dry_run_choice(
    start,
    twin: nn.Module,
    args,
    kwargs,
    optimizer,
    budget_mb: float,
    held_bytes: int = 0,
    running_into: Optional[list] = None,
    device=None,
    mask_attends_all: Optional[bool] = None,
):
    """`auto`'s choice from a dry run of the step about to run (`fake_step.run` with the `instruments` the run was
    handed, the step `memopt-plan` runs; `start`: the planner's `Start`, the run's micro-batches, autocast and DDP
    processes with them): `twin` (`twin_of` the model) trained on fake copies of
    this forward's arguments (their shapes, strides and dtypes: a fake tensor has no values), with `optimizer`'s like,
    `grad_accum` micro-batches a step and autocast to `autocast` ("bfloat16") or none, and with DistributedDataParallel
    over `ddp` processes, its gradient buckets, and `held_bytes` the process holds on the device outside the step
    (`measure.live.held_outside`) counted from the start; on a CUDA `device` (the run's), its attention kernels as
    this process's next call would take them (`measure.attention.CudaKernels.here`). The process's random generators
    are given back as they were. The dry run's `DryRun` (its `fit`: the choice, None where nothing fits); the layers
    the step runs go into `running_into` before its steps (`dry_run`). `mask_attends_all`: whether the batch's
    attention mask attends to every token, where its tensors are not real (read from the mask where None)."""
    from ..fake_step import StepSpec, run
    from ..measure.attention import CudaKernels

    making = optimizer_like(optimizer)
    every_token = attends_all(kwargs) if mask_attends_all is None else mask_attends_all
    spare = copy.deepcopy(twin)  # untouched, for a dry run that runs again without replayed layers (`fake_step.run`)
    spec = StepSpec(getattr(twin, "config", None), grad_accum=start.grad_accum, autocast=start.autocast, ddp=start.ddp)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []  # every device's generator given back
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        return run(
            spec,
            start.instruments,
            "auto",
            budget_mb=budget_mb,
            model=twin,
            batch=lambda: copied_batch(args, kwargs, "cpu"),
            optimizer_from=making,
            held_bytes=held_bytes,
            running_into=running_into,
            kernels=CudaKernels.here(device) if device is not None and torch.device(device).type == "cuda" else None,
            host_mb=start.host_mb,
            mask_attends_all=every_token,  # read here, where the mask is real: a fake one's values cannot be
            remake=lambda: spare,
        )
