"""The guardrail boundary of the engine: the safety hooks of one request, run where it enters and leaves.

A ``RequestGuard`` carries one caller-level request (an HTTP call, or one prompt of ``generate``) through
the three serving hooks of ``plyx.specs.hookspecs``:

- ``plyx_on_request_received`` once, when the request enters the engine (``Engine.admit``; called by
  ``Engine.add_request`` when nobody admitted it yet): a refusal raises ``RequestRefused``, a rewritten
  ``prompt_text`` is re-read by the caller (``Engine.add_request`` re-encodes it);
- ``plyx_output_filters`` once per completion, whose filters see every text delta the engine emits
  (what they hold back is emitted at the completion's end; a filter that blocks ends the completion
  with ``finish_reason="content_filter"``);
- ``plyx_on_response`` once, when the last engine request of the guard finished or was aborted.

Several engine requests may share one guard (an HTTP call with several prompts): the hooks still run once
per guard, which is what a policy counts and audits.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RequestGuard", "RequestRefused"]


def _hooks() -> Any:
    from plyx.specs.plugins import get_plugin_manager

    return get_plugin_manager().hook


class RequestRefused(Exception):
    """An input rail (``plyx_on_request_received``) refused the request; nothing was computed.

    Attributes:
        refusal: the hook's refusal dict (``{"message", "rule_id", "status"}``, or plyx-safety's with ``error``).
        status: the HTTP status the refusal asks for (400 unless it says otherwise).
    """

    def __init__(self, refusal: dict[str, Any]) -> None:
        self.refusal = dict(refusal)
        error = refusal.get("error") if isinstance(refusal.get("error"), dict) else {}
        try:
            status = int(refusal.get("status", 400))
        except (TypeError, ValueError):
            status = 400
        self.status = status if 400 <= status < 600 else 400
        self.message = str(error.get("message") or refusal.get("message") or "refused by a guardrail")
        self.rule_id = error.get("rule_id", refusal.get("rule_id"))
        super().__init__(f"the request was refused by a guardrail ({self.rule_id or 'no rule id'}): {self.message}")


class _Rails:
    """The output filters of one completion and the text they let out so far."""

    __slots__ = ("blocked", "filters", "reason", "text")

    def __init__(self, filters: list[Any]) -> None:
        self.filters = filters
        self.text = ""
        self.blocked = False
        self.reason: str | None = None  # the completion's finish reason, once it ended

    def feed(self, delta: str, final: bool) -> str:
        """The part of ``delta`` the filters let out now (and, when ``final``, what they held back)."""
        out = delta
        for f in self.filters:
            out = f.feed(out)
        if final:
            tail = ""
            for f in self.filters:
                tail = f.feed(tail) + f.finish() if tail else f.finish()
            out += tail
        self.blocked = any(getattr(f, "blocked", None) for f in self.filters)
        self.text += out
        return out


class RequestGuard:
    """The safety hooks of one caller-level request (see the module docstring).

    Args:
        request: the hook's ``request`` dict: the OpenAI-shaped body, with ``prompt_text`` (the text the model
            will see). Input rails may rewrite ``prompt_text`` in place.
        context: the hook's ``context`` (``request_id``, ``client``, ``endpoint``, ``guardrail_policy``);
            the same dict reaches every hook of the request.

    Example::

        guard = RequestGuard({"prompt": "hi", "prompt_text": "hi"}, {"request_id": "r1", "endpoint": "generate"})
        engine.add_request("r1", tok.encode("hi"), params, guard=guard)  # runs the input rails, or raises
    """

    def __init__(self, request: dict[str, Any], context: dict[str, Any]) -> None:
        self.request = request
        self.context = context
        self.admitted = False
        self.status = 200  # the status on_response reports; a server sets 499/500 before aborting
        self._prompt_text = request.get("prompt_text")
        self._open: set[str] = set()  # engine requests not finished yet
        self._choices: dict[tuple[str, int], _Rails] = {}
        self._order: list[tuple[str, int]] = []
        self._tokens = [0, 0]  # prompt, completion
        self._responded = False

    # -- input ---------------------------------------------------------------------------
    def admit(self) -> None:
        """Run the input rails once (later calls do nothing). Raises ``RequestRefused`` on a refusal, after
        reporting it through ``plyx_on_response`` (``finish_reason="refused"``)."""
        if self.admitted:
            return
        hook = _hooks()
        refusal = hook.plyx_on_request_received(request=self.request, context=self.context)
        if refusal:
            error = RequestRefused(refusal)
            self._responded = True
            hook.plyx_on_response(request=self.request, response={"text": "", "finish_reason": "refused",
                                                                  "usage": {}, "status": error.status},
                                  context=self.context)
            raise error
        self.admitted = True

    @property
    def rewritten(self) -> str | None:
        """The prompt text an input rail rewrote (redaction), or None when it let the prompt through as is."""
        text = self.request.get("prompt_text")
        return text if isinstance(text, str) and text != self._prompt_text else None

    # -- output --------------------------------------------------------------------------
    def attach(self, request_id: str, prompt_tokens: int, n: int) -> None:
        """An engine request of this guard was queued with ``n`` completions: each gets its own output filters."""
        hook = _hooks()
        self._open.add(request_id)
        self._tokens[0] += prompt_tokens
        for i in range(n):
            lists = hook.plyx_output_filters(request=self.request, context=self.context)
            self._choices[(request_id, i)] = _Rails([f for group in lists or () for f in (group or ())])
            self._order.append((request_id, i))

    @property
    def filtering(self) -> bool:
        """Whether any completion has output filters (else text passes through untouched)."""
        return any(r.filters for r in self._choices.values())

    def feed(self, request_id: str, index: int, delta: str | None, finish_reason: str | None,
             tokens: int) -> tuple[str | None, bool]:
        """A completion's new text (``finish_reason`` set on its last) through its filters: ``(text to emit,
        blocked)``. A blocked completion must end now (``finish_reason="content_filter"``)."""
        self._tokens[1] += tokens
        rails = self._choices.get((request_id, index))
        if rails is None:
            return delta, False
        if finish_reason is not None:
            rails.reason = finish_reason
        if delta is None:
            return delta, False
        if not rails.filters:
            rails.text += delta
            return delta, False
        out = rails.feed(delta, finish_reason is not None)
        if rails.blocked:
            rails.reason = "content_filter"
        return out, rails.blocked

    def text(self, request_id: str, index: int) -> str | None:
        rails = self._choices.get((request_id, index))
        return rails.text if rails is not None else None

    def finish(self, request_id: str, aborted: bool = False) -> None:
        """An engine request of this guard ended (finished, or ``aborted``): the last one reports the response
        (its ``finish_reason`` is the first completion's, as the server's reply shows it)."""
        if aborted:
            for (rid, _), rails in self._choices.items():
                if rid == request_id and rails.reason is None:
                    rails.reason = "abort"
            if self.status == 200:
                self.status = 499  # the caller went away (a server that knows better set its status already)
        self._open.discard(request_id)
        if self._open or self._responded:
            return
        self._responded = True
        prompt, completion = self._tokens
        text = "".join(self._choices[k].text for k in self._order)
        first = self._choices[self._order[0]].reason if self._order else None
        _hooks().plyx_on_response(request=self.request, response={
            "text": text, "finish_reason": first or "abort",
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
            "status": self.status}, context=self.context)
