"""One MLP measured after step one, whole and in each tile count (`measure`, on the shared harness `measure.ways`)."""

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ... import _torch_api
from ...sharding import sharded
from .option import default_tiles, tile_counts
from .tiles import drawn_by, exact_draws, tiled

REPEATS = 3  # each tiling is timed this many times (interleaved), its median taken


BOUND_MARGIN = 0.25  # the first tile count's bound by the shapes is taken this much higher (`measure`)


@dataclass(frozen=True)
class TilingOption:
    """One MLP run one way (1 tile: whole), measured aside: the most it held above its start (its forward and
    backward, with autograd's saves), what it kept for backward (held after its forward), the most its forward held
    run under a checkpoint (as in a layer recomputed whole: nothing saved), and its seconds (forward and backward)."""

    held_bytes: int
    kept_bytes: int
    seconds: float
    checkpointed_bytes: int = 0
    bound_bytes: int = 0  # the most it could hold before it ran, by the shapes (`measure`; checked by the tests)


@dataclass
class MLPMeasure:
    """The MLP measured after step one on its input's shape, whole (1 tile) and in each tile count; which layers it
    stands for (those whose MLP has the same class and shapes)."""

    tokens: int
    hidden: int
    options: Dict[int, TilingOption]  # by tile count (1: whole), those run
    same: List[int] = field(default_factory=list)  # the layers this measure stands for
    why_not: Dict[int, str] = field(default_factory=dict)  # the counts not run, and why (their bound did not fit)
    draws: int = 0  # the random draws one forward of it makes (dropout's): tiles draw other masks (`exact_draws`)
    device: str = "cpu"  # where it ran ("cpu" for a dry run's fake tensors)
    fake: bool = False  # a dry run's: the run it stands for is taken to be on a GPU
    from_dry_run: bool = False  # a run's own dry run's, taken over after the run's step one (`taken_over`)

    @property
    def layers(self) -> int:
        return len(self.same)

    def draws_as_whole(self) -> bool:
        """Whether its tiles draw the whole MLP's masks on the device the run trains on (`exact_draws`: a dry run's
        fake tensors stand for a GPU's, whose generator advances per call)."""
        return exact_draws(self.draws, "cuda" if self.fake else self.device)


def taken_over(measured: "MLPMeasure", tokens: int, ran: set, device: str) -> Optional["MLPMeasure"]:
    """The run's own dry run's measurement (`measured`, of the same step on fake tensors) as the run's step one's
    (`TiledMLP.adopt`), on the run's `device` (where its draws are counted as that device draws them), or None where
    it does not stand for the step: other shapes, or a tile count step one ran (`ran`) that it did not measure."""
    if not measured.fake or measured.tokens != tokens or not ran <= set(measured.options):
        return None
    return replace(measured, device=device, fake=False, from_dry_run=True)


def _signature(mlp: nn.Module) -> tuple:
    return (type(mlp).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in mlp.named_parameters()))


def measure(lever, profile, resets: bool = True):
    """One MLP of `lever` (a `TiledMLP`) run alone on the first tiled-able layer's input shape, under step one's
    autocast, whole and in each tile count of `tile_counts` and the ones running, on the shared harness
    (`measure.ways`: from the most tiles down, each only where its bound fits what step one's peak, or `auto`'s budget
    where higher, left free, read aside, interleaved repeats); it stands for every layer whose MLP has the same class
    and shapes. The first count's bound is by the shapes (`BOUND_MARGIN` higher); each after it, what the count
    before held scaled by the tokens a tile holds (a part of what a count holds is its own, a part grows with a tile's
    tokens: scaled whole, both are over-counted, never under; tests/test_mlp.py). The input comes from a generator of
    the measurement's own (the process's streams stay the user's). An `MLPMeasure`, or the reason there is none."""
    from ...measure.aside import current_bytes, held_aside
    from ...measure.ways import run_ways

    first = next((i for i, m in enumerate(lever.mlps) if m is not None), None)
    if first is None:
        return lever.why_not[0] or "no layer holds an MLP the lever tiles"
    shape = profile.layers[first].shape if first < len(profile.layers) else ()
    if len(shape) < 2:
        return "step one's layers took no hidden states to count the tokens by"
    if profile.memory is None:
        return (
            "step one's memory was not read, so how much the MLP run alone may take without going above step one's "
            "peak is not known"
        )
    mlp = lever.mlps[first]
    how = sharded(mlp)
    if how is not None:
        return f"the MLP's weights are sharded ({how}): measured alone they would be gathered on one process's say"
    params = [p for p in mlp.parameters() if p.requires_grad]
    weight = next(mlp.parameters())
    device = weight.device.type
    same = [i for i, m in enumerate(lever.mlps) if m is not None and _signature(m) == _signature(mlp)]
    tokens, hidden = math.prod(shape[:-1]), shape[-1]
    running = (c for c in (lever.tiles_at(i) for i in same) if c)
    counts = sorted({1, *tile_counts(tokens, default_tiles(mlp)), *running}, reverse=True)  # the most tiles first
    autocast = getattr(torch, profile.autocast) if profile.autocast else None
    itemsize = max(weight.element_size(), torch.finfo(autocast).bits // 8 if autocast is not None else 0)
    widest = max((max(p.shape) for p in mlp.parameters() if p.dim() == 2), default=hidden)  # Linear's or Conv1D's
    # the first count's bound: what any count holds besides its tiles' intermediates (the output, its gradient and
    # the input's, the tiles' outputs put together; the weights' gradients, summed and a tile's), and what a token of
    # a tile adds (its intermediates kept and their gradients: twelve rows of the widest projection, more than the
    # gated and the GELU MLPs of transformers' families hold; checked by tests/test_mlp.py)
    fixed = 4 * tokens * hidden * itemsize + 2 * sum(p.numel() * p.element_size() for p in params)
    per_token = 12 * widest * itemsize
    own = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=own, dtype=weight.dtype, device=weight.device, requires_grad=True)
    forward = type(mlp).forward.__get__(mlp)
    kept: Dict[int, int] = {}

    draws: List[int] = []  # one forward's draws, counted in the first run only (the timed runs count nothing)

    def run(count: int) -> None:
        start = current_bytes(device)
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            if draws:
                out = forward(x) if count == 1 else tiled(forward, x, count)
            else:
                out, drawn = drawn_by(forward, x, count)
                draws.append(drawn)
        kept[count] = current_bytes(device) - start - out.numel() * out.element_size()
        grads = torch.autograd.grad(out, [x, *params], torch.ones_like(out))
        del grads, out

    def forward_checkpointed(count: int) -> None:
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            out = checkpoint(
                (lambda t: forward(t)) if count == 1 else (lambda t: tiled(forward, t, count)), x, use_reentrant=False
            )
        del out

    def rows(count: int) -> int:
        return -(-tokens // count)

    def bound(tile: int, last: Optional[Tuple[int, int]]) -> int:
        if last is None:  # by the shapes
            return int((fixed + tile * per_token) * (1 + BOUND_MARGIN))
        return -(-last[1] * tile // last[0])  # what the count before held, scaled by a tile's tokens

    def also(count: int) -> int:
        return held_aside(lambda: forward_checkpointed(count), device, resets)[0]

    fake = _torch_api.is_fake(weight)
    training = mlp.training
    mlp.train()
    try:  # the most tiles first (the fewest rows a tile)
        got = run_ways(counts, rows, bound, run, device, profile.room(), fake, REPEATS, resets, also)
    finally:
        mlp.train(training)
    if not got.held:
        return f"the MLP was not run alone in any tile count: {got.why_not[counts[0]]}"
    options = {
        c: TilingOption(got.held[c], max(0, kept[c]), got.seconds[c], got.also[c], got.bounds[c])
        for c in counts
        if got.ran(c)
    }
    why_not = got.why_not
    return MLPMeasure(tokens, hidden, options, same, why_not, draws[0] if draws else 0, device, fake)
