#!/usr/bin/env python
"""A Llama-style decoder trained through `MemoptTrainer` on generated tokens: the model of the level-1 benchmark
(benchmarks/level1_vs_checkpointing.py), built from a config in code, SDPA attention, CPU by default. Takes every
Trainer and memory flag, so the advisor's `run_child` measures it like any training script.

    python benchmarks/decoder.py --output_dir out --max_steps 4 --per_device_train_batch_size 16 \\
        --memory_opt_backend torch --memory_opt_level 1
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from optimum_memopt import MemoptTrainer, MemoptTrainingArguments  # noqa: E402

# Published models' shapes (their config.json's), built here from the config alone with random weights: what a real
# model's step holds and how fast it runs, without its weights (benchmarks/real_size.py)
PRESETS = {
    "llama-3.1-8b": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, tie=False),
    "llama-3.2-1b": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, tie=True),
    # the same proportions at a size the CPU trains in seconds (the benchmarks' check in the suite)
    "tiny": dict(layers=2, hidden=64, intermediate=224, heads=4, kv_heads=2, vocab=2048, tie=False),
}


@dataclass
class DecoderArguments:
    preset: str = field(
        default="", metadata={"help": f"A model's shape: {', '.join(PRESETS)} (else the flags below)."}
    )
    kv_heads: int = field(default=0, metadata={"help": "Key/value heads (0: as many as the attention heads)."})
    tie: bool = field(default=False, metadata={"help": "Tie the head to the input embeddings."})
    weights_dtype: str = field(
        default="float32", metadata={"help": "The weights' dtype as built (bfloat16 for LoRA)."}
    )
    lora_r: int = field(
        default=0, metadata={"help": "LoRA's rank on the q and v projections (PEFT); 0: a full fine-tune."}
    )
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA's dropout."})
    liger_flce: bool = field(
        default=False, metadata={"help": "Liger's fused linear cross-entropy on the head (liger-kernel installed)."}
    )
    layers: int = field(default=4, metadata={"help": "Decoder layers."})
    hidden: int = field(default=256, metadata={"help": "Hidden size."})
    intermediate: int = field(default=768, metadata={"help": "MLP intermediate size."})
    heads: int = field(default=4, metadata={"help": "Attention heads."})
    seq: int = field(default=512, metadata={"help": "Sequence length of every sample."})
    vocab: int = field(default=1000, metadata={"help": "Vocabulary size."})
    samples: int = field(default=256, metadata={"help": "Generated training samples."})
    first_seq: int = field(
        default=0,
        metadata={
            "help": "Where set, the first step's samples have this many tokens and every later one `--seq`, in that "
            "order (an iterable dataset: no shuffling): `auto` chooses for the first and plans again for the "
            "longer (batches padded each to its own longest, as TRL's SFT without packing)."
        },
    )
    profile_step: int = field(
        default=0, metadata={"help": "Profile this training step (1-based; benchmarks/step_profile.py); 0: none."}
    )
    profile_out: str = field(default="step_profile.json", metadata={"help": "Where `--profile_step` writes."})
    sac: str = field(
        default="",
        metadata={
            "help": "`titan`: selective activation checkpointing of every layer as torchtitan's `op` mode does it "
            "(torch.utils.checkpoint with a policy: SDPA outputs and every other matmul saved, the rest recomputed); "
            "`trl`: TRL's (`trl.models.enable_selective_activation_checkpointing`: transformers' checkpointing with "
            "the attention op's output saved, needs `--activation_checkpointing`); with `--memory_opt_backend none`."
        },
    )


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq, vocab):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def config_of(d: DecoderArguments) -> LlamaConfig:
    """The config of `d`'s shape (its preset's, where one is named): what `build_model` builds, and what
    benchmarks/real_size.py plans with `memopt-plan`'s code for a run's `--memory_plan_file`."""
    for name, value in PRESETS.get(d.preset, {}).items():
        setattr(d, name, value)
    if d.preset and d.preset not in PRESETS:
        raise SystemExit(f"`--preset {d.preset}`: the presets are {', '.join(PRESETS)}, as in `--preset llama-3.2-1b`")
    return LlamaConfig(
        vocab_size=d.vocab,
        hidden_size=d.hidden,
        intermediate_size=d.intermediate,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads or d.heads,
        max_position_embeddings=max(d.seq, 8192),
        tie_word_embeddings=d.tie,
        attn_implementation="sdpa",
    )


def build_model(d: DecoderArguments, device: str = "cpu"):
    """The decoder of `d`'s shape (`config_of`), built on `device` in `d.weights_dtype`, with LoRA's adapters where
    `d.lora_r` is set (PEFT's fp32 adapters on q and v, the rest frozen)."""
    config = config_of(d)
    if d.liger_flce:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(fused_linear_cross_entropy=True, cross_entropy=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, d.weights_dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    if d.lora_r:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(task_type="CAUSAL_LM", r=d.lora_r, lora_alpha=2 * d.lora_r, lora_dropout=d.lora_dropout)
        model = get_peft_model(model, lora)
    return model


SAVED = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu", "max"}  # fmt: skip


def titan_policy():
    """torchtitan's `op`-mode policy, restated: save the attention ops' outputs and every second matmul's (the first
    of each pair is recomputed), recompute every other op. One counter per forward (the recompute counts again)."""
    from torch.utils.checkpoint import CheckpointPolicy

    def policy(ctx, op, *args, **kwargs):
        name = op.overloadpacket.__name__
        if name == "mm":
            key = "recompute_mm" if ctx.is_recompute else "forward_mm"
            count = ctx.__dict__[key] = ctx.__dict__.get(key, 0) + 1
            return CheckpointPolicy.MUST_SAVE if count % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_titan_sac(model):
    from functools import partial

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from optimum_memopt.backends.torch.apply.checkpoint import without_cache
    from optimum_memopt.backends.torch.apply.layers import find_layers

    for layer in find_layers(model):
        original = layer.forward

        def forward(*args, _layer=layer, _original=original, **kwargs):
            if not (_layer.training and torch.is_grad_enabled()):
                return _original(*args, **kwargs)
            contexts = partial(create_selective_checkpoint_contexts, titan_policy())
            return checkpoint(
                _original, *args, use_reentrant=False, context_fn=contexts, **without_cache(_layer, kwargs)
            )

        layer.forward = forward


class FirstShorter(torch.utils.data.IterableDataset):
    """`first` samples of `first_seq` tokens, then `n - first` of `seq`, in order; again each epoch."""

    def __init__(self, n, seq, vocab, first, first_seq):
        self.n, self.seq, self.vocab, self.first, self.first_seq = n, seq, vocab, first, first_seq

    def __iter__(self):
        for i in range(self.n):
            length = self.first_seq if i < self.first else self.seq
            ids = torch.randint(0, self.vocab, (length,), generator=torch.Generator().manual_seed(i))
            yield {"input_ids": ids, "labels": ids}


def main(argv=None):
    parser = HfArgumentParser((DecoderArguments, MemoptTrainingArguments))
    d, args = parser.parse_args_into_dataclasses(argv)
    torch.manual_seed(args.seed)
    # on the card where one trains (a model of 8B parameters built on the host first takes minutes)
    model = build_model(d, "cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu")
    if d.sac == "titan":
        if args.memory_opt_on:
            raise SystemExit(
                "`--sac titan` recomputes with torch's own checkpointing: add `--memory_opt_backend none`"
            )
        apply_titan_sac(model)
    elif d.sac == "trl":
        from trl.models import enable_selective_activation_checkpointing

        if args.memory_opt_on or not (args.gradient_checkpointing or getattr(args, "activation_checkpointing", False)):
            raise SystemExit(
                "`--sac trl` turns TRL's policy on inside transformers' checkpointing: add `--memory_opt_backend none "
                "--activation_checkpointing`"
            )
        enable_selective_activation_checkpointing(model)
    elif d.sac:
        raise SystemExit(f"`--sac {d.sac}`: the policies here are `titan` and `trl`")
    if d.first_seq:
        first = args.per_device_train_batch_size * args.gradient_accumulation_steps
        data = FirstShorter(d.samples, d.seq, d.vocab, first, d.first_seq)
    else:
        data = Tokens(d.samples, d.seq, d.vocab)
    trainer = MemoptTrainer(model=model, args=args, train_dataset=data)
    if d.profile_step:
        from step_profile import profile_callback

        trainer.add_callback(profile_callback(d.profile_step, d.profile_out))
    trainer.train()


if __name__ == "__main__":
    main()
