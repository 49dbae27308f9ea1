"""The plugin changes memory and nothing else: with dropout in the attention and in a LoRA adapter, a run with plans,
with level 1, with the loss lever and with `auto` draws every dropout mask the run without the plugin draws, so it
trains as that run (bitwise where its plans are exact; with the head's loss in several chunks, to the summation
order's roundings). Whatever the backend measures between steps (the head's ways, after step one) draws nothing from
the process's random streams."""

import pytest
import torch
from helpers import CausalData, LossRecordingTrainer, make_args
from transformers import LlamaConfig, LlamaForCausalLM

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.torch_backend

STEPS = 10
DROPOUT = 0.1


def model_with_dropout(lora: bool):
    """A tiny Llama with attention dropout; with `lora`, a LoRA adapter on every projection with its own dropout."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, attention_dropout=DROPOUT,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    if not lora:
        return model
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=DROPOUT, target_modules=targets, task_type="CAUSAL_LM")
    return peft.get_peft_model(model, adapter)


def run(tmp_path, name: str, lora: bool, *flags):
    """The losses of `STEPS` steps and the trained parameters."""
    args = make_args(tmp_path / name, "--max_steps", str(STEPS), "--logging_steps", "5", *flags)
    model = model_with_dropout(lora)
    trainer = LossRecordingTrainer(model=model, args=args, train_dataset=CausalData(n=8 * STEPS))
    trainer.train()
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer.losses, params, trainer


@pytest.fixture(scope="module", params=[False, True], ids=["full", "lora"])
def plain(request, tmp_path_factory):
    lora = request.param
    losses, params, _ = run(tmp_path_factory.mktemp("plain"), "plain", lora, "--memory_opt_backend", "none")
    # the runs draw masks that matter: a run whose masks differ from step 2 on ends elsewhere (the test's own check)
    return lora, losses, params


EXACT = {
    "plans": ("--memory_opt_config", "MatMul+silu+Mul+:1:-1"),
    "level 1": ("--memory_opt_level", "1"),
    "Loss+ in one chunk": ("--memory_opt_config", "Layer+:1:-1@0,Loss+:1:-1@chunks1"),
}


@pytest.mark.parametrize("mode", list(EXACT))
@pytest.mark.slow
def test_exact_plans_with_dropout_train_bitwise_as_the_run_without_the_plugin(tmp_path, plain, mode):
    lora, plain_losses, plain_params = plain
    losses, params, trainer = run(tmp_path, "run", lora, "--memory_opt_backend", "torch", *EXACT[mode])
    assert len(losses) == len(plain_losses) == STEPS
    assert losses == plain_losses, (mode, losses, plain_losses)
    assert params.keys() == plain_params.keys()
    assert all(torch.equal(params[n], plain_params[n]) for n in params), mode
    if mode.startswith("Loss+"):  # the lever ran, and its ways were measured between steps one and two
        assert trainer.memopt_handle.levers["loss"].calls == STEPS
        assert trainer.memopt_handle.profile.levers.get("loss") is not None


@pytest.mark.slow
def test_auto_and_chunked_loss_with_dropout_train_as_the_run_without_the_plugin(tmp_path, plain):
    """`auto` (step one's head in chunks, the head's ways measured after it) and `Loss+` in four chunks: the same
    masks, so the losses and parameters are the plain run's to the chunked sum's roundings (dropout masks drawn
    anew would move them by about 1e-3)."""
    lora, plain_losses, plain_params = plain
    for name, flags in [
        ("auto", ("--memory_opt_config", "auto", "--memory_budget_mb", "100000")),
        ("chunks", ("--memory_opt_config", "Layer+:1:-1@1,Loss+:1:-1@chunks4")),
    ]:
        losses, params, trainer = run(tmp_path, name, lora, "--memory_opt_backend", "torch", *flags)
        assert trainer.memopt_handle.profile.levers.get("loss") is not None, name  # measured after step one
        assert len(losses) == STEPS
        for a, b in zip(losses, plain_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (name, losses, plain_losses)
        for n in params:
            torch.testing.assert_close(params[n], plain_params[n], rtol=0, atol=1e-6, msg=f"{name}: {n}")


def test_the_runs_draw_masks_that_change_the_losses(tmp_path, plain):
    """The check above can fail: the same run with another seed for its masks (not its model) ends elsewhere."""
    lora, plain_losses, _ = plain
    losses, _, _ = run(tmp_path, "other", lora, "--memory_opt_backend", "none", "--data_seed", "42", "--seed", "7")
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) > 1e-4


class TwoLengths(torch.utils.data.IterableDataset):
    """Causal sequences of 16 tokens for three steps (8 a step), then of 32, in order (no sampler shuffles an
    iterable dataset): `auto` plans again for the longer batch at step four."""

    def __iter__(self):
        for i in range(8 * STEPS):
            seq = 16 if i < 24 else 32
            ids = torch.randint(3, 128, (seq,), generator=torch.Generator().manual_seed(3000 + i))
            yield {"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long), "labels": ids}


@pytest.mark.slow
def test_auto_planning_again_for_a_longer_batch_with_dropout_trains_as_the_run_without_the_plugin(tmp_path):
    """`auto` planning again mid-run for a longer batch, by a dry run of it (fake tensors) or by measuring its step
    again (every layer recomputed whole, dropout replayed), draws every mask the run without the plugin draws: the
    same losses and parameters, to the chunked loss's roundings (step one and a measured step run the head's loss in
    chunks)."""

    def lengths_run(name, *flags):
        args = make_args(tmp_path / name, "--max_steps", str(STEPS), "--logging_steps", "5", *flags)
        model = model_with_dropout(lora=False)
        trainer = LossRecordingTrainer(model=model, args=args, train_dataset=TwoLengths())
        trainer.train()
        return trainer.losses, {n: p.detach().clone() for n, p in model.named_parameters()}, trainer

    plain_losses, plain_params, _ = lengths_run("plain", "--memory_opt_backend", "none")
    auto = ("--memory_opt_backend", "torch", "--memory_opt_config", "auto", "--memory_budget_mb", "100000")
    for name, flags in [("dry run", ()), ("measured", ("--memory_auto_dry_run", "false"))]:
        losses, params, trainer = lengths_run(name.replace(" ", "-"), *auto, *flags)
        planner = trainer.memopt_handle.planner
        assert [e["batch"] for e in planner.earlier] == [[8, 16]] and planner.planned_shape == (8, 32), name
        assert len(losses) == len(plain_losses) == STEPS
        for a, b in zip(losses, plain_losses):
            assert abs(a - b) <= 1e-6 * abs(b), (name, losses, plain_losses)
        for n in params:
            torch.testing.assert_close(params[n], plain_params[n], rtol=0, atol=1e-6, msg=f"{name}: {n}")
