"""The special tokens of a checkpoint's ``tokenizer.json``: bos, eos and pad ids for the exported configs.

Read from the file's ``added_tokens`` (those marked ``special``), so no tokenizer
library is needed. plyx's own tokenizers have one special token, ``<|endoftext|>``,
which then serves as bos, eos and pad (GPT-2's convention); tokenizers with
dedicated ``<s>`` / ``<pad>`` tokens keep them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

__all__ = ["SpecialTokens", "special_tokens"]

EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")
BOS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
PAD = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


@attrs.frozen
class SpecialTokens:
    """Special token ids and strings (None where the tokenizer has none)."""

    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    bos: str | None = None
    eos: str | None = None
    pad: str | None = None

    def ids(self) -> dict[str, int | None]:
        """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` as Hugging Face configs spell them."""
        return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id}


def special_tokens(tokenizer_json: str | Path | None) -> SpecialTokens:
    """bos/eos/pad of ``tokenizer_json`` (a Hugging Face ``tokenizer.json``); all None without one.

    eos is the first special token named like an end token (``<|endoftext|>``, ``</s>``, ...);
    bos and pad likewise, each falling back to eos when the tokenizer has no such token.
    """
    if tokenizer_json is None or not Path(tokenizer_json).is_file():
        return SpecialTokens()
    data: dict[str, Any] = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    special = {t["content"]: int(t["id"]) for t in data.get("added_tokens", []) if t.get("special")}

    def pick(names: tuple[str, ...]) -> str | None:
        return next((n for n in names if n in special), None)

    eos = pick(EOS)
    bos = pick(BOS) or eos
    pad = pick(PAD) or eos
    return SpecialTokens(bos_id=special.get(bos) if bos else None, eos_id=special.get(eos) if eos else None,
                         pad_id=special.get(pad) if pad else None, bos=bos, eos=eos, pad=pad)
