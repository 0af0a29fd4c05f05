"""Loading policies: formats, migration, and errors that name the rule."""

from __future__ import annotations

import json
import textwrap

import pytest
from plyx.safety import Guard, Policy, load_policy
from plyx.specs.config import migrations_for
from plyx.specs.errors import ConfigError

TOML = """
version = 2
name = "t"
[[input]]
id = "inj"
detector = "prompt_injection"
action = "block"
message = "no"
[[output]]
id = "pii"
detector = "pii"
action = "redact"
"""


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_the_same_policy_in_toml_yaml_and_json(tmp_path):
    from_toml = load_policy(write(tmp_path, "p.toml", TOML))
    doc = from_toml.to_dict()
    import yaml

    from_yaml = load_policy(write(tmp_path, "p.yaml", yaml.safe_dump(doc)))
    from_json = load_policy(write(tmp_path, "p.json", json.dumps(doc)))
    assert from_toml == from_yaml == from_json
    assert [r.id for r in from_toml.input] == ["inj"] and from_toml.output[0].action == "redact"


def test_v1_documents_are_migrated(tmp_path):
    v1 = """
    version = 1
    name = "old"
    fail_mode = "open"
    [[rules]]
    id = "inj"
    detector = "prompt_injection"
    action = "block"
    stage = "input"
    [[rules]]
    id = "mail"
    detector = "email"
    action = "redact"
    stage = "both"
    fail_mode = "closed"
    """
    policy = load_policy(write(tmp_path, "old.toml", v1))
    assert 1 in migrations_for("safety_policy")
    assert policy.version == 2 and policy.on_error == "allow"
    assert [r.id for r in policy.input] == ["inj", "mail.input"]
    assert [(r.id, r.on_error) for r in policy.output] == [("mail.output", "block")]
    assert Guard(policy).check_output("x a@b.com").text == "x [EMAIL]"


@pytest.mark.parametrize("rule, path, words", [
    ({"detector": "emial", "action": "block"}, "$.input[0].detector", ["rule 'r1'", "did you mean 'email'"]),
    ({"detector": "email", "action": "deny"}, "$.input[0].action", ["rule 'r1'", "block, redact, warn, log"]),
    ({"detector": "regex", "action": "block", "options": {"patterns": ["(a"]}}, "$.input[0].options.patterns[0]",
     ["rule 'r1'", "invalid regular expression"]),
    ({"detector": "email", "action": "block", "options": {"colour": 1}}, "$.input[0].options.colour",
     ["rule 'r1'", "unknown option"]),
    ({"detector": "prompt_injection", "action": "redact"}, "$.input[0].action", ["rule 'r1'", "no span to redact"]),
    ({"detector": "email", "action": "redact", "replacement": "[{kind}]"}, "$.input[0].replacement", ["rule 'r1'"]),
    ({"detector": "email", "action": "block", "on_error": "ignore"}, "$.input[0].on_error", ["rule 'r1'"]),
])
def test_bad_rules_fail_at_load_naming_the_rule(rule, path, words):
    with pytest.raises(ConfigError) as info:
        load_policy({"input": [{"id": "r1", **rule}]})
    assert info.value.path == path
    for w in words:
        assert w in str(info.value)


def test_conflicting_rules_are_named():
    dup_id = {"input": [{"id": "a", "detector": "email", "action": "log"}],
              "output": [{"id": "a", "detector": "phone", "action": "log"}]}
    with pytest.raises(ConfigError, match=r"rule 'a': the id is already used at \$\.input\[0\]"):
        load_policy(dup_id)
    same = {"output": [{"id": "a", "detector": "email", "action": "redact"},
                       {"id": "b", "detector": "email", "action": "block"}]}
    with pytest.raises(ConfigError, match="rules 'a' and 'b' conflict: both run 'email'"):
        load_policy(same)
    deny_allow = {"input": [{"id": "deny", "detector": "deny_list", "action": "block", "options": {"deny": ["bomb"]}},
                            {"id": "ok", "detector": "deny_list", "action": "log",
                             "options": {"deny": ["x"], "allow": ["BOMB"]}}]}
    with pytest.raises(ConfigError, match="'deny' denies 'bomb' and 'ok' allows it"):
        load_policy(deny_allow)
    rate_out = {"output": [{"id": "rl", "detector": "rate_limit", "action": "block"}]}
    with pytest.raises(ConfigError, match="rule 'rl'.*only works in the input rail"):
        load_policy(rate_out)


def test_unknown_fields_and_newer_versions_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="unknown field") as info:
        Policy.from_dict({"input": [{"id": "a", "detectr": "email", "action": "log"}]})
    assert info.value.path == "$.input[0].detectr"
    with pytest.raises(ConfigError, match="newer"):
        load_policy({"version": 3})
    with pytest.raises(ConfigError, match="no built-in policy named 'nope'"):
        load_policy("builtin:nope")


def test_builtin_policies_load_and_audit_path_is_relative_to_the_file(tmp_path):
    assert load_policy("builtin:default").name == "default"
    assert load_policy("pii-redact").name == "pii-redact"
    p = write(tmp_path, "a.toml", 'version = 2\naudit_log = "logs/audit.jsonl"\n')
    assert load_policy(p).audit_log == str(tmp_path.resolve() / "logs" / "audit.jsonl")
