#!/usr/bin/env python
"""A training loop of one's own (accelerate, no Trainer) on a causal LM, with the torch backend applied by
`optimum_memopt.optimize_memory`: the three lines marked `# memopt` are all the loop gains.

    python examples/custom_loop/train.py                                   # a chained plan, offline default
    python examples/custom_loop/train.py --plans auto --budget_mb 60       # the least recompute under 60 MiB
    python examples/custom_loop/train.py --plans none                      # the same loop without the plugin
    accelerate launch --config_file examples/configs/accelerate_multi_gpu.yaml examples/custom_loop/train.py  # GPUs

Model: `--model_name_or_path` (a hub name or a local directory), or nothing: a Llama of `--model_size` built from a
config in code, with a tokenizer trained locally. Data: `--train_file` (.txt, one document per line; or CSV / JSON
with a `text` column), or nothing: generated text, packed to `--block_size`. Writes `losses.json` to `--output_dir`.

Several processes: on GPUs, as above. On a CPU-only machine, accelerate 1.15 gives this loop no data parallelism
under the 2-process CPU config (its `Accelerator` reports `DistributedType.NO` and process index 0 in both processes,
although torch.distributed is up), so the two processes train apart; the Trainer's recipes (`--use_cpu
--ddp_backend gloo`) are the tested way to run 2 CPU processes (docs/distributed.md).
"""

import argparse
import json
import os
from itertools import chain

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

from optimum_memopt.offline_defaults import SIZES, model_config, text_datasets, text_lines, train_tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", default="MatMul+silu+Mul+:1:-1", help="plans, 'auto', or 'none' (no plugin)")
    p.add_argument("--level", type=int, default=0, help="1: recompute every layer whole")
    p.add_argument("--budget_mb", type=float, default=None, help="with --plans auto: the peak to fit under (MiB)")
    p.add_argument("--activation_budget", type=float, default=None, help="with --plans auto: a share to keep")
    p.add_argument("--model_name_or_path", default=None)
    p.add_argument("--model_size", default="tiny", choices=list(SIZES))
    p.add_argument("--train_file", default=None)
    p.add_argument("--block_size", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=5e-4)
    p.add_argument("--offline_lines", type=int, default=2000)
    p.add_argument("--output_dir", default="outputs/custom_loop")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(args):
    """The tokenizer and the model: from `--model_name_or_path`, or built offline."""
    if args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path)
        return tokenizer, model
    tokenizer = train_tokenizer(text_lines(args.offline_lines, seed=0))
    config = model_config("llama", args.model_size, len(tokenizer), tokenizer.pad_token_id)
    return tokenizer, AutoModelForCausalLM.from_config(config)


def blocks(args, tokenizer):
    """The training text tokenized and packed into `--block_size` sequences (labels = inputs)."""
    raw = text_datasets(train_file=args.train_file, offline_lines=args.offline_lines)["train"]
    ids = tokenizer(raw["text"])["input_ids"]
    flat = list(chain.from_iterable(ids))
    n = len(flat) // args.block_size
    data = torch.tensor(flat[: n * args.block_size]).view(n, args.block_size)
    return torch.utils.data.TensorDataset(data)


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    tokenizer, model = build(args)
    loader = torch.utils.data.DataLoader(blocks(args, tokenizer), batch_size=args.batch_size, shuffle=True)

    memopt = None
    if args.plans != "none":
        import optimum_memopt  # memopt

        memopt = optimum_memopt.optimize_memory(  # memopt: before accelerate wraps the model
            model,
            args.plans,
            level=args.level,
            budget_mb=args.budget_mb,
            activation_budget=args.activation_budget,
            output_dir=args.output_dir,
            reports_steps=args.gradient_accumulation_steps > 1,  # memopt.step_done() below ends each step
        )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, batches = [], iter(loader)
    while len(losses) < args.steps:
        try:
            (batch,) = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        with accelerator.accumulate(model):
            # use_cache=False: else transformers builds a KV cache in every training forward (the Trainer does not)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            if memopt is not None and args.gradient_accumulation_steps > 1:
                memopt.step_done()  # memopt: several forwards make one step
            losses.append(loss.item())
            accelerator.print(f"step {len(losses)}: loss {losses[-1]:.4f}")

    if accelerator.is_main_process:
        os.makedirs(args.output_dir, exist_ok=True)
        out = {"losses": losses, "config": None if memopt is None else memopt.config}
        if memopt is not None:
            print(memopt.table())
            out["auto"] = memopt.auto
            report = memopt.report()
            out["plans"] = None if report is None else report.to_dict()["plans"]
        with open(os.path.join(args.output_dir, "losses.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
