"""What a crash leaves in ``checkpoints/``, and how a resumed run cleans it up.

A kill during ``CheckpointManager.save`` can leave:

- ``.tmp-step-NNNNNN-<pid>`` directories (a checkpoint being written) and ``.old-step-*`` ones (a
  replaced checkpoint being deleted): up to the size of a checkpoint each, forever;
- ``.latest-<pid>`` symlinks (``latest`` being re-pointed), and ``latest`` itself pointing at an
  older or a deleted checkpoint;
- a complete checkpoint whose ``plyx_on_checkpoint_saved`` hook never ran (the kill came between
  the rename and the hook), so plyx-governance never wrote its receipt.

The last is detected without knowing any plugin: after the hook returns, the trainer drops an
empty ``.hooked-step-NNNNNN`` marker beside the checkpoint (outside it, so receipts that hash the
directory's files are unaffected). A complete checkpoint without its marker gets the hook again.
Leftovers of a process that is still alive (another run writing into the same directory) are
left alone.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
from plyx.train._checkpoint import CheckpointManager
from plyx.train._shards import MANIFEST

__all__ = ["Recovery", "recover", "mark_hooked", "hooked_marker", "rerun_saved_hooks"]

_LEFTOVER = re.compile(r"^\.(?:tmp|old)-step-\d+-(\d+)$")
_LATEST_TMP = re.compile(r"^\.latest-(\d+)$")
_MARKER = re.compile(r"^\.hooked-(step-\d+)$")


@attrs.frozen
class Recovery:
    """What ``recover`` did.

    Attributes:
        removed: leftover paths deleted (temporary checkpoints, stale links, orphan markers).
        latest: the checkpoint ``latest`` was re-pointed to (None when it was already right).
        unhooked: complete checkpoints whose ``plyx_on_checkpoint_saved`` hook has not run, oldest first.
    """

    removed: list[Path]
    latest: Path | None
    unhooked: list[Path]

    def summary(self) -> str:
        """One line for the log ("" when there was nothing to do)."""
        parts = []
        if self.removed:
            parts.append(f"removed {len(self.removed)} leftover(s) of an interrupted save "
                         f"({', '.join(p.name for p in self.removed[:4])}{'...' if len(self.removed) > 4 else ''})")
        if self.latest is not None:
            parts.append(f"re-pointed latest -> {self.latest.name}")
        if self.unhooked:
            parts.append(f"re-ran the checkpoint-saved hooks of {', '.join(p.name for p in self.unhooked)}")
        return "; ".join(parts)


def hooked_marker(checkpoint: Path) -> Path:
    """The marker saying ``checkpoint``'s saved-hooks ran: ``<root>/.hooked-<name>``."""
    return checkpoint.parent / f".hooked-{checkpoint.name}"


def mark_hooked(checkpoint: Path) -> None:
    """Record that ``checkpoint``'s ``plyx_on_checkpoint_saved`` hooks returned; drops markers of rotated ones."""
    hooked_marker(checkpoint).touch()
    for child in checkpoint.parent.iterdir():
        m = _MARKER.match(child.name)
        if m and not (checkpoint.parent / m.group(1)).is_dir():
            child.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process is not saving while it recovers
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def recover(root: Path, complete_steps: list[int], path_for: object) -> Recovery:
    """Clean ``root`` (a run's ``checkpoints/``) after a crash and list checkpoints that miss their hooks.

    Args:
        root: the checkpoints directory.
        complete_steps: the steps of its complete checkpoints (``CheckpointManager.steps()``), ascending.
        path_for: ``CheckpointManager.path_for`` (step -> directory).

    Returns:
        a ``Recovery``.
    """
    removed: list[Path] = []
    if not root.is_dir():
        return Recovery(removed=[], latest=None, unhooked=[])
    for child in sorted(root.iterdir()):
        leftover, link = _LEFTOVER.match(child.name), _LATEST_TMP.match(child.name)
        marker = _MARKER.match(child.name)
        if leftover and not _alive(int(leftover.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        elif link and child.is_symlink() and not _alive(int(link.group(1))):
            child.unlink(missing_ok=True)
            removed.append(child)
        elif marker and not (root / marker.group(1)).is_dir():
            child.unlink(missing_ok=True)
            removed.append(child)
    paths = [path_for(s) for s in complete_steps]  # type: ignore[operator]
    repointed = _repair_latest(root, paths[-1]) if paths else None
    unhooked = [p for p in paths if not hooked_marker(p).exists()]
    return Recovery(removed=removed, latest=repointed, unhooked=unhooked)


def _repair_latest(root: Path, newest: Path) -> Path | None:
    link = root / "latest"
    if link.is_symlink() and os.readlink(link) == newest.name:
        return None
    if link.exists() and not link.is_symlink():
        return None  # not ours to replace (a filesystem without symlinks: latest() reads names anyway)
    tmp = root / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    try:
        tmp.symlink_to(newest.name)
        os.replace(tmp, link)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return newest


def rerun_saved_hooks(checkpoints: list[Path], hook: Any, *, data_dir: Path, out_dir: Path, seed: int) -> None:
    """Call ``hook.plyx_on_checkpoint_saved`` for each checkpoint, with the metadata the save would have passed.

    The metadata comes from the checkpoint's own ``trainer_state.json`` (its config, metrics, run id, data
    directory), so a receipt written now describes the run that wrote the checkpoint.

    Args:
        checkpoints: complete checkpoints whose hooks did not run (``Recovery.unhooked``).
        hook: the plugin manager's ``hook`` relay.
        data_dir: the data directory, when the state does not name one.
        out_dir: the run directory (``metrics.csv``).
        seed: the run's seed.
    """
    for path in checkpoints:
        doc, _ = CheckpointManager.read_state(path)
        data = Path(doc.get("data_dir") or data_dir)
        inputs = {"data": str(data), "manifest": str(data / MANIFEST)}
        if (path / "tokenizer.json").is_file():
            inputs["tokenizer"] = str(path / "tokenizer.json")
        step = int(doc["step"])
        meta = {
            "config": doc.get("config", {}), "seeds": {"seed": seed, "data_seed": seed}, "inputs": inputs,
            "outputs": {"checkpoint": str(path), "metrics": str(out_dir / "metrics.csv")},
            "metrics": dict(doc.get("metrics", {})), "run_id": doc.get("run_id", ""), "step": step,
        }
        hook.plyx_on_checkpoint_saved(path=str(path), step=step, metadata=meta)
        mark_hooked(path)
