"""Which policy guards this process, and the serving/data hook bodies.

The policy is found, in order, in: the hook's ``context["guardrail_policy"]``
(a server passes its ``ServeConfig.guardrail_policy``), the guard set with
``activate()``, and the ``PLYX_SAFETY_POLICY`` environment variable (a path or
``builtin:NAME``). Nothing set: the hooks let everything through. A policy is
never taken from the request body: clients must not choose their own rails.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from plyx.safety._engine import refusal
from plyx.safety._guard import Guard
from plyx.safety._policy import Policy

__all__ = ["activate", "deactivate", "active_guard", "prompt_text", "on_request_received", "output_filters",
           "on_response", "document_filters"]

log = logging.getLogger("plyx.safety")
_LOCK = threading.Lock()
_ACTIVE: Guard | None = None
_CACHE: dict[tuple[str, float], Guard] = {}
# request_id -> rule ids the input rails fired, for the response record (bounded)
_FIRED: collections.OrderedDict[str, list[str]] = collections.OrderedDict()
_FIRED_MAX = 10_000


def activate(policy: Guard | Policy | str | os.PathLike[str] | dict[str, Any]) -> Guard:
    """Guard this process with ``policy`` (used when the hook context names none)."""
    global _ACTIVE
    guard = policy if isinstance(policy, Guard) else Guard(policy)
    with _LOCK:
        _ACTIVE = guard
    return guard


def deactivate() -> None:
    """Stop guarding (hooks let everything through unless a context or env var names a policy)."""
    global _ACTIVE
    with _LOCK:
        _ACTIVE = None
        _CACHE.clear()


def _load(source: str) -> Guard:
    path = Path(source)
    stamp = path.stat().st_mtime if path.is_file() else 0.0
    key = (str(path.resolve()) if path.is_file() else source, stamp)
    with _LOCK:
        guard = _CACHE.get(key)
        if guard is None:
            guard = Guard(source)  # a changed file (new mtime) is reloaded
            _CACHE[key] = guard
        return guard


def active_guard(context: Mapping[str, Any] | None = None) -> Guard | None:
    """The guard for a hook call (see the module docstring), or None."""
    source = (context or {}).get("guardrail_policy") or ""
    if source:
        return _load(str(source))
    if _ACTIVE is not None:
        return _ACTIVE
    env = os.environ.get("PLYX_SAFETY_POLICY", "")
    return _load(env) if env else None


def prompt_text(request: Mapping[str, Any]) -> str:
    """The text the model will see: ``prompt_text`` if the server set it, else the
    chat messages' contents or the completion prompt."""
    if isinstance(request.get("prompt_text"), str):
        return request["prompt_text"]
    parts: list[str] = []
    for message in request.get("messages") or []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # OpenAI content parts
            parts += [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
    prompt = request.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts += [p for p in prompt if isinstance(p, str)]
    return "\n".join(parts)


def on_request_received(request: dict[str, Any], context: dict[str, Any]) -> dict[str, Any] | None:
    try:
        guard = active_guard(context)
    except (ValueError, OSError) as exc:  # ConfigError is a ValueError
        # a named policy that cannot be loaded must not mean "no rails": fail closed
        log.error("guardrail policy %r could not be loaded, refusing requests: %s",
                  (context or {}).get("guardrail_policy") or os.environ.get("PLYX_SAFETY_POLICY", ""), exc)
        return refusal("The service's guardrail policy could not be loaded; the request was not processed.",
                       "policy-error", status=503)
    if guard is None or not guard.rails["input"]:
        return None
    decision = guard.check_input(prompt_text(request), context)
    request_id = str(context.get("request_id", ""))
    if request_id:
        with _LOCK:
            _FIRED[request_id] = decision.rule_ids
            while len(_FIRED) > _FIRED_MAX:
                _FIRED.popitem(last=False)
    if isinstance(context, dict):
        context["safety"] = {"policy": guard.policy.name, "input_rules": decision.rule_ids,
                             "redacted": decision.text != prompt_text(request)}
    if decision.blocked:
        return decision.refusal()
    if decision.text != prompt_text(request):
        # redact rules rewrite the prompt in place; the server reads prompt_text after the hook
        request["prompt_text"] = decision.text
    return None


def output_filters(request: dict[str, Any], context: dict[str, Any]) -> list[Any]:
    guard = active_guard(context)
    if guard is None or not guard.rails["output"]:
        return []
    return [guard.stream(context)]


def on_response(request: dict[str, Any], response: dict[str, Any], context: dict[str, Any]) -> None:
    guard = active_guard(context)
    if guard is None:
        return
    request_id = str(context.get("request_id", ""))
    with _LOCK:
        fired = _FIRED.pop(request_id, [])
    # a server that passes the same context dict to every hook of a request (plyx-serve
    # does) carries the input decision there, even when the request id came later
    safety = context.get("safety") if isinstance(context, Mapping) else None
    if isinstance(safety, Mapping) and not fired:
        fired = list(safety.get("input_rules", []))
    usage = response.get("usage") or {}
    guard.audit.write({
        "event": "response",
        "policy": guard.policy.name,
        "request_id": request_id,
        "status": response.get("status"),
        "finish_reason": response.get("finish_reason"),
        "usage": {k: v for k, v in usage.items() if isinstance(v, (int, float))} if isinstance(usage, Mapping) else {},
        "input_rules": fired,
        "chars": len(response.get("text") or ""),  # the size, never the text
    })


def document_filters(context: dict[str, Any]) -> list[Callable[[str], str | None]]:
    guard = active_guard(context)
    if guard is None or not guard.rails["documents"]:
        return []
    counter = iter(range(1 << 62))
    corpus = str(context.get("corpus", ""))

    def safety_document_filter(text: str) -> str | None:
        decision = guard.check_document(text, {"document": next(counter), "corpus": corpus})
        return None if decision.blocked else decision.text

    return [safety_document_filter]
