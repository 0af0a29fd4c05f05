"""User regexes as a detector.

Matching uses Python's ``re``; streaming uses the ``regex`` module's partial
matching (``partial=True``) on the same patterns to tell exactly from where a
partial text could still grow into a match, however long that match gets.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import regex
from plyx.safety._normalize import normalize
from plyx.safety._types import DetectorOptionError, Finding

__all__ = ["RegexDetector"]

_FLAGS = {"IGNORECASE": re.IGNORECASE, "MULTILINE": re.MULTILINE, "DOTALL": re.DOTALL, "VERBOSE": re.VERBOSE,
          "ASCII": re.ASCII}
_PARTIAL_FLAGS = {"IGNORECASE": regex.IGNORECASE, "MULTILINE": regex.MULTILINE, "DOTALL": regex.DOTALL,
                  "VERBOSE": regex.VERBOSE, "ASCII": regex.ASCII}


class RegexDetector:
    """Matches of one or more regular expressions (Python ``re`` syntax).

    Args:
        patterns: the expressions; a match of any is a finding.
        flags: names of ``re`` flags (``IGNORECASE``, ``MULTILINE``, ``DOTALL``, ``VERBOSE``, ``ASCII``).
        label: the finding label (``regex`` unless set).
        normalize: match on the normalised text (case, homoglyphs, zero-width) instead of the raw one.
        max_len: kept for older policies; streaming no longer relies on it: a match of any length is held
            back until it is decided (partial matching).
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
        value = partial_flags = 0
        for name in flags:
            if name.upper() not in _FLAGS:
                raise DetectorOptionError("flags", "unknown regex flag", value=name, fix=f"choose from {', '.join(_FLAGS)}")
            value |= _FLAGS[name.upper()]
            partial_flags |= _PARTIAL_FLAGS[name.upper()]
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
        # the same patterns for partial matching; one `regex` cannot compile is held back whole
        self._partial: list[regex.Pattern[str]] | None = []
        try:
            self._partial = [regex.compile(p, partial_flags | regex.VERSION0) for p in patterns]
        except regex.error:
            self._partial = None
        self.label = label
        self.normalize = normalize
        self.max_len = int(max_len)

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
        """The start of the earliest partial match at the end of ``text`` (``len(text)`` if none)."""
        norm = normalize(text) if self.normalize else None
        subject = norm.text if norm else text
        if self._partial is None:
            return 0
        hold = len(subject)
        for rx in self._partial:
            for m in rx.finditer(subject, partial=True):
                if m.partial and m.start() < hold:
                    hold = m.start()
        return norm.offset(hold) if norm else hold
