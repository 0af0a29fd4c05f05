"""The classifier-model hook: any text classifier as a detector.

``model`` is a callable or an import string ``"package.module:attr"``. It is
called with the text and may return:

- a float: the probability the text is unsafe;
- a mapping ``{label: score}``;
- a list of ``{"label": ..., "score": ...}`` (what a Hugging Face
  ``pipeline("text-classification")`` returns), or a list of such lists.

Labels listed in ``labels`` (all labels when empty) at or above ``threshold``
are findings. Third parties can equally ship a classifier as its own detector
through the ``plyx_guardrails`` hook.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from plyx.safety._types import DetectorOptionError, Finding

__all__ = ["ClassifierDetector", "resolve_callable"]


def resolve_callable(spec: str | Callable[..., Any], option: str = "model") -> Callable[..., Any]:
    """A callable from ``"module:attr"`` (attr may be dotted), or ``spec`` itself if callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise DetectorOptionError(option, "expected a callable or an import string", value=spec,
                                  fix='write it as "package.module:function"')
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise DetectorOptionError(option, f"cannot import module {module_name!r}: {exc}", value=spec,
                                  fix="install the package that provides it or fix the name") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise DetectorOptionError(option, f"{module_name!r} has no attribute {attr!r}", value=spec) from None
    if not callable(obj):
        raise DetectorOptionError(option, "the import string does not name a callable", value=spec)
    return obj


def _scores(result: Any) -> dict[str, float]:
    if isinstance(result, bool):
        return {"unsafe": float(result)}
    if isinstance(result, (int, float)):
        return {"unsafe": float(result)}
    if isinstance(result, Mapping):
        if "label" in result and "score" in result:
            return {str(result["label"]): float(result["score"])}
        return {str(k): float(v) for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        out: dict[str, float] = {}
        for item in result:
            for k, v in _scores(item).items():
                out[k] = max(v, out.get(k, 0.0))
        return out
    raise TypeError(f"classifier returned {type(result).__name__}; expected a float, a mapping or a list of "
                    f"{{'label', 'score'}}")


class ClassifierDetector:
    """A text classifier as a guardrail (see the module docstring)."""

    name = "classifier"
    scope = "text"

    def __init__(self, model: str | Callable[..., Any] = "", threshold: float = 0.5,
                 labels: Iterable[str] = ()) -> None:
        if not model:
            raise DetectorOptionError("model", "no classifier given", fix='set model = "package.module:function"')
        self.model = resolve_callable(model)
        if not 0 <= float(threshold) <= 1:
            raise DetectorOptionError("threshold", "must be in [0, 1]", value=threshold)
        self.threshold = float(threshold)
        self.labels = frozenset(labels)

    def detect(self, text: str, context: Mapping[str, Any] | None = None) -> list[Finding]:
        scores = _scores(self.model(text))
        return [
            Finding(self.name, f"classifier:{label}", 0, len(text), round(score, 4), "model")
            for label, score in sorted(scores.items())
            if (not self.labels or label in self.labels) and score >= self.threshold
        ]
