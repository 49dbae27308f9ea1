"""How a model's weights are sharded across processes, and gathering them whole for work a lever runs alone.

`sharded` says how a module's weights are split (DeepSpeed ZeRO-3, FSDP); `gathered` makes FSDP2's whole for a
block (the engine around a lever's measurement between step one and step two: `apply.engine`)."""

import contextlib
from typing import Iterator, Optional, Sequence


@contextlib.contextmanager
def gathered(modules: Sequence[object], model) -> Iterator[None]:
    """The weights of `modules` whole on this process for the block where FSDP2 shards them: the `fully_shard`ed
    module holding each (the innermost in `model`) unsharded before it (`FSDPModule.unshard`) and resharded after. A
    collective: every process enters it at the same point of the run (the levers measure between step one and step
    two, in the same order on every rank), decided by the model's structure alone. Elsewhere (no FSDP2; ZeRO-3,
    whose weights stay sharded and are said so by `sharded`) nothing is done."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 has no FSDP2 module class here
        FSDPModule = None
    owners: list = []
    if FSDPModule is not None:
        for module in modules:
            if sharded(module) != "FSDP":
                continue
            holders = [m for m in model.modules() if isinstance(m, FSDPModule) and _holds(m, module)]
            if holders:
                owner = min(holders, key=lambda m: sum(1 for _ in m.modules()))
                if all(owner is not o for o in owners):
                    owners.append(owner)
    for owner in owners:
        owner.unshard()
    try:
        yield
    finally:
        for owner in owners:
            owner.reshard()


def _holds(owner, module) -> bool:
    return any(m is module for m in owner.modules())


def sharded(module) -> Optional[str]:
    """How `module`'s weights are sharded across processes (ZeRO-3, FSDP), or None: a lever measuring it alone would
    gather them, or hand their gradients to the sharding's hooks, on one process's say (FSDP2's are gathered for the
    measurement on every rank: `gathered`; inside it this says None)."""
    for p in module.parameters():
        if hasattr(p, "ds_id"):
            return "DeepSpeed ZeRO-3"
        if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
            return "FSDP"
    return None
