"""The server over a multi-step engine (``EngineConfig.decode_steps``): concurrent streams get the same text,
tokens and usage as the requests run alone one step at a time, every token its own event with
``stream_interval=1`` and a block's tokens in fewer SSE chunks with a larger interval."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor


def _stream_all(serving, app, prompts, lengths):
    """Stream every prompt at once; ``(chunk texts, usage)`` per prompt and the engine's multi-step block count."""
    import httpx

    with serving.serve(app) as s:

        def stream(i: int) -> tuple[list[str], dict]:
            body = {"model": "tiny", "prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            chunks, usage = [], {}
            with httpx.Client(timeout=60) as c, c.stream("POST", s.base_url + "/v1/completions", json=body,
                                                         headers=s.headers) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        obj = json.loads(line[6:])
                        if obj["choices"]:
                            chunks.append(obj["choices"][0]["text"])
                        if obj.get("usage"):
                            usage = obj["usage"]
            return chunks, usage

        with ThreadPoolExecutor(len(prompts)) as pool:  # more requests than the batch: some wait for blocks
            results = list(pool.map(stream, range(len(prompts))))
        return results, s.engine.stats.multi_step_blocks


def test_concurrent_streams_over_blocks_equal_alone(serving, server_lm, bpe, greedy_reference):
    app = serving.make_app(server_lm, bpe, engine_kw={"decode_steps": 4, "max_batch_size": 4, "look_ahead": True,
                                                      "stream_interval": 1})
    prompts = ["hello world", "the quick brown fox", "You are a helpful", "count 3", "yes ok", "answer"]
    lengths = [13, 22, 9, 17, 30, 5]
    results, blocks = _stream_all(serving, app, prompts, lengths)
    assert blocks > 0
    for i, (chunks, usage) in enumerate(results):
        want = greedy_reference(server_lm, bpe, bpe.encode(prompts[i]).ids, lengths[i])
        assert len(chunks) == usage["completion_tokens"] == lengths[i]  # one event per token, as without blocks
        assert "".join(chunks) == want.text


def test_streams_in_chunks_of_up_to_the_interval_equal_alone(serving, server_lm, bpe, greedy_reference):
    app = serving.make_app(server_lm, bpe, engine_kw={"decode_steps": 4, "max_batch_size": 4, "look_ahead": True,
                                                      "stream_interval": 4})
    prompts = ["hello world", "the quick brown fox", "count 3", "yes ok"]
    lengths = [13, 22, 17, 30]
    results, blocks = _stream_all(serving, app, prompts, lengths)
    assert blocks > 0
    fewer = 0
    for i, (chunks, usage) in enumerate(results):
        want = greedy_reference(server_lm, bpe, bpe.encode(prompts[i]).ids, lengths[i])
        assert usage["completion_tokens"] == lengths[i] and "".join(chunks) == want.text
        assert len(chunks) >= -(-lengths[i] // 4)  # no chunk carries more than the interval
        fewer += len(chunks) < lengths[i]
    assert fewer  # blocks streamed several tokens per chunk
