#!/usr/bin/env python
"""A dry run's alike layers replayed from two recorded (`backends.torch.measure.replay`) against the same dry run with
every layer run: the seconds each takes, side by side in interleaved rounds (the median said), and whether every
figure is the same (the peak, its parts and where, the steps' peaks, the priced step seconds, the attention kernels).
A published model's shape (its config, no weights), as `memopt-plan` runs its rows; the plain step (`memopt-plan`'s
eager row) is the one replayed today.

    python benchmarks/layer_replay.py                                  # Llama-3.1-8B LoRA, 8,192 tokens, 3 rounds
    python benchmarks/layer_replay.py --seq 65536 --rounds 5 --out layer_replay.json
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(HERE, "benchmarks"))


def figures(result) -> dict:
    return {
        "peak_bytes": result.peak_bytes,
        "parts": result.parts,
        "peak_at": result.peak_at,
        "step_peaks": result.step_peaks,
        "before_training_bytes": result.before_training_bytes,
        "step_seconds": result.step_seconds,
        "attention": result.attention,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3.1-8B")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="H100-80GB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from plan_8b import configs

    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.devices import DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    device = DEVICES[args.device]
    lora = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    spec = StepSpec(
        configs()[args.model], batch=args.batch, seq=args.seq, dtype="bfloat16", autocast="bfloat16", lora=lora
    )
    rows = {"every layer run": [], "layers replayed": []}
    seen, replayed = {}, 0
    for round_ in range(args.rounds):
        for name, replay in (("every layer run", False), ("layers replayed", True)):
            began = time.perf_counter()
            result = dry_run(
                spec, backend=False, cost_device=device, kernels=CudaKernels(device.capability), replay_layers=replay
            )
            rows[name].append(time.perf_counter() - began)
            seen.setdefault(name, figures(result))
            replayed = max(replayed, result.layers_replayed)
            print(f"round {round_ + 1} {name}: {rows[name][-1]:.2f} s", flush=True)
    same = seen["every layer run"] == seen["layers replayed"]
    medians = {name: statistics.median(times) for name, times in rows.items()}
    print(
        f"{args.model}, LoRA r16 (q, v; dropout 0.05), bf16, {args.batch} x {args.seq}, {args.device}'s kernels, the "
        f"plain step: every layer run {medians['every layer run']:.2f} s, {replayed} layers replayed "
        f"{medians['layers replayed']:.2f} s (medians of {args.rounds}); figures the same: {same}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "model": args.model, "seq": args.seq, "batch": args.batch, "device": args.device,
                    "seconds": rows, "medians": medians, "layers_replayed": replayed, "figures_same": same,
                    "figures": seen["layers replayed"],
                },
                f, indent=1, default=str,
            )  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
