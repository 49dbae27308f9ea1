"""Whole-layer recompute: `torch.utils.checkpoint` (non-reentrant, RNG state preserved) around a layer, for the
layers whose policy says `layer`. The layer's first forward runs under the backend's hooks, which hand every saved
tensor on to checkpoint's own and check at backward that the recomputed tensor is at the version it was saved at
(a recompute that replays an in-place change made after the save would give backward the changed values; torch's
checkpoint does not check this). In step one that forward is also profiled.

A checkpointed layer runs without the model's KV cache: in training, transformers' decoders build a `DynamicCache`
(`config.use_cache` is on by default) that each layer appends to; a layer recomputed in backward would append its
keys and values a second time (the cache's keys double, and the recompute attends over both copies), and the cache
would hold every layer's keys and values that checkpointing frees. transformers' own checkpointed layers drop the
cache for the same reason, unless the layer class says it only reads it (`_can_checkpoint_with_cache`). The engine
drops it from every other layer it runs in training too (`engine.layer_forward`): a cache filled by the layers a
policy keeps and not by those it recomputes is of no use, and what the kept layers' caches hold is what step one,
every layer recomputed whole, never measured (a sliding-window layer's cache copies its keys and values: Gemma 3's
first check after `auto`'s choice read over the budget).
"""

from typing import Optional

from torch.utils.checkpoint import checkpoint

from .. import _torch_api
from ..measure.profile import LayerProfile
from .hooks import finish, hooked, tracked
from .recipe import RECOMPUTE_LAYER, marked
from .routing import selective_context
from .tracking import LayerRun

CACHE_KWARGS = ("past_key_values", "layer_past")  # the names of a legacy cache (a tuple of tensors)

try:  # any transformers cache, whatever the argument that passes it is called (XLM's layers take `cache=`)
    from transformers.cache_utils import Cache as _CACHE
except ImportError:  # pragma: no cover - transformers is a dependency; a bare torch model has no cache
    _CACHE = ()


def without_cache(layer, args: tuple, kwargs: dict):
    """The layer's arguments with its KV cache dropped (see the module's docstring): any transformers `Cache` object,
    passed by position or by whatever keyword, and a legacy cache by its name."""
    if getattr(type(layer), "_can_checkpoint_with_cache", False):
        return args, kwargs
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    for name, value in kwargs.items():
        if value is not None and (name in CACHE_KWARGS or isinstance(value, _CACHE)):
            kwargs[name] = None
    return tuple(None if isinstance(a, _CACHE) else a for a in args), kwargs


def holds_cache(layer, args: tuple, kwargs: dict) -> bool:
    """Whether the layer is given a KV cache it would append to (what `without_cache` drops)."""
    if getattr(type(layer), "_can_checkpoint_with_cache", False):
        return False
    named = any(v is not None and (k in CACHE_KWARGS or isinstance(v, _CACHE)) for k, v in kwargs.items())
    return bool(kwargs.get("use_cache")) or named or any(isinstance(a, _CACHE) for a in args)


def checkpointed(layer, original, record: Optional[LayerProfile], args, kwargs, keep_routing: bool = False):
    """`layer` recomputed whole in backward; with `keep_routing` (an MoE layer) its routing saved in the forward and
    handed back in the recompute (`routing.selective_context`), so every token goes where the forward sent it."""
    args, kwargs = without_cache(layer, args, kwargs)
    first = [True]

    def guarded(*a, **k):
        if not first[0]:  # the recomputation in backward
            with marked(RECOMPUTE_LAYER):
                return original(*a, **k)
        first[0] = False
        outer = _torch_api.top_saved_tensors_hooks()
        if outer is None:
            return original(*a, **k)
        run = LayerRun(frozenset(), record, outer_hooks=outer, check_outer=True)
        with tracked(run) if record is not None else hooked(run):
            out = original(*a, **k)
        finish(run, out, (a, k))
        return out

    if keep_routing:
        return checkpoint(guarded, *args, use_reentrant=False, context_fn=selective_context, **kwargs)
    return checkpoint(guarded, *args, use_reentrant=False, **kwargs)
