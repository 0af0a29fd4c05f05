"""Byte-level BPE tokenizers: trained with Hugging Face ``tokenizers``, or loaded from ``tokenizer.json``.

Byte-level means every string is representable (no unknown token): the base
alphabet is the 256 bytes, mapped to printable characters as GPT-2 does, and
BPE merges are learned on top. One special token ends each document; the data
pipeline writes it between documents so packed sequences know where a
document stops.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer", "train_bpe", "train_char", "load_tokenizer", "EOS_TOKEN", "UNK_TOKEN", "EOS_CANDIDATES", "CHAR", "encode_chars"]

#: the document separator of tokenizers trained by plyx (GPT-2's name for it)
EOS_TOKEN = "<|endoftext|>"
#: stands for characters a character-level tokenizer never saw (never written by ``plyx data prepare``)
UNK_TOKEN = "<|unk|>"
#: the ``tokenizer`` setting (``data.tokenizer``, ``plyx data prepare --tokenizer``) that asks for characters
CHAR = "char"
#: names recognised as end-of-document in tokenizers trained elsewhere, in order of preference
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the few things training needs: ids, text, EOS, vocabulary size.

    Args:
        inner: the Hugging Face tokenizer.
        eos_token: the end-of-document token; looked up among ``EOS_CANDIDATES`` when None.
        path: the ``tokenizer.json`` it was loaded from or saved to, if any.

    Example:
        >>> tok = train_bpe(["to be or not to be"] * 50, vocab_size=300)
        >>> tok.decode(tok.encode("to be"))
        'to be'
    """

    def __init__(self, inner: _HFTokenizer, *, eos_token: str | None = None, path: Path | None = None) -> None:
        self.inner = inner
        self.path = path
        vocab = inner.get_vocab(with_added_tokens=True)
        names = (eos_token,) if eos_token else EOS_CANDIDATES
        found = [name for name in names if name in vocab]
        if not found:
            where = f" ({path})" if path else ""
            raise ValueError(
                f"tokenizer{where} has no end-of-document token: looked for {', '.join(names)}; "
                f"pass eos_token= naming one of its special tokens"
            )
        self.eos_token = found[0]
        self.eos_id = int(vocab[self.eos_token])

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's vocab must be at least this)."""
        return int(self.inner.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.inner.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (``tokenizers`` parallelises this in Rust)."""
        return [list(e.ids) for e in self.inner.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return str(self.inner.decode([int(i) for i in ids], skip_special_tokens=False))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` atomically; returns its path."""
        target = Path(path)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        self.inner.save(str(tmp))
        os.replace(tmp, target)
        self.path = target
        return target

    def sha256(self) -> str:
        """Digest of the serialised tokenizer: what shards and checkpoints record to detect a mismatch."""
        return hashlib.sha256(self.inner.to_str().encode()).hexdigest()


def train_bpe(
    texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2, length: int | None = None
) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts``.

    Args:
        texts: the training documents (an iterator is fine; it is read once).
        vocab_size: ids in the result, the 256 byte symbols and the EOS token included.
        min_frequency: a pair must occur this often to be merged.
        length: number of texts, for ``tokenizers``' progress accounting only.
    """
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs the 256 byte symbols "
            f"and the end-of-document token; use at least 257"
        )
    inner = _HFTokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(x)) == x for every x
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(_strings(texts), trainer=trainer, length=length)
    return Tokenizer(inner, eos_token=EOS_TOKEN)


def train_char(texts: Iterable[str]) -> Tokenizer:
    """A character-level tokenizer (nanoGPT's ``shakespeare_char``): one id per distinct character.

    Characters get ids 0..n-1 in sorted order (the ids nanoGPT's ``prepare.py`` gives them), then the
    end-of-document token (n) and an unknown-character token (n+1) for text the corpus never showed.
    Decoding joins the characters back without separators, so ``decode(encode(x)) == x`` for every
    ``x`` made of seen characters.

    Args:
        texts: the training documents (read once).

    Returns:
        a ``Tokenizer`` of ``len(chars) + 2`` ids.
    """
    chars = sorted(set().union(*(set(t) for t in _strings(texts))))
    if not chars:
        raise ValueError("a character-level tokenizer needs at least one character of text; the corpus is empty")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS_TOKEN], vocab[UNK_TOKEN] = len(chars), len(chars) + 1
    inner = _HFTokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    inner.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character alone
    inner.decoder = decoders.Fuse()  # join without the spaces WordLevel would put between tokens
    inner.add_special_tokens([EOS_TOKEN, UNK_TOKEN])
    return Tokenizer(inner, eos_token=EOS_TOKEN)


def encode_chars(tok: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """Ids of ``texts`` under a character-level ``tok`` (``train_char``), computed with numpy.

    The same ids as ``tok.encode_batch`` (a test holds them equal) at a fraction of the time: the
    Hugging Face pipeline splits 1 MB of text into a million pre-tokens, which takes seconds.

    Args:
        tok: a tokenizer from ``train_char`` (or loaded from its ``tokenizer.json``).
        texts: the documents.

    Returns:
        one int64 array of ids per text.
    """
    vocab = tok.inner.get_vocab(with_added_tokens=False)
    singles = sorted((ord(c), i) for c, i in vocab.items() if len(c) == 1)
    codes = np.asarray([c for c, _ in singles], dtype=np.int64)
    ids = np.asarray([i for _, i in singles], dtype=np.int64)
    unk = int(tok.inner.token_to_id(UNK_TOKEN))
    out = []
    for text in texts:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)  # one code point each
        where = np.clip(np.searchsorted(codes, points), 0, len(codes) - 1)
        out.append(np.where(codes[where] == points, ids[where], unk))
    return out


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"tokenizer training texts must be str, got {type(text).__name__}")
        yield text


def load_tokenizer(path: str | os.PathLike[str], *, eos_token: str | None = None) -> Tokenizer:
    """Load a ``tokenizer.json`` (a file, or a directory holding one).

    Raises:
        FileNotFoundError: nothing at ``path``; the message says how to make one.
        ValueError: the file is not a ``tokenizers`` JSON, or has no EOS token.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer file {str(p)!r} does not exist; point data.tokenizer at a tokenizer.json "
            f"or leave it empty to train a byte-level BPE on the corpus"
        )
    try:
        inner = _HFTokenizer.from_file(str(p))
    except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
        raise ValueError(f"{p} is not a Hugging Face tokenizers JSON file: {exc}") from None
    return Tokenizer(inner, eos_token=eos_token, path=p)
