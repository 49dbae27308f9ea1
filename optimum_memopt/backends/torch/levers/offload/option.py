"""The offload lever's option: its plan words (`SYNTAX`) and how far ahead of the backward a layer's tensors are
fetched (`ahead_of`)."""

from typing import Dict, Optional, Sequence

from .....plans import LeverOption, LeverPart, LeverSyntax

SYNTAX = LeverSyntax(
    name="offload",
    plan="Offload+",
    what="the layers' saved tensors",
    layers=True,
    parameter="prefetch",
    parameters=(("ahead", "N layers fetched ahead of the backward that needs them"),),
    default="the next layer's tensors fetched as a layer's backward starts (ahead1)",
    examples=("Offload+:1:-1", "Offload+:1:-1@0-15", "Offload+:1:-1@0-15:ahead2"),
)

DEFAULT_AHEAD = 1


def layers_of(option: LeverOption, n_layers: int) -> Dict[int, int]:
    """The layers an option offloads, each with how many layers ahead of its backward their tensors are fetched;
    a part naming no layers names every one, a later part wins on a layer an earlier one named."""
    out: Dict[int, int] = {}
    for part in option.parts:
        for i in part.layers if part.layers is not None else range(n_layers):
            out[i] = part.number or DEFAULT_AHEAD
    return out


def ahead_of(layers: Dict[int, int]) -> Optional[int]:
    """The farthest any offloaded layer fetches ahead (None: no layer)."""
    return max(layers.values()) if layers else None


def layer_option(layers: Sequence[int], ahead: int, n_layers: int) -> LeverOption:
    """The option offloading `layers` (of `n_layers`), fetched `ahead` layers ahead (the default unnamed): one part,
    no layers named where it offloads every layer (`layers_of`'s inverse for one `ahead`)."""
    where = None if list(layers) == list(range(n_layers)) else tuple(layers)
    return LeverOption(
        (LeverPart(where, "ahead" if ahead != DEFAULT_AHEAD else None, ahead if ahead != DEFAULT_AHEAD else None),)
    )
