"""The serving hooks safety plugins attach to: input rails refuse, output rails filter the stream, responses are
reported."""

from __future__ import annotations

import json

import httpx
import pytest
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin


class Redact:
    """Replaces "x" by "*" in the streamed text; blocks the response once it has seen 40 characters."""

    def __init__(self):
        self.seen = 0
        self.blocked = None

    def feed(self, text):
        self.seen += len(text)
        if self.seen > 40:
            self.blocked = {"message": "too long", "rule_id": "len"}
            return ""
        return text.replace("x", "*")

    def finish(self):
        return ""


class HoldAll:
    """Holds every character back and decides at the end: blocks a reply longer than 8 characters (a rail whose
    verdict needs the whole text, as plyx-safety's hold-back window at the end of a stream)."""

    def __init__(self):
        self.held = ""
        self.blocked = None

    def feed(self, text):
        self.held += text
        return ""

    def finish(self):
        if len(self.held) > 8:
            self.blocked = {"message": "too long", "rule_id": "short"}
            return ""
        return self.held


class Rails:
    def __init__(self):
        self.responses = []
        self.contexts = []

    @hookimpl
    def plyx_on_request_received(self, request, context):
        self.contexts.append(dict(context))  # as it was when the hook ran
        if "forbidden" in request["prompt_text"]:
            return {"message": "this topic is refused", "rule_id": "topic", "status": 400}
        if "secret" in request["prompt_text"]:  # an input redaction, as plyx-safety's redact rules do
            request["prompt_text"] = request["prompt_text"].replace("secret", "hello")
        return None

    @hookimpl
    def plyx_output_filters(self, request, context):
        return [HoldAll()] if request.get("user") == "hold" else [Redact()]

    @hookimpl
    def plyx_on_response(self, request, response, context):
        self.responses.append(response)


@pytest.fixture
def rails():
    plugin = Rails()
    register_plugin(plugin, "test-rails")
    yield plugin
    unregister_plugin("test-rails")


def test_input_rail_refusal(server, rails):
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers,
                   json={"model": "tiny", "prompt": "tell me the forbidden thing", "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    # the shape of plyx-safety's refusals (and OpenAI's): the rule that fired travels as rule_id
    assert err == {"message": "this topic is refused", "type": "invalid_request_error", "param": None,
                   "code": "content_policy_violation", "rule_id": "topic"}
    assert rails.contexts[-1]["endpoint"] == "/v1/completions"
    assert rails.responses[-1]["finish_reason"] == "refused"


def test_output_rail_filters_and_blocks(server, rails, bpe, greedy_reference, server_lm):
    prompt = "hello world"
    want = greedy_reference(server_lm, bpe, bpe.encode(prompt).ids, 6, ignore_eos=True)
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    choice = r.json()["choices"][0]
    assert len(want.text) <= 40 and choice["text"] == want.text.replace("x", "*")
    long = httpx.post(server.base_url + "/v1/completions", headers=server.headers,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 200, "temperature": 0,
                            "ignore_eos": True}).json()["choices"][0]
    assert long["finish_reason"] == "content_filter" and len(long["text"]) <= 40
    assert rails.responses[-1]["status"] == 200 and rails.responses[-1]["finish_reason"] == "content_filter"


def test_input_rail_redaction_reaches_the_model(server, rails, bpe, greedy_reference, server_lm):
    """The server tokenizes the rewritten prompt_text: the model sees the redacted prompt, not the original."""
    body = {"model": "tiny", "prompt": "secret world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers, json=body).json()
    redacted = bpe.encode("hello world").ids
    want = greedy_reference(server_lm, bpe, redacted, 6, ignore_eos=True)
    assert r["choices"][0]["text"] == want.text.replace("x", "*")
    assert r["usage"]["prompt_tokens"] == len(redacted) != len(bpe.encode("secret world").ids)
    assert rails.contexts[-1]["request_id"] == r["id"]  # the hooks see the response's id


def test_redacting_one_of_several_prompts(server, rails, bpe, greedy_reference, server_lm):
    body = {"model": "tiny", "prompt": ["secret world", "hello there"], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers, json=body).json()
    texts = [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    for prompt, text in zip(["hello world", "hello there"], texts):
        assert text == greedy_reference(server_lm, bpe, bpe.encode(prompt).ids, 4, ignore_eos=True).text.replace("x", "*")


def test_a_refusal_from_plyx_safety_is_answered_as_it_says(server):
    """plyx-safety's refusal carries the OpenAI error object the server answers with: the code is safety's."""
    safety = pytest.importorskip("plyx.safety._engine")

    class SafetyShaped:
        @hookimpl
        def plyx_on_request_received(self, request, context):
            return safety.refusal("no cards", "no-cards") if "card" in request["prompt_text"] else None

    register_plugin(SafetyShaped(), "test-safety-shaped")
    try:
        r = httpx.post(server.base_url + "/v1/completions", headers=server.headers,
                       json={"model": "tiny", "prompt": "my card", "max_tokens": 4})
    finally:
        unregister_plugin("test-safety-shaped")
    assert r.status_code == 400
    assert r.json()["error"] == safety.refusal("no cards", "no-cards")["error"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_block_at_the_end_of_the_reply_is_content_filter(server, rails, bpe, greedy_reference, server_lm, stream):
    """A rail that blocks on what it held back when the reply ends (at max_tokens): finish_reason says
    content_filter, not length, and none of the held text leaves."""
    prompt = "hello world"
    want = greedy_reference(server_lm, bpe, bpe.encode(prompt).ids, 30, ignore_eos=True)
    assert len(want.text) > 8 and want.finish_reason == "length"  # the reply the rail will block
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "user": "hold", "stream": stream}
    if stream:
        with httpx.stream("POST", server.base_url + "/v1/completions", headers=server.headers, json=body,
                          timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
        assert finish == ["content_filter"]
    else:
        choice = httpx.post(server.base_url + "/v1/completions", headers=server.headers, json=body,
                            timeout=60).json()["choices"][0]
        text = choice["text"]
        assert choice["finish_reason"] == "content_filter"
    assert text == ""
    assert rails.responses[-1]["finish_reason"] == "content_filter"
    # a reply the same rail lets through keeps its own finish reason
    ok = httpx.post(server.base_url + "/v1/completions", headers=server.headers, timeout=60,
                    json={**body, "stream": False, "max_tokens": 1}).json()["choices"][0]
    assert 0 < len(ok["text"]) <= 8 and ok["finish_reason"] == "length"


class Counting:
    """Counts each serving hook per request id (the response's id): nothing more."""

    def __init__(self):
        import collections

        self.calls = collections.Counter()

    @hookimpl
    def plyx_on_request_received(self, request, context):
        self.calls["received", context["request_id"]] += 1

    @hookimpl
    def plyx_output_filters(self, request, context):
        self.calls["filters", context["request_id"]] += 1
        return []

    @hookimpl
    def plyx_on_response(self, request, response, context):
        self.calls["response", context["request_id"]] += 1


@pytest.mark.parametrize("stream", [False, True])
def test_the_hooks_run_once_per_api_call_at_the_engine_boundary(server, stream):
    """The server hands its guard to the engine and calls no hook itself: one input check and one response
    report per API call (two prompts, n=2), one set of output rails per choice; no double application."""
    counting = Counting()
    register_plugin(counting, "test-counting-rails")
    try:
        body = {"model": "tiny", "prompt": ["hello world", "hello there"], "n": 2, "max_tokens": 3,
                "temperature": 0.7, "seed": 1, "ignore_eos": True, "stream": stream}
        if stream:
            with httpx.stream("POST", server.base_url + "/v1/completions", headers=server.headers, json=body,
                              timeout=60) as r:
                ids = {json.loads(line[6:])["id"] for line in r.iter_lines() if line.startswith("data: {")}
            (rid,) = ids
        else:
            rid = httpx.post(server.base_url + "/v1/completions", headers=server.headers, json=body,
                             timeout=60).json()["id"]
    finally:
        unregister_plugin("test-counting-rails")
    assert counting.calls == {("received", rid): 1, ("filters", rid): 4, ("response", rid): 1}
