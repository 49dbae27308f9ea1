"""Step one's graph of a layer predicts what any set of planned ops frees and recomputes: replayed on the graph of
an unplanned step, each prediction equals what the engine then does under that plan (its stashed bytes per plan and
the ops its recipes run), chains and multi-output ops included."""

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch_engine import engine, keep, ops, pair, step

from optimum_memopt.backends.torch.measure.graph import effect, frontier, saved_bytes, whole_layer
from optimum_memopt.backends.torch.measure.storages import block_bytes
from optimum_memopt.backends.torch.policy import RecomputePolicy

pytestmark = pytest.mark.torch_backend


def gated_mlp(block, x):
    return (F.silu(x @ block.w) * (x @ block.w.t())) @ block.w


def scaled(block, x):
    return F.gelu((x @ block.w) * 2.0) @ block.w.t()


def changed(block, x):
    h = x @ block.w
    h.add_(1.0)
    return F.gelu(h) @ block.w.t()


def dropped(block, x):
    h = x @ block.w
    d, _ = torch.native_dropout(F.gelu(h), 0.5, True)
    return torch.tanh(d) @ block.w.t() + h


def attention_like(block, x):
    q, k = x @ block.w, x @ block.w.t()
    a = torch.softmax((q @ k.t()) / 3.0, dim=-1)
    return (a @ x) @ block.w


LAYERS = [gated_mlp, scaled, changed, dropped, attention_like]


def graph_of(fn):
    _, model = pair(fn)
    state = engine(model, keep())
    step(model, torch.randn(4, 8))
    return state.profile.layers[0]


@pytest.mark.parametrize("fn", LAYERS, ids=lambda f: f.__name__)
def test_the_graph_predicts_every_plan_set_exactly(fn, recomputed):
    layer = graph_of(fn)
    graph = layer.graph
    names = graph.plans()
    assert names and saved_bytes(graph) == layer.kept_bytes
    for r in range(1, len(names) + 1):
        for chosen in itertools.combinations(names, r):
            predicted = effect(graph, chosen)
            plain, planned = pair(fn)
            state = engine(planned, ops(*chosen))
            recomputed.clear()
            x = torch.randn(4, 8)
            assert all(torch.equal(a, b) for a, b in zip(step(planned, x), step(plain, x))), chosen
            assert predicted.by_plan(graph) == state.profile.layers[0].applied, chosen
            ran = sorted(graph.nodes[i].plan for i in predicted.recomputed)
            calls = {graph.nodes[i].call: graph.nodes[i].plan for i in predicted.recomputed}
            assert len(recomputed) == len(calls), (chosen, recomputed, ran)


def test_whole_layer_frees_everything_but_the_layers_input_and_output():
    layer = graph_of(gated_mlp)
    whole = whole_layer(layer.graph, layer.op_seconds)
    # gate, up, silu's output, the product: 4 x 8 floats each, in one 512-byte block each (as the step counts them)
    assert whole.freed_bytes == layer.kept_bytes == 4 * block_bytes(4 * 8 * 4)
    assert whole.seconds == layer.op_seconds


def test_a_layer_checkpointed_whole_in_step_one_is_recorded_too():
    _, model = pair(gated_mlp)
    state = engine(model, RecomputePolicy.from_plans([], 1, 1))
    step(model, torch.randn(4, 8))
    graph = state.profile.layers[0].graph
    assert effect(graph, ["MatMul", "silu", "Mul"]).freed_bytes == 4 * block_bytes(4 * 8 * 4)


def test_the_frontier_offers_chains_that_free_more_for_their_time():
    graph = graph_of(gated_mlp).graph
    front = frontier(graph)
    freed = [e.freed_bytes for _, e in front]
    seconds = [e.seconds for _, e in front]
    assert freed == sorted(freed) and len(set(freed)) == len(freed)  # each frees more than the cheaper ones
    assert seconds == sorted(seconds)
    ops, most = front[-1]
    assert most.freed_bytes == saved_bytes(graph) and ops == {"MatMul", "silu", "Mul"}  # the whole MLP, chained
    for ops, e in front:  # each is the smallest set with its effect
        assert all(effect(graph, ops - {name}).freed != e.freed for name in ops if len(ops) > 1)


def test_the_frontier_is_searched_once_for_layers_alike_in_structure_and_op_times():
    """Layers of one structure whose op calls take the same times (a dry run's repeated blocks on a roofline) share
    one frontier search; a layer whose ops take other times (a card's measured step) gets its own, with its times."""
    import copy
    import dataclasses

    from optimum_memopt.backends.torch.measure import graph as graphs

    graph = graph_of(gated_mlp).graph
    twin = copy.deepcopy(graph)  # the same structure and times, another object (another layer's record)
    searched = []
    real = graphs._frontier

    def counted(g, limit):
        searched.append(g)
        return real(g, limit)

    graphs._frontier = counted
    try:
        first, again = frontier(graph), frontier(twin)
        slower = copy.deepcopy(graph)
        slower.nodes = [dataclasses.replace(n, seconds=n.seconds * 2 + 1e-3) for n in graph.nodes]
        other = frontier(slower)
    finally:
        graphs._frontier = real
    assert [(ops, e) for ops, e in first] == [(ops, e) for ops, e in again]
    assert not any(g is twin for g in searched) and any(g is slower for g in searched), searched
    assert other and all(e.seconds == effect(slower, ops).seconds != effect(graph, ops).seconds for ops, e in other)
