"""An MLP run in tiles of tokens: where a decoder layer holds its MLP (`mlp_of`), its forward over tiles each under
checkpoint (`tiled`), and the random draws one forward makes (`drawn_by`, `exact_draws`).
"""

import inspect
from typing import Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ... import _torch_api

MLP_NAMES = ("mlp", "feed_forward", "ffn")  # where a decoder layer holds its MLP, in transformers' families


def mlp_of(layer: nn.Module) -> Tuple[Optional[nn.Module], Optional[str]]:
    """The layer's MLP, or None and why the lever cannot tile it."""
    for name in MLP_NAMES:
        mlp = getattr(layer, name, None)
        if not isinstance(mlp, nn.Module):
            continue
        kind = type(mlp).__name__
        if any(hasattr(mlp, a) for a in ("experts", "router")) or "moe" in kind.lower() or "sparse" in kind.lower():
            return None, (
                f"{type(layer).__name__}.{name} is a mixture of experts ({kind}): its routing is kept, never "
                f"recomputed, and tiles would route apart"
            )
        params = [p for p in inspect.signature(mlp.forward).parameters.values() if p.kind != p.VAR_KEYWORD]
        if len(params) != 1 or params[0].kind == params[0].VAR_POSITIONAL:
            more = ", ".join(f"`{p.name}`" for p in params[1:]) or "any number of arguments"
            return None, (
                f"{type(layer).__name__}.{name} ({kind}) takes more than the hidden states ({more}); the lever tiles "
                f"an MLP that takes the hidden states alone and acts on each token apart"
            )
        return mlp, None
    return None, (
        f"{type(layer).__name__} holds no MLP the lever knows (an attribute {', '.join(map(repr, MLP_NAMES))})"
    )


def tiled(mlp_forward, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """`mlp_forward` over `tiles` tiles of `x`'s tokens (its leading dimensions), each under checkpoint: the output
    is `mlp_forward(x)`'s, each tile's intermediates made again in backward."""
    flat = x.reshape(-1, x.shape[-1])
    outs = [
        checkpoint(mlp_forward, tile.unsqueeze(0), use_reentrant=False, preserve_rng_state=True)
        for tile in flat.tensor_split(min(tiles, flat.shape[0]))
    ]
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _Draws(_torch_api.TorchDispatchMode):
    """Counts the ops that draw from a random generator (`torch.Tag.nondeterministic_seeded`: dropout's, `rand`'s)
    while it is on."""

    def __init__(self):
        super().__init__()
        self.count = 0

    @_torch_api.answers_fake_device
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            self.count += 1
        return func(*args, **(kwargs or {}))


def drawn_by(forward, x: torch.Tensor, tiles: int) -> Tuple[torch.Tensor, int]:
    """`forward(x)`, in `tiles` tiles (1: whole), and the random draws one forward of the MLP made (each tile runs
    the whole forward: the draws counted over the tiles, shared out)."""
    with _Draws() as drawn:
        out = forward(x) if tiles == 1 else tiled(forward, x, tiles)
    calls = 1 if tiles == 1 else max(1, min(tiles, x.shape[:-1].numel()))
    return out, -(-drawn.count // calls)


def exact_draws(draws: int, device: str) -> bool:
    """Whether an MLP drawing `draws` times a forward draws, in tiles, the masks it draws whole: none drawn; or one
    draw on the CPU, whose kernel draws element by element in tokens' order (tested: GPT-2's MLP). Two draws or more
    (two dropouts; LoRA's dropout on each projection) interleave tile by tile, and a GPU's generator advances per
    call: another draw of the same distribution."""
    return draws == 0 or (draws == 1 and device == "cpu")
