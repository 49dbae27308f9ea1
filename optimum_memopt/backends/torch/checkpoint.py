"""Whole-layer recompute: `torch.utils.checkpoint` (non-reentrant, RNG state preserved) around a layer, for the
layers whose policy says `layer`. In step one the layer's first forward is also profiled, its tracker handing every
saved tensor on to checkpoint's own hooks."""

from typing import Optional

from torch.utils.checkpoint import checkpoint

from . import _torch_api
from .hooks import finish, tracked
from .profile import LayerProfile
from .tracking import LayerRun


def checkpointed(original, record: Optional[LayerProfile], args, kwargs):
    if record is None:
        return checkpoint(original, *args, use_reentrant=False, **kwargs)
    first = [True]

    def recorded(*a, **k):
        if not first[0]:  # the recomputation in backward
            return original(*a, **k)
        first[0] = False
        outer = _torch_api.top_saved_tensors_hooks()
        if outer is None:
            return original(*a, **k)
        run = LayerRun(frozenset(), record, outer_hooks=outer)
        with tracked(run):
            out = original(*a, **k)
        finish(run, out, (a, k))
        return out

    return checkpoint(recorded, *args, use_reentrant=False, **kwargs)
