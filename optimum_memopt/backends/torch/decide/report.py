"""The plan table from the step-one profile and the policy that ran: plans grouped by operator (frequency = layers
that keep it, bytes for that batch), which are on, requests that matched nothing and why. Pure."""

from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from ....memory import MIB
from ....plans import LAYER as LAYER_PLAN
from ....plans import FoundPlan, PlanReport, Unmatched, lever_named, match_requests
from ..measure.graph import effect, frontier
from ..measure.profile import HEAD, ROUTING, ModelProfile
from ..policy import LAYER, OPS, LayerPolicy, RecomputePolicy
from .budget import LeverChoice, freed_bytes, predict, predict_range

BACKEND = "torch"


def plan_report(policy: RecomputePolicy, profile: ModelProfile, levers: Sequence = ()) -> PlanReport:
    """The table; `levers`: the levers beyond the layers on the model (`levers.protocol.Lever`), whose rows and notes
    it adds."""
    drop = _peak_drop(policy, profile)
    totals: Dict[str, int] = {}
    freq: Dict[str, int] = {}
    applied_layers: Dict[str, int] = {}
    applied_bytes: Dict[str, int] = {}
    blocked: Dict[str, int] = {}
    for layer_policy, rec in zip(policy.layers, profile.layers):
        whole = layer_policy.mode == LAYER
        # A layer checkpointed whole frees everything it keeps, recomputable alone or not.
        kept = dict(rec.recomputable)
        if whole:  # but an MoE's routing, which a whole layer keeps too
            for name, b in rec.not_recomputable.items():
                if b - rec.routing.get(name, 0) > 0:
                    kept[name] = kept.get(name, 0) + b - rec.routing.get(name, 0)
        else:
            for name, b in rec.not_recomputable.items():
                blocked[name] = blocked.get(name, 0) + b
        for name, b in kept.items():
            totals[name] = totals.get(name, 0) + b
            freq[name] = freq.get(name, 0) + 1
            if whole or name in rec.applied:
                applied_layers[name] = applied_layers.get(name, 0) + 1
                applied_bytes[name] = applied_bytes.get(name, 0) + b
    plans = [
        FoundPlan(
            config=f"{name}+:1:-1",
            enabled=name in applied_layers,
            frequency=freq[name],
            saving_bytes=float(totals[name]),
            saving_symbolic="",
            applied_count=applied_layers.get(name, 0),
            applied_saving_bytes=float(applied_bytes.get(name, 0)),
            recompute_seconds=_seconds(profile, name),
            **_drop_fields(drop, [_freed(rec, [name]) for rec in profile.layers]),
        )
        for name in sorted(totals, key=lambda k: -totals[k])
    ]
    plans += combinations(policy, profile, drop)
    zero = [0] * len(profile.layers)
    lever_drop = None if drop is None else (lambda choices: _drop_fields(drop, zero, choices))
    for lever in levers:
        plans += lever.rows(profile, lever_drop)
    canonical = [e for r in policy.requests for e in r.canonical]
    whole_plans = [str(r.entry) for r in policy.requests if r.entry.subgraph == LAYER_PLAN]
    # the levers' plans are theirs, not layer requests: named beside them
    lever_plans = [str(e) for name, option in policy.levers.items() for e in lever_named(name).entries(option)]
    level = policy.level
    notes = list(policy.notes)
    routed = [i for i, rec in enumerate(profile.layers) if any(ROUTING in why for why in rec.why_not.values())]
    if routed:
        kept = {name for i in routed for name, why in profile.layers[i].why_not.items() if ROUTING in why}
        notes.append(
            f"an MoE's routing is kept, never recomputed, in {len(routed)} layer(s): what its routers make and the "
            f"indices made from them ({', '.join(sorted(kept))}), under every plan and in whole layers (a recompute "
            f"could send a near-tie token to another expert than the forward did)"
        )
    if level == 1:
        notes.append(
            "level 1: every layer is checkpointed whole (torch.utils.checkpoint); the table shows what the layers "
            "would otherwise keep for backward"
        )
    elif policy.whole_layers:
        whole = policy.whole_layers
        notes.append(
            f"{'layers' if len(whole) > 1 else 'layer'} {', '.join(map(str, whole))} "
            f"{'are' if len(whole) > 1 else 'is'} checkpointed whole (torch.utils.checkpoint): everything kept there "
            f"is counted as applied"
        )
    if drop is not None:
        notes.append(_where_the_peak_is(policy, profile))
    for lever in levers:
        notes += lever.notes(profile)
    if profile.lever_seconds:
        notes.append(_start_said(profile.lever_seconds))
    if profile.memory_problem:
        notes.append(
            f"step one's memory could not be followed layer by layer ({profile.memory_problem}): no PEAK DROP"
        )
    unread: Dict[str, int] = {}
    for rec in profile.layers:
        for name, count in rec.unread.items():
            unread[name] = unread.get(name, 0) + count
    if unread:
        listed = ", ".join(f"{count} {name}" for name, count in sorted(unread.items()))
        notes.append(
            f"tensors autograd kept in step one whose storage could not be read (tensor subclasses without one): "
            f"{listed}; their bytes are in no figure of this table or of `auto`'s solver, which are that much low"
        )
    if blocked:
        listed = ", ".join(f"{k} {blocked[k] / 2**20:.2f}" for k in sorted(blocked, key=lambda k: -blocked[k]))
        notes.append(
            f"kept for backward but not recomputable from tensors kept anyway (an input of the op that made them "
            f"is not kept, or they were changed in place since), MiB over all layers: {listed}"
        )
    shape = profile.shape
    dims = {"layers": len(profile.layers)}
    if len(shape) >= 2:
        dims.update({"batch": int(shape[0]), "sequence": int(shape[1])})
    report = PlanReport(
        backend=BACKEND,
        optimizer_enabled=policy.active or bool(policy.levers),
        level=level,
        requested=[str(r.entry) for r in policy.requests] + lever_plans,
        applied=[str(e) for e in canonical] + whole_plans + lever_plans if level == 0 else [p.config for p in plans],
        plans=plans,
        dims=dims,
        notes=notes,
        peak=peak_said(profile) if drop is not None else "",
        levers_measured_s=dict(profile.lever_seconds),
    )
    if level == 0:
        report.unmatched = _unknown(policy, plans) + _unmatched(policy, canonical, plans, blocked)
    return report


def _start_said(seconds: Dict[str, float]) -> str:
    """The note on what the levers' measurements after step one cost the run's start (`ModelProfile.lever_seconds`)."""
    most_first = sorted(seconds.items(), key=lambda item: -item[1])
    each = ", ".join(f"{lever_named(name).what} {s:.2f} s" for name, s in most_first)
    return (
        f"after step one the levers ran each way alone (their rows here, `auto`'s options) in "
        f"{sum(seconds.values()):.2f} s of the run's start: {each}"
    )


def _freed(rec, ops) -> int:
    return (
        effect(rec.graph, ops).freed_bytes if rec.graph is not None else sum(rec.recomputable.get(n, 0) for n in ops)
    )


Drop = Tuple[float, float, float]  # how much lower the peak would be: the figure, the least and the most it can be


def _peak_drop(policy: RecomputePolicy, profile: ModelProfile) -> Optional[Callable[[List[int]], Drop]]:
    """Bytes per layer freed -> how much lower step one's peak would be with that alone than with nothing recomputed
    (`budget.predict` over step one's memory by segment), with the least and the most it can be (`predict_range`:
    what the readings cannot tell of a layer's own forward and backward); None where step one's memory was not
    followed."""
    memory = profile.memory
    if memory is None or not memory.segments:
        return None
    q = freed_bytes(profile, policy)
    zero = [0] * len(q)
    none = predict(memory, q, zero).peak_bytes
    none_low, none_high = predict_range(memory, q, zero)

    def drop(freed: List[int], levers: Sequence[LeverChoice] = ()) -> Drop:
        low, high = predict_range(memory, q, freed, levers)
        value = predict(memory, q, freed, levers=levers).peak_bytes
        return float(none - value), float(none_low - high), float(none_high - low)

    return drop


def _drop_fields(drop: Optional[Callable[..., Drop]], freed: List[int], levers: Sequence[LeverChoice] = ()) -> dict:
    if drop is None:
        return {}
    value, least, most = drop(freed, levers)
    return {"peak_drop_bytes": value, "peak_drop_min_bytes": least, "peak_drop_max_bytes": most}


def peak_said(profile: ModelProfile) -> str:
    """Where step one peaked, in a few words: the device's tensors (CUDA's counter; the CPU's tensor storages counted,
    `measure.live`), as `auto` counts its budget."""
    peak = profile.memory.peak
    return f"step one peaked at {peak.peak_bytes / MIB:,.1f} MiB, {peak.name}"


def _where_the_peak_is(policy: RecomputePolicy, profile: ModelProfile) -> str:
    memory = profile.memory
    q = freed_bytes(profile, policy)
    peak = memory.peak
    whole = predict(memory, q, freed_bytes(profile, RecomputePolicy([LayerPolicy(LAYER)] * len(q))))
    head = next((s for s in memory.segments if s.place.kind == HEAD), None)
    held = ""
    if head is not None:
        added = (head.peak_bytes - head.start_bytes) / MIB
        held = f"; the head and the loss add {added:,.1f} MiB to what is held as the layers' forward ends"
    return (
        f"step one peaked at {peak.peak_bytes / MIB:,.1f} MiB, {peak.name} (read at each layer's forward and "
        f"backward, {memory.how}; the optimizer's state is not held yet in step one). PEAK DROP: how much lower "
        f"that peak would be with the row's plans alone than with nothing recomputed, by the same readings; below "
        f"SAVING where the peak would fall outside the layers{held}; with every layer recomputed whole it would be "
        f"{whole.peak_mb:,.1f} MiB, {whole.where}. A drop shown with (+N) may be up to N bytes more, with (-N) up to "
        f"N less: its peak may fall in a layer's own forward or backward, where the readings cannot tell how much of "
        f"the plans' change shows (a planned tensor is let go of after its last use in the forward; a replayed "
        f"layer brings its tensors back one at a time)"
    )


def _seconds(profile: ModelProfile, name: str) -> float:
    """The op time recomputing this plan alone adds to a backward: from each layer's graph, else the time of the ops
    that made its bytes."""
    layers = profile.layers
    return sum(effect(rec.graph, [name]).seconds if rec.graph else rec.seconds.get(name, 0.0) for rec in layers)


def combinations(
    policy: RecomputePolicy, profile: ModelProfile, drop: Optional[Callable[[List[int]], Drop]] = None
) -> List[FoundPlan]:
    """Sets of plans applied together (a planned output recomputed from another's is a chain), the best for their
    recompute time in each layer's graph (`graph.frontier`: each frees more than every set that costs less), and the
    set each layer runs (a chain the plans asked for), best or not, with bytes and time summed over the layers where
    a set is offered. Layers with the same graph share one search. Shown so a budget can be met with the least
    recompute; their bytes are counted in the plans' rows. Which sets are the best rests on the op times measured:
    the set a layer runs has its row whatever the clock said (tests/test_example_clm.py reads a chain's)."""
    if not profile.layers or any(rec.graph is None for rec in profile.layers):
        return []
    fronts: Dict[tuple, List[FrozenSet[str]]] = {}
    rows: Dict[FrozenSet[str], List[float]] = {}  # ops -> [bytes, seconds, layers, applied, applied bytes]
    order: Dict[FrozenSet[str], str] = {}
    per_layer: Dict[FrozenSet[str], List[int]] = {}  # ops -> bytes freed in each layer where the set is offered
    for index, (layer_policy, rec) in enumerate(zip(policy.layers, profile.layers)):
        graph = rec.graph
        key = graph.signature()
        if key not in fronts:
            fronts[key] = [ops for ops, _ in frontier(graph) if len(ops) > 1]
        ranked = graph.plans()
        offered = list(fronts[key])
        running = frozenset(layer_policy.ops) if layer_policy.mode == OPS else frozenset()
        if len(running) > 1 and running <= set(ranked) and running not in offered:
            offered.append(running)
        for ops in offered:
            e = effect(graph, ops)
            row = rows.setdefault(ops, [0.0, 0.0, 0, 0, 0.0])
            order.setdefault(ops, "+".join(sorted(ops, key=ranked.index)) + "+:1:-1")
            on = layer_policy.mode == LAYER or ops <= layer_policy.ops
            row[0] += e.freed_bytes
            row[1] += e.seconds
            row[2] += 1
            row[3] += int(on)
            row[4] += e.freed_bytes if on else 0
            per_layer.setdefault(ops, [0] * len(profile.layers))[index] = e.freed_bytes
    return [
        FoundPlan(
            config=order[ops],
            enabled=bool(row[3]),
            frequency=int(row[2]),
            saving_bytes=row[0],
            applied_count=int(row[3]),
            applied_saving_bytes=row[4],
            recompute_seconds=row[1],
            combination=True,
            **_drop_fields(drop, per_layer[ops]),
        )
        for ops, row in sorted(rows.items(), key=lambda kv: -kv[1][0])
    ]


def _unknown(policy: RecomputePolicy, plans: List[FoundPlan]) -> List[Unmatched]:
    return [
        Unmatched(
            str(r.entry),
            [p.config for p in plans[:3]],
            similar=False,
            reason=f"{', '.join(map(repr, r.unknown))}: no operator the torch backend knows (an ONNX Runtime "
            f"name of its table in docs/DESIGN.md, or an aten op name)",
        )
        for r in policy.requests
        if r.unknown
    ]


def _unmatched(policy, canonical, plans, blocked) -> List[Unmatched]:
    origin = {}
    for r in policy.requests:
        for nm in r.names:
            origin[f"{nm}+:{r.entry.optimization_type}"] = str(r.entry)
    unmatched = match_requests(canonical, plans)
    for u in unmatched:
        head, opt, count = u.requested.rsplit(":", 2)
        key = f"{head}:{opt}"
        if origin.get(key, u.requested) != u.requested:
            u.reason = f"{head} here"
            u.requested = origin[key]
        name = head.rstrip("+")
        if name in blocked:
            u.reason = ", ".join(
                filter(
                    None,
                    [
                        u.reason,
                        f"its {blocked[name] / 2**20:.2f} MiB are kept for backward but cannot be recomputed "
                        f"from tensors kept anyway",
                    ],
                )
            )
    return unmatched
