"""Tool calling through the official ``openai`` client: named / required choices constrained to the schema,
``auto`` parsed by the server's parser, streamed deltas assembled equal to the whole reply, a multi-turn tool
loop (role tool round-trips through the template), and bad input answered with a 400 naming it."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

MODEL = "tiny"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 23}},
                                        "required": ["hour"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "hello world, the weather?"}]


@pytest.fixture(scope="module")
def tool_lm(bpe):
    """The server tests' model with a context that holds the tool descriptions (~850 tokens of this tiny BPE)."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    return TransformerLM(ModelConfig(vocab_size=-(-bpe.get_vocab_size() // 16) * 16, d_model=64, n_layers=2, n_heads=4,
                                     n_kv_heads=2, d_ff=128, max_seq_len=1024, init_std=0.5)).eval()


def _app(server_lm, bpe, parser):
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.server import ServerSettings, create_app

    engine = Engine(server_lm, tokenizer=bpe, config=EngineConfig(max_batch_size=8, max_batch_tokens=512,
                                                                  block_size=16, num_blocks=256))
    return create_app(engine, settings=ServerSettings(model_name=MODEL, tool_parser=parser), chat_template="hermes")


@pytest.fixture(scope="module")
def client(tool_lm, bpe, serving):
    torch.set_num_threads(1)
    with serving.serve(_app(tool_lm, bpe, "hermes")) as running:
        yield openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def greedy(model, tok, prompt_ids, max_tokens):
    """The request run alone on a fresh engine: the expected greedy answer."""
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    engine = Engine(model, tokenizer=tok, config=EngineConfig(max_batch_size=1, max_batch_tokens=1024, block_size=16,
                                                              num_blocks=128, prefix_caching=False))
    return engine.generate([prompt_ids], SamplingParams(temperature=0, max_new_tokens=max_tokens))[0].outputs[0]


def _assemble(chunks):
    """What a client rebuilds from the stream: content, calls (by index) and the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content or None, [calls[i] for i in sorted(calls)], finish


def _whole(r):
    m = r.choices[0].message
    return m.content, [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                       for c in m.tool_calls or ()], r.choices[0].finish_reason


def _same(whole, streamed):
    (wc, wcalls, wf), (sc, scalls, sf) = whole, streamed
    assert wc == sc and wf == sf
    assert [(c["name"], c["arguments"]) for c in wcalls] == [(c["name"], c["arguments"]) for c in scalls]
    assert all(c["id"].startswith("call_") for c in wcalls + scalls)


def _ask(client, stream=False, **kw):
    kw = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": 120, "temperature": 0, **kw}
    if stream:
        return _assemble(client.chat.completions.create(stream=True, **kw))
    return _whole(client.chat.completions.create(**kw))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_constrained_calls_validate_and_stream_equal(client, choice):
    whole = _ask(client, tool_choice=choice, parallel_tool_calls=False)
    content, calls, finish = whole
    assert content is None and len(calls) == 1
    name = calls[0]["name"]
    assert name in SCHEMAS if choice == "required" else name == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS[name])
    assert finish == ("tool_calls" if choice == "required" else "stop")  # a named function keeps "stop" (OpenAI)
    _same(whole, _ask(client, stream=True, tool_choice=choice, parallel_tool_calls=False))


def test_sampled_required_calls_always_validate(client):
    for seed in range(3):
        _, calls, _ = _ask(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=170,
                             parallel_tool_calls=False)
        assert calls, "a complete call within max_tokens"
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_auto_without_a_call_is_the_plain_reply(client, tool_lm, bpe):
    from plyx.serve.server import BUILTIN_TEMPLATES, ChatTemplate

    whole = _ask(client, tool_choice="auto", max_tokens=16)
    prompt = ChatTemplate(BUILTIN_TEMPLATES["hermes"]).render(USER, tools=TOOLS)
    want = greedy(tool_lm, bpe, bpe.encode(prompt, add_special_tokens=False).ids, 16)
    assert whole == (want.text, [], want.finish_reason)
    _same(whole, _ask(client, stream=True, max_tokens=16))  # tool_choice defaults to auto with tools


def test_tool_loop_round_trips(client, tool_lm, bpe):
    from plyx.serve.server import BUILTIN_TEMPLATES, ChatTemplate

    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    messages = USER + [first.choices[0].message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0,
                                            max_tokens=12)
    # the server rendered the call (arguments as an object) and the tool's answer through the template
    rendered = ChatTemplate(BUILTIN_TEMPLATES["hermes"]).render(
        USER + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": json.loads(call.function.arguments)}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}], tools=TOOLS)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    assert f'"arguments": {json.dumps(json.loads(call.function.arguments))}' in rendered
    ids = bpe.encode(rendered, add_special_tokens=False).ids
    assert second.usage.prompt_tokens == len(ids)
    want = greedy(tool_lm, bpe, ids, 12)
    assert second.choices[0].message.content == want.text


def test_auto_parses_a_call_the_model_wrote(tool_lm, bpe, serving):
    """``auto`` through the llama3_json parser: the reply is made a JSON call by response_format, so the parser
    (not a grammar of tool_choice) turns it into tool_calls, streamed and whole alike."""
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"},
                                                    "parameters": SCHEMAS["get_weather"]},
                   "required": ["name", "parameters"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "call", "schema": call_schema}}
    with serving.serve(_app(tool_lm, bpe, "llama3_json")) as running:
        c = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        whole = _ask(c, tool_choice="auto", response_format=fmt, max_tokens=80)
        _, calls, finish = whole
        assert [x["name"] for x in calls] == ["get_weather"] and finish == "tool_calls"
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])
        _same(whole, _ask(c, stream=True, tool_choice="auto", response_format=fmt, max_tokens=80))


def test_bad_tool_requests_name_the_problem(client):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, tool_choice={"type": "function", "function": {"name": "get_wether"}})
    assert e.value.param == "tool_choice" and "get_wether" in e.value.message and "get_weather" in e.value.message
    bad_type = [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, tools=bad_type, tool_choice="required")
    assert e.value.param == "tools[0].function.parameters" and "invalid JSON Schema" in e.value.message
    dangling = [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, tools=dangling)
    assert e.value.param == "tools[1].function.parameters"
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, tool_choice="required", response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, messages=USER + [{"role": "tool", "content": "x"}])
    assert "tool_call_id" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, tools=None, tool_choice="required")
    assert e.value.param == "tool_choice"


def test_a_template_without_tools_is_refused(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=4)
    assert e.value.param == "tools" and "--chat-template hermes" in e.value.message
    # tool_choice none: tools need not be shown, the reply is plain content
    r = c.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=4)
    assert r.choices[0].message.tool_calls is None
