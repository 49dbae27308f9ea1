"""A layer's forward as step one saw it, and what any set of planned ops would free there, without running it.

Step one records, per layer, every storage an op made (its plan name, bytes, op time, the storages it read and
whether it read them as they were made), the storages from outside the layer that ops read, and the order in which
autograd first saved each storage. `effect(graph, ops)` replays the engine's decision for a set of plan names (the
rule of `rule`, which `hooks.pack` asks too: at its first save, a planned output is stashed when each input is a
parameter, a storage saved before it, or a planned output recomputable in turn, read as it was made) and returns the
bytes freed and the op time recomputed once per backward. The plan table and the budget solver read it. Pure: no torch.
"""

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Dict, FrozenSet, Iterable, List, Set, Tuple

from ..rule import KEPT, RecomputeRule

PARAM = -1  # an input that is a parameter (or a leaf that requires grad): always there at backward

# a graph's signature -> plan names -> (freed, recomputed, bytes freed): `LayerGraph.effects_known`; and
# ("frontier", limit, each node's op time) -> that frontier (`frontier`)
_KNOWN: Dict[tuple, Dict[object, object]] = {}


@dataclass
class Node:
    """One storage of the layer's forward."""

    plan: str  # the plan name of the op that made it; "" for a storage from outside the layer
    nbytes: int
    call: int = -1  # the op call that made it (outputs of one call share a recipe and its time); -1: from outside
    seconds: float = 0.0  # the op call's time (shared by its outputs)
    inputs: Tuple[Tuple[int, bool], ...] = ()  # (node, read as it was made) per tensor input; node PARAM for params
    own: bool = True  # saved as the op made it (not changed in place, same dtype): its op alone gives it back
    boundary: bool = False  # the layer's input or output: kept whatever the layer does, never counted as freed
    routing: bool = False  # an MoE's routing (`apply/routing.py`): never planned, kept as it is


@dataclass
class LayerGraph:
    nodes: List[Node] = field(default_factory=list)
    saved: List[int] = field(default_factory=list)  # nodes autograd saved, in the order of their first save
    input: int = -1  # the node of the layer's first argument (its hidden states), -1 where no op read it

    def signature(self) -> tuple:
        """Equal for layers whose graphs differ only in op times (a model's repeated blocks)."""
        nodes = tuple((n.plan, n.nbytes, n.call, n.inputs, n.own, n.boundary, n.routing) for n in self.nodes)
        return nodes, tuple(self.saved), self.input

    def effects_known(self) -> Dict[object, object]:
        """What `effect` found for each set of plan names on a graph of this signature (the rule's replay depends on
        the structure alone, not the op times): shared by the layers of a model's repeated blocks and kept across the
        solver's calls. Read again where the graph grew since (step one records it op by op)."""
        size = (len(self.nodes), len(self.saved))
        if getattr(self, "_known_for", None) != size:
            self._known = _KNOWN.setdefault(self.signature(), {})
            self._known_for = size
            if len(_KNOWN) > 256:  # the graphs of a few models at most are in use at once
                _KNOWN.clear()
                _KNOWN[self.signature()] = self._known
        return self._known

    def plans(self) -> List[str]:
        """The plan names whose outputs autograd saved here or that lead to them, most bytes saved first."""
        saved_bytes: Dict[str, int] = {}
        for i in self.saved:
            n = self.nodes[i]
            if n.plan and not n.boundary and not n.routing:
                saved_bytes[n.plan] = saved_bytes.get(n.plan, 0) + n.nbytes
        others = {n.plan for n in self.nodes if n.plan and not n.routing and n.plan not in saved_bytes}
        return sorted(saved_bytes, key=lambda p: (-saved_bytes[p], p)) + sorted(others)


@dataclass(frozen=True)
class Effect:
    freed_bytes: int  # saved bytes replaced by recipes (boundary storages excluded)
    seconds: float  # forward time of the op calls recomputed, once each per backward
    freed: FrozenSet[int]  # saved nodes stashed
    recomputed: FrozenSet[int]  # nodes whose recipe runs at backward (the freed ones and chain links)

    def by_plan(self, graph: LayerGraph) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for i in self.freed:
            n = graph.nodes[i]
            if not n.boundary:
                out[n.plan] = out.get(n.plan, 0) + n.nbytes
        return out


class _GraphRule(RecomputeRule):
    """The recompute rule (`rule`) on step one's graph, for the plan names `ops`: a node is there at backward as it
    is when it is a parameter or saved as it is so far (`kept`), has a recipe once one was built (`built`)."""

    def __init__(self, nodes, ops: FrozenSet[str], kept: Set[int], built: Set[int]):
        self.nodes, self.ops, self.kept, self.built = nodes, ops, kept, built

    def has_recipe(self, i: int) -> bool:
        return i in self.built

    def planned(self, i: int) -> bool:
        n = self.nodes[i]
        return n.call >= 0 and n.plan in self.ops and not n.routing

    def sources(self, i: int):
        for j, fresh in self.nodes[i].inputs:
            yield KEPT if j == PARAM or j in self.kept else (j if fresh else None)


def effect(graph: LayerGraph, ops: Iterable[str]) -> Effect:
    """What recomputing the outputs of the plan names `ops` frees in this layer, and what it costs: the storages the
    rule stashes and the recipes it builds, found once per graph structure (`LayerGraph.effects_known`), and their
    calls' op time read from this graph's own nodes."""
    ops = frozenset(ops)
    nodes = graph.nodes
    known = graph.effects_known()
    found = known.get(ops)
    if found is None:
        found = known[ops] = _replay(graph, ops)
    freed, built, freed_bytes = found
    calls = {nodes[i].call: nodes[i].seconds for i in built}
    return Effect(freed_bytes, math.fsum(calls.values()), freed, built)  # exact: the same whatever the sets' order


def _replay(graph: LayerGraph, ops: FrozenSet[str]) -> tuple:
    """The rule replayed on the graph for `ops`: (the saved nodes stashed, the nodes whose recipe is built, the bytes
    freed)."""
    nodes = graph.nodes
    kept: Set[int] = set()  # saved as they are, so far
    built: Set[int] = set()  # recipes built (stashed outputs and chain links)
    freed: Set[int] = set()

    rule = _GraphRule(nodes, ops, kept, built)

    def build(i: int) -> None:
        if i in built:
            return
        built.add(i)
        for j, _ in nodes[i].inputs:
            if j != PARAM and j not in kept:
                build(j)

    for i in graph.saved:
        n = nodes[i]
        if i in built and n.own:
            freed.add(i)  # a chain link built earlier, saved now as it was made: its recipe stands in
        elif n.own and rule.recomputable(i):
            build(i)
            freed.add(i)
        else:
            kept.add(i)
    freed_bytes = sum(nodes[i].nbytes for i in freed if not nodes[i].boundary)
    return frozenset(freed), frozenset(built), freed_bytes


def whole_layer(graph: LayerGraph, op_seconds: float) -> Effect:
    """Checkpointing the layer whole: every saved storage but its input and output freed, its forward run again; an
    MoE's routing kept (`apply/routing.py`: the selective checkpoint saves every storage its routing makes, those
    autograd would not have kept too, which the bytes freed are net of). The checkpoint holds the layer's input
    (its first argument, the hidden states) until its backward, which no op of the layer may have saved (a norm in
    fp32 under bf16 autocast saves its fp32 copy): held then by this policy alone, and net of the bytes freed too
    (an 8B Llama at 8,192 tokens: 64 MiB a layer, which the solver had counted freed by every other policy). Never
    below nothing (a layer that saves less than its input: recomputing it whole frees nothing)."""
    nodes = graph.nodes
    freed = frozenset(i for i in graph.saved if nodes[i].call >= 0 and not nodes[i].boundary and not nodes[i].routing)
    saved = set(graph.saved)
    routing_more = sum(n.nbytes for i, n in enumerate(nodes) if n.routing and not n.boundary and i not in saved)
    held_input = nodes[graph.input].nbytes if 0 <= graph.input < len(nodes) and graph.input not in saved else 0
    freed_bytes = max(sum(nodes[i].nbytes for i in freed) - routing_more - held_input, 0)
    return Effect(freed_bytes, op_seconds, freed, frozenset())


def saved_bytes(graph: LayerGraph) -> int:
    """What autograd keeps of the layer's own making (storages from outside the layer and its output left out)."""
    return sum(graph.nodes[i].nbytes for i in graph.saved if graph.nodes[i].call >= 0 and not graph.nodes[i].boundary)


def frontier(graph: LayerGraph, limit: int = 12) -> List[Tuple[FrozenSet[str], Effect]]:
    """The plan-name sets worth offering for this layer: each frees more bytes than every set that recomputes less
    op time (a Pareto front of bytes freed against recompute time), each the smallest set with its effect. Sets of
    up to `limit` names are tried exhaustively (the names that make the most saved bytes first). Found once for the
    layers of one structure whose op calls take the same times (a dry run's repeated blocks, timed on a roofline:
    32 layers of an 8B model, one search of 4,095 sets instead of 32)."""
    known = graph.effects_known()
    key = ("frontier", limit, tuple(n.seconds for n in graph.nodes))
    found = known.get(key)
    if found is None:
        found = known[key] = _frontier(graph, limit)
    return list(found)


def _frontier(graph: LayerGraph, limit: int) -> List[Tuple[FrozenSet[str], Effect]]:
    names = graph.plans()[:limit]
    best: Dict[FrozenSet[int], Tuple[FrozenSet[str], Effect]] = {}
    for r in range(1, len(names) + 1):
        for chosen in combinations(names, r):
            e = effect(graph, chosen)
            if e.freed_bytes <= 0:
                continue
            ops = frozenset(chosen)
            known = best.get(e.freed)
            if known is None or (e.seconds, len(ops)) < (known[1].seconds, len(known[0])):
                best[e.freed] = (ops, e)
    front: List[Tuple[FrozenSet[str], Effect]] = []
    for ops, e in sorted(best.values(), key=lambda oe: (oe[1].seconds, -oe[1].freed_bytes, len(oe[0]))):
        if not front or e.freed_bytes > front[-1][1].freed_bytes:
            front.append((ops, e))
    return front
