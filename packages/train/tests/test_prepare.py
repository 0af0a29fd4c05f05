from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import ShardSet, bundled_corpus, load_tokenizer, prepare_corpus, read_documents
from plyx.train._prepare import BUNDLED_SHA256


def _decoded(out: Path) -> str:
    shards = ShardSet.open(out)
    tok = load_tokenizer(out)
    ids = np.concatenate([a for split in ("train", "val") for _, a in shards.split(split)])
    return tok.decode(ids.tolist())


def test_prepare_writes_tokenizer_shards_and_manifest(tmp_path: Path, corpus: Path) -> None:
    report = prepare_corpus(corpus, tmp_path, vocab_size=300, val_fraction=0.25, separator="\n\n", use_hooks=False)
    docs = list(read_documents(corpus, separator="\n\n"))
    assert report.documents == len(docs) and report.dropped == 0
    shards = ShardSet.open(tmp_path)
    total = report.tokens["train"] + report.tokens["val"]
    assert report.tokens["val"] == round(total * 0.25)
    assert shards.eos_id == 0 and shards.tokenizer_path == tmp_path / "tokenizer.json"
    assert shards.manifest["tokenizer_sha256"] == load_tokenizer(tmp_path).sha256()
    # the token stream is exactly the documents, each followed by EOS
    assert _decoded(tmp_path) == "".join(d + "<|endoftext|>" for d in docs)
    assert sum(e["documents"] for s in shards.manifest["splits"].values() for e in s) == len(docs)


def test_existing_tokenizer_is_reused(tmp_path: Path, corpus: Path, prepared: Path) -> None:
    prepare_corpus(corpus, tmp_path, tokenizer=prepared / "tokenizer.json", val_fraction=0.2, separator="\n\n",
                   use_hooks=False)
    assert load_tokenizer(tmp_path).sha256() == load_tokenizer(prepared).sha256()
    for split in ("train", "val"):
        a = ShardSet.open(tmp_path).split(split)[0][1]
        b = ShardSet.open(prepared).split(split)[0][1]
        assert np.array_equal(a, b)


class _Filters:
    """A document-filter plugin like plyx-safety's: drops one kind of document, redacts another."""

    @hookimpl
    def plyx_document_filters(self, context: dict) -> list:
        self.context = context

        def drop(text: str) -> str | None:
            return None if "DROPME" in text else text

        def redact(text: str) -> str:
            return text.replace("secret-token-42", "[REDACTED]")

        return [drop, redact]


def test_document_filter_hook(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    rows = [{"text": "keep this one"}, {"text": "DROPME please"}, {"text": "key is secret-token-42 ok"}] * 20
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    plugin = _Filters()
    register_plugin(plugin, "test-filters")
    try:
        report = prepare_corpus(corpus, tmp_path / "out", vocab_size=270, val_fraction=0.0)
    finally:
        unregister_plugin("test-filters")
    assert plugin.context == {"corpus": str(corpus), "out_dir": str(tmp_path / "out")}
    assert (report.documents, report.dropped, report.redacted) == (40, 20, 20)
    shards = ShardSet.open(tmp_path / "out")
    text = load_tokenizer(tmp_path / "out").decode(shards.split("train")[0][1].tolist())
    assert "DROPME" not in text and "secret-token-42" not in text and "[REDACTED]" in text


def test_bad_corpus_inputs(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare_corpus(tmp_path / "missing.txt", tmp_path / "o", use_hooks=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "wrong field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*`text` field"):
        prepare_corpus(bad, tmp_path / "o", use_hooks=False)
    with pytest.raises(ValueError, match=r"val_fraction=1.5"):
        prepare_corpus(bad, tmp_path / "o", val_fraction=1.5, use_hooks=False)


def test_bundled_corpus_is_tiny_shakespeare() -> None:
    path = bundled_corpus()
    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest() == BUNDLED_SHA256
    assert len(data) == 1_115_394 and data.startswith(b"First Citizen:")
    assert (path.parent / "README.md").is_file()


def test_bundled_preparation_is_cached(tmp_path: Path) -> None:
    from plyx.train import prepare_bundled

    out = prepare_bundled(tmp_path / "ts", vocab_size=300)
    manifest = out / "manifest.json"
    first = manifest.stat().st_mtime_ns
    shards = ShardSet.open(out)
    assert shards.vocab_size == 300 and shards.manifest["source"]["documents"] > 7000  # speeches
    assert load_tokenizer(out).decode(shards.split("train")[0][1][:5].tolist()).startswith("First")
    assert prepare_bundled(tmp_path / "ts", vocab_size=300) == out
    assert manifest.stat().st_mtime_ns == first  # reused, not prepared again
