"""User regexes as a detector."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from plyx.safety._normalize import normalize
from plyx.safety._types import DetectorOptionError, Finding

__all__ = ["RegexDetector"]

_FLAGS = {"IGNORECASE": re.IGNORECASE, "MULTILINE": re.MULTILINE, "DOTALL": re.DOTALL, "VERBOSE": re.VERBOSE,
          "ASCII": re.ASCII}
# constructs that can match whitespace: a match may then span words
_SPANS_WORDS = re.compile(r"\\s|\\W|\\D|\\S|\[\^| |\.")


class RegexDetector:
    """Matches of one or more regular expressions (Python ``re`` syntax).

    Args:
        patterns: the expressions; a match of any is a finding.
        flags: names of ``re`` flags (``IGNORECASE``, ``MULTILINE``, ``DOTALL``, ``VERBOSE``, ``ASCII``).
        label: the finding label (``regex`` unless set).
        normalize: match on the normalised text (case, homoglyphs, zero-width) instead of the raw one.
        max_len: the longest match expected; streaming holds back at most this many characters.
    """

    name = "regex"
    scope = "span"

    def __init__(self, patterns: Iterable[str] = (), flags: Iterable[str] = (), label: str = "regex",
                 normalize: bool = False, max_len: int = 128) -> None:
        if isinstance(patterns, str):
            patterns = [patterns]
        patterns = list(patterns)
        if not patterns:
            raise DetectorOptionError("patterns", "no pattern given", fix='write patterns = ["..."]')
        value = 0
        for name in flags:
            if name.upper() not in _FLAGS:
                raise DetectorOptionError("flags", "unknown regex flag", value=name, fix=f"choose from {', '.join(_FLAGS)}")
            value |= _FLAGS[name.upper()]
        self.compiled = []
        for i, p in enumerate(patterns):
            if not isinstance(p, str):
                raise DetectorOptionError(f"patterns[{i}]", "a pattern must be a string", value=p)
            try:
                self.compiled.append(re.compile(p, value))
            except re.error as exc:
                raise DetectorOptionError(
                    f"patterns[{i}]", f"invalid regular expression: {exc}", value=p,
                    fix="fix the expression (Python `re` syntax); pass flags through `flags`, not inline",
                ) from None
            if self.compiled[-1].search(""):
                raise DetectorOptionError(f"patterns[{i}]", "the pattern matches the empty string", value=p,
                                          fix="make it match at least one character")
        self.label = label
        self.normalize = normalize
        self.max_len = int(max_len)
        self._tail = re.compile(r"\S+\Z")
        self._spans_words = any(_SPANS_WORDS.search(p) for p in patterns)

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        norm = normalize(text) if self.normalize else None
        subject = norm.text if norm else text
        found = []
        for rx in self.compiled:
            for m in rx.finditer(subject):
                s, e = norm.span(m.start(), m.end()) if norm else (m.start(), m.end())
                found.append(Finding(self.name, self.label, s, e, 1.0, "pattern"))
        return found

    def pending(self, text: str) -> int:
        # Python's re has no partial matching: a pattern that can span words may
        # still match anywhere in the last max_len characters; one that cannot
        # only within the trailing word.
        floor = max(0, len(text) - self.max_len)
        if self._spans_words:
            return floor
        m = self._tail.search(text, floor)
        return m.start() if m else len(text)
