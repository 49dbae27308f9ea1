#!/usr/bin/env python
"""The plan of two 8B models on an H100 80 GB, from their configs alone (written here as their publishers ship them:
no download): Llama-3.1-8B and Qwen3-8B, LoRA (r 16, bf16 weights, PEFT's default targets) and full fine-tuning
(fp32 weights, bf16 autocast, AdamW fused), at 8,192 and 32,768 tokens, batch 1. Prints each plan's table and its
wall time on this machine, and writes every figure to a JSON file (BENCHMARKS.md, "The plan before the GPU").
`--fsdp N`: each step sharded with FSDP2 over N processes, the figures what one of them holds.

    python benchmarks/plan_8b.py --out benchmarks/plan_8b.json
    python benchmarks/plan_8b.py --models Llama-3.1-8B --methods full --fsdp 8 --out benchmarks/plan_8b_fsdp8.json
    python benchmarks/plan_8b.py --models Llama-3.1-8B --methods lora --seqs 65536 131072 \
        --plans 'Layer+:1:-1,Loss+:1:-1@chunks64,MLP+:1:-1@tiles8' --out benchmarks/plan_8b_long.json
    python benchmarks/plan_8b.py --models Llama-3.1-8B --methods lora --seqs 262144 --positions 524288 \
        --host_mb 1000000 --search --out benchmarks/plan_8b_offload.json
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from optimum_memopt.planning.plan import plan  # noqa: E402


def configs():
    from transformers import LlamaConfig, Qwen3Config

    llama = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    qwen = Qwen3Config(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    )
    # the 70B for the planning time at that size (`--models Llama-3.1-70B`; not in the default run)
    size = {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64}
    llama70 = LlamaConfig(**{**llama.to_dict(), **size, "num_key_value_heads": 8})
    return {"Llama-3.1-8B": llama, "Qwen3-8B": qwen, "Llama-3.1-70B": llama70}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="plan_8b.json")
    p.add_argument("--seqs", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--methods", nargs="+", default=["lora", "full"])
    p.add_argument("--fsdp", type=int, default=1, help="processes FSDP2 shards over (1: none)")
    p.add_argument("--search", action="store_true", help="also find the largest batch and sequence (more dry runs)")
    p.add_argument(
        "--plans", default=None, help="plans of your own, a row of the table (`yours`), as in ALST's recipe"
    )
    p.add_argument("--host_mb", type=float, default=None, help="the host memory offloaded tensors may hold (MiB)")
    p.add_argument(
        "--positions", type=int, default=None,
        help="max_position_embeddings raised to this, as a user extending the context would (the longest sequence "
        "the search tries)",
    )  # fmt: skip
    a = p.parse_args(argv)
    records = []
    for name, config in configs().items():
        if (a.models and name not in a.models) or (not a.models and name.endswith("70B")):
            continue
        if a.positions:
            config.max_position_embeddings = a.positions
        for method in a.methods:
            for seq in a.seqs:
                began = time.perf_counter()
                result = plan(
                    config,
                    name=name,
                    batch=1,
                    seq=seq,
                    bf16=True,
                    lora={"r": 16, "lora_alpha": 32} if method == "lora" else None,
                    device="H100-80GB",
                    search=a.search,
                    fsdp=a.fsdp,
                    plans=a.plans,
                    host_mb=a.host_mb,
                )
                seconds = time.perf_counter() - began
                sharded = f", FSDP2 over {a.fsdp}" if a.fsdp > 1 else ""
                print(f"\n## {name}, {method}{sharded}, {seq:,} tokens: planned in {seconds:.0f} s", flush=True)
                print(result.table(), flush=True)
                record = {"model": name, "method": method, "fsdp": a.fsdp, "seq": seq, "seconds": seconds}
                records.append({**record, **result.record()})
                with open(a.out, "w", encoding="utf-8") as f:
                    json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
