"""What the first training step measured, per layer: the bytes autograd kept for backward, by plan (recomputable
from tensors kept anyway or not, and why not), the op time each plan would cost to recompute, and the layer's
own op time (what recomputing the whole layer costs). The plan table and, later, the solver read it. Pure data."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .graph import LayerGraph

# Why a storage autograd kept cannot be recomputed from its op alone (LayerProfile.why_not).
INPUT_NOT_KEPT = "an input of the op that made it is not kept"
CHANGED_IN_PLACE = "it was changed in place since"
OTHER_DTYPE = "it is saved through another dtype"


@dataclass
class LayerProfile:
    recomputable: Dict[str, int] = field(default_factory=dict)  # plan -> bytes kept, recomputable from kept tensors
    not_recomputable: Dict[str, int] = field(default_factory=dict)  # plan -> bytes kept, not recomputable alone
    why_not: Dict[str, List[str]] = field(default_factory=dict)  # plan -> reasons (the constants above)
    applied: Dict[str, int] = field(default_factory=dict)  # plan -> bytes this run replaced by recipes
    seconds: Dict[str, float] = field(default_factory=dict)  # plan -> forward time of the ops that made those bytes
    op_seconds: float = 0.0  # every op of the layer's forward, timed: the cost of recomputing the layer whole
    shape: Tuple[int, ...] = ()  # the layer's first input
    graph: Optional[LayerGraph] = None  # the forward's storages and saves: what any plan would free (`graph`)

    def add(self, plan: str, nbytes: int, seconds: float, recomputable: bool, why: str = "") -> None:
        bucket = self.recomputable if recomputable else self.not_recomputable
        bucket[plan] = bucket.get(plan, 0) + nbytes
        self.seconds[plan] = self.seconds.get(plan, 0.0) + seconds
        if why and why not in self.why_not.setdefault(plan, []):
            self.why_not[plan].append(why)

    @property
    def kept_bytes(self) -> int:
        return sum(self.recomputable.values()) + sum(self.not_recomputable.values())


@dataclass
class ModelProfile:
    layers: List[LayerProfile]

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.layers[0].shape if self.layers else ()
