"""A mixture of experts' routing is kept, never recomputed.

A router's logits, its top-k experts and weights, and the permutation and offsets that send each token to its experts
decide where every token goes. Recomputed in backward, a router whose logits come out a rounding apart (another
kernel, another accumulation order on a GPU) can send a near-tie token to another expert than the forward did: the
backward then runs through experts the forward never used (transformers #47467: a CheckpointError, or silently wrong
gradients). So the routing is never recomputed, under any plan or level:

- under an op plan, a storage made inside a router, or an index an MoE block makes from the routing (a sort, a
  count, a cumulative sum, a one-hot), is never planned: kept as it is (`ROUTING` in the table);
- under whole-layer recompute (`Layer+`, level 1, `auto`'s whole layers), the layer's checkpoint is selective
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`): those ops' outputs are saved in the forward and
  handed back in the recompute, so the recompute routes every token where the forward did.

What a router is: a module whose class name says so (`Qwen3MoeTopKRouter`, `GptOssTopKRouter`, `DeepseekV3TopkRouter`:
transformers 5's MoE routers), or a module named `gate` or `router` beside an `experts` module (the older form: a
plain `nn.Linear`). Its block is the module holding both. The flags are per thread: autograd runs a recompute in its
own thread on a GPU.
"""

import functools
import threading
from typing import List, Optional, Tuple

import torch
from torch import nn

from .. import _torch_api

# ops an MoE block runs on the routing's indices: what it makes from them is routing too (kept with them)
INDEX_OPS = frozenset(
    {"topk", "sort", "argsort", "histc", "bincount", "one_hot", "nonzero", "cumsum", "unique", "searchsorted"}
)

_state = threading.local()


def _depth(name: str) -> int:
    return getattr(_state, name, 0)


def in_router() -> bool:
    return _depth("router") > 0


def routing_op(func) -> bool:
    """Whether an op dispatched now makes routing: anything inside a router, an index op inside an MoE block."""
    return in_router() or (_depth("block") > 0 and _base_name(func) in INDEX_OPS)


def _base_name(func) -> str:
    return _torch_api.op_name(func).rstrip("_")


def routers(root: nn.Module) -> List[Tuple[nn.Module, nn.Module]]:
    """Each router under `root`, with its MoE block (the module holding it and the experts)."""
    found = []
    for block in root.modules():
        children = dict(block.named_children())
        for name, child in children.items():
            by_class = "router" in type(child).__name__.lower()
            by_name = name in ("gate", "router") and "experts" in children
            if by_class or by_name:
                found.append((child, block))
    return found


class Routing:
    """The hooks that say, as a layer runs, when an op is inside a router or an MoE block (`routing_op`)."""

    def __init__(self, layers: List[nn.Module]):
        found = [routers(layer) for layer in layers]
        self.layers = [bool(pairs) for pairs in found]  # which layers route (their checkpoint keeps it)
        self._pairs = [pair for pairs in found for pair in pairs]
        self._handles = []

    def trained(self) -> bool:
        """Whether any router's own weights train (the aux loss then has a gradient to give them)."""
        return any(p.requires_grad for r, _ in self._pairs for p in r.parameters())

    def install(self) -> None:
        blocks = {id(b): b for _, b in self._pairs}
        for module, name in [(r, "router") for r, _ in self._pairs] + [(b, "block") for b in blocks.values()]:
            self._handles.append(module.register_forward_pre_hook(functools.partial(_enter, name)))
            self._handles.append(module.register_forward_hook(functools.partial(_leave, name), always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def aux_loss_problem(module: nn.Module, output) -> Optional[str]:
    """Where a training forward's output (`module`'s) has a routers' aux loss that carries no gradient: what to say.
    Asked in step one where the routers' weights train: reentrant checkpointing runs a layer's forward under
    `torch.no_grad()`, and the router logits it hands out for the aux loss then carry none, so the aux loss trains
    nothing, without a word (the torch backend's own recompute is non-reentrant and keeps it: tests/test_moe.py)."""
    aux = output.get("aux_loss") if isinstance(output, dict) else getattr(output, "aux_loss", None)
    if not torch.is_tensor(aux) or aux.requires_grad:
        return None
    coef = getattr(getattr(module, "config", None), "router_aux_loss_coef", None)
    return (
        f"optimum-memopt: the routers' aux loss of {type(module).__name__} (`router_aux_loss_coef={coef}`) carries no "
        f"gradient in this training step, though the routers' weights train: something ran the routers without "
        f"autograd (reentrant checkpointing runs a layer's forward under `torch.no_grad()`, and the router logits it "
        f"hands out carry none), so the aux loss would train nothing. The torch backend recomputes the layers itself, "
        f"keeping the routing and the aux loss's gradient: turn that checkpointing off"
    )


def _enter(name: str, module, args) -> None:
    setattr(_state, name, _depth(name) + 1)


def _leave(name: str, module, args, out) -> None:
    setattr(_state, name, max(0, _depth(name) - 1))


def _keep_routing(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if routing_op(func) else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """A whole-layer checkpoint's contexts that save the routing's outputs in the forward and hand them back in the
    recompute (`checkpoint(..., context_fn=selective_context)`). A router may change its own outputs in place
    (Mixtral's `router_top_value /= ...sum()`): every op inside it is saved, the in-place one too, so the recompute
    gets each as the forward left it and runs none of them again (hence the cache's entries may have been changed
    since they were saved)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_routing, allow_cache_entry_mutation=True)
