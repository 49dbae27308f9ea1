"""The tiled MLP on one model (`TiledMLP`, the lever protocol's `Lever`): its forward put on each chosen layer's MLP
instance and taken off whole, and its options for the solver and rows for the table from what was measured.
"""

import logging
import math
import types
from typing import Dict, List, Optional

import torch
from torch import nn

from .....memory import MIB
from .....plans import FoundPlan, LeverOption
from ... import _torch_api
from ...apply.layers import distinct, find_layers
from ...decide.budget import LeverChoice
from ...measure.profile import Place
from ..protocol import Lever
from .measure import MLPMeasure, measure, taken_over
from .option import SYNTAX, default_tiles, option_of, parse
from .tiles import drawn_by, exact_draws, mlp_of, tiled

logger = logging.getLogger(__name__)


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
    def build(cls, model, settings, option: Optional[LeverOption], n_layers: int):
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
            plans = SYNTAX.plan_of(option)
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
        self._option: Optional[LeverOption] = None
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

    def run_as(self, option: Optional[LeverOption]) -> None:
        self.remove()
        self._option = option
        self.tiles = {} if option is None else parse(option, len(self.layers))
        if option is not None:
            self.install()

    @property
    def option(self) -> Optional[LeverOption]:
        return self._option if self.installed else None

    def tiles_at(self, index: int) -> Optional[int]:
        """The tile count layer `index`'s MLP runs with now (None: not tiled)."""
        if not self.installed or index not in self.tiles:
            return None
        return self.tiles[index] or default_tiles(self.mlps[index])

    def at_layer(self, index: int) -> Optional[int]:
        """The tiles layer `index`'s MLP runs in now (None: whole)."""
        return self.tiles_at(index)

    # -- its measurement --------------------------------------------------------------------------------------------
    def marks(self):
        """Every layer's MLP, marked as "mlp": step one's segments hold the peak of the stretches it runs in."""
        return [(m, MARK) for m in distinct([m for m in self.mlps if m is not None])]

    def measured_modules(self):
        first = next((m for m in self.mlps if m is not None), None)  # the one `measure` runs alone
        return [first] if first is not None else []

    def after_step_one(self, profile, resets: bool) -> None:
        try:
            result = measure(self, profile, resets)
        except Exception as e:  # a measurement for the table and the solver: its failure costs the run nothing else
            result = f"running one MLP alone failed ({type(e).__name__}: {e})"
        if isinstance(result, str):
            profile.lever_problems[self.name] = result
        else:
            profile.levers[self.name] = result

    def adopt(self, measured, profile) -> bool:
        """The run's dry run's MLP measured whole and in each tile count (`measure.taken_over`): the same layer's
        input shape, every tile count step one ran among those measured."""
        first = next((i for i, m in enumerate(self.mlps) if m is not None), None)
        if not isinstance(measured, MLPMeasure) or first is None or first >= len(profile.layers):
            return False
        shape = profile.layers[first].shape
        if len(shape) < 2:
            return False
        ran = {self.tiles_at(i) or 1 for i in range(len(self.layers)) if self.mlps[i] is not None}
        device = next(self.mlps[first].parameters()).device.type
        taken = taken_over(measured, math.prod(shape[:-1]), ran, device)
        if taken is None:
            return False
        profile.levers[self.name] = taken
        return True

    def choices(self, profile, measured=None) -> List[LeverChoice]:
        """The options `auto` weighs: off; every layer in each tile count measured; and the layers whose own backward
        peaks highest, one more at a time, in the count that holds least. Each on layers recomputed whole only
        (`LeverChoice.recomputed`): there the MLP's saves are made in its layer's backward and gone after, so tiling
        moves no segment but the tiled layer's own forward and backward, in the stretches the MLP runs in (step one's
        `Segment.parts`, marked by `marks`). It moves those by what one MLP held less, measured alone: in its layer's
        forward, its forward under a checkpoint (as a layer recomputed whole runs it); in its layer's backward, its
        forward and backward with autograd's saves (the layer's recompute and backward). Where the MLP was not
        measured, or step one's segments were not marked inside, the way it runs now alone (with the reason in the
        table's notes); a count not run alone (its bound did not fit what step one's peak, or `auto`'s budget
        where higher, left free) is
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
            parts.append((Place.forward(i), f"{MARK} forward", forward))
            recomputes = _stretches(memory, i)
            for tag in (f"{MARK} forward", f"after {MARK} forward") if recomputes else (f"{MARK} backward",):
                parts.append((Place.backward(i), tag, backward))
        seconds = sum(max(0.0, measured.options[c].seconds - base.seconds) for c in tiling.values())
        option = option_of({i: c for i, c in tiling.items()}, len(self.layers)) if tiling else None
        plan = SYNTAX.plan_of(option)
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
                    recompute_seconds=None  # the dry run's clock is not this run's: not timed here (`notes`)
                    if measured.from_dry_run
                    else max(0.0, option.seconds - measured.options[1].seconds) * measured.layers,
                    lever=self.name,
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
            how = (
                "in the run's dry run before step one, on fake tensors of its input's shape (every byte as the "
                "device counts it; not run again on the device, so no TIME)"
                if measured.from_dry_run
                else "after step one on its input's shape"
            )
            read = "read after every op" if measured.from_dry_run else "read after every op once after a warm-up"
            out.append(
                f"the layers' MLPs (`MLP+` rows): one MLP run alone {how} "
                f"({measured.tokens:,} tokens, hidden {measured.hidden}), whole and in each tile count, {read}; "
                f"whole it held {whole.held_bytes / MIB:,.1f} MiB at most, "
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
    at = Place.backward(index)
    return max((s.peak_bytes for s in memory.segments if s.place.in_step() == at), default=0)


def _stretches(memory, index: int) -> bool:
    """Whether layer `index`'s backward recomputed its MLP in the step as measured (a stretch "mlp forward" in it):
    the MLP's backward is then that stretch and the next; else (its saves kept) the stretch "mlp backward"."""
    at = Place.backward(index)
    return any(tag == f"{MARK} forward" for s in memory.segments if s.place.in_step() == at for tag, _ in s.parts)
