"""The loss lever (`Loss+`): a causal LM's head and cross-entropy over chunks of tokens, each chunk's logits made
again in backward. Same losses and gradients as the model's own forward (bitwise with one chunk), on Llama, Qwen2,
Qwen3, Gemma 2 (tied embeddings, soft-capped logits), Cohere (a logit scale), Granite (logits divided), Mixtral and
Qwen3-MoE (the aux loss added after the loss); with ignored labels, `num_items_in_batch`, `shift_labels`, label
smoothing, a LoRA on `lm_head` and bf16 autocast; whole logits never made in training; the forward untouched in
evaluation; refusals by name with the statement that differs; every causal LM of the installed transformers read."""

import json
import time

import pytest
import torch
import transformers

from optimum_memopt.backends.torch.levers.loss import ChunkedLoss, Chunking, causal_lm, loss_problem, plan_of
from optimum_memopt.backends.torch.levers.loss.head_form import HeadForm

pytestmark = pytest.mark.torch_backend

VOCAB, SEQ, BATCH = 256, 24, 3


def decoder(arch: str, seed: int = 0):
    # imported here: the ORT stack's transformers (where these tests are skipped) has no Qwen3 or Gemma 2
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    if arch == "gemma2":  # tied embeddings, final-logit soft-capping (30.0 by default), head_dim given
        model = Gemma2ForCausalLM(Gemma2Config(head_dim=16, **common))
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.config.final_logit_softcapping
        return model
    if arch == "cohere":  # the logits scaled before the loss (`logits * self.logit_scale`)
        return CohereForCausalLM(CohereConfig(logit_scale=0.5, **common))
    if arch == "granite":  # the logits divided before the loss (`logits / config.logits_scaling`)
        return GraniteForCausalLM(GraniteConfig(logits_scaling=4.0, **common))
    # MoE, the router's aux loss on and weighted up so that it counts: `loss += coef * aux_loss` after the loss
    moe = dict(output_router_logits=True, router_aux_loss_coef=0.5)
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **moe, **common))
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, **moe, **common
            )
        )
    raise ValueError(arch)


FORMS = ["llama", "qwen2", "qwen3", "gemma2", "cohere", "granite", "mixtral", "qwen3_moe"]


def batch(step: int, ignore_from: int = 5):
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :ignore_from] = -100  # a prompt left out of the loss
    labels[1, -3:] = -100  # padding
    return ids, labels


def train(model, steps: int, chunking=None, step_kwargs=None, smoothing=None):
    """Losses and the last step's gradients of `steps` SGD steps, with the lever on (`chunking`) or not."""
    lever = None
    if chunking is not None:
        lever = ChunkedLoss(causal_lm(model), chunking, say=lambda text: None)
        lever.smoothing = smoothing
        lever.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, grads = [], {}
    model.train()
    for s in range(steps):
        ids, labels = batch(s)
        out = model(input_ids=ids, labels=labels, **(step_kwargs(s) if step_kwargs else {}))
        if lever is not None:
            assert out.logits is None
        out.loss.backward()
        losses.append(out.loss.detach().clone())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    if lever is not None:
        lever.remove()
    return losses, grads, lever


@pytest.mark.parametrize("arch", FORMS)
def test_one_chunk_is_bitwise_the_models_own_loss(arch):
    plain, plain_grads, _ = train(decoder(arch), 3)
    one, one_grads, lever = train(decoder(arch), 3, Chunking(chunks=1))
    assert lever.last == {"tokens": BATCH * SEQ, "rows": BATCH * SEQ, "chunks": 1}
    assert all(torch.equal(a, b) for a, b in zip(plain, one)), (plain, one)
    assert plain_grads.keys() == one_grads.keys()
    assert all(torch.equal(plain_grads[n], one_grads[n]) for n in plain_grads)


@pytest.mark.parametrize(
    "arch,chunking",
    [(a, c) for a in FORMS[:4] for c in (Chunking(chunks=5), Chunking(tokens=16), Chunking())]
    + [(a, Chunking(chunks=5)) for a in FORMS[4:]],
)
def test_chunks_give_the_models_own_losses_and_gradients_over_20_steps(arch, chunking):
    plain, plain_grads, _ = train(decoder(arch), 20)
    chunked, grads, lever = train(decoder(arch), 20, chunking)
    assert lever.last["chunks"] > 1 and lever.calls == 20
    for a, b in zip(plain, chunked):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item()), (a.item(), b.item())
    assert plain_grads.keys() == grads.keys()
    for n in plain_grads:
        torch.testing.assert_close(grads[n], plain_grads[n], rtol=0, atol=1e-5, msg=n)


def test_the_default_chunk_holds_no_more_logits_than_the_hidden_states():
    """The bare `Loss+`: as few chunks as keep a chunk's logits within the hidden states, the tokens spread evenly
    (rows rounded up from tokens x hidden / vocabulary made 31 chunks of 262 rows and one of 70 at 8B's 8,192
    tokens, each chunk's logits 0.15% over the hidden states)."""
    assert Chunking().rows(8192, 256, 8192) == 256  # vocabulary / hidden = 32: 32 chunks
    assert Chunking().rows(8192, 4096, 128256) == 256 == Chunking(chunks=32).rows(8192, 4096, 128256)
    assert Chunking().rows(16384, 2048, 128256) == 261  # 63 chunks: 62 of 261 rows and one of 202
    assert Chunking().rows(16, 32, 1000) == 1  # the logits of one row hold more than all the hidden states
    for tokens in (1, 7, 100, 1000, 4097, 8192, 65536):
        for hidden, vocab in ((4096, 128256), (2048, 151936), (64, 1000), (3, 1000)):
            rows = Chunking().rows(tokens, hidden, vocab)
            chunks = -(-tokens // rows)
            assert rows == 1 or rows * vocab <= tokens * hidden, (tokens, hidden, vocab, rows)
            assert chunks * rows - tokens < chunks, (tokens, hidden, vocab, rows)  # spread evenly: no short tail
            most = tokens * hidden // vocab  # the most rows a chunk within the hidden states may have
            assert chunks == (-(-tokens // most) if most else tokens), (tokens, hidden, vocab, rows)  # as few as that
    assert Chunking(chunks=3).rows(10, 4, 100) == 4 and Chunking(tokens=7).rows(10, 4, 100) == 7


def test_num_items_in_batch_and_shift_labels_are_the_models_own():
    """Gradient accumulation's token count divides the sum, and pre-shifted labels are not shifted again."""
    items = torch.tensor(50)

    def kwargs(step):
        ids, labels = batch(step)
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return {"num_items_in_batch": items} if step % 2 else {"shift_labels": shifted}

    plain, plain_grads, _ = train(decoder("llama"), 4, step_kwargs=kwargs)
    chunked, grads, _ = train(decoder("llama"), 4, Chunking(chunks=4), step_kwargs=kwargs)
    for a, b in zip(plain, chunked):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    for n in plain_grads:
        torch.testing.assert_close(grads[n], plain_grads[n], rtol=0, atol=1e-5)


def test_label_smoothing_is_the_trainers_label_smoother():
    from transformers.trainer_pt_utils import LabelSmoother

    smoother = LabelSmoother(epsilon=0.1)
    model = decoder("qwen2")
    ids, labels = batch(0)
    reference = smoother(model(input_ids=ids), labels, shift_labels=True)
    lever = ChunkedLoss(causal_lm(model), Chunking(chunks=3), say=lambda text: None)
    lever.smoothing = 0.1
    lever.install()
    model.train()
    got = model(input_ids=ids, labels=labels).loss
    assert abs(got.item() - reference.item()) <= 1e-6 * reference.item()


def test_a_lora_on_the_head_is_trained_as_without_chunks():
    peft = pytest.importorskip("peft")

    def lora():
        model = decoder("llama")
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "lm_head"])
        return peft.get_peft_model(model, config)

    torch.manual_seed(1)
    plain, plain_grads, _ = train(lora(), 5)
    torch.manual_seed(1)
    chunked, grads, lever = train(lora(), 5, Chunking(chunks=4))
    assert type(lever.lm).__name__ == "LlamaForCausalLM"
    assert any("lm_head.lora_A" in n for n in grads)
    for a, b in zip(plain, chunked):  # dropout on the head's LoRA: each chunk's recompute replays its mask
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    for n in plain_grads:
        torch.testing.assert_close(grads[n], plain_grads[n], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_autocast_keeps_the_fp32_upcast(dtype):
    """Under bf16 or fp16 autocast (the CPU's: the GPU's is tests/test_gpu_torch.py's) each chunk's logits are made
    in half precision and upcast before the loss, as the model's own head does: the losses are fp32 and the plain
    run's; one chunk is the plain run bitwise, gradients included."""

    def run(chunking):
        model = decoder("llama")
        with torch.autocast("cpu", dtype=dtype):
            return train(model, 3, chunking)

    with torch.autocast("cpu", dtype=dtype):  # the head runs in half precision here: the upcast is the loss's
        assert decoder("llama")(input_ids=batch(0)[0]).logits.dtype == dtype
    plain, plain_grads, _ = run(None)
    chunked, _, _ = run(Chunking(chunks=4))
    one, one_grads, _ = run(Chunking(chunks=1))
    assert all(a.dtype == b.dtype == torch.float32 for a, b in zip(plain, chunked))
    for a, b in zip(plain, chunked):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item()), (a.item(), b.item())
    assert all(torch.equal(a, b) for a, b in zip(plain, one))
    assert all(torch.equal(plain_grads[n], one_grads[n]) for n in plain_grads)


def test_no_whole_logits_in_training_and_the_forward_untouched_elsewhere():
    """In training no tensor of the whole logits' size is made (the dispatcher sees every op's output); evaluation
    and a forward without labels return the whole logits; the lever says once what training outputs lose."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.most = max(self.most, t.numel())
            return out

    said = []
    model = decoder("llama")
    lever = ChunkedLoss(causal_lm(model), Chunking(chunks=6), say=said.append)
    lever.install()
    ids, labels = batch(0)
    model.train()
    with Largest() as seen:
        model(input_ids=ids, labels=labels).loss.backward()
    whole = BATCH * SEQ * VOCAB
    assert seen.most < whole and seen.most >= whole // 6  # one chunk's logits, never the whole
    model(input_ids=ids, labels=labels)
    assert len(said) == 1 and "return no logits (`outputs.logits` is None)" in said[0]
    assert model(input_ids=ids).logits.shape == (BATCH, SEQ, VOCAB)
    model.eval()
    out = model(input_ids=ids, labels=labels)
    assert out.logits.shape == (BATCH, SEQ, VOCAB) and out.loss is not None
    lever.remove()
    assert "forward" not in vars(model)


def scaled_by_a_batch_tensor():
    """A Llama whose forward multiplies the logits by a tensor the batch passes: not row-wise in what the lever can
    know (it reads more than the logits), so refused."""
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, temperature=None, **kwargs):
            outputs = self.model(input_ids=input_ids, **kwargs)
            hidden_states = outputs.last_hidden_state
            hidden_states = slice_logits_to_keep(hidden_states, logits_to_keep)  # noqa: F821 (read, never run)
            logits = self.lm_head(hidden_states)
            logits = logits / temperature
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=logits)  # noqa: F821

    torch.manual_seed(0)
    return Scaled(decoder("llama").config)


def test_models_it_cannot_chunk_are_refused_by_name():
    from transformers import BertConfig, BertLMHeadModel

    bert = BertLMHeadModel(BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, is_decoder=True))
    assert "BertLMHeadModel (model_type 'bert')" in loss_problem(bert)
    assert "its output embeddings are not one of its own modules" in loss_problem(bert)
    scaled = loss_problem(scaled_by_a_batch_tensor())
    assert "Scaled (model_type 'llama')" in scaled
    assert (
        "between the head and the loss its forward reads ['temperature'] (`logits = logits / temperature`)" in scaled
    )
    custom = decoder("llama")
    custom.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    assert "not transformers' causal-LM loss (`ForCausalLMLoss`)" in loss_problem(custom)
    assert "has no LM head" in loss_problem(torch.nn.Linear(2, 2))
    assert loss_problem(decoder("qwen3")) is None


def _every_causal_lm():
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        for kind, name in mapping.items():
            cls = getattr(transformers, name if isinstance(name, str) else name[0], None)
            if cls is not None:
                yield kind, cls


@pytest.mark.slow
def test_every_causal_lm_of_transformers_is_read_and_chunked_or_refused_with_its_reason():
    """Each causal LM (and image-text-to-text model) class of the installed transformers: its forward read into a form
    or refused with a reason, never an error; the families people fine-tune now among those chunked, each MoE with its
    aux loss added after the loss as its forward adds it, each scaled or soft-capped head with what it does."""
    from optimum_memopt.backends.torch.levers.loss.head_form import _form_of

    forms = {}
    for kind, cls in _every_causal_lm():
        form = _form_of(cls, "lm_head", getattr(cls, "base_model_prefix", "model"))
        assert isinstance(form, (HeadForm, str)), kind
        forms.setdefault(kind, form)
    chunked = {k for k, f in forms.items() if isinstance(f, HeadForm)}
    dense = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3"}
    moe = {"mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "olmoe", "dbrx", "jetmoe", "granitemoe"}
    vlm = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3", "paligemma"}
    assert dense | moe | vlm <= chunked, sorted((dense | moe | vlm) - chunked)
    for kind in moe - {"deepseek_v3"}:  # DeepSeek-V3's forward has no aux loss: its router is aux-loss-free
        assert len(forms[kind].added) == 1 and "aux_loss" in forms[kind].added[0], (kind, forms[kind].added)
    assert not forms["deepseek_v3"].added and not forms["llama"].added
    assert forms["llama"].bare and not forms["gemma2"].bare
    assert forms["cohere"].between == ["logits = logits * self.logit_scale"]
    assert forms["granite"].between == ["logits = logits / self.config.logits_scaling"]
    refused = {k: f for k, f in forms.items() if isinstance(f, str)}
    assert "takes no `logits_to_keep`" in refused["musicgen"]
    # its labels build the decoder's inputs: run without them (as the lever runs it) it is another forward
    assert "its forward reads `labels` besides its loss" in refused["t5gemma2"]
    assert len(chunked) > 3 * len(refused), (len(chunked), len(refused))


# -- through the Trainer -----------------------------------------------------------------------------------------


class Causal(torch.utils.data.Dataset):
    """Token sequences whose first tokens are a prompt left out of the loss."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids, labels = batch(100 + i)
        return {"input_ids": ids[0], "labels": labels[0]}


def trainer_run(tmp_path, name, *flags, model=None, resume=None, **trainer_kwargs):
    from helpers import LossRecordingTrainer, make_args

    args = make_args(
        tmp_path / name, "--max_steps", "6", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
        "2", "--logging_steps", "1", *flags,
    )  # fmt: skip
    trainer = LossRecordingTrainer(
        model=model or decoder("llama"), args=args, train_dataset=Causal(), **trainer_kwargs
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("smoothing,bf16", [("0", False), ("0.1", False), ("0", True)])
@pytest.mark.slow
def test_through_the_trainer_the_losses_are_plain_ones_with_accumulation_and_smoothing(tmp_path, smoothing, bf16):
    """Gradient accumulation (the Trainer's `num_items_in_batch`), label smoothing (the model's forward smooths,
    chunk by chunk, where the Trainer would smooth the logits) and bf16 (accelerate wraps the instance's forward,
    ours included, in autocast): the losses of the run without the backend (under bf16, the first step's to the
    chunked sum's order, 1e-7 relative, not bitwise: which micro-batch rounds alike depends on the CPU's kernels; after
    it, the gradients' last bits, summed chunk by chunk, flip bf16 roundings in the next forwards, 1e-5 apart over
    these 6 steps, as one chunk, bitwise, shows they are nothing else). Removed, the forward is plain again."""
    common = ("--label_smoothing_factor", smoothing, *(("--bf16",) if bf16 else ()))
    plain = trainer_run(tmp_path, "plain", "--memory_opt_backend", "none", *common)
    run = trainer_run(
        tmp_path, "loss", "--memory_opt_backend", "torch", "--memory_opt_config", "Loss+:1:-1@chunks4", *common
    )
    assert len(run.losses) == 12
    for a, b in zip(plain.losses, run.losses):
        assert abs(a - b) <= (5e-5 if bf16 else 1e-6) * abs(a), (a, b)
    if bf16:  # step one's two micro-batches, on the same weights: the chunked sum's order apart (1e-7 relative)
        assert all(abs(a - b) <= 1e-6 * abs(a) for a, b in zip(run.losses[:2], plain.losses[:2]))
        one = trainer_run(
            tmp_path, "one", "--memory_opt_backend", "torch", "--memory_opt_config", "Loss+:1:-1@chunks1", *common
        )
        assert one.losses == plain.losses
    lever = run.memopt_handle.levers["loss"]
    assert lever.calls == 12 and lever.last == {"tokens": 4 * SEQ, "rows": SEQ, "chunks": 4}
    assert (lever.smoothing is not None) == (smoothing != "0")
    with open(tmp_path / "loss" / "memory_plans.json") as f:
        notes = " ".join(json.load(f)["notes"])
    assert f"`Loss+` (4 chunks): the head and loss ran in 4 chunk(s) of up to {SEQ} of the step's {4 * SEQ}" in notes
    model = run.memopt_handle.model
    run.memopt_handle.remove()
    ids, labels = batch(0)
    model.train()
    assert model(input_ids=ids, labels=labels).logits.shape == (BATCH, SEQ, VOCAB) and lever.calls == 12


@pytest.mark.slow
def test_a_second_trainer_under_bf16_takes_the_loss_lever_over(tmp_path):
    """accelerate's mixed precision wraps the instance's forward, the first lever's inside it. A second Trainer on
    the same model with `Loss+` (before: refused, the forward seen as replaced by something unknown, while the first
    lever went on chunking) takes the first one's forward over: the first lever runs no more, the second chunks
    every training forward, and the losses are those of the same second run on a model the plugin never touched."""
    flags = ("--memory_opt_backend", "torch", "--bf16")
    model = decoder("llama")
    first = trainer_run(tmp_path, "first", *flags, "--memory_opt_config", "Loss+:1:-1@chunks2", model=model)
    old = first.memopt_handle.levers["loss"]
    assert old.calls == 12 and "forward" in vars(model)  # accelerate's wrapper, ours inside
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    second = trainer_run(tmp_path, "second", *flags, "--memory_opt_config", "Loss+:1:-1@chunks1", model=model)
    lever = second.memopt_handle.levers["loss"]
    assert old.calls == 12 and not old.installed and lever.calls == 12 and lever.last["chunks"] == 1
    fresh = decoder("llama")
    fresh.load_state_dict(trained)
    plain = trainer_run(tmp_path, "plain", "--memory_opt_backend", "none", "--bf16", model=fresh)
    assert second.losses == plain.losses


def test_a_loss_computed_outside_the_model_or_a_forward_of_another_form_is_refused_at_train(tmp_path):
    flags = ("--memory_opt_backend", "torch", "--memory_opt_config", "Loss+:1:-1")
    with pytest.raises(ValueError) as e:
        trainer_run(tmp_path, "func", *flags, compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0)
    assert "has 'Loss+:1:-1', but the Trainer's `compute_loss_func` computes the loss from the model's logits" in str(
        e.value
    )
    with pytest.raises(ValueError) as e:
        trainer_run(tmp_path, "scaled", *flags, model=scaled_by_a_batch_tensor())
    assert "Scaled (model_type 'llama'): `Loss+` runs a forward whose head's logits go from the backbone's" in str(
        e.value
    )
    assert "drop `Loss+` to train with the head whole" in str(e.value)


# -- measured after step one: the table's rows, and `auto`'s choice ------------------------------------------------


def wide_run(tmp_path, name, steps=1, **memory):
    """A decoder whose head and loss outweigh its layers (vocabulary / hidden = 32), through the Trainer."""
    from helpers import Tokens
    from transformers import LlamaConfig, LlamaForCausalLM

    from optimum_memopt import MemoptTrainer, MemoptTrainingArguments

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, attn_implementation="sdpa",
    )  # fmt: skip
    args = MemoptTrainingArguments(
        output_dir=str(tmp_path / name), use_cpu=True, max_steps=steps, per_device_train_batch_size=8,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, memory_opt_backend="torch",
        **memory,
    )  # fmt: skip
    trainer = MemoptTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(seq=64, vocab=2048))
    trainer.train()
    return trainer


@pytest.mark.slow
def test_the_table_has_a_row_per_chunking_and_its_peak_drop_is_what_a_run_measures(tmp_path):
    """After step one each way of running the head is measured alone (from the fewest rows a chunk up, each within
    what step one's peak left free: SGD here, which holds no state, leaves the room of step one's activations); each
    row's PEAK DROP is what a run with that chunking then measures (step one against step one, read after every op),
    within 2% here."""
    from optimum_memopt.callbacks.plan_stats import format_plan_table
    from optimum_memopt.memory import MIB
    from optimum_memopt.plans import PlanReport

    one = "Loss+:1:-1@chunks1"  # the whole logits at once, made again in backward: the most any way holds
    wide_run(tmp_path, "warm-up")  # the process's first training allocates for good
    began = time.perf_counter()
    eager = wide_run(tmp_path, "one", memory_opt_config=one, optim="sgd")
    took = time.perf_counter() - began
    head = eager.memopt_handle.profile.levers.get("loss")
    assert head.ran == one and (head.tokens, head.hidden, head.vocab) == (8 * 64, 64, 2048)
    assert [o.plan for o in head.options] == [""] + [f"Loss+:1:-1@chunks{c}" for c in (2, 4, 8, 16, 32)] + [one]
    assert head.why_not == {} and all(o.held_bytes <= o.bound_bytes for o in head.options)
    with open(tmp_path / "one" / "memory_plans.json") as f:
        table = json.load(f)
    rows = {p["config"]: p for p in table["plans"] if p["config"].startswith("Loss+")}
    assert list(rows) == [o.plan for o in head.options[1:]] and [p for p in rows if rows[p]["enabled"]] == [one]
    # the header names the head's plan; the layers' kept bytes and the head's transient ones are not added together
    report = PlanReport.from_dict(table)
    assert format_plan_table(report).startswith(f"Memory optimizer (torch) ON: {one}; ")
    assert report.saving_mb(enabled_only=True) == 0.0  # no layer plan on
    assert report.head_saving_mb() == rows[one]["saving_bytes"] / 2**20
    own = head.options[0].held_bytes
    assert all(rows[o.plan]["saving_bytes"] == own - o.held_bytes for o in head.options[1:])
    assert rows["Loss+:1:-1@chunks2"]["saving_bytes"] > own / 3  # half the logits and their gradient
    assert "the head and loss (`Loss+` rows): each way run alone after step one on its shapes (512 tokens" in " ".join(
        table["notes"]
    )
    # what measuring the ways cost the run's start, on its clock (the only lever on the model here)
    seconds = table["levers_measured_s"]
    assert list(seconds) == ["loss"] and 0 < seconds["loss"] < took, (seconds, took)
    started = f"in {seconds['loss']:.2f} s of the run's start: the head and loss {seconds['loss']:.2f} s"
    assert any(note.startswith("after step one the levers ran each way alone") and note.endswith(started)
               for note in table["notes"]), table["notes"]  # fmt: skip
    memory = eager.memopt_handle.profile.memory
    assert memory.peak.name.startswith("after the layers")
    for plan in ("Loss+:1:-1@chunks2", "Loss+:1:-1@chunks8"):
        run = wide_run(tmp_path, plan, memory_opt_config=plan, optim="sgd")
        ran = run.memopt_handle.profile.memory
        measured = (memory.peak.peak_bytes - memory.start_bytes) - (ran.peak.peak_bytes - ran.start_bytes)
        predicted = rows[plan]["peak_drop_bytes"]
        assert abs(measured - predicted) <= 0.02 * predicted, (plan, measured / MIB, predicted / MIB)
        measured_head = run.memopt_handle.profile.levers.get("loss")
        assert measured_head.ran == plan and rows[plan]["recompute_seconds"] >= 0
        # the ways that could hold more than this step's peak left free were not run, and said so
        for way, why in measured_head.why_not.items():
            assert why.startswith("it could hold up to ") and "and step one's peak left" in why
            assert (way or "the model's own head") in " ".join(run.memopt_handle.report().notes)


def test_the_trainers_own_step_lets_go_of_the_outputs_a_subclass_may_not(tmp_path):
    """`WrapSettings.outputs_dropped`: transformers' own `training_step` and `compute_loss` let go of the model's
    outputs before the backward, so the whole head's logits are not counted as held through the step; a subclass
    that runs its own (TRL's, a user's, before or after the mixin) may keep them: counted."""
    from helpers import Tokens
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    from optimum_memopt import MemoptTrainer, MemoptTrainerMixin, MemoptTrainingArguments

    class Kept(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            self.last = model(**inputs)
            return self.last.loss

    class Mine(MemoptTrainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    args = MemoptTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    drops = {
        cls.__name__: cls(model=model, args=args, train_dataset=Tokens(n=2, seq=8, vocab=64))._memopt_drops_outputs()
        for cls in (MemoptTrainer, type("AfterKept", (MemoptTrainerMixin, Kept), {}), Mine)
    }
    assert drops == {"MemoptTrainer": True, "AfterKept": False, "Mine": False}


def test_the_head_is_measured_only_within_what_step_one_left_free(tmp_path):
    """AdamW's state, made after step one, fills what step one's peak left free on this small model: the way the
    step ran the head is not run alone, so the head is not measured, said in the table; each bound held what its
    way held (before, the head's ways were run whatever they took, the whole logits included)."""
    wide_run(tmp_path, "warm-up")
    run = wide_run(tmp_path, "adamw", memory_opt_config="Loss+:1:-1@chunks1")
    profile = run.memopt_handle.profile
    assert profile.levers.get("loss") is None
    assert profile.lever_problems["loss"].startswith(
        "the way the step ran the head (Loss+:1:-1@chunks1) was not run alone: "
    )
    assert f"the head and loss were not measured each way they can run: {profile.lever_problems['loss']}" in (
        run.memopt_handle.report().notes
    )


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_each_ways_bound_is_above_what_it_holds(arch, autocast):
    """The bound a way of running the head is admitted by (`measure`: what the last way run held and what each more
    row can add, 25% higher) is never below what it then holds: Llama and Gemma 2 (soft-capped), fp32 and bf16."""
    from optimum_memopt.backends.torch.levers.loss import measure
    from optimum_memopt.backends.torch.measure.profile import (
        AFTER_PLACE,
        LayerProfile,
        ModelProfile,
        Segment,
        StepMemory,
    )

    layer = LayerProfile(shape=(4, 64, 32))
    profile = ModelProfile([layer], autocast=autocast)
    profile.memory = StepMemory("cpu", [Segment(AFTER_PLACE, 0, 0, 1 << 40)], 0, "")  # room for every way
    measured = measure(ChunkedLoss(causal_lm(decoder(arch)), None, say=lambda text: None), profile)
    assert [o.plan for o in measured.options] == [""] + [f"Loss+:1:-1@chunks{c}" for c in (2, 4, 8)]
    for option in measured.options:
        assert 0 < option.held_bytes <= option.bound_bytes, option


@pytest.mark.slow
def test_auto_chooses_the_heads_chunks_with_the_layers(tmp_path, capsys):
    """Step one runs the head in its finest chunks; after it, each coarser way and the whole head are measured as far
    as the budget leaves room (above step one's peak, which would not have held the whole head: before, it was not
    run, and `auto` kept the head chunked under any budget), and the roomy run chooses the whole head, nothing
    recomputed. Under a budget a fifth of the way from the least recompute reaches to that choice's peak (the whole
    head holds far more than any chunks), the solver chooses the layers' recompute and a coarser way of the head in
    one solve, step two runs it (the head's way switched as that step's first layer starts), every check meets the
    budget, and the losses are the roomy run's to 1e-6. (Which way a budget forces is the solver's, tested against
    brute force in tests/test_torch_budget.py.)"""
    wide_run(tmp_path, "warm-up")
    roomy = wide_run(
        tmp_path,
        "roomy",
        steps=5,
        memory_opt_config="auto",
        memory_auto_dry_run=False,
        memory_budget_mb=10**6,
        optim="sgd",
    )
    planner = roomy.memopt_handle.planner
    head = roomy.memopt_handle.profile.levers.get("loss")
    assert head.ran == "Loss+:1:-1"  # step one: the least memory, the head chunked too
    assert head.why_not == {} and "" in {c.plan for c in planner.levers["loss"]} and len(planner.levers["loss"]) > 1
    assert planner.fits[0].lever("loss").plan == "" and not any(c.freed_bytes for c in planner.fits[0].choice)
    # its check reads what the whole head measured alone predicts (weighed by its bound, 25% over what it held, the
    # prediction stood 3.7 MiB over), the Trainer's own step letting go of the logits before its backward (counted
    # as held, as for a loop keeping `outputs`, it stood 4 MiB over)
    (check,) = planner.verified
    assert "returned_mb" not in check and abs(check["predicted_peak_mb"] - check["measured_peak_mb"]) < 64 / 1024, (
        check
    )
    floor, peak = planner.fits[0].floor.peak_mb, planner.fits[0].predicted.peak_mb
    assert floor < peak
    budget = round(floor + 0.2 * (peak - floor), 1)
    capsys.readouterr()
    tight = wide_run(
        tmp_path,
        "tight",
        steps=5,
        memory_opt_config="auto",
        memory_auto_dry_run=False,
        memory_budget_mb=budget,
        optim="sgd",
    )
    planner = tight.memopt_handle.planner
    final = planner.fits[-1]
    chosen = final.lever("loss").plan
    # the head's way among the choice's entries (the MLP's tiles may come after it: which layers' recompute and which
    # levers win is the CPU's clock, op times measured in step one)
    assert chosen in {c.plan for c in planner.levers["loss"]} and chosen in final.config().split(",")
    assert any(c.freed_bytes for c in final.choice)
    assert all(check["measured_peak_mb"] <= budget for check in planner.verified), planner.verified
    lever = tight.memopt_handle.levers["loss"]
    assert lever.installed and lever.calls == 5 and plan_of(lever.chunking) == chosen
    out = capsys.readouterr().out
    assert (
        f"the solver chose `--memory_opt_config {planner.fits[0].config()}`, under the budget of {budget:,.1f} MiB"
        in out
    )
    roomy_losses = [h["loss"] for h in roomy.state.log_history if "loss" in h]
    tight_losses = [h["loss"] for h in tight.state.log_history if "loss" in h]
    assert len(tight_losses) == 5
    for a, b in zip(roomy_losses, tight_losses):
        assert abs(a - b) <= 1e-6 * abs(a), (roomy_losses, tight_losses)
    with open(tmp_path / "tight" / "memory_auto" / "solver.json") as f:
        solver = json.load(f)
    assert solver["fits"][-1]["levers"]["loss"] == chosen
    assert "loss off" not in [c["config"] for c in solver["lever_candidates"]["loss"]]


def test_a_run_with_chunks_resumes_exactly_and_saves_the_plain_model(tmp_path):
    """Resumed from its step-3 checkpoint, a `Loss+` run ends as the uninterrupted one; `save_model` writes the plain
    model (transformers alone loads it, its forward untouched, with the trained weights)."""
    flags = ("--memory_opt_backend", "torch", "--memory_opt_config", "Loss+:1:-1@chunks4", "--save_strategy", "steps",
             "--save_steps", "3")  # fmt: skip
    whole = trainer_run(tmp_path, "whole", *flags)
    resumed = trainer_run(tmp_path, "resumed", *flags, resume=str(tmp_path / "whole" / "checkpoint-3"))
    assert resumed.losses == whole.losses[6:]  # steps 4-6: two micro-batches each
    whole.save_model(str(tmp_path / "saved"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert "forward" not in vars(loaded)
    mine = {n: p for n, p in whole.memopt_handle.model.named_parameters()}
    assert all(torch.equal(p, mine[n]) for n, p in loaded.named_parameters())
    ids, labels = batch(0)
    loaded.train()
    assert loaded(input_ids=ids, labels=labels).logits.shape == (BATCH, SEQ, VOCAB)


def test_a_dry_runs_head_figures_move_the_chunks_stretches_not_the_final_norms():
    """Each way of chunking the head, as `auto` weighs it from step one (the head marked: its segment read stretch by
    stretch), gives the head segment a step running it reads: the ways move the stretches the chunks run in, not the
    final norm's backward after them, where a LoRA step's head segment peaks (no head weight's gradient): the way's
    change had been counted on top of that peak (2 MiB over here, 129 MiB at 8B and 8,192 tokens). A dry run for a
    card."""
    from transformers import LlamaConfig

    from optimum_memopt.backends.torch import fake_step
    from optimum_memopt.backends.torch.decide.budget import freed_bytes, segment_peaks
    from optimum_memopt.backends.torch.levers.loss.measure import HEAD_STRETCHES, choices, head_marked
    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.backends.torch.measure.profile import HEAD_PLACE
    from optimum_memopt.backends.torch.policy import LAYER, LayerPolicy, RecomputePolicy
    from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, instruments

    config = LlamaConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=1792, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=8192, max_position_embeddings=1024,
                         tie_word_embeddings=False)  # fmt: skip
    lora = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    spec = StepSpec(config, batch=1, seq=1024, dtype="bfloat16", autocast="bfloat16", lora=lora)
    card = dict(kernels=CudaKernels((9, 0)))
    device = DEVICES[DEFAULT_DEVICE]
    one = fake_step.run(spec, instruments(device), "auto", budget_mb=1e6, **card).profile  # step one, then eager fits
    assert head_marked(one.memory)
    head_of = lambda memory: next(s for s in memory.segments if s.place == HEAD_PLACE)  # noqa: E731
    head = head_of(one.memory)
    tags = [tag for tag, _ in head.parts]
    assert set(HEAD_STRETCHES) <= set(tags) and tags[0] == "" and tags[-1] == "after head backward"
    assert head.parts[-1][1] == head.peak_bytes  # step one's head segment peaks in the final norm's backward
    measured = RecomputePolicy([LayerPolicy(LAYER) for _ in one.layers])
    q = freed_bytes(one, measured)
    ways = choices(one.levers["loss"], marked=True)
    whole = {c.plan: c for c in choices(one.levers["loss"])}  # weighed on the whole segment, as before
    assert len(ways) >= 3 and not any(c.less for c in ways) and any(c.less_parts for c in ways)
    assert ways[0].plan == "" and ways[0].returned == 0  # the model's own head (a dry run's: no logits kept)
    for way in (ways[0], ways[1], ways[-1]):  # the model's own head, the most rows a chunk, the fewest
        predicted = dict(segment_peaks(one.memory, q, q, 0, [way]))[HEAD_PLACE]
        plans = ",".join(p for p in ("Layer+:1:-1", way.plan) if p)
        read = head_of(fake_step.run(spec, instruments(device), plans, **card).profile.memory)
        # a way's held bytes, read alone, are what it adds in the step, to the allocator's blocks of its scalars (the
        # own head's too, now that the hidden states it reads are made inside the way: a frozen head lets go of them
        # before its backward's peak, and it was weighed one hidden state, 1 MiB, over)
        assert abs(read.peak_bytes - predicted) <= 16 * 1024, (way.plan, read.peak_bytes - predicted)
        if way.less_parts:  # on the whole segment it was counted on top of the final norm's backward
            before = dict(segment_peaks(one.memory, q, q, 0, [whole[way.plan]]))[HEAD_PLACE]
            assert before - read.peak_bytes > 1024 * 1024, (way.plan, before - read.peak_bytes)


def test_the_way_the_step_ran_is_read_from_the_count_with_its_rows_not_run_twice(monkeypatch):
    """Where the chunking step one ran (`Loss+:1:-1`: a chunk's logits no more than the hidden states) makes as many
    rows a chunk as one of the counts measured, it is read from that count: the same work, run once (at 8B, 8,192
    tokens, 32 chunks of 256 rows were run twice, a sixth of the dry run's step one's lever time)."""
    from transformers import LlamaConfig

    from optimum_memopt.backends.torch import fake_step
    from optimum_memopt.backends.torch.measure import ways
    from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, instruments

    run_ways, ran = ways.run_ways, []

    def watched(order, rows, bound, run, *args, **kwargs):
        if run.__module__.endswith("levers.loss.measure"):  # the loss lever's ways (not the MLP lever's)
            ran.append([rows(w) for w in order])
        return run_ways(order, rows, bound, run, *args, **kwargs)

    monkeypatch.setattr(ways, "run_ways", watched)
    config = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                         vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    head = fake_step.run(StepSpec(config, seq=256), instruments(DEVICES[DEFAULT_DEVICE]), "auto", budget_mb=1e6)
    measured = head.profile.levers["loss"]
    (rows,) = ran
    assert len(rows) == len(set(rows)), rows
    by_plan = {o.plan: o for o in measured.options}
    assert measured.ran == "Loss+:1:-1" and "Loss+:1:-1@chunks16" in by_plan  # vocabulary / hidden = 16
    twin, same = by_plan["Loss+:1:-1"], by_plan["Loss+:1:-1@chunks16"]
    assert (twin.held_bytes, twin.seconds, twin.rows) == (same.held_bytes, same.seconds, same.rows)
