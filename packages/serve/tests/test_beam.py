"""Beam search against transformers' num_beams decoding on the same weights."""

from __future__ import annotations

import pytest
import torch
from plyx.serve import BeamSearchParams, beam_search

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 3, 4, 5]]
STOPS = [2, 7, 9, 11, 13, 40, 41, 42]  # many stop ids so that hypotheses finish at different lengths


def _hf_beams(hf, prompts, *, num_beams, new, nret, length_penalty, early_stopping, use_cache=True):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, num_beams=num_beams,
                      num_return_sequences=nret, do_sample=False, pad_token_id=0, eos_token_id=STOPS,
                      length_penalty=length_penalty, early_stopping=early_stopping, use_cache=use_cache,
                      return_dict_in_generate=True, output_scores=True)
    return out.sequences[:, width:].tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize(
    "num_beams, nret, length_penalty, early_stopping, cache",
    [
        (3, 2, 1.0, False, "contiguous"),
        (4, 4, 0.5, True, "paged"),
        (2, 1, 2.0, "never", "contiguous"),
        (3, 3, -1.0, False, "paged"),
    ],
)
def test_beams_match_transformers(hf_pair, num_beams, nret, length_penalty, early_stopping, cache):
    hf, model = hf_pair
    params = BeamSearchParams(num_beams=num_beams, max_new_tokens=8, num_return_sequences=nret,
                              length_penalty=length_penalty, early_stopping=early_stopping, logprobs=True)
    ours = beam_search(model, PROMPTS, params, eos_token_id=STOPS, cache=cache)
    seqs, scores = _hf_beams(hf, PROMPTS, num_beams=num_beams, new=8, nret=nret, length_penalty=length_penalty,
                             early_stopping=early_stopping)
    for i, req in enumerate(ours):
        assert len(req.outputs) == nret
        for r, c in enumerate(req.outputs):
            want = seqs[i * nret + r]
            assert list(c.token_ids) == want[: len(c.token_ids)]
            assert abs(c.score - scores[i * nret + r]) < 1e-4
            assert c.finish_reason == ("stop" if c.token_ids[-1] in STOPS else "length")
            # the score is the summed raw log-probs over the length penalty
            assert abs(c.score - c.cumulative_logprob / len(c.token_ids) ** length_penalty) < 1e-4
        assert [c.score for c in req.outputs] == sorted((c.score for c in req.outputs), reverse=True)


def test_beam_search_without_cache_and_cache_is_clean(hf_pair):
    from plyx.attn import make_cache

    _, model = hf_pair
    params = BeamSearchParams(num_beams=3, max_new_tokens=6, num_return_sequences=3)
    cache = make_cache("paged", model.config, batch_size=24, max_seq_len=128)
    a = beam_search(model, PROMPTS, params, eos_token_id=STOPS, cache=cache)
    b = beam_search(model, PROMPTS, params, eos_token_id=STOPS, use_cache=False)
    assert [[c.token_ids for c in r.outputs] for r in a] == [[c.token_ids for c in r.outputs] for r in b]
    assert cache.sequences() == [] and cache.usage().blocks_used == 0


def test_one_beam_is_greedy(hf_pair):
    from plyx.serve import SamplingParams, generate

    _, model = hf_pair
    beams = beam_search(model, PROMPTS, BeamSearchParams(num_beams=1, max_new_tokens=8))
    greedy = generate(model, PROMPTS, SamplingParams(temperature=0, max_new_tokens=8))
    assert [b.outputs[0].token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]
