"""Chat templates: the Jinja template of the tokenizer config (as transformers renders it), or a named default.

Rendered in a sandboxed Jinja environment with transformers' globals
(``raise_exception``, ``bos_token``, ``eos_token``, ``add_generation_prompt``),
so the templates shipped in Hugging Face ``tokenizer_config.json`` files work unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN_TEMPLATES", "ChatTemplate", "load_chat_template"]

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
    "plain": (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    ),
}


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

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError) as exc:
            raise ChatTemplateError(f"the chat template {self.name!r} failed to render these messages: {exc}") from None


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content", ""))
    return str(value or "")


def load_chat_template(model_dir: str | Path | None, override: str | None = None) -> ChatTemplate | None:
    """The template of ``override`` (a builtin name, a file, or Jinja source), else of the model directory's
    ``chat_template.jinja`` / ``tokenizer_config.json``; None when there is none."""
    cfg: dict[str, Any] = {}
    d = Path(model_dir) if model_dir else None
    if d is not None and (d / "tokenizer_config.json").is_file():
        cfg = json.loads((d / "tokenizer_config.json").read_text())
    bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
    if override:
        if override in BUILTIN_TEMPLATES:
            return ChatTemplate(BUILTIN_TEMPLATES[override], bos_token=bos, eos_token=eos, name=override)
        p = Path(override)
        if p.is_file():
            return ChatTemplate(p.read_text(), bos_token=bos, eos_token=eos, name=str(p))
        if "{%" in override or "{{" in override:
            return ChatTemplate(override, bos_token=bos, eos_token=eos, name="request")
        raise ValueError(f"chat template {override!r} is neither a builtin ({', '.join(BUILTIN_TEMPLATES)}), a file "
                         "nor Jinja source; pass one of those")
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
