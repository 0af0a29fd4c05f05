from __future__ import annotations

import json
from pathlib import Path

import pytest
from plyx.train import Tokenizer, load_tokenizer, train_bpe
from plyx.train._tokenizer import EOS_TOKEN

TEXTS = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"] * 30


def test_byte_level_round_trip_of_unseen_text() -> None:
    tok = train_bpe(TEXTS, vocab_size=300)
    # byte-level: text with characters never seen in training still round-trips exactly
    for text in ["to be", "Ωμέγα 🙂 tab\tnew\nline", "  leading spaces", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 0 and tok.eos_token == EOS_TOKEN
    assert 257 <= tok.vocab_size <= 300


def test_merges_are_learned_and_training_is_deterministic() -> None:
    a, b = train_bpe(TEXTS, vocab_size=300), train_bpe(TEXTS, vocab_size=300)
    assert a.inner.to_str() == b.inner.to_str()
    assert a.sha256() == b.sha256()
    # a frequent word compresses to fewer tokens than its bytes
    assert len(a.encode(" question")) < len(b" question")


def test_save_and_load(tmp_path: Path) -> None:
    tok = train_bpe(TEXTS, vocab_size=280)
    path = tok.save(tmp_path / "tokenizer.json")
    loaded = load_tokenizer(tmp_path)  # a directory holding tokenizer.json works too
    assert loaded.encode("to be or not") == tok.encode("to be or not")
    assert loaded.sha256() == tok.sha256() and loaded.path == path


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a Hugging Face tokenizers JSON"):
        load_tokenizer(bad)
    # a tokenizer without any end-of-document token is refused, naming what was looked for
    tok = train_bpe(TEXTS, vocab_size=280)
    doc = json.loads(tok.inner.to_str())
    doc["added_tokens"] = []
    doc["model"]["vocab"].pop(EOS_TOKEN)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="no end-of-document token"):
        load_tokenizer(odd)


def test_too_small_vocab_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(TEXTS, vocab_size=100)


def test_wraps_any_tokenizers_object() -> None:
    tok = train_bpe(TEXTS, vocab_size=280)
    again = Tokenizer(tok.inner, eos_token=EOS_TOKEN)
    assert again.encode_batch(["to be", "or not"]) == [tok.encode("to be"), tok.encode("or not")]
