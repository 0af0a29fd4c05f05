"""Deny and allow lists: whole-word terms matched through obfuscation.

Terms and text are both normalised (case, accents, homoglyphs, zero-width
characters; see ``_normalize``). Each letter of a term then matches itself or
its leetspeak stand-ins (``a`` -> ``a4@``), letters may be split by one
separator (``k.i.l.l``, ``k i l l``) and words by any run of non-word
characters, and the term must start and end on a word boundary, so ``kill``
finds ``K1LL`` and ``kіll`` (Cyrillic i) but not ``skill``. A deny match inside
an allow match (``kill the process``) is not reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from plyx.safety._normalize import LEET, Normalized, normalize
from plyx.safety._types import DetectorOptionError, Finding

__all__ = ["DenyListDetector", "term_pattern"]

_LETTER_FORMS: dict[str, str] = {}
for _sym, _letter in LEET.items():
    _LETTER_FORMS[_letter] = _LETTER_FORMS.get(_letter, _letter) + _sym
_LETTER_FORMS["l"] = _LETTER_FORMS.get("l", "l") + "1"  # 1 stands for l as often as for i

_SEP = r"[\s.\-_*·~]?"  # one separator between letters of a word
# a run of non-word characters between words; bounded so that a streaming filter
# rescanning CONTEXT characters back finds the same matches as the whole-text pass
_GAP = r"[\W_]{1,8}"


def _atoms(term: str, leet: bool) -> list[str]:
    """One regex atom per character of the normalised term."""
    atoms = []
    for ch in term:
        if ch.isspace():
            atoms.append(_GAP)
        elif leet and ch in _LETTER_FORMS:
            atoms.append("[" + re.escape(_LETTER_FORMS[ch]) + "]")
        else:
            atoms.append(re.escape(ch))
    return atoms


def _joined(atoms: list[str], separators: bool) -> list[str]:
    out = []
    for i, atom in enumerate(atoms):
        out.append(atom)
        nxt = atoms[i + 1] if i + 1 < len(atoms) else None
        if separators and nxt is not None and atom != _GAP and nxt != _GAP:
            out.append(_SEP)
    return out


def term_pattern(term: str, *, leet: bool = True, separators: bool = True) -> tuple[str, str]:
    """(full-match pattern, partial-match pattern) of a normalised term.

    The partial pattern matches, at the end of a text, any proper prefix of a
    match: ``a(?:b(?:c)?)?\\Z`` for ``abc``. A streaming filter holds back what
    it matches, since more text could complete the term.
    """
    parts = _joined(_atoms(term, leet), separators)
    full = r"(?<!\w)" + "".join(parts) + r"(?!\w)"
    partial = ""
    for part in reversed(parts[1:]):
        partial = f"(?:{part}{partial})?"
    partial = r"(?<!\w)" + parts[0] + partial + r"\Z"
    return full, partial


class DenyListDetector:
    """Whole-word deny terms with Unicode and leetspeak normalisation, minus allowed phrases.

    Args:
        deny: terms or phrases to find (at least one).
        allow: phrases in which a deny term is fine (``kill the process``).
        leet: match leetspeak stand-ins for letters.
        separators: let one separator split the letters of a word.
        label: the finding label (``deny`` unless set).
    """

    name = "deny_list"
    scope = "span"

    def __init__(self, deny: Iterable[str] = (), allow: Iterable[str] = (), *, leet: bool = True,
                 separators: bool = True, label: str = "deny") -> None:
        if isinstance(deny, str) or isinstance(allow, str):
            raise DetectorOptionError("deny", "deny and allow must be lists of strings, not one string",
                                      fix='write deny = ["term"]')
        self.deny = [self._norm_term(t, "deny") for t in deny]
        self.allow = [self._norm_term(t, "allow") for t in allow]
        if not self.deny:
            raise DetectorOptionError("deny", "the deny list is empty", fix='give at least one term: deny = ["term"]')
        both = sorted(set(self.deny) & set(self.allow))
        if both:
            raise DetectorOptionError("allow", "a term is both denied and allowed", value=both[0],
                                      fix="remove it from one of the two lists")
        self.label = label
        self._deny = re.compile("|".join(f"(?:{term_pattern(t, leet=leet, separators=separators)[0]})" for t in self.deny))
        self._partial = re.compile(
            "|".join(f"(?:{term_pattern(t, leet=leet, separators=separators)[1]})" for t in self.deny)
        )
        self._allow = (
            re.compile("|".join(f"(?:{term_pattern(t, leet=leet, separators=separators)[0]})" for t in self.allow))
            if self.allow else None
        )
        self.max_len = max(3 * len(t) + 8 * t.count(" ") for t in self.deny) + 8

    @staticmethod
    def _norm_term(term: Any, option: str) -> str:
        if not isinstance(term, str) or not term.strip():
            raise DetectorOptionError(option, "terms must be non-empty strings", value=term)
        return " ".join(normalize(term).text.split())

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        norm: Normalized = normalize(text)
        allowed = [(m.start(), m.end()) for m in self._allow.finditer(norm.text)] if self._allow else []
        found = []
        for m in self._deny.finditer(norm.text):
            if any(a <= m.start() and m.end() <= b for a, b in allowed):
                continue
            found.append(Finding(self.name, self.label, *norm.span(m.start(), m.end()), 1.0, "term"))
        return found

    def pending(self, text: str) -> int:
        norm = normalize(text)
        start = max(0, len(norm.text) - self.max_len)
        m = self._partial.search(norm.text, start)
        # a term that is complete at the very end may still be a prefix of a
        # longer word ("kill" -> "killer"): the filter holds findings that touch the end
        return norm.offset(m.start()) if m else len(text)
