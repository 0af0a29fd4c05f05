"""Low-level safetensors file handling: header parsing, truncation checks, hashing, atomic directories.

No pickle: tensors are read with ``safetensors`` only.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plyx.model._errors import CheckpointError, CheckpointIntegrityError

__all__ = ["atomic_directory", "read_header", "sha256_file", "check_complete"]

_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: ``{name: {"dtype", "shape", "data_offsets"}, "__metadata__"?}``."""
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointIntegrityError(path.name, f"is {len(head)} bytes long, too short for a safetensors header",
                                               expected=">= 8 bytes", found=len(head))
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > size - 8:
                raise CheckpointIntegrityError(path.name, f"declares a {n}-byte header but holds only {size} bytes",
                                               expected=n + 8, found=size)
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"shard {str(path)!r} is listed by the checkpoint but does not exist") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointIntegrityError(path.name, f"has a corrupt safetensors header ({exc})") from None
    header["__header_bytes__"] = n
    return header


def canonical_dtype(st_dtype: str) -> str:
    return _ST_DTYPES.get(st_dtype, st_dtype.lower())


def check_complete(path: Path, header: dict[str, Any] | None = None) -> None:
    """Raise if the file is shorter (truncated) or longer than its header says."""
    header = header or read_header(path)
    end = max((v["data_offsets"][1] for k, v in header.items() if not k.startswith("__")), default=0)
    want = 8 + header["__header_bytes__"] + end
    size = path.stat().st_size
    if size != want:
        what = "is truncated" if size < want else "has trailing bytes"
        raise CheckpointIntegrityError(path.name, f"{what}: {size} bytes on disk, its header describes {want}",
                                       expected=want, found=size)


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on success it replaces ``path`` by rename.

    Readers never see a half-written checkpoint: the final ``os.replace`` of a
    directory is atomic on POSIX. An existing ``path`` is moved aside first and
    removed after the swap (so a crash leaves either the old or the new one).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.iterdir():  # data on disk before the rename makes it visible
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if path.exists():
            old = path.parent / f".{path.name}.old-{tag}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
