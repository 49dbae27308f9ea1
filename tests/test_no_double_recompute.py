"""Layers recomputed by something besides the torch backend (transformers' activation checkpointing, torch's
`checkpoint_wrapper`, FSDP's checkpointing, a checkpoint call around the layers) are refused with the cause and
the backend's flag for the same recompute, whenever they are turned on: never recomputed twice over."""

import pytest
import torch
from helpers import CausalData, LossRecordingTrainer, make_args, small_decoder
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, apply_activation_checkpointing
from transformers import TrainerCallback
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from optimum_memopt import MemoptTrainingArguments
from optimum_memopt.backends.torch.policy import KEEP, LAYER

pytestmark = pytest.mark.torch_backend

BASE = dict(output_dir="unused_out", report_to="none", use_cpu=True, memory_opt_backend="torch")


def llama(layers=2):
    return small_decoder("llama", layers)


def trainer(tmp_path, model, *flags, callbacks=None):
    args = make_args(tmp_path, "--max_steps", "3", "--memory_opt_backend", "torch", *flags)
    return LossRecordingTrainer(model=model, args=args, train_dataset=CausalData(n=32), callbacks=callbacks)


def wrap_layers(model, impl=CheckpointImpl.NO_REENTRANT):
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: _wrapper(m, impl), check_fn=lambda m: isinstance(m, LlamaDecoderLayer)
    )


def _wrapper(module, impl):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    return checkpoint_wrapper(module, checkpoint_impl=impl)


@pytest.mark.parametrize(
    "layers,kwargs,flag",
    [
        (2, {}, r"`--memory_opt_level 1`"),
        (4, {"every_n_layers": 2}, r"`--memory_opt_config 'Layer\+:1:-1@every2'`"),
        (4, {"every_n_layers": 3}, r"`--memory_opt_config 'Layer\+:1:-1@every3'`"),
    ],
)
def test_transformers_checkpointing_turned_on_before_the_trainer_is_refused_with_our_flag(tmp_path, layers, kwargs,
                                                                                          flag):  # fmt: skip
    model = llama(layers)
    model.activation_checkpointing_enable(**kwargs)
    on = sum(1 for layer in model.model.layers if layer.gradient_checkpointing)
    t = trainer(tmp_path, model, "--memory_opt_level", "1")
    with pytest.raises(ValueError, match=(
        rf"^transformers' activation checkpointing is on in {on} of LlamaForCausalLM's {layers} layers "
        r"\(`model.activation_checkpointing_enable\(\)` or `gradient_checkpointing_enable\(\)` was called on it: "
        rf"by the script, by PEFT's `prepare_model_for_kbit_training`, .* recomputed twice over; call "
        rf"`model.activation_checkpointing_disable\(\)` and pass {flag} for the same recompute"
    )):  # fmt: skip
        t.train()
    assert t.state.global_step == 0


def test_the_flag_named_recomputes_as_transformers_did(tmp_path):
    """The refusal's advice taken: checkpointing every other layer of 4 by transformers and the flag it names
    (`Layer+:1:-1@every2`) give the same losses."""
    theirs = llama(4)
    theirs.activation_checkpointing_enable(every_n_layers=2)
    args = make_args(tmp_path / "t", "--max_steps", "5", "--memory_opt_backend", "none")
    plain = LossRecordingTrainer(model=theirs, args=args, train_dataset=CausalData(n=32))
    plain.train()
    ours = trainer(tmp_path / "o", llama(4), "--memory_opt_config", "Layer+:1:-1@every2", "--max_steps", "5")
    ours.train()
    assert [layer.gradient_checkpointing for layer in theirs.model.layers] == [True, False, True, False]
    modes = [p.mode for p in ours.memopt_handle.policy.layers]
    assert modes == [LAYER, KEEP, LAYER, KEEP]
    assert ours.losses == pytest.approx(plain.losses, abs=1e-5)


class TurnOn(TrainerCallback):
    """Turns on recompute besides the backend's once the Trainer has wrapped the model."""

    def __init__(self, how):
        self.how = how

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.how(model)


@pytest.mark.parametrize(
    "how,pattern",
    [
        (
            lambda m: m.activation_checkpointing_enable(),
            r"has transformers' activation checkpointing turned on since the backend wrapped the model",
        ),
        (lambda m: wrap_layers(m), r"ran inside torch.utils.checkpoint: something outside the backend recomputes it"),
        (
            lambda m: wrap_layers(m, CheckpointImpl.REENTRANT),
            r"ran during a backward pass \(a recompute: torch.utils.checkpoint with use_reentrant=True\)",
        ),
    ],
)
def test_recompute_turned_on_after_the_wrap_stops_the_step(tmp_path, how, pattern):
    t = trainer(tmp_path, llama(), "--memory_opt_level", "1", callbacks=[TurnOn(how)])
    with pytest.raises(RuntimeError, match=r"^optimum-memopt: layer \d \(LlamaDecoderLayer\) of the torch backend "
                                           + pattern + r".*`--memory_opt_level 1` \(every layer\)"):  # fmt: skip
        t.train()
    assert t.state.global_step == 1  # step one trained, step two stopped before any update


def test_checkpoint_wrapper_around_the_layers_is_refused_at_the_wrap(tmp_path):
    model = llama()
    wrap_layers(model)
    with pytest.raises(ValueError, match=r"^2 of LlamaForCausalLM's 2 layers are wrapped in torch's "
                                         r"`checkpoint_wrapper` \(FSDP's `activation_checkpointing`.*pass "
                                         r"`--memory_opt_level 1` for the same recompute"):  # fmt: skip
        trainer(tmp_path, model, "--memory_opt_config", "silu+:1:-1").train()


def test_fsdp_checkpointing_is_refused_from_the_arguments(monkeypatch):
    with pytest.raises(ValueError, match=r"^`fsdp_config\['activation_checkpointing'\]` with the torch backend would "
                                         r"recompute the same layers twice over .*`--memory_opt_level 1`"):  # fmt: skip
        MemoptTrainingArguments(
            **BASE, memory_opt_level=1, fsdp="full_shard auto_wrap",
            fsdp_config={"version": 2, "activation_checkpointing": True},
        )  # fmt: skip
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ValueError, match=r"^`fsdp_activation_checkpointing: true` in accelerate's config "
                                         r"\(\$FSDP_ACTIVATION_CHECKPOINTING\) with the torch backend would recompute "
                                         r"the same layers twice over"):  # fmt: skip
        MemoptTrainingArguments(**BASE, memory_opt_level=1)


def test_saved_tensor_hooks_around_the_step_are_not_recompute():
    """A user's offloading hooks around the step (save_on_cpu) are not a checkpoint: the layers run under them."""
    from optimum_memopt.backends.torch import _torch_api

    with torch.autograd.graph.save_on_cpu():
        assert _torch_api.foreign_recompute() is None
    assert _torch_api.foreign_recompute() is None


def test_the_fsdp2_config_loads_as_accelerate_reads_it_with_fsdps_checkpointing_off():
    import os

    from accelerate.commands.config.config_args import load_config_from_file

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = load_config_from_file(os.path.join(root, "examples", "configs", "accelerate_fsdp2_gpu.yaml"))
    assert str(config.distributed_type).endswith("FSDP") and config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_activation_checkpointing"] is False  # the backend refuses it on
    assert config.fsdp_config["fsdp_reshard_after_forward"] is True
