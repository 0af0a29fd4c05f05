"""Running probes against a target: a JSONL log of every attempt and a Markdown report."""

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


@dataclass
class RedteamReport:
    """All results plus where the log and report were written."""

    target: str
    results: list[RedteamResult] = field(default_factory=list)
    log_path: Path | None = None
    report_path: Path | None = None

    def rates(self, key: Callable[[RedteamResult], str]) -> dict[str, tuple[int, int, int]]:
        """key -> (attempts judged, failures, errors)."""
        table: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.results:
            k = key(r)
            if not k:
                continue
            if r.error:
                table[k][2] += 1
            else:
                table[k][0] += 1
                table[k][1] += int(r.failed)
        return {k: (v[0], v[1], v[2]) for k, v in sorted(table.items(), key=lambda kv: _order(kv[0]))}

    @property
    def failure_rate(self) -> float:
        judged = [r for r in self.results if not r.error]
        return sum(r.failed for r in judged) / len(judged) if judged else 0.0

    def markdown(self) -> str:
        lines = [
            "# plyx safety red-team report", "",
            f"- target: `{self.target}`",
            f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
            f"- attempts: {len(self.results)} ({sum(bool(r.error) for r in self.results)} errors)",
            f"- overall failure rate: {self.failure_rate:.1%}", "",
            "A failure is an attempt where the target did what the probe tried to make it do "
            "(complied with a harmful request, printed an injected canary, leaked planted PII).", "",
            "## Failure rate per probe", "", "| probe | attempts | failures | failure rate | errors |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, (n, f, e) in self.rates(lambda r: r.probe).items():
            lines.append(f"| {name} | {n} | {f} | {_pct(f, n)} | {e} |")
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
) -> RedteamReport:
    """Send every attempt of the chosen probes to ``target`` and judge the replies.

    Args:
        target: ``(messages) -> reply text`` (see ``resolve_target``).
        probes: probe names (default: every installed probe).
        probe_options: per-probe factory options (``{"jailbreak": {"limit": 5}}``).
        out_dir: where ``redteam.jsonl`` and ``redteam.md`` go (None: write nothing).
        workers: concurrent requests.
        target_name: how the report names the target.

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
        failed, reason = probe.judge(attempt, response)
        return RedteamResult(probe.name, probe.family, attempt.id, attempt.category, failed, reason, attempt.prompt,
                             _scrub(response), "", time.perf_counter() - t0)

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(one, jobs))
    report = RedteamReport(target_name or repr(target), results)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        report.log_path = out / "redteam.jsonl"
        with report.log_path.open("w", encoding="utf-8") as fh:
            for r in results:
                record = {"probe": r.probe, "family": r.family, "attempt": r.attempt, "category": r.category,
                          "hazard": HAZARDS.get(r.category, ""), "failed": r.failed, "reason": r.reason,
                          "prompt": r.prompt, "response": r.response, "error": r.error,
                          "seconds": round(r.seconds, 4)}
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
        report.report_path = out / "redteam.md"
        report.report_path.write_text(report.markdown(), encoding="utf-8")
    return report
