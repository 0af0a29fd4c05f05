"""What ``plyx serve PATH`` was given: one-line errors for paths it cannot serve, and the served model id.

The model id (``/v1/models``, the ``model`` field of requests) is, in order:
``--served-model-name``; the checkpoint card's ``name`` (``plyx train`` writes the
run's name there); for a checkpoint inside ``<run>/checkpoints/`` written without a
name, the run's directory name; else the directory's name. The directory's own names
(``step-001000``, and ``latest`` when that link was given) are accepted as aliases.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["PathError", "check_model_path", "served_names"]

#: the ModelCard default name, which says nothing about the model
_UNNAMED = "plyx-model"


class PathError(ValueError):
    """PATH is not something ``plyx serve`` can load; the message says what it is and what to pass instead."""


def _checkpoints_in(d: Path) -> list[Path]:
    return sorted(p for p in d.glob("step-*") if (p / "model_card.json").is_file())


def check_model_path(path: str | Path) -> Path:
    """``path`` if it holds a plyx checkpoint or a Hugging Face model, else a ``PathError`` saying what to pass.

    Args:
        path: what the user gave ``plyx serve``.

    Returns:
        the directory.

    Raises:
        PathError: a missing path, a file, a run or ``checkpoints`` directory, an ONNX export, an empty directory.
    """
    p = Path(path)
    hint = "pass a checkpoint directory such as runs/shakespeare/checkpoints/latest (`plyx train` prints it)"
    if p.is_symlink() and not p.exists():
        raise PathError(f"{path} is a broken link (to {p.readlink()}); {hint}")
    if not p.exists():
        raise PathError(f"{path} does not exist; {hint}")
    if not p.is_dir():
        raise PathError(f"{path} is a file, not a model directory; pass the directory that holds it")
    if (p / "model_card.json").is_file() or (p / "config.json").is_file() and not (p / "model.onnx").is_file():
        return p
    for root in (p / "checkpoints", p):
        found = _checkpoints_in(root)
        if found:
            best = root / "latest" if (root / "latest").exists() else found[-1]
            what = "a training run" if root != p else "a directory of checkpoints"
            raise PathError(f"{path} is {what}, not a checkpoint; serve one of its checkpoints: plyx serve {best}")
    if (p / "model.onnx").is_file() or (p / "plyx_export.json").is_file():
        source = ""
        try:
            source = json.loads((p / "plyx_export.json").read_text())["source"]["path"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        where = f": plyx serve {source}" if source else " (the checkpoint that was exported)"
        raise PathError(f"{path} is an ONNX export (for onnxruntime); plyx serve serves checkpoints{where}")
    if not any(p.iterdir()):
        raise PathError(f"{path} is an empty directory; {hint}")
    raise PathError(f"{path} holds neither model_card.json (a plyx checkpoint) nor config.json (a Hugging Face "
                    f"model); {hint}")


def served_names(path: str | Path, override: str = "") -> tuple[str, tuple[str, ...]]:
    """(model id, aliases) that ``plyx serve PATH`` answers to (see the module docstring).

    Args:
        path: the model directory as given (``latest`` links are kept as an alias).
        override: ``--served-model-name`` ("" for none).

    Returns:
        the id and the other accepted names.
    """
    given = Path(path)
    real = given.resolve()
    name = ""
    card = real / "model_card.json"
    if card.is_file():
        try:
            name = str(json.loads(card.read_text()).get("name") or "")
        except (OSError, ValueError):
            name = ""
    if name == _UNNAMED:
        name = ""
    if not name and real.parent.name == "checkpoints":
        name = real.parent.parent.name
    model_id = override or name or real.name
    aliases = tuple(dict.fromkeys(n for n in (name, real.name, given.name) if n and n != model_id))
    return model_id, aliases
