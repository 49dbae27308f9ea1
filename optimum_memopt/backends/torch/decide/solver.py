"""The budget solver's core: per layer, the configurations worth choosing from (keep, the sets of plans on the
layer's frontier, the whole layer), and the choice over all layers that frees at least a given number of bytes with
the least recompute time (a multiple-choice knapsack, solved by dynamic programming over the bytes: exactly, in units
of the bytes' greatest common divisor, where that is at most EXACT_STEPS units; else in STEPS units, each candidate
rounded down, so that a choice can only free more than asked, never less).

Where the peak falls and how many bytes must go (the budget against the measured step) is the caller's; this module
answers "free N bytes for the least time" from step one's profile. Pure (numpy for the table, no torch state).
"""

import bisect
import functools
import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..measure.graph import frontier, whole_layer
from ..measure.profile import ModelProfile
from ..policy import LAYER, LayerPolicy, RecomputePolicy

STEPS = 4096  # the bytes to free are counted in at most this many units when they must be rounded
EXACT_STEPS = 1 << 18  # or in up to this many units of their greatest common divisor (exact)


@dataclass(frozen=True)
class Candidate:
    """One configuration of one layer: what it frees and what it costs each backward."""

    ops: FrozenSet[str]  # plan names recomputed (empty: keep, or the whole layer)
    whole: bool
    freed_bytes: int
    seconds: float

    @functools.cached_property
    def label(self) -> str:
        if self.whole:
            return "Layer+"
        return "+".join(sorted(self.ops)) + "+" if self.ops else "keep"

    def layer_policy(self) -> LayerPolicy:
        if self.whole:
            return LayerPolicy(LAYER)
        return LayerPolicy.of_ops({name: "solver" for name in self.ops})


KEEP = Candidate(frozenset(), False, 0, 0.0)


def candidates(profile: ModelProfile) -> List[List[Candidate]]:
    """Per layer: keep, each set of plans on its frontier, and the whole layer, without the dominated ones (one that
    frees no more than another that costs no more)."""
    out = []
    for rec in profile.layers:
        options = [KEEP]
        if rec.graph is not None:
            options += [Candidate(ops, False, e.freed_bytes, e.seconds) for ops, e in frontier(rec.graph)]
            whole = whole_layer(rec.graph, rec.op_seconds)
            options.append(Candidate(frozenset(), True, whole.freed_bytes, whole.seconds))
        out.append(_undominated(options))
    return out


def _undominated(options: Sequence[Candidate]) -> List[Candidate]:
    kept: List[Candidate] = []
    for c in sorted(options, key=lambda c: (c.seconds, -c.freed_bytes, c.whole)):
        if not kept or c.freed_bytes > kept[-1].freed_bytes:
            kept.append(c)
    return kept


@dataclass(frozen=True)
class OwnNeeds:
    """Layer i's own two segments where they depend on its own configuration (`budget.Corrections`: what a dry
    run's checks measured a configuration's own forward and backward to hold beyond the prediction): its forward
    needs the first i + 1 layers to free `forward` bytes and its backward the first i to free `backward`, each more
    by what the layer's configuration holds there beyond the prediction (`offsets[k]`: (forward, backward) for its
    k-th candidate)."""

    forward: int
    backward: int
    offsets: Tuple[Tuple[int, int], ...]

    def thresholds(self, k: int) -> Tuple[int, int]:
        """The bytes the layers before and with this one, and those before it, must free under candidate k."""
        more_forward, more_backward = self.offsets[k]
        return self.forward + more_forward, self.backward + more_backward


def choose(
    per_layer: Sequence[Sequence[Candidate]],
    need_bytes: int,
    prefix_needs: Optional[Sequence[int]] = None,
    own: Optional[Sequence[Optional[OwnNeeds]]] = None,
) -> Optional[List[Candidate]]:
    """One candidate per layer freeing at least `need_bytes` in all, with the least total seconds; None when even the
    most each layer can free is not enough. `prefix_needs[i]`, where given: the first i + 1 layers free at least
    that many bytes (a segment of the step that holds only their tensors). `own[i]`, where given and not None: layer
    i's own segments, whose needs depend on its candidate (`OwnNeeds`). Exact for the bytes as counted: each
    candidate's bytes are rounded down to the unit and the needs up, so a choice found frees at least what was
    asked."""
    needs = [math.ceil(n) for n in prefix_needs] if prefix_needs is not None else [0] * len(per_layer)
    if len(needs) != len(per_layer):
        raise ValueError(f"{len(needs)} prefix needs for {len(per_layer)} layers")
    own = list(own) if own is not None else [None] * len(per_layer)
    if needs:
        needs[-1] = max(needs[-1], math.ceil(need_bytes))
    own_most = [max(max(o.thresholds(k)) for k in range(len(o.offsets))) for o in own if o is not None]
    cap_bytes = max(needs + own_most, default=0)
    if cap_bytes <= 0:  # nothing to free: each layer kept, or its quickest where keeping it is not offered
        return [KEEP if KEEP in options else min(options, key=lambda c: c.seconds) for options in per_layer]
    most = 0
    for options, need in zip(per_layer, needs):
        most += max(c.freed_bytes for c in options)
        if most < need:
            return None
    unit = _unit(per_layer, cap_bytes)
    cap = -(-cap_bytes // unit)
    states = np.arange(cap + 1)
    best = np.full(cap + 1, np.inf)  # best[b]: least seconds freeing at least b units so far (b capped at cap)
    best[0] = 0.0
    trail = []  # per layer: the candidate chosen and the state it came from, for each state
    for options, need, mine in zip(per_layer, needs, own):
        new = np.full(cap + 1, np.inf)
        pick = np.zeros(cap + 1, dtype=np.int64)
        prev = np.zeros(cap + 1, dtype=np.int64)
        cheapest = {}  # (units freed, least state before) -> the least seconds of an option before it
        for k, c in enumerate(options):  # an option replaces what one before it reaches only if it costs less
            w = min(c.freed_bytes // unit, cap)
            lo = 0  # the least state it may come from: its own segments' needs met (`OwnNeeds`)
            if mine is not None:
                forward, backward = mine.thresholds(k)
                lo = max(0, -(-backward // unit), -(-forward // unit) - w)
                if lo > cap:
                    continue
            if cheapest.get((w, lo), math.inf) <= c.seconds:
                continue
            cheapest[w, lo] = c.seconds
            if not w:
                reach = best + c.seconds
                reach[:lo] = np.inf
                better = reach < new
                new[better], pick[better], prev[better] = reach[better], k, states[better]
                continue
            reach = best[: cap - w] + c.seconds  # from b units before to b + w, below the last state
            reach[:lo] = np.inf
            better = reach < new[w:cap]
            new[w:cap][better], pick[w:cap][better], prev[w:cap][better] = reach[better], k, states[: cap - w][better]
            first = max(cap - w, lo)  # the last state holds "cap or more": any b >= cap - w
            j = first + int(np.argmin(best[first:]))
            if best[j] + c.seconds < new[cap]:
                new[cap], pick[cap], prev[cap] = best[j] + c.seconds, k, j
        if need > 0:
            new[: -(-need // unit)] = np.inf  # these layers must free `need` bytes by now
        best = new
        trail.append((pick, prev))
    end = int(np.argmin(best))
    if not np.isfinite(best[end]):
        return None  # the bytes are there, but not in whole units: counted conservatively
    chosen, b = [], end
    for options, (pick, prev) in zip(reversed(per_layer), reversed(trail)):
        chosen.append(options[int(pick[b])])
        b = int(prev[b])
    return list(reversed(chosen))


class Relaxation:
    """A lower bound of what `choose` can answer over `per_layer` for any bytes to free (and any prefix needs up to
    them): the least seconds of freeing that many bytes where a layer may take a share of a step between two of its
    configurations (the knapsack's linear relaxation: each layer from its quickest configuration along the lower
    convex hull of its (bytes, seconds), the steps of every layer taken cheapest per byte first). Built once for a
    set of candidates (a few microseconds a configuration), then asked for a figure by a binary search, where a
    `choose` walks its table: what lets `budget.fit` pass over combinations of the levers' options that cannot beat
    one already found."""

    def __init__(self, per_layer: Sequence[Sequence[Candidate]], hulls: Optional[dict] = None):
        """`hulls`: each layer's hull found so far, by its list of candidates (id -> (the list, kept alive; its
        start and steps)), for relaxations of lists of candidates that share most layers' (a fit's: the levers'
        options force a few layers whole and leave the others' lists as they are)."""
        self.seconds, self.freed, steps = 0.0, 0, []
        hulls = {} if hulls is None else hulls
        for options in per_layer:
            known = hulls.get(id(options))
            if known is None:
                known = hulls[id(options)] = (options, *_hull(options))
            _, start, mine = known
            self.seconds += start[1]
            self.freed += start[0]
            steps += mine
        steps.sort()
        self._per_byte = [per_byte for per_byte, _ in steps]
        self._bytes, self._seconds = [0], [0.0]  # after the first k steps: the bytes they free, the seconds they take
        for per_byte, size in steps:
            self._bytes.append(self._bytes[-1] + size)
            self._seconds.append(self._seconds[-1] + per_byte * size)

    def least_seconds(self, need_bytes: int) -> float:
        """The bound for freeing `need_bytes`; `math.inf` where the layers cannot free that many."""
        missing = need_bytes - self.freed
        if missing <= 0:
            return self.seconds
        if missing > self._bytes[-1]:
            return math.inf
        k = bisect.bisect_left(self._bytes, missing)  # the k-th step is the one taken in part
        return self.seconds + self._seconds[k - 1] + self._per_byte[k - 1] * (missing - self._bytes[k - 1])


def _hull(options: Sequence[Candidate]) -> Tuple[Tuple[int, float], list]:
    """One layer's quickest configuration (bytes, seconds; of equal times, the one freeing the most) and the steps
    along the lower convex hull of its (bytes, seconds) from there, each (seconds per byte, bytes)."""
    quickest: Dict[int, float] = {}  # bytes -> the least seconds that free them
    for c in options:
        quickest[c.freed_bytes] = min(c.seconds, quickest.get(c.freed_bytes, math.inf))
    start = min(quickest.items(), key=lambda p: (p[1], -p[0]))
    hull = [start]
    for point in sorted(p for p in quickest.items() if p[0] > start[0]):  # each takes no less than the start
        while len(hull) >= 2 and _turns_up(hull[-2], hull[-1], point):
            hull.pop()
        hull.append(point)
    return start, [((b[1] - a[1]) / (b[0] - a[0]), b[0] - a[0]) for a, b in zip(hull, hull[1:])]


def _turns_up(a, b, c) -> bool:
    """Whether b lies on or above the segment from a to c (b is then off the lower hull)."""
    return (b[1] - a[1]) * (c[0] - a[0]) >= (c[1] - a[1]) * (b[0] - a[0])


def _unit(per_layer, need_bytes: int) -> int:
    """The bytes per unit: their greatest common divisor where that keeps the table small (then the choice is exact:
    every sum is a whole number of units), else need / STEPS (each candidate rounded down)."""
    g = 0
    for options in per_layer:
        for c in options:
            g = math.gcd(g, c.freed_bytes)
    if g and -(-need_bytes // g) <= EXACT_STEPS:
        return g
    return max(1, -(-need_bytes // STEPS))


def policy_of(choice: Sequence[Candidate]) -> RecomputePolicy:
    return RecomputePolicy([c.layer_policy() for c in choice])
