"""``plyx safety scan CORPUS``: redact or report PII in a corpus before tokenization.

A corpus is a file or a folder of ``.txt``/``.md`` files (one document each)
and ``.jsonl`` files (one document per line, the text under ``text_field``).
The policy's ``documents`` rail decides: ``redact`` rewrites spans, ``block``
drops the document, ``warn``/``log`` only report. The report lists, per
document, the rule ids, labels and counts, never the matched text.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plyx.safety._guard import Guard
from plyx.safety._policy import Policy

__all__ = ["ScanSummary", "scan_corpus", "iter_corpus"]

TEXT_SUFFIXES = (".txt", ".md")


@dataclass
class ScanSummary:
    """Counts over a scanned corpus."""

    documents: int = 0
    flagged: int = 0
    redacted: int = 0
    dropped: int = 0
    labels: Counter[str] = field(default_factory=Counter)
    rules: Counter[str] = field(default_factory=Counter)
    written: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"documents": self.documents, "flagged": self.flagged, "redacted": self.redacted,
                "dropped": self.dropped, "labels": dict(self.labels), "rules": dict(self.rules),
                "written": self.written}


def _files(corpus: Path) -> list[Path]:
    if corpus.is_file():
        return [corpus]
    if not corpus.is_dir():
        raise FileNotFoundError(f"corpus {str(corpus)!r} does not exist; give a file or a folder of .txt/.md/.jsonl files")
    return sorted(p for p in corpus.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES + (".jsonl",))


def iter_corpus(corpus: str | Path, text_field: str = "text") -> Iterator[tuple[Path, int, dict[str, Any] | None, str]]:
    """(file, line number or 0, the JSON record or None, text) for every document."""
    root = Path(corpus)
    for path in _files(root):
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError:
                        raise ValueError(f"{path}:{n}: not valid JSON; each line of a .jsonl corpus is one object") from None
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise ValueError(f"{path}:{n}: no string field {text_field!r}; pass --text-field with the "
                                         "name of the field that holds the document")
                    yield path, n, record, text
        else:
            yield path, 0, None, path.read_text(encoding="utf-8", errors="replace")


def scan_corpus(corpus: str | Path, *, policy: Policy | str | Path = "builtin:default", out_dir: str | Path | None = None,
                report_path: str | Path | None = None, text_field: str = "text") -> ScanSummary:
    """Scan ``corpus`` with the policy's ``documents`` rail.

    Args:
        corpus: a file or folder (see the module docstring).
        policy: the policy (default: the built-in ``default``, which redacts all PII).
        out_dir: write the redacted corpus here, mirroring the input layout (None: report only).
        report_path: a JSONL file with one line per flagged document (rule ids, labels, counts).
        text_field: the field holding the text in ``.jsonl`` files.

    Returns:
        ``ScanSummary``.
    """
    guard = policy if isinstance(policy, Guard) else Guard(policy)
    if not guard.rails["documents"]:
        raise ValueError(f"policy {guard.policy.name!r} has no [[documents]] rules; add one (e.g. detector = \"pii\", "
                         "action = \"redact\") or use --policy builtin:default")
    root = Path(corpus)
    base = root if root.is_dir() else root.parent
    summary = ScanSummary()
    report = Path(report_path).open("w", encoding="utf-8") if report_path else None
    outputs: dict[Path, Any] = {}
    try:
        for path, line, record, text in iter_corpus(root, text_field):
            summary.documents += 1
            decision = guard.check_document(text, {"document": f"{path.name}:{line}" if line else path.name})
            if decision.hits:
                summary.flagged += 1
                for h in decision.hits:
                    summary.rules[h.rule_id] += 1
                    summary.labels.update(label.split(":", 1)[0] for label in h.labels)
                if report:
                    report.write(json.dumps({
                        "file": str(path.relative_to(base)), "line": line, "blocked": decision.blocked,
                        "rules": [{"rule_id": h.rule_id, "action": h.action, "labels": list(h.labels),
                                   "count": len(h.spans), "spans": [list(s) for s in h.spans]} for h in decision.hits],
                    }) + "\n")
            if decision.blocked:
                summary.dropped += 1
            elif decision.text != text:
                summary.redacted += 1
            if out_dir is None:
                continue
            target = Path(out_dir) / path.relative_to(base)
            if target not in outputs:
                target.parent.mkdir(parents=True, exist_ok=True)
                outputs[target] = target.open("w", encoding="utf-8")
                summary.written.append(str(target))
            if decision.blocked:
                continue
            if record is not None:
                outputs[target].write(json.dumps({**record, text_field: decision.text}, ensure_ascii=False) + "\n")
            else:
                outputs[target].write(decision.text)
    finally:
        for fh in outputs.values():
            fh.close()
        if report:
            report.close()
    return summary
