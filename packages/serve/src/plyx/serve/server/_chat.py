"""Chat templates: the Jinja template of the tokenizer config (as transformers renders it), or a named default.

Rendered in a sandboxed Jinja environment with transformers' globals
(``raise_exception``, ``bos_token``, ``eos_token``, ``add_generation_prompt``) and
extensions (``{% break %}``/``{% continue %}``, and ``{% generation %}`` blocks,
rendered as their body), so the templates shipped in Hugging Face
``tokenizer_config.json`` files work unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN_TEMPLATES", "ChatTemplate", "load_chat_template"]

HERMES_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with \
function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n\
</tool_call><|im_end|>\n' }}
{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first %}
{%- elif message['role'] == 'assistant' and message['tool_calls'] %}
{{- '<|im_start|>assistant' }}{%- if message['content'] %}{{- '\n' + message['content'] }}{%- endif %}
{%- for call in message['tool_calls'] %}{%- set fn = call['function'] if call['function'] is defined else call %}
{{- '\n<tool_call>\n{"name": ' + (fn['name'] | tojson) + ', "arguments": ' + (fn['arguments'] | tojson) + '}\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}
{%- else %}{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

#: named defaults for models whose tokenizer config has no template
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
        " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # ChatML with tools in the system turn and <tool_call> replies, as Hermes 2 Pro and Qwen 2.5 write them
    # (pair it with --tool-call-parser hermes)
    "hermes": HERMES_TEMPLATE,
    "plain": (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    ),
}


def _generation_block() -> type:
    """The ``{% generation %}...{% endgeneration %}`` tag of transformers' chat templates (it marks the assistant's
    tokens for training masks): rendered here as its body, as transformers renders it when it tracks nothing."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationBlock(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            # a call block, as transformers': the body renders in its own scope (a `set` inside stays inside)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return GenerationBlock


class ChatTemplateError(ValueError):
    """A template failed to render (``raise_exception`` in the template, or a Jinja error)."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: Jinja source.
        bos_token, eos_token: the strings the template may insert.
        name: where it came from (``tokenizer_config.json``, ``chatml``...), for messages.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "custom") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # the environment transformers' apply_chat_template renders in: loop controls and the generation tag
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_generation_block(), "jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        from jinja2 import TemplateError

        try:
            self.template = env.from_string(source)
        except TemplateError as exc:  # a syntax error: one line naming where, not a traceback
            raise ChatTemplateError(f"the chat template {name!r} is not valid Jinja: {exc} (line "
                                    f"{getattr(exc, 'lineno', '?')}); fix the template or pass another") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads ``tools`` (a template that does not would drop them silently)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        extra = {"tools": tools} if tools else {}  # as transformers: templates test `tools is defined` / `if tools`
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"the chat template {self.name!r} failed to render these messages: {exc}") from None


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content", ""))
    return str(value or "")


def load_chat_template(model_dir: str | Path | None, override: str | None = None, *,
                       files: bool = True) -> ChatTemplate | None:
    """The template of ``override`` (a builtin name, a file, or Jinja source), else of the model directory's
    ``chat_template.jinja`` / ``tokenizer_config.json``; None when there is none.

    ``files=False`` (a request's ``chat_template``): ``override`` is a builtin name or Jinja source, never a
    path, so a client cannot make the server read its files."""
    cfg: dict[str, Any] = {}
    d = Path(model_dir) if model_dir else None
    if d is not None and (d / "tokenizer_config.json").is_file():
        from plyx.serve.server._loading import read_json

        found = read_json(d / "tokenizer_config.json")
        cfg = found if isinstance(found, dict) else {}
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if override:
        if override in BUILTIN_TEMPLATES:
            return ChatTemplate(BUILTIN_TEMPLATES[override], bos_token=bos, eos_token=eos, name=override)
        p = Path(override)
        if files and p.is_file():
            return ChatTemplate(p.read_text(), bos_token=bos, eos_token=eos, name=str(p))
        if "{%" in override or "{{" in override:
            return ChatTemplate(override, bos_token=bos, eos_token=eos, name="request")
        what = "a file " if files else ""
        raise ValueError(f"chat template {override!r} is neither a builtin ({', '.join(BUILTIN_TEMPLATES)}), "
                         f"{what}nor Jinja source; pass one of those")
    if d is not None and (d / "chat_template.jinja").is_file():
        return ChatTemplate((d / "chat_template.jinja").read_text(), bos_token=bos, eos_token=eos,
                            name="chat_template.jinja")
    source = cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default") or next(iter(named.values()), None)
    if isinstance(source, str) and source:
        return ChatTemplate(source, bos_token=bos, eos_token=eos, name="tokenizer_config.json")
    return None
