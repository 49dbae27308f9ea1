#!/usr/bin/env python
"""Issue 53's benchmark: `auto` at real size on one card, beside every fixed recipe a user has. For each setup (a
published model's shape built from its config on the card, random weights: benchmarks/decoder.py's presets), each row
a fresh process through the advisor's `run_child` (peak: CUDA's max allocated from the start of training, weights
included; on the CPU the process's tensor storages counted as CUDA counts them; speed: the median step after two
warm-up steps and after every step `auto` measured, checked or reported on, `speed_steps` of them; `speed_settled`
false where none was left and the speed is of steps it still measured):

- the fixed recipes: eager, transformers' checkpointing, checkpointing with Liger's fused linear cross-entropy
  (where liger-kernel is installed; said where not), level 1 + `Loss+`;
- `auto` under each budget: the card's (its memory less 1 GiB, less 5%: `memopt-plan`'s), then each fixed recipe's
  own peak (the budget that recipe fits exactly), down to the least any recipe reached;
- beside each, `auto` from `memopt-plan`'s file (`--memory_plan_file`, planned here by the same code under the budget
  as a whole MiB: `plan_s`): no dry run at the run's start;
- with `--without_offload_too`, beside each, `auto` with no host room to offload to (`--memory_host_mb 1`): issue
  55's check that `auto` is no slower with offload among its levers than without (`--host_mb` gives the room the
  other rows weigh; default the host's available memory).

Each `auto` row is held to its goals, and the verdict printed beside it: within its budget; its dry run's figure
(said before step one) within 1% of the peak it measured; at least as fast as the fastest fixed recipe within the
budget (rounds interleaved, `--rounds`; the spread between them said). Its start: step one beyond a steady step
(`start_s`). Every figure goes to `--out` as it is measured (a run cut short keeps what it finished).

    python benchmarks/real_size.py --out benchmarks/real_size_h100.json            # on the card: the three setups
    python benchmarks/real_size.py --setups llama-3.1-8b-lora --seqs 8192 --rounds 1
    python benchmarks/real_size.py --tiny --out /tmp/real_size.json                # the same rows on the CPU, tiny
    python benchmarks/real_size.py --setups llama-3.1-8b-lora --seqs 8192 --budgets_mb 68445.5 --no_file_rows \
        --fixed_from benchmarks/real_size_h100_8k.json                             # auto again, beside earlier rows
    python benchmarks/real_size.py --setups llama-3.1-8b-lora --seqs 65536 --budgets 1 --no_file_rows \
        --without_offload_too --rounds 2                                           # issue 55: offload not chosen idly
    python benchmarks/real_size.py --setups llama-3.1-8b-lora --seqs 262144 --no_fixed --budgets 1 \
        --no_file_rows --rounds 1                                                  # issue 55's record: auto alone
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from optimum_memopt.advisor import run_child  # noqa: E402

DECODER = os.path.join(ROOT, "benchmarks", "decoder.py")
PLAIN = ["--memory_opt_backend", "none"]
TORCH = ["--memory_opt_backend", "torch"]
LORA = ["--lora_r", "16", "--lora_dropout", "0.05", "--weights_dtype", "bfloat16"]
# (model flags, batch, the sequence lengths): issue 53's rows
SETUPS = {
    "llama-3.1-8b-lora": (["--preset", "llama-3.1-8b", *LORA], 1, [8192, 32768, 65536]),
    "llama-3.2-1b-full": (["--preset", "llama-3.2-1b"], 4, [4096]),
}
TINY = {"tiny-lora": (["--preset", "tiny", *LORA], 1, [256]), "tiny-full": (["--preset", "tiny"], 2, [256])}
COMMON = ["--optim", "adamw_torch_fused", "--samples", "64", "--dataloader_num_workers", "0"]


def recipes(liger: bool) -> list:
    rows = [
        ("eager", PLAIN),
        ("transformers' checkpointing", PLAIN + ["--gradient_checkpointing"]),
        ("level 1 + Loss+", TORCH + ["--memory_opt_config", "Layer+:1:-1,Loss+:1:-1"]),
    ]
    if liger:
        rows.insert(2, ("checkpointing + Liger's fused linear cross-entropy", PLAIN + ["--gradient_checkpointing",
                                                                                    "--liger_flce"]))  # fmt: skip
    return rows


def fixed_recipes(liger: bool, labels) -> list:
    """The fixed recipes named by `labels` (all where None), in the benchmark's order."""
    rows = recipes(liger)
    if labels is None:
        return rows
    unknown = [label for label in labels if label not in dict(rows)]
    if unknown:
        raise SystemExit(f"--recipes {unknown[0]!r}: the recipes are {', '.join(repr(r) for r, _ in rows)}, as in "
                         "--recipes 'level 1 + Loss+'")  # fmt: skip
    return [(label, flags) for label, flags in rows if label in labels]


def card_budget_mb(device: str):
    """`memopt-plan`'s budget for the card here: its memory less 1 GiB for the context and the libraries, less 5%."""
    if device != "cuda":
        return None
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 2**20
    return (total - 1024) * 0.95


def row(label, flags, batch, a, model, seq):
    m = run_child([DECODER], label, [*flags, *model, *COMMON, *a.precision, "--seq", str(seq)], batch, a.steps)
    timed = m.ok and m.step_time_s
    out = {"label": label, "ok": m.ok, "error": m.error, "peak_mb": m.peak_mb, "step_s": m.step_time_s,
           "tokens_per_s": batch * seq / m.step_time_s if timed else None, "auto": m.auto, "oom": m.oom,
           "device": m.device, "speed_steps": m.speed_steps, "speed_settled": m.speed_settled,
           # what step one took beyond a steady step (`auto`'s dry run, a first step's kernels and allocations), and
           # the part of it the levers' measurements after step one took, by lever
           "start_s": m.first_step_s - m.step_time_s if timed and m.first_step_s else None,
           "levers_measured_s": m.plans.levers_measured_s if m.plans is not None else None}  # fmt: skip
    said = f"{m.peak_mb:,.1f} MiB, {out['tokens_per_s']:,.0f} tokens/s" if m.ok else f"failed: {m.error}"
    if m.ok and not m.speed_settled:
        said += f" (of steps auto still measured: too few steps, --steps {a.steps})"
    print(f"    {label}: {said}", flush=True)
    return out


def merged(rounds: list) -> dict:
    """One row's rounds as one: its peak (the highest), its speed (the median) and every round's."""
    ok = [r for r in rounds if r["ok"]]
    first = dict(rounds[0])
    if ok:
        first.update(ok[0])
        first["peak_mb"] = max(r["peak_mb"] for r in ok)
        first["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in ok)
    first["rounds"] = [r["tokens_per_s"] for r in rounds]
    return first


def card_name(device: str):
    """The device table's name of the card here (`planning.devices`), "cpu" on the CPU, None for a card not in it
    (its plan then takes the H100's kernels, and the run refuses a file for other kernels, saying so)."""
    if device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0)
    cards = (("H200", "H200"), ("H100", "H100-80GB"), ("A100", "A100-80GB"), ("L40S", "L40S"), ("L4", "L4"))
    for part, table in cards:
        if part in name:
            return table
    return None


def planned(model, batch, seq, budget, device, path) -> float:
    """`memopt-plan`'s file for the setup's step under `budget` (its `auto` row alone), written to `path` by the same
    code in this process, for the config decoder.py builds, its LoRA, weights' dtype, precision and optimizer: what a
    run's `--memory_plan_file` is compared with. The seconds it took."""
    from transformers import HfArgumentParser

    import optimum_memopt

    sys.path.insert(0, os.path.dirname(DECODER))
    import decoder

    (d,) = HfArgumentParser(decoder.DecoderArguments).parse_args_into_dataclasses([*model, "--seq", str(seq)])
    config = decoder.config_of(d)
    lora = {"r": d.lora_r, "lora_alpha": 2 * d.lora_r, "lora_dropout": d.lora_dropout} if d.lora_r else None
    began = time.perf_counter()
    optimum_memopt.plan(
        config, batch=batch, seq=seq, bf16=device == "cuda", dtype=d.weights_dtype, lora=lora, optim=COMMON[1],
        budget_mb=budget, device=card_name(device), search=False, rows=["auto"],
    ).write_json(path)  # fmt: skip
    return time.perf_counter() - began


def earlier_fixed(path: str, name: str, seq: int, card) -> list:
    """The fixed rows of an earlier report for the same setup and length, measured on the same card (refused
    otherwise: figures of another card are not this one's)."""
    with open(path, encoding="utf-8") as f:
        earlier = json.load(f)
    if earlier.get("card") != card:
        raise SystemExit(f"--fixed_from {path}: measured on {earlier.get('card')!r}, this card is {card!r}")
    for setup in earlier["setups"]:
        if setup["setup"] == name and setup["seq"] == seq and setup["fixed"]:
            return setup["fixed"]
    raise SystemExit(f"--fixed_from {path}: no fixed rows for {name} at {seq:,} tokens")


def verdicts(auto: dict, budget: float, fixed: list) -> dict:
    """`auto`'s goals at one budget, each a figure and whether it holds."""
    fits = [r for r in fixed if r["ok"] and r["peak_mb"] <= budget]
    fastest = max(fits, key=lambda r: r["tokens_per_s"]) if fits else None
    spread = max((((max(r["rounds"]) - min(r["rounds"])) / max(r["rounds"])) for r in fixed + [auto] if r["ok"]
                  and len(r["rounds"]) > 1 and min(r["rounds"])), default=None)  # fmt: skip
    dry = (auto.get("auto") or {}).get("dry_run_peak_mb")
    out = {"within_budget": auto["ok"] and auto["peak_mb"] <= budget}
    if auto["ok"] and dry is not None:
        out["dry_run_error"] = (dry - auto["peak_mb"]) / auto["peak_mb"]
    if auto["ok"] and fastest is not None:
        out["fastest_fixed"] = fastest["label"]
        out["speed_vs_fastest"] = auto["tokens_per_s"] / fastest["tokens_per_s"]
    out["spread"] = spread
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", nargs="*", default=None, help=f"of: {', '.join([*SETUPS, *TINY])} (default: all)")
    p.add_argument("--seqs", type=int, nargs="*", default=None, help="the sequence lengths (default: each setup's)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every row")
    p.add_argument(
        "--steps",
        type=int,
        default=6,
        help="training steps a run (the first two are the warm-up; `auto` measures up to 3)",
    )
    p.add_argument("--tiny", action="store_true", help="tiny setups on the CPU: the benchmark's check")
    p.add_argument("--budgets", type=int, default=None, help="the first N budgets alone (the card's, then down)")
    p.add_argument("--budgets_mb", type=float, nargs="*", default=None, help="auto at these budgets alone (MiB)")
    p.add_argument("--fixed_from", default=None, help="an earlier report of this benchmark on the same card: its "
                   "fixed rows for the same setup and length, instead of running them again")  # fmt: skip
    p.add_argument("--no_file_rows", action="store_true", help="leave out auto from memopt-plan's file")
    p.add_argument("--no_fixed", action="store_true", help="no fixed recipe (a length none of them fits)")
    p.add_argument("--recipes", nargs="*", default=None, help="the fixed recipes to run, by label (default: all)")
    p.add_argument("--host_mb", type=float, default=None, help="the host memory auto may offload to (MiB)")
    p.add_argument("--without_offload_too", action="store_true",
                   help="beside each auto row, auto with no host room to offload to (--memory_host_mb 1)")  # fmt: skip
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "real_size.json"))
    a = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    setups = {k: v for k, v in (TINY if a.tiny else SETUPS).items() if a.setups is None or k in a.setups}
    a.precision = ["--use_cpu"] if device == "cpu" else ["--bf16"]
    try:
        import liger_kernel  # noqa: F401

        liger = device == "cuda"
    except ImportError:
        liger = False
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": device, "torch": torch.__version__,
              "card": torch.cuda.get_device_name(0) if device == "cuda" else None, "rounds": a.rounds,
              "liger": liger or "not installed (or not on a card): its row left out", "setups": []}  # fmt: skip

    def save():
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)

    for name, (model, batch, seqs) in setups.items():
        for seq in a.seqs or seqs:
            print(f"{name}, batch {batch} x {seq:,} tokens", flush=True)
            setup = {"setup": name, "batch": batch, "seq": seq, "fixed": [], "auto": [], "from_file": []}
            report["setups"].append(setup)
            if a.fixed_from:
                setup["fixed"] = earlier_fixed(a.fixed_from, name, seq, report["card"])
                setup["fixed_from"] = a.fixed_from
            elif a.no_fixed:
                setup["fixed"] = []
            else:
                chosen = fixed_recipes(liger, a.recipes)
                runs = {label: [] for label, _ in chosen}
                for _ in range(a.rounds):  # interleaved: what drifts spreads over every row alike
                    for label, flags in chosen:
                        runs[label].append(row(label, flags, batch, a, model, seq))
                setup["fixed"] = [merged(r) for r in runs.values()]
            save()
            budgets = a.budgets_mb or [card_budget_mb(device)] + sorted(
                {r["peak_mb"] for r in setup["fixed"] if r["ok"]}, reverse=True
            )
            for budget in [b for b in budgets if b is not None][: a.budgets]:
                flags = TORCH + ["--memory_opt_config", "auto", "--memory_budget_mb", f"{budget:.1f}"]
                ways = [("", flags + (["--memory_host_mb", f"{a.host_mb:g}"] if a.host_mb else []))]
                if a.without_offload_too:  # no room on the host: no offload option is offered
                    ways.append((", no offload", flags + ["--memory_host_mb", "1"]))
                runs = {label: [] for label, _ in ways}
                for _ in range(a.rounds):  # interleaved
                    for label, way in ways:
                        runs[label].append(row(f"auto{label}, {budget:,.1f} MiB", way, batch, a, model, seq))
                for label, _ in ways:
                    auto = merged(runs[label])
                    auto["budget_mb"], auto["offload"] = budget, not label
                    auto["verdicts"] = verdicts(auto, budget, setup["fixed"])
                    setup["auto"].append(auto)
                    print(f"      {json.dumps(auto['verdicts'])}", flush=True)
                save()
                if a.no_file_rows:
                    continue
                # the same from memopt-plan's file: no dry run at the run's start (its `start_s` beside auto's)
                path = os.path.join(os.path.dirname(os.path.abspath(a.out)), f"plan_{name}_{seq}_{budget:.0f}.json")
                plan_s = planned(model, batch, seq, budget, device, path)
                flags = TORCH + ["--memory_plan_file", path]
                label = f"auto from memopt-plan's file, {float(int(budget)):,.1f} MiB"
                from_file = merged([row(label, flags, batch, a, model, seq) for _ in range(a.rounds)])
                from_file["budget_mb"], from_file["plan_s"] = float(int(budget)), plan_s
                from_file["verdicts"] = verdicts(from_file, float(int(budget)), setup["fixed"])
                setup["from_file"].append(from_file)
                print(f"      {json.dumps(from_file['verdicts'])}", flush=True)
                save()
    print(f"every figure: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
