"""Structured output through xgrammar: JSON schema, regex, choice and EBNF constraints as a logits processor.

Why xgrammar (of the engines DESIGN.md allows):

- it compiles every constraint kind we need (JSON Schema, regex, EBNF, and choice as an
  alternation) into one pushdown automaton, so recursive schemas work; outlines-core handles
  regex finite-state machines and reaches JSON Schema only through a regex translation
  (no recursion), lm-format-enforcer walks characters in Python at each step;
- it precomputes the context-independent part of each token mask at compile time ("adaptive
  token mask cache"), so the per-step cost is a few microseconds per row in C++, not a
  vocabulary scan in Python;
- masks are 32-bit packed bitmasks applied on device by ``apply_token_bitmask_inplace``
  (CUDA / Triton / CPU kernels), and its matchers support rollback for speculative decoding;
- it is what vLLM, SGLang and TensorRT-LLM use by default, and it is already in the stack.

The per-step host work (filling the bitmask from each matcher's state, accepting the sampled
token) is inherent to grammar decoding: the next mask depends on the token just chosen.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
from plyx.serve._params import StructuredOutput
from plyx.serve._tokenizer import TokenizerView
from plyx.specs.errors import ConfigError

__all__ = ["GrammarMask", "compile_structured", "new_matcher", "xgrammar"]

_COMPILERS: dict[int, tuple[Any, Any]] = {}  # id(TokenizerInfo) -> (info, GrammarCompiler)


def xgrammar() -> Any:
    """The xgrammar module, or a ConfigError saying how to install it."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ConfigError("structured", "structured output needs the xgrammar grammar engine, which is not installed",
                          fix='pip install "plyx-serve[structured]"') from None
    return xgr


def _compiler(info: Any) -> Any:
    import xgrammar as xgr

    entry = _COMPILERS.get(id(info))
    if entry is None or entry[0] is not info:
        entry = (info, xgr.GrammarCompiler(info, max_threads=2))
        _COMPILERS[id(info)] = entry
    return entry[1]


def _choice_regex(choices: Sequence[str]) -> str:
    """An alternation of the literal choices (regex metacharacters escaped the way xgrammar's
    regex dialect, ECMAScript-like, expects)."""
    special = set("\\^$.|?*+()[]{}/")
    return "(" + "|".join("".join("\\" + c if c in special else c for c in choice) for choice in choices) + ")"


def compile_structured(spec: StructuredOutput, tokenizer: TokenizerView, vocab_size: int,
                       stop_token_ids: Sequence[int], *, where: str = "SamplingParams.structured") -> Any:
    """Compile one constraint to an ``xgrammar.CompiledGrammar``; a bad schema/regex/grammar is a ConfigError."""
    xgrammar()  # a clear error when the engine is missing
    info = tokenizer.xgrammar_info(vocab_size, stop_token_ids)
    compiler = _compiler(info)
    try:
        if spec.json_schema is not None:
            schema = spec.json_schema
            if isinstance(schema, str):
                try:
                    schema_obj = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{where}.json_schema", f"the JSON schema is not valid JSON: {exc}",
                                      value=schema[:80], fix="pass a dict or valid JSON text") from None
            else:
                schema_obj = schema
            _check_schema(schema_obj, where)
            return compiler.compile_grammar(_json_schema_grammar(
                schema if isinstance(schema, str) else json.dumps(schema), spec.whitespace))
        if spec.json_object:
            return compiler.compile_builtin_json_grammar()
        if spec.regex is not None:
            return compiler.compile_regex(spec.regex)
        if spec.choice is not None:
            return compiler.compile_regex(_choice_regex(spec.choice))
        return compiler.compile_grammar(spec.grammar)
    except ConfigError:
        raise
    except (RuntimeError, ValueError) as exc:  # xgrammar raises RuntimeError with the parser's message
        field = next(n for n in ("json_schema", "regex", "choice", "grammar", "json_object")
                     if getattr(spec, n) not in (None, False))
        detail = str(exc).strip().splitlines()[0]
        detail = detail.split("] ", 1)[-1]  # drop xgrammar's "[time] file.cc:line:" prefix
        raise ConfigError(
            f"{where}.{field}",
            f"the {field.replace('_', ' ')} does not compile: {detail}",
            value=getattr(spec, field),
            fix=f"fix the {field.replace('_', ' ')} (xgrammar's {field} dialect)",
        ) from None


# xgrammar 0.2's rule for length-bounded JSON strings (maxLength / minLength) lets raw control characters
# U+0000..U+001F through, which RFC 8259 forbids inside strings (json.loads rejects them); its unbounded
# string rule already excludes them. We compile the schema's EBNF with the bounded rule tightened.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_schema_grammar(schema: str, whitespace: bool) -> Any:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=whitespace, strict_mode=True)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR))


def _check_schema(schema: dict[str, Any], where: str) -> None:
    """Validate the schema against its metaschema when ``jsonschema`` is installed (xgrammar
    accepts some invalid schemas silently, e.g. ``{"type": 3}`` is caught here first)."""
    try:
        import jsonschema
    except ImportError:  # optional: xgrammar's own checks still apply
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p!r}]" for p in exc.absolute_path)
        raise ConfigError(
            f"{where}.json_schema{path}",
            f"invalid JSON Schema: {exc.message}",
            value=exc.instance,
            fix="make the schema valid against its metaschema (https://json-schema.org)",
        ) from None


def new_matcher(compiled: Any, stop_token_ids: Sequence[int]) -> Any:
    """A fresh matcher: the grammar ends with one of ``stop_token_ids`` (EOS), which finishes the completion."""
    import xgrammar as xgr

    return xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)


class GrammarMask:
    """Processor masking each constrained row to the tokens its grammar allows next.

    ``matchers[i]`` is row i's ``xgrammar.GrammarMatcher`` or None (unconstrained row).
    """

    def __init__(self, matchers: Sequence[Any], vocab_size: int) -> None:
        import xgrammar as xgr

        self.matchers = list(matchers)
        self.rows = [i for i, m in enumerate(self.matchers) if m is not None]
        self._bitmask = xgr.allocate_token_bitmask(len(self.matchers), vocab_size)  # [B, ceil(V/32)] int32
        self._vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, state: Any) -> torch.Tensor:
        import xgrammar as xgr

        for i in self.rows:
            if not self.matchers[i].is_terminated():
                self.matchers[i].fill_next_token_bitmask(self._bitmask, i)
        logits = logits.clone()  # the raw logits are still needed for log-probabilities
        xgr.apply_token_bitmask_inplace(
            logits, self._bitmask.to(logits.device, non_blocking=True), vocab_size=self._vocab_size, indices=self.rows
        )
        return logits
