"""Precision and recall of the detectors on the labelled evaluation set shipped in ``evalset/``.

``evalset/evalset.jsonl`` holds one labelled text per line: ``detector``,
``text``, ``label`` (1: the detector should fire, 0: it should not) and
``kind``: ``positive``, ``obfuscated`` (a positive hidden by zero-width
characters, homoglyphs, fullwidth forms, leetspeak, encodings...) or
``hard_negative`` (text that looks like a positive but is not: Luhn-invalid
cards, version strings, "ignore the typo"...). A text counts as flagged when
the detector returns any finding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plyx.safety._detectors import build_detector

__all__ = ["EVALSET", "EVAL_CONFIG", "DetectorScore", "load_evalset", "evaluate", "markdown_table"]

EVALSET = Path(__file__).parent / "evalset" / "evalset.jsonl"

# detector -> the options it is evaluated with
EVAL_CONFIG: dict[str, dict[str, Any]] = {
    "email": {}, "phone": {}, "credit_card": {}, "iban": {}, "national_id": {}, "ip_address": {}, "secrets": {},
    "deny_list": {"deny": ["idiot", "moron", "kill yourself", "bomb"], "allow": ["bath bomb"]},
    "prompt_injection": {"threshold": 0.5},
}


@dataclass(frozen=True)
class DetectorScore:
    """Counts and rates of one detector (``obfuscated_recall``: recall on obfuscated positives only)."""

    detector: str
    tp: int
    fp: int
    fn: int
    tn: int
    obfuscated_hits: int
    obfuscated_total: int

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0

    @property
    def obfuscated_recall(self) -> float:
        return self.obfuscated_hits / self.obfuscated_total if self.obfuscated_total else 1.0


def load_evalset(path: str | Path = EVALSET) -> list[dict[str, Any]]:
    """The labelled rows of the evaluation set."""
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def evaluate(detectors: Iterable[str] | None = None, path: str | Path = EVALSET) -> dict[str, DetectorScore]:
    """Score each detector on its rows of the evaluation set.

    Returns:
        detector name -> ``DetectorScore``.
    """
    rows = load_evalset(path)
    names = list(detectors) if detectors is not None else list(EVAL_CONFIG)
    scores = {}
    for name in names:
        detector = build_detector(name, EVAL_CONFIG.get(name, {}))
        tp = fp = fn = tn = oh = ot = 0
        for row in rows:
            if row["detector"] != name:
                continue
            flagged = bool(detector.detect(row["text"], {}))
            if row["label"]:
                tp += flagged
                fn += not flagged
                if row["kind"] == "obfuscated":
                    ot += 1
                    oh += flagged
            else:
                fp += flagged
                tn += not flagged
        scores[name] = DetectorScore(name, tp, fp, fn, tn, oh, ot)
    return scores


def markdown_table(scores: dict[str, DetectorScore]) -> str:
    """The README's table: one row per detector."""
    lines = ["| detector | precision | recall | obfuscated recall | positives | hard negatives |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in scores.values():
        lines.append(f"| {s.detector} | {s.precision:.3f} | {s.recall:.3f} | {s.obfuscated_recall:.3f} | "
                     f"{s.tp + s.fn} | {s.fp + s.tn} |")
    return "\n".join(lines)
