"""The breadth sweep (`scripts/families.py`) on a representative subset, inside CI's time: a dense decoder (Llama),
GPT-2 (its head tied to its input embeddings), an MoE (Qwen3-MoE), a hybrid of convolutions and attention (LFM2), an encoder-decoder's causal LM (BART's), a
vision-language model trained on text alone (Gemma 3, whose layer list starts with its vision tower), ELECTRA's
generator (its head projects the hidden states before its output embeddings, another width), HRM (its layers
run in cycles, which `auto` cannot measure: refused with the reason), and RWKV (its feed-forward carries a state:
not tiled, said, and `auto` trains). Each mode trains
as the plain run (bitwise where its plans are exact, within 1e-5 where the head's loss is summed in chunks) or is
refused with its reason; the table is written between its markers."""

import os
import sys

import pytest

pytestmark = pytest.mark.torch_backend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import families  # noqa: E402

EXACT = ("level 1", "Layer+@0")


@pytest.mark.parametrize(
    "kind", ["llama", "gpt2", "qwen3_moe", "lfm2", "bart", "gemma3", "electra", "hrm_text", "rwkv"]
)
@pytest.mark.slow
def test_each_mode_trains_as_plain_or_is_refused_with_its_reason(kind):
    # Gemma 3 on text alone: its tower's layers never run, and a loop of one's own gives `auto` no dry run to see it
    # before step one: three steps find the layers that run, the fourth is measured over them, the fifth chooses
    # (the sweep gives `auto` three steps more)
    row = families.family(kind, steps=3, seconds=120)
    assert row["plain"] == "trains", row
    for mode in EXACT:
        assert row[mode] == "equal", (mode, row)
    if kind == "bart":  # its causal LM calls `self.model.decoder`, not its backbone: said, not chunked
        assert row["Loss+ chunks2"].startswith("refused: its forward does not call its backbone"), row
    else:
        assert row["Loss+ chunks2"] in ("equal", "within 1e-5"), row
    tiles = row["MLP+ tiles2"]  # the MLP in tiles: as plain to the weights' summation order, or refused with why
    if kind == "qwen3_moe":
        assert tiles.startswith("refused: ") and "Qwen3MoeDecoderLayer.mlp is a mixture of exper" in tiles, row
    elif kind == "electra":  # BERT's layer: its MLP is two modules (`intermediate`, and `output` with the residual)
        assert tiles.startswith("refused: ") and "ElectraLayer holds no MLP the lever knows" in tiles, row
    elif kind == "rwkv":  # its feed-forward shifts tokens and carries a state: not a row-wise MLP
        assert tiles.startswith("refused: ") and "RwkvBlock.feed_forward (RwkvFeedForward) takes" in tiles, row
    elif kind in ("llama", "gpt2", "gemma3"):
        assert tiles in ("equal", "within 1e-5"), row
    else:
        assert tiles in ("equal", "within 1e-5") or tiles.startswith("refused: "), row
    if kind == "hrm_text":  # its layers run in cycles: step one cannot be measured layer by layer, said in step one
        assert row["auto"].startswith(
            "error: RuntimeError: `plans='auto'` measures step one layer by layer, but a step of HrmTextForCausalLM "
            "runs layers 0 (HrmTextDec"
        ), row
    else:
        assert row["auto"].startswith(("equal", "within 1e-5")) and "chose" in row["auto"], row
        # under a budget halfway down to the least any choice reaches: a choice that recomputes something, trained
        # as plain with every check within the budget, or `auto`'s own refusal (BART's: its head cannot be chunked)
        tight = row["auto tight"]
        chose = tight.startswith(("equal", "within 1e-5")) and "chose `" in tight and "chose `nothing`" not in tight
        assert chose or tight.startswith("error: RuntimeError: `plans='auto'` found nothing that fits"), row
        assert "OVER" not in tight, row


def test_the_table_goes_between_its_markers(tmp_path):
    doc = tmp_path / "COMPATIBILITY.md"
    doc.write_text("# Compatibility\n\nabove\n")
    rows = [{"family": "llama", "plain": "trains", "level 1": "equal", "Layer+@0": "equal"}]
    families.write(str(doc), families.table(rows))
    families.write(str(doc), families.table(rows + [{"family": "bart", "plain": "trains"}]))  # replaced, not added
    text = doc.read_text()
    assert text.count(families.BEGIN) == 1 and "| bart | trains |" in text and text.startswith("# Compatibility")
    assert "Trained as plain: level 1 1, Layer+@0 1, Loss+ chunks2 0, MLP+ tiles2 0, auto 0, auto tight 0." in text
