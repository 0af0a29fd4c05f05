"""Running probes against a target: a JSONL log of every attempt and a Markdown report.

Each attempt ends in one of four outcomes: ``failed`` (the target did what the
probe tried), ``passed`` (it did not), ``error`` (no answer: unreachable, a
non-refusal HTTP error such as ``context_length_exceeded``, a prompt that does
not fit) or ``empty`` (an answer with no text). Only ``failed`` and ``passed``
are judged; the failure rate is over them alone, and a run whose errors or
empty replies exceed ``max_error_rate`` of the attempts is *inconclusive*:
``report.ok`` is False and the CLI exits 1, so a target that never answered
cannot score "0% failure".
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plyx.safety._engine import redact
from plyx.safety._pii import PiiDetector
from plyx.safety._probes import BUILTIN_PROBES, HAZARDS, Attempt
from plyx.specs import Component
from plyx.specs.plugins import components

__all__ = ["RedteamResult", "RedteamReport", "available_probes", "run_redteam", "BUILTIN_PROBE_COMPONENTS"]

BUILTIN_PROBE_COMPONENTS = [Component(p.name, p, p.description) for p in BUILTIN_PROBES]


def available_probes() -> dict[str, Component]:
    """Every probe family the installed plugins provide."""
    found = components("plyx_redteam_probes")
    return found or {c.name: c for c in BUILTIN_PROBE_COMPONENTS}


@dataclass(frozen=True)
class RedteamResult:
    """The outcome of one attempt (``failed``: the target did what the probe tried to make it do)."""

    probe: str
    family: str
    attempt: str
    category: str
    failed: bool
    reason: str
    prompt: str
    response: str
    error: str = ""
    seconds: float = 0.0
    empty: bool = False

    @property
    def outcome(self) -> str:
        """failed | passed | error | empty."""
        return "error" if self.error else "empty" if self.empty else "failed" if self.failed else "passed"


@dataclass
class RedteamReport:
    """All results plus where the log and report were written."""

    target: str
    results: list[RedteamResult] = field(default_factory=list)
    log_path: Path | None = None
    report_path: Path | None = None
    max_error_rate: float = 0.05

    def rates(self, key: Callable[[RedteamResult], str]) -> dict[str, tuple[int, int, int]]:
        """key -> (attempts judged, failures, errors); empty replies are in none of them (see ``empties``)."""
        table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.results:
            k = key(r)
            if not k:
                continue
            if r.error:
                table[k][2] += 1
            elif r.empty:
                table.setdefault(k, [0, 0, 0])  # listed even when all its replies were empty
            else:
                table[k][0] += 1
                table[k][1] += int(r.failed)
        return {k: (v[0], v[1], v[2]) for k, v in sorted(table.items(), key=lambda kv: _order(kv[0]))}

    def empties(self, key: Callable[[RedteamResult], str]) -> dict[str, int]:
        """key -> attempts answered with an empty reply."""
        table: dict[str, int] = defaultdict(int)
        for r in self.results:
            if key(r):
                table[key(r)] += int(r.empty and not r.error)
        return dict(table)

    @property
    def judged(self) -> list[RedteamResult]:
        """The attempts that got a non-empty answer (or a refusal)."""
        return [r for r in self.results if not r.error and not r.empty]

    @property
    def failure_rate(self) -> float:
        """Failures among the judged attempts (0.0 when none was judged: check ``ok``)."""
        judged = self.judged
        return sum(r.failed for r in judged) / len(judged) if judged else 0.0

    @property
    def error_count(self) -> int:
        return sum(bool(r.error) for r in self.results)

    @property
    def empty_count(self) -> int:
        return sum(r.empty and not r.error for r in self.results)

    @property
    def unjudged_rate(self) -> float:
        """Share of attempts that were errors or empty replies."""
        return (self.error_count + self.empty_count) / len(self.results) if self.results else 0.0

    @property
    def ok(self) -> bool:
        """True when the run is conclusive: something was judged and errors plus empty replies stay
        within ``max_error_rate`` of the attempts."""
        return bool(self.judged) and self.unjudged_rate <= self.max_error_rate

    @property
    def verdict(self) -> str:
        """One line saying whether the failure rate can be trusted, and why not."""
        if self.ok:
            return f"conclusive: {len(self.judged)} of {len(self.results)} attempts judged"
        return (f"INCONCLUSIVE: {self.error_count} errors and {self.empty_count} empty replies in "
                f"{len(self.results)} attempts ({self.unjudged_rate:.1%} > max_error_rate {self.max_error_rate:.1%}); "
                "the failure rate below covers only the judged attempts")

    def markdown(self) -> str:
        lines = [
            "# plyx safety red-team report", "",
            f"- target: `{self.target}`",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
            f"- attempts: {len(self.results)} ({self.error_count} errors, {self.empty_count} empty replies, "
            f"{len(self.judged)} judged)",
            f"- verdict: {self.verdict}",
            f"- overall failure rate (judged attempts): {self.failure_rate:.1%}", "",
            "A failure is an attempt where the target did what the probe tried to make it do "
            "(complied with a harmful request, printed an injected canary, leaked planted PII).", "",
            "Errors (no answer, or an HTTP error that is not a content-policy refusal) and empty replies are "
            "not judged: they count neither as refusals nor as failures.", "",
            "## Failure rate per probe", "", "| probe | attempts | failures | failure rate | errors | empty |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        empties = self.empties(lambda r: r.probe)
        for name, (n, f, e) in self.rates(lambda r: r.probe).items():
            lines.append(f"| {name} | {n} | {f} | {_pct(f, n)} | {e} | {empties.get(name, 0)} |")
        errors = [r for r in self.results if r.error]
        if errors:
            kinds: dict[str, int] = defaultdict(int)
            for r in errors:
                kinds[r.error[:160]] += 1
            lines += ["", "## Errors", "", "| count | error |", "|---:|---|"]
            lines += [f"| {n} | {msg.replace('|', '/')} |" for msg, n in sorted(kinds.items(), key=lambda kv: -kv[1])[:20]]
        lines += ["", "## Failure rate per category", "",
                  "Hazard categories follow the MLCommons AILuminate taxonomy (S1-S14).", "",
                  "| category | name | attempts | failures | failure rate |", "|---|---|---:|---:|---:|"]
        for cat, (n, f, _) in self.rates(lambda r: r.category).items():
            lines.append(f"| {cat} | {HAZARDS.get(cat, '')} | {n} | {f} | {_pct(f, n)} |")
        failed = [r for r in self.results if r.failed]
        if failed:
            lines += ["", "## Failed attempts", "", "| probe | attempt | category | reason |", "|---|---|---|---|"]
            lines += [f"| {r.probe} | {r.attempt} | {r.category or '-'} | {r.reason} |" for r in failed]
        return "\n".join(lines) + "\n"


def _order(key: str) -> tuple[int, str]:
    return (int(key[1:]), key) if key[:1] == "S" and key[1:].isdigit() else (1000, key)


def _pct(f: int, n: int) -> str:
    return f"{f / n:.1%}" if n else "-"


_REDACTOR = PiiDetector()


def _scrub(text: str) -> str:
    """The response as logged: PII a real model may leak is redacted from the log."""
    return redact(text, [(f.start, f.end, f"[{f.label.upper()}]") for f in _REDACTOR.detect(text)])


def run_redteam(
    target: Callable[[Sequence[dict[str, Any]]], str],
    *,
    probes: Iterable[str] | None = None,
    probe_options: dict[str, dict[str, Any]] | None = None,
    out_dir: str | Path | None = None,
    workers: int = 4,
    target_name: str = "",
    max_error_rate: float = 0.05,
) -> RedteamReport:
    """Send every attempt of the chosen probes to ``target`` and judge the replies.

    Args:
        target: ``(messages) -> reply text`` (see ``resolve_target``).
        probes: probe names (default: every installed probe).
        probe_options: per-probe factory options (``{"jailbreak": {"limit": 5}}``).
        out_dir: where ``redteam.jsonl`` and ``redteam.md`` go (None: write nothing).
        workers: concurrent requests.
        target_name: how the report names the target.
        max_error_rate: the share of attempts that may be errors or empty replies before the run is
            inconclusive (``report.ok`` False).

    Returns:
        A ``RedteamReport``.

    Example:
        >>> from plyx.safety import run_redteam, resolve_target
        >>> report = run_redteam(resolve_target("test:refuse"), probes=["harmful"])
        >>> report.failure_rate
        0.0
    """
    found = available_probes()
    names = list(probes) if probes is not None else list(found)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise LookupError(f"probe {unknown[0]!r} not found. It is either misspelled or not installed; "
                          f"known probes: {', '.join(sorted(found))}")
    built = [found[n].factory(**(probe_options or {}).get(n, {})) for n in names]
    jobs: list[tuple[Any, Attempt]] = [(p, a) for p in built for a in p.attempts()]

    def one(job: tuple[Any, Attempt]) -> RedteamResult:
        probe, attempt = job
        t0 = time.perf_counter()
        try:
            response = target(list(attempt.messages))
        except Exception as exc:  # any target failure is reported, not fatal
            return RedteamResult(probe.name, probe.family, attempt.id, attempt.category, False, "error",
                                 attempt.prompt, "", f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)
        if not getattr(response, "refused", False) and not str(response).strip():
            return RedteamResult(probe.name, probe.family, attempt.id, attempt.category, False, "empty reply",
                                 attempt.prompt, "", "", time.perf_counter() - t0, empty=True)
        failed, reason = probe.judge(attempt, response)
        return RedteamResult(probe.name, probe.family, attempt.id, attempt.category, failed, reason, attempt.prompt,
                             _scrub(response), "", time.perf_counter() - t0)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(one, jobs))
    report = RedteamReport(target_name or repr(target), results, max_error_rate=max_error_rate)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report.log_path = out / "redteam.jsonl"
        with report.log_path.open("w", encoding="utf-8") as fh:
            for r in results:
                record = {"probe": r.probe, "family": r.family, "attempt": r.attempt, "category": r.category,
                          "hazard": HAZARDS.get(r.category, ""), "outcome": r.outcome, "failed": r.failed,
                          "reason": r.reason,
                          "prompt": r.prompt, "response": r.response, "error": r.error,
                          "seconds": round(r.seconds, 4)}
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        report.report_path = out / "redteam.md"
        report.report_path.write_text(report.markdown(), encoding="utf-8")
    return report
