"""What a new user runs into first: bodies that are not UTF-8, token ids and seeds out of range, errors on a
keep-alive connection, ``GET /v1/models/{id}``, JSON mode, the context limit, error counts in /metrics and
``{% generation %}`` in chat templates."""

from __future__ import annotations

import http.client
import json

import httpx
import openai
import pytest
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin

CONTEXT = 64  # max_model_len of the small-context server below


@pytest.fixture(scope="module")
def small(server_lm, bpe, serving):
    """A server with a 64-token context and its own metrics."""
    app = serving.make_app(server_lm, bpe, engine_kw={"max_model_len": CONTEXT}, model_aliases=("step-000030",))
    with serving.serve(app) as running:
        yield running


class Crash:
    """An input rail that fails on a marker: an exception no handler expected (a 500)."""

    @hookimpl
    def plyx_on_request_received(self, request, context):
        if "kaboom" in request["prompt_text"]:
            raise RuntimeError("the rail broke")
        return None


@pytest.fixture
def crash():
    register_plugin(Crash(), "test-crash")
    yield
    unregister_plugin("test-crash")


def post(running, body: bytes, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(running.base_url + path, content=body, timeout=60,
                      headers={**running.headers, "content-type": "application/json"})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_that_is_not_utf8_is_400(server, path):
    body = (b'{"model": "tiny", "prompt": "hi \xff\xfe there"}' if path != "/v1/chat/completions" else
            b'{"model": "tiny", "messages": [{"role": "user", "content": "caf\xc3"}]}')
    r = post(server, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "UTF-8" in err["message"] and "offset" in err["message"]


@pytest.mark.parametrize("ids", [[-1, 5], [5, 10**6], [2**70], [-(2**70)]])
def test_prompt_token_ids_outside_the_vocabulary_are_400(server, ids):
    r = post(server, json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 2}).encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and f"[0, {server.engine.vocab_size})" in err["message"]
    r = post(server, json.dumps({"model": "tiny", "prompt": [ids, [5, 6]], "max_tokens": 2}).encode())
    assert r.status_code == 400 and "prompt[0]" in r.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [("logit_bias", {"-1": 5}), ("logit_bias", {"100000": 5}),
                                         ("stop_token_ids", [10**6])])
def test_token_ids_of_sampling_fields_are_checked(server, field, value):
    r = post(server, json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, field: value}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_seed_is_an_int64(server):
    for seed in (2**64, 2**63, 2**70, -1):
        r = post(server, json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2, "seed": seed}).encode())
        assert r.status_code == 400, (seed, r.text)
        assert r.json()["error"]["param"] == "seed" and "2^63" in r.json()["error"]["message"]
    # the largest seed works, also for n > 1 (completion i seeds with seed + i)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "seed": 2**63 - 1, "n": 2, "temperature": 1.0}
    a, b = post(server, json.dumps(body).encode()), post(server, json.dumps(body).encode())
    assert a.status_code == 200, a.text
    assert [c["text"] for c in a.json()["choices"]] == [c["text"] for c in b.json()["choices"]]


def test_errors_leave_the_keep_alive_connection_usable(small, crash):
    port = int(small.base_url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {**small.headers, "content-type": "application/json"}
    good = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2}).encode()
    bad = [
        (b'{"model": "tiny", "prompt": "\xff"}', 400),  # not UTF-8
        (b'{"model": "tiny", "prompt": [-1]}', 400),  # a token id the tokenizer cannot decode
        (b'{"model": "tiny", "prompt": "kaboom"}', 500),  # an exception nothing expected
        (b'{"model": "nope", "prompt": "x"}', 404),
        (b'{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}', 400),
    ]
    conn.request("POST", "/v1/completions", body=good, headers=headers)
    first = conn.getresponse()
    assert first.status == 200
    first.read()
    sock = conn.sock  # the one TCP connection every request below must travel on
    for body, status in bad:
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        r = conn.getresponse()
        payload = json.loads(r.read())
        assert r.status == status and payload["error"]["message"], payload
        assert (r.getheader("connection") or "").lower() != "close"
        conn.request("POST", "/v1/completions", body=good, headers=headers)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["choices"]
        assert conn.sock is sock, f"the connection was dropped after the {status}"
    conn.close()


def test_models_retrieve_and_no_server_paths(model_dir, server_lm, bpe, serving):
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.server import ServerSettings, create_app

    engine = Engine(server_lm, tokenizer=bpe, config=EngineConfig(max_batch_size=4, block_size=4, num_blocks=64,
                                                                  max_model_len=128))
    settings = ServerSettings(model_name="org/tiny", model_aliases=("step-000030",))
    app = create_app(engine, settings=settings, model_dir=str(model_dir))
    with serving.serve(app) as running:
        client = openai.OpenAI(base_url=running.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        listing = httpx.get(running.base_url + "/v1/models").text
        assert str(model_dir) not in listing and str(model_dir.parent) not in listing
        for card in client.models.list().data:
            got = client.models.retrieve(card.id)  # a slash in the id is part of the id
            assert got.id == card.id and got.model_dump() == card.model_dump()
        assert client.models.retrieve("step-000030").parent == "org/tiny"
        assert client.models.retrieve("org/tiny").max_model_len == 128
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("gpt-nope")
        assert e.value.code == "model_not_found" and "org/tiny" in e.value.message


def _token(bpe, text):
    ids = bpe.encode(text, add_special_tokens=False).ids
    assert len(ids) == 1
    return ids[0]


def test_json_mode_answers_an_object(server, bpe):
    """Biased towards `[` (then `]` and `}`): JSON mode must still open an object (the builtin any-JSON grammar
    let `[]` through), and the same biases under an array schema show what they pick when allowed."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)
    bias = {str(_token(bpe, "[")): 60, str(_token(bpe, "]")): 100, str(_token(bpe, "}")): 100}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "answer in JSON"}], max_tokens=12,
              temperature=0, logit_bias=bias)
    r = client.chat.completions.create(response_format={"type": "json_object"}, **kw)
    assert json.loads(r.choices[0].message.content) == {} and r.choices[0].finish_reason == "stop"
    arr = client.chat.completions.create(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "array"}}}, **kw)
    assert json.loads(arr.choices[0].message.content) == []
    # completions too, unbiased and sampled: always an object
    for seed in range(2):
        c = client.completions.create(model="tiny", prompt="{", max_tokens=24, temperature=1.0, seed=seed,
                                      extra_body={"response_format": {"type": "json_object"}})
        text = c.choices[0].text
        assert text.lstrip().startswith("{"), text
        if c.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_the_context_limit_holds_exactly(small):
    for n in (CONTEXT - 1, CONTEXT - 5, 10):  # max_tokens omitted (or null): the context bounds the completion
        body = {"model": "tiny", "prompt": [5] * n, "ignore_eos": True} | ({"max_tokens": None} if n == 10 else {})
        r = post(small, json.dumps(body).encode())
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["total_tokens"] <= CONTEXT
        assert usage["completion_tokens"] == min(16, CONTEXT - n)  # completions default to 16 tokens
    for n in (CONTEXT, CONTEXT + 1):
        r = post(small, json.dumps({"model": "tiny", "prompt": [5] * n}).encode())
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
        assert str(CONTEXT) in err["message"] and str(n) in err["message"]
    # chat: the default completion is the rest of the context
    r = post(small, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello world"}],
                                "ignore_eos": True}).encode(), "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == CONTEXT, r.text
    r = post(small, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi " * 60}]}).encode(),
             "/v1/chat/completions")
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"]
    r = post(small, json.dumps({"model": "tiny", "prompt": [5] * 30, "max_tokens": 40}).encode())
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and "70" in err["message"]


def _requests_total(running) -> dict[tuple[str, str, str], float]:
    out = {}
    for line in httpx.get(running.base_url + "/metrics").text.splitlines():
        if line.startswith("plyx_requests_total{"):
            labels, value = line[len("plyx_requests_total{"):].rsplit("} ", 1)
            d = dict(kv.split("=", 1) for kv in labels.split(","))
            key = (d["route"].strip('"'), d["status"].strip('"'), d["finish_reason"].strip('"'))
            out[key] = float(value)
    return out


def test_errors_are_counted_by_status_and_route(small, crash):
    before = _requests_total(small)
    sent = [
        (b'{"model": "tiny", "prompt": [-1]}', "/v1/completions", 400),
        (b'{"model": "tiny", "prompt": "\xff"}', "/v1/completions", 400),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', "/v1/chat/completions", 404),
        (b'{"model": "tiny", "prompt": "kaboom"}', "/v1/completions", 500),
        (b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}', "/v1/completions", 200),
    ]
    for body, path, status in sent:
        assert post(small, body, path).status_code == status
    assert httpx.get(small.base_url + "/v1/models/nope", headers=small.headers).status_code == 404
    assert httpx.get(small.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    after = _requests_total(small)
    grew = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert grew == {
        ("/v1/completions", "400", "error"): 2,
        ("/v1/chat/completions", "404", "error"): 1,
        ("/v1/completions", "500", "error"): 1,
        ("/v1/completions", "200", "length"): 1,
        ("/v1/models/{model:path}", "404", "error"): 1,
        ("/v1/models", "401", "error"): 1,
    }


def test_generation_blocks_render_as_transformers_renders_them():
    """``{% generation %}`` (transformers' assistant-mask tag) and ``{% break %}`` render as transformers'
    apply_chat_template renders them."""
    from plyx.serve.server import ChatTemplate
    from transformers.utils.chat_template_utils import _compile_jinja_template

    source = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{% set tag = 'A' %}"
        "<{{ tag }}>{{ m['content'] }}</{{ tag }}>{% endgeneration %}{% else %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
        "{{ tag | default('unset') }}{% if add_generation_prompt %}<A>{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}, {"role": "assistant", "content": "never rendered"}]
    want = _compile_jinja_template(source).render(messages=messages, add_generation_prompt=True)
    got = ChatTemplate(source).render(messages, add_generation_prompt=True)
    assert got == want == "user: hi\n<A>hello</A>user: again\nunset<A>"


def test_a_requests_chat_template_is_never_a_server_file(server, tmp_path):
    secret = tmp_path / "secret.jinja"
    secret.write_text("SECRET {{ messages }}")
    for template, status in ((str(secret), 400), ("{% for %}", 400), ("{{ messages[0]['content'] }}!", 200)):
        r = post(server, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                     "chat_template": template, "max_tokens": 1}).encode(), "/v1/chat/completions")
        assert r.status_code == status, r.text
        if status == 400:
            assert r.json()["error"]["param"] == "chat_template" and "SECRET" not in r.text
    r = post(server, json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                 "chat_template": "{{ x"}).encode(), "/v1/chat/completions")
    assert r.status_code == 400 and "not valid Jinja" in r.json()["error"]["message"]
