"""Corpora as users bring them: other encodings, empty files, character-level tokens, files edited after preparing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from plyx.specs.cli import main
from plyx.train import ShardSet, Trainer, TrainOptions, load_tokenizer, prepare_corpus
from plyx.train._prepare import CorpusError, prepare_bundled
from plyx.train._tokenizer import EOS_TOKEN, train_char

QUIET = {"progress": False, "tensorboard": False, "handle_signals": False}


def test_undecodable_corpus_names_file_offset_line_and_options(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "latin1.txt"
    corpus.write_bytes("first line\nsecond: caf\u00e9 and more\n".encode("latin-1"))  # 0xe9 at offset 22
    with pytest.raises(CorpusError) as info:
        prepare_corpus(corpus, tmp_path / "out", vocab_size=300, use_hooks=False)
    msg = str(info.value)
    assert str(corpus) in msg and "byte 0xe9 at offset 22 (line 2)" in msg
    assert "--encoding latin-1" in msg and "--errors replace" in msg and "iconv" in msg
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "cli"), "--vocab-size", "300",
                 "--no-hooks"]) == 2
    assert "offset 22 (line 2)" in capsys.readouterr().err
    # the options the message names work
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "l1"), "--vocab-size", "300", "--no-hooks",
                 "--encoding", "latin-1"]) == 0
    tok = load_tokenizer(tmp_path / "l1")
    ids = np.concatenate([a for _, a in ShardSet.open(tmp_path / "l1").split("train")]).tolist()
    assert "caf\u00e9" in tok.decode(ids)
    assert main(["data", "prepare", str(corpus), "--out", str(tmp_path / "rep"), "--vocab-size", "300", "--no-hooks",
                 "--errors", "replace", "--val-fraction", "0"]) == 0
    ids = np.concatenate([a for _, a in ShardSet.open(tmp_path / "rep").split("train")]).tolist()
    assert "caf\ufffd" in load_tokenizer(tmp_path / "rep").decode(ids)


def test_jsonl_decode_error_names_the_file(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(CorpusError, match=r"docs\.jsonl is not utf-8 text: byte 0xff at offset 25 \(line 2\)"):
        prepare_corpus(corpus, tmp_path / "out", vocab_size=300, use_hooks=False)


def test_empty_corpus_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    assert main(["data", "prepare", str(empty), "--out", str(tmp_path / "out"), "--no-hooks"]) == 2
    assert "holds no text" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_char_tokenizer_round_trips_with_nanogpt_ids() -> None:
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\u00f4"
    tok = train_char([text])
    chars = sorted(set(text))
    assert tok.encode(text) == [chars.index(c) for c in text]  # nanoGPT's stoi: sorted characters
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == len(chars) and tok.vocab_size == len(chars) + 2
    assert tok.encode("F\u00df")[1] == len(chars) + 1  # an unseen character is <|unk|>, not EOS
    assert tok.decode([*tok.encode("Fi"), tok.eos_id]) == "Fi" + EOS_TOKEN
    with pytest.raises(ValueError, match="empty"):
        train_char([""])


def test_bundled_char_preparation_matches_nanogpt() -> None:
    out = prepare_bundled(vocab_size=1024, tokenizer="char")
    shards = ShardSet.open(out)
    tok = load_tokenizer(out)
    assert tok.vocab_size == 67  # nanoGPT's 65 characters + EOS + UNK
    train = np.concatenate([a for _, a in shards.split("train")])
    val = np.concatenate([a for _, a in shards.split("val")])
    text = Path(prepare_bundled.__globals__["bundled_corpus"]()).read_text(encoding="utf-8")
    n = len(text)
    assert len(train) + len(val) == n + 1  # one stream, one EOS at its end
    # nanoGPT: train_ids = encode(data[:int(n*0.9)]); ours cuts the stream (with its EOS) at the same 90%
    chars = sorted(set(text))
    assert train[:1000].tolist() == [chars.index(c) for c in text[:1000]]
    assert train[:1000].tolist() == tok.encode(text[:1000])  # the numpy fast path == the tokenizer
    assert abs(len(train) - int(n * 0.9)) <= 1


def test_sample_of_a_char_run_is_text(tmp_path: Path, corpus: Path, tiny_config) -> None:
    cfg = tiny_config(tmp_path / "unused", tmp_path / "run", steps=2, eval_every=0, checkpoint_every=0,
                      sample_tokens=12, data={"path": str(corpus), "tokenizer": "char"},
                      model={"vocab_size": 64})
    result = Trainer(cfg, options=TrainOptions(**QUIET)).fit()
    assert len(result.sample) >= 1 and not result.sample.replace(" ", "").isdigit()
    allowed = set(corpus.read_text(encoding="utf-8")) | set(EOS_TOKEN) | set("<|unk|>")
    assert set(result.sample) <= allowed


def _manifest_mtime(run: Path) -> int:
    return (run / "data" / "manifest.json").stat().st_mtime_ns


def test_raw_corpus_is_prepared_again_when_it_or_the_settings_change(tmp_path: Path, tiny_config) -> None:
    """The issue's path: an empty corpus fails, the user fills it, and the run now uses the new text."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("", encoding="utf-8")
    cfg = tiny_config(tmp_path / "unused", tmp_path / "run", data={"path": str(corpus)})
    with pytest.raises(CorpusError, match="holds no text"):
        Trainer(cfg, options=TrainOptions(**QUIET))
    words = "the king and queen spoke of war and peace and bread and wine\n\n"
    corpus.write_text(words * 60, encoding="utf-8")
    said: list[str] = []
    trainer = Trainer(cfg, options=TrainOptions(**QUIET, print_fn=said.append))
    first = trainer.shards.tokens("train")
    assert first > 0
    stamp = _manifest_mtime(tmp_path / "run")
    # touched, same bytes: reused
    os.utime(corpus, ns=(1, 1))
    Trainer(cfg, options=TrainOptions(**QUIET))
    assert _manifest_mtime(tmp_path / "run") == stamp
    # more text: prepared again, and said so
    corpus.write_text(words * 120, encoding="utf-8")
    said.clear()
    trainer = Trainer(cfg, options=TrainOptions(**QUIET, print_fn=said.append))
    assert trainer.shards.tokens("train") > first
    assert any("changed since it was prepared" in line for line in said), said
    # another preparation setting: prepared again
    cfg2 = tiny_config(tmp_path / "unused", tmp_path / "run", data={"path": str(corpus), "val_fraction": 0.3})
    said.clear()
    trainer = Trainer(cfg2, options=TrainOptions(**QUIET, print_fn=said.append))
    assert any("val_fraction 0.2 -> 0.3" in line for line in said), said
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".data")]  # no temporaries left
