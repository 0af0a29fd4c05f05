"""generate(): parity with transformers, caches, stops, seeds, logprobs, n > 1, streaming, plugins."""

from __future__ import annotations

import pytest
import torch
from plyx.serve import SamplingParams, generate, stream_generate
from plyx.specs import Component, hookimpl

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 3, 4, 5], [1, 99, 98, 97, 96, 95, 94, 93, 92]]


def _hf_greedy(hf, prompts, new, *, use_cache=True, eos=None):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
                      eos_token_id=eos, use_cache=use_cache)
    return [row[width:].tolist() for row in out]


@pytest.mark.parametrize("cache, use_cache", [("contiguous", True), ("paged", True), ("contiguous", False)])
def test_greedy_matches_transformers_batched_with_padding(hf_pair, cache, use_cache):
    hf, model = hf_pair
    want = _hf_greedy(hf, PROMPTS, 16, use_cache=use_cache)
    got = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=16), cache=cache, use_cache=use_cache)
    for g, w in zip(got, want):
        assert list(g.outputs[0].token_ids) == w
        assert g.outputs[0].finish_reason == "length"


def test_greedy_matches_transformers_with_eos(hf_pair):
    hf, model = hf_pair
    # pick as EOS a token the greedy path of prompt 0 produces, so one row stops early
    free = generate(model, PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=12))[0].outputs[0].token_ids
    eos = free[4]
    want = _hf_greedy(hf, PROMPTS, 12, eos=eos)
    got = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=12), eos_token_id=eos)
    first = got[0].outputs[0]
    assert first.finish_reason == "stop" and first.stop_reason == eos and first.token_ids[-1] == eos
    assert list(first.token_ids) == list(free[: free.index(eos) + 1])
    for g, w in zip(got, want):  # transformers pads finished rows with pad_token_id after EOS
        n = len(g.outputs[0].token_ids)
        assert list(g.outputs[0].token_ids) == w[:n]


def test_user_cache_keeps_its_own_sequences(hf_pair):
    from plyx.attn import make_cache

    _, model = hf_pair
    cache = make_cache("paged", model.config, batch_size=8, max_seq_len=128)
    model(torch.tensor([[1, 2, 3]]), cache=cache, seq_ids=[0])  # someone else's sequence
    before = cache.usage().blocks_used
    ref = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    got = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=8), cache=cache)
    assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
    assert cache.sequences() == [0] and cache.usage().blocks_used == before


def test_stop_token_ids_and_length_and_context(make_model):
    model = make_model(max_seq_len=24)
    free = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=10))[0].outputs[0]
    stop = free.token_ids[3]
    out = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,)))
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop and o.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]
    # the context bounds generation: 20 prompt tokens + 4 new = 24
    o = generate(model, [list(range(1, 21))], SamplingParams(temperature=0, max_new_tokens=50))[0].outputs[0]
    assert len(o.token_ids) == 4 and o.finish_reason == "length"
    # min_tokens bans the stop id at first
    o = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=(stop,),
                                                    min_tokens=8))[0].outputs[0]
    assert stop not in o.token_ids[:8]


def test_stop_strings_and_text(tok_model, tokenizer):
    prompt = "hello world"
    free = generate(tok_model, [prompt], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True),
                    tokenizer=tokenizer)[0].outputs[0]
    assert free.text == tokenizer.decode(list(free.token_ids))
    cut = free.text[5:8]
    assert cut, free.text
    out = generate(tok_model, [prompt], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=(cut,)),
                   tokenizer=tokenizer)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == cut
    assert out.text == free.text[: free.text.index(cut)]
    kept = generate(tok_model, [prompt], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True, stop=(cut,),
                                                        include_stop_str_in_output=True), tokenizer=tokenizer)[0].outputs[0]
    assert kept.text == free.text[: free.text.index(cut) + len(cut)]
    # streamed text deltas add up to the final text and never show the stop string
    stream = stream_generate(tok_model, [prompt], SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True,
                                                                 stop=(cut,)), tokenizer=tokenizer)
    pieces = [e.text for e in stream]
    assert "".join(pieces) == out.text and cut not in "".join(pieces)


def test_seeds_reproducible_and_independent_of_batch(make_model):
    model = make_model(init_std=0.2)
    p = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=7)
    alone = generate(model, [[1, 2, 3]], p)[0].outputs[0].token_ids
    batched = generate(model, [[4, 5], [1, 2, 3], [9]], [SamplingParams(max_new_tokens=5), p,
                                                         SamplingParams(max_new_tokens=9)])
    assert batched[1].outputs[0].token_ids == alone
    other = generate(model, [[1, 2, 3]], SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=8))
    assert other[0].outputs[0].token_ids != alone


def test_n_completions_share_the_prompt_through_fork(make_model):
    model = make_model(init_std=0.2)
    out = generate(model, [[1, 2, 3], [7, 8]], SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=1),
                   cache="paged")
    assert [len(o.outputs) for o in out] == [3, 3]
    seqs = {o.token_ids for o in out[0].outputs}
    assert len(seqs) > 1  # different seeds (seed + i) -> different samples
    # completion i equals a lone request seeded with seed + i
    lone = generate(model, [[1, 2, 3]], SamplingParams(temperature=1.0, max_new_tokens=8, seed=3))[0].outputs[0]
    assert out[0].outputs[2].token_ids == lone.token_ids


def test_logprobs_are_the_models(hf_pair):
    _, model = hf_pair
    out = generate(model, PROMPTS[:2], SamplingParams(temperature=0.8, max_new_tokens=6, logprobs=3, seed=0))
    for req in out:
        o = req.outputs[0]
        seq = torch.tensor([list(req.prompt_token_ids) + list(o.token_ids)])
        with torch.no_grad():
            lp = model(seq)[0].log_softmax(-1)  # [T, V]
        start = len(req.prompt_token_ids) - 1
        for j, tl in enumerate(o.logprobs):
            row = lp[start + j]
            assert tl.token_id == o.token_ids[j]
            assert abs(tl.logprob - float(row[tl.token_id])) < 1e-4
            assert [t for t, _ in tl.top] == row.topk(3).indices.tolist()
        assert abs(o.cumulative_logprob - sum(t.logprob for t in o.logprobs)) < 1e-4


def test_stream_events_rebuild_the_outputs(hf_pair):
    _, model = hf_pair
    params = SamplingParams(temperature=0, max_new_tokens=7, logprobs=0)
    stream = stream_generate(model, PROMPTS, params)
    got: dict[int, list[int]] = {}
    finished = set()
    for ev in stream:
        assert ev.request_index not in finished
        got.setdefault(ev.request_index, []).extend(ev.token_ids)
        if ev.finish_reason:
            finished.add(ev.request_index)
    assert finished == set(range(len(PROMPTS)))
    outs = stream.outputs()
    assert [list(o.outputs[0].token_ids) for o in outs] == [got[i] for i in range(len(PROMPTS))]


class _ForceToken:
    """A third-party processor: forces one token id."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, logits, state):
        out = torch.full_like(logits, float("-inf"))
        out[:, self.token] = 0.0
        return out


class _Plugin:
    plyx_contracts = {"hooks": "1.0"}

    @staticmethod
    @hookimpl
    def plyx_samplers():
        return [Component("force_token", _ForceToken, "test: force one token")]


def test_third_party_processor_by_name(make_model):
    from plyx.specs.plugins import register_plugin, unregister_plugin

    model = make_model()
    register_plugin(_Plugin(), "serve-test-force", distribution="serve-tests")
    try:
        out = generate(model, [[1, 2], [3, 4]], [
            SamplingParams(temperature=0, max_new_tokens=4, processors=(("force_token", {"token": 42}),)),
            SamplingParams(temperature=0, max_new_tokens=4),
        ])
        assert out[0].outputs[0].token_ids == (42, 42, 42, 42)
        assert out[1].outputs[0].token_ids != (42, 42, 42, 42)  # applied to the asking row only
    finally:
        unregister_plugin("serve-test-force")


def test_penalties_change_greedy_output(make_model):
    model = make_model(init_std=0.2)
    base = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=20))[0].outputs[0].token_ids
    pen = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=20, frequency_penalty=2.0,
                                                      presence_penalty=2.0))[0].outputs[0].token_ids
    assert len(set(pen)) >= len(set(base))
    banned = generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=20,
                                                         banned_token_ids=tuple(set(base))))[0].outputs[0].token_ids
    assert not set(banned) & set(base)


def test_closing_a_stream_early_evicts_its_sequences(hf_pair):
    from plyx.attn import make_cache

    _, model = hf_pair
    cache = make_cache("paged", model.config, batch_size=8, max_seq_len=128)
    stream = stream_generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=30, n=2), cache=cache)
    first = next(stream)
    assert first.finish_reason is None and len(cache.sequences()) == 2 * len(PROMPTS)
    # the suspended generator must not leave the consumer in inference mode (grad mode is thread-local)
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    stream.close()
    assert cache.sequences() == [] and cache.usage().blocks_used == 0
    partial = stream.outputs()
    assert sum(len(c.token_ids) for r in partial for c in r.outputs) >= 1
