"""Precision and recall of the detectors on the labelled evaluation set shipped in ``evalset/``.

``evalset/evalset.jsonl`` holds one labelled text per line: ``detector``,
``text``, ``label`` (1: the detector should fire, 0: it should not) and
``kind``: ``positive``, ``obfuscated`` (a positive hidden by zero-width
characters, homoglyphs, fullwidth forms, leetspeak, encodings...) or
``hard_negative`` (text that looks like a positive but is not: Luhn-invalid
cards, version strings, "ignore the typo"...) or ``cross_entity`` (another
entity's look-alike: an IBAN whose digits read as a phone number, a card whose
first digits pass an Aadhaar check, ``logo@2x.png``, ``AKIAXXXXXXXXXXXXXXXX``).
A row may list other entities its text holds in ``contains`` (a card
detector's hard negative ``phone +1 415 555 0132`` is a phone number). A text
counts as flagged when the detector returns any finding.

Every detector is scored on every text of the set, not only on its own rows:
a detector that fires on a text labelled for another detector (or on any
negative) is a false positive, so cross-entity confusion shows in precision
and in ``confusion_matrix``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plyx.safety._detectors import build_detector

__all__ = ["EVALSET", "EVAL_CONFIG", "DetectorScore", "load_evalset", "evaluate", "markdown_table", "confusion_matrix",
           "markdown_confusion"]

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


def _truth(row: dict[str, Any]) -> str:
    """What a row's text really is: its detector when labelled positive, else what it ``contains``, else ``none``."""
    if row["label"]:
        return str(row["detector"])
    return str(row["contains"][0]) if row.get("contains") else "none"


def _positive(row: dict[str, Any], name: str) -> bool:
    """Whether ``name`` should fire on the row's text."""
    return bool(row["label"] and row["detector"] == name) or name in row.get("contains", ())


def _flags(names: list[str], rows: list[dict[str, Any]]) -> dict[str, list[bool]]:
    """detector -> for each row, whether it returned any finding."""
    out = {}
    for name in names:
        detector = build_detector(name, EVAL_CONFIG.get(name, {}))
        out[name] = [bool(detector.detect(row["text"], {})) for row in rows]
    return out


def evaluate(detectors: Iterable[str] | None = None, path: str | Path = EVALSET) -> dict[str, DetectorScore]:
    """Score each detector on every row of the evaluation set.

    A row is a positive for a detector when it is labelled 1 for that detector;
    every other row (the detector's hard negatives and every other entity's
    texts) is a negative for it.

    Returns:
        detector name -> ``DetectorScore``.
    """
    rows = load_evalset(path)
    names = list(detectors) if detectors is not None else list(EVAL_CONFIG)
    flags = _flags(names, rows)
    scores = {}
    for name in names:
        tp = fp = fn = tn = oh = ot = 0
        for row, flagged in zip(rows, flags[name], strict=True):
            if _positive(row, name):
                tp += flagged
                fn += not flagged
                if row["kind"] == "obfuscated" and row["detector"] == name:
                    ot += 1
                    oh += flagged
            else:
                fp += flagged
                tn += not flagged
        scores[name] = DetectorScore(name, tp, fp, fn, tn, oh, ot)
    return scores


def confusion_matrix(detectors: Iterable[str] | None = None, path: str | Path = EVALSET) -> dict[str, dict[str, int]]:
    """How often each detector fires on the texts of each true entity.

    Returns:
        true entity (a row's detector when labelled positive, ``none`` for
        negatives) -> detector -> number of its texts the detector flagged. The
        diagonal is recall's numerator; anything off it is a false positive.
    """
    rows = load_evalset(path)
    names = list(detectors) if detectors is not None else list(EVAL_CONFIG)
    flags = _flags(names, rows)
    matrix: dict[str, dict[str, int]] = {}
    for i, row in enumerate(rows):
        counts = matrix.setdefault(_truth(row), dict.fromkeys(names, 0))
        for name in names:
            counts[name] += flags[name][i]
    return dict(sorted(matrix.items(), key=lambda kv: (kv[0] == "none", kv[0])))


def markdown_confusion(matrix: dict[str, dict[str, int]]) -> str:
    """The confusion matrix as a Markdown table (rows: true entity, columns: detector that fired)."""
    names = list(next(iter(matrix.values()), {}))
    lines = ["| true \\ fired | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for truth, counts in matrix.items():
        lines.append(f"| {truth} | " + " | ".join(str(counts[n]) for n in names) + " |")
    return "\n".join(lines)


def markdown_table(scores: dict[str, DetectorScore]) -> str:
    """The README's table: one row per detector."""
    lines = ["| detector | precision | recall | obfuscated recall | positives | negatives |",
             "|---|---:|---:|---:|---:|---:|"]
    for s in scores.values():
        lines.append(f"| {s.detector} | {s.precision:.3f} | {s.recall:.3f} | {s.obfuscated_recall:.3f} | "
                     f"{s.tp + s.fn} | {s.fp + s.tn} |")
    return "\n".join(lines)
