"""Running a policy's rules on a text and turning findings into one decision.

Precedence within a rail: any ``block`` wins (the first blocking rule in file
order names the refusal); otherwise every ``redact`` span is replaced (spans
of several rules are merged first); ``warn`` and ``log`` only leave records.
A detector that raises is treated as its rule says: ``on_error = "block"``
fails closed (the text is refused), ``"allow"`` fails open (the rule is
skipped); both are logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plyx.safety._audit import AuditLog, fingerprint
from plyx.safety._detectors import UnknownDetectorError, build_detector
from plyx.safety._policy import RAILS, Policy, Rule
from plyx.safety._types import DetectorOptionError, Finding
from plyx.specs.errors import ConfigError

__all__ = ["CompiledRule", "RuleHit", "Decision", "compile_policy", "run_rules", "decide", "redact"]

log = logging.getLogger("plyx.safety")


@dataclass(frozen=True)
class CompiledRule:
    """A rule with its built detector and resolved failure mode."""

    rule: Rule
    rail: str
    detector: Any
    on_error: str  # block | allow

    @property
    def id(self) -> str:
        return self.rule.id

    @property
    def span_scoped(self) -> bool:
        return getattr(self.detector, "scope", "text") == "span"


@dataclass(frozen=True)
class RuleHit:
    """What one rule found in one text (labels and spans only; never the matched text).

    Attributes:
        rule_id, detector, action: from the rule.
        labels: distinct finding labels, sorted.
        spans: (start, end) offsets in the checked text.
        fingerprints: keyed digests of the matched spans (see ``AuditLog``).
        error: the exception type name when the detector raised ("" otherwise).
    """

    rule_id: str
    detector: str
    action: str
    labels: tuple[str, ...] = ()
    spans: tuple[tuple[int, int], ...] = ()
    fingerprints: tuple[str, ...] = ()
    error: str = ""


@dataclass(frozen=True)
class Decision:
    """The outcome of a rail on one text.

    Attributes:
        rail: input | output | documents.
        text: the text to use: redacted where a rule redacts, else unchanged.
        blocked: True when a rule blocked (or a failing detector failed closed).
        rule_id: the rule that blocked ("" when not blocked).
        message: the refusal message when blocked.
        hits: every rule that found something or failed, in rule order.
    """

    rail: str
    text: str
    blocked: bool = False
    rule_id: str = ""
    message: str = ""
    hits: tuple[RuleHit, ...] = field(default=())

    @property
    def rule_ids(self) -> list[str]:
        return [h.rule_id for h in self.hits]

    def refusal(self) -> dict[str, Any] | None:
        """The refusal for ``plyx_on_request_received``: ``message``, ``rule_id`` and
        ``status`` (400), plus ``error``, the OpenAI error object a server answers with."""
        if not self.blocked:
            return None
        return refusal(self.message, self.rule_id)


def refusal(message: str, rule_id: str, status: int = 400) -> dict[str, Any]:
    """An OpenAI-shaped refusal (``{"error": {...}}`` is the body an OpenAI server sends)."""
    return {
        "message": message,
        "rule_id": rule_id,
        "status": status,
        "error": {"message": message, "type": "invalid_request_error", "param": None,
                  "code": "content_policy_violation", "rule_id": rule_id},
    }


# -- compiling ----------------------------------------------------------------------
def _options_key(options: Mapping[str, Any]) -> str:
    import json

    return json.dumps(options, sort_keys=True, default=repr)


def compile_policy(policy: Policy) -> dict[str, list[CompiledRule]]:
    """Build every rule's detector; raise ``ConfigError`` naming the rule on any problem.

    Checked here (they need the installed detectors): unknown detectors, bad
    options (invalid regexes included), ``redact`` on a detector that judges the
    whole text, ``rate_limit`` outside input rails, and conflicting rules (the
    same detector and options twice in a rail; a term one rule denies and
    another allows).
    """
    compiled: dict[str, list[CompiledRule]] = {rail: [] for rail in RAILS}
    for rail, i, rule in policy.rules():
        at = f"$.{rail}[{i}]"
        who = f"rule {rule.id!r}"
        try:
            detector = build_detector(rule.detector, rule.options)
        except UnknownDetectorError as exc:
            raise ConfigError(f"{at}.detector", f"{who}: {exc}", value=rule.detector,
                              fix="install the plugin that provides it or fix the name (`plyx safety detectors` lists them)") from None
        except DetectorOptionError as exc:
            raise ConfigError(f"{at}.options.{exc.option}", f"{who} ({rule.detector}): {exc.problem}",
                              value=exc.value, fix=exc.fix) from None
        scope = getattr(detector, "scope", "text")
        if rule.action == "redact" and scope != "span":
            raise ConfigError(f"{at}.action", f"{who}: detector {rule.detector!r} judges the whole text and finds no "
                              "span to redact", value=rule.action, fix="use block, warn or log")
        if getattr(detector, "input_only", False) and rail != "input":
            raise ConfigError(f"{at}.detector", f"{who}: {rule.detector!r} counts requests and only works in the "
                              "input rail", value=rule.detector, fix="move the rule to [[input]]")
        on_error = policy.on_error if rule.on_error == "inherit" else rule.on_error
        compiled[rail].append(CompiledRule(rule, rail, detector, on_error))
    for rail, rules in compiled.items():
        _check_conflicts(rail, rules)
    return compiled


def _check_conflicts(rail: str, rules: Sequence[CompiledRule]) -> None:
    seen: dict[tuple[str, str], CompiledRule] = {}
    for c in rules:
        key = (c.rule.detector, _options_key(c.rule.options))
        if key in seen:
            other = seen[key]
            raise ConfigError(
                f"$.{rail}", f"rules {other.id!r} and {c.id!r} conflict: both run {c.rule.detector!r} with the same "
                f"options in the {rail} rail (actions {other.rule.action} and {c.rule.action})",
                fix="remove one of them, or merge them into one rule with the action you want")
        seen[key] = c
    denied = {t: c for c in rules for t in getattr(c.detector, "deny", [])}
    for c in rules:
        for term in getattr(c.detector, "allow", []):
            if term in denied and denied[term] is not c:
                raise ConfigError(
                    f"$.{rail}", f"rules {denied[term].id!r} and {c.id!r} conflict: {denied[term].id!r} denies "
                    f"{term!r} and {c.id!r} allows it", fix="remove the term from one of the two lists")


# -- running ------------------------------------------------------------------------
@dataclass
class RuleResult:
    rule: CompiledRule
    findings: list[Finding]
    error: str = ""


def run_rules(rules: Sequence[CompiledRule], text: str, context: Mapping[str, Any]) -> list[RuleResult]:
    """Run each rule's detector on ``text``; a raising detector is recorded, not propagated."""
    results = []
    for c in rules:
        try:
            findings = list(c.detector.detect(text, context))
        except Exception as exc:  # a third-party detector may fail in any way
            # the message may quote the text: log the type only, never the content
            log.warning("detector %r of rule %r raised %s; failing %s", c.rule.detector, c.id,
                        type(exc).__name__, "closed (block)" if c.on_error == "block" else "open (allow)")
            results.append(RuleResult(c, [], type(exc).__name__))
            continue
        for f in findings:
            if not (0 <= f.start <= f.end <= len(text)):
                log.warning("detector %r returned a span outside the text; ignored", c.rule.detector)
        findings = [f for f in findings if 0 <= f.start <= f.end <= len(text)]
        results.append(RuleResult(c, findings))
    return results


def _hit(result: RuleResult, text: str) -> RuleHit:
    fs = result.findings
    return RuleHit(
        rule_id=result.rule.id,
        detector=result.rule.rule.detector,
        action=result.rule.rule.action,
        labels=tuple(sorted({f.label for f in fs})),
        spans=tuple((f.start, f.end) for f in fs),
        fingerprints=tuple(fingerprint(text[f.start:f.end]) for f in fs),
        error=result.error,
    )


def redact(text: str, spans: Sequence[tuple[int, int, str]]) -> str:
    """Replace each ``(start, end, replacement)``; overlapping spans are merged and
    take the replacement of the earliest-starting one."""
    out, pos = [], 0
    merged: list[list[Any]] = []
    for s, e, rep in sorted(spans, key=lambda x: (x[0], -x[1])):
        if merged and s < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e, rep])
    for s, e, rep in merged:
        out.append(text[pos:s])
        out.append(rep)
        pos = e
    out.append(text[pos:])
    return "".join(out)


def replacement(rule: Rule, label: str) -> str:
    base = label.split(":", 1)[0]
    return rule.replacement.format(label=base, LABEL=base.upper(), rule=rule.id)


def decide(policy: Policy, rail: str, text: str, results: Sequence[RuleResult]) -> Decision:
    """Apply precedence (block > redact > warn/log) to the results of one rail on ``text``."""
    hits = tuple(_hit(r, text) for r in results if r.findings or r.error)
    for r in results:
        failed_closed = r.error and r.rule.on_error == "block"
        if (r.findings and r.rule.rule.action == "block") or failed_closed:
            message = r.rule.rule.message or policy.refusal_message
            return Decision(rail, text, True, r.rule.id, message, hits)
    spans = [(f.start, f.end, replacement(r.rule.rule, f.label))
             for r in results if r.rule.rule.action == "redact" for f in r.findings]
    return Decision(rail, redact(text, spans) if spans else text, False, "", "", hits)


def audit_decision(audit: AuditLog | None, policy: Policy, decision: Decision, context: Mapping[str, Any]) -> None:
    """One audit record per rule hit (and per detector error) of ``decision``."""
    if audit is None:
        return
    for h in decision.hits:
        record: dict[str, Any] = {
            "event": "detector_error" if h.error else "rule",
            "policy": policy.name,
            "rail": decision.rail,
            "request_id": context.get("request_id", ""),
            "rule_id": h.rule_id,
            "detector": h.detector,
            "action": h.action,
            "labels": list(h.labels),
            "count": len(h.spans),
            "fingerprints": list(h.fingerprints),
            "blocked": decision.blocked and decision.rule_id == h.rule_id,
        }
        if h.error:
            record["error"] = h.error
            record["failed"] = "closed" if decision.blocked and decision.rule_id == h.rule_id else "open"
        for key in ("endpoint", "document"):
            if key in context:
                record[key] = context[key]
        if context.get("client"):
            record["client"] = fingerprint(str(context["client"]))  # an address is PII too
        audit.write(record)
