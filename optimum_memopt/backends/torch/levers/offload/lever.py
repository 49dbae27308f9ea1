"""The offload lever on one model (`Offload`, the lever protocol's `Lever`): hooks on each chosen layer that run its
training forward under the mover's saved-tensor hooks and fetch its tensors back as backward nears it, put on and
taken off whole."""

from typing import Dict, List, Optional

import torch

from .....memory import MIB
from .....plans import LeverOption
from ...apply.layers import distinct, find_layers
from ...measure.watch import first_grad_tensor
from ..protocol import Lever
from .mover import Mover
from .option import SYNTAX, layers_of


class Offload(Lever):
    """The lever on one model's layers (`protocol.Lever`). Its mechanism: `install` puts a forward pre-hook and a
    forward hook on each chosen layer (`remove` takes them off); in training the pre-hook enters the mover's
    saved-tensor hooks for the layer, the hook leaves them and marks where backward reaches the layer's output, which
    fetches that layer's tensors and those of the layers up to `ahead` before it. The engine's own hooks run inside
    (a planned op's recipe keeps its inputs; what the engine keeps as it is goes to these hooks); a layer recomputed
    whole saves its input through them (torch's checkpoint saves its inputs as saved tensors), and nothing else."""

    syntax = SYNTAX
    name = SYNTAX.name

    @classmethod
    def build(cls, model, settings, option: Optional[LeverOption], n_layers: int):
        """Installed where `Offload+` was asked (`option`). Not weighed by `auto` yet: elsewhere nothing, said in the
        table's notes."""
        if option is None:
            if getattr(settings, "budget", None) is None:
                return None, None
            return None, "`auto` does not weigh `Offload+` yet: name the layers to offload in the plans"
        lever = cls(model)
        lever.run_as(option)
        return lever, None

    def __init__(self, model):
        self.layers = distinct(find_layers(model))
        self.chosen: Dict[int, int] = {}  # layer index -> how many layers ahead its tensors are fetched
        self.mover: Optional[Mover] = None  # made at the first training forward, on the layers' device
        self._option: Optional[LeverOption] = None
        self._handles: list = []
        self._open: Dict[int, list] = {}  # layer index -> the hooks' contexts its running forwards entered
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        for i in self.chosen:
            layer = self.layers[i]
            self._handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._enter(i, m)))
            self._handles.append(layer.register_forward_hook(lambda m, a, o, i=i: self._leave(i, o), always_call=True))
        self.installed = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
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

    def _enter(self, index: int, layer) -> None:
        if not (layer.training and torch.is_grad_enabled()):
            self._open.setdefault(index, []).append(None)
            return
        if self.mover is None:
            device = next((p.device for p in layer.parameters()), torch.device("cpu"))
            self.mover = Mover(self.chosen, device)
        hooks = self.mover.saving(index)
        hooks.__enter__()
        self._open.setdefault(index, []).append(hooks)

    def _leave(self, index: int, out) -> None:
        hooks = self._open[index].pop()
        if hooks is None:
            return
        hooks.__exit__(None, None, None)
        first = first_grad_tensor(out)
        if first is not None:
            mover = self.mover
            first.register_hook(lambda grad: mover.reached(index))

    def on_host(self) -> int:
        """The bytes the host holds now for the offloaded tensors (0 once a step's graph is let go of)."""
        return self.mover.on_host() if self.mover is not None else 0

    def notes(self, profile) -> List[str]:
        if self.mover is None or not self.mover.moved_bytes:
            return []
        moved = sum(self.mover.moved_bytes.values())
        return [
            f"the layers' saved tensors (`Offload+`, layers {', '.join(map(str, sorted(self.chosen)))}): "
            f"{moved / MIB:,.1f} MiB copied to the host in the last forward of those layers and fetched back ahead "
            f"of their backward; not measured each way nor weighed by `auto` yet"
        ]
