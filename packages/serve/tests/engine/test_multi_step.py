"""Multi-step decode (``EngineConfig.decode_steps``): k steps per schedule give exactly the one-step engine's output."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig
from plyx.specs.errors import ConfigError


def _engine(lm, k, **kw):
    cfg = dict(max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=240, prefix_caching=False)
    cfg.update(kw)
    return Engine(lm, config=EngineConfig(decode_steps=k, **cfg))


def _prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def _params(count, stop=(), eos=False):
    """Greedy and seeded sampled rows (top-k, top-p, min_tokens), lengths that end inside blocks."""
    rng = random.Random(1)
    return [SamplingParams(temperature=0.0 if i % 2 else 0.9, top_k=20 if i % 3 == 0 else 0,
                           top_p=0.9 if i % 4 == 0 else 1.0, min_tokens=2 if i == 5 else 0, seed=100 + i,
                           max_new_tokens=rng.randrange(5, 23), stop_token_ids=stop, ignore_eos=not eos)
            for i in range(count)]


def _run(lm, k, prompts, params, eos=None, look_ahead=False):
    engine = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=240,
                                            prefix_caching=False, decode_steps=k, look_ahead=look_ahead),
                    eos_token_id=eos)
    outs = engine.generate(prompts, params)
    assert engine.cache.usage().blocks_used == 0  # finished rows' blocks (and their discarded tail) came back
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs], engine


def test_config_rejects_out_of_range():
    with pytest.raises(ConfigError, match="decode_steps"):
        EngineConfig(decode_steps=0)
    with pytest.raises(ConfigError, match="decode_steps"):
        EngineConfig(decode_steps=64)


@pytest.mark.parametrize("look_ahead", [False, True])
def test_blocks_equal_single_steps_with_stops_and_lengths_inside_blocks(lm, look_ahead):
    """Also with the look-ahead (CUDA's default): the next block is queued before the host reads this one, and
    rows that end by EOS or a stop id inside a block waste their share of the next."""
    prompts = _prompts(8, seed=21)
    plain, _ = _run(lm, 1, prompts, _params(8))
    # stop ids and EOS taken from the middle of the plain outputs: rows then finish mid-block
    common = Counter(t for ids, _, _ in plain for t in ids[2:]).most_common(2)
    stop, eos = common[0][0], common[1][0]
    params = _params(8, stop=(stop,), eos=True)
    want, _ = _run(lm, 1, prompts, params, eos=eos)
    got, engine = _run(lm, 4, prompts, params, eos=eos, look_ahead=look_ahead)
    assert got == want
    assert engine.stats.multi_step_blocks > 0
    assert (engine.stats.looked_ahead > 0) == look_ahead  # blocks queued before the host read the one before
    reasons = Counter(r for _, r, _ in want)
    assert reasons["stop"] >= 2 and reasons["length"] >= 1  # both kinds of ending happened
    assert any(len(ids) % 4 and r == "stop" for ids, r, _ in want)


@pytest.mark.parametrize("look_ahead", [False, True])
def test_arrival_and_abort_mid_block(lm, look_ahead):
    prompts = _prompts(4, seed=22)
    params = _params(4)
    params = [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed, max_new_tokens=30,
                             ignore_eos=True) for p in params]

    def drive(k):
        engine = _engine(lm, k, look_ahead=look_ahead and k > 1)
        got: dict[str, list[int]] = {}
        for i in range(3):
            engine.add_request(f"r{i}", prompts[i], params[i])
        aborted = False
        step = 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.event is not None:
                    got.setdefault(out.request_id, []).extend(out.event.token_ids)
            step += 1
            if step == 3:  # arrives while the others are decoding (inside a block when k > 1)
                engine.add_request("r3", prompts[3], params[3])
            if not aborted and len(got.get("r1", ())) >= 6:
                engine.abort("r1")
                aborted = True
        assert engine.cache.usage().blocks_used == 0
        return got, engine

    want, _ = drive(1)
    got, engine = drive(4)
    assert engine.stats.multi_step_blocks > 0 and (engine.stats.looked_ahead > 0) == look_ahead
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == want[rid] and len(got[rid]) == 30
    # the aborted request streamed a prefix of its own output (a block may have carried it further), then stopped
    full = _engine(lm, 1).generate([prompts[1]], params[1])[0].outputs[0].token_ids
    for stream in (want["r1"], got["r1"]):
        assert 6 <= len(stream) < 30 and list(full[:len(stream)]) == stream


@pytest.mark.parametrize("look_ahead", [False, True])
def test_a_full_batch_runs_blocks_while_requests_wait(lm, look_ahead):
    """More requests than the batch holds: blocks still run (nothing could be admitted anyway) and end where the
    first row ends by length, so the waiting request joins then; same outputs as one step at a time."""
    prompts = _prompts(7, seed=26)
    params = _params(7)
    want = [o.outputs[0].token_ids for o in _engine(lm, 1, max_batch_size=3).generate(prompts, params)]
    engine = _engine(lm, 4, max_batch_size=3, look_ahead=look_ahead)
    blocks_while_waiting = 0
    reqs = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    while engine.has_unfinished():
        before, waiting = engine.stats.multi_step_blocks, bool(engine.waiting)
        engine.step()
        blocks_while_waiting += waiting and engine.stats.multi_step_blocks > before
    assert [r.seqs[0].completion.output().token_ids for r in reqs] == want
    assert blocks_while_waiting > 0
    assert engine.cache.usage().blocks_used == 0


def test_rows_needing_host_logic_keep_one_step(lm):
    prompts = _prompts(3, seed=23)
    params = [SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=2)] + \
             [SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)] * 2
    want, _ = _run(lm, 1, prompts, params)
    got, engine = _run(lm, 4, prompts, params)
    assert got == want
    assert engine.stats.multi_step_blocks == 0  # the log-probs row is in every decode step


@pytest.mark.parametrize("look_ahead", [False, True])
def test_blocks_through_the_static_graph_step(lm, look_ahead):
    """The CUDA path, run eagerly on CPU (``DecodeGraphs(capture=False)``, what a graph replays): plain-greedy
    blocks take ``greedy_steps`` (k steps in one call), sampled blocks ``sample_steps`` (see
    test_multistep_sampling.py); with the
    look-ahead on (CUDA's default) the engine still reaches blocks. Same tokens as one step at a time."""
    from plyx.serve._graphs import DecodeGraphs

    prompts = _prompts(6, seed=24)
    greedy = SamplingParams(temperature=0, max_new_tokens=19, ignore_eos=True)
    sampled = [SamplingParams(temperature=0.8, top_k=30, seed=7 + i, max_new_tokens=13, ignore_eos=True)
               for i in range(len(prompts))]
    for params in (greedy, sampled):
        want = _engine(lm, 1).generate(prompts, params)
        engine = _engine(lm, 4, look_ahead=look_ahead)
        graphs = engine.graphs = DecodeGraphs(lm, engine.cache, max_batch=8, capture=False, max_query=4,
                                              buckets=[2, 4, 8])
        fused = []
        plain_steps = graphs.greedy_steps
        graphs.greedy_steps = lambda ids, tokens, k, fused=fused, run=plain_steps: fused.append(k) or run(ids, tokens, k)
        got = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert engine.stats.multi_step_blocks > 0 and graphs.steps > 0
        assert (4 in fused) if params is greedy else not fused  # greedy blocks: k steps in one (graph) call
        assert engine.cache.usage().blocks_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocks_replay_captured_graphs_on_cuda():
    """On a GPU (decode_steps defaults to 16 since serve 1.8): greedy blocks replay one captured k-step graph,
    sampled blocks one captured k-step graph with the sampling and stop checks in it; same tokens as one step
    per schedule.

    The model is one the Triton paged kernel takes (bf16, head_dim 64): the tiny fp32 head_dim-16 model of the
    CPU tests gets the plain-torch paged reference, which syncs with the host, so its steps cannot be captured
    (the engine then warns and runs them eagerly)."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=160,
                      init_std=0.5)
    model = TransformerLM(cfg).eval().to("cuda", torch.bfloat16)
    prompts = _prompts(6, seed=25)
    for params in (SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True),
                   [SamplingParams(temperature=0.8, top_k=50 if i % 2 else 0, top_p=0.9 if i % 3 else 1.0, seed=i,
                                   max_new_tokens=30, ignore_eos=True) for i in range(6)]):
        want = _engine(model, 1).generate(prompts, params)
        engine = Engine(model, config=EngineConfig(max_batch_size=8, max_batch_tokens=64, block_size=4,
                                                   num_blocks=240, prefix_caching=False))
        assert engine.decode_steps > 1 and engine.graphs is not None  # (the CUDA default, 16 since serve 1.8)
        got = engine.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert engine.stats.multi_step_blocks > 0 and engine.graphs.replays > 0
        # (bucket, query_len, greedy, steps, sampled): every block length was captured both ways at warm-up
        lengths = {1 << i for i in range(1, engine.decode_steps.bit_length())}
        assert {key[3] for key in engine.graphs._graphs if key[4]} == lengths
