"""Output rails on streamed text: emit as early as possible, never a blocked or unredacted span.

After each chunk the filter rescans only what it has not released yet (plus
``CONTEXT`` characters for word boundaries and look-behinds, from just after a
whitespace, and for each rule never from inside a span it already settled, so
the rescan sees what the whole-text scan sees) and works out the
*hold point*: the earliest offset from which the text could still grow into a
match, i.e. the minimum over span detectors of ``pending(text)`` and the start
of any finding that touches the end of the text (``a@b.co`` may become
``a@b.com``). A finding of a ``block`` or ``redact`` rule that straddles the
hold point moves it back to the finding's start, so such a span is released
whole (redacted) or not at all. Text before the hold point is settled: it is
released with its redactions applied, and a settled ``block`` finding stops the
stream with nothing more emitted. Rules whose detectors judge the whole text
(length, classifiers, injection) run on everything received so far at each
chunk; when they block, what is held back is never released.

There is no length past which an undecided span is let go: a detector's
``pending`` holds a span longer than its usual bound (a 400-character JWT)
until it is decided. What bounds memory is the policy's ``stream_holdback``:
when more than that many characters are held at once, the stream ends with
the refusal of rule ``stream-holdback`` and the held text is dropped. A span
the whole-text pass would cut that starts before the released offset (a
third-party detector whose ``pending`` under-reports) also ends the stream
(fail closed) rather than emitting more of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from plyx.safety._engine import Decision, RuleResult, audit_decision, decide, redact, refusal, replacement, run_rules

__all__ = ["StreamFilter", "CONTEXT", "HOLDBACK_RULE"]

# characters of released text rescanned for word boundaries and look-behinds. The built-in
# detectors' look-behinds reach less far: a phone keyword and its separators ("call me at: ",
# at most ~34 characters), "social security number" (26), a secret's name and its "=" (~35)
CONTEXT = 48
HOLDBACK_RULE = "stream-holdback"
_CUTS = ("block", "redact")  # actions whose spans may never be released in part


def _window_start(text: str, upto: int) -> int:
    """Where to start rescanning: the last offset at or before ``upto`` that follows whitespace not
    itself preceded by a digit (or 0).

    Word boundaries and look-behinds at the start of a window see nothing before it; starting right
    after a space makes that the same as what they see in the whole text (``\\b`` before ``api_key``
    in ``comapi_key`` holds at a window start but not in the text; a card's ``1111 2222`` must not
    look like the start of an Aadhaar number).
    """
    i = max(0, upto)
    while i > 0 and not (text[i - 1].isspace() and (i < 2 or not text[i - 2].isdigit())):
        i -= 1
    return i


class StreamFilter:
    """Implements the ``plyx_output_filters`` contract: ``feed(text) -> str``,
    ``finish() -> str`` and ``blocked`` (None or a refusal dict).

    ``decision`` holds the combined outcome once the stream is finished or blocked.
    """

    def __init__(self, guard: Any, context: Mapping[str, Any]) -> None:
        self.guard = guard
        self.context = context
        self.rules = guard.rails["output"]
        self.text = ""
        self.released = 0  # offset in self.text up to which text has been emitted
        self.blocked: dict[str, Any] | None = None
        self.decision: Decision | None = None
        self._reported: set[tuple[str, int, int]] = set()
        self._results: dict[str, RuleResult] = {}
        self._applied: dict[str, list[tuple[int, int]]] = {}  # rule id -> spans settled and released
        self._done = False

    # -- the contract -------------------------------------------------------------
    def feed(self, text: str) -> str:
        """Add a chunk; return the text that is safe to emit now (possibly "")."""
        if self.blocked is not None or self._done:
            return ""
        self.text += text
        return self._advance(final=False)

    def finish(self) -> str:
        """The end of the stream: settle and return everything still held."""
        if self.blocked is not None or self._done:
            return ""
        out = self._advance(final=True)
        self._done = True
        self._close()
        return out

    # -- internals ----------------------------------------------------------------
    def _advance(self, final: bool) -> str:
        span_rules = [r for r in self.rules if r.span_scoped]
        text_rules = [r for r in self.rules if not r.span_scoped]
        start = _window_start(self.text, self.released - CONTEXT)
        # each rule rescans from its own base: never inside a span it already settled, because the
        # whole-text scan resumes after a match, and a rescan from inside it would see its tail as a
        # new match and could swallow the real next one
        bases, results = [], []
        for rule in span_rules:
            base, moved = start, True
            while moved:  # settled spans of one rule may touch: step past each in turn
                moved = False
                for a, b in self._applied.get(rule.id, []):
                    if a < base < b:
                        base, moved = b, True
            found = run_rules([rule], self.text[base:], self.context)[0]
            found.findings = [f.shifted(base) for f in found.findings if f.end + base > self.released]
            bases.append(base)
            results.append(found)
        whole = run_rules(text_rules, self.text, self.context)

        # a cutting span that starts in text already released means a detector's
        # pending() under-reported: part of it left; stop before more of it does
        for r in results:
            if r.rule.rule.action in _CUTS and any(f.start < self.released < f.end for f in r.findings):
                return self._stop(r.rule.id, r.rule.rule.message or self.guard.policy.refusal_message, whole)

        end = len(self.text)
        hold = end
        if not final:
            for r, base in zip(span_rules, bases, strict=True):
                pending = getattr(r.detector, "pending", None)
                hold = min(hold, base + pending(self.text[base:]) if pending else self.released)
            for r in results:
                for f in r.findings:
                    if f.end >= end:  # could still grow: not settled
                        hold = min(hold, f.start)
        # a blocked or redacted span is released whole or not at all
        changed = True
        while changed:
            changed = False
            for r in results:
                if r.rule.rule.action not in _CUTS:
                    continue
                for f in r.findings:
                    if f.start < hold < f.end:
                        hold, changed = f.start, True
        hold = max(hold, self.released)

        settled = [RuleResult(r.rule, [f for f in r.findings if f.end <= hold or (final and f.end <= end)], r.error)
                   for r in results]
        decision = decide(self.guard.policy, "output", self.text, settled + whole)
        if not decision.blocked and end - hold > self.guard.policy.stream_holdback:
            return self._stop(HOLDBACK_RULE, self.guard.policy.refusal_message, whole)
        # whole-text findings move with every chunk: record them once, at the end
        self._record(settled + whole if final or decision.blocked else settled)
        if decision.blocked:
            self.blocked = decision.refusal()
            self._close(decision)
            return ""
        for r in settled:
            kept = [(a, b) for a, b in self._applied.get(r.rule.id, []) if b > start]  # older ones are out of reach
            self._applied[r.rule.id] = kept + [(f.start, f.end) for f in r.findings]
        spans = [(max(f.start, self.released), f.end, replacement(r.rule.rule, f.label))
                 for r in settled if r.rule.rule.action == "redact" for f in r.findings]
        segment = redact(self.text[self.released:hold], [(s - self.released, e - self.released, rep) for s, e, rep in spans])
        self.released = hold
        return segment

    def _stop(self, rule_id: str, message: str, whole: list[RuleResult]) -> str:
        """End the stream with a refusal that no single rule's decision produced."""
        self._record(whole)
        self.blocked = refusal(message, rule_id)
        self._close(Decision("output", "", True, rule_id, message))
        return ""

    def _record(self, results: list[RuleResult]) -> None:
        """Remember each settled finding once, for the combined decision and the audit log."""
        for r in results:
            new = [f for f in r.findings if (r.rule.id, f.start, f.end) not in self._reported]
            if not new and not r.error:
                continue
            for f in new:
                self._reported.add((r.rule.id, f.start, f.end))
            acc = self._results.setdefault(r.rule.id, RuleResult(r.rule, []))
            acc.findings.extend(new)
            if r.error:
                acc.error = r.error

    def _close(self, blocking: Decision | None = None) -> None:
        results = list(self._results.values())
        combined = decide(self.guard.policy, "output", self.text, results)
        if blocking is not None:
            combined = Decision("output", "", True, blocking.rule_id, blocking.message, combined.hits)
        else:
            combined = Decision("output", "", False, "", "", combined.hits)
        self.decision = combined
        audit_decision(self.guard.audit, self.guard.policy, combined, self.context)
