"""Where a run's tokens come from: ``data.path`` resolved to a prepared directory, preparing it when needed.

- empty: the bundled Tiny Shakespeare, prepared once into the cache (``$PLYX_DATA_DIR`` or
  ``$PLYX_CACHE_DIR/data``, default ``~/.cache/plyx/data``), BPE or (``data.tokenizer = "char"``)
  character-level;
- a prepared directory (it has ``manifest.json``): used as is;
- a raw corpus (a text/.jsonl file or a directory of them): prepared into ``<out_dir>/data``, and
  prepared again when the corpus (size, mtime, sha256) or the settings change.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from plyx.train._prepare import prepare_bundled, prepare_cached
from plyx.train._shards import MANIFEST
from plyx.train._tokenizer import CHAR

__all__ = ["resolve_data_dir"]


def resolve_data_dir(data: Any, out_dir: Path, *, cache: str | None = None,
                     say: Callable[[str], None] | None = None) -> Path:
    """The prepared directory of ``data`` (a ``DataConfig``).

    Args:
        data: the run's ``DataConfig``.
        out_dir: the run directory (a raw corpus is prepared into ``out_dir/data``).
        cache: where the bundled corpus is prepared instead of the default cache.
        say: where a note about (re)preparation goes.

    Returns:
        the directory (``ShardSet.open`` explains a missing one).
    """
    if not data.path:
        char = data.tokenizer == CHAR
        name = "tinyshakespeare-char" if char else f"tinyshakespeare-bpe{data.vocab_size}"
        return prepare_bundled(Path(cache) / name if cache else None, vocab_size=data.vocab_size,
                               val_fraction=data.val_fraction, tokenizer=CHAR if char else "")
    path = Path(data.path)
    if (path / MANIFEST).is_file() or not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return path  # a prepared directory (ShardSet.open explains a missing one)
    out, why = prepare_cached(path, out_dir / "data", tokenizer=data.tokenizer or None,
                              vocab_size=data.vocab_size, val_fraction=data.val_fraction)
    if why is not None and say is not None and why != "not prepared yet":
        say(f"note: preparing {path} again into {out}: {why}")
    return out
