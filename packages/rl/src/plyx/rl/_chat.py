"""Chat templates with Hugging Face ``apply_chat_template`` semantics, and the assistant-token mask.

The template is the tokenizer's Jinja source (``chat_template.jinja`` or the ``chat_template`` of
``tokenizer_config.json`` beside ``tokenizer.json``), rendered as transformers renders it: a sandboxed
Jinja environment with ``trim_blocks`` / ``lstrip_blocks``, the globals ``raise_exception``,
``bos_token``, ``eos_token``, ``add_generation_prompt``, the ``tojson`` filter and the
``{% generation %}`` block tag. The rendered text is tokenized without added special tokens
(what ``apply_chat_template(tokenize=True)`` does), so the ids equal transformers' ids.

Which tokens are the assistant's (the SFT loss mask):

- templates with ``{% generation %}`` blocks: exactly the characters rendered inside them (transformers'
  ``return_assistant_tokens_mask``); the blocks are found through two private-use marker characters that
  the render inserts and then removes;
- other templates: for each assistant turn ``i``, the characters between the render of
  ``messages[:i]`` with the generation prompt and the render of ``messages[:i + 1]`` (the turn's content
  and its end-of-turn text), which needs a template whose renders are prefixes of each other.

A token is the assistant's when its first character is.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = ["ChatTemplate", "ChatTemplateError", "RenderedChat", "load_chat_template", "strip_generation_tags"]

_START, _END = "\ue000", "\ue001"  # private-use code points marking {% generation %} output


class ChatTemplateError(ValueError):
    """A template is missing, fails to render, or cannot locate the assistant turns; the message says the fix."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


@attrs.frozen
class RenderedChat:
    """A rendered conversation.

    Attributes:
        text: the template's output.
        spans: ``(start, end)`` character ranges of the assistant's text.
    """

    text: str
    spans: tuple[tuple[int, int], ...]


def _generation_extension() -> Any:
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):  # transformers' AssistantTracker tag, as markers around the block's output
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            return _START + caller() + _END

    return Generation


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja source.
        bos_token, eos_token: strings the template may insert.
        name: where it came from, for error messages.

    Example:
        >>> t = ChatTemplate("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
        >>> t.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
        'user: hi\\n'
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "custom") -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_extension()])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
        try:
            self._template = env.from_string(source)
        except TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template {name!r} is not valid Jinja: {exc} (line {exc.lineno})") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        self.has_generation_blocks = "generation" in source and "endgeneration" in source

    def _render_marked(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template {self.name!r} failed to render these messages: {exc}") from None

    def render(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (``apply_chat_template(tokenize=False)``)."""
        return self._render_marked(messages, add_generation_prompt).replace(_START, "").replace(_END, "")

    def render_with_spans(self, messages: Sequence[dict[str, Any]]) -> RenderedChat:
        """The text of the whole conversation and the character spans of the assistant's turns."""
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and (_START in content or _END in content):
                raise ChatTemplateError("a message contains U+E000/U+E001 (reserved as render markers); remove them")
        marked = self._render_marked(messages, False)
        if self.has_generation_blocks and _START in marked:
            return _strip_markers(marked)
        text = marked.replace(_START, "").replace(_END, "")
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            head = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1], add_generation_prompt=False)
            if not (text.startswith(head) and text.startswith(upto) and len(upto) >= len(head)):
                raise ChatTemplateError(
                    f"chat template {self.name!r}: the render of the first {i} messages (plus the generation prompt) "
                    f"is not a prefix of the whole conversation's, so assistant turn {i} cannot be located; add "
                    "{% generation %} ... {% endgeneration %} around the assistant content in the template"
                )
            spans.append((len(head), len(upto)))
        return RenderedChat(text, tuple(spans))


_GENERATION_TAG = re.compile(r"\{%-?\s*(?:end)?generation\s*-?%\}")


def strip_generation_tags(source: str) -> str:
    """``source`` without ``{% generation %}`` / ``{% endgeneration %}``: the same renders, for consumers
    (inference servers) whose Jinja environment lacks transformers' training-only tag."""
    return _GENERATION_TAG.sub("", source)


def _strip_markers(marked: str) -> RenderedChat:
    out, spans, start = [], [], None
    pos = 0
    for ch in marked:
        if ch == _START:
            start = pos
        elif ch == _END:
            if start is not None and pos > start:
                spans.append((start, pos))
            start = None
        else:
            out.append(ch)
            pos += 1
    return RenderedChat("".join(out), tuple(spans))


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content", ""))
    return str(value or "")


def load_chat_template(tokenizer_dir: str | os.PathLike[str], override: str = "") -> ChatTemplate:
    """The chat template of a tokenizer directory, or ``override`` (a ``.jinja`` file or Jinja source).

    Looks for ``chat_template.jinja``, then ``tokenizer_config.json``'s ``chat_template`` (a string, or
    a list of named templates: ``default`` is used), with that file's ``bos_token`` / ``eos_token``.

    Raises:
        ChatTemplateError: no template anywhere; the message lists where it looked and the fix.
    """
    d = Path(tokenizer_dir)
    if d.is_file():
        d = d.parent
    cfg: dict[str, Any] = {}
    cfg_file = d / "tokenizer_config.json"
    if cfg_file.is_file():
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ChatTemplateError(f"{cfg_file} is not valid JSON ({exc}); fix or remove it") from None
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if override:
        p = Path(override)
        if "{%" in override or "{{" in override:
            return ChatTemplate(override, bos_token=bos, eos_token=eos, name="config")
        if p.is_file():
            return ChatTemplate(p.read_text(encoding="utf-8"), bos_token=bos, eos_token=eos, name=str(p))
        raise ChatTemplateError(f"chat_template {override!r} is neither a file nor Jinja source; pass a "
                                ".jinja file or the template text")
    if (d / "chat_template.jinja").is_file():
        return ChatTemplate((d / "chat_template.jinja").read_text(encoding="utf-8"), bos_token=bos, eos_token=eos,
                            name=str(d / "chat_template.jinja"))
    source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if isinstance(source, str) and source:
        return ChatTemplate(source, bos_token=bos, eos_token=eos, name=str(cfg_file))
    raise ChatTemplateError(
        f"the tokenizer in {str(d)!r} has no chat template (looked for chat_template.jinja and the chat_template "
        "of tokenizer_config.json); add one there, set chat_template in the config (a .jinja file or Jinja "
        "source), or use prompt/completion or text records, which need no template"
    )
