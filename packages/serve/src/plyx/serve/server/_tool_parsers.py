"""Tool-call parsers: the text a model writes when it calls a function, turned back into OpenAI ``tool_calls``.

Each model family writes calls its own way (the chat template tells it how):

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole reply is
  ``{"name": ..., "parameters": {...}}`` (several joined by ``;``), optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11+). ``[TOOL_CALLS]`` is a special token, so this parser asks the
  server to keep special tokens in the text.

A parser is a small object with ``start`` (where the tool-call section begins, once it is certain),
``hold`` (from where streamed text must be held back because it may still become the start) and
``calls`` (the parsed calls of the section, or None when it is not valid). ``ToolStream`` drives any
parser over streamed text, so streamed and whole replies are the same by construction. Parsers are
plugins: ``plyx_tool_parsers`` returns ``Component(name, factory)`` with ``factory()`` -> a parser.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

import msgspec

__all__ = [
    "BUILTIN_PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedCall",
    "ToolParser",
    "ToolStream",
    "get_tool_parser",
]


class ParsedCall(msgspec.Struct, frozen=True):
    """One call: the function's name and its arguments as JSON text (OpenAI sends arguments as a string)."""

    name: str
    arguments: str


class ToolParser(Protocol):
    """What ``ToolStream`` needs of a parser."""

    name: str
    keep_special_tokens: bool
    """True when the call markers are special tokens (they must not be skipped when decoding)."""

    def start(self, text: str) -> int | None:
        """Index where the tool-call section begins, or None while ``text`` has none (yet)."""

    def hold(self, text: str) -> int:
        """Index from which ``text`` may still turn into the section's start (streamed content stops there)."""

    def calls(self, section: str) -> list[ParsedCall] | None:
        """The calls in ``section`` (``text[start:]``); None when it does not parse (it is then content)."""


def _prefix_hold(text: str, marker: str) -> int:
    """The earliest index i such that ``text[i:]`` is a proper prefix of ``marker`` (len(text) when none)."""
    for i in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[i:]):
            return i
    return len(text)


def _call(obj: Any, args_key: str) -> ParsedCall | None:
    """A ``{"name": str, <args_key>: object}`` dict as a call (``arguments`` / ``parameters`` both accepted)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separators: str) -> list[Any] | None:
    """Consecutive JSON values in ``text``, separated by whitespace or ``separators``; None if any does not parse."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in separators):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks (Hermes 2 Pro, Qwen 2.5 / 3)."""

    name = "hermes"
    keep_special_tokens = False
    open, close = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def start(self, text: str) -> int | None:
        i = text.find(self.open)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        return _prefix_hold(text, self.open)

    def calls(self, section: str) -> list[ParsedCall] | None:
        out = []
        for body in self._block.findall(section):  # the last block may be unclosed (the reply ended at EOS)
            values = _json_values(body, "")
            if not values or len(values) != 1:
                return None
            call = _call(values[0], "arguments")
            if call is None:
                return None
            out.append(call)
        # text between or after the blocks other than whitespace means this was not a clean call section
        if self._block.sub("", section).strip():
            return None
        return out or None


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the reply is ``{"name": "f", "parameters": {...}}`` (``;``-separated for
    several), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    keep_special_tokens = False
    tag = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(self.tag) or stripped.startswith("{"):
            return len(text) - len(stripped)
        return None

    def hold(self, text: str) -> int:
        stripped = text.lstrip()
        # a reply that is blank so far, or a prefix of the tag, may still become a call
        if not stripped or self.tag.startswith(stripped):
            return 0
        return len(text)

    def calls(self, section: str) -> list[ParsedCall] | None:
        section = section.strip()
        if section.startswith(self.tag):
            section = section[len(self.tag):]
        values = _json_values(section, ";")
        if not values:
            return None
        out = [_call(v, "parameters") for v in values]
        return None if any(c is None for c in out) else out  # type: ignore[return-value]


class MistralParser:
    """``[TOOL_CALLS] [{"name": "f", "arguments": {...}}]`` (v3) or ``[TOOL_CALLS]f[ARGS]{...}`` (v11+)."""

    name = "mistral"
    keep_special_tokens = True
    marker = "[TOOL_CALLS]"

    def start(self, text: str) -> int | None:
        i = text.find(self.marker)
        return None if i < 0 else i

    def hold(self, text: str) -> int:
        return _prefix_hold(text, self.marker)

    def calls(self, section: str) -> list[ParsedCall] | None:
        out: list[ParsedCall] = []
        for part in section.split(self.marker)[1:]:
            part = part.strip()
            if "[ARGS]" in part and not part.startswith("["):  # v11: name[ARGS]{json}
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args, "")
                call = _call({"name": name.strip(), "arguments": values[0]}, "arguments") \
                    if values is not None and len(values) == 1 else None
                if call is None:
                    return None
                out.append(call)
                continue
            values = _json_values(part, "")
            if not values or len(values) != 1:
                return None
            items = values[0] if isinstance(values[0], list) else [values[0]]
            calls = [_call(v, "arguments") for v in items]
            if not calls or any(c is None for c in calls):
                return None
            out.extend(calls)  # type: ignore[arg-type]
        return out or None


#: name -> class of the built-in parsers (the serve plugin returns them through ``plyx_tool_parsers``)
BUILTIN_PARSERS: dict[str, type] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` among the installed plugins'; a ConfigError (a ValueError) lists those found."""
    from plyx.specs.errors import ConfigError
    from plyx.specs.plugins import components

    found = components("plyx_tool_parsers")
    if name not in found:
        raise ConfigError("tool_parser", f"tool-call parser {name!r} not found. It is either misspelled or not "
                          f"installed; installed: {', '.join(sorted(found)) or 'none'}", value=name,
                          fix="pass --tool-call-parser with one of those (or '' for none)")
    return found[name].factory()


class ToolStream:
    """One choice's text, split into content and tool calls as it streams.

    ``feed(text)`` returns the content that can be shown now: text before the tool-call section, held back
    where it may still become a call marker (and trailing whitespace, which a call would strip).
    ``finish()`` returns ``(content still to show, calls)``: with calls, content is the text before the
    section (right-stripped, None when empty); without (no section, or one that does not parse), the whole
    text is content. ``result()`` gives the same split of the whole text, so a streamed reply assembled by
    a client equals the reply sent whole.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.emitted = 0
        self.begin: int | None = None

    def feed(self, text: str) -> str:
        self.text += text
        if self.begin is None:
            self.begin = self.parser.start(self.text)
        limit = self.begin if self.begin is not None else self.parser.hold(self.text)
        limit = len(self.text[:limit].rstrip())
        if limit <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:limit], limit
        return out

    def result(self) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of everything fed so far."""
        begin = self.parser.start(self.text)
        calls = self.parser.calls(self.text[begin:]) if begin is not None else None
        if not calls:
            return self.text, []
        return self.text[:begin].rstrip() or None, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        content, calls = self.result()
        rest = (content or "")[self.emitted:]
        self.emitted += len(rest)
        return rest, calls
