"""What a verification found: problems (each naming its artifact) and notes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "Report"]


@dataclass(frozen=True)
class Problem:
    """One failed check.

    Attributes:
        artifact: the file it is about, relative to the checked directory.
        check: which check failed (``missing``, ``checksum``, ``signature``,
            ``sbom``, ``receipt``, ``coverage``...).
        message: what is wrong and how to fix it.
    """

    artifact: str
    check: str
    message: str

    def __str__(self) -> str:
        return f"FAIL {self.artifact} [{self.check}]: {self.message}"


@dataclass
class Report:
    """The outcome of a verification: ``ok`` when no problem was found."""

    subject: str
    problems: list[Problem] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def fail(self, artifact: str, check: str, message: str) -> None:
        self.problems.append(Problem(artifact, check, message))

    def lines(self) -> list[str]:
        out = [f"ok   {p}" for p in self.passed]
        out += [f"note {n}" for n in self.notes]
        out += [str(p) for p in self.problems]
        verdict = "PASS" if self.ok else f"FAIL: {len(self.problems)} problem(s)"
        out.append(f"{verdict} - {self.subject}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "ok": self.ok,
            "problems": [{"artifact": p.artifact, "check": p.check, "message": p.message} for p in self.problems],
            "passed": list(self.passed),
            "notes": list(self.notes),
        }
