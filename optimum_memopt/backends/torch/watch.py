"""Where a training step's memory goes: the memory read at each mark the engine passes (a layer's forward starting,
the layers' forward done, a layer's backward starting, backward done, the next step starting) and the peak between
two marks, as `Segment`s of a `StepMemory`. The budget (`budget`) predicts from them what any policy does to the
step's peak: a segment moves by what the layers whose kept tensors it holds free more or less.

Marks are expected in a training step's order (layers 0..L-1 forward, then L-1..0 backward); a model that runs its
layers otherwise (twice, or not all of them) leaves `problem` set, and nothing is predicted from its segments.
Micro-batches after the first (gradient accumulation) and the optimizer step fall in the last segment, which holds
no layer's kept tensors.
"""

from typing import List, Optional, Tuple

import torch

from ...memory import MIB, MemoryMeter
from .profile import Segment, StepMemory


def first_grad_tensor(output) -> Optional[torch.Tensor]:
    """The first tensor of a layer's output that backward reaches (the hidden states)."""
    values = output if isinstance(output, (tuple, list)) else [output]
    if isinstance(output, dict):
        values = list(output.values())
    return next((v for v in values if torch.is_tensor(v) and v.requires_grad), None)


class StepWatch:
    """Reads one training step's memory at the engine's marks (see the module's docstring)."""

    def __init__(self, layers: int, meter: MemoryMeter, resets: bool = True):
        self.layers = layers
        self.meter = meter
        self.resets = resets  # False: the peak counter is someone else's (only the marks' readings are used)
        self.segments: List[Segment] = []
        self.start_bytes: Optional[int] = None
        self.problem: Optional[str] = None
        self._open: Optional[Tuple[str, int, int]] = None  # (name, held, start bytes)
        self._stage = "waiting"  # -> forward -> head -> backward -> after -> done
        self._last = -1

    @property
    def how(self) -> str:
        if not self.resets:
            return "readings at the marks only (the peak counter is not reset)"
        return "CUDA's peak counter" if self.meter.device == "cuda" else "the allocator, sampled every 2 ms"

    @property
    def backward_ended(self) -> bool:
        """The step's backward has ended (what follows is the optimizer step and the next batch)."""
        return self._stage == "after" and self.problem is None

    def _read(self) -> Tuple[int, int]:
        r = self.meter.read()
        current = int(round((r.current_mb or 0.0) * MIB))
        peak = int(round((r.peak_mb or 0.0) * MIB)) if self.resets else current
        return current, max(peak, current)

    def _mark(self, name: Optional[str], held: int = 0) -> int:
        current, peak = self._read()
        if self._open is not None:
            opened, opened_held, start = self._open
            self.segments.append(Segment(opened, opened_held, start, max(peak, start, current)))
        if self.resets:
            self.meter.reset_peak()
        self._open = (name, held, current) if name is not None else None
        return current

    def _wrong(self, what: str) -> None:
        if self.problem is None:
            self.problem = f"the layers ran out of a training step's order ({what})"
        self._stage = "after"  # stop marking: the rest of the step is one segment

    def layer_forward(self, index: int) -> None:
        if self._stage == "after":
            return  # a later micro-batch (gradient accumulation): part of the last segment
        if (self._stage, index) == ("waiting", 0) or (self._stage == "forward" and index == self._last + 1):
            current = self._mark(f"layer {index} forward", index + 1)
            if index == 0:
                self.start_bytes = current
            self._stage, self._last = "forward", index
            if index == self.layers - 1:
                self._stage = "forward-last"
        elif self._stage != "done":
            self._wrong(f"layer {index}'s forward after layer {self._last}'s {self._stage.split('-')[0]}")

    def forward_done(self) -> None:
        if self._stage == "forward-last":
            self._mark("after the layers: head and loss, forward and backward", self.layers)
            self._stage = "head"

    def layer_backward(self, index: int) -> None:
        expected = self.layers - 1 if self._stage == "head" else self._last - 1
        if self._stage in ("head", "backward") and index == expected:
            self._mark(f"layer {index} backward", index)
            self._stage, self._last = "backward", index
        elif self._stage not in ("after", "done"):
            self._wrong(f"layer {index}'s backward where layer {expected}'s was due")

    def backward_done(self) -> None:
        if self._stage == "backward" and self._last == 0:
            self._mark("after backward: the optimizer step and the next batch", 0)
            self._stage = "after"

    def close(self) -> Optional[StepMemory]:
        """At the next step's start: the step's memory, or None when its marks did not come in order (`problem`)."""
        if self._stage == "done":
            return None
        if self._stage != "after" and self.problem is None:
            self.problem = f"the step's marks stopped at {self._stage} (a layer's backward was not seen)"
        self._mark(None)
        self._stage = "done"
        if self.problem is not None or self.start_bytes is None:
            return None
        return StepMemory(self.meter.device, self.segments, self.start_bytes, self.how)
