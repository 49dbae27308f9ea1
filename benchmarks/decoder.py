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


@dataclass
class DecoderArguments:
    layers: int = field(default=4, metadata={"help": "Decoder layers."})
    hidden: int = field(default=256, metadata={"help": "Hidden size."})
    intermediate: int = field(default=768, metadata={"help": "MLP intermediate size."})
    heads: int = field(default=4, metadata={"help": "Attention heads."})
    seq: int = field(default=512, metadata={"help": "Sequence length of every sample."})
    vocab: int = field(default=1000, metadata={"help": "Vocabulary size."})
    samples: int = field(default=256, metadata={"help": "Generated training samples."})
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


def build_model(d: DecoderArguments) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=d.vocab,
        hidden_size=d.hidden,
        intermediate_size=d.intermediate,
        num_hidden_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.heads,
        max_position_embeddings=d.seq,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


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


def main(argv=None):
    parser = HfArgumentParser((DecoderArguments, MemoptTrainingArguments))
    d, args = parser.parse_args_into_dataclasses(argv)
    torch.manual_seed(args.seed)
    model = build_model(d)
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
    trainer = MemoptTrainer(model=model, args=args, train_dataset=Tokens(d.samples, d.seq, d.vocab))
    trainer.train()


if __name__ == "__main__":
    main()
