"""Open what ``plyx serve PATH`` serves: the model (plyx or Hugging Face directory), its tokenizer and EOS ids.

A file that cannot be read (a truncated ``tokenizer.json``, a config that is not
JSON) is a ``PathError`` naming the file and the fix, in the words ``plyx model
inspect`` uses for the checkpoint's own files, so ``plyx serve`` prints one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plyx.serve.server._paths import PathError

__all__ = ["eos_ids", "load_model", "load_tokenizer", "read_json"]


def read_json(file: Path) -> Any:
    """The JSON of ``file``; a ``PathError`` naming the file when it is not JSON (truncated, say)."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise PathError(f"{file} is not valid JSON ({exc}); restore it from the source") from None


def load_model(path: str | Path, *, device: str = "cpu", dtype: str = "auto") -> Any:
    """``plyx.model.load_checkpoint`` of a plyx checkpoint or a Hugging Face model directory."""
    from plyx.model import load_checkpoint

    return load_checkpoint(path, device=device, dtype=None if dtype == "auto" else dtype)


def load_tokenizer(path: str | Path) -> Any:
    """``tokenizers.Tokenizer`` of ``PATH/tokenizer.json``, or None when the directory has none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for a file it cannot parse
        raise PathError(f"{file} cannot be read by tokenizers ({exc}); restore it from the source (or save the "
                        "tokenizer again)") from None


def eos_ids(path: str | Path, tokenizer: Any) -> list[int] | None:
    """EOS ids from ``generation_config.json``, ``config.json`` or ``tokenizer_config.json`` (first found)."""
    d = Path(path)
    for name in ("generation_config.json", "config.json"):
        f = d / name
        if f.is_file():
            value = _get(read_json(f), "eos_token_id")
            if isinstance(value, int):
                return [value]
            if isinstance(value, list) and value:
                return [int(v) for v in value]
    f = d / "tokenizer_config.json"
    if tokenizer is not None and f.is_file():
        token = _get(read_json(f), "eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return [int(tokenizer.token_to_id(token))]
    return None


def _get(obj: Any, key: str) -> Any:
    return obj.get(key) if isinstance(obj, dict) else None
