#!/usr/bin/env python
"""Where `auto`'s dry run spends its time (issue 53's start in seconds): the dry run a run makes before its step one
(`fake_step.run` with `plans="auto"`, called as a run's own dry run calls it: no step priced), for a published model's
shape (its config, no weights) at one length and budget, timed by phase: the model built, the forward that finds the
layers' order, each step (step one measuring, then one a check) and the planner's own time at the steps' edges (the
levers' measurements after step one, the solver). `--rounds`: that many dry runs, the median said. `--before DIR`:
the same dry run from another checkout of the project (an older commit's), a round each in turn, so that the two
stand side by side on one machine's clock.

    python benchmarks/dry_run_start.py                                # Llama-3.1-8B LoRA, 8,192 tokens, 25,000 MiB
    python benchmarks/dry_run_start.py --seq 65536 --budget_mb 76851 --rounds 3 --out dry_run_start.json
    python benchmarks/dry_run_start.py --tiny                         # the same phases at a size the suite runs
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the checkout whose package is timed (`--root`: another's, as `--before` runs it); this one's by default
ROOT = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv[:-1] else HERE
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(HERE, "benchmarks"))


def timed_dry_run(spec, budget_mb: float, device, kernels) -> dict:
    """One `auto` dry run of `spec` under `budget_mb`, its phases timed (seconds) and its answer."""
    from optimum_memopt.backends.torch import fake_step
    from optimum_memopt.backends.torch.decide import planner as planner_module
    from optimum_memopt.planning.dry_run import instruments

    marks, planner_s = [], []
    start_step = planner_module.BudgetPlanner.at_step_start
    check_ended = getattr(planner_module.BudgetPlanner, "check_ended", None)  # none before a83828b
    layer_order = fake_step.layer_order

    def at_step_start(self, step):
        began = time.perf_counter()
        marks.append(("step starts", began))
        try:
            return start_step(self, step)
        finally:
            planner_s.append(time.perf_counter() - began)

    def at_check_end(self):
        began = time.perf_counter()
        try:
            return check_ended(self)
        finally:
            planner_s.append(time.perf_counter() - began)

    def order(*args, **kwargs):
        marks.append(("order starts", time.perf_counter()))
        try:
            return layer_order(*args, **kwargs)
        finally:
            marks.append(("order ends", time.perf_counter()))

    planner_module.BudgetPlanner.at_step_start = at_step_start
    if check_ended is not None:
        planner_module.BudgetPlanner.check_ended = at_check_end
    fake_step.layer_order = order
    try:
        began = time.perf_counter()
        # as a run's own dry run calls it (`decide.from_plan`): no step priced (memopt-plan's rows price the last)
        result = fake_step.run(spec, instruments(device), "auto", budget_mb=budget_mb, kernels=kernels)
        ended = time.perf_counter()
    finally:
        planner_module.BudgetPlanner.at_step_start = start_step
        if check_ended is not None:
            planner_module.BudgetPlanner.check_ended = check_ended
        fake_step.layer_order = layer_order
    times = dict(marks_at=[(name, t - began) for name, t in marks])
    order_starts = next(t for name, t in marks if name == "order starts")
    order_ends = next(t for name, t in marks if name == "order ends")
    step_starts = [t for name, t in marks if name == "step starts"]
    edges = step_starts + [ended]
    return dict(
        seconds=ended - began,
        built_s=order_starts - began,
        order_forward_s=order_ends - order_starts,
        steps_s=[b - a for a, b in zip(edges, edges[1:])],
        planner_s=sum(planner_s),
        steps=len(result.step_peaks),
        checks=len((result.auto or {}).get("checks", [])),
        choice=result.fit.config() if result.fit is not None else None,
        peak_mb=result.fit.predicted.peak_mb if result.fit is not None else None,
        # the choice's recompute on the roofline, as the solver weighed it
        recompute_ms=result.fit.recompute_seconds * 1000 if result.fit is not None and result.fit.choice else None,
        **times,
    )


def side_by_side(a) -> int:
    """`--before`: each round a fresh process of each checkout's package in turn (the older first), the medians."""
    import subprocess
    import tempfile

    seen = {a.before: [], HERE: []}
    flags = ["--seq", str(a.seq), "--budget_mb", str(a.budget_mb)] + (["--tiny"] if a.tiny else [])
    for _ in range(a.rounds):
        for root in seen:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "one.json")
                command = [sys.executable, os.path.abspath(__file__), *flags, "--root", root, "--out", out]
                subprocess.run(command, check=True)
                with open(out) as f:
                    seen[root].append(json.load(f)["runs"][0])
    for root, runs in seen.items():
        each = ", ".join(f"{r['seconds']:.1f}" for r in runs)
        print(f"{root}: median {statistics.median(r['seconds'] for r in runs):.1f} s over {len(runs)} rounds ({each})")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(seq=a.seq, budget_mb=a.budget_mb, tiny=a.tiny, before=a.before, runs=seen), f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--budget_mb", type=float, default=25000.0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="a tiny Llama at 256 tokens (the suite's check)")
    p.add_argument("--out", default=None)
    p.add_argument("--root", default=HERE, help="the checkout whose package is timed (default: this one)")
    p.add_argument("--before", default=None, help="another checkout: its dry run and this one's, a round each in turn")
    a = p.parse_args(argv)
    if a.before:
        return side_by_side(a)

    from transformers import LlamaConfig

    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
    from optimum_memopt.planning.dry_run import StepSpec

    if a.tiny:
        config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                             vocab_size=2048, max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
        spec = StepSpec(config, batch=2, seq=256)
    else:
        from plan_8b import configs

        lora = dict(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
        spec = StepSpec(configs()["Llama-3.1-8B"], batch=1, seq=a.seq, dtype="bfloat16", autocast="bfloat16",
                        lora=lora)  # fmt: skip
    device = DEVICES[DEFAULT_DEVICE]
    runs = []
    for _ in range(a.rounds):
        runs.append(timed_dry_run(spec, a.budget_mb, device, CudaKernels(device.capability)))
        r = runs[-1]
        steps = ", ".join(f"{s:.1f}" for s in r["steps_s"])
        print(f"{r['seconds']:.1f} s: built {r['built_s']:.1f}, order forward {r['order_forward_s']:.1f}, "
              f"steps [{steps}] (the planner {r['planner_s']:.1f} of them); {r['steps']} steps, {r['checks']} "
              f"checks; {r['choice']!r} at {r['peak_mb']:,.1f} MiB, {r['recompute_ms'] or 0:.1f} ms of recompute",
              flush=True)  # fmt: skip
    if len(runs) > 1:
        print(f"median {statistics.median(r['seconds'] for r in runs):.1f} s over {len(runs)} rounds")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(seq=spec.seq, budget_mb=a.budget_mb, tiny=a.tiny, runs=runs), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
