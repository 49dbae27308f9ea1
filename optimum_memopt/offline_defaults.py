"""Offline defaults for the recipes, the probe and the benchmark: generated text of a realistic
shape, a tokenizer trained on it locally, and DeBERTa-v2 / RoBERTa encoders and Llama / Qwen2 /
Qwen3 decoders built from configs in code. Nothing is downloaded. Also the recipes' text data:
a hub dataset, local files or generated lines (`text_datasets`).
"""

import random
from typing import Dict, List

from transformers import DebertaV2Config, PreTrainedTokenizerFast, RobertaConfig

SIZES = {
    # layers, hidden, heads, intermediate
    "tiny": (2, 64, 2, 128),
    "small": (4, 256, 4, 1024),
    "deberta-base-shape": (12, 768, 12, 3072),
    "large": (24, 1024, 16, 4096),
}

_POS = "good great fine lovely superb bright happy calm clever kind warm solid".split()
_NEG = "bad poor dull awful grim weak sad tense clumsy rude cold broken".split()
_NOUNS = "film book song meal trip game story garden city river train house movie plan".split()
_FILL = "the a this that it was is very quite rather and but so then really truly somewhat".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _sentence(rng: random.Random, polarity: int, min_words=4, max_words=60) -> str:
    n = rng.randint(min_words, max_words)
    words = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            words.append(rng.choice(_POS if polarity else _NEG))
        elif r < 0.2:
            words.append(rng.choice(_NEG if polarity else _POS))
        elif r < 0.45:
            words.append(rng.choice(_NOUNS))
        else:
            words.append(rng.choice(_FILL))
    return " ".join(words)


def classification_rows(n: int, seed: int = 0, pairs: bool = False) -> List[Dict]:
    """Sentiment-like sentences of 4 to 60 words (so batches carry a lot of padding)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randint(0, 1)
        row = {"sentence1" if pairs else "sentence": _sentence(rng, label), "label": label}
        if pairs:
            row["sentence2"] = _sentence(rng, label if rng.random() < 0.8 else 1 - label, 3, 30)
        rows.append(row)
    return rows


def text_lines(n: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [_sentence(rng, rng.randint(0, 1), 8, 80) for _ in range(n)]


def train_tokenizer(corpus: List[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer for the generated corpus, with BERT-style specials: the specials, every character (alone
    and as a `##` continuation), then the corpus's words, most frequent first (ties by spelling), up to `vocab_size`.

    Built from counted words rather than with the tokenizers library's WordPiece trainer: that trainer breaks ties
    in an order that changes from process to process, so the same command got a different vocabulary, different
    token ids and losses differing by ~1e-5 from run to run (docs/STACK.md)."""
    from collections import Counter

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts = Counter(
        word for line in corpus for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(line))
    )
    chars = sorted({c for word in counts for c in word})
    tokens = SPECIALS + chars + ["##" + c for c in chars]
    known = set(tokens)
    words = [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if w not in known]
    tokens += words[: max(0, vocab_size - len(tokens))]
    tok = Tokenizer(models.WordPiece(vocab={t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=512,
    )


ENCODERS = ("deberta-v2", "roberta")
DECODERS = ("llama", "qwen2", "qwen3")


def model_config(model_type: str, size: str, vocab_size: int, pad_token_id: int, max_positions: int = 512, **extra):
    """A config of the given family and size; dropout is kept as in the real models unless overridden. Decoders
    (`DECODERS`) have grouped-query attention, two query heads to a key/value head, as current ones do; Qwen3 its
    per-head q/k norms."""
    if size not in SIZES:
        raise ValueError(f"`--model_size` is {size!r}; expected one of {', '.join(SIZES)}")
    layers, hidden, heads, inter = SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        pad_token_id=pad_token_id,
        **extra,
    )
    if model_type == "deberta-v2":
        # DeBERTa-v2/v3 base: relative attention with c2p|p2c, no absolute positions.
        return DebertaV2Config(
            max_position_embeddings=max_positions,
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            max_relative_positions=-1,
            position_buckets=256,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            **common,
        )
    if model_type == "roberta":
        return RobertaConfig(max_position_embeddings=max_positions + 2, attn_implementation="eager", **common)
    if model_type in DECODERS:
        import transformers

        name = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[model_type]
        if not hasattr(transformers, name):
            raise ValueError(
                f"`--model_type {model_type}` needs a transformers with {name}; {transformers.__version__} has none"
            )
        decoder = dict(num_key_value_heads=max(1, heads // 2), max_position_embeddings=max_positions)
        if model_type == "qwen3":
            decoder["head_dim"] = hidden // heads
        return getattr(transformers, name)(**decoder, **common)
    families = ", ".join(repr(f) for f in ENCODERS + DECODERS)
    raise ValueError(f"`--model_type` is {model_type!r}; expected one of {families}")


def text_datasets(
    dataset_name=None,
    dataset_config_name=None,
    train_file=None,
    validation_file=None,
    offline_lines=3000,
    cache_dir=None,
):
    """The recipes' text: a hub dataset (`--dataset_name`), local files (`--train_file` / `--validation_file`: .txt,
    one document per line, or CSV / JSON with a `text` column), or, with neither, generated lines (train and
    validation drawn with different seeds). A `datasets.DatasetDict`."""
    import os

    import datasets

    if dataset_name:
        return datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
    if train_file or validation_file:
        files = {k: v for k, v in (("train", train_file), ("validation", validation_file)) if v}
        for split, path in files.items():
            if not os.path.isfile(path):
                raise ValueError(f"`--{split}_file` {path!r} does not exist")
        ext = os.path.splitext(next(iter(files.values())))[1].lstrip(".").lower()
        builder = {"txt": "text", "csv": "csv", "json": "json", "jsonl": "json"}.get(ext)
        if builder is None:
            raise ValueError(f"`--train_file` / `--validation_file` must be .txt, .csv or .json, got {ext!r}")
        return datasets.load_dataset(builder, data_files=files)
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": text_lines(offline_lines, seed=0)}),
            "validation": datasets.Dataset.from_dict({"text": text_lines(max(100, offline_lines // 10), seed=1)}),
        }
    )
