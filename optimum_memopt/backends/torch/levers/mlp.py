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
"""

import inspect
import logging
import math
import statistics
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ....memory import MIB
from ....plans import FoundPlan, LeverSyntax, PlanEntry, layer_selector
from .. import _torch_api
from ..apply.layers import distinct, find_layers
from ..decide.budget import LeverChoice
from .protocol import Lever, sharded

logger = logging.getLogger(__name__)

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
MLP_NAMES = ("mlp", "feed_forward", "ffn")  # where a decoder layer holds its MLP, in transformers' families
REPEATS = 3  # each tiling is timed this many times (interleaved), its median taken
MOST_TILES = 64  # the most tiles measured for the table
BOUND_MARGIN = 0.25  # the first tile count's bound by the shapes is taken this much higher (`measure`)


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


def parse(option: str, n_layers: int) -> Dict[int, Optional[int]]:
    """The layers an option tiles and each one's tile count (None: the default): "0-7:tiles4;8-9", "" every layer."""
    out: Dict[int, Optional[int]] = {}
    for part in option.split(";") if option else [""]:
        entry = SYNTAX.entry(part) if part else PlanEntry(SYNTAX.plan)
        tiles = int(entry.parameter[len("tiles") :]) if entry.parameter else None
        for i in entry.select(n_layers):
            out[i] = tiles
    return out


def option_of(tiles: Dict[int, Optional[int]], n_layers: int) -> str:
    """`parse`'s inverse, grouped by tile count ("" for every layer at the default)."""
    by_count: Dict[Optional[int], List[int]] = {}
    for i, t in sorted(tiles.items()):
        by_count.setdefault(t, []).append(i)
    parts = []
    for t, layers in sorted(by_count.items(), key=lambda kv: kv[1][0]):
        where = "" if layers == list(range(n_layers)) else layer_selector(layers)
        parts.append(":".join(p for p in (where, f"tiles{t}" if t else "") if p))
    return ";".join(parts)


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


_TILES = "_memopt_mlp_tiles"  # the MLP's attribute holding its tile count while the lever runs it
_DRAWN = "_memopt_mlp_drawn"  # set on an MLP once its first tiled forward's draws were counted
_WHOLE_SAID = "_memopt_mlp_whole_said"  # set on an MLP once a call it could not tile was said


def _tiled_forward(mlp_self, *args, **kwargs):
    """The forward the lever puts on an MLP instance: tiled in training, the MLP's own otherwise (evaluation, no
    grad, or a call with more than the hidden states)."""
    tiles = vars(mlp_self).get(_TILES)
    own = type(mlp_self).forward.__get__(mlp_self)
    if tiles is None or not (mlp_self.training and torch.is_grad_enabled()):
        return own(*args, **kwargs)
    if kwargs or len(args) != 1 or not torch.is_tensor(args[0]) or args[0].dim() < 2:
        if not vars(mlp_self).get(_WHOLE_SAID):
            vars(mlp_self)[_WHOLE_SAID] = True
            logger.warning(
                "`MLP+`: %s was called in training with more than the hidden states (%s); it runs whole there",
                type(mlp_self).__name__, ", ".join([*(type(a).__name__ for a in args), *kwargs]),
            )  # fmt: skip
        return own(*args, **kwargs)
    if vars(mlp_self).get(_DRAWN) or _torch_api.in_backward():
        return tiled(own, args[0], tiles)
    vars(mlp_self)[_DRAWN] = True  # its first tiled training forward: its draws counted, said where tiles change them
    out, draws = drawn_by(own, args[0], tiles)
    if not exact_draws(draws, args[0].device.type):
        logger.warning(
            "`MLP+`: %s draws at random %d time(s) a forward (dropout); in %d tiles it draws its masks tile by tile, "
            "other masks than the whole MLP draws (%s): the run trains as another draw of the same distribution, not "
            "as the run without the plugin. `auto` does not tile such an MLP",
            type(mlp_self).__name__, draws, tiles,
            "several draws interleave" if draws > 1 else "a GPU's generator advances per call",
        )  # fmt: skip
    return out


class TiledMLP(Lever):
    """The lever on one model's layers (`protocol.Lever`). Its mechanism: `install` puts `_tiled_forward` on each
    chosen layer's MLP instance (removed whole by `remove`: the instance's own forward, or the one there before);
    `run_as` changes the layers and tile counts between steps."""

    syntax = SYNTAX
    name = SYNTAX.name

    @classmethod
    def build(cls, model, settings, option: Optional[str], n_layers: int):
        """Installed where `MLP+` was asked (`option`: every layer it names must hold an MLP the lever tiles, else
        refused with the reason), and measured after step one (the table's `MLP+` rows); under `auto` with a budget
        in MiB, built off, its MLPs marked in the steps watched and measured after step one, for the solver to weigh
        (`choices`). Elsewhere nothing."""
        if option is None:
            budget = getattr(settings, "budget", None)
            if budget is None or budget.share is not None:
                return None, None
            lever = cls(model)
            if all(m is None for m in lever.mlps):
                why = next((w for w in lever.why_not if w), "no layer holds an MLP")
                return None, f"`MLP+` cannot run on it: {why}"
            return lever, None
        lever = cls(model)
        chosen = parse(option, len(lever.layers))
        missing = [i for i in chosen if lever.mlps[i] is None]
        if missing:
            plans = ",".join(str(e) for e in SYNTAX.entries(option))
            raise ValueError(
                f"`--memory_opt_config` has {plans!r}, but layer {missing[0]} cannot be tiled: "
                f"{lever.why_not[missing[0]]}; drop `MLP+`, or name the layers it can tile"
            )
        lever.run_as(option)
        return lever, None

    def __init__(self, model: nn.Module):
        self.layers = distinct(find_layers(model))
        found = [mlp_of(layer) for layer in self.layers]
        self.mlps: List[Optional[nn.Module]] = [m for m, _ in found]
        self.why_not: List[Optional[str]] = [w for _, w in found]
        self.tiles: Dict[int, Optional[int]] = {}  # the layers tiled and each one's count (None: the default)
        self._option: Optional[str] = None
        self._put: Dict[int, object] = {}  # layer index -> what the MLP instance's forward was before ours
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        for i, tiles in self.tiles.items():
            mlp = self.mlps[i]
            vars(mlp)[_TILES] = tiles or default_tiles(mlp)
            self._put[i] = vars(mlp).get("forward")
            mlp.forward = types.MethodType(_tiled_forward, mlp)
        self.installed = True

    def remove(self) -> None:
        for i, before in self._put.items():
            mlp = self.mlps[i]
            vars(mlp).pop(_TILES, None)
            vars(mlp).pop(_DRAWN, None)
            vars(mlp).pop(_WHOLE_SAID, None)
            if before is None:
                vars(mlp).pop("forward", None)
            else:
                mlp.forward = before
        self._put = {}
        self.installed = False

    def run_as(self, option: Optional[str]) -> None:
        self.remove()
        self._option = option
        self.tiles = {} if option is None else parse(option, len(self.layers))
        if option is not None:
            self.install()

    @property
    def option(self) -> Optional[str]:
        return self._option if self.installed else None

    def tiles_at(self, index: int) -> Optional[int]:
        """The tile count layer `index`'s MLP runs with now (None: not tiled)."""
        if not self.installed or index not in self.tiles:
            return None
        return self.tiles[index] or default_tiles(self.mlps[index])

    # -- its measurement --------------------------------------------------------------------------------------------
    def marks(self):
        """Every layer's MLP, marked as "mlp": step one's segments hold the peak of the stretches it runs in."""
        return [(m, MARK) for m in distinct([m for m in self.mlps if m is not None])]

    def after_step_one(self, profile, resets: bool) -> None:
        try:
            result = measure(self, profile, resets)
        except Exception as e:  # a measurement for the table and the solver: its failure costs the run nothing else
            result = f"running one MLP alone failed ({type(e).__name__}: {e})"
        if isinstance(result, str):
            profile.lever_problems[self.name] = result
        else:
            profile.levers[self.name] = result

    def choices(self, profile, measured=None) -> List[LeverChoice]:
        """The options `auto` weighs: off; every layer in each tile count measured; and the layers whose own backward
        peaks highest, one more at a time, in the count that holds least. Each on layers recomputed whole only
        (`LeverChoice.recomputed`): there the MLP's saves are made in its layer's backward and gone after, so tiling
        moves no segment but the tiled layer's own forward and backward, in the stretches the MLP runs in (step one's
        `Segment.parts`, marked by `marks`). It moves those by what one MLP held less, measured alone: in its layer's
        forward, its forward under a checkpoint (as a layer recomputed whole runs it); in its layer's backward, its
        forward and backward with autograd's saves (the layer's recompute and backward). Where the MLP was not
        measured, or step one's segments were not marked inside, the way it runs now alone (with the reason in the
        table's notes); a count not run alone (its bound did not fit what step one's peak left free) is
        not offered, and where the count a layer ran was not run alone, nothing else is (no change from it can be
        priced)."""
        running = [LeverChoice(self.name, self.option, self.plan(), recomputed=tuple(sorted(self.tiles)))]
        measured_mlp = profile.levers.get(self.name)
        memory = profile.memory
        if measured_mlp is None or memory is None or not any(seg.parts for seg in memory.segments):
            return running
        if not measured_mlp.draws_as_whole():  # tiles would train another draw: never chosen
            return running
        ran = {self.tiles_at(i) or 1 for i in range(len(self.layers)) if self.mlps[i] is not None}
        if not ran <= set(measured_mlp.options):
            return running
        counts = sorted(c for c in measured_mlp.options if c > 1)
        if not counts:
            return running
        layers = [i for i in measured_mlp.same if i < len(profile.layers)]
        best = min(counts, key=lambda c: (measured_mlp.options[c].held_bytes, c))
        by_peak = sorted(layers, key=lambda i: -_own_backward_peak(memory, i))
        tilings: List[Dict[int, Optional[int]]] = [{}] if 1 in measured_mlp.options else []
        tilings += [{i: c for i in layers} for c in counts]
        tilings += [{i: best for i in by_peak[:k]} for k in range(1, len(by_peak))]
        if self.installed and self.tiles:
            tilings.append({i: self.tiles_at(i) for i in self.tiles})
        out, seen = [], set()
        for tiling in tilings:
            key = tuple(sorted(tiling.items()))
            if key in seen or not self._priced(tiling, measured_mlp):
                continue
            seen.add(key)
            out.append(self._choice(tiling, measured_mlp, memory))
        return out

    def _touched(self, tiling: Dict[int, int]) -> List[int]:
        """The layers a tiling tiles, and those the step as measured tiled (which it may run whole again)."""
        return sorted(set(tiling) | {i for i in self.tiles if self.installed})

    def _priced(self, tiling: Dict[int, int], measured) -> bool:
        """Whether every count `tiling` changes a layer from or to was run alone (a layer it leaves out runs whole:
        after a step one in tiles, whole may not have been)."""
        return all({tiling.get(i, 1), self.tiles_at(i) or 1} <= set(measured.options) for i in self._touched(tiling))

    def _choice(self, tiling: Dict[int, int], measured, memory) -> LeverChoice:
        """The option tiling `tiling`'s layers (index -> tile count), as the solver weighs it against the step as it
        ran (`tiles_at`: the counts it ran)."""
        base = (
            measured.options[1] if 1 in measured.options else min(measured.options.values(), key=lambda o: o.seconds)
        )
        parts = []
        for i in self._touched(tiling):
            now, then = tiling.get(i, 1), self.tiles_at(i) or 1  # both run alone (`_priced`)
            if now == then:
                continue
            a, b = measured.options[now], measured.options[then]
            forward = b.checkpointed_bytes - a.checkpointed_bytes  # what it holds less than the measured count
            backward = b.held_bytes - a.held_bytes
            parts.append((f"layer {i} forward", f"{MARK} forward", forward))
            recomputes = _stretches(memory, i)
            for tag in (f"{MARK} forward", f"after {MARK} forward") if recomputes else (f"{MARK} backward",):
                parts.append((f"layer {i} backward", tag, backward))
        seconds = sum(max(0.0, measured.options[c].seconds - base.seconds) for c in tiling.values())
        option = option_of({i: c for i, c in tiling.items()}, len(self.layers)) if tiling else None
        plan = "" if option is None else ",".join(str(e) for e in SYNTAX.entries(option))
        # every layer whose MLP runs otherwise than in the step measured stays recomputed whole, one untiled too: a
        # layer kept holds its MLP's saves from its forward to its backward, which no stretch's reading gives (a
        # tiled MLP keeps its tiles' inputs, a whole one its intermediates)
        touched = tuple(self._touched(tiling))
        return LeverChoice(self.name, option, plan, seconds=seconds, less_parts=tuple(parts), recomputed=touched)

    def rows(self, profile, drop) -> List[FoundPlan]:
        measured = profile.levers.get(self.name)
        if measured is None or 1 not in measured.options:  # the whole MLP not run alone: nothing to say less than
            return []
        out = []
        for count, option in sorted(measured.options.items()):
            if count == 1:
                continue
            applied = [i for i in measured.same if self.tiles_at(i) == count]  # the layers running it now
            saving = measured.options[1].held_bytes - option.held_bytes
            out.append(
                FoundPlan(
                    config=f"MLP+:1:-1@tiles{count}",
                    enabled=bool(applied),
                    frequency=measured.layers,
                    saving_bytes=float(saving),
                    applied_count=len(applied),
                    applied_saving_bytes=float(saving * len(applied)),
                    recompute_seconds=max(0.0, option.seconds - measured.options[1].seconds) * measured.layers,
                    head=True,
                )
            )
        return out

    def unweighed(self, profile) -> Optional[str]:
        measured, problem = profile.levers.get(self.name), profile.lever_problems.get(self.name)
        ran = {self.tiles_at(i) or 1 for i in range(len(self.layers)) if self.mlps[i] is not None}
        if measured is None:
            return f"the MLPs in tiles (`MLP+`): not measured each way they can run ({problem or 'not run'})"
        if not measured.draws_as_whole():
            return f"the MLPs in tiles (`MLP+`): never chosen, one draws at random {measured.draws} time(s) a forward"
        missing = sorted(ran - set(measured.options))
        if missing:
            as_ran = "whole" if missing == [1] else f"in {missing[0]} tiles"
            return (
                f"the MLPs in tiles (`MLP+`): one MLP run alone after step one was not run {as_ran}, as the step ran "
                f"it ({measured.why_not.get(missing[0], 'not run')}), so no change from it can be priced"
            )
        return None

    def notes(self, profile) -> List[str]:
        out = []
        if self.installed:
            counts = sorted({self.tiles_at(i) for i in self.tiles})
            out.append(
                f"`MLP+`: {len(self.tiles)} layer(s)' MLP run in {', '.join(map(str, counts))} tile(s) of tokens, "
                f"each tile's intermediates made again in backward"
            )
        measured, problem = profile.levers.get(self.name), profile.lever_problems.get(self.name)
        if measured is not None and 1 not in measured.options:
            out.append(
                f"the layers' MLPs (`MLP+`) have no rows: one MLP run alone after step one was not run whole "
                f"({measured.why_not.get(1, 'not run')})"
            )
        elif measured is not None:
            whole = measured.options[1]
            out.append(
                f"the layers' MLPs (`MLP+` rows): one MLP run alone after step one on its input's shape "
                f"({measured.tokens:,} tokens, hidden {measured.hidden}), whole and in each tile count, read after "
                f"every op once after a warm-up; whole it held {whole.held_bytes / MIB:,.1f} MiB at most, "
                f"{whole.kept_bytes / MIB:,.1f} MiB kept for backward; SAVING is what a row's MLP holds less at its "
                f"most, per layer, TIME what it adds to a step in all {measured.layers} layer(s)"
            )
        elif problem:
            out.append(f"the layers' MLPs were not measured each way they can run: {problem}")
        if measured is not None and not measured.draws_as_whole():
            out.append(
                f"`auto` does not tile the MLPs: one draws at random {measured.draws} time(s) a forward (dropout), "
                f"and in tiles it would draw other masks than whole (another draw, not the run without the plugin)"
            )
        return out


MARK = "mlp"  # the name the MLPs' stretches are marked by inside a layer's segments (`Segment.parts`)


def _own_backward_peak(memory, index: int) -> int:
    """The peak of layer `index`'s own backward in the step as measured (0 where it has no segment)."""
    name = f"layer {index} backward"
    return max((s.peak_bytes for s in memory.segments if s.name == name or s.name.startswith(name + " ")), default=0)


def _stretches(memory, index: int) -> bool:
    """Whether layer `index`'s backward recomputed its MLP in the step as measured (a stretch "mlp forward" in it):
    the MLP's backward is then that stretch and the next; else (its saves kept) the stretch "mlp backward"."""
    name = f"layer {index} backward"
    return any(
        tag == f"{MARK} forward"
        for s in memory.segments
        if s.name == name or s.name.startswith(name + " ")
        for tag, _ in s.parts
    )


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

    @property
    def layers(self) -> int:
        return len(self.same)

    def draws_as_whole(self) -> bool:
        """Whether its tiles draw the whole MLP's masks on the device the run trains on (`exact_draws`: a dry run's
        fake tensors stand for a GPU's, whose generator advances per call)."""
        return exact_draws(self.draws, "cuda" if self.fake else self.device)


def _signature(mlp: nn.Module) -> tuple:
    return (type(mlp).__name__, tuple((n, tuple(p.shape), p.dtype) for n, p in mlp.named_parameters()))


def tile_counts(tokens: int, default: int) -> List[int]:
    """Tile counts worth offering: 2, 4 and 8, and the default (intermediate size over hidden size), while a tile
    keeps at least one token."""
    return sorted({c for c in (2, 4, 8, default) if 1 < c <= min(tokens, MOST_TILES)})


def measure(lever: TiledMLP, profile, resets: bool = True):
    """One MLP run alone on the first tiled-able layer's input shape (hidden states drawn from a generator of the
    measurement's own: the process's streams stay the user's), under step one's autocast, whole and in each tile count
    of `tile_counts` and the ones running, read aside (`measure.aside`); it stands for every layer whose MLP has the
    same class and shapes. Never with more memory than step one's peak left free: the counts run from the most tiles
    down, each only where its bound fits: for the first, by the shapes (`BOUND_MARGIN` higher); for each after, what
    the count before held scaled by the tokens a tile holds (what a count holds is a part of its own and a part that
    grows with a tile's tokens: scaled whole, both are over-counted, never under). A count left out, and those after
    it, are said in `why_not`. Returns an `MLPMeasure`, or the reason there is none."""
    from ..measure.aside import current_bytes, held_aside

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

    held, times, checkpointed, why_not, bounds = {}, {}, {}, {}, {}
    fake = _torch_api.is_fake(weight)
    training = mlp.training
    mlp.train()
    try:
        last = None  # the count run before: (its tile's tokens, what it held)
        for count in counts:  # once each, not timed (the kernels' set-up), where its bound fits
            if last is None:
                bounds[count] = int((fixed + rows(count) * per_token) * (1 + BOUND_MARGIN))
            else:
                bounds[count] = -(-last[1] * rows(count) // last[0])
            bound = bounds[count]
            room = profile.memory.peak.peak_bytes - current_bytes(device)
            if bound > room and not fake:  # a dry run's tensors hold no memory: every count is run
                for rest in counts[counts.index(count) :]:
                    why_not[rest] = (
                        f"{'it' if rest == count else f'{count} tile(s) before it'} could hold up to "
                        f"{bound / MIB:,.1f} MiB, and step one's peak left {max(room, 0) / MIB:,.1f} MiB free"
                    )
                break
            most, seconds = held_aside(lambda: run(count), device, resets)
            checkpointed[count], _ = held_aside(lambda: forward_checkpointed(count), device, resets)
            last = (rows(count), most)
            if fake:  # a dry run's counts and times (a roofline of its ops) are the same every run: this one's
                held[count], times[count] = most, [seconds]
        measured = [c for c in counts if c in checkpointed]
        for _ in range(0 if fake else REPEATS):  # timed apart from the first run (the kernels' set-up), interleaved
            for count in measured:
                most, seconds = held_aside(lambda: run(count), device, resets)
                if count not in held:
                    held[count] = most
                times.setdefault(count, []).append(seconds)
    finally:
        mlp.train(training)
    if not measured:
        return f"the MLP was not run alone in any tile count: {why_not[counts[0]]}"
    options = {
        c: TilingOption(held[c], max(0, kept[c]), statistics.median(times[c]), checkpointed[c], bounds[c])
        for c in measured
    }
    return MLPMeasure(tokens, hidden, options, same, why_not, draws[0] if draws else 0, device, fake)


LEVER = TiledMLP
