"""The budget: what a policy does to a measured step's peak, and the policy of least recompute that keeps the peak
under a budget.

Step one gives, per layer, what each configuration frees and costs (`solver.candidates`), and the step's memory by
segment (`watch`): in a segment holding the first `held` layers' kept tensors, a policy that frees `f[j]` bytes in
layer j instead of the `q[j]` the measured step's policy freed reads

    peak(segment) + sum(q[j] - f[j] for j < held)  (+ what the next steps hold that step one did not: `extra`)

and the step's peak is the highest of those. A layer counts as held from its forward's start to its backward's
start; in its own backward its tensors are all back, kept or recomputed, whatever its policy (`profile.Segment`).
A budget is then one constraint per segment on the bytes the first `held` layers free, which the solver's dynamic
programme over the layers, in order, meets exactly (`solver.choose`'s `prefix_needs`). The segment after backward
(the optimizer step, the next batch) holds no layer's tensors: no policy moves it, and a budget below it cannot be
met by recompute (said so).

`extra`: step one runs before the optimizer has its state (Adam's two moments are made in its first step) and, with
gradient accumulation, before gradients are held across micro-batches; the caller measures it at the next step's
start (what is held there that was not at step one's) and adds the gradients' bytes under accumulation. Pure.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ....memory import MIB
from ....plans import LAYER as LAYER_PLAN
from ....plans import PlanEntry
from ..measure.graph import effect, saved_bytes, whole_layer
from ..measure.profile import HEAD_SEGMENT, ModelProfile, Segment, StepMemory
from ..policy import LAYER, OPS, RecomputePolicy
from .solver import Candidate, candidates, choose, policy_of


def freed_bytes(profile: ModelProfile, policy: RecomputePolicy) -> List[int]:
    """Per layer: the bytes `policy` frees there, from step one's graphs (0 where a layer has none)."""
    out = []
    for rec, lp in zip(profile.layers, policy.layers):
        if rec.graph is None or lp.mode not in (LAYER, OPS):
            out.append(0)
        elif lp.mode == LAYER:
            out.append(whole_layer(rec.graph, rec.op_seconds).freed_bytes)
        else:
            out.append(effect(rec.graph, lp.ops).freed_bytes)
    return out


@dataclass(frozen=True)
class Prediction:
    peak_bytes: int
    where: str  # the segment the peak falls in

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MIB


def predict(
    memory: StepMemory, measured_freed: Sequence[int], freed: Sequence[int], extra: int = 0, head: int = 0
) -> Prediction:
    """The step's peak with `freed` bytes freed per layer, from a step measured with `measured_freed`; `head`: the
    bytes the head and loss hold less than in the measured step (another way of running them: `levers.loss`)."""
    best: Optional[Prediction] = None
    for k, seg in enumerate(memory.segments):
        value = _moved(seg, measured_freed, freed, head) + (extra if k < len(memory.segments) - 1 else 0)
        if best is None or value > best.peak_bytes:
            best = Prediction(value, seg.name)
    return best


def segment_peaks(
    memory: StepMemory, measured_freed: Sequence[int], freed: Sequence[int], extra: int = 0, head: int = 0
) -> List[tuple]:
    """Each segment's predicted peak (`predict`'s terms) with `freed` bytes freed per layer: (name, bytes)."""
    last = len(memory.segments) - 1
    return [
        (seg.name, _moved(seg, measured_freed, freed, head) + (extra if k < last else 0))
        for k, seg in enumerate(memory.segments)
    ]


def predict_range(
    memory: StepMemory, measured_freed: Sequence[int], freed: Sequence[int], head: int = 0
) -> Tuple[int, int]:
    """The least and the most the step's peak can be with `freed` bytes freed per layer, where `predict` gives one
    figure inside that range. The readings are exact (the same each run), but they cannot tell how much of a change
    of policy in a layer shows in that layer's own forward and backward: a planned tensor is let go of in the forward
    only after its last use (its layer's forward peak may still hold it), and a layer replayed in its own backward
    brings its tensors back one at a time (its backward may peak with some of them gone). So the segment of layer
    j's forward, which `predict` moves by all of the change, may be higher by what `freed` frees there or lower by
    what the measured policy did; layer k's backward, which `predict` does not move by layer k's change, may be lower
    by what `freed` frees there or higher by what the measured policy did. Every other segment moves exactly (the
    head's by `head`, as measured)."""
    low = high = None
    for seg in memory.segments:
        value = _moved(seg, measured_freed, freed, head)
        down = up = 0
        if seg.own is not None and seg.own < len(freed):
            now, then = freed[seg.own], measured_freed[seg.own]
            down, up = (then, now) if seg.own < seg.held else (now, then)
        low = value - down if low is None else max(low, value - down)
        high = value + up if high is None else max(high, value + up)
    return low, high


def _moved(seg: Segment, measured_freed: Sequence[int], freed: Sequence[int], head: int = 0) -> int:
    held = seg.held
    moved = seg.peak_bytes + sum(measured_freed[:held]) - sum(freed[:held])
    return moved - head if seg.name.startswith(HEAD_SEGMENT) else moved


def as_kept(memory: StepMemory, measured_freed: Sequence[int], extra: int = 0) -> StepMemory:
    """The step's memory as if no layer had freed anything, with what later steps hold more (`extra`) added to every
    segment but the last (after backward, where step one already made what the next steps hold): the form in which
    steps measured on several processes, each freeing what its own graphs say, are put side by side (`merged`)."""
    last = len(memory.segments) - 1
    segments = [
        Segment(
            s.name, s.held, s.start_bytes, _moved(s, measured_freed, [0] * s.held) + (extra if k < last else 0), s.own
        )
        for k, s in enumerate(memory.segments)
    ]
    return StepMemory(memory.device, segments, memory.start_bytes, memory.how)


def merged(kept: Sequence[StepMemory], measured_freed: Sequence[int]) -> StepMemory:
    """Steps in `as_kept`'s form (one per process, rank order) as one step measured under `measured_freed` (the
    choosing process's), with no `extra` left to add: a peak predicted from it is the highest of every process's,
    and a budget met on it is met on each. Segments are named with their rank where there are several."""
    segments = []
    for rank, memory in enumerate(kept):
        on = f" on rank {rank}" if len(kept) > 1 else ""
        for s in memory.segments:
            back = sum(measured_freed[: s.held])
            segments.append(Segment(s.name + on, s.held, s.start_bytes, s.peak_bytes - back, s.own))
    first = kept[0]
    return StepMemory(first.device, segments, first.start_bytes, first.how)


@dataclass(frozen=True)
class HeadChoice:
    """One way to run the head and loss, as the solver weighs it: its plan ("": the model's own head; `Loss+:1:-1@
    chunks8`), the bytes the head and loss hold less than in the measured step, the seconds it adds to a step."""

    plan: str
    bytes_less: int = 0
    seconds: float = 0.0
    # what its forward returns and the caller may keep through the whole step (the model's own head's logits, in a
    # loop that keeps `outputs`; the Trainer lets them go): counted held in every segment but the last
    returned: int = 0

    @property
    def selector(self) -> Optional[str]:
        """The plan's chunking as the policy holds it ("chunks8"; "" for bare `Loss+:1:-1`), None: the own head."""
        return self.plan.partition("@")[2] if self.plan else None


AS_MEASURED = HeadChoice("")  # the head as the measured step ran it (where no other way was measured)


def head_choices(profile: ModelProfile, ran: str = "") -> List[HeadChoice]:
    """The ways the head and loss can run (`levers.loss`'s measure after step one): the bytes each holds less than
    the way the step ran, and the seconds it takes more than the fastest way (a constant apart from what the step
    ran: the least total time is the same); where none was measured, the way the step ran (`ran`, its plan) alone.

    A way that holds more than the step's is weighed by its bound (what it was let take before it ran, above what
    it held): run alone, a way's bytes differ from what it adds in a step (a coarser head was measured 0.3 MiB
    short of its step's on the tests' wide decoder), and a choice that rests on that difference could peak over the
    budget; a way that holds less is weighed as measured (the table's PEAK DROP, within 2% of what runs measure).
    A way that makes more rows of logits at once than the step's (coarser chunks, or the model's own head) is
    weighed by its bound too, whatever it held alone: alone, what the rows add can fall under what every way holds
    besides them (the head's gradients), where in a step, on top of the layers' tensors, it does not (on Llama at
    tiny size chunks of 16 rows and of 8 held the same alone and 12 KiB apart in the step; on Qwen2-VL the own head
    held 28 KiB less than the step's chunks alone and 28 KiB more in the step: `auto` chose them over its budget)."""
    head = profile.head
    if head is None:
        return [HeadChoice(ran)]
    ran = head.option(head.ran)
    fastest = min(head.seconds(o) for o in head.options)

    def held(o) -> int:
        if o.held_bytes > ran.held_bytes or o.rows > ran.rows:
            return max(o.held_bytes, o.bound_bytes)
        return o.held_bytes

    return [
        HeadChoice(o.plan, ran.held_bytes - held(o), head.seconds(o) - fastest, head.logits_bytes if not o.plan else 0)
        for o in head.options
    ]


@dataclass
class Fit:
    """The solver's answer for one budget."""

    budget_bytes: int
    measured: Prediction  # the measured step's peak, moved by `extra`
    floor: Prediction  # the least peak recompute reaches (each layer freeing the most it can)
    choice: Optional[List[Candidate]] = None  # None: nothing fits (`why_not`)
    predicted: Optional[Prediction] = None
    segments: List[tuple] = field(default_factory=list)  # (segment, its predicted peak in bytes) with the choice
    why_not: str = ""
    share: Optional[float] = None  # the budget as a share of `activation_bytes` (`fit_share`), else None
    activation_bytes: int = 0  # what the layers keep for backward with nothing recomputed
    head: HeadChoice = AS_MEASURED  # how the head and loss run with the choice
    source: str = ""  # where the choice comes from, if not the solver's for this step (`planner._confirmed`)

    @property
    def recompute_seconds(self) -> float:
        return sum(c.seconds for c in self.choice) + self.head.seconds if self.choice else 0.0

    @property
    def freed(self) -> int:
        return sum(c.freed_bytes for c in self.choice) if self.choice else 0

    def policy(self) -> RecomputePolicy:
        policy = policy_of(self.choice)
        policy.loss = self.head.selector
        return policy

    def as_dict(self) -> dict:
        """The answer in `memory_auto/solver.json`."""
        return {
            "budget_mb": self.budget_bytes / MIB if self.share is None else None,
            "activation_share": self.share,
            "activation_mb": self.activation_bytes / MIB if self.share is not None else None,
            "config": self.config() if self.choice else None,
            "per_layer": [c.label for c in self.choice] if self.choice else None,
            "head": (self.head.plan or "own") if self.choice else None,
            "head_freed_mb": self.head.bytes_less / MIB if self.choice else None,
            "predicted_peak_mb": self.predicted.peak_mb if self.predicted else None,
            "predicted_peak_in": self.predicted.where if self.predicted else None,
            "predicted_segments": [{"name": name, "peak_mb": value / MIB} for name, value in self.segments],
            "freed_mb": self.freed / MIB,
            "recompute_ms": self.recompute_seconds * 1000,
            "floor_mb": self.floor.peak_mb,
            "floor_in": self.floor.where,
            "measured_step_one_mb": self.measured.peak_mb,
            "why_not": self.why_not or None,
            "source": self.source or "the solver, from step one",
        }

    def config(self) -> str:
        """The choice in the plan grammar (`--memory_opt_config`), for a run without `auto`."""
        if not self.choice:
            return ""
        return ",".join([str(e) for e in plan_entries(self.choice)] + ([self.head.plan] if self.head.plan else []))


def fit(
    profile: ModelProfile,
    memory: StepMemory,
    budget_bytes: int,
    measured: RecomputePolicy,
    extra_bytes: int = 0,
    per_layer: Optional[Sequence[Sequence[Candidate]]] = None,
    heads: Sequence[HeadChoice] = (AS_MEASURED,),
) -> Fit:
    """The least-recompute policy whose predicted peak is at most `budget_bytes`, from a step measured under
    `measured` (its memory by segment and each layer's graph), with the way of running the head and loss (`heads`,
    from `head_choices`) chosen in the same solve: for each, the layers' least-time choice under the budget with
    the head's segment moved by what that way holds less; the least total time wins (the head's time included)."""
    per_layer, q, result = _start(profile, memory, measured, extra_bytes, per_layer, heads)
    result.budget_bytes = budget_bytes
    best, first_why = None, None
    for head in heads:
        extra = extra_bytes + head.returned
        needs, why_not = _needs(memory, q, budget_bytes, extra, head.bytes_less, len(per_layer))
        if why_not is None and _floor(memory, q, per_layer, extra_bytes, head).peak_bytes > budget_bytes:
            why_not = (
                f"with each layer recomputing the most it can, the step still peaks at "
                f"{result.floor.peak_mb:,.1f} MiB ({result.floor.where}), over the budget"
            )
        choice = choose(per_layer, 0, prefix_needs=needs) if why_not is None else None
        if why_not is None and choice is None:  # the bytes are there, but not in the solver's units
            why_not = "no choice frees the bytes needed in the units the solver counts in"
        if choice is None:
            first_why = first_why or why_not
            continue
        seconds = sum(c.seconds for c in choice) + head.seconds
        if best is None or seconds < best[0]:
            best = (seconds, choice, head)
    if best is None:
        result.why_not = first_why
        return result
    _, result.choice, result.head = best
    freed = [c.freed_bytes for c in result.choice]
    extra = extra_bytes + result.head.returned
    result.predicted = predict(memory, q, freed, extra, result.head.bytes_less)
    result.segments = segment_peaks(memory, q, freed, extra, result.head.bytes_less)
    return result


def _needs(memory: StepMemory, q, budget_bytes: int, extra_bytes: int, head: int, layers: int):
    """Per layer, the bytes the first i + 1 layers must free for every segment to fit (the solver's prefix needs),
    with the head's segment moved by `head`; or why recompute cannot meet the budget (a segment no layer's tensors
    are held in peaks over it)."""
    needs = [0] * layers
    last = len(memory.segments) - 1
    for k, seg in enumerate(memory.segments):
        need = _moved(seg, q, [0] * seg.held, head) + (extra_bytes if k < last else 0) - budget_bytes
        if need <= 0:
            continue
        if seg.held == 0:
            where = (
                "where no other layer's tensors are held and its own are all back for its backward, whatever its "
                "policy"
                if seg.name.startswith("layer")
                else "where no layer's tensors are held"
            )
            return needs, (
                f"the step peaks at {(need + budget_bytes) / MIB:,.1f} MiB "
                f"{'in ' if seg.name.startswith('layer') else ''}{seg.name}, {where}: recompute cannot lower it"
            )
        needs[seg.held - 1] = max(needs[seg.held - 1], need)
    return needs, None


def _floor(memory: StepMemory, q, per_layer, extra_bytes: int, head: HeadChoice) -> Prediction:
    most = [max(c.freed_bytes for c in options) for options in per_layer]
    return predict(memory, q, most, extra_bytes + head.returned, head.bytes_less)


def fit_share(
    profile: ModelProfile,
    memory: StepMemory,
    share: float,
    measured: RecomputePolicy,
    extra_bytes: int = 0,
    per_layer: Optional[Sequence[Sequence[Candidate]]] = None,
) -> Fit:
    """The least-recompute policy keeping at most `share` of what the layers keep for backward with nothing
    recomputed (their own tensors: `graph.saved_bytes`), as `torch.compile`'s `activation_memory_budget` is a share;
    its peak predicted from the measured step as `fit` does."""
    per_layer, q, result = _start(profile, memory, measured, extra_bytes, per_layer)
    total = sum(saved_bytes(rec.graph) for rec in profile.layers if rec.graph is not None)
    result.share, result.activation_bytes = share, total
    result.choice = choose(per_layer, math.ceil((1 - share) * total))
    if result.choice is None:
        result.why_not = (
            f"keeping {share:.0%} of {total / MIB:,.1f} MiB frees {(1 - share) * total / MIB:,.1f} MiB; the layers "
            f"can free {sum(max(c.freed_bytes for c in o) for o in per_layer) / MIB:,.1f} MiB at most"
        )
        return result
    result.predicted = predict(memory, q, [c.freed_bytes for c in result.choice], extra_bytes)
    result.segments = segment_peaks(memory, q, [c.freed_bytes for c in result.choice], extra_bytes)
    return result


def _start(profile, memory, measured, extra_bytes, per_layer, heads=(AS_MEASURED,)):
    """What `fit` and `fit_share` share: the candidates, what the measured policy freed per layer, and the answer
    begun with the measured step's peak and the floor (each layer freeing the most it can, the head run the way
    that holds least)."""
    per_layer = list(per_layer) if per_layer is not None else candidates(profile)
    q = freed_bytes(profile, measured)
    floor = min((_floor(memory, q, per_layer, extra_bytes, h) for h in heads), key=lambda p: p.peak_bytes)
    result = Fit(0, measured=predict(memory, q, q, extra_bytes), floor=floor)
    return per_layer, q, result


def plan_entries(choice: Sequence[Candidate]) -> List[PlanEntry]:
    """One plan per configuration chosen, with a selector of its layers: `Layer+:1:-1@2-3`, `Mul+silu+:1:-1@0-1`."""
    groups: Dict[tuple, List[int]] = {}
    for i, c in enumerate(choice):
        if c.whole or c.ops:
            groups.setdefault((c.whole, c.ops), []).append(i)
    entries = []
    for (whole, ops), layers in sorted(groups.items(), key=lambda kv: kv[1][0]):
        subgraph = LAYER_PLAN if whole else "".join(f"{name}+" for name in sorted(ops))
        entries.append(PlanEntry(subgraph, 1, -1, selector(layers)))
    return entries


def selector(layers: Sequence[int]) -> str:
    """Layer indexes as a plan selector: [0, 1, 2, 5] -> '0-2+5'."""
    parts, start = [], None
    for k, i in enumerate(layers):
        if start is None:
            start = i
        if k + 1 == len(layers) or layers[k + 1] != i + 1:
            parts.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return "+".join(parts)
