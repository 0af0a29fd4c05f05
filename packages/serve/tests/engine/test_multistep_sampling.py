"""Sampling and stop checks inside multi-step blocks (``DecodeGraphs.sample_steps``, ``engine._sampling``).

The graph path runs eagerly on CPU (``DecodeGraphs(capture=False)``: what a CUDA graph replays). Seeded rows
draw each token's uniform from Philox-4x32-10 keyed by (seed, token index), so ``decode_steps`` 1 and 4 give
the same tokens; the draw is checked against the exact distribution of the processed logits."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve import _processors as P
from plyx.serve._graphs import DecodeGraphs
from plyx.serve.engine import Engine, EngineConfig
from plyx.serve.engine import _sampling as S

_CFG = dict(max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=240, prefix_caching=False)


def _prompts(count, seed):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(count)]


def _engine(lm, k, graphs=True, look_ahead=False, eos=None, tokenizer=None, **kw):
    engine = Engine(lm, config=EngineConfig(decode_steps=k, look_ahead=look_ahead, **{**_CFG, **kw}),
                    eos_token_id=eos, tokenizer=tokenizer)
    if graphs:  # the CUDA path's static steps, eagerly
        engine.graphs = DecodeGraphs(lm, engine.cache, max_batch=engine.config.max_batch_size, capture=False,
                                     max_query=max(1, k), buckets=[2, 4, 8])
    return engine


def _spy(engine):
    """Counts the sampled k-step calls (one graph replay each on CUDA)."""
    calls = []
    run = engine.graphs.sample_steps
    engine.graphs.sample_steps = lambda *a: calls.append(a[2]) or run(*a)
    return calls


def _mixed(count, stop=(), eos=False, seed=1):
    """Seeded rows with temperature, top-k, top-p, min-p and min_tokens, one greedy row; lengths end mid-block."""
    rng = random.Random(seed)
    return [SamplingParams(temperature=0.0 if i == 3 else 0.7 + 0.1 * (i % 3), top_k=(0, 20, 50)[i % 3],
                           top_p=(1.0, 0.9, 0.8)[i % 3], min_p=0.05 if i % 4 == 1 else 0.0,
                           min_tokens=3 if i == 5 else 0, seed=1000 + i, max_new_tokens=rng.randrange(5, 23),
                           stop_token_ids=stop, ignore_eos=not eos) for i in range(count)]


def _ids(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


def test_philox_matches_the_random123_known_answers():
    counter = np.array([[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]],
                       dtype=np.uint64)
    key = np.array([[0, 0], [0xFFFFFFFF] * 2, [0xA4093822, 0x299F31D0]], dtype=np.uint64)
    got = [[int(x) for x in row] for row in S.philox4x32(counter, key)]
    assert got == [[0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
                   [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
                   [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]]


def test_uniforms_depend_on_seed_and_index_alone():
    index = np.arange(64)
    alone = S.row_uniforms([7], index[None])[0]
    batched = S.row_uniforms([3, 7, 2**64 - 1], np.stack([index[::-1], index, index]))
    assert np.array_equal(batched[1], alone)  # other rows (and their indices) change nothing
    assert not np.array_equal(batched[2], alone) and not np.array_equal(S.row_uniforms([8], index[None])[0], alone)
    many = S.row_uniforms(list(range(200)), np.tile(np.arange(50), (200, 1)))  # [200, 50]
    assert many.min() >= 0 and many.max() < 1
    counts = np.histogram(many, bins=20, range=(0, 1))[0]  # 10,000 draws: chi-square with 19 dof
    assert ((counts - 500) ** 2 / 500).sum() < 43.8  # p = 0.001


def test_row_windows_serve_the_same_uniforms():
    """``seq_uniforms`` (windows of ``UNIFORM_WINDOW`` tokens per row, refilled when a request runs past one)
    gives exactly ``row_uniforms`` at every index, for blocks crossing a window's end."""
    from types import SimpleNamespace

    rows = [SimpleNamespace(seed=s, uniforms=None) for s in (3, 99, 2**63 + 5)]
    start = np.array([0, 10, 60])
    for _ in range(12):
        k = 1 + int(start[0]) % 7
        got = S.seq_uniforms(rows, start, k)
        want = S.row_uniforms([r.seed for r in rows], start[:, None] + np.arange(k))
        assert np.array_equal(got, want)
        start = start + k


def _reference(logits, temperature, top_k, top_p, min_p, penalties=None, seen=None):
    """The pipeline's own processors (transformers' warper semantics); ``penalties``: (repetition, presence,
    frequency) per row, over ``seen`` (prompt masks, output counts)."""
    if seen is None:
        seen = (torch.zeros_like(logits, dtype=torch.bool), torch.zeros_like(logits, dtype=torch.int32))
    state = P.SamplingState(*seen, torch.zeros(logits.shape[0], dtype=torch.long), [None] * logits.shape[0])
    procs = [P.Temperature(temperature), P.TopK(top_k), P.TopP(top_p), P.MinP(min_p)]
    if penalties is not None:
        rep, pres, freq = zip(*penalties)
        procs = [P.RepetitionPenalty(list(rep)), P.PresenceFrequencyPenalty(list(pres), list(freq))] + procs
    for proc in procs:
        logits = proc(logits, state)
    return logits


def _packed(rows, stops=None):
    """``RowParams`` of rows given as {column: value} over the neutral row; ``stops``: per row, its stop ids."""
    packed = np.stack([S.RowParams.padding() for _ in rows])
    for i, row in enumerate(rows):
        for name, value in row.items():
            packed[i, S._COLS.index(name)] = value
        for j, stop in enumerate((stops or {}).get(i, ())):
            packed[i, len(S._COLS) + j] = stop
    return S.RowParams(torch.from_numpy(packed))


def _params(rows):
    return _packed([dict(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in rows])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tensor_processing_is_the_pipelines(seed):
    """The same logits as the pipeline's processors, bit for bit (top-p reuses top-k's sort)."""
    torch.manual_seed(seed)
    rows = [(0.7, 0, 1.0, 0.0), (1.3, 5, 0.9, 0.0), (0.5, 0, 0.6, 0.1), (1.0, 40, 0.95, 0.02), (0.9, 3, 1.0, 0.0)]
    logits = torch.randn(len(rows), 64 if seed == 0 else 1000) * 3
    got = S.process_rows(logits, _params(rows), torch.zeros(len(rows), dtype=torch.long))
    want = _reference(logits, *[[r[j] for r in rows] for j in range(4)])
    assert torch.equal(got, want)
    logits = logits[:, :64]
    # with penalties over random prompt masks and output counts
    penalties = [(1.3, 0.0, 0.0), (1.0, 0.5, 0.2), (0.8, -0.3, 0.7), (1.0, 0.0, 0.0), (1.5, 1.0, 1.0)]
    seen = (torch.rand(len(rows), 64) < 0.2, torch.randint(0, 3, (len(rows), 64), dtype=torch.int32))
    rp = _packed([dict(temperature=t, top_k=k, top_p=p, min_p=m, repetition_penalty=r, presence_penalty=pr,
                       frequency_penalty=f) for (t, k, p, m), (r, pr, f) in zip(rows, penalties)])
    got = S.process_rows(logits, rp, torch.zeros(len(rows), dtype=torch.long), seen=seen)
    want = _reference(logits, *[[r[j] for r in rows] for j in range(4)], penalties=penalties, seen=seen)
    assert torch.equal(got, want)


def test_eager_stages_equal_the_graphs_with_tied_logits():
    """bf16 logits tie often: an eager step skips the stages no row needs (here top-k), the graph runs them all;
    top-p sees the tied tokens in the same order both ways, so both keep the same tokens."""
    torch.manual_seed(3)
    logits = (torch.randn(64, 1000) * 2).bfloat16().float()  # [64, 1000], ~200 distinct values per row
    rp = _params([(1.0, 0, 0.1 + 0.0125 * i, 0.0) for i in range(64)])
    generated = torch.zeros(64, dtype=torch.long)
    graph = S.process_rows(logits, rp, generated)
    eager = S.process_rows(logits, rp, generated, (False, False, False, False, True, False))
    assert torch.equal(graph, eager)
    assert (graph.isinf().sum(-1) > 0).all()  # top-p removed tokens in every row
    # (an ascending sort of its own would order the ties otherwise: some rows would keep other tokens)
    values, order = logits.sort(dim=-1)
    remove = values.softmax(dim=-1).cumsum(dim=-1) <= (1 - rp.top_p)
    remove[:, -1] = False
    own = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    assert not torch.equal(own.isinf(), graph.isinf())


@pytest.mark.parametrize("row", [(0.8, 0, 1.0, 0.0), (0.7, 6, 0.9, 0.0), (1.2, 0, 0.8, 0.05)])
def test_draws_follow_the_processed_distribution(row, chi_square_p):
    """Chi-square of 20,000 draws (one uniform per (seed, index)) against the exact softmax of the processed
    logits; tokens the processors removed are never drawn."""
    torch.manual_seed(1)
    logits = torch.randn(1, 16)
    want = _reference(logits, [row[0]], [row[1]], [row[2]], [row[3]]).softmax(-1)[0].double()
    n = 20000
    u = torch.from_numpy(S.row_uniforms(list(range(n)), np.full(n, 5)))  # [n]
    rp = _params([row] * n)
    tokens = S.sample_rows_tensor(logits.expand(n, -1), rp, torch.zeros(n, dtype=torch.long), u)
    counts = torch.bincount(tokens, minlength=16).double()
    assert counts[want == 0].sum() == 0
    keep = want > 0
    assert keep.sum() >= 4  # a distribution worth testing
    assert chi_square_p(counts, want) > 1e-3


def test_block_count_stops_at_the_first_stop_or_the_limit():
    rp = _packed([dict(generated=2, limit=100), dict(generated=2, limit=5), dict(generated=0, limit=100)],
                 stops={0: (9, 4), 1: (3,)})
    tokens = torch.tensor([[1, 4, 9, 4], [2, 2, 2, 3], [5, 6, 7, 8]])
    assert S.block_count(tokens, rp).tolist() == [2, 3, 4]


@pytest.mark.parametrize("look_ahead", [False, True])
def test_sampled_blocks_equal_single_steps(lm, look_ahead):
    """Seeded temperature/top-k/top-p/min-p/min_tokens rows and a greedy row; EOS, a stop id and max_tokens
    finishing rows inside blocks: the same tokens as one step per schedule, the blocks run by sample_steps."""
    prompts = _prompts(8, seed=31)
    plain = _ids(_engine(lm, 1, graphs=False).generate(prompts, _mixed(8)))
    common = Counter(t for ids, _, _ in plain for t in ids[2:]).most_common(2)
    stop, eos = common[0][0], common[1][0]
    params = _mixed(8, stop=(stop,), eos=True)
    want = _ids(_engine(lm, 1, graphs=False, eos=eos).generate(prompts, params))
    engine = _engine(lm, 4, look_ahead=look_ahead, eos=eos)
    calls = _spy(engine)
    assert _ids(engine.generate(prompts, params)) == want
    assert 4 in calls and engine.stats.multi_step_blocks > 0
    assert (engine.stats.looked_ahead > 0) == look_ahead
    assert engine.cache.usage().blocks_used == 0
    reasons = Counter(r for _, r, _ in want)
    assert reasons["stop"] >= 2 and reasons["length"] >= 1
    assert any(len(ids) % 4 and r == "stop" for ids, r, _ in want)  # a stop inside a block


def test_a_seed_gives_its_tokens_alone_or_batched(lm):
    prompts = _prompts(6, seed=32)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=50 + i, max_new_tokens=17, ignore_eos=True)
              for i in range(6)]
    batched = _ids(_engine(lm, 4).generate(prompts, params))
    for i in (0, 4):
        assert _ids(_engine(lm, 4).generate([prompts[i]], params[i])) == [batched[i]]
        assert _ids(_engine(lm, 1, graphs=False).generate([prompts[i]], params[i])) == [batched[i]]


@pytest.mark.parametrize("look_ahead", [False, True])
def test_arrival_and_abort_mid_sampled_block(lm, look_ahead):
    prompts = _prompts(4, seed=33)
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=70 + i, max_new_tokens=30, ignore_eos=True)
              for i in range(4)]

    def drive(k):
        engine = _engine(lm, k, graphs=k > 1, look_ahead=look_ahead and k > 1)
        calls = _spy(engine) if k > 1 else []
        got: dict[str, list[int]] = {}
        for i in range(3):
            engine.add_request(f"r{i}", prompts[i], params[i])
        aborted, step = False, 0
        while engine.has_unfinished():
            for out in engine.step():
                if out.event is not None:
                    got.setdefault(out.request_id, []).extend(out.event.token_ids)
            step += 1
            if step == 3:  # arrives while the others decode (inside a block when k > 1)
                engine.add_request("r3", prompts[3], params[3])
            if not aborted and len(got.get("r1", ())) >= 6:
                engine.abort("r1")
                aborted = True
        assert engine.cache.usage().blocks_used == 0
        return got, calls

    want, _ = drive(1)
    got, calls = drive(4)
    assert calls
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == want[rid] and len(got[rid]) == 30
    full = _engine(lm, 1, graphs=False).generate([prompts[1]], params[1])[0].outputs[0].token_ids
    for stream in (want["r1"], got["r1"]):
        assert 6 <= len(stream) < 30 and list(full[:len(stream)]) == stream


@pytest.mark.parametrize("case", ["logit_bias", "capture_failed"])
def test_rows_the_graph_cannot_sample_take_k_eager_steps(lm, case):
    """A logit-bias row is not a tensor row, and a failed capture of the sampled graph turns
    ``DecodeGraphs.sampling`` off: such blocks run k one-token steps (sampled on the device in between), still
    the same tokens as one step per schedule."""
    prompts = _prompts(3, seed=34)
    params = [SamplingParams(temperature=0.8, seed=5 + i, max_new_tokens=12, ignore_eos=True,
                             logit_bias={7: 2.0} if i == 0 and case == "logit_bias" else None) for i in range(3)]
    want = _ids(_engine(lm, 1, graphs=False).generate(prompts, params))
    engine = _engine(lm, 4)
    engine.graphs.sampling = case != "capture_failed"
    calls = _spy(engine)
    assert _ids(engine.generate(prompts, params)) == want
    assert not calls and engine.stats.multi_step_blocks > 0


def test_stop_strings_are_checked_on_the_host_after_the_block(bpe_lm, bpe):
    lm, tok = bpe_lm, bpe
    prompts = [bpe.encode("hello world").ids, bpe.encode("the quick brown").ids]
    base = [SamplingParams(temperature=0.9, seed=9 + i, max_new_tokens=24, ignore_eos=True) for i in range(2)]
    plain = _engine(lm, 1, graphs=False, tokenizer=tok).generate(prompts, base)
    text = plain[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # ends row 0 in the middle of its output
    params = [SamplingParams(temperature=0.9, seed=9 + i, max_new_tokens=24, ignore_eos=True, stop=(stop,))
              for i in range(2)]
    want = _engine(lm, 1, graphs=False, tokenizer=tok).generate(prompts, params)
    engine = _engine(lm, 4, tokenizer=tok)
    got = engine.generate(prompts, params)
    assert [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in want]
    assert want[0].outputs[0].finish_reason == "stop" and engine.stats.multi_step_blocks > 0
    assert engine.cache.usage().blocks_used == 0


@pytest.mark.parametrize("graphs", [True, False])
def test_penalised_rows_run_blocks_with_counts_on_the_device(lm, graphs):
    """Repetition, presence and frequency penalties (greedy and seeded rows): each step of a block sees the
    counts of the block's earlier tokens; the same tokens as one step per schedule, with and without the graph
    path, and with the look-ahead (the next block counts this one's tokens before the host reads them)."""
    prompts = _prompts(5, seed=35)
    params = [SamplingParams(temperature=0.0 if i == 0 else 0.9, top_k=30 if i % 2 else 0, seed=300 + i,
                             repetition_penalty=1.0 if i == 3 else 1.4, presence_penalty=0.6 if i % 2 else 0.0,
                             frequency_penalty=0.4 if i > 2 else 0.0, max_new_tokens=18, ignore_eos=True)
              for i in range(5)]
    want = _ids(_engine(lm, 1, graphs=False).generate(prompts, params))
    for look_ahead in (False, True):
        engine = _engine(lm, 4, graphs=graphs, look_ahead=look_ahead and graphs)
        calls = _spy(engine) if graphs else []
        assert _ids(engine.generate(prompts, params)) == want
        assert engine.stats.multi_step_blocks > 0 and bool(calls) == graphs
    # the penalties change the output (else this test would show nothing)
    plain = [SamplingParams(temperature=p.temperature, top_k=p.top_k, seed=p.seed, max_new_tokens=18, ignore_eos=True)
             for p in params]
    assert _ids(_engine(lm, 1, graphs=False).generate(prompts, plain)) != want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampled_blocks_replay_one_captured_graph_on_cuda():
    """On a GPU (decode_steps 8; graphs and the look-ahead on by default): penalised, top-k/top-p/min-p,
    min_tokens and greedy rows, stop ids and lengths ending mid-block, replay the captured sampled k-step graphs
    and give the tokens of one step per schedule. The model is one the Triton paged kernel takes (bf16,
    head_dim 64), as in test_multi_step.py's CUDA test."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=512, max_seq_len=160,
                      init_std=0.5)
    model = TransformerLM(cfg).eval().to("cuda", torch.bfloat16)
    prompts = _prompts(6, seed=36)
    params = _mixed(6, stop=(17, 99))
    params[2] = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                               seed=7, max_new_tokens=37, ignore_eos=True)
    kw = dict(max_batch_size=8, max_batch_tokens=64, block_size=4, num_blocks=240, prefix_caching=False)
    want = _ids(Engine(model, config=EngineConfig(decode_steps=1, **kw)).generate(prompts, params))
    engine = Engine(model, config=EngineConfig(decode_steps=8, **kw))
    assert engine.graphs is not None and engine.look_ahead
    calls = _spy(engine)
    replays = engine.graphs.replays
    assert _ids(engine.generate(prompts, params)) == want
    assert calls and engine.graphs.replays > replays
    assert {key[3] for key in engine.graphs._graphs if key[4]} == {2, 4, 8}  # captured at warm-up
    assert engine.cache.usage().blocks_used == 0
