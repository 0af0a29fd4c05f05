"""Random request bodies never make the server answer 500.

The bodies are drawn from the JSON Schema of the request types the server decodes
(``msgspec.json.schema`` of ``CompletionRequest`` / ``ChatCompletionRequest``): each
field gets a value of its type, a value of another type, an extreme number or odd
unicode; required fields go missing and unknown ones appear now and then. A small
model with a 64-token context keeps every generation short.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

CONTEXT = 64

#: numbers at the edges: int64 and uint64 bounds, past them, floats that overflow a C double or a float32
EXTREME_INTS = [0, 1, -1, 2, 15, 16, 17, 63, 64, 65, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63),
                -(2**63) - 1, 10**30]
EXTREME_FLOATS = [0.0, -0.0, 1e-320, 1e-45, 0.5, 1.0, 2.0, 2.0000001, -1.0, 1e30, 1e308, -1e308, 3.4e38]
ODD_TEXT = ["", " ", "chatml", "hermes", "{{ messages }}", "{% for m in messages %}{{ m.content }}{% endfor %}",
            "{{", "{% generation %}", "{% raise_exception('x') %}", "\x00", "\u200b\u202e", "\U0001f600" * 3,
            "a\nb\r\n", "<|im_start|>", "<|endoftext|>", "/etc/passwd", "..", "null", "é" * 20, "\ufffd",
            "user", "assistant", "tool", "function", "json_object", "json_schema", "auto", "required", "none"]


def _strings() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD_TEXT), st.text(max_size=24))


def _junk() -> st.SearchStrategy[Any]:
    """Any JSON value (the wrong type for most fields)."""
    scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EXTREME_INTS), st.sampled_from(EXTREME_FLOATS),
                        _strings())
    return st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(_strings(), inner, max_size=3)),
                        max_leaves=6)


def _message(wild: bool) -> st.SearchStrategy[Any]:
    if not wild:
        return st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                      "content": _strings()})
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": _strings()})
    content = st.one_of(_strings(), st.lists(part, max_size=2), st.none(), _junk())
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard"])
    extra = st.dictionaries(st.sampled_from(["tool_calls", "name", "tool_call_id"]), _junk(), max_size=1)
    return st.one_of(st.builds(lambda r, c, e: {"role": r, "content": c, **e}, role, content, extra), _junk())


class _FromSchema:
    """Hypothesis strategies of the values a JSON Schema describes (the subset msgspec writes).

    ``wild``: any field may be junk, required ones go missing, unknown ones appear; else (valid-ish) each
    optional field shows up now and then with a value of its type, extreme numbers included, so that many
    bodies get as far as the engine."""

    def __init__(self, schema: dict[str, Any], wild: bool) -> None:
        self.defs = schema.get("$defs", {})
        self.wild = wild

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = self.defs[node["$ref"].rsplit("/", 1)[1]]
        return node

    def value(self, node: dict[str, Any], name: str = "") -> st.SearchStrategy[Any]:
        node = self.resolve(node)
        if name == "messages":
            return st.lists(_message(self.wild), min_size=0 if self.wild else 1, max_size=3)
        if "anyOf" in node:
            return st.one_of([self.value(n, name) for n in node["anyOf"]])
        if "enum" in node:
            return st.sampled_from(node["enum"])
        kind = node.get("type")
        if kind == "string":
            return _strings()
        if kind == "integer":
            small = st.integers(-3, 40) if self.wild else st.integers(0, 6)
            return st.one_of(small, small, st.sampled_from(EXTREME_INTS))
        if kind == "number":
            small = st.floats(-3, 3) if self.wild else st.floats(0, 1.5)
            return st.one_of(small, small, st.sampled_from(EXTREME_FLOATS), st.sampled_from(EXTREME_INTS))
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        if kind == "array":
            return st.lists(self.value(node.get("items", {}), name), max_size=3)
        if kind == "object":
            if "properties" in node:
                return self.obj(node)
            values = node.get("additionalProperties")
            inner = self.value(values, name) if isinstance(values, dict) else _junk()
            keys = st.one_of(_strings(), st.sampled_from(["0", "5", "-1", "99999", "1e3"]))
            return st.dictionaries(keys, inner, max_size=3)
        return _junk()

    def obj(self, node: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
        """Each field: left out, of its type (most often), or junk; required ones now and then missing."""
        node = self.resolve(node)
        required = set(node.get("required", ()))
        fields = {}
        for name, sub in node.get("properties", {}).items():
            typed = self.value(sub, name)
            if name == "model":
                typed = st.sampled_from(["tiny", "tiny", "tiny", "other"]) if self.wild else st.just("tiny")
            if name == "prompt" and not self.wild:
                typed = st.one_of(_strings(), st.lists(st.integers(0, 40), min_size=1, max_size=8),
                                  st.lists(_strings(), min_size=1, max_size=2))
            choice = st.one_of(typed, typed, typed, _junk()) if self.wild else typed
            if name in required:
                present = st.sampled_from([True] * 9 + [False]) if self.wild else st.just(True)
            else:
                present = st.booleans() if self.wild else st.sampled_from([True] + [False] * 5)
            fields[name] = st.tuples(present, choice)

        def assemble(picked: dict[str, tuple[bool, Any]], unknown: dict[str, Any]) -> dict[str, Any]:
            return {**{k: v for k, (keep, v) in picked.items() if keep}, **unknown}

        unknown = st.dictionaries(st.sampled_from(["frobnicate", "functions", "logprobs_extra"]), _junk(),
                                  max_size=1)
        extra = st.one_of(st.just({}), st.just({}), unknown) if self.wild else st.just({})
        return st.builds(assemble, st.fixed_dictionaries(fields), extra)


def _bodies(kind: type) -> st.SearchStrategy[dict[str, Any]]:
    schema = msgspec.json.schema(kind)
    return st.one_of(_FromSchema(schema, wild=False).obj(schema), _FromSchema(schema, wild=True).obj(schema))


@pytest.fixture(scope="module")
def fuzz_server(server_lm, bpe, serving):
    app = serving.make_app(server_lm, bpe, api_key="", engine_kw={"max_model_len": CONTEXT})
    with serving.serve(app) as running, httpx.Client(base_url=running.base_url, timeout=60) as client:
        yield running, client


def _check(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    text = r.text
    assert r.status_code < 500, f"{r.status_code} for {raw[:400]!r}: {text[:400]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"], text
    else:  # streamed or whole: no error event inside
        assert "internal_error" not in text and "engine_error" not in text, f"{raw[:400]!r}: {text[-400:]}"


_SETTINGS = settings(max_examples=100, deadline=None, database=None, derandomize=True,
                     suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                            HealthCheck.data_too_large, HealthCheck.filter_too_much])


def test_completions_bodies_never_500(fuzz_server):
    from plyx.serve.server._protocol import CompletionRequest

    _, client = fuzz_server

    @_SETTINGS
    @given(_bodies(CompletionRequest))
    # what earlier runs found: int64 overflow in the engine's tensors, a body that is not UTF-8
    @example({"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_k": 2**63})
    @example({"model": "tiny", "prompt": [3, 2**64], "min_tokens": -(2**63) - 1})
    @example({"model": "tiny", "prompt": "\udcff", "max_tokens": 2})
    def run(body: dict[str, Any]) -> None:
        _check(client, "/v1/completions", body)

    run()


def test_chat_bodies_never_500(fuzz_server):
    from plyx.serve.server._protocol import ChatCompletionRequest

    _, client = fuzz_server

    @_SETTINGS
    @given(_bodies(ChatCompletionRequest))
    # what earlier runs found: a request's chat template that is not Jinja, one that names a server file
    @example({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "chat_template": "{% raise_exception('x') %}"})
    @example({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "chat_template": "/etc/hostname"})
    def run(body: dict[str, Any]) -> None:
        _check(client, "/v1/chat/completions", body)

    run()
