"""The official ``openai`` client against the server on 127.0.0.1: completions, chat, streaming, errors."""

from __future__ import annotations

import json

import openai
import pytest

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)





def chat_ids(bpe, messages):
    from plyx.serve.server import BUILTIN_TEMPLATES, ChatTemplate

    text = ChatTemplate(BUILTIN_TEMPLATES["chatml"]).render(messages)
    return bpe.encode(text, add_special_tokens=False).ids


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_equals_the_greedy_reference(client, server_lm, bpe, greedy_reference):
    prompt = "hello world, the quick"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0)
    want = greedy_reference(server_lm, bpe, bpe.encode(prompt).ids, 12)
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(bpe.encode(prompt).ids)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"


def test_chat_and_its_stream_agree(client, server_lm, bpe, greedy_reference):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "hello world"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    want = greedy_reference(server_lm, bpe, chat_ids(bpe, messages), 16)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [want.finish_reason]
    assert chunks[-1].usage.completion_tokens == len(want.token_ids) and not chunks[-1].choices


def test_streamed_completion_with_n_logprobs_and_stop(client, server_lm, bpe, greedy_reference):
    prompt = "the quick brown fox"
    full = greedy_reference(server_lm, bpe, bpe.encode(prompt).ids, 20, ignore_eos=True)
    stop = full.text[4:7]
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=20, temperature=0, stop=[stop],
                                       stream=True, n=2, logprobs=2, extra_body={"ignore_eos": True})
    texts, finish, lps = {0: "", 1: ""}, {}, {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs:
                lps[c.index] += c.logprobs.token_logprobs
                assert all(1 <= len(t) <= 2 for t in c.logprobs.top_logprobs)  # equal strings merge
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    want = full.text[: full.text.find(stop)]
    assert texts == {0: want, 1: want} and finish == {0: "stop", 1: "stop"}
    assert all(v <= 0 for v in lps[0]) and len(lps[0]) >= 1


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL_NAME, prompt="hello", max_tokens=12, temperature=1.0, seed=1234)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "yes or no?"}], max_tokens=40, temperature=0.7,
        seed=1, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    assert json.loads(r.choices[0].message.content)["answer"] in ("yes", "no")
    assert r.choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nope", prompt="hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-3)
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi " * 600, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=600)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", extra_body={"frobnicate": 1})
    assert "frobnicate" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "wizard", "content": "x"}])
    assert "role" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", top_p=1.5)
    assert e.value.param == "top_p"
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # the engine is untouched by all of it
    assert not server.engine.has_unfinished()
    assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices
