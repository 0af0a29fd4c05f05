"""Red-team targets: an OpenAI-compatible HTTP endpoint, an in-process callable, or either behind a policy.

A target is a callable ``(messages: list[dict]) -> str`` (the chat messages in
OpenAI shape, the reply text back). ``resolve_target`` turns a ``--target``
string into one:

- ``http://host:port/v1`` (or the full ``.../chat/completions`` URL): POSTs
  ``/chat/completions`` with ``urllib`` (standard library only). Only a
  content-policy refusal counts as an answer: an HTTP 4xx whose OpenAI error has
  code or type ``content_policy_violation`` (plyx-safety, OpenAI) or
  ``content_filter`` (Azure), or carries a guardrail ``rule_id``, and a
  completion whose ``finish_reason`` is ``content_filter``. Every other error
  (``context_length_exceeded``, a 422, a 429) is an error, never a refusal.
  ``max_tokens`` is fitted to the target's context, read from ``/v1/models``
  (``max_model_len`` for plyx and vLLM, ``context_length`` elsewhere), with the
  prompt counted by the server's ``/tokenize`` when it has one;
- ``package.module:attr``: a Python callable taking the messages (a plyx model
  in process, any client function);
- ``test:echo`` / ``test:refuse``: reference targets that repeat the last user
  message or always refuse, to calibrate probes (garak's ``test`` generators).
"""

from __future__ import annotations

import json
import threading
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


_REFUSAL_CODES = frozenset({"content_policy_violation", "content_filter", "moderation_blocked", "safety"})


def _is_refusal_error(error: Any) -> bool:
    """Whether an OpenAI error object is a content-policy refusal (not a malformed or oversized request)."""
    if not isinstance(error, dict):
        return False
    return bool(error.get("rule_id")) or any(str(error.get(k) or "") in _REFUSAL_CODES for k in ("code", "type"))


class HttpTarget:
    """An OpenAI-compatible chat completions endpoint.

    Args:
        url: the API base (``http://127.0.0.1:8000/v1``) or the full ``/chat/completions`` URL.
        model: the ``model`` field sent; empty: the first model ``/v1/models`` lists (else ``default``).
        api_key: sent as ``Authorization: Bearer``; empty sends none.
        timeout: seconds per request.
        max_tokens: the most tokens asked for per reply; lowered per request so that prompt plus reply
            fit the target's context when ``/v1/models`` tells it.
        temperature: sampling temperature sent with each request.
        params: more request fields sent as they are (``{"top_p": 0.9, "stop": ["\\n\\n"]}``).
        min_tokens: a request whose prompt leaves fewer tokens than this is not sent: it is an error.
        context: the target's context in tokens; 0 reads it from ``/v1/models``.
    """

    def __init__(self, url: str, *, model: str = "", api_key: str = "", timeout: float = 60.0,
                 max_tokens: int = 256, temperature: float = 0.0, params: dict[str, Any] | None = None,
                 min_tokens: int = 16, context: int = 0) -> None:
        base = url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.api = self.url[: -len("/chat/completions")]  # .../v1
        self.model, self.api_key, self.timeout = model, api_key, timeout
        self.max_tokens, self.temperature = int(max_tokens), temperature
        self.params = dict(params or {})
        reserved = sorted(set(self.params) & {"model", "messages", "stream"})
        if reserved:
            raise ValueError(f"params: {reserved[0]!r} is set by the target itself; remove it from params")
        self.min_tokens = int(min_tokens)
        self.context = int(context)
        self._discovered = False
        self._tokenize: str | None = None  # the server's /tokenize URL once one has answered
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"HttpTarget({self.url!r}, model={self.model!r})"

    # -- HTTP -------------------------------------------------------------------------
    def _request(self, url: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                         headers={"Content-Type": "application/json"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(request, timeout=self.timeout) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def discover(self) -> None:
        """Read the model name and context length from ``/v1/models`` (once; a target without it is left as set)."""
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            try:
                listing = self._request(self.api + "/models", None)
            except (urllib.error.URLError, TimeoutError, OSError, ValueError):
                return  # not every OpenAI-compatible server lists models: keep the configured values
            cards = [c for c in (listing.get("data") or []) if isinstance(c, dict)] if isinstance(listing, dict) else []
            card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards and not self.model else None)
            if card is None:
                return
            self.model = self.model or str(card.get("id", ""))
            if not self.context:
                for key in ("max_model_len", "context_length", "context_window", "max_context_length"):
                    if isinstance(card.get(key), int) and card[key] > 0:
                        self.context = int(card[key])
                        break

    def _prompt_tokens(self, messages: Messages) -> int:
        """Tokens of the prompt: the server's ``/tokenize`` (plyx, vLLM) when it has one, else an upper
        bound (UTF-8 bytes, as no byte-level or byte-fallback token is shorter than a byte, plus 8 per
        message for the chat template)."""
        root = self.api[: -len("/v1")] if self.api.endswith("/v1") else self.api
        for url in ([self._tokenize] if self._tokenize else [root + "/tokenize", self.api + "/tokenize"]):
            try:
                out = self._request(url, {"model": self.model, "messages": list(messages), "add_generation_prompt": True})
            except (urllib.error.URLError, TimeoutError, OSError, ValueError):
                continue
            if isinstance(out, dict) and isinstance(out.get("count"), int):
                self._tokenize = url
                return int(out["count"])
        return sum(len(str(m.get("content", "")).encode()) + 8 for m in messages) + 8

    def request_body(self, messages: Messages) -> dict[str, Any]:
        """The JSON body sent for ``messages``, ``max_tokens`` fitted to the context.

        Raises:
            TargetError: the prompt leaves fewer than ``min_tokens`` of the target's context.
        """
        self.discover()
        max_tokens = self.max_tokens
        if self.context:
            prompt = self._prompt_tokens(messages)
            room = self.context - prompt
            if room < self.min_tokens:
                raise TargetError(f"the prompt takes ~{prompt} of the target's {self.context}-token context, leaving "
                                  f"{max(room, 0)} (< min_tokens {self.min_tokens}); serve the model with a longer "
                                  "context or lower min_tokens")
            max_tokens = min(max_tokens, room)
        return {**self.params, "model": self.model or "default", "messages": list(messages), "max_tokens": max_tokens,
                "temperature": self.temperature, "stream": False}

    def __call__(self, messages: Messages) -> str:
        body = self.request_body(messages)
        try:
            payload = self._request(self.url, body)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode("utf-8", "replace")
            try:
                error = json.loads(text).get("error", {})
            except (ValueError, AttributeError):
                error = {}
            if 400 <= exc.code < 500 and _is_refusal_error(error):
                return Refusal(str(error.get("message") or "refused"))  # a content-policy refusal is an answer
            code = error.get("code") if isinstance(error, dict) else None
            raise TargetError(f"{self.url} answered HTTP {exc.code}" + (f" {code}" if code else "") +
                              f": {text[:200]}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise TargetError(f"cannot reach {self.url}: {exc}") from None
        except ValueError:
            raise TargetError(f"{self.url} did not answer JSON") from None
        try:
            choice = payload["choices"][0]
            content = choice["message"]["content"] or ""
        except (KeyError, IndexError, TypeError):
            raise TargetError(f"{self.url} answered something that is not a chat completion: {str(payload)[:200]}") from None
        if choice.get("finish_reason") == "content_filter":  # an output rail stopped the reply
            return Refusal(content or "stopped by a content filter")
        return content


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
