"""Red-team targets: an OpenAI-compatible HTTP endpoint, an in-process callable, or either behind a policy.

A target is a callable ``(messages: list[dict]) -> str`` (the chat messages in
OpenAI shape, the reply text back). ``resolve_target`` turns a ``--target``
string into one:

- ``http://host:port/v1`` (or the full ``.../chat/completions`` URL): POSTs
  ``/chat/completions`` with ``urllib`` (standard library only); an HTTP 4xx
  carrying an OpenAI error (a guardrail refusal) counts as the reply's text;
- ``package.module:attr``: a Python callable taking the messages (a plyx model
  in process, any client function);
- ``test:echo`` / ``test:refuse``: reference targets that repeat the last user
  message or always refuse, to calibrate probes (garak's ``test`` generators).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from plyx.safety._classifier import resolve_callable
from plyx.safety._probes import Refusal

__all__ = ["HttpTarget", "GuardedTarget", "resolve_target", "echo_target", "refuse_target", "TargetError"]

Messages = Sequence[dict[str, Any]]


class TargetError(RuntimeError):
    """The target could not be reached or answered something that is not a chat completion."""


class HttpTarget:
    """An OpenAI-compatible chat completions endpoint.

    Args:
        url: the API base (``http://127.0.0.1:8000/v1``) or the full ``/chat/completions`` URL.
        model: the ``model`` field sent (many servers require it).
        api_key: sent as ``Authorization: Bearer``; empty sends none.
        timeout: seconds per request.
        max_tokens, temperature: generation parameters sent with each request.
    """

    def __init__(self, url: str, *, model: str = "", api_key: str = "", timeout: float = 60.0,
                 max_tokens: int = 256, temperature: float = 0.0) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model, self.api_key, self.timeout = model, api_key, timeout
        self.max_tokens, self.temperature = max_tokens, temperature

    def __repr__(self) -> str:
        return f"HttpTarget({self.url!r}, model={self.model!r})"

    def __call__(self, messages: Messages) -> str:
        body = {"model": self.model or "default", "messages": list(messages), "max_tokens": self.max_tokens,
                "temperature": self.temperature, "stream": False}
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as resp:
                payload = json.loads(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            try:
                error = json.loads(text).get("error", {})
            except (ValueError, AttributeError):
                error = {}
            if 400 <= exc.code < 500 and isinstance(error, dict) and error.get("message") and exc.code not in (401, 404):
                return Refusal(str(error["message"]))  # a refusal (guardrail, moderation) is an answer
            raise TargetError(f"{self.url} answered HTTP {exc.code}: {text[:200]}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise TargetError(f"cannot reach {self.url}: {exc}") from None
        except ValueError:
            raise TargetError(f"{self.url} did not answer JSON") from None
        try:
            return payload["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise TargetError(f"{self.url} answered something that is not a chat completion: {str(payload)[:200]}") from None


class GuardedTarget:
    """``inner`` behind a policy's rails: input rails may refuse before the call, output rails
    redact or refuse the reply. Measures what a policy buys against the same probes."""

    def __init__(self, inner: Callable[[Messages], str], guard: Any) -> None:
        self.inner, self.guard = inner, guard

    def __repr__(self) -> str:
        return f"GuardedTarget({self.inner!r}, policy={self.guard.policy.name!r})"

    def __call__(self, messages: Messages) -> str:
        from plyx.safety._serving import prompt_text

        decision = self.guard.check_input(prompt_text({"messages": list(messages)}), {"endpoint": "redteam"})
        if decision.blocked:
            return Refusal(decision.message)
        reply = self.inner(messages)
        out = self.guard.check_output(reply, {"endpoint": "redteam"})
        return Refusal(out.message) if out.blocked else out.text


def echo_target(messages: Messages) -> str:
    """Repeats the last user message (a target that never refuses)."""
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return str(users[-1]) if users else ""


def refuse_target(messages: Messages) -> str:
    """Always refuses."""
    return "I'm sorry, but I can't help with that."


def resolve_target(spec: str | Callable[[Messages], str], **http_options: Any) -> Callable[[Messages], str]:
    """A target from a URL, ``module:attr``, ``test:echo``/``test:refuse`` or a callable."""
    if callable(spec):
        return spec
    if spec in ("test:echo", "test:refuse"):
        return echo_target if spec == "test:echo" else refuse_target
    if spec.startswith(("http://", "https://")):
        return HttpTarget(spec, **http_options)
    try:
        return resolve_callable(spec, option="target")
    except ValueError as exc:
        raise ValueError(f"--target {spec!r}: {exc}; give an http(s):// URL of an OpenAI-compatible API, "
                         "package.module:function, test:echo or test:refuse") from None
