"""The policy schema: input, output and document rails of rules, as a versioned config.

A policy file (TOML, YAML or JSON)::

    version = 2
    name = "chat-default"
    on_error = "block"            # a detector that raises blocks (fail closed) | "allow" (fail open)

    [[input]]
    id = "no-injection"
    detector = "prompt_injection"
    action = "block"              # block | redact | warn | log
    message = "I can't follow instructions that try to override my guidelines."
    options = { threshold = 0.6 }

    [[output]]
    id = "redact-pii"
    detector = "pii"
    action = "redact"
    replacement = "[{LABEL}]"     # {label} / {LABEL}: the finding label, {rule}: the rule id

Version 1 kept one ``rules`` list with a ``stage`` per rule and a
``fail_mode = "closed" | "open"``; the registered migration turns it into v2.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
from plyx.specs.config import ConfigBase, load_config, migration, migrations_for
from plyx.specs.errors import ConfigError

__all__ = ["Policy", "Rule", "ACTIONS", "RAILS", "load_policy", "builtin_policy_path"]

ACTIONS = ("block", "redact", "warn", "log")
RAILS = ("input", "output", "documents")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:\-]{0,63}$")


class Rule(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One guardrail: a detector and what to do when it finds something."""

    id: str
    """Stable identifier, shown in every decision and audit record (letters, digits, ``_.:-``)."""
    detector: str
    """Name of a detector from the ``plyx_guardrails`` hook (``pii``, ``deny_list``, ``prompt_injection``...)."""
    action: str
    """block | redact | warn | log."""
    options: dict[str, Any] = {}
    """Keyword arguments of the detector's factory."""
    message: str = ""
    """Refusal text of a block; empty uses the policy's ``refusal_message``."""
    replacement: str = "[{LABEL}]"
    """Text that replaces a redacted span; ``{label}``, ``{LABEL}`` and ``{rule}`` are filled in."""
    on_error: str = "inherit"
    """inherit | block | allow: what a detector failure does for this rule."""
    description: str = ""
    """Free text for humans."""


class Policy(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A guardrail policy: rules applied to prompts (input), responses (output) and corpora (documents)."""

    SCHEMA = "safety_policy"
    VERSION = 2

    name: str = "policy"
    """Shown in audit records."""
    description: str = ""
    """Free text for humans."""
    on_error: str = "block"
    """block (fail closed) | allow (fail open): what a detector that raises does, unless a rule overrides it."""
    refusal_message: str = "I can't help with that request."
    """Message of a block whose rule sets none."""
    stream_holdback: int = 65536
    """Most characters a streamed response may hold back at once while a span is undecided (a secret still
    being written); past it the stream ends with the refusal of rule ``stream-holdback``. Never a reason to
    release an undecided span."""
    audit_log: str = ""
    """Path of the JSONL audit log (relative paths are relative to the policy file); empty: no file."""
    input: list[Rule] = []
    """Rules run on each prompt before any compute."""
    output: list[Rule] = []
    """Rules run on the streamed response."""
    documents: list[Rule] = []
    """Rules run on each corpus document before tokenization (``block`` drops it)."""

    def check(self) -> None:
        if self.on_error not in ("block", "allow"):
            raise ConfigError("$.on_error", "unknown failure mode", value=self.on_error,
                              fix="use block (fail closed) or allow (fail open)")
        if self.stream_holdback < 1:
            raise ConfigError("$.stream_holdback", "must be at least 1 character", value=self.stream_holdback,
                              fix="give the most characters a stream may hold back, e.g. 65536")
        seen: dict[str, str] = {}
        for rail in RAILS:
            for i, rule in enumerate(getattr(self, rail)):
                at = f"$.{rail}[{i}]"
                who = f"rule {rule.id!r}"
                if not _ID.match(rule.id):
                    raise ConfigError(f"{at}.id", f"{who}: invalid rule id", value=rule.id,
                                      fix="use 1-64 letters, digits, `_`, `.`, `:` or `-`, starting with a letter or digit")
                if rule.id in seen:
                    raise ConfigError(f"{at}.id", f"{who}: the id is already used at {seen[rule.id]}", value=rule.id,
                                      fix="give every rule its own id")
                seen[rule.id] = at
                if rule.action not in ACTIONS:
                    raise ConfigError(f"{at}.action", f"{who}: unknown action", value=rule.action,
                                      fix=f"choose from {', '.join(ACTIONS)}")
                if rule.on_error not in ("inherit", "block", "allow"):
                    raise ConfigError(f"{at}.on_error", f"{who}: unknown failure mode", value=rule.on_error,
                                      fix="use inherit, block or allow")
                try:
                    rule.replacement.format(label="x", LABEL="X", rule="r")
                except (KeyError, IndexError, ValueError) as exc:
                    raise ConfigError(f"{at}.replacement", f"{who}: bad replacement template ({exc!r})",
                                      value=rule.replacement, fix="only {label}, {LABEL} and {rule} may be used; "
                                      "double literal braces") from None

    # -- helpers ------------------------------------------------------------------
    def rules(self) -> list[tuple[str, int, Rule]]:
        """(rail, index, rule) of every rule, in file order."""
        return [(rail, i, r) for rail in RAILS for i, r in enumerate(getattr(self, rail))]


def _policy_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """v1: one ``rules`` list, each rule with ``stage`` (input | output | both | documents)
    and ``fail_mode`` (closed | open); v2: one list per rail and ``on_error`` (block | allow)."""
    modes = {"closed": "block", "open": "allow"}
    if "fail_mode" in doc:
        mode = doc.pop("fail_mode")
        doc["on_error"] = modes.get(mode, mode)
    rails: dict[str, list[dict[str, Any]]] = {"input": [], "output": [], "documents": []}
    for rule in doc.pop("rules", []) or []:
        rule = dict(rule)
        stage = rule.pop("stage", "input")
        if "fail_mode" in rule:
            mode = rule.pop("fail_mode")
            rule["on_error"] = modes.get(mode, mode)
        targets = ["input", "output"] if stage == "both" else [stage]
        for target in targets:
            if target not in rails:
                raise ConfigError("$.rules.stage", f"rule {rule.get('id')!r}: unknown v1 stage", value=stage,
                                  fix="use input, output, both or documents")
            copy = dict(rule)
            if stage == "both":  # ids must be unique in v2
                copy["id"] = f"{rule.get('id')}.{target}"
            rails[target].append(copy)
    for rail, rules in rails.items():
        if rules:
            doc[rail] = doc.get(rail, []) + rules
    return doc


# registered once per process: a second import of this module (reload, doctest
# collection) finds it there and must not fail
if 1 not in migrations_for(Policy.SCHEMA):
    migration(Policy.SCHEMA, 1)(_policy_v1_to_v2)

_BUILTIN = Path(__file__).parent / "policies"


def builtin_policy_path(name: str) -> Path | None:
    """The file of a policy shipped with plyx-safety (``default``, ``pii-redact``...), or None."""
    for suffix in (".toml", ".yaml", ".json"):
        p = _BUILTIN / f"{name}{suffix}"
        if p.is_file():
            return p
    return None


def load_policy(source: str | Path | dict[str, Any] | Policy, *, fmt: str | None = None) -> Policy:
    """Load a policy from a file (TOML/YAML/JSON), a built-in name, a dict or a ``Policy``,
    and check that every rule can be built (detectors exist, options and regexes are valid,
    rules do not conflict).

    Args:
        source: a path, ``builtin:NAME`` / a bare built-in name (``default``), a mapping or a Policy.
        fmt: force the file format instead of guessing it from the suffix.

    Returns:
        The validated ``Policy``; relative ``audit_log`` paths are resolved against the file's folder.

    Raises:
        ConfigError: naming the rule, the field (``$.input[2].detector``), the value and the fix.

    Example:
        >>> policy = load_policy("builtin:default")
        >>> [r.id for r in policy.input][:1]
        ['block-injection']
    """
    from plyx.safety._engine import compile_policy

    if isinstance(source, Policy):
        policy = source
    elif isinstance(source, dict):
        policy = Policy.from_dict(source)
    else:
        text = str(source)
        name = text.removeprefix("builtin:")
        builtin = builtin_policy_path(name) if (text.startswith("builtin:") or not Path(text).exists()) else None
        if text.startswith("builtin:") and builtin is None:
            known = sorted(p.stem for p in _BUILTIN.glob("*.toml"))
            raise ConfigError("$", f"no built-in policy named {name!r}", value=text, fix=f"choose from {', '.join(known)}")
        path = builtin or Path(text)
        policy = load_config(Policy, path, fmt=fmt)
        if policy.audit_log and not Path(policy.audit_log).is_absolute() and builtin is None:
            policy = policy.replace(audit_log=str(path.resolve().parent / policy.audit_log))
    compile_policy(policy)  # raises ConfigError naming the rule
    return policy
