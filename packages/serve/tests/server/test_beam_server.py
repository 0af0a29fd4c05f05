"""``best_of`` and vLLM's ``use_beam_search`` on /v1/completions, through the official ``openai`` client."""

from __future__ import annotations

import openai
import pytest

MODEL_NAME = "tiny"
PROMPT = "hello world, the quick"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_beam_search_returns_the_n_best_beams(client, server_lm, bpe):
    from plyx.serve import BeamSearchParams, beam_search

    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, best_of=4, logprobs=0,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})
    want = beam_search(server_lm, [PROMPT], BeamSearchParams(num_beams=4, num_return_sequences=2, max_new_tokens=8,
                                                             length_penalty=0.5, logprobs=True), tokenizer=bpe)
    outs = want[0].outputs
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [o.text for o in outs]
    assert [c.finish_reason for c in r.choices] == [o.finish_reason for o in outs]
    for c, o in zip(r.choices, outs):
        assert c.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in o.logprobs], abs=1e-4)
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in outs)
    # best_of defaults to n: n beams, all returned
    r2 = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2,
                                   extra_body={"use_beam_search": True})
    want2 = beam_search(server_lm, [PROMPT], BeamSearchParams(num_beams=2, num_return_sequences=2, max_new_tokens=8),
                        tokenizer=bpe)
    assert [c.text for c in r2.choices] == [o.text for o in want2[0].outputs]
    assert r2.choices[0].logprobs is None


def test_best_of_samples_and_returns_the_most_likely(client, server_lm, bpe):
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, n=1, best_of=3, seed=11,
                                  temperature=1.0)
    engine = Engine(server_lm, tokenizer=bpe, config=EngineConfig(max_batch_size=4, block_size=4, num_blocks=256,
                                                                  guardrails=False))
    samples = engine.generate([bpe.encode(PROMPT).ids], SamplingParams(n=3, seed=11, temperature=1.0,
                                                                        max_new_tokens=6, logprobs=0))[0].outputs
    best = max(samples, key=lambda c: c.cumulative_logprob)
    assert len({c.text for c in samples}) > 1  # the samples differ: the ranking chose among them
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].text == best.text and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in samples)  # every sample is computed


@pytest.mark.parametrize("kwargs, extra, param, words", [
    ({"stream": True}, {"use_beam_search": True}, "stream", "cannot be streamed"),
    ({"stream": True, "best_of": 2}, {}, "stream", "cannot be streamed"),
    ({"n": 3, "best_of": 2}, {}, "best_of", "best_of must be in"),
    ({"temperature": 0.7}, {"use_beam_search": True}, "temperature", "deterministic"),
    ({"stop": ["x"]}, {"use_beam_search": True}, "stop", "does not apply to beam search"),
    ({"n": 2, "best_of": 40}, {"use_beam_search": True}, "best_of", "best_of must be in"),
])
def test_beam_and_best_of_refusals(client, kwargs, extra, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, extra_body=extra, **kwargs)
        if kwargs.get("stream"):
            list(r)
    assert info.value.status_code == 400
    assert words in info.value.message and info.value.body["param"] == param
    ok = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)  # the server still answers
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_beams_beside_a_streamed_request(client, server_lm, bpe, greedy_reference):
    """A beam request and a streamed sampled request in flight together: each answers as it does alone."""
    from concurrent.futures import ThreadPoolExecutor

    from plyx.serve import BeamSearchParams, beam_search

    def streamed():
        chunks = client.completions.create(model=MODEL_NAME, prompt="the quick brown", max_tokens=24, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    def beams():
        return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=3,
                                         extra_body={"use_beam_search": True})

    with ThreadPoolExecutor(2) as pool:
        text, r = pool.submit(streamed), pool.submit(beams)
        text, r = text.result(), r.result()
    assert text == greedy_reference(server_lm, bpe, bpe.encode("the quick brown").ids, 24).text
    want = beam_search(server_lm, [PROMPT], BeamSearchParams(num_beams=3, num_return_sequences=3, max_new_tokens=8),
                       tokenizer=bpe)
    assert [c.text for c in r.choices] == [o.text for o in want[0].outputs]
