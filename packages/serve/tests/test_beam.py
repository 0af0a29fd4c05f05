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


# -- beam groups inside the engine -----------------------------------------------------------
def _engine(model, **kw):
    from plyx.serve.engine import Engine, EngineConfig

    cfg = dict(max_batch_size=16, max_batch_tokens=64, block_size=4, max_model_len=32, cuda_graphs=False,
               decode_steps=1, look_ahead=False, guardrails=False)
    cfg.update(kw)
    return Engine(model, config=EngineConfig(**cfg), eos_token_id=STOPS)


def _check_beams(hf, outs, params, prompts=PROMPTS, tol=1e-4):
    seqs, scores = _hf_beams(hf, prompts, num_beams=params.num_beams, new=params.max_new_tokens,
                             nret=params.num_return_sequences, length_penalty=params.length_penalty,
                             early_stopping=params.early_stopping)
    nret = params.num_return_sequences
    for i, req in enumerate(outs):
        assert len(req.outputs) == nret
        for r, c in enumerate(req.outputs):
            want = seqs[i * nret + r]
            assert list(c.token_ids) == want[: len(c.token_ids)]
            assert abs(c.score - scores[i * nret + r]) < 1e-4


@pytest.mark.parametrize("packed", [True, False])
def test_engine_mixes_beam_groups_with_sampled_requests(hf_pair, packed):
    """Beam groups and sampled rows in the same steps (one packed forward, or one per group of equal counts),
    each exactly as alone."""
    from plyx.serve import SamplingParams

    hf, model = hf_pair
    beams = BeamSearchParams(num_beams=3, max_new_tokens=8, num_return_sequences=2)
    greedy = SamplingParams(temperature=0, max_new_tokens=10)
    seeded = SamplingParams(temperature=1.0, seed=7, max_new_tokens=10)
    engine = _engine(model, packed_step=packed)
    assert engine.packed is packed
    reqs = [engine.add_request("b0", PROMPTS[0], beams), engine.add_request("g", [1, 4, 4, 9], greedy),
            engine.add_request("b1", PROMPTS[1], beams), engine.add_request("s", [1, 8, 3], seeded),
            engine.add_request("b2", PROMPTS[2], beams)]
    mixed = 0
    while any(not r.finished for r in reqs):
        engine.step()
        kinds = {s.request.request_id[0] for s in engine.running}
        mixed += "b" in kinds and len(kinds) > 1
    assert mixed > 0  # steps held beam rows and sampled rows together
    _check_beams(hf, [engine.request_output(reqs[i]) for i in (0, 2, 4)], beams)
    alone = _engine(model).generate([[1, 4, 4, 9], [1, 8, 3]], [greedy, seeded])
    assert engine.request_output(reqs[1]).outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert engine.request_output(reqs[3]).outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert not engine.beam_groups and not engine.requests and not engine.running


def test_engine_beams_share_the_prefix_cache(hf_pair):
    """A beam request whose prompt is cached attaches it (no prefill of those blocks) and decodes the same."""
    hf, model = hf_pair
    params = BeamSearchParams(num_beams=4, max_new_tokens=8, num_return_sequences=4, length_penalty=0.5,
                              early_stopping=True)
    prompt = [1, 5, 6, 7, 8, 9, 10, 11, 12, 3]
    engine = _engine(model)
    first = engine.generate([prompt], params)
    computed = engine.stats.prompt_tokens
    second = engine.generate([prompt], params)
    assert engine.prefix.hit_tokens >= 8  # two full blocks of 4 came from the cache
    assert engine.stats.prompt_tokens - computed <= len(prompt) - 8
    assert [c.token_ids for c in first[0].outputs] == [c.token_ids for c in second[0].outputs]
    _check_beams(hf, second, params, [prompt])


def test_engine_preempts_beams_by_recompute(hf_pair):
    """A pool too small for every beam at once: beams are preempted (recomputed later) and the group waits for
    them; the hypotheses are transformers' all the same, and every block comes back."""
    from plyx.serve import SamplingParams

    hf, model = hf_pair
    params = BeamSearchParams(num_beams=4, max_new_tokens=12, num_return_sequences=3, length_penalty=1.0)
    engine = _engine(model, num_blocks=12, prefix_caching=False)
    reqs = [engine.add_request(f"b{i}", p, params) for i, p in enumerate(PROMPTS)]
    greedy = engine.add_request("g", [1, 2, 3], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    while any(not r.finished for r in [*reqs, greedy]):
        engine.step()
    assert sum(s.num_preemptions for r in reqs for s in r.seqs) > 0  # beams themselves were preempted
    _check_beams(hf, [engine.request_output(r) for r in reqs], params)
    assert engine.cache.usage().blocks_used == 0 and engine.cache.sequences() == []


def test_engine_refuses_beam_requests_it_cannot_run(hf_pair):
    from plyx.specs.errors import ConfigError

    _, model = hf_pair
    engine = _engine(model, max_batch_size=2)
    with pytest.raises(ConfigError, match="max_batch_size"):
        engine.add_request("b", [1, 2], BeamSearchParams(num_beams=3))
    assert not engine.requests and not engine.waiting


def test_aborting_a_beam_group_frees_its_blocks(hf_pair):
    _, model = hf_pair
    engine = _engine(model, prefix_caching=False)
    req = engine.add_request("b", PROMPTS[0], BeamSearchParams(num_beams=4, max_new_tokens=12))
    for _ in range(4):
        engine.step()
    assert len(engine.cache.sequences()) == 4  # the beams hold their (shared) blocks
    out = engine.abort("b")
    assert out[0].aborted and req.finished and not engine.beam_groups
    assert engine.cache.sequences() == [] and engine.cache.usage().blocks_used == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the engine's CUDA paths: decode and mixed-step graphs"))])
def test_engine_beams_after_multi_step_and_look_ahead(hf_pair, device):
    """A greedy row decodes in multi-step blocks with the look-ahead (the engine's defaults on a GPU, forced on
    the CPU), then beam groups arrive: the engine falls back to single steps, the hypotheses are
    transformers', the greedy row's tokens are its own alone; on CUDA through decode and mixed-step graphs."""
    import copy

    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    hf, model = hf_pair
    dev = copy.deepcopy(model).to(device)
    params = BeamSearchParams(num_beams=4, max_new_tokens=8, num_return_sequences=3, length_penalty=0.5)
    tol = 1e-3 if device == "cuda" else 1e-4  # another device's matmuls: scores agree to float32 rounding
    if device == "cuda":
        _check_beams(hf, beam_search(dev, PROMPTS, params, eos_token_id=STOPS), params, tol=tol)
    # CUDA: the defaults there (graphs, look-ahead, 8-step blocks), mixed-step buckets up to 128 tokens (capture time)
    kw = {"mixed_graphs": True, "max_batch_tokens": 128} if device == "cuda" else {"decode_steps": 8,
                                                                                   "look_ahead": True}
    engine = Engine(dev, config=EngineConfig(max_batch_size=16, block_size=4, max_model_len=32, **kw),
                    eos_token_id=STOPS)
    greedy = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    g = engine.add_request("g", [1, 4, 4, 9], greedy)
    for _ in range(3):  # the greedy row decodes (a multi-step block, a look-ahead) before the beams arrive
        engine.step()
    assert engine.stats.multi_step_blocks + engine.stats.looked_ahead > 0
    reqs = [engine.add_request(f"b{i}", p, params) for i, p in enumerate(PROMPTS)]
    while any(not r.finished for r in [g, *reqs]):
        engine.step()
    _check_beams(hf, [engine.request_output(r) for r in reqs], params, tol=tol)
    alone = Engine(dev, config=EngineConfig(max_batch_size=1, block_size=4, max_model_len=32, decode_steps=1),
                   eos_token_id=STOPS).generate([[1, 4, 4, 9]], greedy)
    assert engine.request_output(g).outputs[0].token_ids == alone[0].outputs[0].token_ids
