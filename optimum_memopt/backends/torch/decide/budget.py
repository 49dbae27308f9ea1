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

import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ....memory import MIB
from ....plans import LAYER as LAYER_PLAN
from ....plans import LeverOption, PlanEntry, layer_selector, lever_syntax, parse_plans
from ..measure.graph import effect, saved_bytes, whole_layer
from ..measure.profile import BACKWARD, FORWARD, ModelProfile, Place, Segment, StepMemory
from ..policy import LAYER, OPS, RecomputePolicy
from .solver import KEEP, Candidate, OwnNeeds, Relaxation, candidates, choose, policy_of


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
    memory: StepMemory,
    measured_freed: Sequence[int],
    freed: Sequence[int],
    extra: int = 0,
    levers: Sequence["LeverChoice"] = (),
) -> Optional[Prediction]:
    """The step's peak with `freed` bytes freed per layer, from a step measured with `measured_freed`; `levers`: the
    options of the levers beyond the layers (`levers/`), each moving the segments it acts in by what it holds less
    there than the measured step's option (`_Moved`). None for a step with no segments."""
    return _Moved(memory).predict(measured_freed, freed, extra, levers) if memory.segments else None


def segment_peaks(
    memory: StepMemory,
    measured_freed: Sequence[int],
    freed: Sequence[int],
    extra: int = 0,
    levers: Sequence["LeverChoice"] = (),
) -> List[tuple]:
    """Each segment's predicted peak (`predict`'s terms) with `freed` bytes freed per layer: (place, bytes)."""
    if not memory.segments:
        return []
    values = _Moved(memory).peaks(measured_freed, freed, extra, levers).tolist()
    return [(seg.place, value) for seg, value in zip(memory.segments, values)]


def predict_range(
    memory: StepMemory, measured_freed: Sequence[int], freed: Sequence[int], levers: Sequence["LeverChoice"] = ()
) -> Tuple[int, int]:
    """The least and the most the step's peak can be with `freed` bytes freed per layer, where `predict` gives one
    figure inside that range. The readings are exact (the same each run), but they cannot tell how much of a change
    of policy in a layer shows in that layer's own forward and backward: a planned tensor is let go of in the forward
    only after its last use (its layer's forward peak may still hold it), and a layer replayed in its own backward
    brings its tensors back one at a time (its backward may peak with some of them gone). So the segment of layer
    j's forward, which `predict` moves by all of the change, may be higher by what `freed` frees there or lower by
    what the measured policy did; layer k's backward, which `predict` does not move by layer k's change, may be lower
    by what `freed` frees there or higher by what the measured policy did. Every other segment moves exactly (those
    a lever acts in by what its option holds less there, as measured)."""
    low = high = None
    for seg in memory.segments:
        value = _moved(seg, measured_freed, freed, levers)
        down = up = 0
        if seg.own is not None and seg.own < len(freed):
            now, then = freed[seg.own], measured_freed[seg.own]
            down, up = (then, now) if seg.own < seg.held else (now, then)
        low = value - down if low is None else max(low, value - down)
        high = value + up if high is None else max(high, value + up)
    return low, high


def _moved(
    seg: Segment, measured_freed: Sequence[int], freed: Sequence[int], levers: Sequence["LeverChoice"] = ()
) -> int:
    held = seg.held
    return _moved_by(seg, sum(measured_freed[:held]) - sum(freed[:held]), levers)


def _moved_by(seg: Segment, layers_more: int, levers: Sequence["LeverChoice"] = ()) -> int:
    """The segment's peak with what its held layers keep moved by `layers_more` bytes (what the measured policy freed
    there less what another frees) and by what the levers' options hold less in it."""
    by = layers_more - sum(c.less_in(seg.place) for c in levers) if levers else layers_more
    if not seg.parts:
        return seg.peak_bytes + by
    # marked inside (`StepWatch.inside`): the highest of its stretches, each moved by what the levers hold less there
    return max(peak - sum(c.less_in_part(seg.place, tag) for c in levers) for tag, peak in seg.parts) + by


class _Moved:
    """One measured step's segments with the levers' options' bytes taken off, as arrays (`_moved_by` less what the
    layers free): a combination's in a few array operations, each option's bytes read once. What `fit` weighs every
    combination of the levers' options by (and `predict`, `segment_peaks`): each segment's `_moved` figure, to the
    byte."""

    def __init__(self, memory: StepMemory):
        self.memory = memory
        rows, starts = [], []
        for k, seg in enumerate(memory.segments):  # a row per stretch of a segment marked inside, else one
            starts.append(len(rows))
            rows += [(k, tag, peak) for tag, peak in seg.parts] if seg.parts else [(k, None, seg.peak_bytes)]
        self._rows = rows
        self._peaks = np.array([peak for _, _, peak in rows], dtype=np.int64)
        self._starts = np.array(starts, dtype=np.int64)
        self.held = np.array([seg.held for seg in memory.segments], dtype=np.int64)
        self._less: Dict[int, tuple] = {}  # id(option) -> (the option, kept alive; its bytes less per row)

    def _less_of(self, option: "LeverChoice") -> np.ndarray:
        known = self._less.get(id(option))
        if known is None:
            segments = self.memory.segments
            less = [
                option.less_in(segments[k].place)
                + (option.less_in_part(segments[k].place, tag) if tag is not None else 0)
                for k, tag, _ in self._rows
            ]
            known = self._less[id(option)] = (option, np.array(less, dtype=np.int64))
        return known[1]

    def bases(self, combos: Sequence[Sequence["LeverChoice"]]) -> np.ndarray:
        """Each segment's peak moved by what each of `combos` (combinations of the levers' options) holds less there,
        before what the layers free: a row per combination."""
        rows = len(self._peaks)
        widest = max((len(combo) for combo in combos), default=0)
        if not widest:
            return np.maximum.reduceat(np.tile(self._peaks, (len(combos), 1)), self._starts, axis=1)
        # each option's bytes less per row, stacked once (a row of zeros for a combination with fewer options), and
        # each combination's options as indices into the stack: the sums in one array operation
        places: Dict[int, int] = {}
        stack = [np.zeros(rows, dtype=np.int64)]
        index = np.zeros((len(combos), widest), dtype=np.int64)
        for r, combo in enumerate(combos):
            for j, option in enumerate(combo):
                at = places.get(id(option))
                if at is None:
                    at = places[id(option)] = len(stack)
                    stack.append(self._less_of(option))
                index[r, j] = at
        less = np.stack(stack)[index].sum(axis=1)
        return np.maximum.reduceat(self._peaks - less, self._starts, axis=1)

    def peaks_of(
        self, q: Sequence[int], freed: np.ndarray, extras: np.ndarray, combos: Sequence[Sequence["LeverChoice"]]
    ) -> np.ndarray:
        """Each segment's predicted peak for each of `combos`, a row each: `freed`, the prefix sums (`_sums`) of
        what the layers free, a row per combination or one for all; `extras`, what later steps hold more, one per
        combination (`predict`'s `extra`, counted in every segment but the last)."""
        q_sums = np.array(_sums(q), dtype=np.int64)
        held = np.minimum(self.held, min(len(q_sums), freed.shape[1]) - 1)
        values = self.bases(combos) + q_sums[held] - freed[:, held]
        values[:, :-1] += np.asarray(extras, dtype=np.int64)[:, None]
        return values

    def peaks(self, q: Sequence[int], freed: Sequence[int], extra: int, levers: Sequence["LeverChoice"]) -> np.ndarray:
        """Each segment's predicted peak (`segment_peaks`' figures)."""
        return self.peaks_of(q, np.array([_sums(freed)], dtype=np.int64), [extra], [levers])[0]

    def predict(
        self, q: Sequence[int], freed: Sequence[int], extra: int, levers: Sequence["LeverChoice"]
    ) -> Prediction:
        """`predict`'s answer: the highest segment, the first of equals."""
        values = self.peaks(q, freed, extra, levers)
        k = int(np.argmax(values))
        return Prediction(int(values[k]), self.memory.segments[k].name)


def _sums(values: Sequence[int]) -> List[int]:
    """The prefix sums of `values`: out[i] is the sum of the first i."""
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out


def as_kept(memory: StepMemory, measured_freed: Sequence[int], extra: int = 0) -> StepMemory:
    """The step's memory as if no layer had freed anything, with what later steps hold more (`extra`) added to every
    segment but the last (after backward, where step one already made what the next steps hold): the form in which
    steps measured on several processes, each freeing what its own graphs say, are put side by side (`merged`)."""
    last = len(memory.segments) - 1
    segments = [
        s.shifted(_moved(s, measured_freed, [0] * s.held) + (extra if k < last else 0) - s.peak_bytes)
        for k, s in enumerate(memory.segments)
    ]
    return StepMemory(memory.device, segments, memory.start_bytes, memory.how)


def merged(kept: Sequence[StepMemory], measured_freed: Sequence[int]) -> StepMemory:
    """Steps in `as_kept`'s form (one per process, rank order) as one step measured under `measured_freed` (the
    choosing process's), with no `extra` left to add: a peak predicted from it is the highest of every process's,
    and a budget met on it is met on each. Segments are named with their rank where there are several."""
    segments = []
    for rank, memory in enumerate(kept):
        for s in memory.segments:
            back = sum(measured_freed[: s.held])
            segments.append(s.shifted(-back, s.place.on_rank(rank) if len(kept) > 1 else None))
    first = kept[0]
    return StepMemory(first.device, segments, first.start_bytes, first.how)


@dataclass(frozen=True)
class LeverChoice:
    """One option of a lever beyond the layers (`levers/`), as the solver weighs it: pure data the lever makes from
    what it measured after step one (its `choices`).

    `option` is what the policy holds for it (`RecomputePolicy.levers`: a `plans.LeverOption`, its parameter and layers
    as data), None the lever off; `plan` its entries in the plan grammar, for messages and files ("" off). `less`: the
    bytes it holds less than the measured step's option, by segment (its `profile.Place` in the step, whichever process
    read it: the head's segment, a layer's backward); negative where it holds more. `seconds`: what it adds to a step
    on the compute's path, above the lever's fastest option (a constant apart: the least total time is the same). Work
    that overlaps compute (a copy on a stream of its own, as an offload's) is `overlap_seconds`, hidden under
    `window_seconds` of the step's compute: only what it runs past the window costs (`cost`). `returned`: what its
    forward returns that a caller may keep through the whole step (the model's own head's logits, in a loop that keeps
    `outputs`), counted held in every segment but the last. `less_parts`: the bytes it holds less in a stretch of a
    segment marked inside (`profile.Segment.parts`), as (the segment's place, the stretch's mark, bytes): a lever
    acting inside a layer (the tiled MLP) lowers the stretches its module runs in, and a segment's peak is the highest
    of its stretches so moved. `recomputed`: the layers the option needs recomputed whole (the tiled MLP is weighed
    there only: in a layer kept, what its saves hold less would show in every later segment, which no stretch's reading
    says)."""

    lever: str
    option: Optional[LeverOption] = None
    plan: str = ""
    less: Tuple[Tuple[Place, int], ...] = ()
    seconds: float = 0.0
    returned: int = 0
    overlap_seconds: float = 0.0
    window_seconds: float = 0.0
    less_parts: Tuple[Tuple[Place, str, int], ...] = ()
    recomputed: Tuple[int, ...] = ()

    @functools.cached_property
    def _less_at(self) -> Dict[Place, int]:
        out: Dict[Place, int] = {}
        for where, b in self.less:
            out[where] = out.get(where, 0) + b
        return out

    @functools.cached_property
    def _less_parts_at(self) -> Dict[Tuple[Place, str], int]:
        out: Dict[Tuple[Place, str], int] = {}
        for where, tag, b in self.less_parts:
            out[where, tag] = out.get((where, tag), 0) + b
        return out

    def less_in(self, place: Place) -> int:
        """What this option holds less than the measured step's in the segment at `place` (on any process)."""
        return self._less_at.get(place.in_step(), 0) if self.less else 0

    def less_in_part(self, place: Place, part: str) -> int:
        """What this option holds less than the measured step's in the stretch `part` of the segment at `place`."""
        return self._less_parts_at.get((place.in_step(), part), 0) if self.less_parts else 0

    def less_mb(self) -> Dict[str, float]:
        """What it holds less by segment (and stretch, "segment: stretch"), in MiB: solver.json's figures."""
        out = {str(where): b / MIB for where, b in self.less}
        out.update({f"{where}: {tag}": b / MIB for where, tag, b in self.less_parts})
        return out

    @property
    def cost(self) -> float:
        """The seconds it adds to a step: its time on the compute's path, and what of its overlapped work outruns
        the compute it hides under."""
        return self.seconds + max(0.0, self.overlap_seconds - self.window_seconds)

    @property
    def label(self) -> str:
        return self.plan or f"{self.lever} off"


@dataclass
class Corrections:
    """What a dry run's checks read beyond their predictions (`learn`), segment by segment, for the solves after them
    (and, before the first check, what a layer run alone under a configuration held beyond them, laid on `own` by
    `planner.BudgetPlanner._probed`): the figures `predict` gives are exact but for a layer's own forward and backward
    under a configuration other than the measured step's (a planned tensor let go of only after its last use; a layer
    replayed in its own backward bringing its tensors back one at a time: `predict_range`) and a segment the levers'
    options are weighed in by a bound (the head's ways). A dry run's readings are exact and the same each time, so
    each difference is one configuration's (or one combination of the levers' options'): `own` by layer, then `alike`
    for a layer not yet checked under that configuration (the most any layer of the step read under it: the model's
    layers are alike), and `shared` for the segments no layer owns, by the levers' options, then `shared_alike` for
    options not yet checked (the most any read there). Empty: every figure as `predict` gives it."""

    own: Dict[Tuple[int, str, str], int] = field(default_factory=dict)  # (layer, its configuration, kind) -> bytes
    alike: Dict[Tuple[str, str], int] = field(default_factory=dict)  # (configuration, kind) -> bytes
    shared: Dict[Tuple[Place, Tuple[str, ...]], int] = field(default_factory=dict)  # (place, the options) -> bytes
    shared_alike: Dict[Place, int] = field(default_factory=dict)  # place -> the most any options read there

    def __bool__(self) -> bool:
        return bool(self.own or self.shared)

    def learn(
        self,
        predicted: Sequence[tuple],
        measured: StepMemory,
        choice: Sequence[Candidate],
        levers: Sequence[LeverChoice],
    ) -> None:
        """From a check: `predicted`, each segment's figure as `segment_peaks` gives it for `choice` and `levers`
        (uncorrected), and the step that ran them, `measured`, segment by segment (the same places in order)."""
        figures = {place.in_step(): value for place, value in predicted}
        options = _options_key(levers)
        for seg in measured.segments:
            place = seg.place.in_step()
            if place not in figures:
                continue
            more = seg.peak_bytes - figures[place]
            if seg.own is not None and seg.own < len(choice):
                label = choice[seg.own].label
                self.own[seg.own, label, place.kind] = more
                known = self.alike.get((label, place.kind))
                self.alike[label, place.kind] = more if known is None else max(known, more)
            else:
                self.shared[place, options] = more
                known = self.shared_alike.get(place)
                self.shared_alike[place] = more if known is None else max(known, more)

    def of_own(self, layer: int, label: str, kind: str) -> int:
        """What layer `layer`'s own segment of `kind` holds beyond the prediction under configuration `label`."""
        known = self.own.get((layer, label, kind))
        return known if known is not None else self.alike.get((label, kind), 0)

    def offsets(self, memory: StepMemory, choice: Sequence[Candidate], levers: Sequence[LeverChoice]) -> np.ndarray:
        """Each segment's difference with `choice` and `levers` (0 where none was read)."""
        out = np.zeros(len(memory.segments), dtype=np.int64)
        for k, seg in enumerate(memory.segments):
            place = seg.place.in_step()
            if seg.own is not None and seg.own < len(choice):
                out[k] = self.of_own(seg.own, choice[seg.own].label, place.kind)
            else:
                out[k] = self.of_shared(place, levers)
        return out

    def of_shared(self, place: Place, levers: Sequence[LeverChoice]) -> int:
        """What the segment at `place`, which no layer owns, holds beyond the prediction with `levers`' options."""
        known = self.shared.get((place.in_step(), _options_key(levers)))
        return known if known is not None else self.shared_alike.get(place.in_step(), 0)


class _Corrected:
    """`Corrections` laid over one measured step's segments for one fit (which weighs thousands of combinations of
    the levers' options): the segments each layer owns and the others, found once, and each list of candidates'
    offsets once (`solver.OwnNeeds`)."""

    def __init__(self, corrections: Corrections, memory: StepMemory, layers: int):
        self.corrections = corrections
        self.memory = memory
        self.layers = layers
        self.others = [k for k, seg in enumerate(memory.segments) if seg.own is None or seg.own >= layers]
        # each layer's own segments (one each, or one a process), as runs of indices `np.maximum.reduceat` reads
        self.kinds = {}
        for kind in (FORWARD, BACKWARD):
            owned: List[List[int]] = [[] for _ in range(layers)]
            for k, seg in enumerate(memory.segments):
                if seg.own is not None and seg.own < layers and seg.place.kind == kind:
                    owned[seg.own].append(k)
            has = np.array([bool(ks) for ks in owned])
            order = np.array([k for ks in owned for k in ks], dtype=np.int64)
            starts = np.cumsum([0] + [len(ks) for ks in owned if ks])[:-1]
            self.kinds[kind] = (has, order, starts)
        self._offsets: Dict[int, tuple] = {}  # id(per_layer) -> (per_layer, kept alive; each layer's offsets)

    def owns(self, seg: Segment) -> bool:
        return seg.own is not None and seg.own < self.layers

    def _most(self, over: np.ndarray, kind: str) -> List[int]:
        """Per layer, the highest of its own segments of `kind` in `over`; `LEAST` where it has none."""
        has, order, starts = self.kinds[kind]
        out = np.full(self.layers, LEAST, dtype=np.int64)
        if len(order):
            out[has] = np.maximum.reduceat(over[order], starts)
        return out.tolist()

    def shared(self, combos: Sequence[Sequence[LeverChoice]]) -> np.ndarray:
        """For each combination of the levers' options, what each segment no layer owns read beyond its prediction
        with them (0 in the segments a layer owns): a row per combination."""
        out = np.zeros((len(combos), len(self.memory.segments)), dtype=np.int64)
        places = [(k, self.memory.segments[k].place.in_step()) for k in self.others]
        shared, alike = self.corrections.shared, self.corrections.shared_alike
        for row, levers in enumerate(combos):
            key = _options_key(levers)
            for k, place in places:
                known = shared.get((place, key))
                out[row, k] = known if known is not None else alike.get(place, 0)
        return out

    def own_needs(self, over: np.ndarray, per_layer) -> list:
        """Each layer's own segments as the solver meets them (`solver.OwnNeeds`; None for a layer without any), from
        `over`: each segment's figure with every layer kept, less the budget."""
        known = self._offsets.get(id(per_layer))
        if known is None:
            of_own = self.corrections.of_own
            offsets = [
                tuple((of_own(i, c.label, FORWARD), of_own(i, c.label, BACKWARD)) for c in options)
                for i, options in enumerate(per_layer)
            ]  # fmt: skip
            known = self._offsets[id(per_layer)] = (per_layer, offsets)
        forward, backward = self._most(over, FORWARD), self._most(over, BACKWARD)
        return [
            OwnNeeds(f, b, known[1][i]) if (f != LEAST or b != LEAST) else None
            for i, (f, b) in enumerate(zip(forward, backward))
        ]


LEAST = -(1 << 62)  # the need of a segment a layer does not have: nothing


def _options_key(levers: Sequence[LeverChoice]) -> Tuple[str, ...]:
    """The levers' options, as `Corrections.shared` tells combinations apart."""
    return tuple(sorted(f"{c.lever}:{c.label}" for c in levers))


@dataclass
class Fit:
    """The solver's answer for one budget."""

    budget_bytes: int
    measured: Prediction  # the measured step's peak, moved by `extra`
    floor: Prediction  # the least peak recompute reaches (each layer freeing the most it can)
    choice: Optional[List[Candidate]] = None  # None: nothing fits (`why_not`)
    predicted: Optional[Prediction] = None
    segments: List[tuple] = field(default_factory=list)  # (its place, its predicted peak in bytes) with the choice
    why_not: str = ""
    share: Optional[float] = None  # the budget as a share of `activation_bytes` (`fit_share`), else None
    activation_bytes: int = 0  # what the layers keep for backward with nothing recomputed
    levers: Tuple[LeverChoice, ...] = ()  # each lever's option with the choice (the levers offered none: as measured)
    source: str = ""  # where the choice comes from, if not the solver's for this step (`planner._confirmed`)

    @property
    def recompute_seconds(self) -> float:
        return sum(c.seconds for c in self.choice) + sum(c.cost for c in self.levers) if self.choice else 0.0

    @property
    def returned(self) -> int:
        return sum(c.returned for c in self.levers)

    def lever(self, name: str) -> Optional[LeverChoice]:
        return next((c for c in self.levers if c.lever == name), None)

    @property
    def freed(self) -> int:
        return sum(c.freed_bytes for c in self.choice) if self.choice else 0

    def policy(self) -> RecomputePolicy:
        policy = policy_of(self.choice)
        policy.levers = {c.lever: c.option for c in self.levers if c.option is not None}
        return policy

    def as_dict(self) -> dict:
        """The answer in `memory_auto/solver.json`."""
        return {
            "budget_mb": self.budget_bytes / MIB if self.share is None else None,
            "activation_share": self.share,
            "activation_mb": self.activation_bytes / MIB if self.share is not None else None,
            "config": self.config() if self.choice else None,
            "per_layer": [c.label for c in self.choice] if self.choice else None,
            "levers": {c.lever: c.label for c in self.levers} if self.choice else None,
            "levers_freed_mb": ({c.lever: c.less_mb() for c in self.levers} if self.choice else None),
            "predicted_peak_mb": self.predicted.peak_mb if self.predicted else None,
            "predicted_peak_in": self.predicted.where if self.predicted else None,
            "predicted_segments": [
                {"name": str(where), "place": where.as_dict(), "peak_mb": value / MIB}
                for where, value in self.segments
            ],
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
        return ",".join([str(e) for e in plan_entries(self.choice)] + [c.plan for c in self.levers if c.plan])


# a combination's least time (`solver.Relaxation`) is lowered by this share before it is compared with a time
# found: the two sums add the same seconds in different orders, and a bound a rounding above the time would pass over
# the combination that ties it
BOUND_SLACK = 1e-9


def fit(
    profile: ModelProfile,
    memory: StepMemory,
    budget_bytes: int,
    measured: RecomputePolicy,
    extra_bytes: int = 0,
    per_layer: Optional[Sequence[Sequence[Candidate]]] = None,
    levers: Sequence[Sequence[LeverChoice]] = (),
    corrections: Optional[Corrections] = None,
    weighed: Optional["Weighing"] = None,
) -> Fit:
    """The least-recompute policy whose predicted peak is at most `budget_bytes`, from a step measured under
    `measured` (its memory by segment and each layer's graph), with the levers beyond the layers chosen in the same
    solve (`levers`: each lever's options, from its `choices`): for each combination of one option per lever, the
    layers' least-time choice under the budget with the segments the options act in moved by what they hold less;
    the least total time wins (the options' `cost` included).

    The combinations are tried from the least time they could take (their options' cost and the least the layers can
    take to free what their segments need: `solver.Relaxation`, a bound the dynamic programme cannot beat); once
    one fits, those that could take no less are not solved. The answer is the one trying every combination in the
    levers' order gives: of equal times, the first in that order.

    `corrections`: what a dry run's checks read beyond their predictions (`Corrections`), each segment's figure moved
    by it for the configurations and options that read it: a layer's own segments then need what its configuration
    holds there (`solver.OwnNeeds`), and the figure given is so moved. `weighed`: `weigh`'s answer, for a caller
    that fits one step several times (used where it was weighed from these very inputs)."""
    corrections = corrections if corrections else None
    per_layer, q, result, combos, moved = _start(profile, memory, measured, extra_bytes, per_layer, levers, weighed)
    result.budget_bytes = budget_bytes
    bounded = []  # each combination with its needs and the least time it can take for them (`solver.Relaxation`)
    relaxed: Dict[int, Relaxation] = {}  # id(allowed) -> its bound (the combinations share a few lists of candidates)
    hulls: dict = {}  # each layer's hull in the bounds, by its candidates (the lists share most layers')
    corrected = _Corrected(corrections, memory, len(per_layer)) if corrections is not None else None
    needed = _Needs(moved, q, budget_bytes, extra_bytes, [c for _, c, _, _, _ in combos], len(per_layer), corrected)
    for row, (order, combo, allowed, floor, _) in enumerate(combos):
        if id(allowed) not in relaxed:
            relaxed[id(allowed)] = Relaxation(allowed, hulls)
        at_least = sum(c.cost for c in combo) + relaxed[id(allowed)].least_seconds(needed.most(row))
        bounded.append((at_least * (1 - BOUND_SLACK), order, combo, allowed, floor, row, needed.why_not(row)))
    bounded.sort(key=lambda entry: entry[:2])
    best, closest = None, None  # closest: (the least peak of a combination that does not fit, its order, why not)
    for at_least, order, combo, allowed, floor, row, why_not in bounded:
        if best is not None and at_least > best[0]:
            break  # sorted: every combination after it takes more than the one found
        if best is not None and at_least >= best[0] and order > best[3]:
            continue  # it could at best tie, and a tie keeps the first in order
        least = floor.peak_bytes
        if why_not is None and least > budget_bytes:
            why_not = (
                f"with each layer recomputing the most it can, the step still peaks at "
                f"{result.floor.peak_mb:,.1f} MiB ({result.floor.where}), over the budget"
            )
        choice = None
        if why_not is None:
            choice = choose(allowed, 0, prefix_needs=needed.needs(row), own=needed.own(row, allowed))
        if why_not is None and choice is None:  # the bytes are there, but not in the solver's units
            why_not = "no choice frees the bytes needed in the units the solver counts in"
        if choice is None:
            if closest is None or (least, order) < closest[:2]:  # said of the levers' options that come closest
                closest = (least, order, why_not)
            continue
        extra = extra_bytes + sum(c.returned for c in combo)
        choice = _polished(moved, q, extra, combo, allowed, choice, budget_bytes, corrections)
        seconds = sum(c.seconds for c in choice) + sum(c.cost for c in combo)
        if best is None or seconds < best[0] or (seconds == best[0] and order < best[3]):
            best = (seconds, choice, combo, order)
    if best is None:
        result.why_not = closest[2] if closest is not None else "no option of the levers can run with the layers"
        return result
    _, result.choice, result.levers, _ = best
    freed = [c.freed_bytes for c in result.choice]
    extra = extra_bytes + result.returned
    values = moved.peaks(q, freed, extra, result.levers)
    if corrections is not None:
        values = values + corrections.offsets(memory, result.choice, result.levers)
    k = int(np.argmax(values))
    result.predicted = Prediction(int(values[k]), memory.segments[k].name)
    result.segments = [(seg.place, int(value)) for seg, value in zip(memory.segments, values)]
    return result


def _polished(
    moved: _Moved,
    q,
    extra_bytes: int,
    levers: Sequence[LeverChoice],
    per_layer,
    choice: List[Candidate],
    budget_bytes: int,
    corrections: Optional[Corrections] = None,
) -> List[Candidate]:
    """`choice` with each layer's configuration made quicker wherever the step's figure, to the byte, still fits
    (one layer at a time, the quickest that fits first, until none does): the dynamic programme counts bytes in
    units where their greatest common divisor would make its table too long, each candidate's rounded down, which
    at 8B leaves up to a unit a layer unspent (32 units of 2.5 MiB: a choice with 0.5% less recompute whose figure
    fits by 60 MiB was passed over)."""

    values = moved.peaks(q, [c.freed_bytes for c in choice], extra_bytes, levers)
    if corrections is not None:
        values = values + corrections.offsets(moved.memory, choice, levers)
    segments = moved.memory.segments
    own: Dict[int, List[int]] = {}  # layer -> its own segments (what its configuration's corrections move)
    if corrections is not None:
        for k, seg in enumerate(segments):
            if seg.own is not None:
                own.setdefault(seg.own, []).append(k)
    choice = list(choice)
    quicker = True
    while quicker:
        quicker = False
        for i, options in enumerate(per_layer):
            holds = moved.held > i  # the segments that hold layer i's kept tensors
            for c in sorted(options, key=lambda c: c.seconds):
                if c.seconds >= choice[i].seconds:
                    break
                trial = values + (choice[i].freed_bytes - c.freed_bytes) * holds
                for k in own.get(i, ()):
                    kind = segments[k].place.kind
                    trial[k] += corrections.of_own(i, c.label, kind) - corrections.of_own(i, choice[i].label, kind)
                if int(trial.max()) <= budget_bytes:
                    choice[i], values, quicker = c, trial, True
                    break
    return choice


class _Needs:
    """What every combination of the levers' options (`combos`) needs the layers to free for each segment to fit,
    weighed at once, a row of arrays per combination (a fit weighs a few thousand): each segment's figure with every
    layer's tensors kept (`_Moved.peaks`, the segments the options act in moved) less the budget, `over`; where a
    segment is over, the first `held` layers must free that much (the solver's prefix needs, `needs`), unless a layer
    owns it and `corrected` is given (met by that layer's configuration: `own`, `solver.OwnNeeds`), or it holds no
    layer's tensors (`why_not`: recompute cannot lower it)."""

    def __init__(
        self,
        moved: _Moved,
        q,
        budget_bytes: int,
        extra_bytes: int,
        combos: Sequence[Sequence[LeverChoice]],
        layers: int,
        corrected: Optional[_Corrected] = None,
    ):
        self.moved, self.budget_bytes, self.corrected = moved, budget_bytes, corrected
        segments = moved.memory.segments
        extras = [extra_bytes + sum(c.returned for c in combo) for combo in combos]
        kept = np.zeros((1, len(q) + 1), dtype=np.int64)  # every layer's tensors kept
        over = moved.peaks_of(q, kept, extras, combos) - budget_bytes
        owned = np.zeros(len(segments), dtype=bool)
        if corrected is not None:  # the segments no layer owns moved by what the options read; a layer's own apart
            over += corrected.shared(combos)
            owned = np.array([corrected.owns(seg) for seg in segments], dtype=bool)
        self.over = over
        self._needs = np.zeros((len(combos), layers), dtype=np.int64)
        for layer in range(layers):  # the segments holding the first layer + 1 layers' tensors
            ks = np.flatnonzero((moved.held == layer + 1) & ~owned)
            if len(ks):
                self._needs[:, layer] = np.maximum(over[:, ks].max(axis=1), 0)
        self._alone = np.flatnonzero((moved.held == 0) & ~owned)  # no layer's tensors held: recompute cannot help

    def most(self, row: int) -> int:
        """The most any prefix of the layers must free for combination `row`."""
        return int(self._needs[row].max()) if self._needs.shape[1] else 0

    def needs(self, row: int) -> List[int]:
        return self._needs[row].tolist()

    def own(self, row: int, per_layer) -> Optional[list]:
        return self.corrected.own_needs(self.over[row], per_layer) if self.corrected is not None else None

    def why_not(self, row: int) -> Optional[str]:
        """Why recompute cannot meet the budget with combination `row` (a segment no layer's tensors are held in
        peaks over it: the first such), else None."""
        over = self.over[row, self._alone]
        if not len(over) or over.max() <= 0:
            return None
        k = int(self._alone[int(np.argmax(over > 0))])
        seg, need = self.moved.memory.segments[k], int(self.over[row, k])
        where = (
            "where no other layer's tensors are held and its own are all back for its backward, whatever its policy"
            if seg.place.layer is not None
            else "where no layer's tensors are held"
        )
        return (
            f"the step peaks at {(need + self.budget_bytes) / MIB:,.1f} MiB "
            f"{'in ' if seg.place.layer is not None else ''}{seg.name}, {where}: recompute cannot lower it"
        )


def _allowed(profile: ModelProfile, per_layer, levers: Sequence[LeverChoice], wholes: Optional[dict] = None):
    """Each layer's candidates with the levers' options `levers`: only the whole layer where an option needs it
    recomputed whole (`LeverChoice.recomputed`; offered even where a set of op plans frees as much for less, which
    `solver.candidates` keeps instead); None where such a layer has no graph to recompute it by. `wholes`: each
    layer's whole-layer candidate found so far, as the one list of candidates every combination forcing it gets
    (index -> [candidate]; `solver.Relaxation` finds each list's hull once), filled as they are found."""
    whole = {i for c in levers for i in c.recomputed if i < len(per_layer)}
    if not whole:
        return per_layer
    wholes = {} if wholes is None else wholes
    allowed = list(per_layer)
    for i in whole:
        if i not in wholes:
            rec = profile.layers[i] if i < len(profile.layers) else None
            if rec is None or rec.graph is None:
                return None
            done = whole_layer(rec.graph, rec.op_seconds)
            wholes[i] = [Candidate(frozenset(), True, done.freed_bytes, done.seconds)]
        allowed[i] = wholes[i]
    return allowed


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
    per_layer, q, result, _, _ = _start(profile, memory, measured, extra_bytes, per_layer)
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


@dataclass(frozen=True)
class Weighing:
    """What every fit of one measured step shares whatever its budget and corrections (`weigh`): each layer's
    candidates, what the measured policy freed per layer, the combinations of the levers' options that can run
    (`_combinations`), the step's segments as arrays (`_Moved`, each option's bytes read once), the measured step's
    figure and the floor. Made once for a planner's several fits of its step one (`fit`'s `weighed`)."""

    per_layer: list
    q: list
    combos: list
    moved: "_Moved"
    measured: Prediction
    floor: Prediction
    inputs: tuple  # what it was weighed from, held (`fit` weighs again for other inputs, told apart by identity)


def weigh(profile, memory, measured, extra_bytes=0, per_layer=None, levers: Sequence[Sequence[LeverChoice]] = ()):
    """`fit`'s start (`Weighing`): the candidates, what the measured policy freed per layer, the combinations of the
    levers' options that can run, the floor (each layer freeing the most it can, the levers' options combined so that
    the step holds least) and the measured step's figure."""
    inputs = (profile, memory, measured, per_layer, extra_bytes, tuple(levers))
    per_layer = list(per_layer) if per_layer is not None else candidates(profile)
    q = freed_bytes(profile, measured)
    moved = _Moved(memory)
    combos = _combinations(profile, moved, q, per_layer, extra_bytes, levers)
    floor = min((f for _, _, _, f, _ in combos), key=lambda p: p.peak_bytes)
    return Weighing(per_layer, q, combos, moved, moved.predict(q, q, extra_bytes, ()), floor, inputs)


def _weighed_from(weighed: Weighing, inputs: tuple) -> bool:
    """Whether `weighed` was weighed from these very `inputs`: the same objects (the levers' option lists one by one),
    the same `extra_bytes`."""
    (*held, extra, levers), (*given, extra_now, levers_now) = weighed.inputs, inputs
    return (
        extra == extra_now
        and all(a is b for a, b in zip(held, given))
        and len(levers) == len(levers_now)
        and all(a is b for a, b in zip(levers, levers_now))
    )


def _start(
    profile, memory, measured, extra_bytes, per_layer, levers: Sequence[Sequence[LeverChoice]] = (), weighed=None
):
    """What `fit` and `fit_share` share (`weighed` where it was weighed from the same inputs, else `weigh`), and the
    answer begun with the measured step's figure and the floor."""
    if weighed is None or not _weighed_from(
        weighed, (profile, memory, measured, per_layer, extra_bytes, tuple(levers))
    ):
        weighed = weigh(profile, memory, measured, extra_bytes, per_layer, levers)
    result = Fit(0, measured=weighed.measured, floor=weighed.floor)
    return weighed.per_layer, weighed.q, result, weighed.combos, weighed.moved


def _combinations(profile, moved: _Moved, q, per_layer, extra_bytes, levers: Sequence[Sequence[LeverChoice]]) -> list:
    """Each combination of one option per lever whose layers can run it: (its place in the levers' order, its options,
    each layer's candidates with them, the least peak they reach, the least time they can take: their options' cost
    and the whole-layer recompute they force, every other layer kept), ordered by that least time, then by place.
    Combinations that force the same layers whole share one list of candidates (one object: `fit` bounds each list
    once)."""
    wholes: Dict[int, List[Candidate]] = {}
    # the layers forced whole -> (each layer's candidates, the most each frees, the whole layers' seconds, in the
    # layers' order)
    lists: Dict[frozenset, tuple] = {}
    forces = {id(c): frozenset(i for i in c.recomputed if i < len(per_layer)) for options in levers for c in options}
    runs = []
    for order, combo in enumerate(itertools.product(*levers)):
        forced = frozenset().union(*(forces[id(c)] for c in combo))
        if forced not in lists:
            allowed = _allowed(profile, per_layer, combo, wholes)
            most = None if allowed is None else _sums([max(c.freed_bytes for c in options) for options in allowed])
            whole_seconds = None if allowed is None else sum(wholes[i][0].seconds for i in sorted(forced))
            lists[forced] = (allowed, most, whole_seconds)
        allowed, most, whole_seconds = lists[forced]
        if allowed is not None:
            runs.append((order, combo, allowed, most, sum(c.cost for c in combo) + whole_seconds))
    runs.sort(key=lambda entry: (entry[4], entry[0]))
    if not runs:
        return []
    # each one's floor (each layer freeing the most it can), as `_Moved.predict` gives it, on one array
    most_sums = np.array([most for _, _, _, most, _ in runs], dtype=np.int64)
    extras = [extra_bytes + sum(c.returned for c in combo) for _, combo, _, _, _ in runs]
    values = moved.peaks_of(q, most_sums, extras, [combo for _, combo, _, _, _ in runs])
    top = values.argmax(axis=1)
    names = [seg.name for seg in moved.memory.segments]
    return [
        (order, combo, allowed, Prediction(int(values[row, top[row]]), names[top[row]]), at_least)
        for row, (order, combo, allowed, _, at_least) in enumerate(runs)
    ]


def plan_entries(choice: Sequence[Candidate]) -> List[PlanEntry]:
    """One plan per configuration chosen, with a selector of its layers: `Layer+:1:-1@2-3`, `Mul+silu+:1:-1@0-1`."""
    groups: Dict[tuple, List[int]] = {}
    for i, c in enumerate(choice):
        if c.whole or c.ops:
            groups.setdefault((c.whole, c.ops), []).append(i)
    entries = []
    for (whole, ops), layers in sorted(groups.items(), key=lambda kv: kv[1][0]):
        subgraph = LAYER_PLAN if whole else "".join(f"{name}+" for name in sorted(ops))
        entries.append(PlanEntry(subgraph, 1, -1, layer_selector(layers)))
    return entries


def fit_of_plans(config: str, n_layers: int, budget_bytes: int, predicted: Prediction, floor: Prediction) -> Fit:
    """A choice written in the plan grammar (what `Fit.config` writes: a `memopt-plan` file's) as an answer for
    `n_layers` layers, `predicted` its peak: each layer's configuration and each lever's option as the plans name
    them. What each frees and costs is not in the grammar: 0 until a step's profile offers them (`matched`)."""
    entries = parse_plans(config) if config else []
    policy = RecomputePolicy.from_plans(entries, 0, n_layers)
    choice = [Candidate(lp.ops, lp.mode == LAYER, 0, 0.0) for lp in policy.layers]
    written: Dict[str, List[str]] = {}
    for entry in entries:
        syntax = lever_syntax(entry.subgraph)
        if syntax is not None and entry.enabled:
            written.setdefault(syntax.name, []).append(str(entry))
    levers = tuple(LeverChoice(name, option, ",".join(written[name])) for name, option in policy.levers.items())
    return Fit(budget_bytes, predicted, floor, choice, predicted, levers=levers)


def matched(result: Fit, profile: ModelProfile, levers: Dict[str, Sequence[LeverChoice]]) -> Optional[Fit]:
    """`result` (`fit_of_plans`) with what each layer's configuration frees and costs in `profile`'s graphs and each
    lever's option as the lever offers it after that step (`levers`: each lever's `choices`); None where a layer
    recomputing something has no graph there, or a lever does not offer the option."""
    if len(profile.layers) != len(result.choice):
        return None
    choice = []
    for mine, rec in zip(result.choice, profile.layers):
        if not mine.whole and not mine.ops:
            choice.append(KEEP)
        elif rec.graph is None:
            return None
        elif mine.whole:
            whole = whole_layer(rec.graph, rec.op_seconds)
            choice.append(Candidate(frozenset(), True, whole.freed_bytes, whole.seconds))
        else:
            e = effect(rec.graph, mine.ops)
            choice.append(Candidate(mine.ops, False, e.freed_bytes, e.seconds))
    options = []
    for mine in result.levers:
        same = next((c for c in levers.get(mine.lever, ()) if c.option == mine.option), None)
        if same is None:
            return None
        options.append(same)
    named = {c.lever for c in result.levers}
    for name, offered in levers.items():  # a lever the plans leave off runs as its option None
        off = next((c for c in offered if c.option is None), None)
        if name not in named and off is not None:
            options.append(off)
    return replace(result, choice=choice, levers=tuple(options))
