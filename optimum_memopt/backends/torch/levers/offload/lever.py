"""The offload lever on one model (`Offload`, the lever protocol's `Lever`): each chosen layer's training forward run
under the mover's saved-tensor hooks and its tensors fetched back as backward nears it; its options for the solver
from what `measure` read after step one."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .....memory import MIB
from .....plans import LeverOption
from ...apply.layers import distinct, find_layers
from ...decide.budget import LeverChoice
from ...measure.watch import as_node_runs, first_grad_tensor
from ..protocol import Lever
from .measure import HOST_IS_DEVICE, OffloadMeasure, measure
from .measure import choices as offload_choices
from .mover import Mover
from .option import SYNTAX, layers_of


@dataclass(frozen=True, eq=False)
class _Copies:
    """An offloaded layer's copies as a dry run records them (`Offload.layer_recorded`): their sizes (bytes, sorted),
    each one's host tensor's place among the storages the forward kept (None: the count does not see the host's), and
    whether the record holds every copy the forward made."""

    sizes: Tuple[int, ...]
    hosts: Tuple[Optional[int], ...]  # places in one record's order: compared only as seen or not
    whole: bool

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, _Copies)
            and self.whole
            and other.whole
            and self.sizes == other.sizes
            and [p is None for p in self.hosts] == [p is None for p in other.hosts]
        )


class Offload(Lever):
    """The lever on one model's layers (`protocol.Lever`). Its mechanism: the engine runs each layer's training forward
    through `around_layer`, which for a chosen layer enters the mover's saved-tensor hooks around it and marks where
    backward reaches the layer's output, which fetches that layer's tensors and those of the layers up to `ahead`
    before it; `install` / `remove` turn it on and off (between steps: a choice carried out at a step's first layer
    offloads that layer too). The engine's own hooks run inside (a planned op's recipe keeps its inputs; what the
    engine keeps as it is goes to these hooks); a layer recomputed whole saves its input through them (torch's
    checkpoint saves its inputs as saved tensors), and nothing else."""

    syntax = SYNTAX
    name = SYNTAX.name

    @classmethod
    def build(cls, model, settings, option: Optional[LeverOption], n_layers: int):
        """Installed where `Offload+` was asked (`option`); under `auto` with a budget in MiB, built off, its link and
        the host's room read after step one, for the solver to weigh (`choices`). Elsewhere nothing."""
        budget = getattr(settings, "budget", None)
        if option is None:
            if budget is None or budget.share is not None:
                return None, None
            lever = cls(model)
            lever.host_mb = budget.host_mb
            return lever, None
        lever = cls(model)
        lever.run_as(option)
        return lever, None

    def __init__(self, model):
        self.layers = distinct(find_layers(model))
        self.chosen: Dict[int, int] = {}  # layer index -> how many layers ahead its tensors are fetched
        self.mover: Optional[Mover] = None  # made at the first training forward, on the layers' device
        self._option: Optional[LeverOption] = None
        self.installed = False
        self.host_mb: Optional[float] = None  # `--memory_host_mb`: the host memory the copies may hold (None: read)

    def install(self) -> None:
        self.installed = True

    def remove(self) -> None:
        self.installed = False

    def run_as(self, option: Optional[LeverOption]) -> None:
        self.remove()
        self._option = option
        self.chosen = {} if option is None else layers_of(option, len(self.layers))
        self.mover = None
        if option is not None:
            self.install()

    @property
    def option(self) -> Optional[LeverOption]:
        return self._option if self.installed else None

    def around_layer(self, index: int, forward: Callable[[], object]):
        """A chosen layer's training forward under the mover's saved-tensor hooks. Where backward reaches the output
        of a chosen layer or of one up to `ahead` layers after a chosen one (the layers after the last chosen one
        too), the tensors of the chosen layers it is ahead of are fetched: without that mark, the last chosen layer's
        would come back only as its own backward asked for them, a copy waited for, not run under the backward
        before it (and held later than its figures say)."""
        if not self.installed:
            return forward()
        chosen = index in self.chosen
        if not chosen and not self._fetches_at(index):
            return forward()
        mover = self._mover_at(index)
        if chosen:
            with mover.saving(index):
                out = forward()
        else:
            out = forward()
        first = first_grad_tensor(out)
        if first is not None:
            as_node_runs(first, lambda: mover.reached(index))
        return out

    def _mover_at(self, index: int) -> Mover:
        if self.mover is None:
            device = next((p.device for p in self.layers[index].parameters()), torch.device("cpu"))
            self.mover = Mover(self.chosen, device)
        return self.mover

    def at_layer(self, index: int):
        """What the lever does to layer `index`: how far ahead an offloaded layer's tensors are fetched (None: not
        offloaded), and whether backward reaching it fetches another's; None where it does neither."""
        if self.installed and (index in self.chosen or self._fetches_at(index)):
            return self.chosen.get(index), self._fetches_at(index)
        return None

    # -- in a dry run that replays alike layers (`measure.replay`) ----------------------------------------------------
    def layer_recorded(self, index: int, count, kept: List[tuple]) -> Optional["_Copies"]:
        """An offloaded layer's copies alive as its forward ends, by size, each with the place in `kept` of its host
        tensor where the count sees it (the CPU's step); a copy let go of in the forward, or a host tensor the forward
        does not keep, and no record can stand for another layer (`_Copies.whole` false)."""
        if not self.installed or index not in self.chosen or self.mover is None:
            return None
        copies = self.mover.copies_of(index)
        places = {key: place for place, key in enumerate(kept)}
        made = sorted(
            (copy.nbytes, None if copy.host is None else places.get(count.identity(copy.host), -1)) for copy in copies
        )
        whole = sum(n for n, _ in made) == self.mover.moved_bytes.get(index) and all(p != -1 for _, p in made)
        return _Copies(tuple(n for n, _ in made), tuple(p for _, p in made), whole)

    def layer_replayed(self, index: int, record: Optional["_Copies"], kept, out):
        """A replayed layer's copies counted on the host again (`record`'s sizes; on the CPU its host tensors the
        stand-ins of the record's), and its fetch hooked to backward reaching it, as `around_layer` hooks it."""
        if not self.installed or (index not in self.chosen and not self._fetches_at(index)):
            return None
        mover = self._mover_at(index)
        held = None
        if index in self.chosen:
            held = mover.stand_in(index, record.sizes, [None if p is None else kept[p] for p in record.hosts], out)
        as_node_runs(out, lambda: mover.reached(index))
        return held

    def layer_backward(self, index: int, held) -> list:
        """The layer's copies fetched back to the device (its backward lets go of them)."""
        if held is None:
            if not self.installed or index not in self.chosen or self.mover is None:
                return []
            held = self.mover.copies_of(index)
        return [copy.fetched for copy in held if copy.fetched is not None]

    def _fetches_at(self, index: int) -> bool:
        """Whether backward reaching layer `index`'s output fetches a chosen layer's tensors (one `ahead` of it)."""
        return any(i < index <= i + ahead for i, ahead in self.chosen.items())

    def host_peak(self) -> int:
        return self.mover.host_peak if self.mover is not None else 0

    def on_host(self) -> int:
        """The bytes the host holds now for the offloaded tensors (0 once a step's graph is let go of)."""
        return self.mover.on_host() if self.mover is not None else 0

    # -- its measurement, options and notes ---------------------------------------------------------------------------
    def after_step_one(self, profile, resets: bool) -> None:
        device = next((p.device.type for layer in self.layers for p in layer.parameters()), "cpu")
        try:
            result = measure(device, self.host_mb, resets)
        except Exception as e:  # a measurement for the solver: its failure costs the run nothing else
            result = f"timing the link to the host failed ({type(e).__name__}: {e})"
        if isinstance(result, str):
            profile.lever_problems[self.name] = result
        else:
            result.ran = tuple(sorted(self.chosen.items())) if self.installed else ()
            profile.levers[self.name] = result

    def choices(self, profile, measured=None) -> List[LeverChoice]:
        """Off, and the first layers offloaded in a few counts, each on those layers recomputed whole
        (`measure.choices`: what each holds less, where, and what its copies cost past the compute they hide under);
        where nothing was measured, the option running now alone."""
        found = profile.levers.get(self.name)
        if not isinstance(found, OffloadMeasure) or profile.memory is None:
            option = self.option
            return [LeverChoice(self.name, option, self.plan(), recomputed=tuple(sorted(self.chosen)))]
        return offload_choices(profile, found)

    def unweighed(self, profile) -> Optional[str]:
        """Why its options were not weighed where they could have lowered the step (not on the CPU, where none can)."""
        problem = profile.lever_problems.get(self.name)
        if problem is None or problem == HOST_IS_DEVICE:
            return None
        return f"`Offload+` was not weighed: {problem}"

    def notes(self, profile) -> List[str]:
        out = []
        found = profile.levers.get(self.name) if profile is not None else None
        if isinstance(found, OffloadMeasure):
            out.append(
                f"the layers' saved tensors offloaded (`Offload+`): weighed on layers recomputed whole, their copies "
                f"at {found.link / 1e9:,.1f} GB/s a way ({found.link_how}), the host's room "
                f"{found.host_room / MIB:,.0f} MiB ({found.host_how})"
                + "".join(f"; not offered: {why}" for why in found.not_offered)
            )
        elif profile is not None and self.name in profile.lever_problems:
            out.append(f"`Offload+` not weighed: {profile.lever_problems[self.name]}")
        if self.mover is not None and self.mover.moved_bytes:
            moved = sum(self.mover.moved_bytes.values())
            out.append(
                f"the layers' saved tensors (`Offload+`, layers {', '.join(map(str, sorted(self.chosen)))}): "
                f"{moved / MIB:,.1f} MiB copied to the host in the last forward of those layers and fetched back "
                f"ahead of their backward"
            )
        return out
