"""Multi-step decode's host side: a block's tokens streamed in fewer events (``stream_interval``), and blocks that
keep their length when the pool is short but the prefix cache holds blocks nobody else reads."""

from __future__ import annotations

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig


def _engine(lm, k, *, prefix, num_blocks, look_ahead=False, stream_interval=1):
    return Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=64, block_size=4, num_blocks=num_blocks,
                                          max_model_len=64, prefix_caching=prefix, decode_steps=k,
                                          look_ahead=look_ahead, stream_interval=stream_interval))


def _drive(engine, prompts, params):
    """Step to the end; (each request's streamed token ids, each request's event count, schedules run)."""
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    streamed: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    events: dict[str, int] = dict.fromkeys(streamed, 0)
    calls = 0
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += list(out.event.token_ids)
            events[out.request_id] += 1
        calls += 1
    assert [r.seqs[0].completion.token_ids for r in reqs] == [streamed[r.request_id] for r in reqs]
    return [streamed[r.request_id] for r in reqs], [events[r.request_id] for r in reqs], calls


@pytest.mark.parametrize("look_ahead", [False, True])
def test_stream_interval_groups_a_blocks_tokens_into_fewer_events(lm, look_ahead):
    """Same tokens as one step per schedule; with ``stream_interval=1`` one event per token in blocks too, with
    k a row's block streams in events of up to k tokens, with 0 (the default) one event per block."""
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14], [20, 21]]
    params = SamplingParams(temperature=0, max_new_tokens=21, ignore_eos=True)
    want, one_events, _ = _drive(_engine(lm, 1, prefix=False, num_blocks=64), prompts, params)
    assert one_events == [21, 21, 21]
    got, events, calls = _drive(_engine(lm, 4, prefix=False, num_blocks=64, look_ahead=look_ahead), prompts, params)
    assert got == want and events == one_events and calls < 21  # blocks ran, still one event per token
    for every, most in ((4, 8), (2, 13), (0, 8)):
        engine = _engine(lm, 4, prefix=False, num_blocks=64, look_ahead=look_ahead, stream_interval=every)
        got, events, _ = _drive(engine, prompts, params)
        assert got == want
        # the first token (prefill), then blocks of up to 4 in events of up to ``every`` tokens
        assert all(e <= most for e in events), (every, events)
        assert engine.cache.usage().blocks_used == 0


def test_stream_interval_with_stops_inside_blocks(lm):
    """Rows that end by a stop id or EOS inside an event's tokens keep exactly the one-step output."""
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14], [20, 21], [3, 4, 5, 6]]
    free = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    plain, _, _ = _drive(_engine(lm, 1, prefix=False, num_blocks=96), prompts, free)
    stop = plain[0][5]  # a token one row emits mid-way: rows stop at it (some inside a block's event)
    params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=(stop,), ignore_eos=True)
    want, _, _ = _drive(_engine(lm, 1, prefix=False, num_blocks=96), prompts, params)
    assert len(want[0]) == 6 and any(len(w) == 24 for w in want)
    engine = _engine(lm, 8, prefix=False, num_blocks=96, stream_interval=3)
    got, _, _ = _drive(engine, prompts, params)
    assert got == want and engine.stats.multi_step_blocks > 0
    assert engine.cache.usage().blocks_used == 0


def test_stream_interval_must_not_be_negative():
    from plyx.specs.errors import ConfigError

    with pytest.raises(ConfigError, match="stream_interval"):
        EngineConfig(stream_interval=-1)


def test_blocks_evict_prefix_blocks_instead_of_shrinking(lm):
    """A pool that the rows fill near their end, beside prompt blocks only the prefix cache holds: blocks evict
    those (as many as the one-step engine evicts on its way to the same tokens) and keep their length, so the
    run takes as many schedules as with the prefix cache off (before, blocks shrank to single steps there)."""
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    prompts = [list(range(50, 55 + i)) for i in range(4)]  # staggered lengths: rows cross blocks at different steps

    def run(k, prefix):
        engine = _engine(lm, k, prefix=prefix, num_blocks=50)  # 4 rows end holding 48 blocks
        engine.generate([list(range(1, 41))], SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True))
        held = engine.cache.usage().blocks_used  # the first prompt's 10 blocks, held by the prefix cache alone
        tokens, _, calls = _drive(engine, prompts, params)
        evicted = engine.prefix.evicted_blocks if engine.prefix is not None else 0
        return held, tokens, calls, evicted

    held, want, one_calls, one_evicted = run(1, True)
    assert held == 10 and one_calls == 40 and one_evicted > 0  # the one-step engine had to evict too
    _, plain, plain_calls, _ = run(4, False)
    _, got, calls, evicted = run(4, True)
    assert got == want == plain
    assert calls == plain_calls  # no block shortened for lack of room
    assert evicted == one_evicted  # and no prefix block evicted that the one-step engine kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_block_reads_reuse_one_pinned_buffer_on_cuda():
    from .conftest import small_lm

    model = small_lm().to("cuda")
    engine = Engine(model, config=EngineConfig(max_batch_size=4, max_batch_tokens=64, block_size=4, num_blocks=128,
                                               prefix_caching=False, decode_steps=4))
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14]]
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in Engine(model, config=EngineConfig(
        max_batch_size=4, max_batch_tokens=64, block_size=4, num_blocks=128, prefix_caching=False,
        decode_steps=1)).generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in engine.generate(prompts, params)] == want
    reader = engine._block_reader
    assert all(b.is_pinned() for b in reader.buffers.values()) and len(reader.buffers) <= 3  # one per block shape


def test_the_look_ahead_goes_on_for_the_rows_left_when_one_ends_by_length(lm, monkeypatch):
    """Rows of different lengths, nothing waiting: when a row ends by length inside a block, the next block is
    still queued before the host reads this one, for the rows that go on; only the first block is scheduled
    afresh (``run_block``). Same tokens as one step at a time."""
    import plyx.serve.engine._engine as engine_module

    prompts = [[7, 8, 9], [10, 11, 12, 13, 14], [20, 21]]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (9, 13, 21)]
    want = [o.outputs[0].token_ids for o in _engine(lm, 1, prefix=False, num_blocks=64).generate(prompts, params)]
    fresh = []
    run = engine_module.run_block
    monkeypatch.setattr(engine_module, "run_block", lambda *a: fresh.append(a[2]) or run(*a))
    engine = _engine(lm, 4, prefix=False, num_blocks=64, look_ahead=True)
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert fresh == [4]  # one block scheduled afresh; every later block was queued ahead
    assert engine.stats.multi_step_blocks >= 5 and engine.cache.usage().blocks_used == 0


def test_min_tokens_in_blocks_queued_ahead(lm):
    """A block queued before the host read the one before it counts that block's tokens as generated: EOS is
    allowed from exactly ``min_tokens`` on, as one step at a time allows it (greedy and seeded sampled rows)."""
    from collections import Counter

    prompts = [[7, 8, 9], [10, 11, 12, 13, 14], [20, 21], [3, 4, 5, 6]]

    def run(k, look_ahead, eos, min_tokens=13):
        params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, seed=i, min_tokens=min_tokens, max_new_tokens=30,
                                 ignore_eos=eos is None) for i in range(len(prompts))]
        engine = Engine(lm, config=EngineConfig(max_batch_size=4, max_batch_tokens=64, block_size=4, num_blocks=96,
                                                max_model_len=64, prefix_caching=False, decode_steps=k,
                                                look_ahead=look_ahead), eos_token_id=eos)
        outs = engine.generate(prompts, params)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], engine

    free, _ = run(1, False, None, 0)
    # an EOS that one step at a time suppresses before min_tokens and takes after it in some row
    for eos, _ in Counter(t for ids, _ in free for t in ids[:13]).most_common(8):
        want, _ = run(1, False, eos)
        if any(r == "stop" for _, r in want):
            break
    assert any(r == "stop" and len(ids) >= 13 for ids, r in want)
    assert all(len(ids) >= 13 for ids, _ in want)
    got, engine = run(4, True, eos)
    assert got == want
    assert engine.stats.looked_ahead > 0


def test_default_pool_holds_the_batch_and_the_copy_on_write_block(lm):
    """``num_blocks=0`` sizes the pool the engine's own minimum accepts, at any batch size (one included)."""
    from plyx.specs.errors import ConfigError

    engine = Engine(lm, config=EngineConfig(max_batch_size=1, block_size=16, prefix_caching=False))
    per_seq = -(-engine.max_model_len // 16)
    assert engine.cache.layout.num_blocks == per_seq + 1
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ConfigError, match="copy-on-write block"):
        Engine(lm, config=EngineConfig(max_batch_size=1, block_size=16, num_blocks=per_seq))
