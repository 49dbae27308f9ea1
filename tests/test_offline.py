"""The recipes' offline data and tokenizer: the same in every process, so two runs of one command train on the same
token ids (the tokenizers library's WordPiece trainer gave a different vocabulary in each process)."""

import subprocess
import sys

from optimum_memopt.offline_defaults import SPECIALS, classification_rows, train_tokenizer

CODE = (
    "import json\n"
    "from optimum_memopt.offline_defaults import classification_rows, train_tokenizer\n"
    "tok = train_tokenizer([r['sentence'] for r in classification_rows(300)])\n"
    "print(json.dumps(sorted(tok.get_vocab().items())))\n"
)


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
