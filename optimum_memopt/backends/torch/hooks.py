"""The saved-tensor hooks of a layer's forward: for each tensor autograd saves, keep it as it is or keep a recipe
(when an op of the policy made it and its inputs are kept anyway); unpack rebuilds it; `finish` folds what was kept
into the step-one profile."""

import contextlib
import weakref
from typing import Optional, Sequence

import torch

from . import _torch_api
from .profile import CHANGED_IN_PLACE, INPUT_NOT_KEPT, OTHER_DTYPE
from .recipe import Stashed, tensors_in
from .tracking import LayerRun, TrackingMode, storage_key


def _kept(run: LayerRun, t: Optional[torch.Tensor]) -> bool:
    """Whether autograd keeps this (live) tensor's storage as it is; a freed input is not kept."""
    if t is None:
        return False
    ptr = storage_key(t)
    ref = run.kept.get(ptr)
    held = ref() if ref is not None else None
    return held is not None and storage_key(held) == ptr


def pack(run: LayerRun, x: torch.Tensor):
    ptr = storage_key(x)
    made = run.made.get(ptr)
    stash = None
    if made is not None and made.ref() is None:
        made = None  # freed; the address now belongs to a storage made outside this layer
    if made is not None and made.recomputable is None:
        run.counted.append(made)
        # Changed in place since (dropout's mask on CPU: `bernoulli_` on `empty_like`'s output) or seen through
        # another dtype: the op alone does not give it back.
        if made.version != _torch_api.version(x):
            made.why_not = CHANGED_IN_PLACE
        elif x.dtype != made.ref().dtype:
            made.why_not = OTHER_DTYPE
        elif not all(ref is None or _kept(run, ref()) for ref in made.inputs):
            made.why_not = INPUT_NOT_KEPT
        made.recomputable = not made.why_not
    if made is not None and run.outer is None:
        if made.call is not None and made.recomputable:
            if made.recipe is None:
                made.recipe = made.call.to_recipe()
                made.call = None
            made.recipe.pending += 1
            stash = Stashed(made.recipe, made.index, x)
        elif made.recipe is not None:
            made.recipe.pending += 1
            stash = Stashed(made.recipe, made.index, x)
    if stash is None and ptr:
        run.kept[ptr] = weakref.ref(x)
    if run.outer is not None:
        return run.outer[0](x)
    return stash if stash is not None else x


def unpack(run: LayerRun, h):
    if run.outer is not None:
        return run.outer[1](h)
    return h.materialize() if isinstance(h, Stashed) else h


def finish(run: LayerRun, outputs, inputs: Sequence) -> None:
    """After the layer's forward: fold what autograd kept into the profile. The layer's own outputs and inputs are
    left out: the next layer (or the caller) keeps them whatever this layer does."""
    if run.record is not None:
        skip = {storage_key(t) for t in tensors_in(outputs)} | {storage_key(t) for t in tensors_in(inputs)}
        for made in run.counted:
            alive = made.ref()
            if alive is not None and storage_key(alive) in skip:
                continue
            run.record.add(made.plan, made.nbytes, made.seconds, bool(made.recomputable), made.why_not)
            if made.recipe is not None:
                run.record.applied[made.plan] = run.record.applied.get(made.plan, 0) + made.nbytes
    # Ops that were never kept by autograd do not need their inputs any longer.
    for made in run.made.values():
        made.call = None
    run.made.clear()


@contextlib.contextmanager
def tracked(run: LayerRun):
    """The tracker and the hooks around one layer's forward."""
    with TrackingMode(run), torch.autograd.graph.saved_tensors_hooks(lambda x: pack(run, x), lambda h: unpack(run, h)):
        yield
