"""The rest of the HTTP surface with httpx: health, tokenize, metrics, limits, bad input, disconnects."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest


def wait_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not engine.has_unfinished()


def held_by_prefix_cache(engine):
    return len(engine.prefix) if engine.prefix is not None else 0


def test_health_and_models_need_no_key_but_v1_does(server):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    r = httpx.get(server.base_url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.base_url + "/v1/models", headers=server.headers)
    assert r.status_code == 200 and r.json()["data"][0]["max_model_len"] == server.engine.max_model_len


def test_tokenize_detokenize_round_trip(server, bpe):
    text = "hello world, the quick brown fox"
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": text}, headers=server.headers).json()
    assert r["tokens"] == bpe.encode(text).ids and r["count"] == len(r["tokens"])
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}, headers=server.headers).json()
    assert back["prompt"] == text
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=server.headers).json()
    assert bpe.decode(chat["tokens"], skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n" \
                                                                    "<|im_start|>assistant\n"
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": [10**6]}, headers=server.headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "tiny"}', 400, None),
    (b'{"model": "tiny", "prompt": [[1, 2], "x", {}]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": [1, 2], "logit_bias": {"a": 1}}', 400, "logit_bias"),
    (b'{"model": "tiny", "prompt": "hi", "n": 0}', 400, "n"),
    (b'{"model": "other", "prompt": "hi"}', 404, "model"),
    (b'{"model": "tiny", "prompt": [1, 99999]}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": "hi", "echo": true}', 400, "echo"),
])
def test_bad_input_gets_openai_error_bodies(server, body, status, param):
    r = httpx.post(server.base_url + "/v1/completions", content=body,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_metrics_report_the_engine(server):
    httpx.post(server.base_url + "/v1/completions", headers=server.headers,
               json={"model": "tiny", "prompt": "hello hello hello hello", "max_tokens": 4})
    text = httpx.get(server.base_url + "/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in ("plyx_num_requests_waiting", "plyx_num_requests_running", "plyx_kv_cache_usage_ratio",
                 "plyx_prefix_cache_hit_rate", "plyx_generation_tokens_per_second"):
        assert name in values
    assert values["plyx_generation_tokens_total"] >= 4
    assert values["plyx_time_to_first_token_seconds_count"] >= 1
    assert values["plyx_time_per_output_token_seconds_count"] >= 1
    assert 0 <= values["plyx_kv_cache_usage_ratio"] <= 1


def test_request_size_limit(serving, server_lm, bpe):
    with serving.serve(serving.make_app(server_lm, bpe, max_request_bytes=200)) as s:
        big = {"model": "tiny", "prompt": "x" * 500}
        r = httpx.post(s.base_url + "/v1/completions", json=big, headers=s.headers)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit still holds while reading
            yield json.dumps(big).encode()

        r = httpx.post(s.base_url + "/v1/completions", content=chunks(), headers=s.headers)
        assert r.status_code == 413


def test_concurrency_limit_and_disconnect_frees_blocks(serving, server_lm, bpe):
    app = serving.make_app(server_lm, bpe, max_concurrent=1)
    with serving.serve(app) as s:
        engine = s.engine
        long_req = {"model": "tiny", "prompt": "hello world", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", s.base_url + "/v1/completions", json=long_req, headers=s.headers) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: ") for line in got)
                assert engine.cache.usage().blocks_used > held_by_prefix_cache(engine)
                busy = httpx.post(s.base_url + "/v1/completions", headers=s.headers,
                                  json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
                assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
            # the client hung up mid-stream: the request is aborted and its blocks are freed right away
        assert wait_idle(engine, timeout=5)
        assert engine.cache.usage().blocks_used == held_by_prefix_cache(engine)
        assert engine.stats.requests_aborted == 1
        ok = httpx.post(s.base_url + "/v1/completions", headers=s.headers,
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200


def test_non_streaming_disconnect_aborts(serving, server_lm, bpe):
    with serving.serve(serving.make_app(server_lm, bpe)) as s:
        engine = s.engine

        def go():
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.base_url + "/v1/completions", headers=s.headers, timeout=0.5,
                           json={"model": "tiny", "prompt": "hello", "max_tokens": 450, "ignore_eos": True})

        t = threading.Thread(target=go)
        t.start()
        t.join()
        assert wait_idle(engine, timeout=5)
        assert engine.stats.requests_aborted == 1
        assert engine.cache.usage().blocks_used == held_by_prefix_cache(engine)


def test_queue_full_is_429(serving, server_lm, bpe):
    app = serving.make_app(server_lm, bpe, engine_kw={"max_batch_size": 1, "max_queue": 1})
    with serving.serve(app) as s, httpx.Client(timeout=30) as c:
        req = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "stream": True, "ignore_eos": True}
        with c.stream("POST", s.base_url + "/v1/completions", json=req, headers=s.headers) as r1:
            lines = r1.iter_lines()  # kept: a dropped iterator closes the connection (and aborts the request)
            next(lines)  # running
            with c.stream("POST", s.base_url + "/v1/completions", json=req, headers=s.headers):  # queued
                st = (s.engine.num_waiting, s.engine.num_running, s.engine.stats.requests_finished)
                r3 = httpx.post(s.base_url + "/v1/completions", headers=s.headers,
                                json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
                assert r3.status_code == 429 and r3.json()["error"]["code"] == "queue_full", st
        assert wait_idle(s.engine, timeout=5)
