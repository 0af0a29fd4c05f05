"""Token shards: flat uint16/uint32 files read through ``numpy.memmap``, described by ``manifest.json``.

Layout of a prepared directory::

    manifest.json          format, dtype, vocab, EOS id, every shard with its token count and sha256
    tokenizer.json         the tokenizer that produced the ids (when there is one)
    train-00000.bin ...    raw little-endian token ids, no header (nanoGPT's train.bin layout)
    val-00000.bin ...

The manifest is written last and atomically, so a directory without one is an
interrupted preparation, never a half-valid corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = ["MANIFEST", "ShardError", "ShardInfo", "ShardSet", "write_shards", "token_dtype"]

MANIFEST = "manifest.json"
FORMAT = "plyx-token-shards"
FORMAT_VERSION = 1
#: tokens per shard file unless told otherwise (256 MiB of uint16)
DEFAULT_SHARD_TOKENS = 1 << 27


class ShardError(ValueError):
    """A prepared data directory is missing, incomplete or corrupt; the message names the file and the fix."""


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 while every id fits (vocab <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@attrs.frozen
class ShardInfo:
    """One shard file as the manifest records it."""

    file: str
    tokens: int
    sha256: str
    documents: int = 0


def _sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def write_shards(
    out_dir: str | os.PathLike[str],
    splits: dict[str, Iterable[np.ndarray]],
    *,
    vocab_size: int,
    eos_id: int | None,
    tokenizer_file: str = "",
    tokenizer_sha256: str = "",
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write token arrays into shards and the manifest; returns the manifest path.

    Args:
        out_dir: the directory (created if needed).
        splits: split name (``train``, ``val``) -> token arrays, written in order.
        vocab_size: ids must be below this; picks uint16 or uint32.
        eos_id: the end-of-document id (None when the corpus has no documents, e.g. char-level).
        tokenizer_file: the tokenizer's file name inside ``out_dir`` ("" for none).
        tokenizer_sha256: its digest, checked against the tokenizer at training time.
        shard_tokens: the most tokens per shard file.
        extra: free-form provenance stored under ``source``.
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": int(vocab_size),
        "eos_id": eos_id,
        "tokenizer": tokenizer_file,
        "tokenizer_sha256": tokenizer_sha256,
        "max_token_id": -1,
        "splits": {},
        "source": dict(extra or {}),
    }
    # an old manifest must not describe the shards being rewritten
    (root / MANIFEST).unlink(missing_ok=True)
    for split, arrays in splits.items():
        infos: list[dict[str, Any]] = []
        writer = _ShardWriter(root, split, dtype, shard_tokens, eos_id)
        for array in arrays:
            ids = np.asarray(array)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
                raise ValueError(
                    f"token ids of split {split!r} fall outside [0, {vocab_size}): min {int(ids.min())}, "
                    f"max {int(ids.max())}; pass the tokenizer's vocab_size"
                )
            if ids.size:
                manifest["max_token_id"] = max(manifest["max_token_id"], int(ids.max()))
            writer.write(ids.astype(dtype, copy=False))
        infos.extend(attrs.asdict(info) for info in writer.close())
        manifest["splits"][split] = infos
    tmp = root / f".{MANIFEST}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, root / MANIFEST)
    return root / MANIFEST


class _ShardWriter:
    """Appends ids to ``{split}-NNNNN.bin`` files, starting a new one every ``limit`` tokens."""

    def __init__(self, root: Path, split: str, dtype: np.dtype[Any], limit: int, eos_id: int | None) -> None:
        self.root, self.split, self.dtype, self.limit, self.eos_id = root, split, dtype, limit, eos_id
        self.done: list[ShardInfo] = []
        self._open()

    def _open(self) -> None:
        self.name = f"{self.split}-{len(self.done):05d}.bin"
        self.fh = (self.root / self.name).open("wb")
        self.digest = hashlib.sha256()
        self.count = 0
        self.docs = 0

    def write(self, ids: np.ndarray) -> None:
        while ids.size:
            room = self.limit - self.count
            if room == 0:
                self._finish()
                self._open()
                continue
            part, ids = ids[:room], ids[room:]
            data = part.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self.fh.write(data)
            self.digest.update(data)
            self.count += int(part.size)
            if self.eos_id is not None:
                self.docs += int((part == self.eos_id).sum())

    def _finish(self) -> None:
        self.fh.close()
        self.done.append(ShardInfo(self.name, self.count, self.digest.hexdigest(), self.docs))

    def close(self) -> list[ShardInfo]:
        self._finish()
        if self.done[-1].tokens == 0 and len(self.done) > 1:  # a trailing empty file is noise
            (self.root / self.done.pop().file).unlink()
        return self.done


@attrs.define
class ShardSet:
    """A prepared directory opened for reading: memmaps per split, checked against the manifest.

    Attributes:
        root: the directory.
        manifest: the parsed ``manifest.json``.
        shards: split -> list of (ShardInfo, memmap of ids).
    """

    root: Path
    manifest: dict[str, Any]
    shards: dict[str, list[tuple[ShardInfo, np.ndarray]]]

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, verify: bool = True) -> ShardSet:
        """Open ``path``; with ``verify`` every shard's sha256 is recomputed.

        Raises:
            ShardError: no manifest, a missing shard, a size or digest that does not match.
        """
        root = Path(path)
        fix = f"run `plyx data prepare CORPUS --out {root}` again"
        mpath = root / MANIFEST
        if not mpath.is_file():
            what = "does not exist" if not root.exists() else f"has no {MANIFEST} (an interrupted preparation?)"
            raise ShardError(f"prepared data directory {str(root)!r} {what}; {fix}")
        try:
            manifest = json.loads(mpath.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ShardError(f"{mpath} is not valid JSON ({exc}); {fix}") from None
        if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
            raise ShardError(
                f"{mpath} is format {manifest.get('format')!r} v{manifest.get('version')}, expected "
                f"{FORMAT!r} v{FORMAT_VERSION}; {fix}"
            )
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        shards: dict[str, list[tuple[ShardInfo, np.ndarray]]] = {}
        for split, entries in manifest["splits"].items():
            opened = []
            for entry in entries:
                info = ShardInfo(**entry)
                file = root / info.file
                if not file.is_file():
                    raise ShardError(f"shard {str(file)!r} listed in {mpath} is missing; {fix}")
                size = file.stat().st_size
                if size != info.tokens * dtype.itemsize:
                    raise ShardError(
                        f"shard {str(file)!r} holds {size} bytes but the manifest says {info.tokens} "
                        f"{dtype.name} tokens ({info.tokens * dtype.itemsize} bytes): it is truncated or "
                        f"corrupt; {fix}"
                    )
                if verify and _sha256_file(file) != info.sha256:
                    raise ShardError(
                        f"shard {str(file)!r} does not match the sha256 in {mpath} (corrupt or modified); {fix}"
                    )
                ids = np.memmap(file, dtype=dtype, mode="r") if info.tokens else np.zeros(0, dtype=dtype)
                opened.append((info, ids))
            shards[split] = opened
        return cls(root=root, manifest=manifest, shards=shards)

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_id(self) -> int | None:
        eos = self.manifest.get("eos_id")
        return None if eos is None else int(eos)

    @property
    def tokenizer_path(self) -> Path | None:
        name = self.manifest.get("tokenizer") or ""
        return self.root / name if name else None

    def tokens(self, split: str) -> int:
        return sum(info.tokens for info, _ in self.split(split))

    def split(self, split: str) -> list[tuple[ShardInfo, np.ndarray]]:
        if split not in self.shards:
            raise ShardError(
                f"prepared data {str(self.root)!r} has no {split!r} split (it has {', '.join(self.shards) or 'none'}); "
                f"prepare it with a val_fraction > 0"
            )
        return self.shards[split]
