"""The tiled MLP's option: its plan words (`SYNTAX`), the layers and tile counts an option names (`parse`,
`option_of`), and the counts worth offering."""

import math
from typing import Dict, List, Optional

from torch import nn

from .....plans import LeverOption, LeverPart, LeverSyntax

SYNTAX = LeverSyntax(
    name="mlp",
    plan="MLP+",
    what="the layers' MLPs",
    layers=True,
    parameter="tiling",
    parameters=(("tiles", "N tiles of tokens"),),
    default="intermediate size / hidden size tiles (rounded up), whose intermediates hold about the MLP's input",
    examples=("MLP+:1:-1", "MLP+:1:-1@tiles4", "MLP+:1:-1@0-7:tiles4"),
)


MOST_TILES = 64  # the most tiles measured for the table


def default_tiles(mlp: nn.Module) -> int:
    """Intermediate size over hidden size, rounded up (2 where the sizes cannot be read)."""
    linears = [m for m in mlp.modules() if isinstance(m, nn.Linear)] or [
        m for m in mlp.modules() if hasattr(m, "weight") and getattr(m.weight, "dim", lambda: 0)() == 2
    ]
    if not linears:
        return 2
    first = linears[0].weight
    hidden = first.shape[1] if isinstance(linears[0], nn.Linear) else first.shape[0]
    widest = max(max(m.weight.shape) for m in linears)
    return max(1, math.ceil(widest / max(1, hidden)))


def parse(option: LeverOption, n_layers: int) -> Dict[int, Optional[int]]:
    """The layers an option tiles and each one's tile count (None: the default); a part naming no layers names every
    one; a later part's count wins on a layer an earlier one named."""
    out: Dict[int, Optional[int]] = {}
    for part in option.parts:
        for i in part.layers if part.layers is not None else range(n_layers):
            out[i] = part.number
    return out


def option_of(tiles: Dict[int, Optional[int]], n_layers: int) -> LeverOption:
    """`parse`'s inverse, a part a tile count in the order of its first layer (no layers named where it tiles every
    layer)."""
    by_count: Dict[Optional[int], List[int]] = {}
    for i, t in sorted(tiles.items()):
        by_count.setdefault(t, []).append(i)
    parts = []
    for t, layers in sorted(by_count.items(), key=lambda kv: kv[1][0]):
        where = None if layers == list(range(n_layers)) else tuple(layers)
        parts.append(LeverPart(where, "tiles" if t else None, t))
    return LeverOption(tuple(parts))


def tile_counts(tokens: int, default: int) -> List[int]:
    """Tile counts worth offering: 2, 4 and 8, and the default (intermediate size over hidden size), while a tile
    keeps at least one token."""
    return sorted({c for c in (2, 4, 8, default) if 1 < c <= min(tokens, MOST_TILES)})
