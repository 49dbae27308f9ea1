"""The tiled MLP lever (`MLP+`, `backends/torch/levers/mlp/`): a decoder layer's MLP over tiles of tokens, each
tile's intermediates made again in backward. On gated and plain MLPs of six families it trains as the plain model
(the loss bitwise, the gradients to the weights' summation order), alone, inside whole-layer recompute and beside op
plans in the same layer, with dropout in the MLP; it is refused with the reason on a mixture of experts; it comes
off whole; its rows are measured; `auto` weighs it, and chooses it where only tiles fit."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import optimum_memopt
from optimum_memopt.backends.torch.levers import mlp
from optimum_memopt.backends.torch.levers.mlp import default_tiles, mlp_of, parse, tiled
from optimum_memopt.plans import PlanReport

pytestmark = pytest.mark.torch_backend

VOCAB, SEQ = 128, 64
SMALL = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=112, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=SEQ, n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, n_inner=112,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attention_dropout=0.0, hidden_dropout=0.0, tie_word_embeddings=False,
    use_cache=False, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
FAMILIES = ["llama", "gpt2", "phi3", "gpt_neox", "gemma", "qwen2"]


def model_of(kind: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(kind, **{**SMALL, **changes})
    config._attn_implementation = "eager"
    return AutoModelForCausalLM.from_config(config)


def run(kind: str, plans, steps: int = 2, **changes):
    """Losses and the first step's gradients of `kind` trained `steps` SGD steps with `plans` (None: plain)."""
    model = model_of(kind, **changes)
    model.train()
    handle = optimum_memopt.optimize_memory(model, plans, reports_steps=True) if plans else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)  # the dropout masks' stream, the same in every run
    losses, grads = [], None
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.step_done()
    return losses, grads, model, handle


def same_training(plain, ours, exact_first: bool = True):
    (pl, pg, *_), (ol, og, *_) = plain, ours
    if exact_first:
        assert torch.equal(pl[0], ol[0]), (pl, ol)  # the first forward: bitwise (the MLP is row-wise)
    assert pg.keys() == og.keys()
    for name in pg:
        torch.testing.assert_close(og[name], pg[name], rtol=1e-5, atol=1e-6, msg=name)
    for a, b in zip(pl, ol):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_tiled_mlp_trains_as_the_plain_model(kind):
    plain = run(kind, None)
    ours = run(kind, "MLP+:1:-1@tiles4")
    same_training(plain, ours)
    handle = ours[3]
    lever = handle.levers["mlp"]
    assert [lever.tiles_at(i) for i in range(2)] == [4, 4] and str(handle.policy.levers["mlp"]) == "tiles4"


def test_a_tiled_mlp_is_exact_row_by_row():
    """One MLP, whole and in tiles: the output and the input's gradient bitwise, the weights' to summation order."""
    model = model_of("llama")
    mlp, _ = mlp_of(model.model.layers[0])
    x = torch.randn(2, 48, 32, requires_grad=True)
    y = mlp(x)
    y.backward(torch.ones_like(y))
    gx, gw = x.grad.clone(), [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()
    y2 = tiled(mlp.forward, x, 5)  # 96 tokens in 5 uneven tiles
    assert torch.equal(y, y2)
    y2.backward(torch.ones_like(y2))
    assert torch.equal(gx, x.grad)
    for a, p in zip(gw, mlp.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-6)
    assert default_tiles(mlp) == 4  # 112 / 32, rounded up


@pytest.mark.parametrize(
    "plans", ["Layer+:1:-1,MLP+:1:-1@tiles4", "Layer+:1:-1@0,MLP+:1:-1@0-1:tiles2", "Mul+:1:-1,MLP+:1:-1@1:tiles4"]
)
def test_the_tiled_mlp_runs_inside_whole_layer_recompute_and_beside_op_plans(plans):
    """Nested in a layer checkpointed whole (the recompute brings the layer back but the MLP's tiles, made one at a
    time in its backward), and in a layer whose other ops' outputs the engine recomputes from recipes."""
    same_training(run("llama", None), run("llama", plans))


def test_dropout_in_a_tiled_mlp_draws_the_plain_runs_masks():
    """GPT-2's MLP ends in a dropout: tiles draw their masks in tokens' order, each restored for its recompute; on
    the CPU the masks are the plain run's (the run trains as the plain one)."""
    plain = run("gpt2", None, resid_pdrop=0.1)
    ours = run("gpt2", "MLP+:1:-1@tiles4", resid_pdrop=0.1)
    same_training(plain, ours)


def test_the_tiled_mlp_comes_off_whole():
    model = model_of("llama")
    ids = torch.randint(0, VOCAB, (2, SEQ))
    before = model(input_ids=ids, labels=ids).loss
    handle = optimum_memopt.optimize_memory(model, "MLP+:1:-1@tiles2")
    mlps = [layer.mlp for layer in model.model.layers]
    assert all("forward" in vars(m) for m in mlps)
    handle.remove()
    assert not any("forward" in vars(m) or "_memopt_mlp_tiles" in vars(m) for m in mlps)
    assert torch.equal(model(input_ids=ids, labels=ids).loss, before)


def test_a_mixture_of_experts_is_refused_with_the_reason():
    model = model_of(
        "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1
    )
    with pytest.raises(ValueError, match=r"'MLP\+:1:-1'.*layer 0 cannot be tiled: .*mixture of experts"):
        optimum_memopt.optimize_memory(model, "MLP+:1:-1")


def test_after_a_step_in_tiles_every_layer_run_otherwise_stays_recomputed_and_only_counts_run_are_offered():
    """A step measured with an MLP in tiles kept only the tiles' inputs: an option running that layer's MLP whole
    again keeps the layer recomputed whole (kept, it would hold the MLP's intermediates from its forward to its
    backward, which no stretch of the step measured gives). Where the whole MLP was not run alone (after a step with
    every MLP in tiles its bound did not fit what the step's peak left free), no option runs any layer whole."""

    def step(plans):
        model = model_of("llama")
        handle = optimum_memopt.optimize_memory(model, plans, reports_steps=True)
        ids = torch.randint(0, VOCAB, (2, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()
        handle.step_done()
        return handle.levers["mlp"], handle.profile

    lever, profile = step("Layer+:1:-1,MLP+:1:-1@0:tiles2")  # layer 1's MLP whole: room to run it whole alone
    assert 1 in profile.levers["mlp"].options
    options = {c.option: c for c in lever.choices(profile)}
    assert options[None].recomputed == (0,)  # layer 0 whole again: recomputed whole still
    for c in options.values():
        assert set(c.recomputed) == {0} | set(mlp.parse(c.option, 2) if c.option else ()), c

    lever, profile = step("Layer+:1:-1,MLP+:1:-1@tiles2")
    assert 1 not in profile.levers["mlp"].options, profile.levers["mlp"].why_not
    offered = lever.choices(profile)
    assert len(offered) > 1 and all(set(mlp.parse(c.option, 2)) == {0, 1} for c in offered), offered


def test_which_draws_tiles_keep():
    """Tiles draw the whole MLP's masks where it draws none, or once on the CPU (element by element, in tokens'
    order); never where it draws several times, nor on a GPU, which a dry run's fake tensors stand for."""
    from optimum_memopt.backends.torch.levers.mlp import MLPMeasure, exact_draws

    assert [exact_draws(0, "cuda"), exact_draws(1, "cpu"), exact_draws(1, "cuda"), exact_draws(3, "cpu")] == [
        True, True, False, False,
    ]  # fmt: skip
    assert MLPMeasure(64, 32, {}, draws=1).draws_as_whole()
    assert not MLPMeasure(64, 32, {}, draws=1, fake=True).draws_as_whole()
    assert MLPMeasure(64, 32, {}, draws=0, fake=True).draws_as_whole()


def test_an_mlp_taking_more_than_the_hidden_states_is_refused_with_the_reason():
    """RWKV's feed-forward takes a state and shifts tokens: not row-wise, never tiled."""
    from torch import nn

    class Stateful(nn.Module):
        def forward(self, hidden, state=None):
            return hidden, state

    layer = nn.Module()
    layer.feed_forward = Stateful()
    found, why = mlp_of(layer)
    assert found is None and "takes more than the hidden states (`state`)" in why, why


def test_the_tiling_grammar():
    from optimum_memopt.backends.torch.policy import RecomputePolicy
    from optimum_memopt.plans import LeverOption, LeverPart, PlanError, parse_inline, parse_plans

    # the entries' layers and tile counts, as data; `option_of` writes a tiling back as the same option
    option = RecomputePolicy.from_plans(parse_plans("MLP+:1:-1@0-1:tiles4,MLP+:1:-1@3"), 0, 4).levers["mlp"]
    assert option == LeverOption((LeverPart((0, 1), "tiles", 4), LeverPart((3,))))
    assert str(option) == "0-1:tiles4;3" and parse(option, 4) == {0: 4, 1: 4, 3: None}
    assert mlp.option_of(parse(option, 4), 4) == option and parse(LeverOption(), 2) == {0: None, 1: None}
    assert mlp.option_of({0: 2, 1: 2}, 2) == LeverOption((LeverPart(None, "tiles", 2),))
    assert str(parse_inline("mlp+:1:-1@0-7:Tiles4")[0]) == "MLP+:1:-1@0-7:tiles4"
    with pytest.raises(PlanError, match=r"tiling 'tokens1024'; expected 'tilesN' \(N tiles of tokens\)"):
        parse_inline("MLP+:1:-1@tokens1024")


def test_its_rows_are_measured_after_step_one():
    _, _, _, handle = run("llama", "Layer+:1:-1,MLP+:1:-1@tiles2", steps=2)
    report = handle.report()
    rows = {p.config: p for p in report.plans if p.config.startswith("MLP+")}
    assert "MLP+:1:-1@tiles2" in rows and rows["MLP+:1:-1@tiles2"].enabled
    assert rows["MLP+:1:-1@tiles2"].saving_bytes > 0  # one tile's intermediates at a time
    assert any(n.startswith("the layers' MLPs (`MLP+` rows)") for n in report.notes), report.notes
    assert "MLP+:1:-1@tiles2" in report.requested
    # the rows are the MLP lever's: neither the layers' kept bytes nor the head's saving count them
    assert all(p.lever == "mlp" for p in rows.values())
    without = PlanReport.from_dict(
        {**report.to_dict(), "plans": [p for p in report.to_dict()["plans"] if not p["lever"]]}
    )
    assert report.head_saving_mb() == 0.0 and report.saving_mb(enabled_only=True) == without.saving_mb(True) > 0
    # a report written when every lever's row said `head` is read with each row's own lever
    old = report.to_dict()
    for row in old["plans"]:
        row["head"] = bool(row.pop("lever"))
    again = PlanReport.from_dict(old)
    assert [p.lever for p in again.plans] == [p.lever for p in report.plans] and again.head_saving_mb() == 0.0


def _lora_run(plans, dropout: float, caplog=None):
    """PEFT's LoRA on the MLP's three projections (its B matrices drawn, not zero: the LoRA path counts from the
    first step), trained 3 SGD steps; the losses and the handle."""
    from peft import LoraConfig, get_peft_model

    model = model_of("llama")
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, config)
    init = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=init) * 0.1)
    model.train()
    handle = optimum_memopt.optimize_memory(model, plans, reports_steps=True) if plans else None
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    losses = []
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.step_done()
    return losses, handle, model


def test_a_lora_on_the_mlp_trains_as_the_plain_peft_model():
    """PEFT's LoRA on the MLP's three projections, without dropout: the tiled MLP trains as the plain PEFT run."""
    plain, _, _ = _lora_run(None, 0.0)
    tiled_losses, handle, _ = _lora_run("Layer+:1:-1@0,MLP+:1:-1@tiles4", 0.0)
    assert torch.equal(plain[0], tiled_losses[0])
    torch.testing.assert_close(tiled_losses, plain, rtol=1e-5, atol=1e-6)
    assert handle.levers["mlp"].tiles_at(1) == 4


def test_an_mlp_drawing_several_times_is_said_to_train_another_draw_and_auto_never_tiles_it(caplog):
    """LoRA's dropout on each of the MLP's three projections: tile by tile, the three draws interleave, so the tiles'
    masks are not the whole MLP's. Asked for by hand, the tiles run and the first tiled forward says the run is
    another draw (the losses differ from the plain run's: the truth, not hidden); the MLP measured after step one
    counts three draws a forward, and `auto` offers no tiling of it (the table's notes say why)."""
    import logging

    plain, _, _ = _lora_run(None, 0.1)
    with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
        tiled_losses, handle, model = _lora_run("Layer+:1:-1,MLP+:1:-1@tiles4", 0.1)
    said = [r.getMessage() for r in caplog.records if "draws at random" in r.getMessage()]
    assert len(said) == 2 and "draws at random 3 time(s) a forward" in said[0], said  # once per layer's MLP
    assert not torch.equal(plain[0], tiled_losses[0])  # the masks differ, as said
    lever = handle.levers["mlp"]
    profile = handle.profile
    assert profile.levers["mlp"].draws == 3
    assert [c.option for c in lever.choices(profile)] == [lever.option]  # only what runs: nothing else offered
    assert any("`auto` does not tile the MLPs: one draws at random 3 time(s)" in n for n in handle.report().notes)


def test_entries_on_layers_apart_give_each_its_own_tile_count():
    model = model_of("llama")
    handle = optimum_memopt.optimize_memory(model, "MLP+:1:-1@0:tiles2,MLP+:1:-1@1:tiles4", reports_steps=True)
    lever = handle.levers["mlp"]
    assert (lever.tiles_at(0), lever.tiles_at(1)) == (2, 4) and str(handle.policy.levers["mlp"]) == "0:tiles2;1:tiles4"
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (2, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()
        handle.step_done()
    report = handle.report()
    assert "MLP+:1:-1@0:tiles2" in report.requested and "MLP+:1:-1@1:tiles4" in report.requested
    rows = {p.config: p for p in report.plans if p.config.startswith("MLP+")}
    assert (rows["MLP+:1:-1@tiles2"].applied_count, rows["MLP+:1:-1@tiles4"].applied_count) == (1, 1)  # 1 of 2 each
    assert rows["MLP+:1:-1@tiles2"].enabled and not rows["MLP+:1:-1@tiles8"].enabled


def _auto_run(budget_mb: float, steps: int = 3):
    """A Llama-shaped decoder whose MLP holds most of a layer (intermediate 7x hidden), 1,024 tokens, trained in a
    loop of one's own under `auto` (step one measured with every layer recomputed whole)."""
    model = model_of(
        "llama", hidden_size=32, intermediate_size=224, max_position_embeddings=1024, num_attention_heads=2
    )
    model.config._attn_implementation = "sdpa"
    model.train()
    handle = optimum_memopt.optimize_memory(model, "auto", budget_mb=budget_mb, reports_steps=True, say=lambda s: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (1, 1024), generator=data)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        handle.step_done()
    state = getattr(model, "_memopt_recompute")
    return handle, state.planner, state.profile


@pytest.mark.slow
def test_auto_tiles_the_mlp_where_only_tiles_fit_and_its_prediction_holds():
    """`auto` weighs the tiled MLP beside the layers' recompute and the head's chunks: step one's layers are read in
    the stretches their MLP runs in (`Segment.parts`), and each tiling moves those by what one MLP held less,
    measured alone. Under a budget between the least peak without tiles and the least with them, it tiles the MLPs,
    and the step after its choice peaks as predicted, under the budget."""
    from optimum_memopt.backends.torch.decide.budget import fit

    _, planner, profile = _auto_run(10_000.0)  # a budget anything fits: step one and the levers' options, measured
    layers = [seg for seg in planner.solved.segments if seg.name.startswith("layer")]
    assert all(seg.parts and max(p for _, p in seg.parts) == seg.peak_bytes for seg in layers)
    assert {tag for seg in layers for tag, _ in seg.parts} >= {"mlp forward", "mlp backward", "after mlp backward"}
    loss, mlp = planner.levers["loss"], planner.levers["mlp"]
    assert any(c.option for c in mlp) and all(c.recomputed for c in mlp if c.option)

    def floor(options) -> float:
        solved = fit(profile, planner.solved, 0, planner.measured_policy, 0, planner.per_layer,
                     [loss, options])  # fmt: skip
        return solved.floor.peak_mb

    untiled, tiled_floor = floor([c for c in mlp if c.option is None]), floor(mlp)
    assert tiled_floor < untiled - 0.5, (tiled_floor, untiled)
    budget = (tiled_floor + untiled) / 2

    handle, planner, _ = _auto_run(budget)
    choice = planner.fits[-1]
    assert choice.lever("mlp").option, choice.config()  # tiles: nothing fits without them
    check = planner.verified[-1]
    assert check["measured_peak_mb"] <= budget
    # where the model's own head is chosen, its logits are counted as a caller's through the step: this loop drops
    # `outputs` before backward, so it peaks lower by them (which head the solver picks rests on the CPU's clock)
    dropped = check["predicted_peak_mb"] - check.get("returned_mb", 0.0)
    assert (check.get("returned_mb", 0.0) > 0) == (choice.lever("loss").option is None), (check, choice.config())
    assert abs(check["measured_peak_mb"] - dropped) <= 0.01 * dropped, check
    assert handle.levers["mlp"].option == choice.lever("mlp").option  # it runs what was chosen
    tiled_layers = choice.lever("mlp").recomputed
    assert "MLP+" in choice.config() and all(choice.choice[i].whole for i in tiled_layers)  # tiles in whole layers


@pytest.mark.parametrize("autocast", [False, True])
def test_the_mlp_is_run_alone_only_where_its_bound_fits_what_step_one_left_free(autocast):
    """Each tile count is run alone after step one only where its bound by the shapes fits under step one's peak
    (a whole MLP at long sequence is more than a tiled step holds: run between steps, it would not fit on a device
    where the tiled step does). The bound holds what each count held, under autocast too (the MLP is run in step
    one's autocast, as the step runs it); with no room, nothing is run and the reason is said."""
    import dataclasses

    from optimum_memopt.backends.torch.levers.mlp import measure

    model = model_of("llama")
    # layer 1's MLP runs whole: step one holds it, and every count fits what the step's peak leaves free
    handle = optimum_memopt.optimize_memory(model, "Layer+:1:-1,MLP+:1:-1@0:tiles2", reports_steps=True)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(input_ids=ids, labels=ids).loss.backward()
    handle.step_done()
    state = getattr(model, "_memopt_recompute")
    assert state.profile.autocast == ("bfloat16" if autocast else None)
    measured = state.profile.levers["mlp"]
    assert set(measured.options) == {1, 2, 4, 8} and not measured.why_not, measured.why_not
    for count, option in measured.options.items():
        assert 0 < option.held_bytes <= option.bound_bytes, (count, option)
    whole, tiles = measured.options[1], measured.options[4]
    assert tiles.held_bytes < whole.held_bytes and tiles.checkpointed_bytes < whole.checkpointed_bytes

    lever = handle.levers["mlp"]
    memory = state.profile.memory
    tight = dataclasses.replace(
        state.profile, memory=dataclasses.replace(memory, segments=[s.shifted(-s.peak_bytes) for s in memory.segments])
    )
    why = measure(lever, tight)
    assert isinstance(why, str) and "step one's peak left 0.0 MiB free" in why, why
