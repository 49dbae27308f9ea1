"""What each layer recomputes: one policy model, built once (from the plan grammar, later from the solver) and
stored with the wrapped model; the engine executes it and the report reads it.

A `LayerPolicy` is one of three modes: `keep` (nothing recomputed), `ops` (the outputs of the named ops are
recomputed from kept inputs) or `layer` (the whole layer is checkpointed). Each op name remembers the request it
came from, so the report never parses the arguments again. Pure: no torch state.
"""

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Sequence, Tuple

from ...plans import LAYER as LAYER_PLAN
from ...plans import LeverOption, PlanEntry, PlanError, check_named_once, lever_syntax
from .names import VIEW_NAMES, canonical_ops

KEEP, OPS, LAYER = "keep", "ops", "layer"
MODES = (KEEP, OPS, LAYER)


@dataclass(frozen=True)
class LayerPolicy:
    mode: str = KEEP
    ops: FrozenSet[str] = frozenset()
    origin: Tuple[Tuple[str, str], ...] = ()  # (plan name, the request that asked for it), one per op

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"layer policy mode {self.mode!r}; expected one of {', '.join(map(repr, MODES))}")
        if self.mode == OPS and not self.ops:
            raise ValueError("layer policy mode 'ops' needs at least one op name")
        if self.mode != OPS and self.ops:
            raise ValueError(f"layer policy mode {self.mode!r} takes no op names (got {sorted(self.ops)})")

    @classmethod
    def of_ops(cls, ops: Dict[str, str]) -> "LayerPolicy":
        """Recompute these ops ({plan name: request}); no ops is `keep`."""
        if not ops:
            return cls()
        return cls(OPS, frozenset(ops), tuple(sorted(ops.items())))


@dataclass(frozen=True)
class Request:
    """One enabled plan entry as given, and what it stands for here."""

    entry: PlanEntry
    names: Tuple[str, ...]  # plan names of the operators it names
    unknown: Tuple[str, ...]  # parts that name no operator the backend knows

    @property
    def canonical(self) -> List[PlanEntry]:
        e = self.entry
        return [PlanEntry(f"{nm}+", e.optimization_type, e.apply_count, e.layers) for nm in self.names]


def check_requests(entries: Sequence[PlanEntry], flag: str = "--memory_opt_config") -> None:
    for entry in entries:
        if lever_syntax(entry.subgraph) is not None:
            continue
        if entry.subgraph != LAYER_PLAN and any(op.lower() == "layer" for op in entry.ops):
            raise ValueError(
                f"`{flag}` has {str(entry)!r}: `Layer+` (the whole layer recomputed) takes no op names; give the "
                f"layers and the ops as two plans, as in 'Layer+:1:-1@0-3,Gelu+:1:-1@4-11'"
            )
    _check_ops(entries, flag)


def _check_ops(entries: Sequence[PlanEntry], flag: str) -> None:
    """Refuse plans that would silently do nothing here: a request naming only view operators (in PyTorch a view
    creates no storage, so there is nothing to recompute), and one op asked for by two requests on a layer (two names
    of one op, as `Gelu+` and `FastGelu+`, or `Mul+silu+` and `silu+`: which count would win is not the user's to
    guess), by the grammar's rule for a thing named twice (`plans.check_named_once`), with the ops as what is named.
    It needs no layer count, so it is checked when the arguments are built."""
    ops = []
    for entry in entries:
        if entry.subgraph == LAYER_PLAN or lever_syntax(entry.subgraph) is not None:
            continue
        names, unknown = canonical_ops(entry.subgraph)
        if not names and not unknown:
            raise ValueError(
                f"`{flag}` has {str(entry)!r}, which names only view operators ({entry.subgraph.rstrip('+')}): in "
                f"PyTorch they create no storage, so the plan would recompute nothing; drop it, or name the op that "
                f"makes the tensor, as in 'Gelu+:1:-1' (views ignored here: {', '.join(VIEW_NAMES)})"
            )
        ops.append(entry)
    try:
        check_named_once(ops, lambda entry: canonical_ops(entry.subgraph)[0], "op")
    except PlanError as e:
        raise ValueError(f"`{flag}` {e}") from None


def _layers(indexes: Sequence[int]) -> str:
    return f"layer{'s' if len(indexes) > 1 else ''} {', '.join(map(str, indexes))}"


@dataclass
class RecomputePolicy:
    layers: List[LayerPolicy]
    requests: List[Request] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)  # what the plans' reader should know (overlaps resolved)
    # the levers beyond the layers that are on, by name, each with its option as data (`plans.LeverOption`: its
    # layers and parameter, one part an entry): run by the levers (`levers/`), not by the engine
    levers: Dict[str, LeverOption] = field(default_factory=dict)

    @classmethod
    def from_plans(cls, entries: Sequence[PlanEntry], level: int, n_layers: int) -> "RecomputePolicy":
        """From the plan grammar: level 1 checkpoints every layer; level 0 checkpoints the layers of `Layer+`
        entries whole and recomputes each other enabled entry's ops in its layers (the first `RequestApplyCount`,
        -1 all, or those its `@` selector names). A layer both checkpointed whole and named by an op plan is
        checkpointed whole (it frees all the op plan would), said in `notes`."""
        requests, whole, levers = [], {}, {}
        for entry in entries:
            syntax = lever_syntax(entry.subgraph)
            if syntax is not None:  # a lever's plan, not a layer's
                if entry.enabled:
                    option = syntax.option(entry, n_layers)
                    before = levers.get(syntax.name)
                    levers[syntax.name] = option if before is None else before.joined(option)
                continue
            if not entry.enabled:
                continue
            if entry.subgraph == LAYER_PLAN:
                for i in entry.select(n_layers):
                    whole.setdefault(i, str(entry))
                requests.append(Request(entry, (), ()))
                continue
            names, unknown = canonical_ops(entry.subgraph)
            requests.append(Request(entry, tuple(names), tuple(unknown)))
        if level == 1:
            return cls([LayerPolicy(LAYER) for _ in range(n_layers)], requests, levers=levers)
        ops: List[Dict[str, str]] = [{} for _ in range(n_layers)]
        notes, overlaps = [], {}
        for r in requests:
            if not r.names:
                continue
            for i in r.entry.select(n_layers):
                if i in whole:
                    overlaps.setdefault((str(r.entry), whole[i]), []).append(i)
                    continue
                for name in r.names:
                    if ops[i].get(name, str(r.entry)) != str(r.entry):
                        raise PlanError(
                            f"entries {ops[i][name]!r} and {str(r.entry)!r} both name the op {name!r} in layer {i}; "
                            f"give each layer's op once, as in 'Mul+silu+:1:-1@0-1,silu+:1:-1@2-3'"
                        )
                    ops[i][name] = str(r.entry)
        for (plan, layer_plan), where in overlaps.items():
            notes.append(
                f"{plan!r} names {_layers(where)}, recomputed whole by {layer_plan!r}: the op plan applies to the "
                f"other layers"
            )
        layers = [LayerPolicy(LAYER) if i in whole else LayerPolicy.of_ops(o) for i, o in enumerate(ops)]
        return cls(layers, requests, notes, levers)

    @property
    def level(self) -> int:
        """1 when every layer is checkpointed whole (what `--memory_opt_level 1` asks), else 0."""
        return 1 if self.layers and all(p.mode == LAYER for p in self.layers) else 0

    @property
    def active(self) -> bool:
        return any(p.mode != KEEP for p in self.layers)

    @property
    def whole_layers(self) -> List[int]:
        return [i for i, p in enumerate(self.layers) if p.mode == LAYER]

    def ops_at(self, index: int) -> FrozenSet[str]:
        return self.layers[index].ops

    def describe(self) -> str:
        levers = [f"{name} ({option or 'its default'})" for name, option in self.levers.items()]
        return ", ".join([self._describe_layers(), *(f"lever {lever}" for lever in levers)])

    def _describe_layers(self) -> str:
        if not self.active:
            return "no layer recomputed"
        if self.level == 1:
            return "whole layers checkpointed"
        if self.whole_layers:
            return (
                f"layers {', '.join(map(str, self.whole_layers))} checkpointed whole, planned ops recomputed elsewhere"
            )
        return "planned ops recomputed from kept inputs"
