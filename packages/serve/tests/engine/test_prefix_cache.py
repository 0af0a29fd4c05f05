"""Prefix caching: shared prompt prefixes are computed once, outputs do not change, LRU eviction spares blocks in use."""

from __future__ import annotations

import random

from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig, PrefixCache


def prompts_with_system(count, system_len=40, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(system_len)]
    return system, [system + [rng.randrange(256) for _ in range(rng.randrange(1, 15))] for _ in range(count)]


def run(lm, prompts, *, prefix, num_blocks=128, sequential=False):
    engine = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=4,
                                            num_blocks=num_blocks, prefix_caching=prefix))
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    if sequential:
        outs = [engine.generate([p], sp)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, sp)
    return engine, [o.outputs[0].token_ids for o in outs]


def test_system_prompt_is_computed_once_and_outputs_are_unchanged(lm):
    system, prompts = prompts_with_system(6)
    off, want = run(lm, prompts, prefix=False, sequential=True)
    on, got = run(lm, prompts, prefix=True, sequential=True)
    assert got == want
    # the 40-token system prompt (10 full blocks) is computed by the first request only
    saved = off.stats.prompt_tokens - on.stats.prompt_tokens
    assert saved == 5 * 40
    assert on.prefix.hit_tokens == 5 * 40
    assert on.prefix.hit_rate == on.prefix.hit_tokens / sum(len(p) for p in prompts)


def test_whole_prompt_hit_still_computes_its_last_token(lm):
    _, prompts = prompts_with_system(1, system_len=40)
    prompt = prompts[0][:40]  # exactly 10 full blocks
    on, got = run(lm, [prompt, prompt, prompt], prefix=True, sequential=True)
    _, want = run(lm, [prompt], prefix=False)
    assert got == want * 3
    assert on.prefix.hit_tokens == 2 * 36  # at most len - 1 tokens come from the cache, in whole blocks


def test_hits_while_the_first_request_still_runs(lm):
    _, prompts = prompts_with_system(8, seed=1)
    _, want = run(lm, prompts, prefix=False)
    on, got = run(lm, [prompts[0]] + prompts[1:], prefix=True)
    assert got == want


def _blocks_in_use(engine):
    return {b for s in engine.running for b in engine.cache.blocks(s.seq_id)}


def test_eviction_under_pressure_is_lru_and_never_frees_blocks_in_use(lm):
    rng = random.Random(2)
    # many distinct 32-token prompts fill the prefix cache, then pressure forces evictions while requests run
    prompts = [[rng.randrange(256) for _ in range(32)] for _ in range(30)]
    engine = Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=32, block_size=4, num_blocks=60,
                                            max_model_len=64))
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    results = {}
    while engine.has_unfinished():
        outs = engine.step()
        free = {b for b in range(60) if engine.cache.refcount(b) == 0}
        for o in outs:
            results.setdefault(o.request_id, []).extend(o.event.token_ids)
        # a block a live sequence holds is never on the free list
        assert not (_blocks_in_use(engine) & free)
    assert engine.prefix.evicted_blocks > 0
    _, want = run(lm, prompts, prefix=False)
    assert [tuple(results[str(i)]) for i in range(len(prompts))] == [tuple(w) for w in want]
    engine.prefix.clear()
    assert engine.cache.usage().blocks_free == 60  # nothing leaked


def test_prefix_cache_lru_order_and_refcount_guard(lm):
    from plyx.attn import PagedKVCache, cache_layout

    cache = PagedKVCache(cache_layout(lm.config, max_seq_len=64, block_size=4, num_blocks=32))
    pc = PrefixCache(cache, block_size=4)
    a, b, c = list(range(1, 9)), list(range(101, 109)), list(range(201, 209))  # 2 blocks each
    for sid, toks in ((0, a), (1, b), (2, c)):
        cache.allocate(sid)
        cache.reserve([sid], [8])
        pc.insert(sid, toks, computed=8)
    cache.evict(1)  # b and c finished: their blocks are held by the prefix cache alone
    cache.evict(2)
    assert len(pc) == 6 and cache.num_free_blocks() == 32 - 6
    pc.match(a, max_tokens=8)  # a is the most recent, then b; c is the least recently used
    pc.match(b, max_tokens=8)
    pc.match(a, max_tokens=8)
    assert pc.evict(1) == 1  # a is running (its blocks have refcount 2): c's leaf goes, LRU
    assert len(pc.match(c, max_tokens=8)) == 1 and len(pc.match(b, max_tokens=8)) == 2
    assert pc.evict(10) == 3  # c's first block, then b's two; a's blocks are in use
    assert len(pc.match(a, max_tokens=8)) == 2 and cache.num_free_blocks() == 32 - 2
    cache.evict(0)  # a finished
    assert pc.evict(10) == 2 and cache.num_free_blocks() == 32 and len(pc) == 0
