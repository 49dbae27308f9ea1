"""The recipes' offline data and tokenizer: the same in every process, so two runs of one command train on the same
token ids (the tokenizers library's WordPiece trainer gave a different vocabulary in each process)."""

import subprocess
import sys

import pytest

from optimum_memopt.offline_defaults import SPECIALS, classification_rows, train_tokenizer

CODE = (
    "import json\n"
    "from optimum_memopt.offline_defaults import classification_rows, train_tokenizer\n"
    "tok = train_tokenizer([r['sentence'] for r in classification_rows(300)])\n"
    "print(json.dumps(sorted(tok.get_vocab().items())))\n"
)


@pytest.mark.slow
def test_tokenizer_is_the_same_in_every_process():
    vocabs = [
        subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=300).stdout
        for _ in range(2)
    ]
    assert vocabs[0] == vocabs[1] and len(vocabs[0]) > 100


def test_tokenizer_vocabulary():
    corpus = [r["sentence"] for r in classification_rows(300)]
    tok = train_tokenizer(corpus)
    vocab = tok.get_vocab()
    assert [vocab[s] for s in SPECIALS] == list(range(len(SPECIALS)))
    # every corpus word is one token between [CLS] and [SEP]; an unseen ending falls back to characters
    assert len(tok(corpus[0])["input_ids"]) == len(corpus[0].split()) + 2
    assert tok.convert_ids_to_tokens(tok("goodish")["input_ids"]) == ["[CLS]", "good", "##i", "##s", "##h", "[SEP]"]
    small = train_tokenizer(corpus, vocab_size=60)
    assert len(small.get_vocab()) == 60


def test_decoder_configs_have_grouped_query_attention_and_name_an_unknown_family():
    import pytest
    import transformers

    from optimum_memopt.offline_defaults import model_config

    llama = model_config("llama", "tiny", 300, 0, max_positions=256)
    assert (llama.model_type, llama.num_hidden_layers, llama.hidden_size) == ("llama", 2, 64)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.max_position_embeddings) == (2, 1, 256)
    assert model_config("qwen2", "small", 300, 0).num_key_value_heads == 2
    if hasattr(transformers, "Qwen3Config"):
        qwen3 = model_config("qwen3", "tiny", 300, 0)
        assert (qwen3.model_type, qwen3.head_dim) == ("qwen3", 32)
    with pytest.raises(ValueError, match=r"`--model_type` is 'gpt2'; expected one of 'deberta-v2', .*'qwen3'"):
        model_config("gpt2", "tiny", 300, 0)


def test_text_datasets_generated_and_from_local_files(tmp_path):
    import pytest

    from optimum_memopt.offline_defaults import text_datasets, text_lines

    generated = text_datasets(offline_lines=200)
    assert (generated["train"].num_rows, generated["validation"].num_rows) == (200, 100)
    assert generated["train"]["text"] == text_lines(200, seed=0)
    (tmp_path / "train.txt").write_text("one line\nanother line\n")
    assert text_datasets(train_file=str(tmp_path / "train.txt"))["train"]["text"] == ["one line", "another line"]
    with pytest.raises(ValueError, match=r"`--validation_file` '.*missing.txt' does not exist"):
        text_datasets(train_file=str(tmp_path / "train.txt"), validation_file=str(tmp_path / "missing.txt"))
    (tmp_path / "train.parquet").write_text("")
    with pytest.raises(ValueError, match=r"must be .txt, .csv or .json, got 'parquet'"):
        text_datasets(train_file=str(tmp_path / "train.parquet"))
