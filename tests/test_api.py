"""`optimum_memopt.optimize_memory`: the torch backend in a loop of one's own, without the Trainer. Plans train as
the same loop without it and report the Trainer's table; `auto` chooses from the loop's own steps (each backward
ends one, or `step_done`) and meets its budget; `remove` gives the plain model back; errors name the keyword.
`examples/custom_loop/train.py` (accelerate) is run as a user runs it."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import Tokens
from helpers import tiny_decoder as decoder

import optimum_memopt
from optimum_memopt import MemoptTrainer, MemoptTrainingArguments

pytestmark = pytest.mark.torch_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAIN = "MatMul+Mul+silu+:1:-1"


def ops(config):
    return sorted(config.split(":")[0].strip("+").split("+"))


@pytest.fixture(scope="session")
def plain_loop():
    """The losses of `loop` on a fresh tests' decoder without the plugin, for `steps` steps: each computed once a test
    run (a worker's), for the tests that hold a run with the plugin to it."""
    seen = {}

    def losses(steps=3):
        if steps not in seen:
            torch.manual_seed(0)
            seen[steps] = loop(decoder(), steps=steps)
        return seen[steps]

    return losses


def loop(model, steps=3, accumulate=1, handle=None, batch=8):
    """A plain training loop on the tests' decoder: AdamW, `accumulate` forwards per optimizer step; the losses."""
    data = Tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for i in range(steps * accumulate):
        rows = [data[(i * batch + j) % len(data)] for j in range(batch)]
        inputs = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        loss = model(**inputs, use_cache=False).loss  # as the Trainer runs it (no KV cache built in training)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()
            if handle is not None and accumulate > 1:
                handle.step_done()
    return losses


@pytest.mark.slow
def test_plans_train_as_the_plain_loop_and_report_the_trainers_table(tmp_path, plain_loop):
    plain = plain_loop()
    torch.manual_seed(0)
    model = decoder()
    memopt = optimum_memopt.optimize_memory(model, CHAIN)
    assert memopt.report() is None and "no training step has run" in memopt.table()
    assert loop(model, handle=memopt) == plain  # recompute is exact
    report = memopt.report()
    table = memopt.table()
    assert memopt.config == CHAIN and "PEAK DROP (B)" in table and table.startswith("Memory optimizer (torch) ON")
    chained = [p for p in report.plans if p.combination and ops(p.config) == ops(CHAIN)]
    assert len(chained) == 1 and chained[0].enabled and f"ON     {chained[0].config}" in table
    # the single plans' rows (the sets offered together depend on the ops' timings as well)
    mine = {p.config: (p.frequency, p.saving_bytes, p.enabled) for p in report.plans if not p.combination}
    # the head's rows are measured only where `Loss+` or `auto` was asked (measuring runs the head between steps,
    # above what the step holds then): said
    assert not [p for p in report.plans if p.config.startswith("Loss+")]
    assert any("they are measured where `Loss+` or `--memory_opt_config auto`" in n for n in report.notes)

    args = MemoptTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=8, report_to="none",
        save_strategy="no", memory_opt_backend="torch", memory_opt_config=CHAIN,
    )  # fmt: skip
    trainer = MemoptTrainer(model=decoder(), args=args, train_dataset=Tokens())
    trainer.train()
    theirs = trainer.memopt_handle.report().plans
    theirs = {
        p.config: (p.frequency, p.saving_bytes, p.enabled)
        for p in theirs
        if not p.combination and not p.config.startswith("Loss+")
    }
    assert mine == theirs  # the same table through the Trainer (the bytes are the graphs', the same batch shape)


@pytest.mark.slow
def test_auto_chooses_from_a_loops_own_steps_and_meets_the_budget(tmp_path, plain_loop):
    """Each backward ends a step: step one measures, step two runs the choice, step three's start checks it. Step one
    runs the head's loss in chunks too (the least memory); a loop that does not report its steps has no place to
    measure the head's other ways, so the head stays as step one ran it (said in the choice), and the losses are the
    plain loop's to 1e-6 (the chunks sum the loss in another order)."""
    loop(decoder(), steps=1)  # the process's first training keeps what the libraries allocate once
    said = []
    roomy = optimum_memopt.optimize_memory(decoder(), "auto", budget_mb=10**6, say=said.append)
    loop(roomy.model, steps=3)
    eager = roomy.auto["measured_peak_mb"]
    assert roomy.config == "Loss+:1:-1" and roomy.auto["choices"] == 1 and len(said) == 2

    plain = plain_loop(steps=4)
    torch.manual_seed(0)
    model = decoder()
    budget = round(eager * 0.8, 1)
    memopt = optimum_memopt.optimize_memory(model, "auto", budget_mb=budget, output_dir=str(tmp_path))
    assert memopt.config is None  # nothing chosen before step two
    losses = loop(model, steps=4)
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses, plain)), (losses, plain)
    choice = memopt.auto
    assert memopt.config == choice["config"] and choice["config"] not in ("Loss+:1:-1", None)
    assert choice["predicted_peak_mb"] <= budget and choice["measured_peak_mb"] <= budget, choice
    assert all(check["measured_peak_mb"] <= budget for check in choice["checks"]), choice  # every step after one
    with open(tmp_path / "solver.json") as f:
        data = json.load(f)
    assert data["fits"][-1]["config"] == choice["config"]
    figure = memopt.picture(str(tmp_path / "step_memory.png"))
    assert (tmp_path / "step_memory.png").is_file()
    assert [b.get_height() for b in figure.axes[0].patches] == [s["peak_mb"] for s in data["memory"]["segments"]]


def test_auto_stops_a_loop_in_the_calls_own_words():
    """Where no choice fits, `auto` stops the loop before step two with what the least recompute reaches, naming
    the call's keywords (`budget_mb=1`), not the Trainer's flags (`--memory_budget_mb 1`)."""
    memopt = optimum_memopt.optimize_memory(decoder(), "auto", budget_mb=1, say=lambda text: None)
    with pytest.raises(RuntimeError) as e:
        loop(memopt.model, steps=2)
    text = str(e.value)
    assert "found nothing that fits `budget_mb=1`" in text and "The least any recompute reaches is" in text, text
    assert "--memory" not in text and "--per_device" not in text, text
    # the levers this loop could not measure (it does not report its steps), said with how to have them measured
    assert "the loop does not say where its steps end: `optimize_memory(..., reports_steps=True)`" in text, text


def test_autos_step_one_recomputes_every_layer_whole_as_the_trainers_does():
    """Through `optimize_memory` as through the Trainer: step one runs the least memory any choice needs (it ran the
    layers as they were before: a loop that only fitted with recompute ran out of memory at step one)."""
    memopt = optimum_memopt.optimize_memory(decoder(), "auto", budget_mb=10**6, say=lambda text: None)
    assert [p.mode for p in memopt.policy.layers] == ["layer"] * len(memopt.layers)
    loop(memopt.model, steps=1)
    assert memopt.profile is not None and memopt.auto is None


@pytest.mark.slow
def test_under_gradient_accumulation_the_loop_says_where_steps_end():
    """With `reports_steps=True` and `step_done` after each optimizer step, two forwards make one step: the choice
    is made at the third forward (the second step's start), not the second."""
    memopt = optimum_memopt.optimize_memory(
        decoder(), "auto", budget_mb=10**6, reports_steps=True, say=lambda text: None
    )
    loop(memopt.model, steps=1, accumulate=2, handle=memopt)
    assert memopt.auto is None and memopt.solver_figures() is None  # two forwards, one step: still in step one
    loop(memopt.model, steps=1, accumulate=2, handle=memopt)
    assert memopt.auto["choices"] == 1 and memopt.auto["measured_peak_mb"] is None  # chosen, not yet checked


def random_token_steps(model, loss_of, vocab, shape, handle=None, steps=3):
    """`steps` plain AdamW steps of `model` on random tokens of `shape` (`loss_of(model, ids)` the loss), telling
    `handle` each step's end; the losses. Seeded by the caller."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, shape)
        loss = loss_of(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if handle is not None:
            handle.step_done()
    return losses


class SequentialGPT(torch.nn.Module):
    """A GPT written in plain PyTorch whose blocks sit in an `nn.Sequential` (nanoGPT-like scripts, timm's stages):
    each block a residual attention and MLP."""

    class Block(torch.nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.attend = torch.nn.MultiheadAttention(width, 4, batch_first=True)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
            )

        def forward(self, x):
            h = self.norm(x)
            x = x + self.attend(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.norm(x))

    def __init__(self, vocab=64, width=32, layers=3):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*[self.Block(width) for _ in range(layers)])
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.blocks(self.embed(ids)))


@pytest.mark.parametrize("plans, level", [(None, 1), ("Gelu+:1:-1", 0)])
def test_blocks_in_an_nn_sequential_are_found_and_train_as_plain(plans, level):
    def train(handle_of):
        torch.manual_seed(0)
        model = SequentialGPT()
        handle = handle_of(model)
        next_token = lambda m, ids: torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())  # noqa: E731
        return random_token_steps(model, next_token, 64, (4, 16), handle), handle

    plain, _ = train(lambda model: None)
    got, handle = train(lambda model: optimum_memopt.optimize_memory(model, plans, level=level, reports_steps=True))
    assert got == plain
    assert len(handle.layers) == 3 and all(type(layer).__name__ == "Block" for layer in handle.layers)
    assert handle.report().dims["layers"] == 3


def gemma3_with_its_vision_tower():
    """Gemma 3 as `AutoModelForCausalLM` builds it (`Gemma3ForConditionalGeneration`), tiny: its layer list starts with
    the vision tower's two `SiglipEncoderLayer`s, which a text-only step never runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma3")
    text, vision = config.text_config, config.vision_config
    text.num_hidden_layers, text.hidden_size, text.intermediate_size, text.vocab_size = 2, 64, 128, 300
    text.num_attention_heads, text.num_key_value_heads, text.head_dim = 2, 1, 32
    vision.num_hidden_layers, vision.hidden_size, vision.intermediate_size, vision.num_attention_heads = 2, 64, 128, 2
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.slow
def test_a_layer_list_whose_first_layers_never_run_is_measured_over_the_layers_that_ran(caplog):
    """Gemma 3 on text alone runs its language layers (2, 3), not its vision tower's (0, 1). Before, `auto` trained
    without a choice and said nothing, then stopped; plans made no table. A loop of one's own gives `auto` no dry run
    to see it before step one: after three steps that ran the same layers (LayerDrop skips a first layer now and
    then) it says so, and the next step is measured over them as step one: `auto` chooses among them, and plans get
    their table."""

    def train(handle_of, steps=6):
        model = gemma3_with_its_vision_tower()
        handle = handle_of(model)
        causal = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
        torch.manual_seed(0)
        return random_token_steps(model, causal, 300, (2, 16), handle, steps=steps), handle

    plain, _ = train(lambda model: None)
    said = (
        "the layer list's first layer (SiglipEncoderLayer, layer 0 of 4) did not run in the first 3 training steps; "
        "layers 2, 3 (Gemma3DecoderLayer) did"
    )
    with caplog.at_level("WARNING", logger="optimum_memopt"):
        got, auto = train(
            lambda model: optimum_memopt.optimize_memory(model, "auto", budget_mb=10**6, reports_steps=True)
        )
    warned = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert len(warned) == 1, warned
    assert (
        "The next step is measured over those as step one (the plan table and `auto`'s choice count them)"
        in (warned[0])
    )
    assert auto.auto is not None and auto.auto["choices"] == 1, auto.auto  # measured at step 4, chosen at step 5
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, plain)), (got, plain)
    caplog.clear()
    with caplog.at_level("WARNING", logger="optimum_memopt"):
        got, plans = train(lambda model: optimum_memopt.optimize_memory(model, "Layer+:1:-1@2+3", reports_steps=True))
    assert got == plain
    report = plans.report()  # made from step 4, over the layers that ran
    assert report is not None and report.plans and report.peak, report
    assert [r.getMessage() for r in caplog.records if said in r.getMessage()] and "(the plan table counts them)" in (
        caplog.records[-1].getMessage()
    )


class OutOfOrder(torch.nn.Module):
    """Three blocks in an `nn.ModuleList`, run as `order` says: backwards (as BLT runs the patchers it lists after
    the layers they feed), or with one again (as HRM runs its layers in cycles)."""

    def __init__(self, order):
        super().__init__()
        self.order = order
        self.embed = torch.nn.Embedding(64, 32)
        self.layers = torch.nn.ModuleList(SequentialGPT.Block(32) for _ in range(3))
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids):
        x = self.embed(ids)
        for k in self.order:
            x = self.layers[k](x)
        return self.head(x)


@pytest.mark.parametrize(
    "order, said",
    [
        ([2, 1, 0], "runs layer 1 (Block) after layer 2 (Block), against the order the layer list holds them in"),
        ([0, 1, 2, 1, 2], "runs layers 1 (Block), 2 (Block) several times each (5 layer forwards for 3 layers)"),
    ],
)
def test_auto_refuses_a_step_that_runs_its_layers_out_of_order_or_again(order, said):
    """Step one is measured layer by layer, in the list's order, once each: such a step is said to be out of reach
    after step one (a loop of one's own gives no dry run before it), with whole layers as the way out; whole layers
    train as plain."""
    next_token = lambda m, ids: torch.nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten())  # noqa: E731
    torch.manual_seed(0)
    model = OutOfOrder(order)
    handle = optimum_memopt.optimize_memory(model, "auto", budget_mb=10**6, reports_steps=True)
    with pytest.raises(RuntimeError) as e:
        random_token_steps(model, next_token, 64, (2, 8), handle)
    assert f"`plans='auto'` measures step one layer by layer, but a step of OutOfOrder {said}" in str(e.value)
    assert str(e.value).endswith("Recompute whole layers instead (`level=1`)"), str(e.value)

    def run(handle_of):
        torch.manual_seed(0)
        model = OutOfOrder(order)
        return random_token_steps(model, next_token, 64, (2, 8), handle_of(model))

    assert run(lambda model: optimum_memopt.optimize_memory(model, None, level=1, reports_steps=True)) == run(
        lambda model: None
    )


def test_remove_gives_the_plain_model_back(plain_loop):
    plain = plain_loop()
    torch.manual_seed(0)
    model = decoder()
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    with optimum_memopt.optimize_memory(model, "Layer+:1:-1@0") as memopt:
        assert len(model._forward_pre_hooks) > hooks[0]
    assert memopt.model is model and not hasattr(model, "_memopt_recompute")
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
    assert all("forward" not in vars(layer) for layer in model.model.layers)  # the class's forward again
    assert loop(model) == plain


def samplers() -> int:
    import threading

    return sum(t.name == "memopt-peak-sampler" and t.is_alive() for t in threading.enumerate())


@pytest.mark.slow
def test_remove_after_auto_takes_off_the_loss_lever_and_the_meters(plain_loop):
    """`auto` installs the loss lever on the head (step one runs it in chunks) and meters with sampler threads: all
    of it goes with `remove`, and the model trains as it did before the plugin."""
    plain = plain_loop()
    torch.manual_seed(0)
    model = decoder()
    before = samplers()
    memopt = optimum_memopt.optimize_memory(model, "auto", budget_mb=100000, reports_steps=False)
    loop(memopt.model, steps=3)
    assert memopt.levers["loss"].calls == 3 and "forward" in vars(model)
    # the head's ways are measured between steps, which a loop that does not report them has no place for: said
    assert any("the loop does not say where its steps end" in n for n in memopt.report().notes)
    memopt.remove()
    assert {"forward", "_memopt_loss_lever", "_memopt_loss_forward", "_memopt_recompute"}.isdisjoint(vars(model))
    assert samplers() == before
    torch.manual_seed(0)
    model.load_state_dict(decoder().state_dict())
    assert loop(model) == plain


def test_a_second_wrap_takes_the_first_ones_levers_off():
    """A second `optimize_memory` on a model the first one left on (no `remove`): the first wrap's loss lever runs no
    more (before, it kept chunking with the first choice, and the second wrap refused `Loss+` or could not measure
    the head), its meters are closed, and the second wrap's `Loss+` runs every step."""
    torch.manual_seed(0)
    model = decoder()
    before = samplers()
    first = optimum_memopt.optimize_memory(model, "auto", budget_mb=100000, reports_steps=False)
    loop(first.model, steps=3)
    old = first.levers["loss"]
    second = optimum_memopt.optimize_memory(model, "Layer+:1:-1@0,Loss+:1:-1@chunks4")
    first.remove()  # a stale handle leaves the later wrap on
    loop(second.model, steps=2)
    assert not old.installed and old.calls == 3
    lever = second.levers["loss"]
    assert lever.calls == 2 and lever.last["chunks"] == 4
    second.remove()
    assert "forward" not in vars(model) and samplers() == before


@pytest.mark.parametrize(
    "kwargs, said",
    [
        ({"plans": "auto"}, "`plans='auto'` needs a budget: add `budget_mb`, as in `plans='auto', budget_mb=4000`"),
        ({"plans": CHAIN, "budget_mb": 100}, "`budget_mb=100` is only used by `plans='auto'`"),
        ({"plans": "Gelu+:x"}, "'Gelu+:x' has 2 ':'-separated field(s); expected 3"),
        ({"plans": "auto", "budget_mb": -5}, "`budget_mb` is -5; expected a positive, finite number of MiB"),
        ({"level": 2}, "level"),
    ],
)
def test_bad_arguments_are_refused_naming_the_keyword(kwargs, said):
    model = decoder()
    with pytest.raises(ValueError) as e:
        optimum_memopt.optimize_memory(model, **kwargs)
    assert said in str(e.value) and "--memory_opt_config" not in str(e.value), str(e.value)
    assert not hasattr(model, "_memopt_recompute")


def run_example(out, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script = os.path.join(ROOT, "examples", "custom_loop", "train.py")
    tiny = ["--steps", "4", "--offline_lines", "300", "--block_size", "64", "--output_dir", str(out)]
    res = subprocess.run([sys.executable, script, *tiny, *flags], capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(out / "losses.json") as f:
        return json.load(f), res.stdout


@pytest.mark.slow
def test_the_custom_loop_example_trains_as_without_the_plugin(tmp_path):
    """examples/custom_loop (accelerate) with a chained plan, and with `auto`: the losses of `--plans none`, the
    plan table printed, `auto`'s choice within its budget."""
    plain, _ = run_example(tmp_path / "none", "--plans", "none")
    chain, out = run_example(tmp_path / "chain", "--plans", CHAIN)
    assert chain["losses"] == plain["losses"] and chain["config"] == CHAIN
    assert "Memory optimizer (torch) ON" in out
    assert any(ops(p["config"]) == ops(CHAIN) and p["enabled"] and p["combination"] for p in chain["plans"])
    auto, out = run_example(tmp_path / "auto", "--plans", "auto", "--activation_budget", "0.5")
    assert auto["losses"] == plain["losses"] and auto["config"] and auto["auto"]["choices"] >= 1
    assert "the solver chose `plans=" in out
