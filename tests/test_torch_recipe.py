"""The torch engine at op level, without a Trainer: recipes recompute planned outputs bitwise, refuse what they
cannot recompute with a clear error, replay random ops, rebuild views; chains of planned outputs recompute each
output once, from tensors kept anyway."""

import pytest
import torch
import torch.nn.functional as F
from torch_engine import Counting, engine, ops, pair, step

from optimum_memopt.backends.torch.measure.profile import INPUT_NOT_KEPT
from optimum_memopt.backends.torch.measure.storages import block_bytes

pytestmark = pytest.mark.torch_backend

# what a planned output of 4 x 8 floats is counted at: one of CUDA's 512-byte blocks, as the step counts it
BLOCK = block_bytes(4 * 8 * 4)


def three_ops(block, x):
    return F.gelu(x @ block.w) @ block.w.t()  # mm, gelu, mm: the GELU output is kept by the second mm


def trained_as_plain(fn, plan: str):
    """A stack running `fn` under a plan on `plan`, one step beside the plain stack's: the gradients equal bitwise;
    the planned stack and its engine state, for more steps and what its profile says."""
    plain, planned = pair(fn)
    x = torch.randn(4, 8)
    state = engine(planned, ops(plan))
    got, want = step(planned, x), step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    return plain, planned, x, state


def test_a_planned_output_is_recomputed_bitwise(recomputed):
    plain, planned, x, state = trained_as_plain(three_ops, "Gelu")
    assert recomputed == ["gelu"]
    assert state.profile.layers[0].applied == {"Gelu": BLOCK}
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
    assert recomputed == ["native_dropout"]
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


def test_a_chain_of_planned_outputs_is_recomputed_once_each(recomputed):
    """`MatMul+Gelu+` frees the matmul's output (kept by GELU) and GELU's output (kept by the second matmul): GELU's
    recipe reads the matmul's output from the matmul's recipe, down to the layer's input, which is kept anyway."""
    plain, planned = pair(three_ops)
    x = torch.randn(4, 8)
    state = engine(planned, ops("MatMul", "Gelu"))
    with Counting() as outer_plain:
        want = step(plain, x)
    with Counting() as outer_planned:
        got = step(planned, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert sorted(recomputed) == ["gelu", "mm"]  # each once, though the matmul's output is read twice
    assert state.profile.layers[0].applied == {"MatMul": BLOCK, "Gelu": BLOCK}
    assert outer_planned.nbytes == outer_plain.nbytes - 2 * 4 * 8 * 4


def gated_mlp(block, x):
    """A Llama MLP with one weight: down(silu(gate(x)) * up(x))."""
    return (F.silu(x @ block.w) * (x @ block.w.t())) @ block.w


def test_a_gated_mlp_chain_frees_every_intermediate(recomputed):
    plain, planned = pair(gated_mlp, n=2)
    x = torch.randn(4, 8)
    engine(planned, ops("MatMul", "silu", "Mul", n=2))
    for seed in (0, 1):  # the profiled step and a later one
        recomputed.clear()
        with Counting() as outer_plain:
            want = step(plain, x, seed)
        with Counting() as outer_planned:
            got = step(planned, x, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        # per layer: gate, up, silu's output, the product; each recomputed once
        assert outer_planned.nbytes == outer_plain.nbytes - 2 * 4 * (4 * 8 * 4)
        assert sorted(recomputed) == sorted(["mm", "mm", "silu", "mul"] * 2)


def test_a_chain_runs_through_an_output_autograd_never_kept(recomputed):
    """`h * 2` keeps nothing of `h` (a scalar's product); GELU keeps `h * 2`. Without `MatMul+`, `h` is neither kept
    nor recomputable, so GELU's input is kept; with it, the chain recomputes `h`, then `h * 2`."""

    def scaled(block, x):
        return F.gelu((x @ block.w) * 2.0) @ block.w.t()

    plain, planned = pair(scaled)
    x = torch.randn(4, 8)
    state = engine(planned, ops("Mul", "Gelu"))
    assert all(torch.equal(a, b) for a, b in zip(step(planned, x), step(plain, x)))
    layer = state.profile.layers[0]
    assert layer.why_not["Mul"] == [INPUT_NOT_KEPT] and layer.applied == {"Gelu": BLOCK}

    plain, planned = pair(scaled)
    state = engine(planned, ops("MatMul", "Mul", "Gelu"))
    recomputed.clear()
    assert all(torch.equal(a, b) for a, b in zip(step(planned, x), step(plain, x)))
    assert state.profile.layers[0].applied == {"Mul": BLOCK, "Gelu": BLOCK}
    assert sorted(recomputed) == ["gelu", "mm", "mul"]


def test_a_chain_does_not_recompute_a_value_changed_before_it_was_read(recomputed):
    """The matmul's output is changed in place before GELU reads it: recomputing it would give the value before the
    change, so GELU's input is kept as it is (autograd keeps it anyway) and only GELU is recomputed."""

    def changed(block, x):
        h = x @ block.w
        h.add_(1.0)
        return F.gelu(h) @ block.w.t()

    plain, planned = pair(changed)
    x = torch.randn(4, 8)
    engine(planned, ops("MatMul", "Gelu"))
    assert all(torch.equal(a, b) for a, b in zip(step(planned, x), step(plain, x)))
    assert recomputed == ["gelu"]


def test_a_linear_layers_output_on_a_3d_input_chains_too(recomputed):
    """`F.linear` on a (batch, sequence, hidden) input runs a matmul on a 2-D view and returns `_unsafe_view` of its
    output: the matmul's own tensor object dies at once while its storage lives on. The chain follows the storage
    (a Llama MLP's projections were kept before)."""

    def linear_mlp(block, x):
        h = x.view(2, 2, 8)
        return (F.silu(F.linear(h, block.w)) * F.linear(h, block.w.t())).matmul(block.w).view(4, 8)

    plain, planned = pair(linear_mlp)
    x = torch.randn(4, 8)
    engine(planned, ops("MatMul", "silu", "Mul"))
    with Counting() as outer_plain:
        want = step(plain, x)
    with Counting() as outer_planned:
        got = step(planned, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert outer_planned.nbytes == outer_plain.nbytes - 4 * (4 * 8 * 4)
    assert sorted(recomputed) == ["mm", "mm", "mul", "silu"]


def _fp32_inside_autocast(block, x):
    # a product computed in fp32 in a region with autocast off (as models do for precision), then one in bf16
    with torch.autocast("cpu", enabled=False):
        h = F.silu(x.float() @ block.w)
    return F.gelu(h @ block.w)


@pytest.mark.parametrize("over_backward", [False, True], ids=["autocast-forward", "autocast-over-backward"])
def test_planned_outputs_under_autocast_are_recomputed_bitwise_in_their_dtype(recomputed_as_first, over_backward):
    """bf16 autocast (CPU): each recomputed output equals the first forward's bitwise and in its dtype, the
    gradients equal plain PyTorch's, with autocast over the forward only (the Trainer's) or over backward too (the
    replay runs the kernel autocast chose in the forward, not autocast's choice again)."""
    plain, planned = pair(_fp32_inside_autocast, n=2)
    engine(planned, ops("MatMul", "silu", "Gelu", n=2))
    x = torch.randn(4, 8)

    def run(model):
        model.train()
        xg = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(xg).float().square().sum()
            if over_backward:
                loss.backward()
        if not over_backward:
            loss.backward()
        return [xg.grad] + [p.grad for p in model.parameters()]

    for _ in range(2):  # the profiled step one, then a plain step
        recomputed_as_first.clear()
        got, want = run(planned), run(plain)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        dtypes = {(name, made) for name, made, _, _ in recomputed_as_first}
        assert {("mm", torch.float32), ("mm", torch.bfloat16)} <= dtypes  # fp32 in the region, bf16 after
        assert all(same and made == back for _, made, back, same in recomputed_as_first), recomputed_as_first


# An op that returns None among its outputs, as CUDA's attention kernels do (flash's cumulative sequence lengths
# before its random seed and offset, which backward keeps); no CPU kernel of aten's does.
_LIB = torch.library.Library("memopt_test", "FRAGMENT")
_LIB.define("sin_none_cos(Tensor x) -> (Tensor, Tensor?, Tensor)")
_LIB.impl("sin_none_cos", lambda x: (x.sin(), None, x.cos()), "CompositeExplicitAutograd")


def _keep_input_and_cos(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[2])


def _sin_backward(ctx, grad_sin, grad_none, grad_cos):
    x, cos = ctx.saved_tensors
    return grad_sin * cos - (grad_cos * x.sin() if grad_cos is not None else 0)


torch.library.register_autograd(
    "memopt_test::sin_none_cos", _sin_backward, setup_context=_keep_input_and_cos, lib=_LIB
)


def test_an_output_after_a_none_is_recomputed_as_the_one_saved(recomputed):
    """A planned output's place counts the op's output tensors, a None among them not: the cosine saved here is the
    op's second tensor, its third output."""

    def none_between(block, x):
        s, _, c = torch.ops.memopt_test.sin_none_cos(x @ block.w)
        return s @ block.w

    state = trained_as_plain(none_between, "sin_none_cos")[3]
    assert recomputed == ["sin_none_cos"]
    assert state.profile.layers[0].applied == {"sin_none_cos": 2 * BLOCK}
