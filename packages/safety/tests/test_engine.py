"""Decisions: precedence of actions, redaction, failing closed or open, and the audit log."""

from __future__ import annotations

import json
import logging
import re

import pytest
from plyx.safety import AuditLog, Guard
from plyx.specs import Component, hookimpl
from plyx.specs.plugins import register_plugin

CARD = "4111 1111 1111 1111"
MAIL = "jane.doe@example.com"


def guard(rules: dict, tmp_path=None, **top) -> Guard:
    audit = AuditLog(tmp_path / "audit.jsonl") if tmp_path else AuditLog()
    return Guard({"version": 2, **top, **rules}, audit=audit)


def test_block_wins_over_redact_and_names_the_first_blocking_rule():
    g = guard({"input": [
        {"id": "red-mail", "detector": "email", "action": "redact"},
        {"id": "log-pii", "detector": "pii", "action": "log", "options": {"entities": ["credit_card"]}},
        {"id": "block-card", "detector": "credit_card", "action": "block", "message": "no cards"},
    ]})
    d = g.check_input(f"mail {MAIL} card {CARD}")
    assert d.blocked and d.rule_id == "block-card" and d.message == "no cards"
    assert d.rule_ids == ["red-mail", "log-pii", "block-card"]
    refusal = d.refusal()
    assert refusal["status"] == 400 and refusal["rule_id"] == "block-card"
    assert refusal["error"]["code"] == "content_policy_violation" and refusal["error"]["message"] == "no cards"


def test_overlapping_redactions_merge_and_replacements_use_the_label():
    g = guard({"output": [
        {"id": "r-pii", "detector": "pii", "action": "redact", "options": {"entities": ["email", "phone"]}},
        {"id": "r-words", "detector": "deny_list", "action": "redact", "replacement": "<{rule}>",
         "options": {"deny": ["jane doe", "example"]}},
    ]})
    d = g.check_output(f"Jane Doe wrote from {MAIL} and +1 415 555 0132.")
    assert not d.blocked
    assert d.text == "<r-words> wrote from [EMAIL] and [PHONE]."


def test_warn_and_log_leave_text_unchanged_but_are_recorded():
    g = guard({"input": [{"id": "w", "detector": "email", "action": "warn"}]})
    d = g.check_input(f"hi {MAIL}")
    assert d.text == f"hi {MAIL}" and not d.blocked and d.rule_ids == ["w"]
    assert g.audit.recent[-1]["rule_id"] == "w" and g.audit.recent[-1]["action"] == "warn"


class _Boom:
    name = "boom"
    scope = "text"

    def detect(self, text, context):
        raise RuntimeError(f"model crashed on {text!r}")  # a message that quotes the (PII) text


class _BoomPlugin:
    @hookimpl
    def plyx_guardrails(self):
        return [Component("boom", _Boom, "always raises")]


@pytest.mark.parametrize("mode, blocked", [("block", True), ("allow", False)])
def test_a_raising_detector_fails_closed_or_open_and_is_logged(mode, blocked, tmp_path, caplog):
    register_plugin(_BoomPlugin(), "boom-plugin")
    g = guard({"input": [{"id": "risky", "detector": "boom", "action": "log"}]}, tmp_path, on_error=mode)
    with caplog.at_level(logging.WARNING, logger="plyx.safety"):
        d = g.check_input(f"card {CARD}")
    assert d.blocked is blocked
    assert d.rule_id == ("risky" if blocked else "")
    assert "rule 'risky'" in caplog.text and "RuntimeError" in caplog.text and CARD not in caplog.text
    record = json.loads((tmp_path / "audit.jsonl").read_text().splitlines()[-1])
    assert record["event"] == "detector_error" and record["error"] == "RuntimeError"
    assert record["failed"] == ("closed" if blocked else "open")
    # a rule can override the policy's failure mode
    g2 = guard({"input": [{"id": "risky", "detector": "boom", "action": "log", "on_error": "allow"}]}, on_error="block")
    assert not g2.check_input("x").blocked


def test_audit_records_never_hold_the_matched_text(tmp_path):
    g = guard({"input": [{"id": "pii-in", "detector": "pii", "action": "block"}],
               "output": [{"id": "pii-out", "detector": "pii", "action": "redact"}]}, tmp_path)
    secrets = [MAIL, CARD, "DE89 3704 0044 0532 0130 00", "123-45-6789", "+44 20 7946 0958"]
    g.check_input(" ".join(secrets), {"request_id": "r1", "client": "10.1.2.3:5555"})
    g.check_output(" and ".join(secrets), {"request_id": "r1"})
    raw = (tmp_path / "audit.jsonl").read_text()
    # fingerprints and the client are 16-hex-digit digests: a digest may contain "4111" by chance
    readable = re.sub(r'"[0-9a-f]{16}"', '"<digest>"', raw)
    for s in secrets + ["10.1.2.3", "4111", "jane"]:
        assert s not in readable
    records = [json.loads(line) for line in raw.splitlines()]
    assert [r["rule_id"] for r in records] == ["pii-in", "pii-out"]
    assert records[0]["blocked"] is True and records[0]["count"] == 5
    assert sorted(records[1]["labels"]) == ["credit_card", "email", "iban", "national_id", "phone"]
    # fingerprints correlate the same value across records without revealing it
    assert set(records[0]["fingerprints"]) == set(records[1]["fingerprints"])
