"""Unicode normalisation that remembers where every character came from.

Detectors match on a normalised copy of the text (zero-width characters
removed, compatibility forms folded, homoglyphs mapped to Latin, accents and
case folded) and report offsets in the original, so a redaction replaces
exactly the characters the user sent, zero-width padding included.

Sources: Unicode TR39 confusables (the Cyrillic/Greek letters below are the
ones that render like Latin letters in common fonts), TR15 (NFKD).
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

__all__ = ["Normalized", "normalize", "ZERO_WIDTH", "HOMOGLYPHS", "LEET"]

# Invisible characters used to split words past naive filters.
ZERO_WIDTH = frozenset(
    [0x00AD, 0x034F, 0x061C, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180E, 0x200B, 0x200C, 0x200D, 0x200E, 0x200F]
    + list(range(0x202A, 0x202F))
    + list(range(0x2060, 0x2065))
    + list(range(0xFE00, 0xFE10))  # variation selectors
    + [0x3164, 0xFEFF, 0xFFA0]
)

# Letters of other scripts that look like Latin ones (TR39 confusables, subset).
HOMOGLYPHS = {
    # Cyrillic
    "а": "a", "в": "b", "е": "e", "ё": "e", "к": "k", "м": "m", "н": "h", "о": "o", "р": "p",
    "с": "c", "т": "t", "у": "y", "х": "x", "ѕ": "s", "і": "i", "ї": "i", "ј": "j", "ԁ": "d",
    "ԛ": "q", "ԝ": "w", "ɡ": "g", "һ": "h", "ӏ": "l", "ү": "y",
    "А": "A", "В": "B", "Е": "E", "К": "K", "М": "M", "Н": "H", "О": "O", "Р": "P", "С": "C",
    "Т": "T", "У": "Y", "Х": "X", "Ѕ": "S", "І": "I", "Ј": "J", "Ԁ": "D", "Ԛ": "Q", "Ԝ": "W",
    # Greek
    "α": "a", "ο": "o", "ρ": "p", "ν": "v", "υ": "u", "ι": "i", "κ": "k", "τ": "t", "χ": "x",
    "ε": "e", "Α": "A", "Β": "B", "Ε": "E", "Ζ": "Z", "Η": "H", "Ι": "I", "Κ": "K", "Μ": "M",
    "Ν": "N", "Ο": "O", "Ρ": "P", "Τ": "T", "Υ": "Y", "Χ": "X",
    # Latin lookalikes and symbols
    "ı": "i", "ł": "l", "ø": "o", "đ": "d", "ħ": "h", "ß": "ss", "æ": "ae", "œ": "oe",
}

# Leetspeak digits and symbols -> the letters they stand for (first choice).
LEET = {"0": "o", "1": "i", "3": "e", "4": "a", "5": "s", "7": "t", "8": "b", "9": "g",
        "@": "a", "$": "s", "!": "i", "|": "l", "+": "t", "€": "e"}


@dataclass(frozen=True)
class Normalized:
    """A normalised text and the original offset of each of its characters.

    Attributes:
        text: the normalised text.
        index: ``index[i]`` is the offset in the original of ``text[i]``;
            ``index[len(text)]`` is the original's length (a sentinel).
    """

    text: str
    index: list[int] | range

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span covering normalised ``text[start:end]``."""
        if end <= start:
            at = self.index[start]
            return at, at
        return self.index[start], self.index[end - 1] + 1

    def offset(self, i: int) -> int:
        """Original offset of normalised position ``i`` (``len(text)`` allowed)."""
        return self.index[i]


def normalize(text: str, *, fold_case: bool = True, strip_marks: bool = True, homoglyphs: bool = True) -> Normalized:
    """Normalise ``text`` for matching, keeping an offset map back to it.

    Args:
        text: the original text.
        fold_case: apply ``str.casefold`` (``Straße`` -> ``strasse``).
        strip_marks: drop combining marks after NFKD (``kíll`` -> ``kill``).
        homoglyphs: map Cyrillic/Greek lookalikes to Latin letters.

    Returns:
        ``Normalized``; for ASCII input it is the (case-folded) text with an
        identity map, so the common case costs one ``lower()``.

    Example:
        >>> n = normalize("Ｋi\u200bll")
        >>> n.text, n.span(0, 4)
        ('kill', (0, 5))
    """
    if text.isascii():
        return Normalized(text.lower() if fold_case else text, range(len(text) + 1))
    out: list[str] = []
    index: list[int] = []
    for i, ch in enumerate(text):
        if ord(ch) in ZERO_WIDTH:
            continue
        if homoglyphs and ch in HOMOGLYPHS:
            pieces = HOMOGLYPHS[ch]
        else:
            pieces = unicodedata.normalize("NFKD", ch) if not ch.isascii() else ch
        for p in pieces:
            if strip_marks and unicodedata.combining(p):
                continue
            if homoglyphs and p in HOMOGLYPHS:
                p = HOMOGLYPHS[p]
            if ord(p[0]) in ZERO_WIDTH:
                continue
            folded = p.casefold() if fold_case else p
            if homoglyphs and folded != p:  # "Đ" folds to "đ", which has a Latin lookalike
                folded = "".join(HOMOGLYPHS.get(c, c) for c in folded)
            out.append(folded)
            index.extend([i] * len(folded))
    index.append(len(text))
    return Normalized("".join(out), index)
