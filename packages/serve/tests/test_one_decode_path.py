"""One decode path: ``generate`` is a client of the engine, and the guardrails run at the engine boundary."""

from __future__ import annotations

import collections

import pytest
import torch
from plyx.serve import SamplingParams, generate, stream_generate
from plyx.serve.engine import EngineConfig, RequestRefused
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin


class Star:
    """An output rail: "o" becomes "*"; blocks once it has let out more than ``limit`` characters."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.seen = 0
        self.blocked = None

    def feed(self, text):
        self.seen += len(text)
        if self.seen > self.limit:
            self.blocked = {"message": "too long", "rule_id": "len"}
            return ""
        return text.replace("o", "*")

    def finish(self):
        return ""


class Rails:
    """Refuses prompts with "forbidden", rewrites "secret" to "hello", stars the output; counts every call."""

    def __init__(self, limit: int = 1000) -> None:
        self.limit = limit
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()  # (hook, request id)
        self.responses = []

    @hookimpl
    def plyx_on_request_received(self, request, context):
        self.calls["received", context["request_id"]] += 1
        text = request.get("prompt_text") or ""
        if "forbidden" in text:
            return {"message": "this topic is refused", "rule_id": "topic", "status": 400}
        if "secret" in text:
            request["prompt_text"] = text.replace("secret", "hello")
        return None

    @hookimpl
    def plyx_output_filters(self, request, context):
        self.calls["filters", context["request_id"]] += 1
        return [Star(self.limit)]

    @hookimpl
    def plyx_on_response(self, request, response, context):
        self.calls["response", context["request_id"]] += 1
        self.responses.append(response)


@pytest.fixture
def rails():
    plugin = Rails()
    register_plugin(plugin, "test-engine-rails")
    yield plugin
    unregister_plugin("test-engine-rails")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kw)


def _unguarded(model, prompts, params, tokenizer=None):
    """The model's own answer: an engine with the guardrails off."""
    return generate(model, prompts, params, tokenizer=tokenizer, engine_config=EngineConfig(guardrails=False))


def test_a_guardrail_refuses_a_prompt_given_to_generate(tok_model, tokenizer, counting, rails):
    wrapped = counting(tok_model)
    with pytest.raises(RequestRefused) as info:
        generate(wrapped, ["hello world", "tell me the forbidden thing"], _greedy(4), tokenizer=tokenizer)
    assert info.value.rule_id == "topic" and info.value.status == 400 and "refused" in str(info.value)
    assert wrapped.calls == 0  # refused before anything ran, the other prompt included
    refused = [r for r in rails.responses if r["finish_reason"] == "refused"]
    assert len(refused) == 1 and refused[0]["status"] == 400
    # the prompt let through was aborted, and reported once as such
    assert [r["status"] for r in rails.responses if r["finish_reason"] != "refused"] == [499]


def test_input_rewrite_and_output_rails_apply_to_generate(tok_model, tokenizer, rails):
    want = _unguarded(tok_model, ["hello world"], _greedy(12), tokenizer)[0].outputs[0]
    assert "o" in want.text and "*" not in want.text  # the rail has something to change; it did not run here
    assert not rails.calls  # guardrails off: no hook ran
    got = generate(tok_model, ["secret world"], _greedy(12), tokenizer=tokenizer)[0]
    # the model saw the rewritten prompt: same tokens as the unguarded run of it; the text went through the rail
    assert got.prompt_token_ids == tuple(tokenizer.encode("hello world").ids)
    assert got.outputs[0].token_ids == want.token_ids
    assert got.outputs[0].text == want.text.replace("o", "*")
    # streamed deltas are the filtered text too
    stream = stream_generate(tok_model, ["hello world"], _greedy(12), tokenizer=tokenizer)
    assert "".join(e.text for e in stream) == want.text.replace("o", "*")
    assert stream.outputs()[0].outputs[0].text == want.text.replace("o", "*")


def test_an_output_rail_that_blocks_ends_the_completion(tok_model, tokenizer, rails):
    full = _unguarded(tok_model, ["hello world"], _greedy(40), tokenizer)[0].outputs[0]
    assert len(full.text) > 6
    rails.limit = 6
    out = generate(tok_model, ["hello world"], _greedy(40), tokenizer=tokenizer)[0].outputs[0]
    assert out.finish_reason == "content_filter"
    assert len(out.token_ids) < len(full.token_ids)  # it stopped decoding: the blocks were freed at once
    assert len(out.text) <= 6 and full.text.replace("o", "*").startswith(out.text)
    assert rails.responses[-1]["finish_reason"] == "content_filter" and rails.responses[-1]["status"] == 200


def test_each_hook_runs_once_per_request_and_completion(tok_model, tokenizer, rails):
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_new_tokens=5, ignore_eos=True)
    outs = generate(tok_model, ["hello world", "the quick brown"], params, tokenizer=tokenizer)
    assert [len(o.outputs) for o in outs] == [2, 2]
    ids = {rid for _, rid in rails.calls}
    assert len(ids) == 2  # one request per prompt
    for rid in ids:
        assert rails.calls["received", rid] == 1 and rails.calls["response", rid] == 1
        assert rails.calls["filters", rid] == 2  # one set of output rails per completion
    usage = rails.responses[-1]["usage"]
    assert usage["completion_tokens"] == 10 and usage["total_tokens"] == usage["prompt_tokens"] + 10


def test_generate_keeps_its_engine_and_drops_stale_prefixes(make_model):
    """The engine of a call is kept for the next call of its shape (its prefix cache serves it); a weight
    written in place (a training step) drops the cached prefixes: the next call computes with the new weights."""
    from plyx.serve import _generate

    model = make_model(vocab=96, seed=31, init_std=0.2)
    prefix = list(range(1, 40))
    prompts = [prefix + [50, 51], prefix + [60]]
    params = _greedy(6)
    first = generate(model, prompts, params)
    (engine,) = _generate._kept(model)
    hits = engine.prefix.hit_rate
    again = generate(model, prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert engine.prefix.hit_rate > hits  # the second call reused the first call's prompt blocks
    with torch.no_grad():
        model.embed_tokens.weight.mul_(-1.5)  # in place: same addresses, new values (and new keys, values)
    changed = generate(model, prompts, params)
    fresh = _unguarded(model, prompts, params)  # another engine (its config differs): nothing cached
    (same, _) = _generate._kept(model)  # and the unguarded call's engine, kept beside it
    assert same is engine
    assert [o.outputs[0].token_ids for o in changed] == [o.outputs[0].token_ids for o in fresh]
    assert [o.outputs[0].token_ids for o in changed] != [o.outputs[0].token_ids for o in first]


def test_more_requests_than_the_batch_queue_in_the_engine(make_model):
    model = make_model(vocab=96, seed=32, init_std=0.2).train()
    prompts = [[1 + i, 2 + i, 3] for i in range(5)]
    params = [SamplingParams(temperature=0.9, seed=i, max_new_tokens=4 + i) for i in range(5)]
    want = generate(model, prompts, params)
    assert model.training  # generate leaves the caller's mode alone
    got = generate(model, prompts, params, engine_config=EngineConfig(max_batch_size=2, max_batch_tokens=16))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.request_index for o in got] == list(range(5))


def test_a_non_paged_cache_object_is_deprecated_and_still_works(make_model):
    from plyx.attn import make_cache

    model = make_model(vocab=96, seed=33)
    cache = make_cache("contiguous", model.config, batch_size=4, max_seq_len=64)
    want = generate(model, [[1, 2, 3]], _greedy(5))
    with pytest.warns(DeprecationWarning, match="reference loop"):
        got = generate(model, [[1, 2, 3]], _greedy(5), cache=cache)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_engine_requests_are_guarded_unless_turned_off(tok_model, tokenizer, rails):
    """A library user of the Engine itself meets the same rails; a rewrite is re-encoded by the engine."""
    from plyx.serve.engine import Engine

    def engine(**kw):
        return Engine(tok_model, tokenizer=tokenizer, config=EngineConfig(max_batch_size=2, num_blocks=64, **kw))

    forbidden = tokenizer.encode("the forbidden fox").ids
    with pytest.raises(RequestRefused):
        engine().add_request("r1", forbidden, _greedy(3))
    assert engine(guardrails=False).generate([forbidden], _greedy(3))[0].outputs[0].finish_reason == "length"
    guarded = engine()
    req = guarded.add_request("r2", tokenizer.encode("secret world").ids, _greedy(4))
    assert req.prompt_ids == tokenizer.encode("hello world").ids  # the engine encoded the rail's rewrite
    while guarded.has_unfinished():
        guarded.step()
    assert rails.calls["received", "r2"] == rails.calls["response", "r2"] == 1
    assert "o" not in guarded.request_output(req).outputs[0].text  # the output rail's text


class _HoldAll:
    """Holds every character and decides at the end: blocks a reply longer than 3 characters."""

    def __init__(self):
        self.held = ""
        self.blocked = None

    def feed(self, text):
        self.held += text
        return ""

    def finish(self):
        if len(self.held) > 3:
            self.blocked = {"message": "too long", "rule_id": "short"}
            return ""
        return self.held


class _HoldRails:
    @hookimpl
    def plyx_output_filters(self, request, context):
        return [_HoldAll()]


def test_a_block_on_the_last_text_is_the_generate_finish_reason(tok_model, tokenizer):
    """A rail that decides on the whole text blocks after the last token: generate's finish reason says so for
    every completion that ended in that same step (both of n=2), and the held text never leaves."""
    params = SamplingParams(temperature=0, n=2, max_new_tokens=12, ignore_eos=True)
    full = _unguarded(tok_model, ["hello world"], params, tokenizer)[0].outputs
    assert all(len(c.text) > 3 for c in full)
    register_plugin(_HoldRails(), "test-hold-rails")
    try:
        stream = stream_generate(tok_model, ["hello world"], params, tokenizer=tokenizer)
        events = list(stream)
        short = generate(tok_model, ["hello world"], _greedy(1), tokenizer=tokenizer)[0].outputs[0]
    finally:
        unregister_plugin("test-hold-rails")
    assert "".join(e.text for e in events) == ""
    assert sorted(e.index for e in events if e.finish_reason == "content_filter") == [0, 1]
    for c in stream.outputs()[0].outputs:  # both ended by length, then the rail blocked what it held
        assert c.finish_reason == "content_filter" and c.text == "" and len(c.token_ids) == 12
    assert short.finish_reason == "length" and 0 < len(short.text) <= 3  # let through at the end
