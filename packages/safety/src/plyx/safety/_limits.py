"""Length and rate limits."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from plyx.safety._types import DetectorOptionError, Finding

__all__ = ["LengthDetector", "RateLimitDetector"]


class LengthDetector:
    """Flags a text longer than ``max_chars`` characters, ``max_words`` words or ``max_lines`` lines.

    The finding covers the excess (from the first character past the limit).
    """

    name = "length"
    scope = "text"

    def __init__(self, max_chars: int | None = None, max_words: int | None = None, max_lines: int | None = None) -> None:
        for opt, value in (("max_chars", max_chars), ("max_words", max_words), ("max_lines", max_lines)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise DetectorOptionError(opt, "must be a positive integer", value=value)
        if max_chars is None and max_words is None and max_lines is None:
            raise DetectorOptionError("max_chars", "no limit given", fix="set max_chars, max_words or max_lines")
        self.max_chars, self.max_words, self.max_lines = max_chars, max_words, max_lines

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        found = []
        if self.max_chars is not None and len(text) > self.max_chars:
            found.append(Finding(self.name, "length:chars", self.max_chars, len(text), 1.0, f"limit {self.max_chars}"))
        if self.max_words is not None:
            words = text.split()
            if len(words) > self.max_words:
                found.append(Finding(self.name, "length:words", 0, len(text), 1.0, f"limit {self.max_words}"))
        if self.max_lines is not None and text.count("\n") + 1 > self.max_lines:
            found.append(Finding(self.name, "length:lines", 0, len(text), 1.0, f"limit {self.max_lines}"))
        return found


class RateLimitDetector:
    """At most ``requests`` per ``per_seconds`` for each value of ``context[key]`` (sliding window).

    Only meaningful in input rails: each ``detect`` call counts one request.

    Args:
        requests: requests allowed in the window.
        per_seconds: the window length.
        key: the context field that identifies a caller (``client`` by default).
        clock: monotonic clock in seconds (tests inject a fake one).
    """

    name = "rate_limit"
    scope = "text"
    input_only = True

    def __init__(self, requests: int = 60, per_seconds: float = 60.0, key: str = "client",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(requests, int) or isinstance(requests, bool) or requests < 1:
            raise DetectorOptionError("requests", "must be a positive integer", value=requests)
        if not float(per_seconds) > 0:
            raise DetectorOptionError("per_seconds", "must be > 0", value=per_seconds)
        self.requests, self.per_seconds, self.key, self.clock = requests, float(per_seconds), key, clock
        self._seen: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        who = str((context or {}).get(self.key, "") or "anonymous")
        now = self.clock()
        with self._lock:
            window = self._seen.setdefault(who, deque())
            while window and window[0] <= now - self.per_seconds:
                window.popleft()
            if len(window) >= self.requests:
                return [Finding(self.name, "rate_limit", 0, len(text), 1.0,
                                f"{self.requests} per {self.per_seconds:g}s exceeded")]
            window.append(now)
            if len(self._seen) > 100_000:  # bound memory: forget idle callers
                for k in [k for k, w in self._seen.items() if not w or w[-1] <= now - self.per_seconds]:
                    del self._seen[k]
        return []
