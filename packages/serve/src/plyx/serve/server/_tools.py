"""Tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, ``parallel_tool_calls``.

How each ``tool_choice`` is served (vLLM's semantics):

- ``none``: tools are rendered into the prompt, the reply is plain content;
- ``auto`` (the default when tools are given): the reply is parsed by the server's tool-call parser
  (``--tool-call-parser``); text before the calls is content;
- ``required``: the reply is constrained by the structured-output grammar to a JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}`` (one item unless ``parallel_tool_calls``);
- a named function: the reply is constrained to that function's parameters schema and is its arguments.

Constrained arguments always validate against the function's JSON schema (xgrammar, as
``response_format``). Every tool schema is checked (metaschema and grammar compilation) before any
compute, and a bad one is a 400 naming ``tools[i].function.parameters``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec
from plyx.serve._params import StructuredOutput
from plyx.serve.server._errors import APIError
from plyx.serve.server._tool_parsers import ParsedCall, ToolParser, ToolStream

__all__ = ["ToolPlan", "plan_tools", "prepare_messages"]

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolPlan:
    """How one request's replies become tool calls.

    Attributes:
        mode: ``auto`` (parser), ``required`` (constrained array), ``named`` (constrained arguments).
        tools: the request's tools, as the chat template receives them.
        structured: the grammar constraint of ``required`` / ``named``, else None.
        function: the named function (``named``).
        parallel: whether several calls may be returned.
        parser: the tool-call parser (``auto``).
    """

    def __init__(self, mode: str, tools: list[dict[str, Any]], *, structured: StructuredOutput | None = None,
                 function: str | None = None, parallel: bool = True, parser: ToolParser | None = None) -> None:
        self.mode = mode
        self.tools = tools
        self.structured = structured
        self.function = function
        self.parallel = parallel
        self.parser = parser

    def stream(self) -> ChoiceTools:
        return ChoiceTools(self)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChoiceTools:
    """One choice's reply split into content and tool calls (streamed or whole: the same split)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.parsed = ToolStream(plan.parser) if plan.mode == "auto" and plan.parser is not None else None
        self.named_started = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, tool-call deltas) to stream now for ``text``."""
        self.text += text
        if self.parsed is not None:
            return self.parsed.feed(text), []
        if self.plan.mode == "named":  # the arguments stream as they are generated
            deltas = []
            if not self.named_started and text:
                self.named_started = True
                deltas.append({"index": 0, "id": new_call_id(), "type": "function",
                               "function": {"name": self.plan.function, "arguments": ""}})
            if text:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return "", deltas
        return "", []  # required: the array is parsed when it is complete

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content still to stream, tool-call deltas still to stream) at the end of the choice."""
        if self.parsed is not None:
            rest, calls = self.parsed.finish()
            return rest, [_call_entry(i, c) for i, c in enumerate(self._limit(calls))]
        if self.plan.mode == "named":
            if not self.named_started:  # an empty reply (max_tokens too small): still one call, empty arguments
                self.named_started = True
                return "", [{"index": 0, "id": new_call_id(), "type": "function",
                             "function": {"name": self.plan.function, "arguments": ""}}]
            return "", []
        return "", [_call_entry(i, c) for i, c in enumerate(self._required_calls())]

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of the whole reply."""
        if self.parsed is not None:
            content, calls = self.parsed.result()
            return content, [_call_entry(i, c, indexed=False) for i, c in enumerate(self._limit(calls))]
        if self.plan.mode == "named":
            return None, [_call_entry(0, ParsedCall(self.plan.function or "", self.text), indexed=False)]
        return None, [_call_entry(i, c, indexed=False) for i, c in enumerate(self._required_calls())]

    def _limit(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls if self.plan.parallel else calls[:1]

    def _required_calls(self) -> list[ParsedCall]:
        try:
            items = json.loads(self.text)
        except json.JSONDecodeError:  # cut by max_tokens: no complete call to return
            return []
        return [ParsedCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False)) for it in items
                if isinstance(it, dict) and isinstance(it.get("name"), str) and isinstance(it.get("parameters"), dict)]


def _call_entry(i: int, call: ParsedCall, *, indexed: bool = True) -> dict[str, Any]:
    entry = {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return {"index": i, **entry} if indexed else entry


def _check_parameters(schema: Any, where: str) -> None:
    """The tool's parameters schema is a valid JSON Schema that xgrammar compiles (else a 400 naming it)."""
    from plyx.serve._structured import _check_schema, _json_schema_grammar, xgrammar
    from plyx.specs.errors import ConfigError

    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON Schema object (got {type(schema).__name__})", param=where,
                       code="invalid_value")
    try:
        xgrammar()
        _check_schema(schema, where)
        _json_schema_grammar(json.dumps(schema), False)
    except ConfigError as exc:
        raise APIError(400, f"{where}: {exc.problem}; {exc.fix}" if exc.fix else f"{where}: {exc.problem}",
                       param=where, code="invalid_value") from None
    except (RuntimeError, ValueError) as exc:  # xgrammar: "[time] file.cc:line: message"
        detail = str(exc).strip().splitlines()[0].split("] ", 1)[-1]
        raise APIError(400, f"{where} does not compile to a grammar: {detail}; fix the schema (xgrammar's JSON "
                       "Schema dialect: $ref must point inside the schema, ...)", param=where,
                       code="invalid_value") from None


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
               parser: ToolParser | None) -> ToolPlan | None:
    """The ``ToolPlan`` of a request, or None when it has no tools or ``tool_choice`` is ``none``.

    Raises:
        APIError: 400 for a tool_choice naming no tool, a bad schema, tool_choice without tools.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: pass `tools` or leave tool_choice out", param="tool_choice",
                           code="invalid_value")
        return None
    specs = [msgspec.to_builtins(t) for t in tools]
    names: list[str] = []
    for i, t in enumerate(specs):
        fn = t["function"]
        if fn["name"] in names:
            raise APIError(400, f"tools[{i}].function.name {fn['name']!r} is used twice; give each tool its own name",
                           param=f"tools[{i}].function.name", code="invalid_value")
        names.append(fn["name"])
        if fn.get("parameters") is None:
            fn["parameters"] = dict(_EMPTY_PARAMETERS)
        _check_parameters(fn["parameters"], f"tools[{i}].function.parameters")
    allow_parallel = True if parallel is None else parallel
    if tool_choice is None or tool_choice == "auto":
        if parser is None:
            raise APIError(400, "this server has no tool-call parser for tool_choice=auto; start it with "
                           "--tool-call-parser hermes|llama3_json|mistral, or pass tool_choice='required' or a "
                           "named function", param="tool_choice", code="invalid_value")
        return ToolPlan("auto", specs, parallel=allow_parallel, parser=parser)
    if tool_choice == "none":
        return ToolPlan("none", specs)
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                   "parameters": t["function"]["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in specs]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not allow_parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", specs, structured=StructuredOutput(json_schema=schema), parallel=allow_parallel)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           '{"type": "function", "function": {"name": "..."}}', param="tool_choice",
                           code="invalid_value")
        if name not in names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                           f"({', '.join(names)}); name one of them", param="tool_choice", code="invalid_value")
        params = specs[names.index(name)]["function"]["parameters"]
        return ToolPlan("named", specs, structured=StructuredOutput(json_schema=params), function=name,
                        parallel=False)
    raise APIError(400, f"tool_choice must be 'none', 'auto', 'required' or a named function (got {tool_choice!r})",
                   param="tool_choice", code="invalid_value")


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: an assistant's ``tool_calls[].function.arguments`` as an
    object (OpenAI sends JSON text; templates ``tojson`` it), ``role: tool`` replies kept with their id.

    Raises:
        APIError: 400 for arguments that are not JSON, a tool message without ``tool_call_id``.
    """
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise APIError(400, f"messages[{i}] (role tool) needs tool_call_id: the id of the call it answers",
                           param=f"messages[{i}].tool_call_id", code="invalid_value")
        if calls:
            if not isinstance(calls, list):
                raise APIError(400, f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
            fixed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(400, f"messages[{i}].tool_calls[{j}] needs function.name",
                                   param=f"messages[{i}].tool_calls")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except json.JSONDecodeError:
                        raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON "
                                       "text; send the arguments the call returned", param=f"messages[{i}].tool_calls",
                                       code="invalid_value") from None
                fixed.append({**c, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
