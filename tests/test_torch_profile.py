"""Step one's profile, per layer: the bytes autograd keeps by plan, recomputable or not and why, the op times."""

import pytest
import torch
import torch.nn.functional as F
from torch_engine import engine, ops, pair, step

from optimum_memopt.backends.torch.measure.profile import CHANGED_IN_PLACE
from optimum_memopt.backends.torch.measure.storages import block_bytes
from optimum_memopt.backends.torch.policy import LAYER, LayerPolicy, RecomputePolicy

pytestmark = pytest.mark.torch_backend


def mlp(block, x):
    return F.gelu(x @ block.w) @ block.w.t()


def test_bytes_per_plan_and_their_op_times():
    _, model = pair(mlp, n=2)
    state = engine(model, ops(n=2))  # nothing recomputed: measured only
    step(model, torch.randn(32, 8))
    for rec in state.profile.layers:
        # gelu keeps its input (the first matmul's output), the second matmul keeps GELU's output: 32 x 8 fp32 each
        assert rec.recomputable == {"MatMul": 32 * 8 * 4, "Gelu": 32 * 8 * 4}
        assert rec.not_recomputable == {} and rec.applied == {}
        assert rec.seconds["MatMul"] > 0 and rec.seconds["Gelu"] > 0
        assert rec.op_seconds >= rec.seconds["MatMul"] + rec.seconds["Gelu"]
        assert rec.shape == (32, 8)
    assert state.profile.shape == (32, 8)


def test_what_cannot_be_recomputed_says_why():
    def in_place(block, x):
        h = x @ block.w
        h.mul_(2.0)  # the matmul's output changed after it was made
        return F.gelu(h) @ block.w.t()  # gelu keeps h

    _, model = pair(in_place)
    state = engine(model, ops())
    step(model, torch.randn(4, 8))
    rec = state.profile.layers[0]
    assert rec.not_recomputable == {"MatMul": block_bytes(4 * 8 * 4)} and rec.why_not["MatMul"] == [CHANGED_IN_PLACE]


def test_a_layer_checkpointed_whole_is_profiled_too():
    _, model = pair(mlp, n=1)
    state = engine(model, RecomputePolicy([LayerPolicy(LAYER)]))
    step(model, torch.randn(32, 8))
    rec = state.profile.layers[0]
    # checkpoint frees what it saves, so the recording cannot tell which op outputs would be recomputable alone:
    # the layer's kept bytes and op time are what whole-layer recompute frees and costs
    assert rec.kept_bytes == 2 * 32 * 8 * 4 and set(rec.seconds) == {"MatMul", "Gelu"} and rec.op_seconds > 0


def test_a_kept_tensor_whose_storage_cannot_be_read_is_said_not_counted_zero(monkeypatch):
    """A tensor subclass without a readable storage (its size unknown to the tracker): before, it counted 0 bytes in
    the profile and the table without a word; now each such save is recorded by type and the table's notes say that
    its bytes are in no figure. (Emulated: the storage of GELU's input reads as none.)"""
    from optimum_memopt.backends.torch.apply import hooks
    from optimum_memopt.backends.torch.decide.report import plan_report

    real = hooks.storage_key
    unreadable = set()

    def key(t):
        return 0 if real(t) in unreadable else real(t)

    def marked(block, x):
        h = x @ block.w
        unreadable.add(real(h))
        return F.gelu(h) @ block.w.t()

    monkeypatch.setattr(hooks, "storage_key", key)
    _, model = pair(marked)
    state = engine(model, ops())
    step(model, torch.randn(32, 8))
    rec = state.profile.layers[0]
    assert rec.unread == {"Tensor": 1} and "MatMul" not in rec.recomputable  # said, and not counted as 0 bytes
    notes = plan_report(state.policy, state.profile).notes
    assert any(n.startswith("tensors autograd kept in step one whose storage could not be read") and "1 Tensor" in n
               for n in notes), notes  # fmt: skip
