"""Conformance checks for guardrail detectors, runnable by third parties on their own.

``check_detector(detector, samples)`` asserts the detector contract of
``plyx.safety`` (see ``_types``): the attributes, well-formed findings,
determinism, and for span detectors the streaming promise: releasing text
before ``pending(prefix)`` at any cut of any sample never releases a span that
the whole text would flag. plyx-safety runs it on every detector the registry
discovers.

Example:
    >>> from plyx.safety import build_detector
    >>> check_detector(build_detector("email"), ["mail jane@example.com now"])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from plyx.safety._types import Finding

__all__ = ["check_detector", "DetectorContractError"]


class DetectorContractError(AssertionError):
    """A detector breaks the contract; the message names the detector, the rule broken and the input."""


def _fail(detector: Any, problem: str) -> None:
    raise DetectorContractError(f"detector {getattr(detector, 'name', type(detector).__name__)!r}: {problem}")


def _findings(detector: Any, text: str) -> list[Finding]:
    found = detector.detect(text, {})
    if not isinstance(found, list):
        _fail(detector, f"detect() returned {type(found).__name__}, expected a list of Finding")
    for f in found:
        if not isinstance(f, Finding):
            _fail(detector, f"detect() returned {f!r}, not a plyx.safety.Finding")
        if not (0 <= f.start <= f.end <= len(text)):
            _fail(detector, f"span ({f.start}, {f.end}) is outside the text of length {len(text)}: {text!r}")
        if not 0 <= f.score <= 1:
            _fail(detector, f"score {f.score} is outside [0, 1]")
    return found


def _hold(detector: Any, prefix: str) -> int:
    """Where a streaming filter stops releasing after receiving ``prefix``."""
    hold = detector.pending(prefix)
    if not (0 <= hold <= len(prefix)):
        _fail(detector, f"pending() returned {hold} for a text of length {len(prefix)}: {prefix!r}")
    for f in _findings(detector, prefix):
        if f.end >= len(prefix):
            hold = min(hold, f.start)
    return hold


def check_detector(detector: Any, samples: Iterable[str]) -> None:
    """Assert that ``detector`` keeps the detector contract on ``samples``.

    Raises:
        DetectorContractError: naming the detector, what it broke and on which input.
    """
    if not isinstance(getattr(detector, "name", None), str):
        _fail(detector, "has no `name` string")
    scope = getattr(detector, "scope", None)
    if scope not in ("span", "text"):
        _fail(detector, f"`scope` is {scope!r}; expected 'span' or 'text'")
    for text in samples:
        first = _findings(detector, text)
        if _findings(detector, text) != first:
            _fail(detector, f"two calls on the same text disagree: {text!r}")
        if scope != "span" or not hasattr(detector, "pending"):
            continue
        whole = {(f.start, f.end) for f in first}
        for k in range(len(text) + 1):
            prefix = text[:k]
            released = _hold(detector, prefix)
            seen = {(f.start, f.end) for f in _findings(detector, prefix)}
            for start, end in whole:
                if start < released and (start, end) not in seen:
                    _fail(detector, f"after {prefix!r} the text up to {released} is released, but the whole text "
                                    f"{text!r} has a finding at ({start}, {end}) that the prefix did not show; "
                                    "pending() must hold back everything that could still become a match")
