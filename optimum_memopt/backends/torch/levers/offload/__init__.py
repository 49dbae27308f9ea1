"""The offload lever (`Offload+`): what a layer keeps for backward, its input above all, copied to the host as the
forward saves it and fetched back ahead of the backward that needs it.

A step holds, between a layer's forward and its backward, what autograd saved in the layer. With this lever the
chosen layers' saved storages wait in the host's memory instead (pinned, copied on a stream of their own on a card,
so that the copies overlap the compute), and come back `ahead` layers before their backward (`Offload+:1:-1@0-15`:
layers 0 to 15, the next layer's fetched as a layer's backward starts; `@0-15:ahead2`: two layers ahead). Exact:
the copies are copies, each saved tensor back as the view it was; the gradients are bitwise those of the run
without the lever, dropout included (tests/test_offload.py).

Combined with the layers' plans: a layer recomputing ops offloads what the engine keeps of it as it is (a recipe's
inputs stay); a layer recomputed whole offloads its input alone (torch's checkpoint saves its inputs as saved
tensors, through the hooks around it; each comes back at the version it was saved at, which the recompute's checks
compare). With `Loss+` and `MLP+` (a tiled MLP's tile inputs are held by their checkpoints, the rest of the layer
offloaded).

`auto` weighs it where the host is not the device (a card): the first layers offloaded, recomputed whole, priced by
what their copies take past the compute they hide under, within the host's room (`measure` states the rules); the dry
run counts it as the card holds it, and the host's peak beside.

The package, by job: `option` (the plan words, the layers and how far ahead each is fetched), `mover` (the saved-
tensor hooks, the copies out and back, the streams), `lever` (`Offload`: each chosen layer's forward run under the
mover, the lever's measurement and options), `measure` (the link and the host's room read after step one; the
options for the solver).
"""

from .lever import Offload
from .mover import Mover, Streams
from .option import DEFAULT_AHEAD, SYNTAX, layers_of

LEVER = Offload

__all__ = ["DEFAULT_AHEAD", "LEVER", "Mover", "Offload", "SYNTAX", "Streams", "layers_of"]
