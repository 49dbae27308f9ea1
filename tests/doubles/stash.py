"""A lever double for the lever protocol's tests: `Stash+`, a lever that acts in layers and takes a parameter
(`Stash+:1:-1@0-1:copies2`: layers 0 and 1, two copies in flight), shaped as an offload is: its work (a copy of each
layer's input off the compute's path) overlaps the compute, and its options say so (`overlap_seconds` against
`window_seconds`).

Its mechanism is real but changes nothing a step computes: a forward pre-hook on each layer it acts in counts the
calls and the input bytes it would copy. Its measurement after step one reads each layer's input shape and op time
from the profile and times one copy of a tensor of that shape. Its options offer the bytes of the layers' inputs as
held less in the segment after the layers' forward (what an offload would take off the device), with the copy's
time as overlapped work hidden under the layers' op time. It proves the protocol's plumbing (grammar, policy, solver,
table, install and removal) and the solver's pricing of overlapped work; it frees nothing (it is not offload).
"""

import math
import time
from typing import List, Optional

import torch

from optimum_memopt.backends.torch.apply.layers import find_layers
from optimum_memopt.backends.torch.decide.budget import LeverChoice
from optimum_memopt.backends.torch.levers.protocol import Lever
from optimum_memopt.backends.torch.measure.profile import HEAD_PLACE
from optimum_memopt.plans import FoundPlan, LeverOption, LeverPart, LeverSyntax

SYNTAX = LeverSyntax(
    name="stash",
    plan="Stash+",
    what="the layers' stashed inputs",
    layers=True,
    parameter="copy count",
    parameters=(("copies", "N copies in flight"),),
    default="one copy in flight",
    examples=("Stash+:1:-1", "Stash+:1:-1@0-1:copies2"),
)
AFTER_FORWARD = HEAD_PLACE  # the segment after the layers' forward, where an offload of their inputs holds less


def parse(option: Optional[LeverOption], n_layers: int):
    """The layers and the copies an option names (its first part: `0-1:copies2`; its default: every layer, one
    copy); None: no layer."""
    if option is None:
        return [], 1
    part = option.parts[0]
    return list(part.layers) if part.layers is not None else list(range(n_layers)), part.number or 1


class Stash(Lever):
    syntax = SYNTAX
    name = SYNTAX.name

    @classmethod
    def build(cls, model, settings, option, n_layers):
        """Installed where asked; under `auto` with a budget in MiB, built off and measured for the solver."""
        if option is None and (settings.budget is None or settings.budget.budget_mb is None):
            return None, None
        lever = cls(model)
        lever.run_as(option)
        return lever, None

    def __init__(self, model):
        self.layers = list(find_layers(model))
        self._option: Optional[LeverOption] = None
        self.handles = []
        self.calls = 0
        self.bytes_seen = 0
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        chosen, _ = parse(self._option, len(self.layers))
        for i in chosen:
            self.handles.append(self.layers[i].register_forward_pre_hook(self._seen))
        self.installed = True

    def _seen(self, module, args):
        self.calls += 1
        self.bytes_seen += sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        self.installed = False

    def run_as(self, option: Optional[LeverOption]) -> None:
        self.remove()
        self._option = option
        if option is not None:
            self.install()

    @property
    def option(self) -> Optional[LeverOption]:
        return self._option if self.installed else None

    def after_step_one(self, profile, resets: bool) -> None:
        shapes = [rec.shape for rec in profile.layers]
        if not all(shapes):
            profile.lever_problems[self.name] = "a layer took no input to copy"
            return
        nbytes = [math.prod(s) * 4 for s in shapes]
        start = time.perf_counter()
        torch.empty(shapes[0]).copy_(torch.zeros(shapes[0]))
        copy = time.perf_counter() - start
        profile.levers[self.name] = {
            "bytes": nbytes,
            "copy_seconds": copy,
            "op_seconds": [rec.op_seconds for rec in profile.layers],
        }

    def choices(self, profile, measured=None) -> List[LeverChoice]:
        measured = profile.levers.get(self.name)
        if measured is None:
            return super().choices(profile)
        n = len(measured["bytes"])
        out = [LeverChoice(self.name, None, "")]
        for option in (LeverOption(), LeverOption((LeverPart(tuple(range(n)), "copies", 2),))):
            chosen, copies = parse(option, n)
            out.append(
                LeverChoice(
                    self.name,
                    option,
                    SYNTAX.plan_of(option),
                    ((AFTER_FORWARD, sum(measured["bytes"][i] for i in chosen)),),
                    overlap_seconds=measured["copy_seconds"] * len(chosen) / copies,
                    window_seconds=sum(measured["op_seconds"][i] for i in chosen),
                )
            )
        return out

    def rows(self, profile, drop) -> List[FoundPlan]:
        out = []
        for c in self.choices(profile)[1:]:
            saving = float(sum(b for _, b in c.less))
            out.append(
                FoundPlan(
                    config=c.plan,
                    enabled=c.option == self.option,
                    frequency=1,
                    saving_bytes=saving,
                    recompute_seconds=c.cost,
                    lever=self.name,
                    **(drop([c]) if drop is not None else {}),
                )
            )
        return out

    def notes(self, profile) -> List[str]:
        if self.name in profile.levers:
            return [f"`Stash+` (a double): {self.calls} layer calls seen, {self.bytes_seen} input bytes"]
        return []


LEVER = Stash
