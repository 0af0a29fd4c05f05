"""``plyx data prepare``: corpus -> filtered documents -> tokenizer -> train/val shards + manifest.

Documents pass through every ``plyx_document_filters`` hook implementation
first (plyx-safety attaches PII redaction there), so a dropped or redacted
document never reaches the tokenizer or the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from plyx.specs import get_plugin_manager
from plyx.train._shards import MANIFEST, ShardSet, write_shards
from plyx.train._tokenizer import Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "PrepareReport",
    "prepare_corpus",
    "prepare_bundled",
    "bundled_corpus",
    "read_documents",
    "document_filters",
    "default_data_dir",
    "BUNDLED_SHA256",
]

#: sha256 of the bundled Tiny Shakespeare (also in data/tinyshakespeare.txt.sha256)
BUNDLED_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
#: Tiny Shakespeare's speeches are separated by blank lines
BUNDLED_SEPARATOR = "\n\n"

DocumentFilter = Callable[[str], "str | None"]


@attrs.frozen
class PrepareReport:
    """What a preparation wrote."""

    out_dir: Path
    manifest: Path
    tokenizer: Path | None
    vocab_size: int
    documents: int
    dropped: int
    redacted: int
    tokens: dict[str, int]


def bundled_corpus() -> Path:
    """Path of the bundled Tiny Shakespeare, after checking its sha256."""
    path = Path(str(resources.files("plyx.train").joinpath("data", "tinyshakespeare.txt")))
    digest = _sha256(path)
    if digest != BUNDLED_SHA256:
        raise RuntimeError(
            f"the bundled corpus {path} has sha256 {digest}, expected {BUNDLED_SHA256}: the installation is "
            f"damaged; reinstall plyx-train"
        )
    return path


def default_data_dir(vocab_size: int) -> Path:
    """Where the bundled corpus is prepared: ``$PLYX_DATA_DIR`` or ``~/.cache/plyx/data``."""
    base = os.environ.get("PLYX_DATA_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plyx", "data"
    )
    return Path(base) / f"tinyshakespeare-bpe{vocab_size}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def read_documents(corpus: str | os.PathLike[str], *, separator: str | None = None) -> Iterator[str]:
    """Documents of a corpus.

    - a ``.jsonl`` file: the ``text`` field of each line;
    - any other file: the whole file is one document, or pieces split on ``separator``;
    - a directory: every ``.txt``/``.md``/``.jsonl`` file under it, in sorted order.
    """
    path = Path(corpus)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".md", ".jsonl"} and p.is_file())
        if not files:
            raise FileNotFoundError(f"corpus directory {str(path)!r} holds no .txt, .md or .jsonl files")
        for file in files:
            yield from read_documents(file, separator=separator)
        return
    if not path.is_file():
        raise FileNotFoundError(f"corpus {str(path)!r} does not exist; pass a text file, a .jsonl file or a directory")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(
                        f"{path}:{number}: each .jsonl line must be an object with a string `text` field"
                    ) from None
                yield str(text)
        return
    text = path.read_text(encoding="utf-8")
    if separator:
        yield from (piece for piece in text.split(separator) if piece.strip())
    else:
        yield text


def document_filters(context: dict[str, Any]) -> list[DocumentFilter]:
    """Every filter returned by ``plyx_document_filters`` implementations, in hook order."""
    found: list[DocumentFilter] = []
    for result in get_plugin_manager().hook.plyx_document_filters(context=context):
        for item in result or ():
            if not callable(item):
                raise TypeError(f"a plyx_document_filters implementation returned {item!r}, which is not callable")
            found.append(item)
    return found


def prepare_corpus(
    corpus: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | Tokenizer | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    separator: str | None = None,
    filters: Sequence[DocumentFilter] | None = None,
    use_hooks: bool = True,
    shard_tokens: int | None = None,
) -> PrepareReport:
    """Tokenize ``corpus`` into ``out_dir``.

    Args:
        corpus: a text file, a ``.jsonl`` file or a directory (see ``read_documents``).
        out_dir: the prepared directory (``manifest.json``, ``tokenizer.json``, shards).
        tokenizer: an existing tokenizer (object or ``tokenizer.json`` path); None trains a
            byte-level BPE of ``vocab_size`` on the (filtered) corpus.
        val_fraction: the last this fraction of the token stream is the ``val`` split.
        separator: splits a text file into documents (``"\\n\\n"``: paragraphs).
        filters: extra document filters, applied after the hook's.
        use_hooks: apply ``plyx_document_filters`` implementations.
        shard_tokens: the most tokens per shard file.

    Returns:
        a ``PrepareReport``.

    Example:
        >>> prepare_corpus("corpus.txt", "data/", vocab_size=2048, separator="\\n\\n")
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in [0, 1) (DataConfig.val_fraction)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    context = {"corpus": str(corpus), "out_dir": str(out)}
    active = (document_filters(context) if use_hooks else []) + list(filters or ())

    documents: list[str] = []
    dropped = redacted = 0
    for doc in read_documents(corpus, separator=separator):
        kept: str | None = doc
        for fn in active:
            kept = fn(kept)
            if kept is None:
                break
        if kept is None:
            dropped += 1
            continue
        redacted += kept != doc
        documents.append(kept)
    if not documents:
        raise ValueError(f"no documents left in {str(corpus)!r} after filtering ({dropped} dropped)")

    if tokenizer is None:
        tok = train_bpe(documents, vocab_size=vocab_size, length=len(documents))
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        tok = load_tokenizer(tokenizer)
    tok_path = tok.save(out / "tokenizer.json")

    # one stream: every document followed by EOS, so packed rows know where documents end
    pieces: list[np.ndarray] = []
    for start in range(0, len(documents), 1024):
        for ids in tok.encode_batch(documents[start : start + 1024]):
            pieces.append(np.asarray(ids + [tok.eos_id], dtype=np.int64))
    stream = np.concatenate(pieces)
    cut = len(stream) - int(round(len(stream) * val_fraction))
    splits = {"train": [stream[:cut]]}
    if val_fraction > 0:
        splits["val"] = [stream[cut:]]
    corpus_path = Path(corpus)
    source = {
        "corpus": str(corpus_path.resolve()),
        "corpus_sha256": _sha256(corpus_path) if corpus_path.is_file() else "",
        "documents": len(documents),
        "dropped": dropped,
        "redacted": redacted,
        "separator": separator,
        "val_fraction": val_fraction,
        "requested_vocab_size": vocab_size if tokenizer is None else None,
        "filters": [getattr(fn, "__qualname__", repr(fn)) for fn in active],
    }
    kwargs = {"shard_tokens": shard_tokens} if shard_tokens else {}
    manifest = write_shards(
        out,
        splits,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer_file=tok_path.name,
        tokenizer_sha256=tok.sha256(),
        extra=source,
        **kwargs,
    )
    return PrepareReport(
        out_dir=out,
        manifest=manifest,
        tokenizer=tok_path,
        vocab_size=tok.vocab_size,
        documents=len(documents),
        dropped=dropped,
        redacted=redacted,
        tokens={name: int(sum(a.size for a in arrays)) for name, arrays in splits.items()},
    )


def prepare_bundled(
    out_dir: str | os.PathLike[str] | None = None, *, vocab_size: int = 4096, val_fraction: float = 0.1
) -> Path:
    """Prepare the bundled Tiny Shakespeare once (reused while the manifest matches); returns the directory."""
    out = Path(out_dir) if out_dir else default_data_dir(vocab_size)
    if (out / MANIFEST).is_file():
        try:
            shards = ShardSet.open(out, verify=False)
            src = shards.manifest.get("source", {})
            if (
                src.get("corpus_sha256") == BUNDLED_SHA256
                and src.get("val_fraction") == val_fraction
                and src.get("requested_vocab_size") == vocab_size
            ):
                return out
        except Exception:  # anything wrong with the old one: prepare it again
            pass
    prepare_corpus(
        bundled_corpus(), out, vocab_size=vocab_size, val_fraction=val_fraction, separator=BUNDLED_SEPARATOR
    )
    return out
