"""The torch engine at op level, without a Trainer: recipes recompute planned outputs bitwise, refuse what they
cannot recompute with a clear error, replay random ops, rebuild views; a chain of planned outputs (today not
recomputed, the profile says why)."""

import pytest
import torch
import torch.nn.functional as F
from torch_engine import engine, ops, pair, step

from optimum_memopt.backends.torch import recipe
from optimum_memopt.backends.torch.profile import INPUT_NOT_KEPT

pytestmark = pytest.mark.torch_backend


@pytest.fixture
def recomputed(monkeypatch):
    """How many times a recipe recomputed its op."""
    calls = []
    real = recipe.Recipe.outputs

    def counting(self):
        if self.value is None:
            calls.append(self.func)
        return real(self)

    monkeypatch.setattr(recipe.Recipe, "outputs", counting)
    return calls


def three_ops(block, x):
    return F.gelu(x @ block.w) @ block.w.t()  # mm, gelu, mm: the GELU output is kept by the second mm


def test_a_planned_output_is_recomputed_bitwise(recomputed):
    plain, planned = pair(three_ops)
    x = torch.randn(4, 8)
    state = engine(planned, ops("Gelu"))
    got, want = step(planned, x), step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [f.overloadpacket.__name__ for f in recomputed] == ["gelu"]
    assert state.profile.layers[0].applied == {"Gelu": 4 * 8 * 4}
    # a second step (not profiled) recomputes again and still matches
    got, want = step(planned, x, seed=1), step(plain, x, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(recomputed) == 2


def test_an_input_changed_in_place_after_forward_is_a_clear_error():
    def changes_input(block, x):
        h = x @ block.w
        g = F.gelu(h)
        out = g @ block.w.t()
        h.add_(1.0)  # the recipe's input, after the planned output was stashed
        return out

    _, planned = pair(changes_input)
    engine(planned, ops("Gelu"))
    with pytest.raises(RuntimeError, match=r"an input of aten\.gelu\.default was modified in place after the forward"):
        step(planned, torch.randn(4, 8))


def test_a_second_backward_through_the_graph_is_a_clear_error():
    _, planned = pair(three_ops)
    engine(planned, ops("Gelu"))
    planned.train()
    loss = planned(torch.randn(4, 8)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match=r"retain_graph=True\) is not supported with plans"):
        loss.backward()


def test_dropout_is_replayed_from_its_random_state_bitwise(recomputed):
    def drops(block, x):
        h = x @ block.w  # keeps x, the dropout's input
        out, _ = torch.native_dropout(x, 0.5, True)  # one op on every device, with its random state
        return out @ block.w.t() + h

    plain, planned = pair(drops)
    x = torch.randn(16, 8)
    engine(planned, ops("Dropout"))
    got = step(planned, x, seed=3)
    after_planned = torch.rand(3)
    want = step(plain, x, seed=3)
    after_plain = torch.rand(3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [f.overloadpacket.__name__ for f in recomputed] == ["native_dropout"]
    assert torch.equal(after_planned, after_plain)  # the replay left the random stream where the plain run did


def test_a_view_of_a_planned_output_is_rebuilt_with_its_geometry(recomputed):
    def viewed(block, x):
        g = F.gelu(x @ block.w)
        return g[:, 1:] @ block.w[1:, :]  # the matmul keeps a view of the GELU output (offset 1, 7 of 8 columns)

    plain, planned = pair(viewed)
    x = torch.randn(4, 8)
    engine(planned, ops("Gelu"))
    got, want = step(planned, x), step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(recomputed) == 1


def test_a_planned_output_made_from_another_planned_output_is_not_recomputed_yet():
    """`MatMul+` frees the matmul's output, so GELU's output, made from it, has an input that is not kept: today it
    stays kept (the profile says why); the budget issue makes such chains recompute."""
    plain, planned = pair(three_ops)
    x = torch.randn(4, 8)
    state = engine(planned, ops("MatMul", "Gelu"))
    got, want = step(planned, x), step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    layer = state.profile.layers[0]
    assert "Gelu" in layer.not_recomputable and layer.why_not["Gelu"] == [INPUT_NOT_KEPT]
    assert "Gelu" not in layer.applied and layer.applied.get("MatMul") == 4 * 8 * 4
