"""One view of the tokenizers ``generate()`` accepts: a ``tokenizers.Tokenizer`` or a transformers tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plyx.specs.errors import ConfigError

__all__ = ["TokenizerView"]


class TokenizerView:
    """Encode, decode, special ids and the xgrammar vocabulary of a tokenizer, whatever its library.

    Accepted: ``tokenizers.Tokenizer`` (what plyx-train writes) and any transformers
    ``PreTrainedTokenizerBase``; both are detected by their methods, so neither library is imported here.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.raw = tokenizer
        # transformers tokenizers have convert_ids_to_tokens; tokenizers.Tokenizer has id_to_token
        self.is_hf = hasattr(tokenizer, "convert_ids_to_tokens") and hasattr(tokenizer, "all_special_ids")
        if not self.is_hf and not (hasattr(tokenizer, "id_to_token") and hasattr(tokenizer, "decode")):
            raise ConfigError(
                "tokenizer",
                "the tokenizer must be a tokenizers.Tokenizer or a transformers tokenizer",
                value=type(tokenizer).__name__,
                fix="pass tokenizers.Tokenizer.from_file('tokenizer.json') or AutoTokenizer.from_pretrained(...)",
            )
        self._info_cache: dict[tuple[int, tuple[int, ...]], Any] = {}

    # -- text <-> ids ------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.is_hf:
            return list(self.raw.encode(text))
        return list(self.raw.encode(text).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.raw) if self.is_hf else self.raw.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        if self.is_hf:
            return self.raw.eos_token_id
        for name in ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|im_end|>"):
            tid = self.raw.token_to_id(name)
            if tid is not None:
                return int(tid)
        return None

    # -- grammar engine ------------------------------------------------------------
    def xgrammar_info(self, model_vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
        """The ``xgrammar.TokenizerInfo`` for a model whose vocabulary has ``model_vocab_size`` rows."""
        key = (model_vocab_size, tuple(sorted(stop_token_ids)))
        if key in self._info_cache:
            return self._info_cache[key]
        import xgrammar as xgr

        stops = list(key[1]) or None
        if self.is_hf:
            info = xgr.TokenizerInfo.from_huggingface(self.raw, vocab_size=model_vocab_size, stop_token_ids=stops)
        else:
            vocab = self.raw.get_vocab(with_added_tokens=True)
            encoded = [""] * (max(vocab.values()) + 1)
            for token, tid in vocab.items():
                encoded[tid] = token
            # the byte-level / byte-fallback / raw detection xgrammar applies to HF tokenizer.json files
            meta = xgr.TokenizerInfo._detect_metadata_from_hf(self.raw.to_str())
            info = xgr.TokenizerInfo(
                encoded,
                meta["vocab_type"],
                vocab_size=max(model_vocab_size, len(encoded)),
                stop_token_ids=stops,
                add_prefix_space=meta["add_prefix_space"],
            )
        self._info_cache[key] = info
        return info
