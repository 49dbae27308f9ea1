#!/usr/bin/env python
"""Every causal-LM family of the installed transformers, at tiny size, trained a few steps in each of the torch
backend's modes against the same steps without the plugin; one row a family in a Markdown table.

    python scripts/families.py                              # every family; the table into docs/COMPATIBILITY.md
    python scripts/families.py --families llama,qwen3_moe --out -      # some, the table on stdout

Each family's default config (`AutoConfig.for_model`) is shrunk (2 layers, hidden 64, 4 heads, 4 experts choosing 2,
vocabulary 256, and each sub-config of a tower alike) and built with `AutoModelForCausalLM.from_config`; each mode
trains a fresh copy (seed 0) for `--steps` SGD steps on two 16-token sequences and is compared step by step with the
plain run: `equal` (bitwise), `within 1e-5` (relative, what chunked losses reach: a sum in another order), `differs`
(with the largest relative difference; "another draw of its dropout, said" where the plugin said its tiles draw
other masks), `refused` (the plugin said why, quoted), or `error` (the exception). A family
that cannot be built or trained plainly at that size says so and is left out of the modes. Modes: level 1; layer 0
recomputed whole (`Layer+:1:-1@0`); the head and loss in 2 chunks (`Loss+:1:-1@chunks2`); every layer's MLP in 2 tiles
of tokens (`MLP+:1:-1@tiles2`); `auto` under a budget it
meets by choosing nothing (the path: its measurement and choice, and the steps after), with the choice said; and
`auto` under a tight budget, halfway from the least any choice reaches to eager's peak (both from the
run before), with its choice, the budget, and any check that read over it. Both `auto` runs take three steps more
than the others (`AUTO_MORE`).
"""

import argparse
import contextlib
import io
import logging
import os
import re
import signal
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SMALL = dict(
    num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, hidden_size=64, d_model=64, n_embd=64,
    intermediate_size=128, ffn_dim=128, n_inner=128, num_attention_heads=4, n_head=4, num_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=0,
    n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    decoder_layers=2, encoder_layers=2, decoder_attention_heads=4, encoder_attention_heads=4, decoder_ffn_dim=128,
    encoder_ffn_dim=128, num_decoder_layers=2, vision_layers=2, depth=2, embed_dim=32,
)  # fmt: skip
MODES = {
    "level 1": dict(level=1),
    "Layer+@0": dict(plans="Layer+:1:-1@0"),
    "Loss+ chunks2": dict(plans="Loss+:1:-1@chunks2"),
    "MLP+ tiles2": dict(plans="MLP+:1:-1@tiles2"),
    "auto": dict(plans="auto", budget_mb=1e6),
    # halfway from the least any choice reaches to eager's peak, both from the "auto" run before it
    "auto tight": dict(plans="auto", budget_mb=None),
}
TIGHT = 0.5
BEGIN, END = "<!-- families: begin -->", "<!-- families: end -->"


def shrink(config) -> None:
    """`config` and every sub-config it holds, each field of `SMALL` it has set to the small value."""
    seen = set()

    def visit(c) -> None:
        if id(c) in seen:
            return
        seen.add(id(c))
        for key, value in SMALL.items():
            if key in vars(c) and isinstance(getattr(c, key), int) and not isinstance(getattr(c, key), bool):
                setattr(c, key, value)
        if hasattr(c, "qk_rope_head_dim") and "head_dim" in vars(c):
            c.head_dim = c.qk_rope_head_dim
        vocab = getattr(c, "vocab_size", None)
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # ids past the small vocabulary
            value = getattr(c, key, None)
            if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
                setattr(c, key, vocab - 1)
        for value in list(vars(c).values()):
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):
                visit(value)

    visit(config)
    for key in ("use_cache",):
        if hasattr(config, key):
            setattr(config, key, False)


def build(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(kind)
    shrink(config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def batches(steps: int, vocab: int):
    out = []
    for step in range(steps):
        ids = torch.randint(0, min(vocab, 256), (2, 16), generator=torch.Generator().manual_seed(step))
        out.append(ids)
    return out


def train(kind: str, steps: int, mode: dict = None):
    """The steps' losses, with the plugin on as `mode` says (None: without it), and what it said."""
    import optimum_memopt

    model = build(kind)
    model.train()
    said = []
    handle = None
    if mode is not None:
        mode = dict(mode)
        handle = optimum_memopt.optimize_memory(
            model, mode.pop("plans", None), level=mode.pop("level", 0), say=said.append, **mode
        )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    vocab = model.config.get_text_config().vocab_size
    for ids in batches(steps, vocab):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.item())
        opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.step_done()
    figures = {}
    if handle is not None:
        auto = getattr(handle, "auto", None)
        if auto is not None:
            said.append(f"chose `{auto.get('config') or 'nothing'}`")
            planner = handle.planner
            figures = {
                "eager": planner.verified[0]["measured_peak_mb"] if planner.verified else None,
                "floor": planner.fits[0].floor.peak_mb if planner.fits else None,
                "checks": [c["measured_peak_mb"] for c in auto.get("checks", [])],
            }
        handle.remove()
    return losses, said, figures


class Timeout(Exception):
    pass


class Heard(logging.Handler):
    """The plugin's warnings while it is on (`with Heard() as heard`), by their text."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("optimum_memopt").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("optimum_memopt").removeHandler(self)


@contextlib.contextmanager
def limit(seconds: int):
    def stop(signum, frame):
        raise Timeout(f"ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def short(text: str, n: int = 110) -> str:
    text = re.sub(r"\s+", " ", str(text)).replace("|", "/").strip()
    return text if len(text) <= n else text[: n - 3] + "..."


def reason(message: str) -> str:
    """A refusal's reason, without the words every refusal of its kind repeats (`Loss+`'s form)."""
    found = re.search(r"only row-wise statements between; (.*), so its head is not chunked", message, re.S)
    return found.group(1) if found else message


def compare(plain, ran) -> str:
    if ran == plain:
        return "equal"
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain, ran))
    return "within 1e-5" if worst <= 1e-5 else f"differs ({worst:.1e})"


# `auto` runs this many steps more: where a step leaves the list's first layer out (a VLM's tower on text alone), a
# loop of one's own gives it no dry run, and it finds the layers that run in three steps before it measures and chooses
AUTO_MORE = 3


def family(kind: str, steps: int, seconds: int) -> dict:
    row = {"family": kind}
    try:
        with limit(seconds), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            plain, _, _ = train(kind, steps + AUTO_MORE)
    except Exception as e:  # the family itself, before the plugin: said, and its modes left out
        row["plain"] = f"not trained plainly: {type(e).__name__}: {short(e, 90)}"
        return row
    row["plain"] = "trains"
    roomy = {}  # the "auto" run's figures: eager's peak and the least any choice reaches
    for name, mode in MODES.items():
        began = time.perf_counter()
        if name == "auto tight":
            if not (roomy.get("eager") and roomy.get("floor")):
                row[name] = "-"
                continue
            budget = round(roomy["floor"] + TIGHT * (roomy["eager"] - roomy["floor"]), 3)
            mode = dict(mode, budget_mb=budget)
        heard = Heard()
        try:
            with limit(seconds), warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), heard:
                warnings.simplefilter("ignore")
                n = steps + AUTO_MORE if name.startswith("auto") else steps
                ran, said, figures = train(kind, n, mode)
            cell = compare(plain[:n], ran)
            if cell.startswith("differs") and any("draws at random" in m for m in heard.messages):
                cell += ": another draw of its dropout, said"  # `MLP+` on an MLP drawing several times
            if name == "auto":
                roomy = figures
            if name.startswith("auto") and said and said[-1].startswith("chose"):
                cell += f"; {said[-1]}"
            if name == "auto tight":
                over = [c for c in figures.get("checks", []) if c is not None and c > mode["budget_mb"]]
                cell += f" under {mode['budget_mb']} MiB" + (f": OVER it at {max(over):.3f} MiB" if over else "")
        except ValueError as e:  # the plugin's refusals are ValueErrors that say why
            cell = f"refused: {short(reason(str(e)))}"
        except Exception as e:
            cell = f"error: {type(e).__name__}: {short(e)}"
        row[name] = cell
        row["seconds"] = row.get("seconds", 0.0) + time.perf_counter() - began
    return row


def table(rows) -> str:
    import transformers

    head = ["family", "plain", *MODES]
    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}; {len(rows)} families, "
        f"{sum(r.get('plain') == 'trains' for r in rows)} trained plainly at this size.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in rows:
        lines.append("| " + " | ".join(r.get(k, "-") for k in head) + " |")
    counts = {m: sum(r.get(m, "").startswith(("equal", "within")) for r in rows) for m in MODES}
    lines += ["", "Trained as plain: " + ", ".join(f"{m} {n}" for m, n in counts.items()) + "."]
    return "\n".join(lines)


def write(path: str, text: str) -> None:
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + block + doc[doc.index(END) + len(END) :]
    else:
        doc = doc.rstrip("\n") + "\n\n## Every causal-LM family (`python scripts/families.py`)\n\n" + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)


def kinds() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=None, help="comma-separated model types (default: every causal LM)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seconds", type=int, default=180, help="the most one run may take")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "COMPATIBILITY.md"), help="'-': stdout")
    a = p.parse_args(argv)
    chosen = a.families.split(",") if a.families else kinds()
    rows = []
    for kind in chosen:
        rows.append(family(kind, a.steps, a.seconds))
        row = rows[-1]
        print(
            f"{kind} ({row.get('seconds', 0):.0f} s): "
            + " | ".join(f"{k}: {v}" for k, v in row.items() if k not in ("family", "seconds")),
            flush=True,
        )
    text = table(rows)
    if a.out == "-":
        print(text)
    else:
        write(a.out, text)
        print(f"families: the table is in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
