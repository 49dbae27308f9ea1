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
ROUTING = "it is an MoE's routing, kept: never recomputed (`apply/routing.py`)"


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
    # tensors autograd kept whose storage could not be read (tensor subclasses without one), by type: their bytes are
    # in no figure, and said so (`report`)
    unread: Dict[str, int] = field(default_factory=dict)
    routing: Dict[str, int] = field(default_factory=dict)  # plan -> bytes kept as an MoE's routing (in every policy)

    def add(self, plan: str, nbytes: int, seconds: float, recomputable: bool, why: str = "") -> None:
        bucket = self.recomputable if recomputable else self.not_recomputable
        bucket[plan] = bucket.get(plan, 0) + nbytes
        if why == ROUTING:
            self.routing[plan] = self.routing.get(plan, 0) + nbytes
        self.seconds[plan] = self.seconds.get(plan, 0.0) + seconds
        if why and why not in self.why_not.setdefault(plan, []):
            self.why_not[plan].append(why)

    @property
    def kept_bytes(self) -> int:
        return sum(self.recomputable.values()) + sum(self.not_recomputable.values())


@dataclass
class Segment:
    """A stretch of the measured step between two of its marks (a layer's forward or backward starting, the layers'
    forward ending, backward ending), with the memory read there. Throughout it, what the first `held` layers kept
    for backward is held: in a layer's forward, that layer's too (it builds up); in its backward, the layers before
    it only: the layer's own tensors are then all back (kept, or recomputed for its backward), whatever its policy.
    That holds as an upper bound for a step measured with every layer recomputed whole (`planner`), where the whole
    forward comes back at once."""

    name: str
    held: int  # the first `held` layers' kept tensors are held here
    start_bytes: int  # the reading as it began
    peak_bytes: int  # the highest reading in it (`StepMemory.how`)
    own: Optional[int] = None  # the layer whose forward (own = held - 1) or backward (own = held) this is


@dataclass
class StepMemory:
    """Where a training step's memory went, mark by mark: the step one profile's second half (`watch`)."""

    device: str
    segments: List[Segment]
    start_bytes: int  # the reading as the first layer's forward began
    how: str  # how the peaks were read (after every op / CUDA's counter / readings at the marks only)

    @property
    def peak(self) -> Segment:
        return max(self.segments, key=lambda s: s.peak_bytes)


HEAD_SEGMENT = "after the layers: head and loss, forward and backward"  # the step's segment the head runs in


@dataclass(frozen=True)
class HeadOption:
    """One way to run a causal LM's head and loss, measured aside (`levers.loss`): its plan (`Loss+:1:-1@chunks8`;
    "" for the model's own head), the most it held above the level it started at, and its seconds."""

    plan: str
    held_bytes: int
    seconds: float
    bound_bytes: int = 0  # the most it was let hold before it ran (what step one's peak left free bounded it by)
    rows: int = 0  # the rows of logits it makes at once (every token for the model's own head); 0: not known


@dataclass
class HeadMeasure:
    """The head and loss measured after step one, each way it can run, on the step's shapes. `ran` is the plan the
    step ran (its option is among `options`, which are ordered as measured); a way not measured is said in `why_not`
    (by plan)."""

    tokens: int
    hidden: int
    vocab: int
    ran: str
    options: List[HeadOption]
    why_not: Dict[str, str] = field(default_factory=dict)
    # the logits the model's own head returns (its forward's output holds them: a loop that keeps the outputs, as
    # `outputs = model(**batch)` does, holds them through the backward and the next forward)
    logits_bytes: int = 0

    def option(self, plan: str) -> Optional[HeadOption]:
        return next((o for o in self.options if o.plan == plan), None)

    def seconds(self, option: HeadOption) -> float:
        """`option`'s seconds, never below what chunking must add to the model's own head, where that was measured:
        a chunked way makes each chunk's logits again in backward (the head's three matmuls, one forward and two
        backward, become four), so it is taken at least a third slower than the own head. A chunked way measured
        faster than that is the clock's noise on a small head (two chunks were measured faster than the whole head
        on the tests' decoder, and `auto` chose them under a budget with room for everything)."""
        own = self.option("")
        if own is None or not option.plan:
            return option.seconds
        return max(option.seconds, own.seconds * 4 / 3)


@dataclass
class ModelProfile:
    layers: List[LayerProfile]
    memory: Optional[StepMemory] = None  # step one's memory by segment (`watch`), once the step ended
    memory_problem: Optional[str] = None  # why step one's memory could not be followed layer by layer
    head: Optional[HeadMeasure] = None  # the head and loss measured each way (`levers.loss`), where they were
    head_problem: Optional[str] = None  # why they were not
    autocast: Optional[str] = None  # the dtype autocast ran step one's layers in ("bfloat16"), None: off

    @property
    def shape(self) -> Tuple[int, ...]:
        """The first input of the first layer that ran (a step may leave a tower listed before it out)."""
        return next((layer.shape for layer in self.layers if layer.shape), ())
