"""The tiled MLP lever (`MLP+`): a decoder layer's MLP run over tiles of tokens, each tile's intermediates made again
in backward.

Once the layers are recomputed and the loss is chunked, a step at long sequences peaks in one layer's backward: the
layer's recompute brings all its tensors back at once, the MLP's intermediates (tokens x intermediate size, three or
four of them in a gated MLP) the largest. With this lever the MLP's forward runs on the tokens in tiles, each under
`torch.utils.checkpoint` (non-reentrant, RNG state kept and restored per tile: a dropout inside, LoRA's included,
draws in the recompute what it drew in the forward): what it keeps for backward is each tile's input (views of the
MLP's input, which its first projection keeps anyway), and backward makes one tile's intermediates at a time. Its
price is one more MLP forward a step in the tiled layers.

Exact: the MLP is row-wise (each token's output depends on that token alone), so each tile's output and input
gradient are those rows of the whole MLP's, bitwise (the same kernels on fewer rows); the weights' gradients are
summed tile by tile, equal to the summation order. A dropout inside the MLP draws its masks tile by tile, in tokens'
order: with one draw a forward, on the CPU, the same masks as the whole tensor's (its kernel draws element by element;
tested against the plain run); with several (two dropouts, LoRA's on each projection) the draws interleave tile by
tile, and a GPU's generator advances per call: the run is another draw of the same distribution, said at the first
tiled forward (`exact_draws`), and `auto` never tiles such an MLP.

The tile count is a number (`MLP+:1:-1@tiles4`), or by default the intermediate size over the hidden size (rounded
up): tiles whose intermediates hold about what the MLP's input holds. It is never derived from a batch's length:
ranks whose batches differ in length would tile differently, and under ZeRO-3 (which gathers the weights at each
tile's call, in the forward and in the recompute) ranks calling a different number of times wait on each other
forever. With a count, every rank tiles alike.

`auto` weighs it (`TiledMLP.choices`) on layers recomputed whole: step one's segments are read in the stretches each
layer's MLP runs in (`marks`: its forward, its recompute and backward), and each tiling moves those stretches by what
one MLP, measured alone after step one, held less. The table's `MLP+` rows say what one MLP holds less each way.

Refused with the reason: a layer whose MLP the lever does not find (an attribute `mlp`, `feed_forward` or `ffn` whose
forward takes the hidden states alone), and a mixture of experts (its routing is kept, never recomputed, by the
engine: `apply/routing.py`; tiling it would route each tile apart).

The package, by job: `option` (the plan words, the layers and tile counts an option names), `tiles` (the MLP found
in a layer, run in tiles, its draws counted), `lever` (`TiledMLP`: its forward on the MLPs, installed and removed; its
options for the solver and rows for the table), `measure` (one MLP measured each way on the shared harness).
"""

from .lever import MARK, TiledMLP
from .measure import BOUND_MARGIN, REPEATS, MLPMeasure, TilingOption, measure
from .option import MOST_TILES, SYNTAX, default_tiles, option_of, parse, tile_counts
from .tiles import MLP_NAMES, drawn_by, exact_draws, mlp_of, tiled

LEVER = TiledMLP

__all__ = [
    "BOUND_MARGIN",
    "LEVER",
    "MARK",
    "MLPMeasure",
    "MLP_NAMES",
    "MOST_TILES",
    "REPEATS",
    "SYNTAX",
    "TiledMLP",
    "TilingOption",
    "default_tiles",
    "drawn_by",
    "exact_draws",
    "measure",
    "mlp_of",
    "option_of",
    "parse",
    "tile_counts",
    "tiled",
]
