"""TRL's `SFTTrainer` with the mixin (`class T(MemoptTrainerMixin, SFTTrainer)`), models built in code: plain SFT and
SFT with a `peft_config` train with plans and layer recompute as the same SFT run without the plugin (TRL's
defaults otherwise: bf16 autocast), a Qwen3-MoE with its aux loss on among them (with `Loss+` in one chunk too); TRL's `gradient_checkpointing` default is refused naming SFTConfig; TRL's
activation offloading composes (its hooks receive every tensor the backend keeps as it is). The installed
`sft.py` script itself: tests/test_trl_sft_script.py."""

import functools

import pytest
import torch
from helpers import LossRecordingMixin, small_decoder

from optimum_memopt import MemoptTrainerMixin, with_memory_flags

pytestmark = pytest.mark.torch_backend

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
if int(trl.__version__.split(".")[0]) < 1:
    pytest.skip(f"TRL {trl.__version__}: these tests are written for TRL 1.x", allow_module_level=True)

STEPS = 6
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


class PlainSFT(LossRecordingMixin, trl.SFTTrainer):
    pass


class MemoptSFT(LossRecordingMixin, MemoptTrainerMixin, trl.SFTTrainer):
    pass


@pytest.fixture(scope="module")
def text():
    from optimum_memopt.offline_defaults import text_lines, train_tokenizer

    lines = text_lines(64, seed=0)
    tokenizer = train_tokenizer(lines, vocab_size=120)
    tokenizer.eos_token = "[SEP]"  # TRL 1.x appends it to every text
    return tokenizer, datasets.Dataset.from_list([{"text": t} for t in lines])


def sft(tmp_path, text, arch, ours, *, lora=False, offload=False, **flags):
    tokenizer, data = text
    Config = with_memory_flags(trl.SFTConfig) if ours else trl.SFTConfig
    memory = dict(memory_opt_backend="torch", **flags) if ours else {}
    args = Config(
        output_dir=str(tmp_path), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4, max_length=32,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
        gradient_checkpointing=False, activation_offloading=offload, **memory,
    )  # fmt: skip
    if arch == "qwen3_moe":  # its routers' aux loss on, as TRL turns it on for MoE configs
        from test_moe import moe

        model = moe(arch, coef=0.01)
    else:
        model = small_decoder(arch)  # 128 tokens: the tokenizer's 120 fit
    trainer = (MemoptSFT if ours else PlainSFT)(
        model=model, args=args, processing_class=tokenizer, train_dataset=data,
        peft_config=peft.LoraConfig(task_type="CAUSAL_LM", **LORA) if lora else None,
    )  # fmt: skip
    trainer.train()
    return trainer


@pytest.mark.parametrize(
    "arch,lora,flags",
    [
        ("llama", False, dict(memory_opt_config="MatMul+silu+Mul+:1:-1")),
        ("qwen2", False, dict(memory_opt_level=1)),
        ("llama", True, dict(memory_opt_level=1)),
        ("qwen2", True, dict(memory_opt_config="Layer+:1:-1@0,MatMul+silu+Mul+:1:-1@1")),
        ("qwen3_moe", False, dict(memory_opt_level=1)),
        ("qwen3_moe", True, dict(memory_opt_config="Layer+:1:-1@0,MatMul+:1:-1@1,Loss+:1:-1@chunks1")),
    ],
    ids=["llama-chain", "qwen2-level1", "llama-lora-level1", "qwen2-lora-mixed", "moe-level1", "moe-lora-mixed"],
)
@pytest.mark.slow
def test_sft_trainer_with_the_mixin_trains_as_plain_sft(tmp_path, text, arch, lora, flags):
    plain = sft(tmp_path / "plain", text, arch, False, lora=lora)
    ours = sft(tmp_path / "ours", text, arch, True, lora=lora, **flags)
    assert plain.args.bf16 and ours.args.bf16  # TRL's default, kept by with_memory_flags
    assert len(ours.losses) == STEPS and ours.losses == plain.losses  # bitwise
    state = ours.memopt_handle
    assert len(state.layers) == 2 and state.profile is not None
    if lora:
        assert isinstance(ours.model, peft.PeftModel)
        frozen = [p for n, p in ours.model.named_parameters() if "lora_" not in n]
        assert frozen and all(not p.requires_grad and p.grad is None for p in frozen)
        mine = {n: p for n, p in ours.model.named_parameters() if p.requires_grad}
        theirs = dict(plain.model.named_parameters())
        assert mine and all(torch.equal(p, theirs[n]) for n, p in mine.items())
    else:
        theirs = dict(plain.model.named_parameters())
        assert all(torch.equal(p, theirs[n]) for n, p in ours.model.named_parameters())


def test_trls_gradient_checkpointing_default_is_refused_naming_sft_config(tmp_path):
    with pytest.raises(ValueError, match=r"^`gradient_checkpointing=True` \(SFTConfig's default, unless you passed "
                                         r"it\) with the torch backend would recompute the same layers twice over; "
                                         r"use the backend's whole-layer recompute instead, as in "
                                         r"`--memory_opt_level 1 --gradient_checkpointing false`"):  # fmt: skip
        with_memory_flags(trl.SFTConfig)(output_dir=str(tmp_path), use_cpu=True, memory_opt_backend="torch")


def test_trls_activation_offloading_receives_what_the_backend_keeps(tmp_path, text, monkeypatch):
    """TRL 1.16's offloading needs an accelerator (`torch.accelerator.current_accelerator()` is None on a CPU-only
    torch, and its __init__ fails there): run with the CPU taken for the accelerator and no pinned memory or streams,
    so that it copies every tensor it is given (CPU to CPU) and gives the copies back in backward."""
    from trl.models import activation_offloading
    from trl.trainer import sft_trainer

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    given = []
    real_pack = activation_offloading.OffloadActivations.__init__

    def counting_init(self, *a, **k):
        real_pack(self, *a, **k)
        pack = self.pack_hook

        def pack_counted(t):
            given.append(t.numel() * t.element_size())
            return pack(t)

        self.pack_hook = pack_counted

    monkeypatch.setattr(activation_offloading.OffloadActivations, "__init__", counting_init)
    monkeypatch.setattr(
        sft_trainer,
        "get_act_offloading_ctx_manager",
        functools.partial(activation_offloading.get_act_offloading_ctx_manager, use_pin_memory=False,
                          use_streams=False),
    )  # fmt: skip
    plain = sft(tmp_path / "plain", text, "llama", False, offload=True)
    plain_given, plain_bytes = len(given), sum(given)
    given.clear()
    ours = sft(tmp_path / "ours", text, "llama", True, offload=True, memory_opt_config="MatMul+silu+Mul+:1:-1")
    assert ours.losses == plain.losses
    # the planned outputs are recipes, not handed on (seen: 560 tensors, 3.7 MiB without the plugin; 476, 2.5 MiB
    # with it); every other tensor saved in the layers reached TRL's hooks
    assert 0 < sum(given) < plain_bytes and 0 < len(given) <= plain_given


@pytest.mark.slow
def test_trls_fused_head_is_not_chunked_twice(tmp_path, text, caplog):
    """`SFTTrainer` chunks the head itself (TRL's fused LM head, installed in its __init__): `Loss+` detects it,
    says so, and leaves TRL's forward as it is; the run is plain SFT's, the table's note says whose head ran."""
    import json
    import logging

    plain = sft(tmp_path / "plain", text, "llama", False)
    with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
        ours = sft(tmp_path / "ours", text, "llama", True, memory_opt_config="Layer+:1:-1,Loss+:1:-1")
    assert ours.losses == plain.losses
    lever = ours.memopt_handle.levers["loss"]
    assert lever.trl and not lever.installed and lever.calls == 0
    assert "chunked already by TRL's fused LM head (`SFTTrainer`), which runs its own forward; it is not chunked " \
           "twice" in caplog.text  # fmt: skip
    with open(tmp_path / "ours" / "memory_plans.json") as f:
        notes = " ".join(json.load(f)["notes"])
    assert "`Loss+`: the head is TRL's fused LM head, chunked by TRL already: not chunked again" in notes


def test_the_twin_runs_trls_fused_head_as_the_model_does_or_says_why_not():
    """`auto`'s dry run runs the model's twin (`from_plan.twin_of`), which drops every forward set on an instance:
    TRL's fused LM head is put back on it as TRL put it on the model, with the same settings (`fused_onto`), so the dry run runs the
    head the step runs (it had run the model's own head: a step of TRL's measured 31.9 MiB against 13.9 predicted,
    over a 30 MiB budget). On CUDA TRL scores only the positions the labels leave in, in Triton kernels: no twin, and
    the reason said (step one then measures with every layer recomputed whole)."""
    from trl.trainer.utils import add_fused_lm_head

    from optimum_memopt.backends.torch.decide.from_plan import NoTwin, twin_of
    from optimum_memopt.backends.torch.levers.loss import fused_by_trl, fused_onto

    model = small_decoder("llama")
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    twin = twin_of(model)
    assert not fused_by_trl(twin)  # dropped with every forward set on an instance
    fused_onto(model, twin)
    assert fused_by_trl(twin) and twin.forward.__func__ is not model.forward.__func__
    cells = dict(zip(twin.forward.__func__.__code__.co_freevars, twin.forward.__func__.__closure__))
    assert (cells["temperature"].cell_contents, cells["outputs"].cell_contents) == (0.7, ("log_probs", "entropy"))
    assert cells["original_forward"].cell_contents.__self__ is twin  # its own head, where TRL's is not asked for
    with pytest.raises(NoTwin, match=r"TRL's fused LM head \(`SFTTrainer`\) scores on CUDA only the positions"):
        fused_onto(model, twin_of(model), device=torch.device("cuda"))
    plain = small_decoder("llama")
    fused_onto(plain, twin_of(plain))  # nothing of TRL's on it: nothing done
    assert not fused_by_trl(twin_of(plain))


@pytest.mark.slow
def test_autos_dry_run_counts_trls_fused_head_as_the_step_holds_it(tmp_path, text):
    """Through `SFTTrainer`, `auto`'s dry run of step one counts TRL's fused LM head (its tiles of 32,768 logits a
    row, whatever the vocabulary: here more than the model's own head holds) as the step then holds it: the step
    after the choice measured within 1% of the figure said before step one."""
    ours = sft(tmp_path / "auto", text, "llama", True, memory_opt_config="auto", memory_budget_mb=10**6)
    planner = ours.memopt_handle.planner
    predicted, measured = planner.planned.predicted.peak_mb, planner.verified[0]["measured_peak_mb"]
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, planner.verified)
    step_one = ours.memopt_handle.profile.memory.peak
    assert step_one.name.startswith("after the layers: head and loss"), step_one.name  # the head's is the peak
