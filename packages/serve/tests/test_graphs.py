"""The graphed decode step (``DecodeGraphs``): its static inputs give what the ordinary forward gives.

On CPU the static step runs eagerly (``capture=False``): the same buffers, padding rows, slot writes and
block-table reads that a captured graph replays. The CUDA tests capture and replay for real.
"""

from __future__ import annotations

import pytest
import torch
from plyx.attn import StaticDecode, make_cache
from plyx.serve import SamplingParams, generate
from plyx.serve._graphs import DecodeGraphs, default_buckets
from plyx.serve._reference import reference_generate
from plyx.specs.errors import ConfigError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _prefill(model, cache, prompts):
    width = max(len(p) for p in prompts)
    device = next(model.parameters()).device
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    seq_ids = list(range(10, 10 + len(prompts)))
    logits = model(ids, attention_mask=mask, cache=cache, seq_ids=seq_ids)[:, -1]
    return seq_ids, logits.argmax(-1)


def _decode_both(model, cache, graphs, seq_ids, tokens, steps):
    """``steps`` greedy decode steps through the ordinary forward on ``cache`` and through ``graphs``: same logits."""
    for _ in range(steps):
        want = model(tokens[:, None], cache=cache, seq_ids=seq_ids)[:, -1]
        torch.testing.assert_close(graphs.step(seq_ids, tokens), want, rtol=1e-5, atol=1e-5)
        tokens = want.argmax(-1)


def _assert_same_cache(model, caches, seq_ids):
    """Every layer's keys, values and lengths of ``seq_ids`` agree between the two caches."""
    for layer in range(model.config.n_layers):
        for sid in seq_ids:
            a, b = caches[0].read(layer, sid), caches[1].read(layer, sid)
            torch.testing.assert_close(b[0], a[0])
            torch.testing.assert_close(b[1], a[1])
            assert caches[1].length(sid) == caches[0].length(sid) == a[0].shape[0]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("buckets", [None, [2, 5]])
def test_static_step_matches_the_ordinary_forward(make_model, kind, buckets):
    """Logits and cache contents of five decode steps, rows of different lengths, batch padded to a bucket."""
    model = make_model(vocab=96, seed=3)
    g = torch.Generator().manual_seed(int(kind == "paged"))
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (5, 17, 9)]
    caches = [make_cache(kind, model.config, batch_size=4, max_seq_len=48, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, caches[0], prompts)
        _prefill(model, caches[1], prompts)
        graphs = DecodeGraphs(model, caches[1], max_batch=5 if buckets else 3, capture=False, buckets=buckets)
        _decode_both(model, caches[0], graphs, seq_ids, tokens, 5)
    _assert_same_cache(model, caches, seq_ids)


@pytest.mark.parametrize("lengths", [(11,), (4, 13)], ids=["batch1", "batch2"])
def test_static_step_with_norms_fused_into_projections(make_model, monkeypatch, lengths):
    """At <= 2 rows the input RMSNorm runs inside the packed q/k/v projection (rmsnorm_linear) and the SwiGLU
    inside the down projection (swiglu_linear): the same logits and cache contents as the ordinary forward."""
    from plyx.model import _model

    calls = []
    original = _model._optional_kernel

    def spy(name, *tensors, **shape):
        calls.append((name, shape["rows"]))
        return original(name, *tensors, **shape)

    monkeypatch.setattr(_model, "_optional_kernel", spy)
    model = make_model(vocab=96, seed=12)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in lengths]
    caches = [make_cache("paged", model.config, batch_size=2, max_seq_len=48, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, caches[0], prompts)
        _prefill(model, caches[1], prompts)
        graphs = DecodeGraphs(model, caches[1], max_batch=2, capture=False)
        _decode_both(model, caches[0], graphs, seq_ids, tokens, 3)
    rows = len(lengths)
    assert calls.count(("rmsnorm_linear", rows)) == 3 * model.config.n_layers  # every layer's q/k/v
    assert calls.count(("swiglu_linear", rows)) == 3 * model.config.n_layers  # every layer's down projection
    _assert_same_cache(model, caches, seq_ids)


def test_static_step_without_the_fused_kernels_takes_the_plain_path(make_model, monkeypatch):
    """An older plyx-kernel (no rope_store_kv, no rmsnorm_linear): the static step falls back, same logits."""
    from plyx.attn import _attention
    from plyx.model import _model
    from plyx.specs.kernels import KernelNotFoundError

    real = _attention.kernel
    missing = ("rope_store_kv", "rmsnorm_linear", "swiglu_linear")

    def older(name, *tensors, **shape):
        if name in missing:
            raise KernelNotFoundError(f"no kernel named {name!r}")
        return real(name, *tensors, **shape)

    monkeypatch.setattr(_attention, "kernel", older)
    monkeypatch.setattr(_model, "_kernel", older)
    model = make_model(vocab=96, seed=14)
    caches = [make_cache("paged", model.config, batch_size=1, max_seq_len=32, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, caches[0], [[5, 9, 2, 7]])
        _prefill(model, caches[1], [[5, 9, 2, 7]])
        graphs = DecodeGraphs(model, caches[1], max_batch=1, capture=False)
        _decode_both(model, caches[0], graphs, seq_ids, tokens, 3)


def test_padding_rows_repeat_row_zero(make_model):
    model = make_model(vocab=64)
    cache = make_cache("paged", model.config, batch_size=4, max_seq_len=32, dtype=torch.float32)
    decode = StaticDecode(cache, max_batch=4)
    for sid, n in ((0, 3), (1, 20)):
        cache.allocate(sid)
        cache.reserve([sid], [n])
    decode.prepare([1, 0], [7, 8], bucket=4)  # host ints ride in the packed copy
    assert decode.row_map.tolist() == [0, 1, 0, 0]
    assert decode.positions.tolist() == [20, 3, 20, 20]
    assert decode.lens.tolist() == [21, 4, 21, 21]
    bs = cache.block_size
    blocks = list(cache.seq_blocks(1))
    assert decode.slots[0].item() == blocks[20 // bs] * bs + 20 % bs
    assert decode.slots[2].item() == decode.slots[3].item() == decode.slots[0].item()
    assert decode.tables[3, :len(blocks)].tolist() == blocks
    ids, positions, step = decode.inputs(4)
    assert ids[:, 0].tolist() == [7, 8, 7, 7]
    assert positions[:, 0].tolist() == [20, 3, 20, 20]


def test_a_prompt_chunk_fills_rows_of_query_len_tokens(make_model):
    model = make_model(vocab=64)
    cache = make_cache("paged", model.config, batch_size=4, max_seq_len=64, dtype=torch.float32)
    decode = StaticDecode(cache, max_batch=4, max_query=4)
    cache.allocate(0)
    cache.reserve([0], [14])
    cache.allocate(1)
    decode.prepare([1, 0], [[5, 6, 7], [8, 9, 10]], bucket=3, query_len=3)
    ids, positions, step = decode.inputs(3, query_len=3)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 10], [5, 6, 7]]  # the padding row repeats row 0
    assert positions.tolist() == [[0, 1, 2], [14, 15, 16], [0, 1, 2]]
    assert decode.lens[:3].tolist() == [3, 17, 3]
    bs, blocks = cache.block_size, list(cache.seq_blocks(0))
    assert step.slots[3:6].tolist() == [blocks[p // bs] * bs + p % bs for p in (14, 15, 16)]
    with pytest.raises(ValueError, match="query_len 5 is outside"):
        decode.prepare([1], [[1] * 5], bucket=1, query_len=5)
    with pytest.raises(ValueError, match="rows of exactly query_len=3"):
        decode.prepare([1, 0], [[1, 2, 3], [4, 5]], bucket=2, query_len=3)


def test_prefill_chunk_sizes(make_model):
    # 8 query heads per key/value head: a 32-token chunk is 256 rows, two of the paged kernel's row tiles
    model = make_model(vocab=64, n_heads=8, n_kv_heads=1)
    cache = make_cache("paged", model.config, batch_size=2, max_seq_len=512, dtype=torch.float32)
    graphs = DecodeGraphs(model, cache, max_batch=2, capture=False)
    assert graphs.max_query == 32
    assert graphs.chunks(1, 32) == [32]  # a typical short prompt: one replay
    assert graphs.chunks(1, 69) == [32, 32, 4, 1]
    assert graphs.chunks(2, 15) == [8, 4, 2, 1]
    assert graphs.chunks(1, 1) is None  # a one-token prompt is a decode step's business
    assert graphs.chunks(3, 20) is None  # above the largest bucket
    assert graphs.chunks(1, 32 * 12) is not None and graphs.chunks(1, 32 * 12 + 1) is None  # 13 replays: eager


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("length,heads", [(23, None), (40, (8, 1))], ids=["23-tokens", "40-tokens-gqa8"])
def test_prefill_through_chunks_matches_the_ordinary_forward(make_model, kind, length, heads):
    """Three prompts of 23 tokens (chunks 16, 4, 2, 1) or of 40 with 8 query heads per key/value head
    (chunks 32 -- 256 query rows, two row tiles of the paged kernel -- and 8); bucket 4 with a padding row:
    the last logits, the cache contents and the decode steps after them equal an eager, left-padded forward's."""
    model = make_model(vocab=96, seed=4, **({"n_heads": heads[0], "n_kv_heads": heads[1]} if heads else {}))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 96, (length,), generator=g).tolist() for _ in range(3)]
    caches = [make_cache(kind, model.config, batch_size=4, max_seq_len=64, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, caches[0], prompts)
        graphs = DecodeGraphs(model, caches[1], max_batch=4, capture=False, buckets=[4])
        want = model(torch.tensor(prompts), cache=make_cache(kind, model.config, batch_size=3, max_seq_len=64,
                                                             dtype=torch.float32))[:, -1]
        got = graphs.prefill(seq_ids, prompts)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert graphs.steps == len(graphs.chunks(3, length)) == (4 if length == 23 else 2)
        _decode_both(model, caches[0], graphs, seq_ids, tokens, 3)
    _assert_same_cache(model, caches, seq_ids)


def test_prefill_declines_ragged_rows_and_keeps_the_cache_on_failure(make_model):
    model = make_model(vocab=64)
    cache = make_cache("paged", model.config, batch_size=2, max_seq_len=32, dtype=torch.float32)
    graphs = DecodeGraphs(model, cache, max_batch=2, capture=False)
    assert graphs.prefill([0, 1], [[1, 2, 3], [4, 5]]) is None and not cache.sequences()
    cache.allocate(7)
    cache.reserve([7], [20])
    # chunks 8, 4, 1: sequence 7 holds 28 and 32 tokens after the first two, the third exceeds max_seq_len
    with pytest.raises(ValueError, match="more than max_seq_len=32"):
        graphs.prefill([7, 8], [[1] * 13, [2] * 13])
    assert graphs.steps == 2
    assert sorted(cache.sequences()) == [7] and cache.length(7) == 20  # all or nothing, as an eager forward


def test_contiguous_cache_seen_as_blocks(make_model):
    """The contiguous slab addressed by block: slot ids land where ``read`` finds them."""
    model = make_model(vocab=64)
    cache = make_cache("contiguous", model.config, batch_size=3, max_seq_len=40, dtype=torch.float32)
    assert cache.block_size == 8  # the largest power of two <= 16 dividing 40
    cache.allocate(5)
    cache.allocate(6)
    cache.reserve([6], [11])
    k_blocks, _ = cache.kv_blocks(0)
    assert k_blocks.shape[:2] == (3 * 40 // 8, 8)
    assert list(cache.seq_blocks(6)) == [5, 6]  # row 1 starts at block 40 // 8 = 5; 11 tokens: 2 blocks
    assert k_blocks.data_ptr() == cache._k[0].data_ptr()  # a view, not a copy


def test_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(128) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128]
    assert default_buckets(100)[-2:] == [96, 100]


def test_unsupported_cache_is_named(make_model):
    model = make_model(vocab=64)

    class Opaque:
        layout = make_cache("paged", model.config, batch_size=1, max_seq_len=16).layout

    with pytest.raises(TypeError, match="lacks block_size, kv_blocks, seq_blocks"):
        StaticDecode(Opaque(), max_batch=1)


def test_cuda_graphs_true_on_cpu_is_a_clear_error(make_model):
    model = make_model(vocab=64)
    with pytest.raises(ConfigError, match="not a CUDA device"):
        generate(model, [[1, 2, 3]], SamplingParams(temperature=0, max_new_tokens=2), cuda_graphs=True)


def test_generate_with_a_graph_step_equals_without(make_model):
    """generate's Runner with the (eager) static step gives the same greedy tokens as the ordinary step."""
    from plyx.serve import _runner

    model = make_model(vocab=96, seed=5)
    prompts = [[3, 4, 5, 6], [9, 8], [1, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(temperature=0, max_new_tokens=12)
    want = [o.outputs[0].token_ids for o in reference_generate(model, prompts, params, cache="paged")]

    made = []
    original = _runner.Runner._decode_graphs

    def eager_graphs(self, wanted, num_sequences):
        made.append(DecodeGraphs(self.model, self.cache, max_batch=num_sequences, capture=False))
        return made[-1]

    _runner.Runner._decode_graphs = eager_graphs
    try:
        for kind in ("paged", "contiguous"):
            got = [o.outputs[0].token_ids for o in reference_generate(model, prompts, params, cache=kind)]
            assert got == want, kind
    finally:
        _runner.Runner._decode_graphs = original
    assert len(made) == 2


def test_generate_prefills_equal_prompts_through_chunk_steps(make_model, monkeypatch):
    """Prompts of one length go through DecodeGraphs.prefill (4 chunk steps for 29 tokens), same tokens."""
    from plyx.serve import _runner

    model = make_model(vocab=96, seed=6)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 96, (29,), generator=g).tolist() for _ in range(2)]
    params = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in reference_generate(model, prompts, params, cache="paged")]
    made = []

    def eager_graphs(self, wanted, num_sequences):
        made.append(DecodeGraphs(self.model, self.cache, max_batch=num_sequences, capture=False))
        return made[-1]

    monkeypatch.setattr(_runner.Runner, "_decode_graphs", eager_graphs)
    for kind in ("paged", "contiguous"):
        got = [o.outputs[0].token_ids for o in reference_generate(model, prompts, params, cache=kind)]
        assert got == want, kind
    assert [m.steps for m in made] == [4 + 5, 4 + 5]  # chunks 16, 8, 4, 1, then 5 decode steps


@cuda
@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_captured_graphs_replay_the_eager_steps(make_model, kind):
    # the Triton kernels take bf16 and head_dim >= 32 (tiny heads get the reference, which cannot be captured)
    model = make_model(vocab=128, d_model=256, seed=7).to("cuda", torch.bfloat16)
    prompts = [[5, 6, 7], list(range(1, 30)), [9, 10, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_new_tokens=20)
    eager = generate(model, prompts, params, cache=kind, cuda_graphs=False)
    graphed = generate(model, prompts, params, cache=kind, cuda_graphs=True)
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


@cuda
def test_captured_prefill_chunks_replay_the_eager_forward(make_model):
    model = make_model(vocab=128, d_model=256, seed=7).to("cuda", torch.bfloat16)
    prompts = [list(range(3, 72)), list(range(50, 119))]  # 69 tokens each: chunks 32, 32, 4, 1
    with torch.inference_mode():
        eager_cache = make_cache("paged", model.config, batch_size=2, max_seq_len=96, device="cuda",
                                 dtype=torch.bfloat16)
        want = model(torch.tensor(prompts, device="cuda"), cache=eager_cache)[:, -1]
        cache = make_cache("paged", model.config, batch_size=4, max_seq_len=96, device="cuda", dtype=torch.bfloat16)
        graphs = DecodeGraphs(model, cache, max_batch=2)
        first = graphs.prefill([0, 1], prompts).clone()  # captures the 32, 4 and 1 chunk graphs, replays 32 once
        again = graphs.prefill([2, 3], prompts)  # replays all four chunks
        assert graphs.replays == 1 + 4 and graphs.captured == [2]
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        # bf16 through other kernels (flash attention over the whole prompt): rounding-level differences
        torch.testing.assert_close(first, want, rtol=0.05, atol=0.05 * float(want.abs().max()))


@cuda
def test_graphs_are_captured_once_per_bucket(make_model):
    model = make_model(vocab=128, d_model=256, seed=8).to("cuda", torch.bfloat16)
    cache = make_cache("paged", model.config, batch_size=4, max_seq_len=64, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, cache, [[1, 2, 3], [4, 5], [6]])
        graphs = DecodeGraphs(model, cache, max_batch=4)
        for _ in range(4):
            tokens = graphs.step(seq_ids, tokens).argmax(-1)
    assert graphs.captured == [4] and graphs.replays == 3


@cuda
def test_a_step_that_cannot_be_captured_falls_back_to_eager(make_model):
    """float32 on CUDA: paged attention is the reference (it syncs with the host), so capture fails."""
    model = make_model(vocab=128, seed=9).cuda()
    prompts = [[5, 6, 7], [9, 10]]
    params = SamplingParams(temperature=0, max_new_tokens=6)
    eager = reference_generate(model, prompts, params, cache="paged", cuda_graphs=False)
    with pytest.warns(RuntimeWarning, match="capture of the decode step failed"):
        graphed = reference_generate(model, prompts, params, cache="paged")
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]


def _engine_outputs(model, graphs: bool, prompts, params):
    from plyx.serve.engine import Engine, EngineConfig

    engine = Engine(model, config=EngineConfig(max_batch_size=4, max_batch_tokens=64, num_blocks=40,
                                               max_model_len=64))
    if graphs:  # the CPU stand-in for what CUDA gets: the static step, run eagerly
        engine.graphs = DecodeGraphs(engine.model, engine.cache, max_batch=4, capture=False)
        engine._mixed = 0
    outs = engine.generate(prompts, params)
    return [c.token_ids for o in outs for c in o.outputs], engine


def test_engine_with_static_decode_steps_equals_without(make_model):
    """Continuous batching (admissions mid-run, prefix sharing, n=2 forks) through the static step."""
    model = make_model(vocab=96, seed=11)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(1, 96, (20,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 96, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6, 2)]
    params = [SamplingParams(temperature=0, max_new_tokens=m, n=2 if m == 7 else 1, ignore_eos=True)
              for m in (5, 12, 7, 3, 9, 10)]
    want, _ = _engine_outputs(model, False, prompts, params)
    got, engine = _engine_outputs(model, True, prompts, params)
    assert got == want
    assert engine.graphs.steps > 10  # the decodes went through the static step


def test_looking_ahead_one_step_changes_no_output(make_model, monkeypatch, tokenizer, tok_model):
    """The CUDA loop queues step N + 1 before it reads step N's tokens; forced on here (CPU), every output
    -- rows ending by EOS, by stop string, by length, n > 1, log-probs -- is what the plain loop gives."""
    from plyx.serve import _reference

    model = make_model(vocab=96, seed=12)
    prompts = [[3, 4, 5, 6], [9, 8], [1, 2, 3, 4, 5, 6, 7], [40]]
    params = [SamplingParams(temperature=0, max_new_tokens=m, logprobs=2 if m == 9 else None) for m in (9, 3, 14, 6)]
    params.append(SamplingParams(temperature=0.8, seed=4, n=3, max_new_tokens=10))
    prompts.append([7, 7, 7])

    def run(eos):
        outs = reference_generate(model, prompts, params, eos_token_id=eos, cache="paged")
        return [(c.token_ids, c.finish_reason, c.logprobs) for o in outs for c in o.outputs]

    monkeypatch.setattr(_reference, "_looks_ahead", lambda device: False)
    free = run([95])
    eos = [free[0][0][2], free[2][0][4]]  # two rows end early by EOS, mid-batch
    want = run(eos)
    assert {r[1] for r in want} == {"stop", "length"}  # both kinds of ending are exercised
    monkeypatch.setattr(_reference, "_looks_ahead", lambda device: True)
    assert run(eos) == want
    text = dict(prompts="hello world, the", params=SamplingParams(temperature=0, max_new_tokens=12, stop=["o"]))
    monkeypatch.setattr(_reference, "_looks_ahead", lambda device: False)
    want_text = reference_generate(tok_model, [text["prompts"]], text["params"], tokenizer=tokenizer)[0].outputs[0]
    monkeypatch.setattr(_reference, "_looks_ahead", lambda device: True)
    got_text = reference_generate(tok_model, [text["prompts"]], text["params"], tokenizer=tokenizer)[0].outputs[0]
    assert (got_text.text, got_text.token_ids) == (want_text.text, want_text.token_ids)


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
@pytest.mark.parametrize("steps", [2, 5])
def test_greedy_steps_equal_one_step_at_a_time(make_model, kind, steps):
    """K greedy steps in one (eager) static run choose the tokens K single steps choose, padding rows
    included, and leave the same keys, values and lengths in the cache."""
    model = make_model(vocab=96, seed=21)
    prompts = [[3, 4, 5, 6], [9, 8], [1, 2, 3, 4, 5, 6, 7]]
    with torch.inference_mode():
        caches = [make_cache(kind, model.config, batch_size=4, max_seq_len=40) for _ in range(2)]
        seq_ids, tokens = _prefill(model, caches[0], prompts)
        _prefill(model, caches[1], prompts)
        want = []
        step_tokens = tokens
        for _ in range(steps):
            step_tokens = model(step_tokens[:, None], cache=caches[0], seq_ids=seq_ids)[:, -1].argmax(-1)
            want.append(step_tokens)
        graphs = DecodeGraphs(model, caches[1], max_batch=4, capture=False, buckets=[4])
        got = graphs.greedy_steps(seq_ids, tokens, steps)
        assert got.shape == (3, steps)
        assert got.tolist() == torch.stack(want, dim=1).tolist()
        _assert_same_cache(model, caches, seq_ids)
        assert graphs.steps == steps
        with pytest.raises(ValueError, match="steps must be in"):
            graphs.greedy_steps(seq_ids, got[:, -1], graphs.max_query + 1)


def test_plain_greedy_runs_several_steps_per_replay(make_model, monkeypatch):
    """With graphs and look-ahead (forced on here, eagerly on CPU), plain greedy rows go GREEDY_STEPS at a
    time: rows ending by EOS inside a group, by length at different limits and a row whose budget is
    not a power of two all end with the tokens and reasons of the one-step loop; a sampled request in
    the same call keeps one step per replay."""
    from plyx.serve import _reference, _runner

    model = make_model(vocab=96, seed=22)
    prompts = [[3, 4, 5, 6], [9, 8], [1, 2, 3, 4, 5, 6, 7]]
    params = [SamplingParams(temperature=0, max_new_tokens=m) for m in (19, 30, 13)]

    def run(eos):
        outs = reference_generate(model, prompts, params, eos_token_id=eos, cache="paged")
        return [(c.token_ids, c.finish_reason) for o in outs for c in o.outputs]

    free = run([95])
    eos = [free[0][0][10]]  # row 0 ends by EOS in the middle of its second group of 8
    want = run(eos)
    assert want[0][1] == "stop" and len(want[0][0]) == 11 and "length" in {r[1] for r in want}
    made, groups = [], []

    def eager_graphs(self, wanted, num_sequences):
        made.append(DecodeGraphs(self.model, self.cache, max_batch=num_sequences, capture=False))
        original = made[-1].greedy_steps
        made[-1].greedy_steps = lambda ids, tokens, steps: groups.append(steps) or original(ids, tokens, steps)
        return made[-1]

    monkeypatch.setattr(_runner.Runner, "_decode_graphs", eager_graphs)
    monkeypatch.setattr(_reference, "_looks_ahead", lambda device: True)
    assert run(eos) == want
    assert groups and max(groups) == _reference.GREEDY_STEPS and all(g & (g - 1) == 0 for g in groups)
    groups.clear()
    sampled = reference_generate(model, [[5, 5]], SamplingParams(temperature=0.7, seed=1, max_new_tokens=6), cache="paged")
    assert len(sampled[0].outputs[0].token_ids) == 6 and not groups  # sampling: one step per replay


@cuda
def test_graphs_are_reused_by_the_next_call_of_the_same_shape(make_model):
    model = make_model(vocab=128, d_model=256, seed=10).to("cuda", torch.bfloat16)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    first = reference_generate(model, [[1, 2, 3]], params, cache="paged")
    from plyx.serve._runner import _SPARES

    (_, cache, graphs), = _SPARES[model].values()
    assert graphs.captured == [1] and not cache.sequences()
    captured, replays = set(graphs._graphs), graphs.replays
    again = reference_generate(model, [[1, 2, 3]], params, cache="paged")
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    # the second call replayed the first call's graphs (prompt chunks 2 + 1, then decode groups 4, 2, 1), capturing none
    assert set(graphs._graphs) == captured and graphs.replays == replays + 5
    reference_generate(model, [[1, 2, 3]], params, cache="contiguous")  # another shape: kept beside the first
    replays = graphs.replays
    reference_generate(model, [[1, 2, 3]], params, cache="paged")
    assert graphs.replays > replays and len(_SPARES[model]) == 2
    with torch.no_grad():  # new weights at new addresses: the spare graphs must not be used
        for p in model.parameters():
            p.data = p.data * 1.5
    reference_generate(model, [[1, 2, 3]], params, cache="paged")
    newer = _SPARES[model][("paged", 1, 16)][2]
    assert newer is not graphs


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_static_step_with_packed_projections_per_architecture(arch, tmp_path):
    """q/k/v biases (qwen2) and QK-norm (qwen3) through the packed GEMVs; the packed weights save and load."""
    from plyx.model import TransformerLM, load_hf, save_hf
    from plyx.specs import ModelConfig

    torch.manual_seed(1)
    config = ModelConfig(arch=arch, vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                         max_seq_len=64, qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    model = TransformerLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)  # non-trivial biases and norm weights
    caches = [make_cache("paged", config, batch_size=2, max_seq_len=48, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, caches[0], [[3, 4, 5], [6, 7, 8, 9, 10]])
        _prefill(model, caches[1], [[3, 4, 5], [6, 7, 8, 9, 10]])
        graphs = DecodeGraphs(model, caches[1], max_batch=2, capture=False)
        from plyx.attn import packed_linear

        layer = model.layers[0]
        assert packed_linear((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)) is not None
        assert packed_linear((layer.mlp.gate_proj, layer.mlp.up_proj)) is not None
        _decode_both(model, caches[0], graphs, seq_ids, tokens, 3)
    save_hf(model, tmp_path / "packed")  # shared storage must not trouble the writer
    again = load_hf(tmp_path / "packed")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_greedy_tokens_from_the_graph_change_no_output(make_model, monkeypatch):
    """Plain greedy rows take the argmax computed in the step's graph (here: its eager stand-in) instead of
    sampling after it; tokens, finish reasons and EOS endings are those of the plain loop."""
    from plyx.serve import _reference, _runner

    model = make_model(vocab=96, seed=13)
    prompts = [[3, 4, 5, 6], [9, 8], [1, 2, 3, 4, 5, 6, 7], [40]]
    params = [SamplingParams(temperature=0, max_new_tokens=m) for m in (9, 3, 14, 6)]

    def run(eos):
        outs = reference_generate(model, prompts, params, eos_token_id=eos, cache="paged")
        return [(c.token_ids, c.finish_reason) for o in outs for c in o.outputs]

    free = run([95])
    eos = [free[0][0][2], free[2][0][4]]
    want = run(eos)
    calls = []  # steps whose tokens came from the graph: 1 per greedy_step, K per greedy_steps
    original, original_k = _runner.Runner.greedy_step, _runner.Runner.greedy_steps

    def counting(self, seq_ids, tokens):
        calls.append(1)
        return original(self, seq_ids, tokens)

    def counting_k(self, seq_ids, tokens, steps):
        calls.append(steps)
        return original_k(self, seq_ids, tokens, steps)

    monkeypatch.setattr(_runner.Runner, "_decode_graphs",
                        lambda self, wanted, n: DecodeGraphs(self.model, self.cache, max_batch=n, capture=False))
    monkeypatch.setattr(_runner.Runner, "greedy_step", counting)
    monkeypatch.setattr(_runner.Runner, "greedy_steps", counting_k)
    monkeypatch.setattr(_reference, "_looks_ahead", lambda device: True)
    assert run(eos) == want
    assert sum(calls) >= 3  # every look-ahead step of the run (rows end by EOS after a few tokens)
    calls.clear()
    sampled = [SamplingParams(temperature=0, max_new_tokens=4, repetition_penalty=1.3)]  # a processor: not plain
    reference_generate(model, [[3, 4]], sampled, cache="paged")
    assert not calls


def test_warm_up_runs_every_bucket_and_block_length_and_leaves_the_cache_as_it_was(make_model):
    """``warm_up`` runs one-step and multi-step graphs for every bucket on a scratch sequence that it frees: the
    cache keeps only the real sequences, and decoding them afterwards gives what it gives without a warm-up."""
    model = make_model(vocab=96, seed=5)
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    caches = [make_cache("paged", model.config, batch_size=4, max_seq_len=48, dtype=torch.float32) for _ in range(2)]
    with torch.inference_mode():
        seq_ids, tokens = _prefill(model, caches[0], prompts)
        _prefill(model, caches[1], prompts)
        graphs = DecodeGraphs(model, caches[1], max_batch=3, capture=False, buckets=[1, 3], max_query=4)
        free = caches[1].num_free_blocks()
        assert graphs.warm_up([2, 4, 8]) >= 0  # 8 > max_query: skipped
        assert graphs.steps == 0  # warm-up steps are not counted as served steps
        assert sorted(caches[1].sequences()) == sorted(seq_ids) and caches[1].num_free_blocks() == free
        _decode_both(model, caches[0], graphs, seq_ids, tokens, 3)
    _assert_same_cache(model, caches, seq_ids)
