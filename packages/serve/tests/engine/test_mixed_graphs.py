"""Mixed-step graphs (``MixedGraphs``): the bucketed, padded static step equals the unpadded packed step.

On CPU the static step runs without capture (the same code the graphs replay); on CUDA a captured
graph's outputs are compared with the eager packed step's.
"""

from __future__ import annotations

import random

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig
from plyx.serve.engine._mixed_graphs import MixedGraphs, mixed_buckets


def prompts_of(count, seed, lo=1, hi=60, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def test_buckets_are_multiples_of_16_and_cover_the_budget():
    b = mixed_buckets(2048)
    assert b[0] == 16 and b[-1] == 2048 and all(x % 16 == 0 for x in b)
    assert all(nxt / cur <= 2 for cur, nxt in zip(b, b[1:]))  # padding stays bounded
    assert mixed_buckets(100)[-1] == 112  # rounded up to a multiple of 16
    assert mixed_buckets(1) == [16]


def _run_arrivals(engine, prompts, sp):
    """Arrivals spread over the run, so most steps mix prefill chunks and decode rows; tokens and log-probs."""
    pending = list(enumerate(prompts))
    outs: dict[str, list] = {}
    lps: dict[str, list] = {}
    while pending or engine.has_unfinished():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(str(i), p, sp)
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.event.token_ids)
            if o.event.logprobs:
                lps.setdefault(o.request_id, []).extend(o.event.logprobs)
    return [outs[str(i)] for i in range(len(prompts))], [lps.get(str(i), []) for i in range(len(prompts))]


def test_engine_with_mixed_graph_path_matches_unpadded_packed_steps(lm):
    prompts = prompts_of(10, seed=5, lo=10, hi=50)
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=2)
    kw = dict(max_batch_size=10, max_batch_tokens=72, block_size=4, num_blocks=200, cuda_graphs=False)
    plain = Engine(lm, config=EngineConfig(mixed_graphs=False, **kw))
    bucketed = Engine(lm, config=EngineConfig(mixed_graphs=True, **kw))
    assert plain.mixed_graphs is None and bucketed.mixed_graphs is not None
    assert bucketed.mixed_graphs.buckets[-1] == 80  # 72 tokens rounded up: every step fits
    toks_p, lps_p = _run_arrivals(plain, prompts, sp)
    toks_b, lps_b = _run_arrivals(bucketed, prompts, sp)
    assert toks_b == toks_p
    for a, b in zip(lps_b, lps_p):
        for x, y in zip(a, b):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
    assert bucketed.mixed_graphs.steps == bucketed.stats.steps  # every step took the bucketed path


def test_token_budget_is_capped_at_the_largest_bucket_so_every_step_replays(lm, monkeypatch):
    """A budget above the largest bucket (``MAX_GRAPH_TOKENS``) would send big steps to the eager path (and a
    GPU to compiling mid-serving): the scheduler caps each step at the largest bucket instead."""
    import plyx.serve.engine._mixed_graphs as mg

    monkeypatch.setattr(mg, "MAX_GRAPH_TOKENS", 32)
    prompts = prompts_of(6, seed=9, lo=30, hi=60)
    sp = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    kw = dict(max_batch_size=6, max_batch_tokens=128, block_size=4, num_blocks=200, cuda_graphs=False)
    capped = Engine(lm, config=EngineConfig(mixed_graphs=True, **kw))
    assert capped.mixed_graphs.max_tokens == 32
    toks_c, _ = _run_arrivals(capped, prompts, sp)
    toks_p, _ = _run_arrivals(Engine(lm, config=EngineConfig(mixed_graphs=False, **kw)), prompts, sp)
    assert toks_c == toks_p
    assert capped.mixed_graphs.steps == capped.stats.steps  # no step fell back to the eager packed forward


def test_speculative_rows_and_preemption_through_the_bucketed_step(lm):
    """Prompt-lookup drafts ride in the bucketed step as extra tokens (verified from every fed position's
    output), and a pool small enough to preempt: tokens equal to the unpadded packed engine's."""
    rng = random.Random(4)
    motif = [rng.randrange(256) for _ in range(6)]
    prompts = [motif * 4 + [rng.randrange(256) for _ in range(rng.randrange(1, 8))] for _ in range(6)]
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    kw = dict(max_batch_size=6, max_batch_tokens=48, block_size=4, num_blocks=24, max_model_len=64,
              prefix_caching=False, cuda_graphs=False, speculative_ngram=3,
              spec_policy="always")
    runs = {}
    for mixed in (False, True):
        engine = Engine(lm, config=EngineConfig(mixed_graphs=mixed, **kw))
        runs[mixed] = (_run_arrivals(engine, prompts, sp)[0], engine.stats)
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].spec_drafted > 0 and runs[True][1].preemptions > 0


def _two_engines(model, **kw):
    return [Engine(model, config=EngineConfig(mixed_graphs=m, **kw)) for m in (False, True)]


@pytest.mark.parametrize("counts", [[1, 1, 1, 9], [1] * 7 + [16], [5, 12], [3]])
def test_static_step_hidden_states_equal_begin_packed_step(lm, counts):
    """Every fed token's hidden state (not only the sampled ones), padding in the bucket included: equal to
    the unpadded packed forward on the same cache contents, and the cache holds the same keys afterwards."""
    from plyx.attn import begin_packed_step

    rng = random.Random(sum(counts))
    kw = dict(max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=120, cuda_graphs=False)
    results = []
    for use_static in (False, True):
        engine = Engine(lm, config=EngineConfig(mixed_graphs=False, **kw))
        cache = engine.cache
        rng.seed(7)
        history = [[rng.randrange(256) for _ in range(rng.randrange(0, 14))] for _ in counts]
        new = [[rng.randrange(256) for _ in range(n)] for n in counts]
        with torch.inference_mode():
            for sid, toks in enumerate(history):  # cached context of each sequence
                if toks:
                    ids, pos, step = begin_packed_step(cache, [sid], [len(toks)], toks, engine.device)
                    lm(ids, position_ids=pos, kv_step=step)
            flat = [t for row in new for t in row]
            if use_static:
                graphs = MixedGraphs(lm, cache, max_tokens=64, max_rows=8, capture=False, return_hidden=True)
                hidden = graphs.step(list(range(len(counts))), counts, flat).clone()  # [N, D]
                assert graphs.bucket(len(flat)) % 16 == 0
            else:
                ids, pos, step = begin_packed_step(cache, list(range(len(counts))), counts, flat, engine.device)
                hidden = lm(ids, position_ids=pos, kv_step=step, return_hidden=True)[0]  # [N, D]
            keys = [cache.read(0, sid)[0].clone() for sid in range(len(counts))]
        results.append((hidden, keys))
    (h0, k0), (h1, k1) = results
    assert h0.shape == h1.shape == (sum(counts), lm.config.d_model)
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    for a, b in zip(k1, k0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_prepare_rejects_a_step_over_the_largest_bucket(lm):
    engine = Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=32, block_size=4, num_blocks=80,
                                            cuda_graphs=False, mixed_graphs=True))
    graphs = engine.mixed_graphs
    assert not graphs.fits(1, 33) and graphs.fits(4, 32) and not graphs.fits(5, 8)
    with pytest.raises(ValueError, match="does not fit"):
        graphs.prepare([0], [33], list(range(33)))
    assert engine.cache.sequences() == []  # nothing reserved


def _filled_cache(model, counts, seed):
    """An engine's paged cache (its geometry) holding a random history per sequence; the step's new tokens."""
    from plyx.attn import begin_packed_step

    engine = Engine(model, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=16, num_blocks=64,
                                               cuda_graphs=False, mixed_graphs=False))
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    history = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 40))] for _ in counts]
    new = [t for n in counts for t in (rng.randrange(vocab) for _ in range(n))]
    with torch.inference_mode():
        for sid, toks in enumerate(history):
            if toks:
                ids, pos, step = begin_packed_step(engine.cache, [sid], [len(toks)], toks, engine.device)
                model(ids, position_ids=pos, kv_step=step)
    return engine.cache, new


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("counts", [[1] * 5 + [23], [1] * 12 + [7, 30], [40]])
def test_cuda_mixed_graph_outputs_equal_the_eager_static_step_and_the_packed_step(counts):
    """bf16 on the GPU: a captured graph's hidden states (every bucket captured by warm_up first, so the replay
    is of a graph captured on other data) equal the same static step run eagerly, and the unpadded eager packed
    step to bf16 rounding."""
    from plyx.attn import begin_packed_step
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=256)
    model = TransformerLM(config).to("cuda", torch.bfloat16).eval()
    outs = {}
    for mode in ("graph", "static", "packed"):
        cache, new = _filled_cache(model, counts, seed=len(counts))
        seq_ids = list(range(len(counts)))
        with torch.inference_mode():
            if mode == "packed":
                ids, pos, step = begin_packed_step(cache, seq_ids, counts, new, torch.device("cuda"))
                outs[mode] = model(ids, position_ids=pos, kv_step=step, return_hidden=True)[0].float()
            else:
                graphs = MixedGraphs(model, cache, max_tokens=64, max_rows=16, capture=mode == "graph",
                                     return_hidden=True)
                if mode == "graph":
                    graphs.warm_up()
                    assert graphs.captured == graphs.buckets
                outs[mode] = graphs.step(seq_ids, counts, new).float().clone()
                assert graphs.replays == (1 if mode == "graph" else 0)
    torch.testing.assert_close(outs["graph"], outs["static"], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(outs["graph"], outs["packed"], rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_engine_replays_mixed_graphs_and_first_tokens_match_the_eager_engine():
    """Whole serving-like runs (arrivals while others decode), bf16: every bucket captured at start, mixed steps
    replayed, and each request's first token (sampled from its prompt's last position, computed in a mixed
    step) has the eager packed engine's log-prob to bf16 rounding."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=256)
    model = TransformerLM(config).to("cuda", torch.bfloat16).eval()
    prompts = prompts_of(16, seed=3, lo=8, hi=120, vocab=512)
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=1)
    kw = dict(max_batch_size=16, max_batch_tokens=256, block_size=16, num_blocks=400, look_ahead=False)
    eager, graphed = _two_engines(model, **kw)
    assert eager.mixed_graphs is None
    assert graphed.mixed_graphs.captured == graphed.mixed_graphs.buckets  # every bucket captured at start
    toks_e, lps_e = _run_arrivals(eager, prompts, sp)
    toks_g, lps_g = _run_arrivals(graphed, prompts, sp)
    assert graphed.mixed_graphs.replays > 0
    assert all(len(t) == 6 for t in toks_g)
    for a, b in zip(lps_g, lps_e):
        assert abs(a[0].logprob - b[0].logprob) < 0.05
