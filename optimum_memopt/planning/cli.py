"""`memopt-plan`: what a fine-tuning step holds on a GPU, before renting it, from the Trainer's own flags.

    memopt-plan --model_name_or_path ./Llama-3.1-8B --per_device_train_batch_size 1 --block_size 8192 --bf16 \\
        --use_peft --lora_r 16 --device H100-80GB --json plan.json

Only the model's config is read (`config.json` in a local folder, or a hub name where the hub can be reached): the
step runs on fake tensors, nothing is allocated and no weight is read. Exit status: 0 with a table; 2 for bad flags
(before anything runs); 1 when the dry run itself failed.
"""

import argparse
import math
import sys
from typing import List, Optional

from .devices import DEVICES

_TRUE = {"true", "1", "yes"}
_FALSE = {"false", "0", "no"}


class UsageError(ValueError):
    pass


def _flag_bool(name: str):
    def parse(value: str) -> bool:
        v = value.strip().lower()
        if v in _TRUE:
            return True
        if v in _FALSE:
            return False
        raise argparse.ArgumentTypeError(f"`--{name} {value}` is not a boolean; accepted: true or false")

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="memopt-plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model_name_or_path", required=True, help="a local folder with config.json, or a hub name")
    p.add_argument("--per_device_train_batch_size", type=int, default=8, help="as the Trainer's (default 8)")
    p.add_argument(
        "--block_size", "--max_length", "--max_seq_length", dest="block_size", type=int, default=None,
        help="tokens per sequence (default: the config's max_position_embeddings, at most 2048)",
    )  # fmt: skip
    for name in ("bf16", "fp16", "use_peft"):
        p.add_argument(f"--{name}", nargs="?", const=True, default=False, type=_flag_bool(name))
    p.add_argument("--torch_dtype", "--dtype", dest="dtype", default=None,
                   help="the weights' dtype as loaded: float32, bfloat16 or float16 (default: float32; bfloat16 "
                        "with --use_peft and --bf16)")  # fmt: skip
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.05)
    p.add_argument("--lora_target_modules", nargs="+", default=None, help="default: PEFT's for the model type")
    p.add_argument("--optim", default="adamw_torch_fused")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument(
        "--fsdp", default="", help="the Trainer's: `full_shard` (with `auto_wrap`) shards every layer and the model "
        "with FSDP2 over --num_processes; each figure is what one process holds",
    )  # fmt: skip
    p.add_argument(
        "--num_processes", "--nproc_per_node", dest="num_processes", type=int, default=1,
        help="processes the step runs in (accelerate's --num_processes, torchrun's --nproc_per_node): sharded with "
        "--fsdp, else replicated by DistributedDataParallel, each holding its gradient buckets",
    )  # fmt: skip
    p.add_argument("--deepspeed", default=None, help="not planned yet (refused with the reason)")
    p.add_argument("--memory_opt_config", default=None, help="your plans, compared beside the others; or auto")
    p.add_argument("--memory_opt_level", type=int, default=0)
    p.add_argument("--memory_budget_mb", type=float, default=None, help="the budget (MiB) instead of a device's")
    p.add_argument(
        "--device", default=None, help=f"one of: {', '.join(DEVICES)}; or cpu (its kernels, with --memory_budget_mb)"
    )
    p.add_argument(
        "--memory_host_mb", type=float, default=None,
        help="the training machine's host memory (MiB) the layers' offloaded tensors may hold (Offload+, on a card); "
        "default: auto weighs this machine's available memory, and the rows are not held to it",
    )  # fmt: skip
    p.add_argument(
        "--search", nargs="?", const=True, default=True, type=_flag_bool("search"),
        help="find the largest batch and the longest sequence auto fits (more dry runs; default true)",
    )  # fmt: skip
    p.add_argument("--json", default=None, metavar="PATH", help="write every figure of the table there")
    p.add_argument("--picture", default=None, metavar="PATH", help="draw auto's step memory there (PNG)")
    return p


def validate(args) -> None:
    """Refuse what cannot run, before anything runs: each message names the flag, quotes the value and shows an
    accepted form."""
    from .devices import device
    from .dry_run import OPTIMIZERS

    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "block_size"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"`--{flag} {value}` must be at least 1, as in `--{flag} 4`")
    if args.bf16 and args.fp16:
        raise UsageError("`--bf16` and `--fp16` were both given; keep one, as in `--bf16`")
    if args.optim not in OPTIMIZERS:
        raise UsageError(f"`--optim {args.optim}` has no dry run here; accepted: {', '.join(OPTIMIZERS)}")
    if args.dtype is not None and args.dtype not in ("float32", "bfloat16", "float16"):
        raise UsageError(f"`--torch_dtype {args.dtype}` is not a weights' dtype; accepted: float32, bfloat16, float16")
    if args.memory_budget_mb is not None and args.memory_budget_mb <= 0:
        raise UsageError(
            f"`--memory_budget_mb {args.memory_budget_mb:g}` must be above 0, as in `--memory_budget_mb 70000`"
        )
    if args.memory_host_mb is not None and not (math.isfinite(args.memory_host_mb) and args.memory_host_mb > 0):
        raise UsageError(
            f"`--memory_host_mb {args.memory_host_mb:g}` must be a positive number of MiB, as in "
            f"`--memory_host_mb 200000`"
        )
    if args.device is not None and args.device.strip().lower() == "cpu":
        if args.memory_budget_mb is None:
            raise UsageError(
                "`--device cpu` plans the CPU's step (its kernels), which has no memory size here; give the budget, "
                "as in `--device cpu --memory_budget_mb 2000`"
            )
    elif args.device is not None:
        try:
            device(args.device)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.memory_opt_config == "auto":
        raise UsageError(
            "`--memory_opt_config auto` is in every plan already (under the device's budget or `--memory_budget_mb`); "
            "drop it, or give plans to compare, as in `--memory_opt_config 'Layer+:1:-1@every2'`"
        )
    if args.memory_opt_config:
        from ..config import MemoryOptConfig

        try:
            MemoryOptConfig(plans=args.memory_opt_config, backend="torch")
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.num_processes < 1:
        raise UsageError(f"`--num_processes {args.num_processes}` must be at least 1, as in `--num_processes 8`")
    words = set(args.fsdp.split())
    if words - {"full_shard", "auto_wrap"}:
        raise UsageError(
            f"`--fsdp {args.fsdp}`: a dry run shards as FSDP2's `fully_shard` does (every layer and the model, "
            f"resharded after forward); accepted: `--fsdp 'full_shard auto_wrap'` or none"
        )
    if words and args.num_processes == 1:
        raise UsageError(
            f"`--fsdp {args.fsdp}` over one process shards nothing; give the process count, as in `--fsdp "
            f"'full_shard auto_wrap' --num_processes 8`"
        )
    if args.deepspeed:
        raise UsageError(
            f"`--deepspeed {args.deepspeed}`: ZeRO's partitions are DeepSpeed's own code, which a dry run does not run"
            f" on fake tensors; plan without it (DDP: each process holds the whole model) or with FSDP2, which shards "
            f"weights, gradients and optimizer state over the processes as ZeRO-3 does, as in "
            f"`--fsdp 'full_shard auto_wrap' --num_processes 8`"
        )
    if args.memory_opt_level not in (0, 1):
        raise UsageError(f"`--memory_opt_level {args.memory_opt_level}` is not the torch backend's; accepted: 0 or 1")


def _seq(args, config) -> int:
    if args.block_size is not None:
        return args.block_size
    most = getattr(config.get_text_config(), "max_position_embeddings", None) or 2048
    return min(int(most), 2048)


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"memopt-plan: error: {e}", file=sys.stderr)
        return 2
    from transformers import AutoConfig

    from .plan import plan

    try:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
    except (OSError, ValueError) as e:
        parser.print_usage(sys.stderr)
        print(
            f"memopt-plan: error: `--model_name_or_path {args.model_name_or_path}`: no config could be read ({e}); "
            f"give a local folder holding config.json, as in `--model_name_or_path ./Llama-3.1-8B`",
            file=sys.stderr,
        )
        return 2
    lora = None
    if args.use_peft:
        lora = {"r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout}
        if args.lora_target_modules:
            lora["target_modules"] = list(args.lora_target_modules)
    try:
        result = plan(
            config,
            name=args.model_name_or_path,
            batch=args.per_device_train_batch_size,
            seq=_seq(args, config),
            bf16=args.bf16,
            fp16=args.fp16,
            dtype=args.dtype,
            lora=lora,
            optim=args.optim,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            plans=args.memory_opt_config,
            level=args.memory_opt_level,
            budget_mb=args.memory_budget_mb,
            device=args.device,
            search=args.search,
            fsdp=args.num_processes if args.fsdp.split() else 1,
            ddp=1 if args.fsdp.split() else args.num_processes,
            host_mb=args.memory_host_mb,
        )
    except (RuntimeError, ValueError) as e:
        print(f"memopt-plan: the dry run failed: {e}", file=sys.stderr)
        return 1
    print(result.table())
    if args.json:
        result.write_json(args.json)
        print(f"every figure: {args.json}")
    if args.picture:
        if result.auto_solver is None:
            print("no picture: auto had no dry run (give --device or --memory_budget_mb)", file=sys.stderr)
        else:
            result.picture(args.picture)
            print(f"auto's step memory: {args.picture}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
