"""What a detector is and what it finds.

A detector is any object with:

- ``name`` (str): the registered component name (``email``, ``deny_list``...);
- ``scope``: ``"span"`` when its findings are spans of the text that an action
  may redact (PII, deny lists, regexes), ``"text"`` when it judges the text as a
  whole (prompt injection, length, rate, classifiers);
- ``detect(text, context) -> list[Finding]``: offsets index ``text`` itself;
- ``pending(text) -> int`` (span detectors, optional): the index from which the
  end of a *partial* text could still grow into a match when more text arrives.
  Streaming output rails hold back ``text[pending(text):]`` and release the
  rest; without the method the whole text is held.

Detectors are built from the ``plyx_guardrails`` hook: each returns
``plyx.specs.Component(name, factory)`` and ``factory(**options)`` builds one
from the ``options`` table of a policy rule. A factory raises
``DetectorOptionError`` (a ``ValueError``) for bad options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from plyx.specs.errors import describe

__all__ = ["Finding", "Detector", "DetectorOptionError", "Scope"]

Scope = Literal["span", "text"]


@dataclass(frozen=True)
class Finding:
    """One match of a detector.

    Attributes:
        detector: the detector's name.
        label: what was found (``email``, ``credit_card``, ``injection:override``...).
        start: offset of the first character in the scanned text.
        end: offset one past the last character.
        score: confidence in [0, 1] (1 for checksum-validated matches).
        detail: a short, PII-free explanation (``luhn ok``, ``base64 -> override``).
    """

    detector: str
    label: str
    start: int
    end: int
    score: float = 1.0
    detail: str = ""

    def shifted(self, offset: int) -> Finding:
        return Finding(self.detector, self.label, self.start + offset, self.end + offset, self.score, self.detail)


@runtime_checkable
class Detector(Protocol):
    """The shape every guardrail detector has (see the module docstring)."""

    name: str
    scope: Scope

    def detect(self, text: str, context: Mapping[str, Any]) -> list[Finding]: ...


class DetectorOptionError(ValueError):
    """A detector was given an option it does not accept or cannot use.

    Attributes:
        option: the option's name; ``value`` what was given; ``fix`` how to make it right.
    """

    def __init__(self, option: str, problem: str, *, value: Any = None, fix: str = "") -> None:
        self.option = option
        self.problem = problem
        self.value = value
        self.fix = fix
        super().__init__(describe(f"option `{option}`", problem, value=value, fix=fix))
