"""`auto` without a dry run (as under FSDP, DeepSpeed or `--memory_auto_dry_run false`): the choice made from step one
measured, its predicted peak beside what the step after it read, on the CPU through the Trainer.

Each row a fresh process: a small Llama built in code (the tests' decoder: 3 layers, hidden 128, vocabulary 512,
batch 4 x 256; or a wider head), AdamW, `--memory_opt_config auto --memory_auto_dry_run false` under a budget. The
prediction of a choice that runs the model's own head counts its logits as held through the step (a loop keeping
`outputs`); the Trainer lets go of them, so each row shows the prediction less them (`returned_mb`) beside the
reading. Prints a table and writes the figures as JSON.

    python benchmarks/measured_choice.py --out benchmarks/measured_choice.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (vocabulary, hidden, tokens a row, batch, LoRA, bf16, budget MiB)
ROWS = {
    "decoder, budget 1e6": (512, 128, 256, 4, False, False, 1e6),
    "decoder, budget 50": (512, 128, 256, 4, False, False, 50),
    "decoder LoRA, budget 1e6": (512, 128, 256, 4, True, False, 1e6),
    "decoder bf16, budget 1e6": (512, 128, 256, 4, False, True, 1e6),
    "vocabulary 4,096, budget 1e6": (4096, 128, 256, 4, False, False, 1e6),
    "vocabulary 4,096, budget 80": (4096, 128, 256, 4, False, False, 80),
    "wide head (2,048 / 64), budget 1e6": (2048, 64, 64, 8, False, False, 1e6),
    "wide head (2,048 / 64), budget 14": (2048, 64, 64, 8, False, False, 14),
}

CHILD = r"""
import json, os, sys
sys.path.insert(0, os.path.join(ROOT, "tests"))
import torch
from helpers import Tokens, make_args
from transformers import LlamaConfig, LlamaForCausalLM
from optimum_memopt.trainer import MemoptTrainer

vocab, hidden, seq, batch, lora, bf16, budget = ARGS
torch.manual_seed(0)
layers = 3 if hidden == 128 else 2
model = LlamaForCausalLM(LlamaConfig(
    vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden if hidden == 128 else 2 * hidden,
    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max(seq, 128),
    attn_implementation="sdpa"))
if lora:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
flags = ["--per_device_train_batch_size", str(batch), "--max_steps", "4", "--memory_opt_backend", "torch",
         "--memory_opt_config", "auto", "--memory_budget_mb", str(budget), "--memory_auto_dry_run", "false"]
args = make_args(OUT, *flags, *(["--bf16"] if bf16 else []))
MemoptTrainer(model=model, args=args, train_dataset=Tokens(vocab=vocab, seq=seq)).train()
with open(os.path.join(OUT, "memory_auto", "solver.json")) as f:
    data = json.load(f)
print("FIGURES " + json.dumps({"fits": [f["config"] for f in data["fits"]], "head": data["fits"][-1]["levers"]["loss"],
                               "verified": data["verified"]}))
"""


def run(name: str, spec: tuple) -> dict:
    with tempfile.TemporaryDirectory() as out:
        code = CHILD.replace("ROOT", repr(ROOT)).replace("ARGS", repr(spec)).replace("OUT", repr(out))
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("FIGURES ")), None)
    if line is None:
        return {"row": name, "error": (done.stderr or done.stdout)[-2000:]}
    figures = json.loads(line[len("FIGURES ") :])
    check = figures["verified"][0]
    dropped = check["predicted_peak_mb"] - check.get("returned_mb", 0.0)
    return {
        "row": name,
        "budget_mb": spec[-1],
        "choice": figures["fits"][0] or "nothing recomputed",
        "head": figures["head"],
        "predicted_mb": check["predicted_peak_mb"],
        "returned_mb": check.get("returned_mb", 0.0),
        "read_mb": check["measured_peak_mb"],
        "apart_kib": (dropped - check["measured_peak_mb"]) * 1024,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rows", nargs="*", default=None, help="row names (default: all)")
    a = p.parse_args()
    rows = []
    print("| row | choice | head | predicted MiB | less logits dropped | read MiB | prediction above the reading |")
    print("|---|---|---|---|---|---|---|")
    for name, spec in ROWS.items():
        if a.rows is not None and name not in a.rows:
            continue
        r = run(name, spec)
        rows.append(r)
        if "error" in r:
            print(f"| {name} | error: {r['error'].splitlines()[-1]} |")
            continue
        print(
            f"| {name} | `{r['choice']}` | {r['head']} | {r['predicted_mb']:,.3f} | {r['returned_mb']:,.3f} | "
            f"{r['read_mb']:,.3f} | {r['apart_kib']:+,.1f} KiB |",
            flush=True,
        )
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
