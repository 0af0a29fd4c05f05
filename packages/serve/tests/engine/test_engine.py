"""Continuous batching: batched output equals each request alone, chunked prefill, preemption, per-request params."""

from __future__ import annotations

import random

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig, QueueFullError
from plyx.specs.errors import ConfigError


def alone(model, prompt, params, **kw):
    """The request on an engine of its own (batch of one, roomy cache)."""
    cfg = EngineConfig(max_batch_size=max(1, params.n), max_batch_tokens=256, block_size=4, num_blocks=256,
                       prefix_caching=False)
    return Engine(model, config=cfg, **kw).generate([prompt], params)[0]


def reference_greedy(model, prompt, n):
    """Greedy decoding by full recomputation, no KV cache at all: the ground truth."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def random_prompts(count, seed=0, lo=1, hi=60, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def test_alone_matches_uncached_reference(lm):
    for prompt in random_prompts(3, seed=1):
        got = alone(lm, prompt, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
        assert list(got.outputs[0].token_ids) == reference_greedy(lm, prompt, 12)


def test_many_interleaved_requests_equal_alone_under_chunking_and_preemption(lm):
    prompts = random_prompts(24, seed=2)
    rng = random.Random(3)
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 20), ignore_eos=True) for _ in prompts]
    want = [alone(lm, p, sp).outputs[0].token_ids for p, sp in zip(prompts, params)]
    # budget 16 < most prompts: chunked prefill; 40 blocks of 4 for 8 sequences of up to 80 tokens: preemption
    engine = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=16, block_size=4, num_blocks=40, max_model_len=96,
                                            prefix_caching=False))
    got = engine.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert engine.stats.preemptions > 0
    assert engine.cache.usage().blocks_used == 0  # every block came back


def test_requests_join_the_running_batch(lm):
    engine = Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=64, block_size=4, num_blocks=64))
    sp = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    a, b = random_prompts(2, seed=4, lo=5, hi=20)
    engine.add_request("a", a, sp)
    first = [engine.step() for _ in range(3)]
    assert all(len(outs) == 1 for outs in first)
    engine.add_request("b", b, sp)
    outs = engine.step()  # b's prefill and a's decode in one step
    assert {o.request_id for o in outs} == {"a", "b"} and engine.stats.last_batch_seqs == 2
    tokens = {"a": [t for s in first for o in s for t in o.event.token_ids], "b": []}
    for o in outs:
        tokens[o.request_id] += o.event.token_ids
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.event.token_ids
    assert tokens["a"] == reference_greedy(lm, a, 10)
    assert tokens["b"] == reference_greedy(lm, b, 10)


def test_chunked_prefill_does_not_stall_decoding(lm):
    engine = Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=9, block_size=4, num_blocks=80))
    decoding = random_prompts(1, seed=5, lo=3, hi=4)[0]
    long_prompt = random_prompts(1, seed=6, lo=100, hi=101)[0]
    engine.add_request("d", decoding, SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True))
    engine.step()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    long_seq = engine.requests["long"].seqs[0]
    steps_while_prefilling = 0
    tokens = []
    while long_seq.num_computed < len(long_prompt):
        outs = engine.step()
        tokens += [t for o in outs if o.request_id == "long" for t in o.event.token_ids]
        # every step gives the decoding request its token; the prompt advances by at most the rest of the budget
        assert [o.request_id for o in outs if o.request_id == "d"] == ["d"]
        assert engine.stats.last_batch_tokens <= 9
        steps_while_prefilling += 1
    assert steps_while_prefilling >= 100 // 8  # the 100-token prompt went in chunks
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == "long" for t in o.event.token_ids]
    assert tokens == reference_greedy(lm, long_prompt, 3)


def test_sampled_requests_resume_identically_after_preemption(lm):
    prompts = random_prompts(10, seed=7, lo=10, hi=40)
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_new_tokens=16, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    want = [alone(lm, p, sp).outputs[0].token_ids for p, sp in zip(prompts, params)]
    engine = Engine(lm, config=EngineConfig(max_batch_size=10, max_batch_tokens=32, block_size=4, num_blocks=30, max_model_len=64,
                                            prefix_caching=False))
    reqs = [engine.add_request(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        engine.step()
    assert sum(s.num_preemptions for r in reqs for s in r.seqs) > 0
    assert [tuple(r.seqs[0].completion.token_ids) for r in reqs] == [tuple(w) for w in want]


def test_mixed_parameters_in_one_batch_each_equal_alone(lm):
    prompts = random_prompts(6, seed=8, lo=4, hi=30)
    params = [
        SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, max_new_tokens=12, seed=1, n=3, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, repetition_penalty=1.5, presence_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.1, max_new_tokens=12, seed=5, logit_bias={7: 5.0}, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(17, 42, 99, 200), min_tokens=2),
    ]
    want = [alone(lm, p, sp) for p, sp in zip(prompts, params)]
    engine = Engine(lm, config=EngineConfig(max_batch_size=16, max_batch_tokens=64, block_size=4, num_blocks=128))
    got = engine.generate(prompts, params)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
    n3 = [c.token_ids for c in got[1].outputs]
    assert len(n3) == 3 and len(set(n3)) == 3  # n completions share the prompt, not the seed
    lps = got[3].outputs[0].logprobs
    assert len(lps) == 12 and all(len(lp.top) == 3 and lp.top[0][1] >= lp.logprob - 1e-6 for lp in lps)
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(lps, want[3].outputs[0].logprobs))


def test_n_completions_fork_the_prompt_once(lm):
    prompt = random_prompts(1, seed=9, lo=40, hi=41)[0]
    engine = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=128,
                                            prefix_caching=False))
    engine.generate([prompt], SamplingParams(temperature=1.0, n=4, seed=3, max_new_tokens=4, ignore_eos=True))
    assert engine.stats.prompt_tokens == len(prompt)  # not 4 * len(prompt)


def test_abort_frees_blocks_at_once(lm):
    engine = Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=64, block_size=4, num_blocks=64,
                                            prefix_caching=False))
    engine.add_request("x", random_prompts(1, seed=10, lo=30, hi=31)[0],
                       SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.cache.usage().blocks_used > 0
    outs = engine.abort("x")
    assert outs and outs[0].aborted and outs[0].request_finished
    assert engine.cache.usage().blocks_used == 0 and not engine.has_unfinished()
    assert engine.abort("x") == []


def test_bad_requests_are_rejected_before_compute(lm):
    engine = Engine(lm, config=EngineConfig(max_batch_size=2, max_queue=2, block_size=4, num_blocks=64))
    with pytest.raises(ConfigError, match="context"):
        engine.add_request("long", [1] * (engine.max_model_len + 1), SamplingParams())
    with pytest.raises(ConfigError, match="token ids"):
        engine.add_request("oov", [1, 2, 10_000], SamplingParams())
    with pytest.raises(ConfigError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    engine.add_request("q1", [1, 2], SamplingParams())
    engine.add_request("q2", [1, 2], SamplingParams())
    with pytest.raises(QueueFullError):
        engine.add_request("q3", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("q1", [1, 2], SamplingParams())
    assert engine.stats.steps == 0


def test_engine_config_is_validated():
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        EngineConfig(max_batch_size=64, max_batch_tokens=8)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)


def test_pool_must_hold_one_full_sequence(lm):
    with pytest.raises(ConfigError, match="num_blocks"):
        Engine(lm, config=EngineConfig(block_size=4, num_blocks=10))


def test_mixed_chunks_share_the_decode_forward_and_change_nothing(lm):
    prompts = random_prompts(12, seed=11, lo=20, hi=60)
    sp = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    want = [alone(lm, p, sp).outputs[0].token_ids for p in prompts]
    calls = []
    hook = lm.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        results = {}
        for mixed in (0, 8):
            calls.clear()
            engine = Engine(lm, config=EngineConfig(max_batch_size=12, max_batch_tokens=64, block_size=4,
                                                    num_blocks=160, mixed_chunk=mixed, packed_step=False))
            # arrivals spread over the run, so prompts are prefilled while others decode
            pending = list(enumerate(prompts))
            outs: dict[str, list[int]] = {}
            while pending or engine.has_unfinished():
                if pending:
                    i, p = pending.pop(0)
                    engine.add_request(str(i), p, sp)
                for o in engine.step():
                    outs.setdefault(o.request_id, []).extend(o.event.token_ids)
            results[mixed] = (engine.stats.steps, len(calls))
            assert [tuple(outs[str(i)]) for i in range(len(prompts))] == [tuple(w) for w in want]
    finally:
        hook.remove()
    (steps0, forwards0), (steps8, forwards8) = results[0], results[8]
    assert forwards0 > steps0  # without mixing, prefill steps run a second forward
    assert forwards8 - steps8 < (forwards0 - steps0) / 2
