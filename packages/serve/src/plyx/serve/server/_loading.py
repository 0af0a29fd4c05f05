"""Open what ``plyx serve PATH`` serves: the model (plyx or Hugging Face directory), its tokenizer and EOS ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["eos_ids", "load_model", "load_tokenizer"]


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

    return Tokenizer.from_file(str(file))


def eos_ids(path: str | Path, tokenizer: Any) -> list[int] | None:
    """EOS ids from ``generation_config.json``, ``config.json`` or ``tokenizer_config.json`` (first found)."""
    d = Path(path)
    for name in ("generation_config.json", "config.json"):
        f = d / name
        if f.is_file():
            value = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(value, int):
                return [value]
            if isinstance(value, list) and value:
                return [int(v) for v in value]
    f = d / "tokenizer_config.json"
    if tokenizer is not None and f.is_file():
        token = json.loads(f.read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return [int(tokenizer.token_to_id(token))]
    return None
