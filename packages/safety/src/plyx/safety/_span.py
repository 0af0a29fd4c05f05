"""Shared machinery of span detectors: match on normalised text, report original offsets,
and tell a streaming filter how much of a partial text could still become a match."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from plyx.safety._normalize import Normalized, normalize
from plyx.safety._types import Finding

__all__ = ["SpanDetector", "trailing_run"]


def trailing_run(text: str, alphabet: re.Pattern[str], max_len: int) -> int:
    """Start of the longest suffix of ``text`` made of ``alphabet`` characters, at most ``max_len`` long.

    A match of a detector whose matches only contain ``alphabet`` characters and
    are at most ``max_len`` long can only still grow out of this suffix. When the
    suffix reaches past ``max_len`` (a 400-character JWT) the span may have started
    anywhere: 0 is returned, so a streaming filter holds everything it has not
    released until the run ends and the span can be decided.
    """
    floor = max(0, len(text) - max_len)
    m = alphabet.search(text, floor)
    # the pattern is anchored at the end (`...+\Z`), so its first hit is the run
    if m is None:
        return len(text)
    if m.start() == floor > 0 and alphabet.match(text, floor - 1):
        return 0  # longer than the bound: never let an undecided span go
    return m.start()


class SpanDetector:
    """Base of the regex-and-validator detectors.

    Subclasses set ``name``, ``alphabet`` (a character class every match is made
    of, used for streaming hold-back) and ``max_len``, and implement ``_scan``
    on the normalised text.
    """

    name = "span"
    scope = "span"
    alphabet = r"[\w@.+\-]"
    #: a regex, anchored with ``\Z``, matching the end of a text that could still
    #: grow into a match; None means ``alphabet+\Z``
    tail: str | None = None
    max_len = 64
    fold_case = False

    def __init__(self) -> None:
        self._tail = re.compile(self.tail or f"{self.alphabet}+\\Z")

    def _scan(self, text: str) -> list[tuple[str, int, int, float, str]]:
        """(label, start, end, score, detail) over normalised ``text``."""
        raise NotImplementedError

    def _normalize(self, text: str) -> Normalized:
        return normalize(text, fold_case=self.fold_case)

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        norm = self._normalize(text)
        found = []
        for label, start, end, score, detail in self._scan(norm.text):
            s, e = norm.span(start, end)
            found.append(Finding(self.name, label, s, e, score, detail))
        return found

    def pending(self, text: str) -> int:
        norm = self._normalize(text)
        return norm.offset(trailing_run(norm.text, self._tail, self.max_len))
