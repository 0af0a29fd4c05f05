"""``plyx data prepare``: corpus -> filtered documents -> tokenizer -> train/val shards + manifest.

Documents pass through every ``plyx_document_filters`` hook implementation
first (plyx-safety attaches PII redaction there), so a dropped or redacted
document never reaches the tokenizer or the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from plyx.specs import get_plugin_manager
from plyx.train._shards import MANIFEST, ShardSet, write_shards
from plyx.train._tokenizer import CHAR, Tokenizer, encode_chars, load_tokenizer, train_bpe, train_char

__all__ = [
    "PrepareReport",
    "prepare_corpus",
    "prepare_bundled",
    "bundled_corpus",
    "read_documents",
    "document_filters",
    "default_data_dir",
    "prepare_cached",
    "corpus_stat",
    "corpus_sha256",
    "cache_dir",
    "CorpusError",
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


class CorpusError(ValueError):
    """A corpus cannot be read as text (wrong encoding) or holds nothing; the message names the file and the fix."""


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


def cache_dir() -> Path:
    """plyx's cache root: ``$PLYX_CACHE_DIR``, else ``$XDG_CACHE_HOME/plyx``, else ``~/.cache/plyx``."""
    explicit = os.environ.get("PLYX_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "plyx"


def default_data_dir(vocab_size: int, tokenizer: str = "") -> Path:
    """Where the bundled corpus is prepared: ``$PLYX_DATA_DIR``, else ``cache_dir()/data``.

    Args:
        vocab_size: the BPE vocabulary (part of the directory name).
        tokenizer: ``"char"`` for the character-level preparation (``tinyshakespeare-char``).
    """
    base = Path(os.environ.get("PLYX_DATA_DIR") or cache_dir() / "data")
    return base / ("tinyshakespeare-char" if tokenizer == CHAR else f"tinyshakespeare-bpe{vocab_size}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _decode(path: Path, data: bytes, encoding: str, errors: str) -> str:
    """``data.decode`` whose failure names the file, the byte offset and line, and the ways out."""
    try:
        return data.decode(encoding, errors)
    except LookupError:
        raise CorpusError(f"unknown text encoding {encoding!r} for {path}; use e.g. utf-8, latin-1 or cp1252") from None
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        bad = data[exc.start : exc.start + 1].hex()
        raise CorpusError(
            f"{path} is not {encoding} text: byte 0x{bad} at offset {exc.start} (line {line}) {exc.reason}. "
            f"If it is text in another encoding, prepare it with `plyx data prepare {path} --out DIR --encoding "
            f"latin-1` (or cp1252, ...); `--errors replace` keeps going with U+FFFD for the bad bytes; or convert "
            f"it first (`iconv -f latin1 -t utf-8`). A binary file is not a corpus"
        ) from None


def read_documents(
    corpus: str | os.PathLike[str], *, separator: str | None = None, encoding: str = "utf-8", errors: str = "strict"
) -> Iterator[str]:
    """Documents of a corpus.

    - a ``.jsonl`` file: the ``text`` field of each line;
    - any other file: the whole file is one document, or pieces split on ``separator``;
    - a directory: every ``.txt``/``.md``/``.jsonl`` file under it, in sorted order.

    Args:
        corpus: the file or directory.
        separator: splits text files into documents.
        encoding: the files' text encoding.
        errors: ``strict`` (a ``CorpusError`` naming file, offset and line), ``replace`` or ``ignore``.

    Raises:
        CorpusError: a file does not decode.
        FileNotFoundError: nothing at ``corpus``.
    """
    path = Path(corpus)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".md", ".jsonl"} and p.is_file())
        if not files:
            raise FileNotFoundError(f"corpus directory {str(path)!r} holds no .txt, .md or .jsonl files")
        for file in files:
            yield from read_documents(file, separator=separator, encoding=encoding, errors=errors)
        return
    if not path.is_file():
        raise FileNotFoundError(f"corpus {str(path)!r} does not exist; pass a text file, a .jsonl file or a directory")
    if path.suffix == ".jsonl":
        # str.splitlines would also split on U+2028 etc. inside strings; JSON lines end at "\n" only
        for number, line in enumerate(_decode(path, path.read_bytes(), encoding, errors).split("\n"), 1):
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
    text = _decode(path, path.read_bytes(), encoding, errors)
    if separator:
        yield from (piece for piece in text.split(separator) if piece.strip())
    elif text.strip():  # an empty or blank file holds no document
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
    encoding: str = "utf-8",
    errors: str = "strict",
    _key: dict[str, Any] | None = None,
) -> PrepareReport:
    """Tokenize ``corpus`` into ``out_dir``.

    Args:
        corpus: a text file, a ``.jsonl`` file or a directory (see ``read_documents``).
        out_dir: the prepared directory (``manifest.json``, ``tokenizer.json``, shards).
        tokenizer: an existing tokenizer (object or ``tokenizer.json`` path); ``"char"`` builds a
            character-level one (``train_char``); None trains a byte-level BPE of ``vocab_size`` on the
            (filtered) corpus.
        val_fraction: the last this fraction of the token stream is the ``val`` split.
        separator: splits a text file into documents (``"\\n\\n"``: paragraphs).
        filters: extra document filters, applied after the hook's.
        use_hooks: apply ``plyx_document_filters`` implementations.
        shard_tokens: the most tokens per shard file.
        encoding / errors: how the files are decoded (see ``read_documents``).

    Returns:
        a ``PrepareReport``.

    Raises:
        CorpusError: the corpus does not decode, or holds no text.

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
    for doc in read_documents(corpus, separator=separator, encoding=encoding, errors=errors):
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
    if not documents and not dropped:
        raise CorpusError(f"corpus {str(corpus)!r} holds no text (it is empty or blank); put text in it or point at "
                          f"another file")
    if not documents:
        raise CorpusError(f"no documents left in {str(corpus)!r} after filtering ({dropped} dropped)")

    if tokenizer is None:
        tok = train_bpe(documents, vocab_size=vocab_size, length=len(documents))
    elif tokenizer == CHAR:
        tok = train_char(documents)
    elif isinstance(tokenizer, Tokenizer):
        tok = tokenizer
    else:
        tok = load_tokenizer(tokenizer)
    tok_path = tok.save(out / "tokenizer.json")

    # one stream: every document followed by EOS, so packed rows know where documents end
    pieces: list[np.ndarray] = []
    eos = np.asarray([tok.eos_id], dtype=np.int64)
    for start in range(0, len(documents), 1024):
        batch = documents[start : start + 1024]
        encoded = encode_chars(tok, batch) if tokenizer == CHAR else tok.encode_batch(batch)
        for ids in encoded:
            pieces.append(np.concatenate([np.asarray(ids, dtype=np.int64), eos]))
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
        "tokenizer_request": tokenizer if isinstance(tokenizer, str) else "",
        "encoding": encoding,
        "errors": errors,
        "filters": [getattr(fn, "__qualname__", repr(fn)) for fn in active],
        **(_key or {}),  # prepare_cached's key: settings, corpus_stat, corpus_sha256 (a directory's digest)
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


def _corpus_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.suffix in {".txt", ".md", ".jsonl"} and p.is_file())
    return [path] if path.is_file() else []


def corpus_stat(corpus: str | os.PathLike[str]) -> dict[str, int]:
    """Cheap identity of a corpus: total size and newest mtime (ns) of its files, and how many there are."""
    stats = [f.stat() for f in _corpus_files(Path(corpus))]
    return {"size": sum(st.st_size for st in stats), "mtime_ns": max((st.st_mtime_ns for st in stats), default=0),
            "files": len(stats)}


def corpus_sha256(corpus: str | os.PathLike[str]) -> str:
    """Content digest of a corpus: a file's sha256, or for a directory one over each file's name and sha256."""
    path = Path(corpus)
    if path.is_file():
        return _sha256(path)
    digest = hashlib.sha256()
    for f in _corpus_files(path):
        digest.update(f"{f.relative_to(path).as_posix()}\0{_sha256(f)}\n".encode())
    return digest.hexdigest()


def _settings(
    tokenizer: str | os.PathLike[str] | None, vocab_size: int, val_fraction: float, separator: str | None,
    encoding: str, errors: str,
) -> dict[str, Any]:
    """The preparation settings a prepared directory is keyed on (with the corpus' identity)."""
    tok = "" if tokenizer is None else str(tokenizer)
    tok_file = Path(tok) / "tokenizer.json" if tok and Path(tok).is_dir() else Path(tok)
    return {
        "tokenizer": tok,
        # a tokenizer file edited in place is a different tokenizer
        "tokenizer_file_sha256": _sha256(tok_file) if tok and tok != CHAR and tok_file.is_file() else "",
        "vocab_size": vocab_size if not tok else None,  # only a trained BPE depends on it
        "val_fraction": val_fraction,
        "separator": separator,
        "encoding": encoding,
        "errors": errors,
    }


def _stale(out: Path, corpus: Path, settings: dict[str, Any]) -> str | None:
    """Why the prepared ``out`` does not match ``corpus`` and ``settings`` (None: it matches)."""
    if not (out / MANIFEST).is_file():
        return "not prepared yet"
    try:
        src = ShardSet.open(out, verify=False).manifest.get("source", {})
    except Exception as exc:  # a damaged directory is prepared again rather than trusted
        return f"the prepared directory is unreadable ({exc})"
    old = src.get("settings")
    if old != settings:
        if not isinstance(old, dict):
            return "it was prepared by an older plyx-train that did not record its settings"
        changed = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v)
        return f"the preparation settings changed ({changed})"
    stat = corpus_stat(corpus)
    if stat == src.get("corpus_stat"):
        return None
    if corpus_sha256(corpus) == src.get("corpus_sha256"):
        return None  # touched, not changed
    return f"{corpus} changed since it was prepared (size {src.get('corpus_stat', {}).get('size')} -> {stat['size']})"


def prepare_cached(
    corpus: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    vocab_size: int = 4096,
    val_fraction: float = 0.1,
    separator: str | None = None,
    encoding: str = "utf-8",
    errors: str = "strict",
    use_hooks: bool = True,
) -> tuple[Path, str | None]:
    """Prepare ``corpus`` into ``out_dir`` unless it already holds this corpus prepared with these settings.

    The prepared directory is keyed on the corpus' size and mtime (a cheap check), its sha256 (when
    size or mtime differ: a touched file is not re-prepared) and the settings. A stale directory is
    replaced atomically: the new preparation is written beside it and swapped in when complete.

    Args:
        corpus: a raw corpus (see ``read_documents``).
        out_dir: the prepared directory.
        tokenizer, vocab_size, val_fraction, separator, encoding, errors, use_hooks: see ``prepare_corpus``.

    Returns:
        (the directory, why it was (re)prepared; None when the existing one was reused).
    """
    out, path = Path(out_dir), Path(corpus)
    settings = _settings(tokenizer, vocab_size, val_fraction, separator, encoding, errors)
    reason = _stale(out, path, settings)
    if reason is None:
        return out, None
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    stat, digest = corpus_stat(path), corpus_sha256(path)
    try:
        prepare_corpus(path, tmp, tokenizer=tokenizer, vocab_size=vocab_size, val_fraction=val_fraction,
                       separator=separator, encoding=encoding, errors=errors, use_hooks=use_hooks,
                       _key={"settings": settings, "corpus_stat": stat, "corpus_sha256": digest})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out, reason


def prepare_bundled(
    out_dir: str | os.PathLike[str] | None = None, *, vocab_size: int = 4096, val_fraction: float = 0.1,
    tokenizer: str = "",
) -> Path:
    """Prepare the bundled Tiny Shakespeare once (reused while corpus and settings match); returns the directory.

    Args:
        out_dir: where (default ``default_data_dir``).
        vocab_size: the BPE vocabulary.
        val_fraction: the held-out fraction.
        tokenizer: ``""`` (a byte-level BPE) or ``"char"`` (one id per character, nanoGPT's recipe).
    """
    out = Path(out_dir) if out_dir else default_data_dir(vocab_size, tokenizer)
    out.parent.mkdir(parents=True, exist_ok=True)
    # characters keep the file as one stream, as nanoGPT does (its ids are then exactly nanoGPT's)
    separator = None if tokenizer == CHAR else BUNDLED_SEPARATOR
    prepare_cached(bundled_corpus(), out, tokenizer=tokenizer or None, vocab_size=vocab_size,
                   val_fraction=val_fraction, separator=separator, use_hooks=True)
    return out
