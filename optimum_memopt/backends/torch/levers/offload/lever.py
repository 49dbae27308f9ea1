"""The offload lever on one model (`Offload`, the lever protocol's `Lever`): each chosen layer's training forward run
under the mover's saved-tensor hooks and its tensors fetched back as backward nears it; its options for the solver
from what `measure` read after step one."""

from typing import Callable, Dict, List, Optional

import torch

from .....memory import MIB
from .....plans import LeverOption
from ...apply.layers import distinct, find_layers
from ...decide.budget import LeverChoice
from ...measure.replay import RUN_ALWAYS
from ...measure.watch import first_grad_tensor
from ..protocol import Lever
from .measure import HOST_IS_DEVICE, OffloadMeasure, measure
from .measure import choices as offload_choices
from .mover import Mover
from .option import SYNTAX, layers_of


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
        if self.mover is None:
            device = next((p.device for p in self.layers[index].parameters()), torch.device("cpu"))
            self.mover = Mover(self.chosen, device)
        mover = self.mover
        if chosen:
            with mover.saving(index):
                out = forward()
        else:
            out = forward()
        first = first_grad_tensor(out)
        if first is not None:
            first.register_hook(lambda grad: mover.reached(index))
        return out

    def at_layer(self, index: int):
        """A layer offloaded, or one whose backward fetches one, runs in a dry run (its copies are the host's count and
        the mover's, which a replayed layer's record does not hold); None elsewhere."""
        if self.installed and (index in self.chosen or self._fetches_at(index)):
            return RUN_ALWAYS
        return None

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
