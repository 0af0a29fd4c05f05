"""Streaming output rails: never emit a blocked or unredacted span, hold back only what could still match."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plyx.safety import AuditLog, Guard

PII = ["jane.doe@example.com", "+1 415 555 0132", "4111 1111 1111 1111", "DE89 3704 0044 0532 0130 00",
       "123-45-6789", "bob [at] example [dot] org", "ghp_aB3dE5fG7hJ9kL1mN2pQ4rS6tU8vW0xY2zA4b"]
WORDS = ["hello", "the", "account", "is", "ok", "today", "at", "DE", "41", "call", "dot", "(x)", "idiot", "idiom"]
SEPS = [" ", " ", ", ", ".\n", "\n", "  "]


def redact_guard() -> Guard:
    return Guard({"output": [
        {"id": "pii", "detector": "pii", "action": "redact"},
        {"id": "words", "detector": "deny_list", "action": "redact", "options": {"deny": ["idiot"]}},
    ]}, audit=AuditLog())


def run_stream(guard: Guard, text: str, cuts: list[int]) -> tuple[list[str], object]:
    f = guard.stream({"request_id": "s"})
    pieces, pos = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        if cut > pos:
            pieces.append(f.feed(text[pos:cut]))
            pos = cut
    pieces.append(f.finish())
    return pieces, f


texts = st.lists(st.sampled_from(PII + WORDS), min_size=1, max_size=12).flatmap(
    lambda parts: st.lists(st.sampled_from(SEPS), min_size=len(parts), max_size=len(parts)).map(
        lambda seps: "".join(p + s for p, s in zip(parts, seps, strict=True))))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts, data=st.data())
def test_stream_equals_whole_text_redaction_for_any_chunking(text, data):
    guard = redact_guard()
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    pieces, f = run_stream(guard, text, cuts)
    expected = guard.check_output(text).text
    assert "".join(pieces) == expected
    # every emitted prefix is a prefix of the redacted text: nothing raw ever left early
    emitted = ""
    for p in pieces:
        emitted += p
        assert expected.startswith(emitted)
    assert f.blocked is None


def test_blocked_span_is_never_emitted_and_the_stream_stops():
    guard = Guard({"output": [{"id": "no-insults", "detector": "deny_list", "action": "block",
                                "message": "refused", "options": {"deny": ["idiot"]}}]}, audit=AuditLog())
    text = "That is fine. You are an idiot and then more text follows."
    for size in (1, 2, 3, 5, 8, 13):
        f = guard.stream({})
        out = ""
        for i in range(0, len(text), size):
            out += f.feed(text[i:i + size])
        out += f.finish()
        assert "idi" not in out  # not even the start of the blocked word
        assert "That is fine. You are an ".startswith(out) and len(out) >= len("That is fine. You are")
        assert f.blocked["rule_id"] == "no-insults" and f.blocked["message"] == "refused"
        assert f.feed("more") == "" and f.finish() == ""


def test_only_what_could_still_match_is_held_back():
    f = redact_guard().stream({})
    out = f.feed("Hello there, how are you today")
    assert out == "Hello there, how are you "  # "today" could still become an address or a key
    out += f.feed("? Fine.\n")
    assert out == "Hello there, how are you today? Fine.\n"
    held = f.feed("Card: 4111 1111")
    assert held == "Card: "  # the digits could still grow into a card number
    assert f.feed(" 1111 1111 thanks") == "[CREDIT_CARD] "
    assert f.finish() == "thanks"


def test_whole_text_rules_stop_the_stream_when_the_limit_is_crossed():
    guard = Guard({"output": [{"id": "len", "detector": "length", "action": "block", "options": {"max_chars": 20}}]},
                  audit=AuditLog())
    f = guard.stream({})
    out = f.feed("0123456789") + f.feed("0123456789") + f.feed("X")
    assert out == "01234567890123456789" and f.blocked["rule_id"] == "len"


def test_stream_decision_is_audited_once_per_finding():
    guard = redact_guard()
    rng = random.Random(3)
    text = "mail jane.doe@example.com or call +1 415 555 0132 please"
    pieces, f = run_stream(guard, text, [rng.randrange(len(text)) for _ in range(20)])
    assert f.decision.hits[0].rule_id == "pii" and len(f.decision.hits[0].spans) == 2
    records = [r for r in guard.audit.recent if r["rail"] == "output"]
    assert len(records) == 1 and records[0]["count"] == 2


@settings(max_examples=100, deadline=None)
@given(text=texts, data=st.data())
def test_a_blocked_term_never_leaves_the_stream(text, data):
    guard = Guard({"output": [{"id": "b", "detector": "deny_list", "action": "block", "options": {"deny": ["idiot"]}}]},
                  audit=AuditLog())
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    pieces, f = run_stream(guard, text, cuts)
    emitted = "".join(pieces)
    whole = guard.check_output(text)
    if whole.blocked:
        first = guard.rails["output"][0].detector.detect(text, {})[0].start
        assert f.blocked is not None and f.blocked["rule_id"] == "b"
        assert text[:first].startswith(emitted)  # only text before the term, possibly less
    else:
        assert f.blocked is None and emitted == text
