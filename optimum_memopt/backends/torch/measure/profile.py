"""What the first training step measured, per layer: the bytes autograd kept for backward, by plan (recomputable
from tensors kept anyway or not, and why not), the op time each plan would cost to recompute, and the layer's
own op time (what recomputing the whole layer costs). The plan table and, later, the solver read it. Pure data."""

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from .graph import LayerGraph

# Why a storage autograd kept cannot be recomputed from its op alone (LayerProfile.why_not).
INPUT_NOT_KEPT = "an input of the op that made it is not kept"
CHANGED_IN_PLACE = "it was changed in place since"
OTHER_DTYPE = "it is saved through another dtype"
ROUTING = "it is an MoE's routing, kept: never recomputed (`apply/routing.py`)"


INPUT_KEPT = -1  # `LayerProfile.input_gone_at` where the model's code holds a layer's input through the head


@dataclass
class LayerProfile:
    recomputable: Dict[str, int] = field(default_factory=dict)  # plan -> bytes kept, recomputable from kept tensors
    not_recomputable: Dict[str, int] = field(default_factory=dict)  # plan -> bytes kept, not recomputable alone
    why_not: Dict[str, List[str]] = field(default_factory=dict)  # plan -> reasons (the constants above)
    applied: Dict[str, int] = field(default_factory=dict)  # plan -> bytes this run replaced by recipes
    seconds: Dict[str, float] = field(default_factory=dict)  # plan -> forward time of the ops that made those bytes
    op_seconds: float = 0.0  # every op of the layer's forward, timed: the cost of recomputing the layer whole
    shape: Tuple[int, ...] = ()  # the layer's first input
    # the first input's storage (the hidden states: what the layer before made, held for this layer's backward by
    # this layer alone), and every tensor argument's storage once (the hidden states, the positions' embeddings, a
    # mask: what a layer recomputed whole saves through its checkpoint), in CUDA's blocks
    input_bytes: int = 0
    arguments_bytes: int = 0
    # where the model's own code lets go of that input in the forward (what is left once autograd's saves are taken
    # off, as the offload lever takes them): the first layer whose forward starts with it freed, the number of
    # layers where the head's does, `INPUT_KEPT` where the model holds it through the head; None: not seen (a run
    # measured without a dry run), taken as the next layer's (`fake_step.layer_order`)
    input_gone_at: Optional[int] = None
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


FORWARD, BACKWARD, HEAD, AFTER = "forward", "backward", "head", "after"  # the kinds of place in a step
_IN_WORDS = {
    HEAD: "after the layers: head and loss, forward and backward",
    AFTER: "after backward: the optimizer step and the next batch",
}


@dataclass(frozen=True)
class Place:
    """Where in a training step a segment of it is read: a layer's forward or backward (`layer`, its index in the
    layer list), the head and its loss after the layers (`HEAD`), or after backward, the optimizer step and the next
    batch (`AFTER`); `rank`, the process it was read on where several processes' steps are put side by side
    (`budget.merged`), else None. Compared as values (`in_step` leaves the process out); `str` names it in words,
    for messages and files only."""

    kind: str
    layer: Optional[int] = None
    rank: Optional[int] = None

    @classmethod
    def forward(cls, layer: int) -> "Place":
        return cls(FORWARD, layer)

    @classmethod
    def backward(cls, layer: int) -> "Place":
        return cls(BACKWARD, layer)

    def in_step(self) -> "Place":
        """The place in the step, whichever process read it."""
        return replace(self, rank=None) if self.rank is not None else self

    def on_rank(self, rank: int) -> "Place":
        return replace(self, rank=rank)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "layer": self.layer, "rank": self.rank}

    def __str__(self) -> str:
        words = _IN_WORDS.get(self.kind) or f"layer {self.layer} {self.kind}"
        return words if self.rank is None else f"{words} on rank {self.rank}"


HEAD_PLACE, AFTER_PLACE = Place(HEAD), Place(AFTER)


@dataclass
class Segment:
    """A stretch of the measured step between two of its marks (a layer's forward or backward starting, the layers'
    forward ending, backward ending), with the memory read there. Throughout it, what the first `held` layers kept
    for backward is held: in a layer's forward, that layer's too (it builds up); in its backward, the layers before
    it only: the layer's own tensors are then all back (kept, or recomputed for its backward), whatever its policy.
    That holds as an upper bound for a step measured with every layer recomputed whole (`planner`), where the whole
    forward comes back at once."""

    place: Place
    held: int  # the first `held` layers' kept tensors are held here
    start_bytes: int  # the reading as it began
    peak_bytes: int  # the highest reading in it (`StepMemory.how`)
    own: Optional[int] = None  # the layer whose forward (own = held - 1) or backward (own = held) this is
    # the peak of each stretch between the inner marks inside it (`StepWatch.inside`: a lever's module starting its
    # forward, ending it, its backward starting and ending), in order, each named by the mark that opened it ("" the
    # stretch from the segment's start); empty where nothing marked inside it or the peak counter is not reset
    parts: Tuple[Tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        """Where it is, in words (messages and files)."""
        return str(self.place)

    def shifted(self, by: int, place: Optional[Place] = None) -> "Segment":
        """The segment with every reading of its peak moved by `by` bytes (and placed at `place`)."""
        parts = tuple((tag, peak + by) for tag, peak in self.parts)
        return Segment(place or self.place, self.held, self.start_bytes, self.peak_bytes + by, self.own, parts)


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


# why a lever measured nothing in a loop of one's own that does not report its steps (its `lever_problems`)
NOT_BETWEEN_STEPS = (
    "each way is measured between steps, and the loop does not say where its steps end: "
    "`optimize_memory(..., reports_steps=True)` and `handle.step_done()` after each optimizer step"
)


@dataclass
class ModelProfile:
    layers: List[LayerProfile]
    memory: Optional[StepMemory] = None  # step one's memory by segment (`watch`), once the step ended
    memory_problem: Optional[str] = None  # why step one's memory could not be followed layer by layer
    # what each lever beyond the layers measured after step one, by its name (`levers/`: its own pure data, which
    # its rows and options are made from), and why a lever measured nothing
    levers: Dict[str, object] = field(default_factory=dict)
    lever_problems: Dict[str, str] = field(default_factory=dict)
    # the seconds each lever's measurement after step one took on the clock of a run on a device (part of its start;
    # none in a dry run, whose measurements are of fake tensors)
    lever_seconds: Dict[str, float] = field(default_factory=dict)
    autocast: Optional[str] = None  # the dtype autocast ran step one's layers in ("bfloat16"), None: off
    # the peak `auto` promised to train under (`--memory_budget_mb`, in the meter's bytes), where one was given: a
    # lever's ways may hold up to it while they are measured (`room`); None: step one's peak alone
    budget_bytes: Optional[int] = None

    def room(self) -> Tuple[int, str]:
        """The most the process may hold while a lever's ways are measured after step one (`measure.ways`), and what
        that figure is, in words: the budget `auto` trains under where it is above step one's peak (the run promises
        no more, and holds up to it from the next step on), else step one's peak (a measurement never holds more than
        the step did). Needs step one's memory."""
        peak = self.memory.peak.peak_bytes
        if self.budget_bytes is not None and self.budget_bytes > peak:
            return self.budget_bytes, "the budget"
        return peak, "step one's peak"

    @property
    def shape(self) -> Tuple[int, ...]:
        """The first input of the first layer that ran (a step may leave a tower listed before it out)."""
        return next((layer.shape for layer in self.layers if layer.shape), ())
