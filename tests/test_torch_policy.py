"""The torch engine's policy model: built once from the plan grammar, per layer (keep / ops / whole layer, each op
with the request it came from), and executed as given, mixed per-layer policies included."""

import pytest
import torch
import torch.nn.functional as F
from torch_engine import engine, pair, step

from optimum_memopt.backends.torch.decide.report import plan_report
from optimum_memopt.backends.torch.measure.storages import block_bytes
from optimum_memopt.backends.torch.policy import KEEP, LAYER, OPS, LayerPolicy, RecomputePolicy
from optimum_memopt.plans import parse_plans

pytestmark = pytest.mark.torch_backend


def test_plans_become_one_policy_per_layer_with_their_origin():
    policy = RecomputePolicy.from_plans(parse_plans("BiasGelu+:1:2,Reshape+Where+BiasSoftmax+:1:-1,Foo+:1:-1"), 0, 3)
    assert [p.mode for p in policy.layers] == [OPS, OPS, OPS]
    assert policy.layers[0].ops == {"Gelu", "Where", "Softmax"} and policy.layers[2].ops == {"Where", "Softmax"}
    assert dict(policy.layers[0].origin)["Gelu"] == "BiasGelu+:1:2"
    assert dict(policy.layers[0].origin)["Softmax"] == "Reshape+Where+BiasSoftmax+:1:-1"
    assert [r.unknown for r in policy.requests] == [(), (), ("Foo",)]
    assert policy.level == 0 and policy.active


def test_level_1_is_every_layer_whole_and_no_plans_is_keep():
    assert RecomputePolicy.from_plans([], 1, 2).layers == [LayerPolicy(LAYER)] * 2
    assert RecomputePolicy.from_plans([], 1, 2).level == 1
    off = RecomputePolicy.from_plans(parse_plans("Gelu+:0:-1"), 0, 2)
    assert off.layers == [LayerPolicy(KEEP)] * 2 and not off.active


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(mode="some"), "layer policy mode 'some'"),
        (dict(mode=OPS), "mode 'ops' needs at least one op name"),
        (dict(mode=LAYER, ops=frozenset({"Gelu"})), "mode 'layer' takes no op names"),
    ],
)
def test_a_layer_policy_that_cannot_work_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerPolicy(**kwargs)


def mlp(block, x):
    return F.gelu(x @ block.w) @ block.w.t()


def test_a_mixed_policy_runs_each_layer_as_its_policy_says():
    """Three layers: the first checkpointed whole, the second with GELU recomputed, the third kept: gradients are
    bitwise the plain model's, and the profile and table say what each layer did."""
    plain, model = pair(mlp, n=3)
    policy = RecomputePolicy([LayerPolicy(LAYER), LayerPolicy.of_ops({"Gelu": "Gelu+:1:-1"}), LayerPolicy()])
    state = engine(model, policy)
    x = torch.randn(4, 8)
    got, want = step(model, x), step(plain, x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    layers = state.profile.layers
    assert [bool(rec.applied) for rec in layers] == [False, True, False]
    report = plan_report(state.policy, state.profile)
    gelu = next(p for p in report.plans if p.config == "Gelu+:1:-1")
    assert gelu.frequency == 3 and gelu.applied_count == 2  # layer 0 whole, layer 1 by plan
    assert report.level == 0 and report.optimizer_enabled
    assert any(n.startswith("layer 0 is checkpointed whole") for n in report.notes)


def test_a_policy_swapped_between_steps_applies_from_the_next_step():
    plain, model = pair(mlp, n=2)
    state = engine(model, RecomputePolicy([LayerPolicy(), LayerPolicy()]))
    x = torch.randn(4, 8)
    step(model, x), step(plain, x)
    state.set_policy(RecomputePolicy([LayerPolicy(LAYER), LayerPolicy.of_ops({"Gelu": "Gelu+:1:-1"})]))
    got, want = step(model, x, seed=1), step(plain, x, seed=1)
    assert all(torch.allclose(a, b, atol=0, rtol=0) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="a policy for 1 layers given to a model with 2"):
        state.set_policy(RecomputePolicy([LayerPolicy()]))


def plain_and_level1(cls, config):
    """Two models of `cls` with the same weights: one plain, one whose two layers are recomputed whole."""
    torch.manual_seed(0)
    plain = cls(config).train()
    model = cls(config).train()
    model.load_state_dict(plain.state_dict())
    engine(model, RecomputePolicy.from_plans([], 1, 2))
    return plain, model


def test_a_layer_checkpointed_whole_leaves_the_kv_cache_alone(monkeypatch):
    """In training a Llama builds a KV cache (config.use_cache); a checkpointed layer recomputed in backward would
    append its keys a second time. Whole layers run without the cache, as transformers' checkpointing runs them."""
    from transformers import LlamaConfig, LlamaForCausalLM, cache_utils

    updates = []
    real = cache_utils.DynamicLayer.update
    monkeypatch.setattr(
        cache_utils.DynamicLayer, "update", lambda self, *a, **k: updates.append(1) or real(self, *a, **k)
    )
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    plain, model = plain_and_level1(LlamaForCausalLM, cfg)
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert updates == []  # neither in forward nor in the recompute
    plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_layers_kept_or_planned_by_op_run_without_the_kv_cache_in_training(monkeypatch, caplog):
    """A cache filled by the layers a policy keeps and not by those it recomputes is of no use, and it holds their keys
    and values through backward, which step one (every layer recomputed whole under `auto`) never measured: every
    layer the engine runs drops it in training, said once; gradients are plain Llama's without its cache, bitwise. Out
    of training the cache is built as the model builds it."""
    from transformers import LlamaConfig, LlamaForCausalLM, cache_utils

    updates = []
    real = cache_utils.DynamicLayer.update
    monkeypatch.setattr(
        cache_utils.DynamicLayer, "update", lambda self, *a, **k: updates.append(1) or real(self, *a, **k)
    )
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(cfg)
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(plain.state_dict())
    engine(model, RecomputePolicy([LayerPolicy(), LayerPolicy(OPS, frozenset({"silu"}))]))
    ids = torch.randint(0, 100, (2, 8))
    with caplog.at_level("WARNING", logger="optimum_memopt"):
        model(input_ids=ids, labels=ids).loss.backward()
        model(input_ids=ids, labels=ids).loss.backward()
    assert updates == []
    assert sum("builds a KV cache (`use_cache` on)" in r.getMessage() for r in caplog.records) == 1
    plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    assert updates  # generation's forward keeps its cache


def test_a_cache_passed_under_any_name_is_dropped_from_a_layer_checkpointed_whole(monkeypatch):
    """XLM builds its cache whatever `use_cache` says and hands it to each layer as `cache=`: a layer recomputed with
    it appended its keys and values a second time, and the recompute failed on a mask's shape ("The expanded size of
    the tensor (32) must match the existing size (16)"). Any transformers cache is dropped, whatever its name: the
    gradients are then plain XLM's without its cache, bitwise; with it, the cache's copy of the keys and values (a
    concatenation, contiguous) changes a matmul's order of summation, and plain's differ by float32 rounding."""
    import transformers.models.xlm.modeling_xlm as xlm
    from transformers import XLMConfig, XLMWithLMHeadModel

    cfg = XLMConfig(vocab_size=100, emb_dim=32, n_layers=2, n_heads=2, dropout=0.0, attention_dropout=0.0)
    plain, model = plain_and_level1(XLMWithLMHeadModel, cfg)
    ids = torch.randint(0, 100, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    with_cache = plain(input_ids=ids, labels=ids).loss
    with_cache.backward()
    assert torch.equal(loss, with_cache)
    grads = [p.grad.clone() for p in plain.parameters()]
    assert all(torch.allclose(a.grad, g, rtol=1e-5, atol=1e-9) for a, g in zip(model.parameters(), grads))
    attend = xlm.MultiHeadAttention.forward
    monkeypatch.setattr(
        xlm.MultiHeadAttention, "forward", lambda self, *a, **k: attend(self, *a, **{**k, "cache": None})
    )
    plain.zero_grad(set_to_none=True)
    plain(input_ids=ids, labels=ids).loss.backward()
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


# -- whole layers and op plans per layer, in the grammar ------------------------------------------------------------
def test_whole_layers_and_op_plans_per_layer_from_the_grammar():
    plans = parse_plans("Layer+:1:-1@every2,Gelu+:1:-1@1-4,MatMul+:1:-1@5")
    policy = RecomputePolicy.from_plans(plans, 0, 6)
    modes = [p.mode for p in policy.layers]
    assert modes == [LAYER, OPS, LAYER, OPS, LAYER, OPS]
    assert policy.layers[1].ops == {"Gelu"} and policy.layers[5].ops == {"MatMul"}
    assert policy.whole_layers == [0, 2, 4] and policy.level == 0
    # the op plan named layers 2 and 4 too: they are recomputed whole, and the policy says so
    assert policy.notes == ["'Gelu+:1:-1@1-4' names layers 2, 4, recomputed whole by 'Layer+:1:-1@every2': the op "
                            "plan applies to the other layers"]  # fmt: skip
    assert RecomputePolicy.from_plans(parse_plans("Layer+:1:-1"), 0, 3).level == 1  # every layer: level 1's policy
    first = RecomputePolicy.from_plans(parse_plans("Layer+:1:2,Gelu+:1:-1"), 0, 3)
    assert [p.mode for p in first.layers] == [LAYER, LAYER, OPS]


def test_a_selector_naming_a_layer_the_model_lacks_is_refused_with_its_count():
    from optimum_memopt.plans import PlanError

    with pytest.raises(PlanError, match=r"names layer 7, but the model has 4 layers \(0-3\)"):
        RecomputePolicy.from_plans(parse_plans("Gelu+:1:-1@2-7"), 0, 4)


def test_layer_with_op_names_is_refused():
    from optimum_memopt.backends.torch.policy import check_requests

    with pytest.raises(
        ValueError, match=r"'Layer\+Gelu\+:1:-1': `Layer\+` \(the whole layer recomputed\) takes no op"
    ):
        check_requests(parse_plans("Layer+Gelu+:1:-1"))


def test_a_mixed_plan_from_the_grammar_trains_as_plain_pytorch():
    """Four layers: 0 and 2 whole, 1 and 3 with the matmul-GELU chain: bitwise the plain model's gradients, in the
    profiled step and after."""
    plain, model = pair(mlp, n=4)
    state = engine(model, RecomputePolicy.from_plans(parse_plans("Layer+:1:-1@every2,MatMul+Gelu+:1:-1"), 0, 4))
    x = torch.randn(4, 8)
    for seed in (0, 1):
        got, want = step(model, x, seed), step(plain, x, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    applied = [rec.applied for rec in state.profile.layers]
    block = block_bytes(4 * 8 * 4)  # a planned output of 4 x 8 floats, counted in one 512-byte block
    assert applied[0] == applied[2] == {} and applied[1] == applied[3] == {"MatMul": block, "Gelu": block}
    report = plan_report(state.policy, state.profile)
    assert report.applied == ["MatMul+:1:-1", "Gelu+:1:-1", "Layer+:1:-1@every2"]
    assert any(n.startswith("layers 0, 2 are checkpointed whole") for n in report.notes)


def test_the_set_a_layer_runs_has_its_combination_row_whatever_its_time(monkeypatch):
    """`report.combinations`: the rows of sets run together are those best for their measured recompute time
    (`graph.frontier`), and the set each layer runs (a chain the plans asked for) has its row whatever the clock
    said: a run's noisy op times once left the chain a recipe asked for without a row (tests/test_example_clm.py)."""
    from optimum_memopt.backends.torch.decide import report as report_module

    def gated(block, x):
        h = x @ block.w
        return (F.silu(h) * h) @ block.w.t()

    _, model = pair(gated, n=2)
    state = engine(model, RecomputePolicy.from_plans(parse_plans("silu+Mul+:1:-1"), 0, 2))
    step(model, torch.randn(4, 8))
    monkeypatch.setattr(report_module, "frontier", lambda graph: [])  # no set is best by the clock
    rows = [p for p in plan_report(state.policy, state.profile).plans if p.combination]
    assert [(sorted(p.config.split(":")[0].strip("+").split("+")), p.enabled, p.applied_count) for p in rows] == [
        (["Mul", "silu"], True, 2)
    ]
    assert rows[0].saving_bytes > 0
