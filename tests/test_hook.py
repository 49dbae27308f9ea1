"""The hook's parts alone: the attention switch, the in-graph loss, log(), and the mixin on TRL's SFTTrainer."""

import pytest
import torch
from helpers import ClsData, make_args, tiny_model
from transformers import RobertaConfig, RobertaForSequenceClassification
from transformers.trainer_pt_utils import LabelSmoother

from optimum_memopt.eager_attention import use_eager_attention
from optimum_memopt.losses import LossInGraph, smoothed_cross_entropy
from optimum_memopt.trainer import MemoptTrainer

# the hook against the installed Trainer and TRL: both stacks' (and the compatibility slice's) transformers range
pytestmark = pytest.mark.both_stacks


@pytest.mark.ort
def test_sdpa_attention_is_switched_to_eager_keeping_every_parameter():
    torch.manual_seed(0)
    cfg = RobertaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
        attn_implementation="sdpa",
    )
    model = RobertaForSequenceClassification(cfg).eval()
    assert any("Sdpa" in type(m).__name__ for m in model.modules())
    ids = torch.randint(3, 64, (2, 10))
    before = model(input_ids=ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_eager_attention(model) is True
    assert not any("Sdpa" in type(m).__name__ for m in model.modules())
    assert model.config._attn_implementation == "eager"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-5)
    assert use_eager_attention(model) is False  # nothing left to switch
    assert use_eager_attention(tiny_model("deberta")) is False  # DeBERTa has no SDPA path


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_in_graph_smoothed_loss_equals_the_trainers_label_smoother(epsilon):
    torch.manual_seed(0)
    logits = torch.randn(4, 7, 11)
    labels = torch.randint(0, 11, (4, 7))
    labels[0, :3] = -100
    expected = LabelSmoother(epsilon=epsilon)({"logits": logits}, labels, shift_labels=False)
    assert torch.allclose(smoothed_cross_entropy(logits, labels, epsilon), expected, atol=1e-6)


@pytest.mark.ort
def test_loss_in_graph_wrapper_returns_only_the_loss_and_exposes_the_model():
    model = tiny_model("deberta")
    wrapper = LossInGraph(model, label_smoothing=0.1)
    data = ClsData(n=4)[0]
    (loss,) = wrapper(
        input_ids=data["input_ids"][None], attention_mask=data["attention_mask"][None], labels=data["labels"][None]
    )
    assert loss.ndim == 0 and loss.requires_grad
    # what the Trainer reads through the wrapper (saving, best-model loading, FLOPs)
    assert wrapper.config is model.config
    assert wrapper._keys_to_ignore_on_save == model._keys_to_ignore_on_save
    assert wrapper.floating_point_ops({"input_ids": data["input_ids"][None]}) > 0


def test_log_does_not_change_the_callers_metrics(tmp_path):
    trainer = MemoptTrainer(
        model=tiny_model(),
        args=make_args(tmp_path, "--memory_opt_backend", "none", "--print_input_density"),
        train_dataset=ClsData(n=8),
    )
    density = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "InputDensityCallback")
    density._pending = {"memopt/embed_density_pct": 50.0}
    metrics = {"train_runtime": 1.0}
    trainer.log(metrics)
    assert metrics == {"train_runtime": 1.0}  # what train() returns stays clean
    assert trainer.state.log_history[-1]["memopt/embed_density_pct"] == 50.0


def test_mixin_needs_its_arguments(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(TypeError, match=r"MemoptTrainer needs MemoptTrainingArguments, got TrainingArguments"):
        MemoptTrainer(model=tiny_model(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True))


def test_ort_not_installed_is_said_when_the_trainer_is_built(tmp_path, monkeypatch):
    """Asked for by name, the backend is not called "the default here" (it was, before its refusal was its own)."""
    from optimum_memopt.backends import ort

    args = make_args(tmp_path, "--memory_opt_backend", "ort")  # parsing probes nothing
    monkeypatch.setattr(ort, "_onnxruntime_dir", lambda: None)
    with pytest.raises(
        RuntimeError,
        match=r"^`--memory_opt_backend ort` needs ONNX Runtime Training: onnxruntime-training is not installed; install it with: pip install 'optimum-memopt\[cpu\]'.*Or pass `--memory_opt_backend none`",
    ):
        MemoptTrainer(model=tiny_model(), args=args)


@pytest.mark.ort
def test_ort_extensions_not_built_gives_the_command(tmp_path, monkeypatch):
    from optimum_memopt.backends import ort

    (tmp_path / "ort" / "training" / "ortmodule" / "torch_cpp_extensions").mkdir(parents=True)
    args = make_args(tmp_path / "out", "--memory_opt_backend", "ort")
    monkeypatch.setattr(ort, "_onnxruntime_dir", lambda: str(tmp_path / "ort"))
    with pytest.raises(
        RuntimeError,
        match=r"ORTModule's C\+\+ extensions are not built; build them once with: .* -m onnxruntime\.training\.ortmodule\.torch_cpp_extensions\.install",
    ):
        MemoptTrainer(model=tiny_model(), args=args)


@pytest.mark.ort
def test_fp16_with_ort_on_cpu_is_refused_before_training(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    args = make_args(tmp_path)
    args.bf16 = True  # transformers refuses --fp16 on CPU itself; bf16 passes its checks
    with pytest.raises(ValueError, match=r"^`--bf16` with ORTModule on CPU"):
        MemoptTrainer(model=tiny_model(), args=args)


def test_mixin_with_trls_sft_trainer(tmp_path):
    """README's promise: `class MyTrainer(MemoptTrainerMixin, SFTTrainer)` with `with_memory_flags(SFTConfig)` trains
    a small causal LM through the stack's backend (ORTModule with TRL 0.12, the torch backend with TRL 1.16), with
    TRL's own dataset preparation, its defaults, and our reports."""
    trl = pytest.importorskip("trl")
    import importlib.metadata as md

    import transformers
    from packaging.requirements import Requirement

    declared = [Requirement(r) for r in md.requires("trl") or [] if r.startswith("transformers")]
    if declared and not declared[0].specifier.contains(transformers.__version__):
        pytest.skip(
            f"the installed TRL {trl.__version__} declares {declared[0]}; transformers is {transformers.__version__}"
        )
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl import SFTConfig, SFTTrainer

    from optimum_memopt import MemoptTrainerMixin, with_memory_flags
    from optimum_memopt.offline_defaults import classification_rows, train_tokenizer

    class MemoptSFTTrainer(MemoptTrainerMixin, SFTTrainer):
        pass

    Args = with_memory_flags(SFTConfig)  # both sets of fields, TRL's defaults kept

    texts = [r["sentence"] for r in classification_rows(64, seed=0)]
    tokenizer = train_tokenizer(texts, vocab_size=200)
    tokenizer.eos_token = "[SEP]"  # TRL 1.x appends the EOS token to each text
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            attn_implementation="eager",
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    args = Args(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=4,
        per_device_train_batch_size=4,
        report_to="none",
        logging_steps=2,
        save_strategy="no",
        memory_opt_level=1,
        print_input_density=True,
        dataset_text_field="text",
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL's default; the backend's level 1 recomputes the layers instead
        **({"max_seq_length": 32} if hasattr(SFTConfig, "max_seq_length") else {"max_length": 32}),  # TRL 0.12 / 1.x
    )
    trainer = MemoptSFTTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list([{"text": t} for t in texts]),
    )
    trainer.train()
    assert args.learning_rate == SFTConfig.learning_rate  # TRL's default, not transformers'
    if args.memory_opt.backend == "ort":
        assert type(trainer.backend_model).__name__ == "ORTModule"
    report = trainer.memopt_backend.plan_report(trainer.backend_model, trainer.memopt_wrap_settings())
    assert report.level == 1 and report.plans_on
    assert (tmp_path / "memory_plans.json").exists() and (tmp_path / "input_density.csv").exists()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and 0 < logged[0]["memopt/embed_density_pct"] <= 100
    assert logged[-1]["loss"] < 20


@pytest.mark.ort  # the torch backend's auto re-runs nothing (tests/test_torch_budget.py)
def test_auto_needs_a_script_to_re_run_and_says_what_to_do_instead(tmp_path, monkeypatch):
    args = make_args(tmp_path, "--memory_opt_config", "auto", "--memory_budget_mb", "1000")
    trainer = MemoptTrainer(model=tiny_model(), args=args, train_dataset=ClsData(n=8))
    assert trainer.memory_plan is None  # nothing chosen while the trainer is built
    monkeypatch.setattr("sys.argv", [""])  # a notebook's kernel
    with pytest.raises(
        RuntimeError,
        match=r"re-runs the training script to measure plans, but this process has no "
        r"script to re-run .*resolve_memory_plan\(script_argv=",
    ):
        trainer.train()
