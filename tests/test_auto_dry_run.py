"""`auto`'s dry run (the torch backend's `fake_step` with `plans="auto"`: what `memopt-plan` runs, through
`planning.dry_run`, and a training run's `auto` before its step one): every choice checked by a fake step of its own, the answer the least recompute whose step fitted, its
figure the one a dry run of that choice as fixed plans counts, byte for byte (one figure for one step and choice).

The decoder's head is most of its step (a vocabulary 32 times its width, tied): the smallest size at which step one's
prediction of a head run whole stands well above what the step holds (a head run whole is weighed by its bound,
`levers.loss.choices`), as it did for the 1B and 8B models on an H100 (issue 53: `auto` recomputed where the plain
step fit)."""

import pytest
import torch
from transformers import LlamaConfig

from optimum_memopt.backends.torch.measure.attention import CudaKernels
from optimum_memopt.backends.torch.measure.storages import block_bytes
from optimum_memopt.memory import MIB
from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
from optimum_memopt.planning.dry_run import StepSpec, dry_run

pytestmark = [pytest.mark.torch_backend, pytest.mark.slow]

CONFIG = LlamaConfig(
    num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=4,
    vocab_size=2048, max_position_embeddings=256, tie_word_embeddings=True,
)  # fmt: skip
SPEC = StepSpec(CONFIG, batch=2, seq=128)
CARD = dict(kernels=CudaKernels((9, 0)), cost_device=DEVICES[DEFAULT_DEVICE])
RECIPES = {
    "eager": dict(backend=False),
    "checkpointing": dict(checkpointing=True),
    "level 1": dict(level=1),
    "level 1 + Loss+": dict(plans="Layer+:1:-1,Loss+:1:-1"),
}
# the engine's own path through the head (the model's loss run by the loss lever, whole) prices 0.8% above the plain
# step's on the card's roofline at this size; a choice run as fixed plans, 0.03% apart
SECONDS_APART = 0.01


@pytest.fixture(scope="module")
def recipes():
    return {name: dry_run(SPEC, **kwargs, **CARD) for name, kwargs in RECIPES.items()}


def test_where_the_plain_step_fits_auto_recomputes_nothing(recipes):
    eager = recipes["eager"].peak_bytes
    budget = eager / MIB + 0.5
    result = dry_run(SPEC, "auto", budget_mb=budget, **CARD)
    assert result.fit.config() == "", result.auto
    assert result.fit.predicted.peak_bytes == result.step_peaks[-1] == eager
    assert result.auto["config"] == "" and result.auto["measured_peak_mb"] == eager / MIB


@pytest.mark.parametrize("under", ["level 1", "level 1 + Loss+"])
def test_auto_is_the_least_recompute_that_fits_and_its_figure_is_its_choices_dry_run(recipes, under):
    """At a recipe's own peak (a budget that recipe fits): `auto`'s figure is within the budget, it is the peak a dry
    run of its choice as fixed plans counts, and by the card's roofline its step is no slower than the fastest recipe
    that fits."""
    budget = recipes[under].peak_bytes / MIB
    result = dry_run(SPEC, "auto", budget_mb=budget, **CARD)
    choice = result.fit.config()
    assert choice and result.fit.predicted.peak_bytes <= recipes[under].peak_bytes, result.auto
    assert result.step_peaks[-1] == result.fit.predicted.peak_bytes
    fixed = dry_run(SPEC, choice, **CARD)
    assert fixed.peak_bytes == result.fit.predicted.peak_bytes, (choice, result.auto)
    assert abs(fixed.step_seconds - result.step_seconds) <= SECONDS_APART * fixed.step_seconds
    fitting = [r.step_seconds for r in recipes.values() if r.peak_bytes <= recipes[under].peak_bytes]
    assert result.step_seconds <= min(fitting) * (1 + SECONDS_APART), (choice, result.step_seconds, fitting)
    # every check the search made was read to the byte by a step: none of them taken for a prediction
    for check in result.auto["checks"]:
        assert check["measured_peak_mb"] is not None
    # each check read as its step ended: no step runs the answer again where the last check was it
    checks = result.auto["checks"]
    again = 0 if checks[-1]["config"] == choice else 1
    assert len(result.step_peaks) == 1 + len(checks) + again, (len(result.step_peaks), checks, choice)


def test_under_gradient_accumulation_the_floor_is_one_micro_batchs_with_the_gradients():
    """A later micro-batch runs the layers as the first does, holding the gradients the first made: a choice moves it
    as it moves the first (the planner adds the gradients to every segment but the last). Read as part of the step's
    last segment, the measuring step's second micro-batch (every layer recomputed whole, the head in the chunks step
    one ran) stood as a floor no choice could lower: under accumulation `auto` refused budgets a single micro-batch
    met (issue 53's 4-layer Llama through the Trainer: a floor of 36.1 MiB with two micro-batches, 24.2 with one)."""
    from dataclasses import replace

    one = dry_run(SPEC, "auto", budget_mb=1e6, **CARD)
    two = dry_run(replace(SPEC, grad_accum=2), "auto", budget_mb=1e6, **CARD)
    gradients = sum(block_bytes(p.numel() * p.element_size()) for p in _params())
    assert two.fit.floor.peak_bytes <= one.fit.floor.peak_bytes + gradients, (two.fit.floor, one.fit.floor, gradients)
    # a budget just above that floor is met, as the step that checked the choice measured
    budget = two.fit.floor.peak_mb + 0.25
    tight = dry_run(replace(SPEC, grad_accum=2), "auto", budget_mb=budget, **CARD)
    assert tight.fit.choice is not None and tight.fit.predicted.peak_mb <= budget, tight.auto
    assert tight.step_peaks[-1] == tight.fit.predicted.peak_bytes


def _params():
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return [p for p in AutoModelForCausalLM.from_config(CONFIG).parameters() if p.requires_grad]


def test_step_one_measured_weighs_the_levers_up_to_the_budget_or_says_what_it_could_not_weigh(tmp_path):
    """Issue 53's case: a Llama of 4 layers (hidden 256, MLP 896, vocabulary 8,192) on 4,096 tokens under 218 MiB.
    A dry run of step one weighs the MLPs in tiles and fits the budget. Step one measured instead (no dry run) peaks
    at 181.6 MiB, beside which one MLP cannot run alone whole: its ways are measured up to the budget, and the choice
    tiles the MLPs too, fits, and is read as predicted (before, the tiles went unpriced and `auto` refused: "the least
    any recompute reaches is 242.6 MiB"). Under 170 MiB, below step one's peak, they are not run, and the refusal says
    so and what weighs them."""
    from helpers import LossRecordingTrainer, Tokens, make_args
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=8192, hidden_size=256, intermediate_size=896, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip

    def train(budget, steps, *flags):
        args = make_args(
            tmp_path, "--max_steps", str(steps), "--per_device_train_batch_size", "1", "--memory_opt_backend", "torch",
            "--optim", "adamw_torch", "--memory_opt_config", "auto", "--memory_budget_mb", budget, *flags,
        )  # fmt: skip
        trainer = LossRecordingTrainer(
            model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(n=6, seq=4096, vocab=8192)
        )
        trainer.train()
        return trainer.memopt_handle.planner

    # a dry run of the step (the one a run makes before step one: its figure is the CPU's count of the choice's step,
    # tests above) weighs the MLPs in tiles and fits
    dry = dry_run(StepSpec(config, batch=1, seq=4096, optimizer="adamw_torch"), plans="auto", budget_mb=218)
    assert "MLP+" in dry.fit.config() and dry.fit.predicted.peak_mb <= 218, (dry.fit.config(), dry.fit.predicted)
    planner = train("218", 3, "--memory_auto_dry_run", "false")  # step two runs the choice, step three checks it
    assert planner.step_one.memory.peak.peak_bytes / MIB < 218 and "MLP+" in planner.fits[-1].config(), planner.fits
    assert planner.verified and all(check["measured_peak_mb"] <= 218 for check in planner.verified), planner.verified
    first = planner.verified[0]
    assert abs(first["measured_peak_mb"] - first["predicted_peak_mb"]) <= 0.01 * first["predicted_peak_mb"], first
    with pytest.raises(RuntimeError) as refused:
        train("170", 2, "--memory_auto_dry_run", "false")  # refused at step two's start
    said = str(refused.value)
    assert said.startswith("`--memory_opt_config auto` found nothing that fits `--memory_budget_mb 170`")
    assert (
        "Not weighed, so these figures are not the least the levers reach: the MLPs in tiles (`MLP+`): one MLP "
        in said
    )
    assert "run alone after step one was not run whole, as the step ran it (it could hold up to " in said
    assert "and step one's peak left " in said
    assert "`--memory_opt_config Layer+:1:-1,Loss+:1:-1,MLP+:1:-1@tiles8`" in said


class _Cycling(torch.nn.ModuleList):
    """A layer list whose slice (what Llama's forward loops over) runs its first layer again after the others, as a
    model that cycles its layers does."""

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            got = list(super().__getitem__(idx))
            return got + got[:1]
        return super().__getitem__(idx)


def test_a_step_the_dry_run_cannot_measure_stops_the_run_before_step_one(tmp_path):
    """Through the Trainer, a step that runs a layer twice is found by the dry run before step one, and every rank
    stops there, saying why and what runs instead: no step trains (a refusal, not a fallback to measuring)."""
    from helpers import LossRecordingTrainer, Tokens, make_args
    from transformers import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.model.layers = _Cycling(model.model.layers)
    args = make_args(
        tmp_path, "--max_steps", "2", "--per_device_train_batch_size", "2", "--memory_opt_backend", "torch",
        "--optim", "adamw_torch", "--memory_opt_config", "auto", "--memory_budget_mb", "1000",
    )  # fmt: skip
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=Tokens(n=4, seq=32, vocab=256))
    with pytest.raises(RuntimeError) as refused:
        trainer.train()
    assert str(refused.value) == (
        "`--memory_opt_config auto` cannot measure this model's step: a step of LlamaForCausalLM runs layers 0 "
        "(LlamaDecoderLayer) several times each (3 layer forwards for 2 layers), and step one is measured layer by "
        "layer, once each. Nothing was chosen, and no step was trained. Recompute whole layers instead "
        "(`--memory_opt_level 1`)"
    )
    assert trainer.losses == []


def test_each_check_is_read_as_its_step_ends_and_the_answer_runs_again_only_where_an_earlier_check_was_it(
    recipes, monkeypatch
):
    """The search reads each check as its step ends (`BudgetPlanner.check_ended`): where the check just read is the
    answer, the dry run stops there (its step is the answer's, as a dry run of the choice as fixed plans counts it);
    where the answer is an earlier check (the last went over, or kept no less), one more step runs it where the last
    step is priced (`memopt-plan`'s rows), and none where it is not (a run's own dry run): that check's step stands
    for it (`DryRun.answer_step`), the same choice and figure. With what each check reads corrected for, the first
    check is the answer at every budget at this size (the next test); the search is taken here as it runs where a
    check's segments cannot be read (`_learn` reading nothing: the budget moved by what each check measured), where
    budgets between level 1 + `Loss+`'s peak and eager's take both ways."""
    from optimum_memopt.backends.torch.decide.planner import BudgetPlanner

    monkeypatch.setattr(BudgetPlanner, "_learn", lambda self, result: False)
    low, high = recipes["level 1 + Loss+"].peak_bytes / MIB, recipes["eager"].peak_bytes / MIB
    ways = set()
    for k in (3, 4, 5, 6):
        budget = low + k * (high - low) / 15
        result = dry_run(SPEC, "auto", budget_mb=budget, **CARD)
        checks, choice = result.auto["checks"], result.fit.config()
        again = checks[-1]["config"] != choice
        ways.add(again)
        assert len(result.step_peaks) == 1 + len(checks) + again, (budget, checks, choice)
        assert result.step_peaks[-1] == result.fit.predicted.peak_bytes <= budget * MIB, (budget, result.auto)
        assert dry_run(SPEC, choice, **CARD).peak_bytes == result.fit.predicted.peak_bytes, (budget, choice)
        unpriced = dry_run(SPEC, "auto", budget_mb=budget, kernels=CARD["kernels"])  # the same roofline, no price
        assert unpriced.fit.config() == choice and unpriced.auto["checks"] == checks, (budget, unpriced.auto)
        assert len(unpriced.step_peaks) == 1 + len(checks), (budget, checks, choice)
        answer = unpriced.answer_step
        assert answer == (-1 if not again else next(k for k, c in enumerate(checks) if c["config"] == choice) + 1)
        assert unpriced.step_peaks[answer] == unpriced.fit.predicted.peak_bytes == result.fit.predicted.peak_bytes
        (parts, at), (priced_parts, priced_at) = unpriced.step_parts[answer], result.step_parts[-1]
        assert parts == priced_parts and at.partition(", ")[2] == priced_at.partition(", ")[2], (at, priced_at)
    assert ways == {False, True}, "these budgets no longer take both ways: choose others that do"


def test_a_choice_recomputing_no_less_than_one_that_fitted_is_not_checked(recipes, monkeypatch):
    """Once a check fitted, a next choice that recomputes no less is not checked: that check is the answer, and the
    dry run ends at it (a corrected solve, counting bytes in rounded units, returned 153.3 ms at 8B where the check it
    learned from, 153.0 ms, fitted: a third step of the dry run, 4.7 s, for nothing). The solve after the first check
    is made to return a choice for less memory (more recompute) here, and the first choice is checked as solved from
    step one (no layers read alone before it: their solves would be made slower too)."""
    from optimum_memopt.backends.torch.decide.planner import BudgetPlanner

    fit, offered = BudgetPlanner._fit, []
    monkeypatch.setattr(BudgetPlanner, "_probed", lambda self, step, result: result)

    def slower(self, step, budget_bytes, corrections=None):
        if corrections is None:
            return fit(self, step, budget_bytes)
        found = fit(self, step, int(budget_bytes * 0.9), corrections)
        offered.append(found)
        return found

    monkeypatch.setattr(BudgetPlanner, "_fit", slower)
    low, high = recipes["level 1 + Loss+"].peak_bytes / MIB, recipes["eager"].peak_bytes / MIB
    budget = low + 6 * (high - low) / 15
    result = dry_run(SPEC, "auto", budget_mb=budget, kernels=CARD["kernels"])
    checks = result.auto["checks"]
    assert len(checks) == 1 and len(result.step_peaks) == 2, checks
    assert result.fit.config() == checks[0]["config"] and result.fit.predicted.peak_bytes <= budget * MIB
    assert offered and offered[0].choice is not None and offered[0].config() != checks[0]["config"]
    assert offered[0].recompute_seconds >= result.fit.recompute_seconds > 0


def test_a_dry_runs_first_choice_is_solved_with_its_layers_read_alone_as_the_check_then_reads_them(monkeypatch):
    """Before the first check, each configuration the first choice gives a layer is run alone in one layer of each
    structure (`BudgetPlanner._probed`, `RecomputeState.probe`), and what it held beyond the prediction is laid on
    those layers (`Corrections.own`), each configuration read once (the one step one ran there too): the check then reads the same in each layer's own segments, to 16 KiB, but the
    last layer's own forward, which read up to one hidden state (1 MiB here) more in the step than alone (the cause
    not found yet). A layer's backward alone is read with its other arguments held, as layers recomputed whole ahead
    of it hold them in a step: where none is (as here), the step reads one positions' storage less (8 KiB here).
    A 2-layer LoRA decoder with dropout, its width 512, 1,024 tokens, a dry run for a card."""
    from optimum_memopt.backends.torch.decide import budget as budget_module

    config = LlamaConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=1792, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024,
                         tie_word_embeddings=False)  # fmt: skip
    lora = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    spec = StepSpec(config, batch=1, seq=1024, dtype="bfloat16", autocast="bfloat16", lora=lora)
    learn, seen = budget_module.Corrections.learn, []

    def watched(self, predicted, measured, choice, levers):
        before = dict(self.own)
        learn(self, predicted, measured, choice, levers)
        seen.append((before, dict(self.own), [c.label for c in choice]))

    monkeypatch.setattr(budget_module.Corrections, "learn", watched)
    from optimum_memopt.backends.torch.apply.engine import RecomputeState

    probe, probed = RecomputeState.probe, []

    def counted(self, index, layer_policy):
        probed.append((index, layer_policy.mode, layer_policy.ops))
        return probe(self, index, layer_policy)

    monkeypatch.setattr(RecomputeState, "probe", counted)
    eager = dry_run(spec, backend=False, kernels=CARD["kernels"]).peak_bytes / MIB
    result = dry_run(spec, "auto", budget_mb=eager / 2, kernels=CARD["kernels"])
    (first, read, labels), *_ = seen
    assert result.fit.predicted.peak_bytes <= eager / 2 * MIB and any(label != "Layer+" for label in labels)
    compared = 0
    for i, label in enumerate(labels):
        for kind in ("forward", "backward"):
            alone, step = first.get((i, label, kind)), read[i, label, kind]
            assert alone is not None, (i, label, kind)  # every configuration of the choice was read alone first
            last_forward = i == len(labels) - 1 and kind == "forward"
            assert abs(step - alone) <= (MIB if last_forward else 0) + 16 * 1024, (i, label, kind, step - alone)
            compared += 1
    assert compared == 2 * len(labels)
    assert probed and len(probed) == len(set(probed)), probed  # each configuration read once
    probed.clear()  # a budget whose first choice recomputes every layer whole, as step one ran them: read once
    whole = dry_run(spec, "auto", budget_mb=eager * 0.35, kernels=CARD["kernels"])
    assert [c.label for c in whole.fit.choice] == ["Layer+", "Layer+"]
    assert sorted(probed) == [(0, "layer", frozenset()), (1, "layer", frozenset())], probed


def test_a_dry_run_without_autocast_reads_its_layers_alone_too(recipes, monkeypatch, caplog):
    """The layers read alone before the first check run as the step ran: in fp32 without autocast too (they once asked
    for an autocast of no dtype there, failed, and the first choice went to its check unread, said nowhere)."""
    from optimum_memopt.backends.torch.apply.engine import RecomputeState

    probe, read = RecomputeState.probe, []

    def counted(self, index, layer_policy):
        got = probe(self, index, layer_policy)
        read.append(got)
        return got

    monkeypatch.setattr(RecomputeState, "probe", counted)
    low, high = recipes["level 1 + Loss+"].peak_bytes / MIB, recipes["eager"].peak_bytes / MIB
    with caplog.at_level("WARNING", logger="optimum_memopt"):
        result = dry_run(SPEC, "auto", budget_mb=(low + high) / 2, **CARD)
    assert SPEC.autocast is None and result.fit.predicted.peak_bytes <= (low + high) / 2 * MIB
    assert read and all(got is not None and got[0] > 0 and got[1] > 0 for got in read), read
    assert not [r for r in caplog.records if "run alone" in r.getMessage()]


def test_the_start_benchmark_times_each_phase_of_the_dry_run(tmp_path):
    """benchmarks/dry_run_start.py at a tiny size: the phases it times add up within the dry run's seconds, one time a
    step, and the dry run it timed chose within the budget."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import dry_run_start

    out = tmp_path / "start.json"
    assert dry_run_start.main(["--tiny", "--budget_mb", "8", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["steps"] == len(run["steps_s"]) and run["checks"] >= 1 and run["peak_mb"] <= 8
    phases = run["built_s"] + run["order_forward_s"] + sum(run["steps_s"])
    assert 0 < phases <= run["seconds"] and 0 < run["planner_s"] < sum(run["steps_s"])


def test_a_layer_recomputed_whole_holds_its_input_which_no_other_policy_holds():
    """bf16 weights under bf16 autocast: each layer's norm saves an fp32 copy of its input, not the input, so only
    the whole layer's checkpoint holds the input through backward (`graph.whole_layer`, net of it). Every layer's
    kept bytes then predict the step where no layer's own forward or backward is: the head's segment of a step with
    op plans in every layer, from step one measured with every layer recomputed whole, to the byte (before, each
    layer's input was counted freed by every policy: the prediction stood that much above the step per layer)."""
    from optimum_memopt.backends.torch.decide.budget import freed_bytes
    from optimum_memopt.backends.torch.measure.graph import whole_layer
    from optimum_memopt.backends.torch.measure.profile import HEAD_PLACE
    from optimum_memopt.backends.torch.policy import LAYER, LayerPolicy, RecomputePolicy

    spec = StepSpec(CONFIG, batch=2, seq=128, dtype="bfloat16", autocast="bfloat16")
    measured = dry_run(spec, plans="Layer+:1:-1", **CARD)
    profile = measured.profile
    layer = profile.layers[1]
    graph = layer.graph
    assert graph.input >= 0 and graph.input not in graph.saved and graph.nodes[graph.input].nbytes == layer.input_bytes
    kept_copy = [graph.nodes[i] for i in graph.saved if graph.nodes[i].plan == "Cast"]
    assert kept_copy and all(n.nbytes == 2 * layer.input_bytes for n in kept_copy[:1])  # the norm's fp32 copy
    assert (
        whole_layer(graph, 0.0).freed_bytes
        == sum(graph.nodes[i].nbytes for i in graph.saved if graph.nodes[i].call >= 0 and not graph.nodes[i].boundary)
        - layer.input_bytes
    )

    plans = "MatMul+Mul+silu+:1:-1"
    ops = dry_run(spec, plans=plans, **CARD)
    n = len(profile.layers)
    q = freed_bytes(profile, RecomputePolicy([LayerPolicy(LAYER)] * n))
    f = freed_bytes(profile, RecomputePolicy([LayerPolicy.of_ops({"MatMul": "t", "Mul": "t", "silu": "t"})] * n))
    head = next(s for s in profile.memory.segments if s.place == HEAD_PLACE)
    real = next(s for s in ops.profile.memory.segments if s.place == HEAD_PLACE)
    # to the byte but the positions: step one's whole layers' checkpoints held the layers' other arguments, among them
    # the token positions (128 int64: one 1 KiB block, one storage for every layer), which a step of op plans lets go
    # of before its head (not modelled: the prediction stands that much above). Counting the inputs freed put it n
    # inputs (64 KiB here) above; weighing cuDNN attention's kept seed and offset at their own 8 bytes each, not a
    # 512-byte block, put it 1,008 bytes a layer below (the two once all but cancelled, 32 bytes apart)
    apart = head.peak_bytes + sum(q) - sum(f) - real.peak_bytes
    positions = block_bytes(spec.seq * torch.tensor([], dtype=torch.int64).element_size())
    assert apart == positions < n * layer.input_bytes, (head.peak_bytes, sum(q) - sum(f), real.peak_bytes)


def test_what_a_check_reads_corrects_the_next_choice_to_the_byte(recipes):
    """Each check is watched segment by segment (`BudgetPlanner._check_watch`) and what it reads beyond its
    prediction corrects the next solve (`budget.Corrections`: a configuration's own forward and backward, a segment
    the levers' options are weighed in by a bound), made for the budget itself. At eager's own peak the first
    choice, predicted from step one, recomputes a little and peaks below its prediction; the corrected solve then
    finds that the plain step fits, and its figure is the step's to the byte: two checks, no more (the search moved
    the budget by each check's reading before, and walked four checks at 8B)."""
    eager = recipes["eager"].peak_bytes
    result = dry_run(SPEC, "auto", budget_mb=eager / MIB, **CARD)
    checks = result.auto["checks"]
    assert len(checks) == 2 and checks[0]["predicted_peak_mb"] != checks[0]["measured_peak_mb"], checks
    assert checks[1]["predicted_peak_mb"] == checks[1]["measured_peak_mb"] == eager / MIB, checks
    assert result.fit.config() == "" and result.step_peaks[-1] == eager
