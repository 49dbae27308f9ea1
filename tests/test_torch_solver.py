"""The solver's core: per-layer candidates from step one's graphs, and the least-time choice that frees at least the
bytes asked, checked against every combination on small cases and on a real profile."""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from torch_engine import engine, keep, pair, step

from optimum_memopt.backends.torch.decide.solver import Candidate, candidates, choose, policy_of
from optimum_memopt.backends.torch.measure.graph import effect

pytestmark = pytest.mark.torch_backend


def brute_force(per_layer, need):
    best = None
    for combo in itertools.product(*per_layer):
        if sum(c.freed_bytes for c in combo) >= need:
            t = sum(c.seconds for c in combo)
            if best is None or t < best - 1e-12:
                best = t
    return best


def random_layers(rng, n_layers, n_options, grain, top=40):
    out = []
    for _ in range(n_layers):
        options = [Candidate(frozenset(), False, 0, 0.0)]
        for k in range(n_options):
            options.append(Candidate(frozenset({f"op{k}"}), False, grain * rng.randint(1, top), rng.uniform(0.01, 1)))
        out.append(options)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_choice_is_the_least_time_that_frees_enough(seed):
    rng = random.Random(seed)
    per_layer = random_layers(rng, n_layers=4, n_options=4, grain=1 << 20)
    most = sum(max(c.freed_bytes for c in options) for options in per_layer)
    for need in (1, most // 3, most // 2, most - 5, most):
        got = choose(per_layer, need)
        want = brute_force(per_layer, need)
        assert got is not None and sum(c.freed_bytes for c in got) >= need
        assert sum(c.seconds for c in got) == pytest.approx(want), (seed, need)
    assert choose(per_layer, most + 1) is None
    assert all(c.freed_bytes == 0 for c in choose(per_layer, 0))


def test_bytes_not_in_whole_units_are_counted_down_never_up():
    """With odd byte counts the units round each candidate down: the choice may free more than the optimum needs,
    never less than asked."""
    rng = random.Random(7)
    per_layer = random_layers(rng, n_layers=6, n_options=5, grain=1, top=50_000_000)  # no common divisor
    most = sum(max(c.freed_bytes for c in options) for options in per_layer)
    for need in (most // 4, most // 2, (3 * most) // 4):
        got = choose(per_layer, need)
        assert got is not None and sum(c.freed_bytes for c in got) >= need
        assert sum(c.seconds for c in got) <= brute_force(per_layer, need) * 1.10 + 1e-9


def gated_mlp(block, x):
    return (F.silu(x @ block.w) * (x @ block.w.t())) @ block.w


def test_candidates_from_a_profile_and_the_policy_they_make():
    """Three gated-MLP layers: keep, the frontier's sets and the whole layer for each; asking for the bytes of two
    layers' MLPs picks the cheapest way, and running that policy frees what the graph said."""
    plain, model = pair(gated_mlp, n=3)
    state = engine(model, keep(3))
    x = torch.randn(4, 8)
    step(model, x), step(plain, x)
    per_layer = candidates(state.profile)
    assert all(options[0].label == "keep" and options[-1].freed_bytes > 0 for options in per_layer)
    per_layer_bytes = effect(state.profile.layers[0].graph, ["MatMul", "silu", "Mul"]).freed_bytes
    choice = choose(per_layer, 2 * per_layer_bytes)
    assert sum(c.freed_bytes for c in choice) >= 2 * per_layer_bytes
    state.set_policy(policy_of(choice))
    got, want = step(model, x, seed=1), step(plain, x, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
