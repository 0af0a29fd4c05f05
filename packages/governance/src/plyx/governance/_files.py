"""File digests and the ``sha256sum``-compatible checksums file."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from plyx.governance._canonical import canonical_json
from plyx.governance._errors import GovernanceError

__all__ = [
    "digest_file",
    "digest_tree",
    "iter_tree",
    "portable_relpath",
    "read_checksums",
    "render_checksums",
    "write_text_atomic",
    "write_bytes_atomic",
]

_CHUNK = 1 << 20  # 1 MiB reads: checkpoints are large, memory stays flat
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


# (algorithm, absolute path, size, mtime_ns, inode) -> hex digest, for inputs only (see digest_file)
_CACHE: dict[tuple[str, str, int, int, int], str] = {}


def digest_file(path: str | os.PathLike[str], algorithm: str = "sha256", *, cache: bool = False) -> str:
    """Hex digest of a file's bytes.

    With ``cache=True`` a digest is reused while the file's size, mtime and
    inode are unchanged. The checkpoint hook uses this for a run's inputs:
    they are the same at every save and can be tens of GB, while outputs are
    always read fresh.
    """
    key = None
    if cache:
        st = os.stat(path)
        key = (algorithm, os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
        if key in _CACHE:
            return _CACHE[key]
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    if key is not None:
        _CACHE[key] = h.hexdigest()
    return h.hexdigest()


def iter_tree(root: str | os.PathLike[str], *, exclude: Iterable[str] = ()) -> Iterator[Path]:
    """Every regular file under ``root``, in sorted portable-path order, minus ``exclude`` (relative names)."""
    root = Path(root)
    skip = set(exclude)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel not in skip and p.is_file() and not p.is_symlink():
                found.append((rel, p))
    for _, p in sorted(found):
        yield p


def digest_tree(root: str | os.PathLike[str], *, exclude: Iterable[str] = (), cache: bool = False) -> str:
    """sha256 of a directory: over the canonical JSON of ``[[relpath, sha256, size], ...]`` sorted by relpath.

    Independent of file-system order, timestamps and permissions; a renamed,
    added, removed or changed file changes it.
    """
    root = Path(root)
    listing = [[p.relative_to(root).as_posix(), digest_file(p, cache=cache), p.stat().st_size]
               for p in iter_tree(root, exclude=exclude)]
    return hashlib.sha256(canonical_json(listing)).hexdigest()


def portable_relpath(path: str | os.PathLike[str], start: str | os.PathLike[str]) -> str:
    """``path`` relative to ``start`` with forward slashes (``..`` allowed), as stored in governance files."""
    return Path(os.path.relpath(os.path.abspath(path), os.path.abspath(start))).as_posix()


def render_checksums(entries: Iterable[tuple[str, str]]) -> str:
    """``<sha256>  <relpath>`` lines sorted by path: the format ``sha256sum -c`` reads."""
    lines = []
    for rel, digest in sorted(entries):
        if "\n" in rel or "\\" in rel:
            raise GovernanceError("file name", "newlines and backslashes cannot appear in a checksums file",
                                  value=rel, fix="rename the file")
        lines.append(f"{digest}  {rel}\n")
    return "".join(lines)


def read_checksums(path: str | os.PathLike[str]) -> dict[str, str]:
    """relpath -> sha256 from a checksums file; raises naming the first malformed line."""
    entries: dict[str, str] = {}
    text = Path(path).read_bytes().decode("utf-8", errors="strict")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise GovernanceError(f"{path}:{number}", "not a `<sha256 hex>  <path>` line", value=line,
                                  fix="regenerate the file with `plyx governance sign`")
        if m.group(2) in entries:
            raise GovernanceError(f"{path}:{number}", "file listed twice", value=m.group(2))
        entries[m.group(2)] = m.group(1)
    return entries


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, mode: int | None = None) -> Path:
    """Write through a temporary file and rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    # 0o666 lets the umask decide as for any new file; an explicit mode (0o600
    # for private keys) is set on the descriptor before a byte is written.
    fd = os.open(tmp, flags, 0o666 if mode is None else mode)
    try:
        if mode is not None and hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """UTF-8 text with ``\\n`` line ends, written atomically."""
    return write_bytes_atomic(path, text.encode("utf-8"))

