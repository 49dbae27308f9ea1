"""The budget solver: the step's memory by segment (`watch`), the peak any policy would reach (`budget.predict`),
the least-recompute choice under a budget (`budget.fit`, against every combination), its plan-grammar form, and
`--memory_opt_config auto` choosing in the training process (`planner`) on a decoder through the Trainer."""

import gc
import itertools
import json
import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import Tokens
from helpers import tiny_decoder as decoder
from torch_engine import engine, keep, pair, step

from optimum_memopt import MemoptTrainer, MemoptTrainingArguments
from optimum_memopt.backends.torch.decide.budget import (
    Corrections,
    LeverChoice,
    as_kept,
    fit,
    fit_share,
    freed_bytes,
    merged,
    plan_entries,
    predict,
    segment_peaks,
)
from optimum_memopt.backends.torch.decide.planner import MARGIN, BudgetPlanner
from optimum_memopt.backends.torch.decide.report import _freed, _peak_drop
from optimum_memopt.backends.torch.decide.solver import Candidate, OwnNeeds, Relaxation, candidates, choose, policy_of
from optimum_memopt.backends.torch.measure.graph import saved_bytes, whole_layer
from optimum_memopt.backends.torch.measure.profile import AFTER_PLACE, HEAD_PLACE, Place, Segment, StepMemory
from optimum_memopt.backends.torch.policy import LAYER, LayerPolicy, RecomputePolicy
from optimum_memopt.memory import MIB
from optimum_memopt.plans import PlanError, parse_inline, parse_plans
from optimum_memopt.plans import layer_selector as selector

pytestmark = pytest.mark.torch_backend

L = 3


def gated_mlp(block, x):
    return (F.silu(x @ block.w) * (x @ block.w.t())) @ block.w


@pytest.fixture(scope="module")
def profile():
    """Step one's profile of three gated-MLP layers (graphs and op times)."""
    _, model = pair(gated_mlp, n=L)
    state = engine(model, keep(L))
    step(model, torch.randn(64, 8))
    return state.profile


def whole(n=L):
    return RecomputePolicy([LayerPolicy(LAYER) for _ in range(n)])


def memory_of(fwd, head, bwd, after):
    """A measured step: fwd[i] and bwd[i] the peaks in layer i's forward and backward."""
    segs = [Segment(Place.forward(i), i + 1, 0, p) for i, p in enumerate(fwd)]
    segs.append(Segment(HEAD_PLACE, len(fwd), 0, head))
    segs += [Segment(Place.backward(i), i, 0, bwd[i]) for i in reversed(range(len(bwd)))]
    segs.append(Segment(AFTER_PLACE, 0, 0, after))
    return StepMemory("cpu", segs, 0, "test")


# -- the solver with a constraint per prefix of layers ----------------------------------------------------------------


def brute_force(per_layer, needs):
    best = None
    for combo in itertools.product(*per_layer):
        running, ok = 0, True
        for c, need in zip(combo, needs):
            running += c.freed_bytes
            ok = ok and running >= need
        if ok:
            t = sum(c.seconds for c in combo)
            best = t if best is None or t < best - 1e-12 else best
    return best


@pytest.mark.parametrize("seed", range(12))
def test_prefix_needs_are_met_at_the_least_time(seed):
    """Each prefix of layers must free its own need (a segment that holds only those layers' tensors)."""
    rng = random.Random(seed)
    per_layer = []
    for _ in range(4):
        options = [Candidate(frozenset(), False, 0, 0.0)]
        options += [
            Candidate(frozenset({f"op{k}"}), False, (1 << 20) * rng.randint(1, 40), rng.uniform(0.01, 1))
            for k in range(4)
        ]
        per_layer.append(options)
    most = [max(c.freed_bytes for c in o) for o in per_layer]
    for _ in range(8):
        needs = [rng.randint(-5, sum(most[: i + 1])) * (1 << 20) // 2 for i in range(4)]
        got = choose(per_layer, 0, prefix_needs=needs)
        want = brute_force(per_layer, needs)
        if want is None:
            assert got is None
            continue
        running = 0
        for c, need in zip(got, needs):
            running += c.freed_bytes
            assert running >= need
        assert sum(c.seconds for c in got) == pytest.approx(want)


@pytest.mark.parametrize("seed", range(12))
def test_a_layers_own_needs_are_met_by_its_own_candidate(seed):
    """`OwnNeeds`: layer i's forward needs the first i + 1 layers to free its figure and its backward the first i,
    each moved by what the layer's own candidate holds there beyond the prediction; the least time meeting them all
    with the prefix needs, as every combination tried says."""
    rng = random.Random(seed)
    mib = 1 << 20
    per_layer = []
    for _ in range(4):
        options = [Candidate(frozenset(), False, 0, 0.0)]
        options += [
            Candidate(frozenset({f"op{k}"}), False, mib * rng.randint(1, 40), rng.uniform(0.01, 1)) for k in range(3)
        ]
        per_layer.append(options)
    most = [max(c.freed_bytes for c in o) for o in per_layer]
    for _ in range(8):
        needs = [rng.randint(-5, sum(most[: i + 1])) * mib // 3 for i in range(4)]
        own = [
            None
            if rng.random() < 0.25
            else OwnNeeds(
                rng.randint(-10, sum(most[: i + 1])) * mib // 2,
                rng.randint(-10, sum(most[:i]) + 1) * mib // 2,
                tuple((rng.randint(-8, 8) * mib, rng.randint(-8, 8) * mib) for _ in per_layer[i]),
            )
            for i in range(4)
        ]
        want = None
        for combo in itertools.product(*[list(enumerate(o)) for o in per_layer]):
            running, ok = 0, True
            for i, ((k, c), need) in enumerate(zip(combo, needs)):
                before, running = running, running + c.freed_bytes
                if own[i] is not None:
                    forward, backward = own[i].thresholds(k)
                    ok = ok and running >= forward and before >= backward
                ok = ok and running >= need
            if ok:
                t = sum(c.seconds for _, c in combo)
                want = t if want is None or t < want else want
        got = choose(per_layer, 0, prefix_needs=needs, own=own)
        if want is None:
            assert got is None
            continue
        assert got is not None and sum(c.seconds for c in got) == pytest.approx(want)
        running = 0
        for i, (c, need) in enumerate(zip(got, needs)):
            before, running = running, running + c.freed_bytes
            assert running >= need
            if own[i] is not None:
                forward, backward = own[i].thresholds(per_layer[i].index(c))
                assert running >= forward and before >= backward


@pytest.mark.parametrize("seed", range(12))
def test_the_relaxation_bounds_the_solver_from_below_and_meets_it_at_a_configuration(seed):
    """`Relaxation` (what lets `fit` pass over a combination of levers' options) is never above what `choose` answers
    for the same bytes, whatever the prefix needs under them; with one layer, at the bytes of a configuration on its
    hull, it is that configuration's time (a bound of 0 would pass the first check, not this one)."""
    rng = random.Random(seed)
    per_layer = []
    for _ in range(4):
        options = [Candidate(frozenset(), False, 0, 0.0)]
        options += [
            Candidate(frozenset({f"op{k}"}), k == 3, (1 << 20) * rng.randint(0, 40), rng.uniform(0.0, 1))
            for k in range(4)
        ]
        per_layer.append(options)
    relaxed = Relaxation(per_layer)
    most = [max(c.freed_bytes for c in o) for o in per_layer]
    assert relaxed.least_seconds(0) == 0.0 and relaxed.least_seconds(sum(most) + 1) == float("inf")
    for _ in range(12):
        needs = [rng.randint(-5, sum(most[: i + 1])) * (1 << 20) // 2 for i in range(4)]
        got = choose(per_layer, 0, prefix_needs=needs)
        if got is not None:
            assert relaxed.least_seconds(max(needs)) <= sum(c.seconds for c in got) * (1 + 1e-12)
    one = Relaxation(per_layer[:1])
    for c in per_layer[0]:
        answer = choose(per_layer[:1], c.freed_bytes)
        bound = one.least_seconds(c.freed_bytes)
        assert bound <= sum(a.seconds for a in answer) * (1 + 1e-12)
        on_hull = all(  # no two others the bytes lie between cost less in the line between them
            not (a.freed_bytes < c.freed_bytes < b.freed_bytes)
            or (a.seconds * (b.freed_bytes - c.freed_bytes) + b.seconds * (c.freed_bytes - a.freed_bytes))
            >= c.seconds * (b.freed_bytes - a.freed_bytes)
            for a in per_layer[0]
            for b in per_layer[0]
        ) and all(a.seconds >= c.seconds or a.freed_bytes < c.freed_bytes for a in per_layer[0])
        if on_hull:
            assert bound == pytest.approx(sum(a.seconds for a in answer))


# -- the peak model and the fit ---------------------------------------------------------------------------------------


def test_a_policy_moves_the_segments_that_hold_its_layers(profile):
    q = freed_bytes(profile, whole())
    keep_all = [0] * L
    mem = memory_of([100, 110, 120], 200, [220, 250, 300 * 1000], 150)  # backward peaks of layers 0, 1, 2
    # from whole layers to nothing recomputed: each segment rises by what the layers it holds stop freeing (a layer's
    # own backward holds the layers before it)
    got = predict(mem, q, keep_all)
    assert got.peak_bytes == 300 * 1000 + q[0] + q[1] and got.where == "layer 2 backward"
    mem = memory_of([100, 110, 120], 200 + 10**6, [220, 250, 300], 150)
    assert predict(mem, q, keep_all).peak_bytes == 200 + 10**6 + sum(q)
    assert predict(mem, q, keep_all).where == "after the layers: head and loss, forward and backward"
    assert predict(mem, q, q).peak_bytes == 200 + 10**6
    # what later steps hold more rises every segment but the last
    assert predict(memory_of([1, 1, 1], 1, [1, 1, 1], 500), q, q, extra=100).peak_bytes == 500


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_the_fit_is_the_least_recompute_of_every_combination_that_fits(profile, share):
    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base = 10 << 20
    mem = memory_of([base + 1000] * L, base + 5000, [base + 4000] * L, base)
    plain = predict(mem, q, [0] * L, extra=777).peak_bytes
    floor = predict(mem, q, [max(c.freed_bytes for c in o) for o in per_layer], extra=777).peak_bytes
    budget = int(floor + share * (plain - floor))
    result = fit(profile, mem, budget, whole(), extra_bytes=777)
    best = None
    for combo in itertools.product(*per_layer):
        if predict(mem, q, [c.freed_bytes for c in combo], extra=777).peak_bytes <= budget:
            t = sum(c.seconds for c in combo)
            best = t if best is None or t < best else best
    assert result.choice is not None and result.predicted.peak_bytes <= budget
    assert result.recompute_seconds == pytest.approx(best)
    assert result.floor.peak_bytes == floor
    if share == 1.0:
        assert all(c.label == "keep" for c in result.choice) and result.config() == ""


@pytest.mark.parametrize("share", [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
def test_the_head_is_chosen_with_the_layers_in_one_solve(profile, share):
    """The ways of running the head and loss (what each holds less than the measured step's head, what it adds to a
    step) are weighed with every layer's configurations: the least total time among every combination whose peak,
    with the head's segment moved, fits; the choice's plans and policy carry the head's way."""
    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base = 10 << 20
    head_peak = base + 3 * sum(q)  # the head and loss peak over the layers' segments: chunking matters
    mem = memory_of([base + 1000] * L, head_peak, [base + 4000] * L, base)
    heads = [head(""), head("Loss+:1:-1@chunks2", sum(q), 0.002), head("Loss+:1:-1@chunks8", 2 * sum(q), 0.004)]
    plain = predict(mem, q, [0] * L).peak_bytes
    floor = min(predict(mem, q, [max(c.freed_bytes for c in o) for o in per_layer], levers=[h]).peak_bytes
                for h in heads)  # fmt: skip
    budget = int(floor + share * (plain - floor))
    result = fit(profile, mem, budget, whole(), levers=[heads])
    best = None
    for h in heads:
        for combo in itertools.product(*per_layer):
            freed = [c.freed_bytes for c in combo]
            if predict(mem, q, freed, levers=[h]).peak_bytes <= budget:
                t = sum(c.seconds for c in combo) + h.seconds
                best = (t, h) if best is None or t < best[0] else best
    assert result.choice is not None and result.predicted.peak_bytes <= budget
    assert result.recompute_seconds == pytest.approx(best[0]) and result.floor.peak_bytes == floor
    assert result.predicted == predict(mem, q, [c.freed_bytes for c in result.choice], levers=result.levers)
    chosen = result.lever("loss")
    if chosen.plan:
        assert result.config().endswith("," + chosen.plan) or result.config() == chosen.plan
        assert result.policy().levers["loss"] == chosen.option and str(chosen.option) == chosen.plan.partition("@")[2]
    else:
        assert "Loss+" not in result.config() and "loss" not in result.policy().levers
    if share == 0.0:  # the least any choice reaches needs the head's most
        assert chosen.plan == "Loss+:1:-1@chunks8"
    if share == 1.0:
        assert result.config() == "" and chosen.plan == ""
    assert fit(profile, mem, floor - 1, whole(), levers=[heads]).choice is None


@pytest.mark.parametrize("seed", range(6))
def test_the_fit_over_two_levers_is_every_combinations_least_time(profile, seed):
    """With two levers (the head's ways and one that needs some layers recomputed whole, as the tiled MLP does), the
    fit's answer is the least time over every combination of their options and the layers' configurations that fits
    (`fit` passes over combinations its bound says cannot win: the answer is the same)."""
    rng = random.Random(seed)
    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base = 10 << 20
    mem = memory_of([base + 1000] * L, base + 3 * sum(q), [base + 4000] * L, base)
    heads = [head("")] + [
        head(f"Loss+:1:-1@chunks{2**k}", rng.randint(1, 2 * sum(q)), rng.uniform(0.0, 0.01)) for k in range(1, 4)
    ]
    tiles = [LeverChoice("mlp")] + [
        LeverChoice(
            "mlp",
            None,
            f"tiles{k}",
            ((Place.backward(k % L), rng.randint(0, sum(q))),),
            rng.uniform(0.0, 0.01),
            recomputed=tuple(range(k % L + 1)),
        )  # fmt: skip
        for k in range(1, 4)
    ]
    wholes = [whole_layer(rec.graph, rec.op_seconds) for rec in profile.layers]  # what a forced layer runs
    wholes = [Candidate(frozenset(), True, w.freed_bytes, w.seconds) for w in wholes]
    plain = predict(mem, q, [0] * L).peak_bytes
    floor = predict(mem, q, [max(c.freed_bytes for c in o) for o in per_layer], levers=[heads[-1]]).peak_bytes
    for share in (0.0, 0.3, 0.6, 1.0):
        budget = int(floor + share * (plain - floor))
        result = fit(profile, mem, budget, whole(), levers=[heads, tiles])
        best = None
        for h, t in itertools.product(heads, tiles):
            allowed = [[wholes[i]] if i in t.recomputed else o for i, o in enumerate(per_layer)]
            for combo in itertools.product(*allowed):
                if predict(mem, q, [c.freed_bytes for c in combo], levers=[h, t]).peak_bytes <= budget:
                    seconds = sum(c.seconds for c in combo) + h.seconds + t.seconds
                    best = seconds if best is None or seconds < best else best
        if best is None:
            assert result.choice is None
            continue
        assert result.choice is not None and result.predicted.peak_bytes <= budget
        assert result.recompute_seconds == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("share", [0.0, 0.3, 0.6, 1.0])
def test_what_checks_read_moves_the_fit_as_every_combination_so_corrected_says(profile, share):
    """`Corrections` learned from a check (each segment it read against the prediction for its choice) move each
    later figure: a layer's own forward and backward by its configuration's difference (by layer, else the most any
    layer read under it), the head by the options'. The fit with them is the least time of every combination whose
    figure so moved fits, and the figure it gives is so moved; the check's own choice is then predicted as read."""
    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base = 10 << 20
    mem = memory_of([base + 1000] * L, base + 5000, [base + 4000] * L, base)
    mem = StepMemory("cpu", [replace(seg, own=seg.place.layer) for seg in mem.segments], 0, "test")  # as a watch reads
    heads = [head(""), head("Loss+:1:-1@chunks2", sum(q) // 3, 0.001)]
    checked = [max(o, key=lambda c: c.freed_bytes) for o in per_layer]  # the choice a check ran
    checked[0] = per_layer[0][len(per_layer[0]) // 2]
    predicted = segment_peaks(mem, q, [c.freed_bytes for c in checked], levers=[heads[1]])
    read = [(place, value + (sum(q) // 5 if place.kind == "forward" else -sum(q) // 7) * (place.layer == 0))
            for place, value in predicted]  # fmt: skip
    read = [(p, v - 999) if p == HEAD_PLACE else (p, v) for p, v in read]
    measured = StepMemory("cpu", [Segment(p, s.held, 0, v, s.own) for (p, v), s in zip(read, mem.segments)], 0, "t")
    corrections = Corrections()
    corrections.learn(predicted, measured, checked, [heads[1]])
    offsets = {(i, c.label, kind): corrections.of_own(i, c.label, kind)
               for i, o in enumerate(per_layer) for c in o for kind in ("forward", "backward")}  # fmt: skip
    forward, backward = offsets[0, checked[0].label, "forward"], offsets[0, checked[0].label, "backward"]
    assert (forward, backward) == (sum(q) // 5, -sum(q) // 7)
    plain = predict(mem, q, [0] * L).peak_bytes
    floor = predict(mem, q, [max(c.freed_bytes for c in o) for o in per_layer], levers=[heads[1]]).peak_bytes
    budget = int(floor + share * (plain - floor))
    result = fit(profile, mem, budget, whole(), per_layer=per_layer, levers=[heads], corrections=corrections)
    best = None
    for h in heads:
        for combo in itertools.product(*per_layer):
            figure = max(
                value + int(corrections.offsets(mem, list(combo), [h])[k])
                for k, (_, value) in enumerate(segment_peaks(mem, q, [c.freed_bytes for c in combo], levers=[h]))
            )
            if figure <= budget:
                t = sum(c.seconds for c in combo) + h.seconds
                best = (t, figure) if best is None or t < best[0] else best
    if best is None:
        assert result.choice is None
    else:
        assert result.choice is not None and result.recompute_seconds == pytest.approx(best[0])
        moved = corrections.offsets(mem, result.choice, result.levers)
        figures = segment_peaks(mem, q, [c.freed_bytes for c in result.choice], levers=result.levers)
        assert result.predicted.peak_bytes == max(v + int(m) for (_, v), m in zip(figures, moved)) <= budget
    again = fit(profile, mem, 10**15, whole(), per_layer=[[c] for c in checked], levers=[[heads[1]]],
                corrections=corrections)  # fmt: skip
    assert again.predicted.peak_bytes == max(v for _, v in read)


def test_a_choice_counted_in_rounded_units_is_made_quicker_where_its_figure_still_fits(profile, monkeypatch):
    """Where the bytes' greatest common divisor would make the solver's table too long, it counts in rounded units
    (each candidate's bytes rounded down): a choice can leave a unit a layer unspent. The fit then makes each layer
    quicker where the step's figure, to the byte, still fits (`_polished`): never slower than the rounded choice,
    always within the budget, and at some budget quicker (tables of 4 units here, to round as an 8B model's do)."""
    from optimum_memopt.backends.torch.decide import budget as budget_module
    from optimum_memopt.backends.torch.decide import solver as solver_module

    monkeypatch.setattr(solver_module, "EXACT_STEPS", 1)
    monkeypatch.setattr(solver_module, "STEPS", 4)
    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base = 10 << 20
    mem = memory_of([base + 1000] * L, base + 5000, [base + 4000] * L, base)
    plain = predict(mem, q, [0] * L).peak_bytes
    floor = predict(mem, q, [max(c.freed_bytes for c in o) for o in per_layer]).peak_bytes
    quicker = 0
    for k in range(1, 20):
        budget = int(floor + k * (plain - floor) / 20)
        polished = fit(profile, mem, budget, whole())
        with monkeypatch.context() as m:
            m.setattr(budget_module, "_polished", lambda *args: list(args[5]))
            rounded = fit(profile, mem, budget, whole())
        if rounded.choice is None:  # so coarse a count finds nothing at this budget
            continue
        assert polished.predicted.peak_bytes <= budget
        assert polished.recompute_seconds <= rounded.recompute_seconds
        quicker += polished.recompute_seconds < rounded.recompute_seconds
    assert quicker, "no budget here leaves a rounded choice room: round coarser"


def head(plan: str, less: int = 0, seconds: float = 0.0) -> LeverChoice:
    """A way of running the head as the loss lever offers it (`levers.loss.choices`): in the head's segment."""
    option = RecomputePolicy.from_plans(parse_plans(plan), 0, 1).levers["loss"] if plan else None
    return LeverChoice("loss", option, plan, ((HEAD_PLACE, less),) if less else (), seconds)


def test_the_heads_ways_are_weighed_by_bytes_against_the_one_the_step_ran_and_by_time_against_the_fastest():
    from optimum_memopt.backends.torch.levers.loss import Chunking, HeadMeasure, HeadOption, choices

    measured = HeadMeasure(1024, 64, 4096, "Loss+:1:-1@chunks4", [
        HeadOption(Chunking(chunks=2), 30, 0.010), HeadOption(Chunking(chunks=8), 12, 0.013),
        HeadOption(Chunking(chunks=4), 20, 0.012),
    ])  # fmt: skip
    got = choices(measured)
    assert got == [
        head("Loss+:1:-1@chunks2", -10, 0.0),  # holds more than the step ran; the fastest
        head("Loss+:1:-1@chunks8", 8, pytest.approx(0.003)),
        head("Loss+:1:-1@chunks4", 0, pytest.approx(0.002)),
    ]
    assert choices(None) == [head("")]
    # every way is weighed as it held, whatever its bound (the most it was let hold, 25% over the shapes' count:
    # weighed by it, the whole head was predicted 2.3 MiB over its check on the tests' decoder); a chunked way is
    # never faster than four thirds of the model's own head
    measured = HeadMeasure(1024, 64, 4096, "Loss+:1:-1@chunks4", [
        HeadOption(None, 40, 0.010, bound_bytes=55, rows=1024),
        HeadOption(Chunking(chunks=2), 18, 0.009, bound_bytes=25, rows=512),  # holds less with more rows
        HeadOption(Chunking(chunks=8), 12, 0.020, bound_bytes=14, rows=128),
        HeadOption(Chunking(chunks=4), 20, 0.016, bound_bytes=24, rows=256),
    ])  # fmt: skip
    assert choices(measured) == [
        head("", -20, 0.0),
        head("Loss+:1:-1@chunks2", 2, pytest.approx(0.010 * 4 / 3 - 0.010)),
        head("Loss+:1:-1@chunks8", 8, pytest.approx(0.010)),
        head("Loss+:1:-1@chunks4", 0, pytest.approx(0.006)),
    ]
    # the model's own head returns its logits, which a loop keeping the outputs holds: said beside its bytes
    measured.logits_bytes = 64
    assert choices(measured)[0] == LeverChoice("loss", None, "", ((HEAD_PLACE, -20),), 0.0, 64)
    # measured in a dry run (fake tensors), whose every choice a fake step checks exactly: no logits returned to weigh
    # (the checking step is the run's own loop)
    measured.fake = True
    assert choices(measured) == [
        head("", -20, 0.0),
        head("Loss+:1:-1@chunks2", 2, pytest.approx(0.010 * 4 / 3 - 0.010)),
        head("Loss+:1:-1@chunks8", 8, pytest.approx(0.010)),
        head("Loss+:1:-1@chunks4", 0, pytest.approx(0.006)),
    ]


@pytest.mark.parametrize("share", [0.0, 0.3, 0.6, 1.0])
def test_a_share_of_the_activations_is_kept_at_the_least_recompute(profile, share):
    """`--activation_memory_budget`: keep at most that share of what the layers keep with nothing recomputed."""
    per_layer = candidates(profile)
    total = sum(saved_bytes(rec.graph) for rec in profile.layers)
    mem = memory_of([1000] * L, 5000, [4000] * L, 10)
    result = fit_share(profile, mem, share, whole())
    best = min(
        sum(c.seconds for c in combo)
        for combo in itertools.product(*per_layer)
        if sum(c.freed_bytes for c in combo) >= (1 - share) * total
    )
    assert result.activation_bytes == total and total - result.freed <= share * total
    assert result.recompute_seconds == pytest.approx(best)
    assert result.predicted == predict(mem, freed_bytes(profile, whole()), [c.freed_bytes for c in result.choice])


def test_what_no_recompute_can_fix_is_said(profile):
    q = freed_bytes(profile, whole())
    mem = memory_of([10] * L, 10 + 5000, [10] * L, 9000)
    out = fit(profile, mem, 8000, whole())
    assert out.choice is None
    assert out.why_not == (
        f"the step peaks at {9000 / MIB:,.1f} MiB after backward: the optimizer step and the next batch, where no "
        f"layer's tensors are held: recompute cannot lower it"
    )
    mem = memory_of([10] * L, 10**7, [10] * L, 10)
    out = fit(profile, mem, 10**7 - 1, whole())
    assert out.choice is None and out.why_not.startswith(
        "with each layer recomputing the most it can, the step still peaks at"
    )
    assert out.floor.peak_bytes == 10**7 and out.floor.where.startswith("after the layers")
    assert q  # the whole layers freed something to move


# -- the choice in the plan grammar -----------------------------------------------------------------------------------


def test_layer_selectors():
    assert selector([0, 1, 2, 5]) == "0-2+5"
    assert selector([3]) == "3"
    assert selector([0, 2, 4]) == "0+2+4"


def test_the_choice_written_as_plans_builds_the_same_policy():
    mul_silu = Candidate(frozenset({"Mul", "silu"}), False, 10, 0.1)
    silu = Candidate(frozenset({"silu"}), False, 5, 0.05)
    layer = Candidate(frozenset(), True, 30, 0.3)
    keep_c = Candidate(frozenset(), False, 0, 0.0)
    choice = [mul_silu, mul_silu, layer, silu, keep_c, layer]
    entries = plan_entries(choice)
    assert ",".join(map(str, entries)) == "Mul+silu+:1:-1@0-1,Layer+:1:-1@2+5,silu+:1:-1@3"
    rebuilt = RecomputePolicy.from_plans(parse_inline(",".join(map(str, entries))), 0, len(choice))
    assert [(p.mode, p.ops) for p in rebuilt.layers] == [(p.mode, p.ops) for p in policy_of(choice).layers]


def test_one_op_twice_in_one_layer_is_refused_naming_both():
    with pytest.raises(PlanError, match=r"entries 'Mul\+silu\+:1:-1@0-1' and 'silu\+:1:-1@1' both name the op 'silu'"):
        RecomputePolicy.from_plans(parse_inline("Mul+silu+:1:-1@0-1,silu+:1:-1@1"), 0, 3)


# -- the planner on the engine ----------------------------------------------------------------------------------------


def test_the_planner_watches_step_one_and_applies_its_choice_from_step_two():
    plain, model = pair(gated_mlp, n=L)
    state = engine(model, whole())
    said, details = [], []
    # everything fits: nothing is recomputed
    state.planner = BudgetPlanner(1 << 40, say=said.append, detail=details.append)
    x = torch.randn(64, 8)
    for seed in range(3):
        got, want = step(model, x, seed=seed), step(plain, x, seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        state.step_done()
    names = [s.name for s in state.planner.memory.segments]
    assert names == [
        "layer 0 forward", "layer 1 forward", "layer 2 forward",
        "after the layers: head and loss, forward and backward",
        "layer 2 backward", "layer 1 backward", "layer 0 backward",
        "after backward: the optimizer step and the next batch",
    ]  # fmt: skip
    assert [s.held for s in state.planner.memory.segments] == [1, 2, 3, 3, 2, 1, 0, 0]
    assert not state.policy.active  # whole layers in step one, nothing from step two
    # a line for the choice and one for its check; the figures behind the choice in words, beside them
    assert said[0].startswith("memory_opt_config auto: the solver chose to recompute nothing, under the budget of ")
    assert "predicted peak" in said[0] and "\n" not in said[0]
    assert said[1].startswith("memory_opt_config auto: the step after the choice peaked at") and len(said) == 2
    assert details[0].startswith("memory_opt_config auto: step one (every layer recomputed whole, first input 64x8)")
    assert "the solver chose to recompute nothing: predicted peak" in details[0] and len(details) == 1
    assert state.planner.stage == "done"


def test_step_one_is_watched_in_a_loop_of_ones_own_in_tensor_storages():
    """Without a trainer reporting steps, step one ends where the next training forward starts. On the CPU the step is
    read in the unit CUDA counts (`measure.live`): the process's tensor storages, the weights counted from step one's
    start (the count is seeded with every tensor the process holds), with no sampler thread of the C allocator's
    started for it."""
    import gc
    import threading

    from optimum_memopt.backends.torch.measure.live import LIVE_HOW
    from optimum_memopt.backends.torch.measure.storages import block_bytes

    def samplers():
        return sum(t.name == "memopt-peak-sampler" for t in threading.enumerate())

    gc.collect()
    before = samplers()
    _, model = pair(gated_mlp, n=2)
    state = engine(model, keep(2))
    x = torch.randn(4, 8)
    step(model, x)
    assert state.watch is not None and samplers() == before
    step(model, x)
    memory = state.profile.memory
    assert state.watch is None and memory is not None and memory.how == LIVE_HOW and samplers() == before
    weights = sum(block_bytes(p.nbytes) for p in model.parameters())
    assert memory.start_bytes >= weights + block_bytes(x.nbytes), (memory.start_bytes, weights)


BIG = 1 << 24  # 64 MiB of float32, allocated and let go of inside one layer's forward or backward


class _BigInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + torch.empty(BIG)[:1].zero_()


class _RaisesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward raised")


def _brief_spikes(block, x):
    """64 MiB held for microseconds in the forward (an `empty` never touched is mapped at once, not filled) and again
    in the backward: a sampler every 2 ms all but never sees either."""
    spike = torch.empty(BIG)[:1].zero_()
    return _BigInBackward.apply(x @ block.w + spike)


def test_step_one_is_read_after_every_op_and_misses_no_peak():
    """In step one the tensor storages are counted after every op of the model's forward and of its backward: a
    64 MiB spike lasting microseconds is in its layer's forward and backward segments every time (the 2 ms sampler
    of the C allocator used before missed it). Nothing is left on once the step is over, or in a step that is not
    measured; a forward or a backward that raises leaves it all as it found it."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from optimum_memopt.backends.torch.measure.live import LIVE_HOW, CountOps

    # the count is the process's, as CUDA's counter is: tensors earlier tests left in reference cycles, collected by
    # chance inside a segment, would lower that segment's peak above its start (in the suite's process: 1 KiB under
    # the spike in layer 0's forward). Collected before the step, nothing but the step's own is freed during it.
    gc.collect()
    _, model = pair(_brief_spikes, n=2)
    state = engine(model, keep(2))
    modes = []
    model.layers[0].register_forward_pre_hook(lambda m, a: modes.append(_get_current_dispatch_mode()))
    x = torch.randn(4, 8)
    step(model, x)
    assert isinstance(modes[-1], CountOps)
    assert _get_current_dispatch_mode() is None
    step(model, x)  # step one ends as step two starts (no trainer reports steps here)
    memory = state.profile.memory
    assert memory.how == LIVE_HOW
    peaks = {s.name: s.peak_bytes - s.start_bytes for s in memory.segments}
    assert peaks["layer 0 forward"] >= BIG * 4 and peaks["layer 1 forward"] >= BIG * 4, peaks
    assert peaks["layer 0 backward"] >= BIG * 4 and peaks["layer 1 backward"] >= BIG * 4, peaks
    assert modes[-1] is None  # step two is not measured: no readings
    assert _get_current_dispatch_mode() is None

    _, failing = pair(lambda block, x: x @ block.w.t()[:3], n=2)  # a shape error in layer 1
    engine(failing, keep(2))
    with pytest.raises(RuntimeError):
        step(failing, x)
    assert _get_current_dispatch_mode() is None

    # a backward that raises leaves no count on (autograd gives each node the mode stack backward started with)
    _, raising = pair(lambda block, x: _RaisesInBackward.apply(x @ block.w), n=2)
    engine(raising, keep(2))
    raising.train()
    held = raising(x.clone().requires_grad_(True)).sum()
    with pytest.raises(RuntimeError, match="backward raised"):
        held.backward()
    assert _get_current_dispatch_mode() is None
    step(model, x)
    assert _get_current_dispatch_mode() is None and held.grad_fn is not None

    # an optimizer step that raises runs no post-hook: its count is left at the model's next forward
    class Raising(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("step raised")

    _, stepped = pair(gated_mlp, n=2)
    engine(stepped, keep(2))
    failing_optimizer = Raising(stepped.parameters(), lr=0.1)
    step(stepped, x)  # step one, counted
    with pytest.raises(RuntimeError, match="step raised"):
        failing_optimizer.step()
    assert isinstance(_get_current_dispatch_mode(), CountOps)  # torch ran the pre-hook only
    stepped.layers[0].register_forward_pre_hook(lambda m, a: modes.append(_get_current_dispatch_mode()))
    stepped.train()
    with torch.no_grad():
        stepped(x)
    assert modes[-1] is None and _get_current_dispatch_mode() is None


def test_a_tied_weights_gradient_summed_by_autograd_is_counted_through_the_layers_backward():
    """GPT-2's head is its input embeddings' weight: the head's gradient is held from the head's backward to the
    embeddings' (the last), made inside the head's node where the head runs whole, summed by autograd's engine between
    nodes where it runs in chunks. Step one's layers' backward segments hold it either way: the same bytes above the
    step's start with the head whole or in 4 chunks (counted node by node alone, the chunks' sum was missed: 64 KiB
    less, and `auto` chose over its budget on 22 families)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import optimum_memopt

    def backward_segments(plans):
        gc.collect()
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64, use_cache=False)
        model = GPT2LMHeadModel(config).train()
        assert model.lm_head.weight is model.transformer.wte.weight
        handle = optimum_memopt.optimize_memory(model, plans, say=lambda text: None)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        for _ in range(2):  # step one ends as step two starts
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        memory = handle.profile.memory
        handle.remove()
        return {
            s.name: s.peak_bytes - memory.start_bytes
            for s in memory.segments
            if s.name.startswith("layer") and s.name.endswith("backward")
        }

    whole, chunked = backward_segments(None), backward_segments("Loss+:1:-1@chunks4")
    assert whole == chunked and len(whole) == 2, (whole, chunked)


def test_layers_run_out_of_order_stop_the_planner_with_the_reason():
    _, model = pair(gated_mlp, n=2)
    state = engine(model, whole(2))
    state.planner = BudgetPlanner(1 << 40, say=lambda s: None)
    model.train()
    x = torch.randn(4, 8, requires_grad=True)
    model.layers[0](model.layers[1](model.layers[0](x))).sum().backward()
    said = (
        r"measures step one layer by layer, but a step of Stack runs layers 0 \(Block\) several times each \(3 layer "
        r"forwards for 2 layers\), and step one is measured layer by layer, once each; nothing was chosen"
    )
    with pytest.raises(RuntimeError, match=said):  # said as step one ends
        state.step_done()


# -- through the Trainer ----------------------------------------------------------------------------------------------


def train_decoder(tmp_path, name, steps=4, **memory):
    args = MemoptTrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, max_steps=steps, per_device_train_batch_size=8,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=0,
        **{"memory_opt_backend": "torch", **memory},
    )  # fmt: skip
    trainer = MemoptTrainer(model=decoder(), args=args, train_dataset=Tokens())
    trainer.train()
    return trainer


def train_auto(tmp_path, budget_mb, name, dry_run=False):
    """`auto` through the Trainer; `dry_run` False: step one measures with every layer recomputed whole (the path
    taken wherever no dry run of step one can be made), True: it runs a dry run's choice (`from_plan`)."""
    trainer = train_decoder(
        tmp_path, name, memory_opt_config="auto", memory_budget_mb=budget_mb, memory_auto_dry_run=dry_run
    )
    planner = trainer.memopt_handle.planner
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, planner, losses


def _auto_meets_the_budget(tmp: str) -> None:
    """The body of the test below, run in a process of its own (its assertions end that process)."""
    import contextlib
    import io
    from pathlib import Path

    tmp_path = Path(tmp)
    train_decoder(tmp_path, "warm-up", steps=1)
    _, roomy, plain_losses = train_auto(tmp_path, 10**6, "roomy")
    assert roomy.fits[0].config() == ""
    eager = roomy.verified[0]["measured_peak_mb"]
    floor = roomy.fits[0].floor.peak_mb
    assert floor < eager
    budget = round((eager + floor) / 2, 1)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        trainer, planner, losses = train_auto(tmp_path, budget, "tight")
    final = planner.fits[-1]
    assert final.choice is not None and final.predicted.peak_mb <= budget
    assert any(c.freed_bytes for c in final.choice) and not all(c.whole for c in final.choice)
    # each check said what it measured and judged it against the budget; every one of them measured within its
    # prediction (step one is read after every op, and its graphs record each save by its storage: 1-17%
    # under-predictions came from addresses checkpoint freed and reused) and within the budget: the run's whole peak
    # after step one never went over it; a check under its prediction lends nothing to a second solve
    text = said.getvalue()
    for check in planner.verified:
        assert check["measured_peak_mb"] <= check["predicted_peak_mb"] * 1.01 + 0.1, planner.verified
        assert check["measured_peak_mb"] <= budget, planner.verified
        assert f"peaked at {check['measured_peak_mb']:,.1f} MiB (predicted {check['predicted_peak_mb']:,.1f}" in text
        assert f"within the budget of {budget:,.1f} MiB" in text
    assert len(planner.fits) == len(planner.verified) == 1, planner.verified
    # the layers' recompute is exact; the head may run whole in one run and in chunks in the other (which the
    # solver takes depends on the ops' measured times): the loss summed in another order, to the last bits
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, plain_losses)), (losses, plain_losses)
    policy = trainer.memopt_handle.policy
    rebuilt = RecomputePolicy.from_plans(parse_inline(final.config()), 0, 3)
    assert [(p.mode, p.ops) for p in policy.layers] == [(p.mode, p.ops) for p in rebuilt.layers]
    with open(tmp_path / "tight" / "memory_auto" / "solver.json") as f:
        report = json.load(f)
    assert report["budget_mb"] == pytest.approx(budget) and report["fits"][-1]["config"] == final.config()
    assert len(report["memory"]["segments"]) == 2 * 3 + 2
    with open(tmp_path / "tight" / "memory_plans.json") as f:
        table = json.load(f)
    assert (
        f"--memory_opt_config auto (`--memory_budget_mb {budget:g}`): this first step ran with every layer recomputed"
        in " ".join(table["notes"])
    )
    assert (
        f"the solver chose `--memory_opt_config {planner.fits[0].config()}`, under the budget of {budget:,.1f} MiB"
        in text
    )


@pytest.mark.slow
def test_a_trained_model_let_go_is_freed_with_its_trainer_and_optimizer(tmp_path):
    """Nothing the plugin leaves in the process (torch's optimizer step hooks are the process's) keeps a trained
    model, its trainer or its optimizer's state alive once the user lets go of them. Before, every run's model and
    AdamW state stayed for the rest of the process, a notebook's on the GPU (and in this suite's process, 45 to 105
    MiB that later runs' steps counted, which a dry run of them did not know of)."""
    import gc
    import weakref

    trainer, _, _ = train_auto(tmp_path, 10**6, "let-go", dry_run=True)
    model = trainer.model  # kept: the optimizer and its state go all the same (the dry run held it until it ran)
    gone = [weakref.ref(trainer.optimizer.optimizer), weakref.ref(trainer)]
    del trainer
    gc.collect()
    assert [ref() is None for ref in gone] == [True, True]
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None


def test_the_live_count_holds_no_meta_tensor():
    """A meta tensor holds no memory of the process (a copy of `auto`'s twin, kept to plan again for a longer batch,
    made while a live count's ops are on): the live count does not count it, made under its ops or seen; a CPU
    tensor made beside it is. (A twin copied under the count once read as 1.5 MiB held outside the step, and `auto`
    chose to chunk the head where the plain step fitted.)"""
    from optimum_memopt.backends.torch.measure.live import live_count

    count = live_count()
    before = count.current
    with count.ops():
        meta = torch.empty(2**20, device="meta").requires_grad_(True)
        copied = torch.nn.Linear(512, 512, device="meta").to_empty(device="meta")
        assert count.current == before
        real = torch.ones(2**18)
    count.see(meta)
    assert count.current - before == real.untyped_storage().nbytes()
    del meta, copied, real


def test_a_longer_batch_whose_shape_is_not_read_is_said_once_with_why():
    """Where a batch's own shape is not read (no `input_ids`, `inputs_embeds` or tensor of two dimensions: no batch is
    planned for again), a layer input of more tokens than step one's is said once at the layers, naming that; one of
    no more tokens says nothing; where the shape is read, `batch_arrives` judges it and the layers say nothing."""
    said = []
    planner = BudgetPlanner(30 * MIB, say=said.append)
    planner.batch_reached((8, 16, 64), (8, 16, 64))  # as many tokens as step one's
    assert said == []
    planner.batch_reached((8, 32, 64), (8, 16, 64))
    planner.batch_reached((8, 64, 64), (8, 16, 64))  # once
    assert len(said) == 1, said
    assert "a batch of 8 x 32 tokens (256) runs, more than the 8 x 16 (128) the choice under" in said[0], said
    assert (
        "(the batch's shape is not read (no `input_ids`" in said[0] and "so no batch is planned for again)" in said[0]
    )
    read = BudgetPlanner(30 * MIB, say=said.append)
    read.planned_shape = (8, 16)
    read.batch_reached((8, 32, 64), (8, 16, 64))
    assert len(said) == 1, said


@pytest.mark.slow
def test_a_dry_run_counts_what_the_process_holds_outside_the_step(tmp_path):
    """Tensors the process holds on the device besides the step's own (another model, a notebook's) are in every
    reading of the step: `auto`'s dry run counts them from its start (`other`), so a budget that would fit the step
    alone is not promised where they take the room. Here 24 MiB are held (counted by the process's live count, as a
    tensor an earlier run used is): a budget that fits the step alone finds nothing that fits with them."""
    from optimum_memopt.backends.torch.measure.live import held_outside, live_count

    _, roomy, _ = train_auto(tmp_path, 10**6, "roomy", dry_run=True)
    alone = roomy.planned.floor.peak_mb
    model = decoder()
    before = held_outside(model, (), torch.device("cpu"))
    kept = torch.zeros(6 * 2**20)  # 24 MiB
    live_count().see(kept)
    assert held_outside(model, (), torch.device("cpu")) - before == 24 * 2**20
    budget = round(alone + 2, 1)
    with pytest.raises(RuntimeError, match="found nothing that fits"):
        train_auto(tmp_path, budget, "held", dry_run=True)
    del kept
    assert held_outside(model, (), torch.device("cpu")) == before


@pytest.mark.slow
def test_auto_starts_from_a_dry_run_of_step_one(tmp_path, capsys, caplog):
    """Through the Trainer, `auto` chooses before step one from a dry run of that step on fake tensors (the model's twin
    on the meta device, the first batch's shapes, the run's optimizer), and step one runs the choice: no step spent
    with every layer recomputed. The real step one checks it (kept where its own memory with what later steps hold
    more fits, else the solver chooses again from it), every check after is within the budget, and the losses are
    those of the run without the plugin, bitwise (a choice that runs the model's own head from step one; the measuring
    step one runs it in chunks). The dry run counts as the CPU counts a real step (tensor storages): the choice it
    predicts to fit is within a few percent of what the step holds."""
    plain = train_decoder(tmp_path, "plain", memory_opt_backend="none")
    with caplog.at_level("WARNING"):
        _, roomy, plain_losses = train_auto(tmp_path, 10**6, "roomy", dry_run=True)
    assert plain_losses == [h["loss"] for h in plain.state.log_history if "loss" in h]
    assert roomy.planned is not None and roomy.planned.config() == "" and roomy.fits[0].source
    # the dry run's step one ran the head in chunks; the run's runs it whole, and nothing says it returns no logits
    assert not [r.getMessage() for r in caplog.records if "return no logits" in r.getMessage()]
    assert "return no logits" not in capsys.readouterr().out
    eager, floor = roomy.verified[0]["measured_peak_mb"], roomy.planned.floor.peak_mb
    assert floor < eager
    budget = round((eager + floor) / 2, 1)
    capsys.readouterr()
    trainer, planner, losses = train_auto(tmp_path, budget, "tight", dry_run=True)
    out = capsys.readouterr().out
    planned = planner.planned
    assert planned is not None and planned.choice and planned.predicted.peak_mb <= budget
    assert "a dry run of step one in " in out and f"chose `--memory_opt_config {planned.config()}`" in out
    assert not all(c.whole for c in planned.choice)  # step one ran it (the table's note below), not every layer whole
    for check in planner.verified:
        assert check["measured_peak_mb"] <= budget, (budget, planner.verified)
    # one figure: the dry run's for its choice is what the step after the choice measured (issue 53: 11-35% high on
    # a card, and 15% on the CPU in README's main job, before the dry run checked its choices step by step)
    real = planner.verified[0]["measured_peak_mb"]
    assert abs(planned.predicted.peak_mb - real) <= 0.01 * real, (planned.predicted.peak_mb, planner.verified)
    first = planner.fits[0]
    if first.source:  # kept: predicted from step one's own memory, so the check reads it to the block
        assert first.config() == planned.config() and "step one ran the dry run's choice and keeps it" in out
        assert abs(planner.verified[0]["measured_peak_mb"] - first.predicted.peak_mb) <= 0.01 * budget
    # recompute is exact; the head may run whole in one run and in chunks in the other (the solver's choice rests on
    # measured times): the loss summed in another order
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, plain_losses)), (losses, plain_losses)
    with open(tmp_path / "tight" / "memory_plans.json") as f:
        notes = " ".join(json.load(f)["notes"])
    assert f"this first step ran the choice of a dry run of it (`{planned.config()}`)" in notes


@pytest.mark.slow
def test_step_one_takes_the_levers_measurements_over_from_its_dry_run_and_measures_where_it_chooses_again(
    tmp_path, monkeypatch
):
    """A run whose step one runs its dry run's choice takes the levers' measurements of that step over from the dry
    run (the head's ways, the MLPs' tile counts: the same shapes, every byte as the device counts it) and runs none of
    them again on the device: none of the start spent on them (`levers_measured_s`), the table's notes say whose
    they are and their rows give no TIME (the dry run's clock is not the run's). Where a choice is made again from
    step one, the levers measure on the device first, so that the solver weighs their seconds on the run's clock as it
    weighs the layers' op times; the bytes they read are the dry run's."""
    from optimum_memopt.backends.torch.decide.planner import BudgetPlanner

    trainer, planner, _ = train_auto(tmp_path, 10**6, "kept", dry_run=True)
    assert planner.fits[0].source  # step one's memory fits: the dry run's choice kept, nothing chosen again
    profile = trainer.memopt_handle.profile
    taken = {name: profile.levers[name] for name in ("loss", "mlp")}
    assert all(m.from_dry_run and not m.fake for m in taken.values()), taken
    assert taken["mlp"].device == "cpu"  # its draws counted as the run's device draws them
    assert profile.lever_seconds == {}  # nothing run alone on the device (the CPU times no link to the host)
    with open(tmp_path / "kept" / "memory_plans.json") as f:
        table = json.load(f)
    rows = [p for p in table["plans"] if p["lever"] in ("loss", "mlp")]
    assert rows and all(p["recompute_seconds"] is None for p in rows), rows
    assert table["levers_measured_s"] == {}
    said = [n for n in table["notes"] if "in the run's dry run before step one" in n]
    assert len(said) == 2 and all("not run again on the device, so no TIME" in n for n in said), table["notes"]

    # the same run, its choice made again from step one (as where step one's memory does not fit)
    monkeypatch.setattr(BudgetPlanner, "_confirmed", lambda self, step, budget_bytes: None)
    trainer, planner, _ = train_auto(tmp_path, 10**6, "again", dry_run=True)
    assert not planner.fits[0].source
    measured = trainer.memopt_handle.profile
    assert {"loss", "mlp"} <= set(measured.lever_seconds), measured.lever_seconds
    assert not any(measured.levers[name].from_dry_run for name in ("loss", "mlp"))
    # what each way held on the device is what the dry run counted, where both ran it
    mlp, dry_mlp = measured.levers["mlp"], taken["mlp"]
    assert {1, 2} <= set(mlp.options) and measured.levers["loss"].option("") is not None
    assert {c: (o.held_bytes, o.kept_bytes, o.checkpointed_bytes) for c, o in mlp.options.items()} == {
        c: (o.held_bytes, o.kept_bytes, o.checkpointed_bytes) for c, o in dry_mlp.options.items() if c in mlp.options
    }
    head, dry_head = measured.levers["loss"], taken["loss"]
    assert {o.plan: o.held_bytes for o in head.options} == {
        o.plan: o.held_bytes for o in dry_head.options if head.option(o.plan) is not None
    }


class _Lengths(torch.utils.data.IterableDataset):
    """Sequences of 16 tokens, `short` of them, then of 32, in that order (no sampler shuffles an iterable dataset);
    `long_at`: where given, of 32 tokens only where `long_at(i)`, else of 16."""

    def __init__(self, short: int = 8, long_at=None):
        self.long_at = long_at or (lambda i: i >= short)

    def __iter__(self):
        for i in range(64):
            ids = torch.randint(0, 512, (32 if self.long_at(i) else 16,), generator=torch.Generator().manual_seed(i))
            yield {"input_ids": ids, "labels": ids}


def _train_lengths(
    tmp_path, name, budget_mb, short=8, accumulate=1, dry_run=True, steps=4, use_cpu=True, long_at=None
):
    args = MemoptTrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=use_cpu, max_steps=steps, per_device_train_batch_size=8,
        gradient_accumulation_steps=accumulate, learning_rate=1e-3, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, memory_opt_backend="torch", memory_opt_config="auto", memory_budget_mb=budget_mb,
        memory_auto_dry_run=dry_run,
    )  # fmt: skip
    trainer = MemoptTrainer(model=decoder(), args=args, train_dataset=_Lengths(short, long_at))
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.slow
def test_auto_plans_again_for_a_longer_batch_and_keeps_its_budget(tmp_path, capsys):
    """Every choice of `auto` is made and checked for one batch's shape; SFT padded to each batch's longest (TRL
    without packing) brings longer ones later. A batch of more tokens than the choice's is planned again for before
    its step runs, as step one was: a dry run of it chooses, its step runs the choice and is measured and checked.
    Under a budget the short batches fit with nothing recomputed and the long ones do not, the long steps recompute
    and peak within the budget, measured as predicted; the losses are the unconstrained run's (recompute is exact).
    A longer micro-batch inside a step (gradient accumulation) runs under the choice it finds, and the next step
    plans for it; at a step's start, for the batch itself. Where the step planned so runs shorter batches than the
    one planned for, the dry run's figure stands for the choice (what that step held says less), and the check reads
    on to a step of the planned length. The plan kept for the next run is the longest's."""
    from optimum_memopt.planning.plan_file import read

    def run(name, budget_mb, short, long_at=None, steps=4):
        """What a run chose, checked and lost; its trainer let go of (a process's live tensors are what the next
        run's dry run counts as held outside its step: another model's, as on a device)."""
        trainer, losses = _train_lengths(
            tmp_path, name, budget_mb, short=short, accumulate=2, long_at=long_at, steps=steps
        )
        planner = trainer.memopt_handle.planner
        found = (planner.earlier, planner.planned_shape, planner.fits[-1], planner.verified, losses)
        del trainer, planner
        gc.collect()
        return found

    earlier, shape, last, _, roomy_losses = run("roomy", 10**6, 16)
    assert [e["batch"] for e in earlier] == [[8, 16]] and earlier[0]["config"] == "" and shape == (8, 32)
    eager_short, eager_long, floor_long = earlier[0]["predicted_peak_mb"], last.predicted.peak_mb, last.floor.peak_mb
    assert max(eager_short, floor_long) < eager_long
    budget = round((max(eager_short, floor_long) + eager_long) / 2, 1)
    capsys.readouterr()
    inside = "a micro-batch of the last step had 8 x 32 tokens (256), more than the 8 x 16 (128)"
    cases = {  # a step's micro-batches: 8 rows each, 2 a step
        "at-start": (16, None, 4, "a batch of 8 x 32 tokens (256) runs next, more than the 8 x 16 (128)"),
        "inside": (8, None, 4, inside),
        # step one short then long, step two short (the step planned for the long one: its choice kept by the dry
        # run's figure; by what step two held it was 15.6 MiB where the long step held 19.3), long from step three on
        "inside-then-short": (None, lambda i: 8 <= i < 16 or i >= 32, 5, inside),
    }
    for name, (short, long_at, steps, said) in cases.items():
        earlier, shape, final, verified, losses = run(f"tight-{name}", budget, short, long_at, steps)
        out = capsys.readouterr().out
        assert out.count(said) == 1 and out.count("planning again for 8 x 32") == 1, out
        assert "(128) the choice under `--memory_budget_mb" in out
        assert [e["batch"] for e in earlier] == [[8, 16]] and earlier[0]["config"] == "" and shape == (8, 32)
        assert final.choice is not None and final.config(), final  # the long batch recomputes
        assert verified, out
        for check in verified:
            assert check["measured_peak_mb"] <= budget, verified
            assert check["measured_peak_mb"] == pytest.approx(check["predicted_peak_mb"], rel=0.01), verified
        kept = read(str(tmp_path / f"tight-{name}" / "memory_auto" / "plan.json"))
        assert (kept.step.batch, kept.step.seq) == (8, 32) and kept.choice == final.config()
        with open(tmp_path / f"tight-{name}" / "memory_auto" / "solver.json") as f:
            solved = json.load(f)
        assert solved["batch"] == [8, 32] and [e["batch"] for e in solved["earlier_batches"]] == [[8, 16]]
        if name == "at-start":  # the same batches in the same steps as the unconstrained run's
            assert losses == pytest.approx(roomy_losses, rel=1e-6, abs=1e-6)


@pytest.mark.slow
def test_a_check_reads_on_past_shorter_batches_to_one_of_the_length_planned(tmp_path, capsys):
    """The step after a choice may run a shorter batch than the one the choice was made for, which holds less than
    the prediction: the check reads on through such steps (its meter's peak not reset) to the first of the planned
    length, and is exact there; said with how many it read past."""
    trainer, _ = _train_lengths(tmp_path, "waits", 10**6, steps=5, long_at=lambda i: i < 8 or i >= 24)
    out = capsys.readouterr().out
    planner = trainer.memopt_handle.planner
    assert planner.planned_shape == (8, 32) and len(planner.verified) == 1 and not planner.earlier, out
    check = planner.verified[0]
    assert check["measured_peak_mb"] == pytest.approx(check["predicted_peak_mb"], rel=0.01), check
    assert "the 3 steps after the choice (read on past 2 of batches shorter than 8 x 32) peaked at" in out, out


@pytest.mark.slow
def test_a_longer_batch_where_no_dry_run_can_be_made_is_measured_again_and_keeps_its_budget(tmp_path, capsys):
    """Where no dry run can be made (here `--memory_auto_dry_run false`; FSDP, DeepSpeed, a loop of one's own), a
    step whose first batch has more tokens than the choice's is measured again as step one was, with every layer
    recomputed whole, and the next step runs the choice made from it and is checked: under a budget the short
    batches fit with nothing recomputed and the long ones do not, the long steps recompute and keep the budget,
    measured as predicted; the step measured again runs as step one did, the head's loss in chunks too (the least
    any choice holds: a choice of the model's own head before it once left the step measured again running it). A
    longer micro-batch inside a step runs under the choice it finds: said once, with why."""

    def run(name, budget_mb, **kw):
        trainer, losses = _train_lengths(tmp_path, name, budget_mb, dry_run=False, **kw)
        handle = trainer.memopt_handle
        planner = handle.planner
        found = (planner.earlier, planner.planned_shape, planner.fits[-1], planner.verified, losses)
        measured_head = handle.profile.levers["loss"].ran  # the head as the last measured step ran it
        del trainer, handle, planner
        gc.collect()
        return found if name != "roomy" else (*found[:-1], measured_head)

    # two steps of 8 x 16, then of 8 x 32: step three measured again, step four chooses, step five checks; the
    # roomy run's step two ran the model's own head (its choice), its step three the head in chunks again
    earlier, shape, last, _, measured_head = run("roomy", 10**6, short=16, steps=5)
    assert measured_head == "Loss+:1:-1" and last.lever("loss").option is None, (measured_head, last.config())
    assert [e["batch"] for e in earlier] == [[8, 16]] and earlier[0]["config"] == "" and shape == (8, 32)
    eager_short, eager_long, floor_long = earlier[0]["predicted_peak_mb"], last.predicted.peak_mb, last.floor.peak_mb
    assert max(eager_short, floor_long) < eager_long, (eager_short, floor_long, eager_long)
    budget = round((max(eager_short, floor_long) + eager_long) / 2, 1)
    capsys.readouterr()
    earlier, shape, final, verified, _ = run("tight", budget, short=16, steps=5)
    out = capsys.readouterr().out
    said = "a batch of 8 x 32 tokens (256) runs next, more than the 8 x 16 (128) the choice under"
    assert out.count(said) == 1 and out.count("measuring again for 8 x 32 (no dry run here") == 1, out
    assert "planning again" not in out and "nothing plans again for it" not in out, out
    assert [e["batch"] for e in earlier] == [[8, 16]] and earlier[0]["config"] == "" and shape == (8, 32)
    # the short batches' choice ran a step before the long batch came: its check read then, before it was replaced
    short = earlier[0]
    assert short["measured_peak_mb"] is not None and short["measured_peak_mb"] <= budget, earlier
    assert short["measured_peak_mb"] <= short["predicted_peak_mb"] * 1.01, earlier
    assert out.index("the step after the choice peaked at") < out.index("measuring again for 8 x 32"), out
    assert final.choice is not None and final.config(), final  # the long batch recomputes
    assert verified, out
    for check in verified:  # the model's own head's logits counted as held through the step, which the Trainer's
        # loop drops before backward (said with the check): it peaks lower by them. Where the choice runs the model's
        # own head, weighed by what it holds alone beside the chunks the measured step ran, it is predicted high (the
        # safe side; docs/torch-backend.md): 16.69 MiB read for 16.92 here, within 5% and never above
        dropped = check["predicted_peak_mb"] - check.get("returned_mb", 0.0)
        assert check["measured_peak_mb"] <= budget, verified
        assert 0.95 * dropped <= check["measured_peak_mb"] <= 1.01 * dropped, verified

    # 2 micro-batches a step, a longer second one in step two: it runs under the choice, said once, with why
    capsys.readouterr()
    run("inside", 10**6, accumulate=2, long_at=lambda i: 24 <= i < 32, steps=3)
    out = capsys.readouterr().out
    said = "memory_opt_config auto: a batch of 8 x 32 tokens (256) runs, more than the 8 x 16 (128) the choice under"
    assert out.count(said) == 1 and "pad to the longest, or pack" in out, out
    why = (
        "(`--memory_auto_dry_run false`; a step whose first batch is longer is measured again, and "
        "this one is a later micro-batch of its step, which runs under the choice it finds)"
    )
    assert why in out, out
    assert "measuring again" not in out, out


@pytest.mark.slow
def test_auto_chooses_in_the_training_process_and_meets_the_budget(tmp_path):
    """A budget with room for everything keeps everything (its step shows eager's peak); a budget halfway between
    that and the floor of recompute gets a mixed choice predicted to fit, whose next step is measured and judged
    truthfully (a miss re-planned once) and meets the budget, with the losses of the first run (recompute is exact;
    the head's loss, whole in one run and in chunks in the other, to 1e-6). No script is re-run (a notebook's kernel has none). A warm-up training first: the process's first one keeps,
    from its step one on, what the libraries allocate once (27 MiB here), so the roomy run read alone would set a
    budget the tight run, warmed up by it, meets with nothing recomputed. In a fresh process, as a user's run is
    (in the full suite's process, before step one's graphs keyed saves by storage, step two once measured 67.4 MiB
    for two choices predicted at 62.5 and 57.5)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import sys; sys.path.insert(0, {tests!r}); sys.argv = ['']\n"
        f"import test_torch_budget\ntest_torch_budget._auto_meets_the_budget({str(tmp_path)!r})"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]


@pytest.mark.slow
@pytest.mark.parametrize("config", ["MatMul+Mul+silu+:1:-1", "Mul+silu+:1:-1"])
def test_the_tables_peak_drop_is_what_a_run_with_the_plan_measures(tmp_path, config):
    """Where the peak leaves the layers, SAVING overstates the drop; PEAK DROP, from step one's memory by segment,
    is what a run with the plan then measures (step one against step one), inside the bounds the table says: step
    one is read after every op, so both runs read the same figures every time, and the measured drop lies between
    the least and the most the row gives (here it may only be more: the planned run's peak may fall in layer 2's own
    backward, where its replay brings the MLP's tensors back one at a time). Counted in tensor storages (`measure.live`)
    there is no tolerance: the C allocator read before counted a few KiB that are not tensors (autograd's nodes), and
    its 2 ms sampler, before that, read this small step 20% apart run to run."""
    from optimum_memopt.backends.torch.measure.live import LIVE_HOW

    train_decoder(tmp_path, "warm-up", steps=1)  # the process's first training allocates for good (thread pools)
    eager = train_decoder(tmp_path, "eager", steps=1)
    with open(tmp_path / "eager" / "memory_plans.json") as f:
        report = json.load(f)
    assert all(p["peak_drop_bytes"] <= p["saving_bytes"] for p in report["plans"])
    note = next(n for n in report["notes"] if n.startswith("step one peaked at"))
    handle = eager.memopt_handle
    memory = handle.profile.memory
    assert f"step one peaked at {memory.peak.peak_bytes / MIB:,.1f} MiB, {memory.peak.name}" in note
    assert f"backward, {LIVE_HOW};" in note
    assert "(+N) may be up to N" in note

    peak_drop, layers = _peak_drop(handle.policy, handle.profile), handle.profile.layers

    def drop(ops):
        """The table's figure and bounds for a set of ops (a row, where the table offers the set)."""
        return peak_drop([_freed(rec, ops) for rec in layers])

    layer_rows = [p for p in report["plans"] if not p["config"].startswith("Loss+")]  # the head's: test_torch_loss
    rows = {tuple(sorted(p["config"].split(":")[0].strip("+").split("+"))): p for p in layer_rows}
    for ops, row in rows.items():  # every row, single plans and the sets offered (these depend on op timings too)
        assert (row["peak_drop_bytes"], row["peak_drop_min_bytes"], row["peak_drop_max_bytes"]) == drop(ops)
    ops = config.split(":")[0].strip("+").split("+")
    predicted, least, most = drop(ops)
    del eager, handle  # what the process holds before each run's first layer is left out of its peak
    run = train_decoder(tmp_path, config.split(":")[0], steps=1, memory_opt_config=config)
    ran = run.memopt_handle.profile.memory
    measured = (memory.peak.peak_bytes - memory.start_bytes) - (ran.peak.peak_bytes - ran.start_bytes)
    assert least == predicted < most  # one-sided here: the peak with nothing recomputed is after the layers
    assert least <= measured <= most, (least / MIB, measured / MIB, most / MIB)


@pytest.mark.slow
def test_auto_with_a_share_of_the_activations(tmp_path, capsys):
    trainer = train_decoder(tmp_path, "share", steps=3, memory_opt_config="auto", activation_memory_budget=0.5)
    planner = trainer.memopt_handle.planner
    result = planner.fits[-1]
    assert result.share == 0.5 and result.freed >= result.activation_bytes / 2 and len(planner.fits) == 1
    out = capsys.readouterr().out
    assert f"keeping at most 50% of the {result.activation_bytes / MIB:,.1f} MiB the layers keep for backward" in out
    figures = (tmp_path / "share" / "memory_plans.txt").read_text()  # the figures behind the choice, in words
    assert f"Keeping at most 50% of the {result.activation_bytes / MIB:,.1f} MiB the layers keep" in figures
    assert "(the budget is a share of the activations: `--activation_memory_budget 0.5`)" in out


def eager_and_floor(x):
    """The peaks predicted with nothing recomputed and with the most recompute for three gated-MLP layers on `x`,
    after a warm-up training (what a process's first training allocates once is not in them)."""
    _, warm = pair(gated_mlp, n=L)
    step(warm, x)
    del warm
    gc.collect()  # earlier tests' garbage freed now, not between a run's step one and two (its `extra`)
    _, model = pair(gated_mlp, n=L)
    probe = engine(model, whole())
    probe.planner = BudgetPlanner(1 << 40, say=lambda text: None)
    for seed in range(2):
        step(model, x, seed=seed)
        probe.step_done()
    eager, floor = probe.planner.fits[0].predicted.peak_bytes, probe.planner.fits[0].floor.peak_bytes
    assert eager > floor
    return eager, floor


def planned_between(x, share):
    """A fresh model under the budget planner, the budget `share` of the way from the floor to eager's peak: the
    model, its engine, the planner, the budget, that span, and what the planner said (a list)."""
    eager, floor = eager_and_floor(x)
    gc.collect()
    _, model = pair(gated_mlp, n=L)
    state = engine(model, whole())
    said = []
    budget = floor + int(share * (eager - floor))
    state.planner = BudgetPlanner(budget, say=said.append)
    return model, state, state.planner, budget, eager - floor, said


@pytest.mark.slow
def test_a_check_that_misses_again_falls_back_to_the_floor_then_stops_with_the_figures():
    """Each check's step measures more than predicted by what the model holds only from step two on (here added to
    the meter's readings: 40%, 80%, then 120% of the way from the floor to eager's peak): the first miss re-plans for
    the budget lowered by the miss and a margin of 0.5% of it, said with that budget; the second falls back to the
    least peak recompute reaches; the floor's miss stops training with the figures, on the step after it, never
    training on over the budget."""
    from optimum_memopt.memory import MemoryReading

    x = torch.randn(1 << 15, 8)  # 1 MiB an activation: the step well above the allocator's noise
    model, state, planner, budget, span, said = planned_between(x, 0.7)
    extra = iter([0.4 * span, 0.8 * span, 1.2 * span])
    checks = []

    def reading(read):
        def more():
            got = read()
            if planner.stage == "verify" and len(checks) < len(planner.fits):  # the step being checked
                checks.append(next(extra))
            add = checks[-1] / MIB if planner.stage == "verify" and checks else 0.0
            return MemoryReading(got.device, got.current_mb, got.peak_mb + add, got.resident_mb, got.resident_peak_mb)

        return more

    with pytest.raises(RuntimeError) as stopped:
        for seed in range(6):
            step(model, x, seed=seed)
            state.step_done()
            if planner.meter is not None and not hasattr(planner.meter, "_wrapped"):
                planner.meter.read, planner.meter._wrapped = reading(planner.meter.read), True
    fits = planner.fits
    assert len(fits) == 3 and len(planner.verified) == 3
    missed = (planner.verified[0]["measured_peak_mb"] - planner.verified[0]["predicted_peak_mb"]) * MIB
    assert fits[1].budget_bytes == pytest.approx(budget - missed - int(MARGIN * budget), abs=2)
    assert (
        f"under {fits[1].budget_bytes / MIB:,.1f} MiB (the budget of {budget / MIB:,.1f} MiB lowered by the" in said[2]
    )
    assert fits[2].predicted.peak_bytes == fits[2].floor.peak_bytes < fits[1].predicted.peak_bytes
    assert "(the least peak recompute reaches: the choice for a lowered budget missed again, by" in said[4]
    text = str(stopped.value)
    assert text.startswith(f"`--memory_opt_config auto` cannot keep `--memory_budget_mb {budget / MIB:g}`: with the ")
    assert f"most recompute it has (`--memory_opt_config {fits[2].config()}`" in text
    assert "it stops here rather than train on over it. Raise the budget to at least" in text
    assert all(f"over the budget of {budget / MIB:,.1f} MiB" in s for s in (said[1], said[3], said[5]))


@pytest.mark.slow
def test_a_check_under_its_prediction_keeps_the_choice():
    """A check that measures well under its prediction (30% of the span from the floor to eager's peak taken off the
    meter's readings in every checked step) keeps the choice: what it measured less comes from the step it ran, and a
    choice that recomputes less could peak where the difference is not (a second solve that took it as slack chose,
    3 runs in 10 of the advisor test's recipe, a choice that measured 3.6% over its prediction and over the budget:
    docs/STACK.md). One choice, one check, said within the budget."""
    from optimum_memopt.memory import MemoryReading

    x = torch.randn(1 << 15, 8)  # 1 MiB an activation: the step well above the allocator's noise
    model, state, planner, budget, span, said = planned_between(x, 0.6)
    kept_once = int(0.3 * span)

    def reading(read):
        def less():
            got = read()
            if planner.stage != "verify":
                return got
            peak = planner.fits[-1].predicted.peak_bytes - kept_once
            return MemoryReading(got.device, got.current_mb, peak / MIB, got.resident_mb, got.resident_peak_mb)

        return less

    for seed in range(5):
        step(model, x, seed=seed)
        state.step_done()
        if planner.meter is not None and not hasattr(planner.meter, "_wrapped"):
            planner.meter.read, planner.meter._wrapped = reading(planner.meter.read), True
    assert planner.stage == "done" and len(planner.fits) == len(planner.verified) == 1
    first, check = planner.fits[0], planner.verified[0]
    assert first.recompute_seconds > 0 and state.policy == first.policy()
    assert (check["predicted_peak_mb"] - check["measured_peak_mb"]) * MIB == pytest.approx(kept_once, abs=2)
    assert said[-1].endswith(f"within the budget of {budget / MIB:,.1f} MiB") and len(said) == 2


def test_a_lever_inside_the_layers_moves_its_stretches_only_and_is_chosen_over_whole_layers_only(profile):
    """A lever acting inside the layers (the tiled MLP) moves the stretches of a segment its module runs in
    (`Segment.parts`, `LeverChoice.less_parts`): the segment's peak is the highest stretch so moved, a stretch it
    does not act in stays. Its options that need their layers recomputed whole (`recomputed`) are weighed with those
    layers recomputed whole and no other way: the least total time of every combination that fits, by brute force."""
    from optimum_memopt.backends.torch.measure.graph import whole_layer

    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base, k = 10 << 20, 100  # k: the stretches' figures apart by more than a message's 0.1 MiB
    segs = [Segment(Place.forward(i), i + 1, 0, base + 900 * k, parts=(("", base + 100 * k), ("mlp forward", base + 900 * k)))
            for i in range(L)]  # fmt: skip
    segs.append(Segment(HEAD_PLACE, L, 0, base + 500 * k))
    for i in reversed(range(L)):
        parts = (
            ("", base),
            ("mlp backward", base + 2000 * k),
            ("mlp forward", base + 6000 * k),
            ("after mlp backward", base + 3000 * k),
        )
        segs.append(Segment(Place.backward(i), i, 0, base + 6000 * k, parts=parts))
    segs.append(Segment(AFTER_PLACE, 0, 0, base))
    mem = StepMemory("cpu", segs, 0, "test")

    def tiles(layers, seconds):
        parts = tuple((Place.backward(i), "mlp forward", 5000 * k) for i in layers)
        parts += tuple((Place.forward(i), "mlp forward", 400 * k) for i in layers)
        return LeverChoice("mlp", "x", "MLP+", seconds=seconds, less_parts=parts, recomputed=tuple(layers))

    one = tiles([L - 1], 0.001)
    assert (
        predict(mem, q, q, levers=[one]).peak_bytes == base + 6000 * k
    )  # the other layers' backward still peak there
    moved = predict(mem, q, q, levers=[tiles(range(L), 0.003)])
    assert moved.peak_bytes == base + 3000 * k and "backward" in moved.where  # the attention's stretch is the top now

    options = [LeverChoice("mlp"), one, tiles(range(L), 0.003)]
    wholes = []
    for rec in profile.layers:
        w = whole_layer(rec.graph, rec.op_seconds)
        wholes.append(Candidate(frozenset(), True, w.freed_bytes, w.seconds))
    chosen = set()
    for budget in (base + 6000 * k - min(q) // 2, base + 3000 * k, base + 6100 * k, base + 2999 * k):
        best = None
        for option in options:
            allowed = [[wholes[i]] if i in option.recomputed else per_layer[i] for i in range(L)]
            for combo in itertools.product(*allowed):
                if predict(mem, q, [c.freed_bytes for c in combo], levers=[option]).peak_bytes <= budget:
                    t = sum(c.seconds for c in combo) + option.seconds
                    best = t if best is None or t < best - 1e-12 else best
        result = fit(profile, mem, budget, whole(), levers=[options])
        if best is None:
            assert result.choice is None, budget
            continue
        assert result.choice is not None and result.predicted.peak_bytes <= budget
        assert result.recompute_seconds == pytest.approx(best), (
            budget - base,
            [c.label for c in result.choice],
            result.lever("mlp").recomputed,
        )
        tiled = result.lever("mlp").recomputed
        assert all(result.choice[i].whole for i in tiled)
        chosen.add(len(tiled))
    assert chosen == {0, L}, chosen  # untiled where it fits so, every layer tiled where only that fits
    # nothing fits: said of the option that comes closest (every layer tiled), not of the first one tried
    closest = fit(profile, mem, base + 2999 * k, whole(), levers=[[options[2]]]).why_not
    assert fit(profile, mem, base + 2999 * k, whole(), levers=[options]).why_not == closest
    assert "10.3 MiB in layer 0 backward" in closest, closest


@pytest.mark.slow
def test_the_step_after_the_last_check_is_counted_only_up_to_its_first_layer():
    """On the CPU the steps `auto` measures are counted op by op (several times slower); its last check is read at
    the next step's first layer, and the rest of that step runs uncounted: only step one and the check are slow."""
    from optimum_memopt import optimize_memory
    from optimum_memopt.backends.torch import _torch_api

    model = decoder()
    model.train()
    handle = optimize_memory(model, "auto", budget_mb=1e6, reports_steps=True, say=lambda s: None)
    modes = []
    model.model.layers[-1].register_forward_hook(lambda *a: modes.append(len(_torch_api.dispatch_modes())))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 512, (2, 64), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        handle.step_done()
    planner = getattr(model, "_memopt_recompute").planner
    assert planner.stage == "done" and len(planner.verified) == 1
    assert [m > 0 for m in modes] == [True, True, False, False], modes  # step one, the check; not the two after


def test_a_segment_is_a_place_in_the_step_named_in_words_for_messages_only():
    """A lever's bytes held less are by place in the step: they move the same place read on any process (steps of
    several merged), and no other (a layer's backward is not the backward of a layer whose number starts alike);
    `str` is what messages and files say."""
    at = Place.backward(1)
    tiles = LeverChoice("mlp", "x", "MLP+", less=((at, 7),), less_parts=((at, "mlp forward", 5),))
    assert tiles.less_in(at) == tiles.less_in(at.on_rank(1)) == 7
    assert tiles.less_in(Place.backward(10)) == tiles.less_in(Place.forward(1)) == tiles.less_in(HEAD_PLACE) == 0
    assert tiles.less_in_part(at.on_rank(0), "mlp forward") == 5 and tiles.less_in_part(at, "mlp backward") == 0
    assert str(at.on_rank(1)) == "layer 1 backward on rank 1" and str(Place.forward(0)) == "layer 0 forward"
    assert str(HEAD_PLACE) == "after the layers: head and loss, forward and backward"
    assert str(AFTER_PLACE) == "after backward: the optimizer step and the next batch"
    merged_ = merged([as_kept(memory_of([5], 6, [7], 1), [0])] * 2, [0])
    assert [s.place for s in merged_.segments][:2] == [Place.forward(0).on_rank(0), HEAD_PLACE.on_rank(0)]
    assert [s.name for s in merged_.segments][-1] == "after backward: the optimizer step and the next batch on rank 1"


def test_the_solves_arrays_move_every_segment_as_predict_does_for_every_combination_of_options():
    """`fit` weighs every combination of the levers' options on arrays (`budget._Moved`): each segment's peak, the
    stretches inside one included, moved by what each option holds less there and what the layers free, to the byte
    what the rule gives one segment at a time (`_moved`), the first of equal peaks named (random figures, a fixed
    seed); `predict` gives the same."""
    from optimum_memopt.backends.torch.decide.budget import Prediction, _Moved, _moved
    from optimum_memopt.backends.torch.measure.profile import AFTER_PLACE, HEAD_PLACE, Place, Segment, StepMemory

    rng = random.Random(7)
    n = 5
    places = [Place.forward(i) for i in range(n)] + [HEAD_PLACE] + [Place.backward(i) for i in reversed(range(n))]
    segments = []
    for place in places:
        held = place.layer + 1 if place.kind == "forward" else (n if place == HEAD_PLACE else place.layer)
        parts = tuple((tag, rng.randrange(900, 1100)) for tag in ("", "mlp", "after")) if rng.random() < 0.5 else ()
        segments.append(Segment(place, held, 0, rng.randrange(900, 1100), parts=parts))
    segments.append(Segment(AFTER_PLACE, 0, 0, 500))
    memory = StepMemory("cuda", segments, 0, "test")

    def option(name, k):
        less = tuple((p, rng.randrange(-50, 200)) for p in rng.sample(places, 4))
        parts = tuple((p, tag, rng.randrange(0, 150)) for p in rng.sample(places, 3) for tag in ("mlp", "after"))
        return LeverChoice(name, None, f"{name}{k}", less=less, less_parts=parts if name == "mlp" else ())

    levers = [[option("loss", k) for k in range(3)], [option("mlp", k) for k in range(3)], [option("off", 0)]]
    moved = _Moved(memory)
    q = [rng.randrange(0, 300) for _ in range(n)]
    last = len(segments) - 1
    for combo in itertools.product(*levers):
        for _ in range(3):
            freed = [rng.randrange(0, 300) for _ in range(n)]
            extra = rng.randrange(0, 100)
            # each segment's figure by the rule, one segment at a time (`_moved`), and the highest, the first of equals
            expected = [_moved(seg, q, freed, combo) + (extra if k < last else 0) for k, seg in enumerate(segments)]
            assert moved.peaks(q, freed, extra, combo).tolist() == expected
            top = expected.index(max(expected))
            assert moved.predict(q, freed, extra, combo) == Prediction(expected[top], segments[top].name)
            assert predict(memory, q, freed, extra, combo) == moved.predict(q, freed, extra, combo)
    # equal peaks: the first segment named
    flat = StepMemory("cuda", [Segment(Place.forward(0), 1, 0, 7), Segment(Place.backward(0), 0, 0, 7)], 0, "test")
    assert predict(flat, [0], [0]) == Prediction(7, flat.segments[0].name)
