"""Atomic export directories: written in a temporary sibling, renamed into place when complete.

A crash or a failed verification leaves the destination untouched (absent, or
its previous contents under ``force``) and no temporary directory behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

from plyx.export._errors import ExportError

__all__ = ["atomic_directory", "check_destination"]


def check_destination(dest: Path, *, force: bool) -> None:
    """Raise ``ExportError`` unless ``dest`` is absent, an empty directory, or ``force`` is set."""
    if dest.exists() and not dest.is_dir():
        raise ExportError("out_dir", f"{str(dest)!r} exists and is a file, not a directory",
                          fix="choose a directory path for the export")
    if dest.is_dir() and not force:
        entries = sorted(p.name for p in dest.iterdir())
        if entries:
            shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
            raise ExportError("out_dir", f"{str(dest)!r} exists and is not empty ({len(entries)} entries: {shown})",
                              fix="pass force=True (--force) to replace it, or choose a new directory")


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike[str], *, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``dest``; on success it replaces ``dest``.

    Args:
        dest: the final directory.
        force: replace a non-empty ``dest`` (its old contents are removed only
            after the new directory is in place).

    Example::

        with atomic_directory("exports/tiny") as tmp:
            (tmp / "model.onnx").write_bytes(data)
    """
    final = Path(dest)
    check_destination(final, force=force)
    final.parent.mkdir(parents=True, exist_ok=True)
    # a sibling, so the final rename stays on one filesystem (rename is atomic there)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700; an export is meant to be read by others
        yield tmp
        _replace(tmp, final, force=force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace(tmp: Path, final: Path, *, force: bool) -> None:
    if not final.exists():
        _rename(tmp, final)
        return
    check_destination(final, force=force)  # it may have been filled while we exported
    old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(final, old)
    try:
        _rename(tmp, final)
    except BaseException:
        os.rename(old, final)  # put the previous export back
        raise
    shutil.rmtree(old, ignore_errors=True)


def _rename(tmp: Path, final: Path) -> None:
    try:
        os.rename(tmp, final)
    except OSError as exc:
        raise ExportError("out_dir", f"cannot move the finished export into {str(final)!r}: {exc}",
                          fix="check that nothing else writes there and that the directory is writable") from exc
