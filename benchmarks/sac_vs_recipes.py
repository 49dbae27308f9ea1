#!/usr/bin/env python
"""Why the torch backend recomputes planned ops from recipes rather than with `torch.utils.checkpoint` and a
selective policy (`create_selective_checkpoint_contexts`): both measured on the same BERT-style model, in one
process, in one run (modern stack: torch >= 2.5).

For each way of recomputing the GELU outputs (and, as references, no recompute and whole layers):
the bytes in use at the allocator held from before forward to after forward (the activations kept for backward),
and the median time of a forward + backward step.

    python benchmarks/sac_vs_recipes.py            # about a minute on 2 CPU cores; prints a markdown table
    python benchmarks/sac_vs_recipes.py --device cuda --hidden 768 --layers 12 --seq 512 --batch 32

SAC policies measured:
  * "others saved": GELU recomputed, every other op's output cached (the policy a plan maps to literally; it needs
    `allow_cache_entry_mutation=True`, as dropout on CPU fills a cached output in place);
  * "matmuls saved": GELU and every op other than a matmul recomputed (the usual selective-checkpointing recipe).
"""

import argparse
import functools
import gc
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts  # noqa: E402
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

from optimum_memopt.backends.base import WrapSettings  # noqa: E402
from optimum_memopt.backends.torch.apply.layers import find_layers  # noqa: E402
from optimum_memopt.backends.torch.backend import TorchBackend  # noqa: E402
from optimum_memopt.memory import allocator_bytes_in_use  # noqa: E402
from optimum_memopt.plans import parse_plans  # noqa: E402

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_dot_product_flash_attention_for_cpu"}


def policy(keep_all: bool, ctx, op, *args, **kwargs):
    name = op.overloadpacket.__name__
    if name == "gelu":
        return CheckpointPolicy.MUST_RECOMPUTE
    if keep_all or name in MATMULS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def build(a):
    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=1000,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 64,
        intermediate_size=4 * a.hidden,
        max_position_embeddings=a.seq,
        attn_implementation=a.attn,
    )
    model = BertForMaskedLM(cfg)
    model.train()
    return model


def with_checkpoint(model, context_fn=None):
    for layer in find_layers(model):
        original = layer.forward
        kwargs = {"use_reentrant": False}
        if context_fn is not None:
            kwargs["context_fn"] = context_fn
        layer.forward = functools.partial(checkpoint, original, **kwargs)
    return model


def in_use(device) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else allocator_bytes_in_use()


def measure(model, batch, steps, device="cpu"):
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    held, times = [], []
    for _ in range(steps):
        gc.collect()
        sync()
        before = in_use(device)
        t0 = time.perf_counter()
        loss = model(**batch).loss
        held.append((in_use(device) - before) / 2**20)
        loss.backward()
        sync()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        del loss
    return statistics.median(held[1:]), statistics.median(times[1:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--plans", action="append", help="a plan set for the torch backend's row (repeatable)")
    p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    a = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (a.batch, a.seq), generator=g)
    batch = {"input_ids": ids.to(a.device), "labels": ids.to(a.device)}
    configs = [
        ("no recompute (eager)", lambda m: m),
        *[
            (
                f"torch backend, `{plans}` (recipes)",
                lambda m, plans=plans: TorchBackend().wrap(m, WrapSettings(entries=parse_plans(plans))),
            )
            for plans in a.plans or ["Gelu+:1:-1"]
        ],
        (
            "SAC, GELU recomputed, others saved",
            lambda m: with_checkpoint(
                # without allow_cache_entry_mutation it stops at the first backward: dropout on CPU fills
                # `empty_like`'s cached output in place (`bernoulli_`)
                m,
                lambda: create_selective_checkpoint_contexts(
                    functools.partial(policy, True), allow_cache_entry_mutation=True
                ),
            ),
        ),
        (
            "SAC, GELU recomputed, matmuls saved",
            lambda m: with_checkpoint(
                m, lambda: create_selective_checkpoint_contexts(functools.partial(policy, False))
            ),
        ),
        ("whole layers checkpointed (level 1)", lambda m: with_checkpoint(m)),
    ]
    rows = []
    for label, make in configs:
        model = make(build(a).to(a.device))
        held, step = measure(model, batch, a.steps, a.device)
        rows.append((label, held, step))
        print(f"{label}: held {held:.1f} MiB, step {step:.3f} s", file=sys.stderr)
        del model
    eager_held, eager_step = rows[0][1], rows[0][2]
    where = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
    print(
        f"BERT-style MLM, hidden {a.hidden}, {a.layers} layers, sequence {a.seq}, batch {a.batch}, "
        f"{a.attn} attention, "
        f"dropout 0.1, fp32 on {where}; torch {torch.__version__}; median of {a.steps - 1} steps after one warm-up.\n"
    )
    print("| recompute | held after forward MiB | saved vs eager MiB | step s | step vs eager |")
    print("|---|---|---|---|---|")
    for label, held, step in rows:
        print(f"| {label} | {held:.1f} | {eager_held - held:.1f} | {step:.3f} | {step / eager_step:.2f}x |")


if __name__ == "__main__":
    main()
