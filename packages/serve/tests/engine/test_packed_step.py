"""The packed (varlen) step: one forward per engine step, the same outputs as one forward per group of rows."""

from __future__ import annotations

import json
import random

import pytest
import torch
from plyx.serve import SamplingParams, StructuredOutput
from plyx.serve.engine import Engine, EngineConfig


def prompts_of(count, seed, lo=1, hi=60, vocab=256):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def both(model, config_kw, run, **engine_kw):
    """``run(engine)`` on the packed engine and on the per-group engine (the path before packing)."""
    out = {}
    for packed in (True, False):
        engine = Engine(model, config=EngineConfig(packed_step=packed, **config_kw), **engine_kw)
        assert engine.packed is packed
        out[packed] = run(engine)
    return out[True], out[False]


def completions(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_logprobs_close(packed, grouped):
    """Same chosen tokens and top ids; log-probabilities equal to float32 rounding (one GEMM over N tokens sums in
    another order than one per group)."""
    for a, b in zip(packed, grouped):
        for ca, cb in zip(a.outputs, b.outputs):
            if ca.logprobs is None or cb.logprobs is None:
                assert ca.logprobs is cb.logprobs  # not asked for
                continue
            assert len(ca.logprobs) == len(cb.logprobs)
            for x, y in zip(ca.logprobs, cb.logprobs):
                assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
                assert abs(x.logprob - y.logprob) < 1e-4


def test_packed_step_runs_one_forward_per_step_and_matches_grouped(lm):
    prompts = prompts_of(12, seed=11, lo=20, hi=60)
    sp = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=2)
    kw = dict(max_batch_size=12, max_batch_tokens=64, block_size=4, num_blocks=160)
    calls = []
    hook = lm.register_forward_pre_hook(lambda *a: calls.append(1))
    mixed_steps = []

    def run(engine):
        calls.clear()
        pending = list(enumerate(prompts))
        outs = {}
        mixed = 0
        while pending or engine.has_unfinished():
            if pending:  # arrivals spread over the run: prompts are prefilled while others decode
                i, p = pending.pop(0)
                engine.add_request(str(i), p, sp)
            decoding = sum(1 for s in engine.running if s.pending == 1)
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.event.token_ids)
            mixed += int(0 < decoding < engine.stats.last_batch_seqs)
        mixed_steps.append(mixed)
        return engine.stats.steps, len(calls), [tuple(outs[str(i)]) for i in range(len(prompts))]

    try:
        (steps_p, forwards_p, toks_p), (steps_g, forwards_g, toks_g) = both(lm, kw, run)
    finally:
        hook.remove()
    assert toks_p == toks_g
    assert mixed_steps[0] > 3  # steps that held prefill chunks and decode rows together
    assert forwards_p == steps_p  # one forward per step, mixed steps included
    assert forwards_g > steps_g  # the grouped path runs a second forward on mixed steps


def test_packed_equals_grouped_under_chunking_preemption_and_prefix_caching(lm):
    prefix = prompts_of(1, seed=20, lo=24, hi=25)[0]  # a shared system prompt: prefix-cache hits
    prompts = [prefix + p for p in prompts_of(16, seed=21, lo=1, hi=40)]
    rng = random.Random(22)
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 20), ignore_eos=True, logprobs=1)
              for _ in prompts]
    # budget 16: chunked prefill; 30 blocks of 4 for 8 sequences of up to 96 tokens: preemption
    kw = dict(max_batch_size=8, max_batch_tokens=16, block_size=4, num_blocks=30, max_model_len=96)

    def run(engine):
        outs = engine.generate(prompts, params)
        return outs, engine.stats.preemptions, engine.prefix.hit_tokens

    (packed, pre_p, hit_p), (grouped, pre_g, hit_g) = both(lm, kw, run)
    assert pre_p > 0 and pre_g > 0 and hit_p > 0 and hit_g > 0
    assert completions(packed) == completions(grouped)
    assert_logprobs_close(packed, grouped)


def test_packed_matches_uncached_reference(lm):
    """Ground truth without any cache: full recomputation of every prefix."""
    prompts = prompts_of(5, seed=30, lo=2, hi=50)
    engine = Engine(lm, config=EngineConfig(max_batch_size=5, max_batch_tokens=24, block_size=4, num_blocks=128))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(8):
                ids.append(int(lm(torch.tensor([ids]))[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]


def test_packed_per_request_sampling_and_n_completions(lm):
    prompts = prompts_of(6, seed=40, lo=4, hi=30)
    params = [
        SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, max_new_tokens=12, seed=1, n=3, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, repetition_penalty=1.5, presence_penalty=0.5,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.1, max_new_tokens=12, seed=5, logit_bias={7: 5.0}, ignore_eos=True),
        SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(17, 42, 99, 200), min_tokens=2),
    ]
    kw = dict(max_batch_size=16, max_batch_tokens=20, block_size=4, num_blocks=128)
    packed, grouped = both(lm, kw, lambda e: e.generate(prompts, params))
    assert completions(packed) == completions(grouped)
    assert [[c.finish_reason for c in o.outputs] for o in packed] == [[c.finish_reason for c in o.outputs]
                                                                       for o in grouped]
    assert_logprobs_close(packed, grouped)


def test_packed_abort_mid_prefill_and_mid_decode(lm):
    prompts = prompts_of(4, seed=50, lo=30, hi=50)
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    kw = dict(max_batch_size=4, max_batch_tokens=16, block_size=4, num_blocks=128, prefix_caching=False)

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, sp)
        engine.step()
        engine.abort("0")  # mid prefill (its prompt is longer than one step's budget)
        outs: dict[str, list[int]] = {}
        for _ in range(12):
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.event.token_ids)
        engine.abort("1")  # mid decode
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.event.token_ids)
        assert engine.cache.usage().blocks_used == 0
        return outs

    packed, grouped = both(lm, kw, run)
    assert packed == grouped and "0" not in packed and len(packed["2"]) == len(packed["3"]) == 12


def test_packed_structured_output_next_to_free_rows(bpe_lm, bpe):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    prompt = bpe.encode("hello world").ids
    free = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    constrained = SamplingParams(temperature=0.8, seed=3, max_new_tokens=40,
                                 structured=StructuredOutput(json_schema=schema))
    kw = dict(max_batch_size=8, max_batch_tokens=8, block_size=4, num_blocks=256)
    packed, grouped = both(bpe_lm, kw, lambda e: e.generate([prompt, prompt + prompt, prompt],
                                                            [free, constrained, free]), tokenizer=bpe)
    assert completions(packed) == completions(grouped)
    assert json.loads(packed[1].outputs[0].text)["answer"] in ("yes", "no")


def test_packed_step_is_on_by_default_and_off_when_asked(lm):
    engine = Engine(lm, config=EngineConfig(block_size=4, num_blocks=128, packed_step=False))
    assert not engine.packed
    assert Engine(lm, config=EngineConfig(block_size=4, num_blocks=128)).packed


@pytest.mark.parametrize("counts", [[1, 1, 1], [5], [1, 1, 7, 3, 3], [2, 1, 2]])
def test_varlen_groups_are_runs_of_equal_counts(counts):
    from plyx.attn import varlen_groups

    runs = varlen_groups(counts)
    rebuilt, token = [], 0
    for first, rows, n, start in runs:
        assert start == token and first == len(rebuilt)
        rebuilt += [n] * rows
        token += rows * n
    assert rebuilt == counts
    assert all(a[2] != b[2] for a, b in zip(runs, runs[1:]))  # maximal runs


def test_look_ahead_changes_no_output(lm):
    """The next forward queued before the host reads the tokens (forced on here; default on CUDA only): same
    outputs with rows that stop by EOS/stop ids (wasted look-ahead rows), sampled and penalised rows, n > 1,
    arrivals between steps, preemption and an abort."""
    prompts = prompts_of(10, seed=60, lo=3, hi=40)
    rng = random.Random(61)
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_new_tokens=rng.randrange(1, 16), logprobs=1,
                                         stop_token_ids=tuple(rng.sample(range(256), 40))))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, seed=i, n=2, max_new_tokens=12, ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4,
                                         max_new_tokens=14, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=1.0, top_k=20, seed=i, max_new_tokens=10, ignore_eos=True))
    results = []
    for look_ahead in (True, False):
        engine = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=24, block_size=4, num_blocks=20,
                                                max_model_len=64, look_ahead=look_ahead, prefix_caching=False))
        assert engine.look_ahead is look_ahead
        outs: dict[tuple[str, int], list[int]] = {}
        pending = list(enumerate(zip(prompts, params)))
        while pending or engine.has_unfinished():
            if pending and (engine.stats.steps % 2 == 0 or not engine.has_unfinished()):
                i, (p, sp) = pending.pop(0)
                engine.add_request(str(i), p, sp)
            if engine.stats.steps == 9:
                engine.abort("2")
            for o in engine.step():
                if o.event is not None:
                    outs.setdefault((o.request_id, o.index), []).extend(o.event.token_ids)
        assert engine.cache.usage().blocks_used == 0 and not engine._ahead  # nothing leaked
        results.append((outs, engine.stats.preemptions, engine.stats.looked_ahead))
    (ahead_outs, pre_a, looked_a), (plain_outs, pre_p, looked_p) = results
    assert ahead_outs == plain_outs
    assert pre_a > 0 and pre_p > 0
    assert looked_a > 20 and looked_p == 0  # tokens whose forward was queued before the host read them


@pytest.mark.parametrize("look_ahead", [False, True])
def test_decode_only_steps_take_a_graph_bucket_and_mixed_steps_the_packed_forward(lm, look_ahead):
    """The step-shape choice, checked on CPU with the static step run eagerly (``capture=False``, the path a CUDA
    graph replays): decode-only steps of up to the largest bucket go through ``DecodeGraphs``, padded up to their
    bucket; steps holding a prefill chunk, or more decode rows than the largest bucket, run one packed forward."""
    from plyx.serve._graphs import DecodeGraphs

    prompts = prompts_of(7, seed=70, lo=10, hi=30)
    sp = SamplingParams(temperature=0, max_new_tokens=9, ignore_eos=True, logprobs=1)
    want = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=32, block_size=4, num_blocks=128,
                                          packed_step=False)).generate(prompts, sp)
    engine = Engine(lm, config=EngineConfig(max_batch_size=8, max_batch_tokens=32, block_size=4, num_blocks=128,
                                            look_ahead=look_ahead))
    engine.graphs = DecodeGraphs(lm, engine.cache, max_batch=4, capture=False, max_query=1, buckets=[1, 2, 4])
    kinds = []
    forwards = []
    hook = lm.register_forward_pre_hook(lambda m, args, kw: forwards.append(kw["input_ids"].shape if "input_ids"
                                                                                in kw else args[0].shape),
                                        with_kwargs=True)
    try:
        pending = list(enumerate(prompts))
        outs = {}
        while pending or engine.has_unfinished():
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, sp)
            before = (engine.graphs.steps, len(forwards))
            decodes = [s for s in engine.running if s.pending == 1]
            # pending 0: the look-ahead computed its logits already; > 1: a prefill chunk
            only_decodes = not engine.waiting and all(s.pending <= 1 for s in engine.running)
            for o in engine.step():
                outs[o.request_id] = outs.get(o.request_id, ()) + o.event.token_ids
            graph_steps = engine.graphs.steps - before[0]
            kinds.append((only_decodes, len(decodes), graph_steps, len(forwards) - before[1]))
    finally:
        hook.remove()
    assert [outs[str(i)] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in want]
    for only_decodes, rows, graph_steps, eager in kinds:
        if not look_ahead and only_decodes and rows:
            # a decode-only step: one graph step when a bucket holds it, else the packed forward
            assert (graph_steps, eager) == ((1, 1) if rows <= 4 else (0, 1))
        if not only_decodes:
            assert eager >= 1  # the packed forward (a look-ahead may add a graph step for the next)
    assert any(not k[0] for k in kinds)
    if not look_ahead:  # both kinds of decode-only step occurred
        assert any(k[0] and 0 < k[1] <= 4 for k in kinds) and any(k[0] and k[1] > 4 for k in kinds)
    else:  # decode steps are fed by the look-ahead: through a graph bucket when it holds them
        assert engine.stats.looked_ahead > 0 and engine.graphs.steps > 0


def test_packed_step_through_packed_projections_and_the_fused_small_step():
    """With q/k/v and gate/up stacked (what CUDA-graph engines do), the packed step runs the packed GEMM, RoPE +
    cache store in one kernel (``rope_store_kv``) and, at <= 2 tokens, the fused norm + projection step: same
    tokens as the per-group path on the unpacked twin."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=160,
                      init_std=0.5)
    torch.manual_seed(3)
    plain = TransformerLM(cfg).eval()
    packed_model = TransformerLM(cfg).eval()
    packed_model.load_state_dict(plain.state_dict())
    packed_model.pack_projections_()
    prompts = prompts_of(3, seed=80, lo=5, hi=30)
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=1)
    kw = dict(max_batch_size=4, max_batch_tokens=16, block_size=4, num_blocks=64)
    for batch in (prompts[:1], prompts):  # one request: every decode step is one token (the fused path)
        got = Engine(packed_model, config=EngineConfig(**kw)).generate(batch, sp)
        want = Engine(plain, config=EngineConfig(packed_step=False, **kw)).generate(batch, sp)
        assert completions(got) == completions(want)
        assert_logprobs_close(got, want)


def test_ngram_speculation_in_the_engine_is_greedy_exact():
    """Prompt-lookup drafts fed in the packed step and verified by the target's argmax: every row's tokens equal
    plain greedy decoding, rows that may not speculate (sampled, log-probs, stop ids) ride along, drafts are
    accepted (the small random model's greedy output loops, so it copies its own context), and fewer steps run;
    with chunked prefill, preemption and prefix caching in play."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    lm = TransformerLM(ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                   max_seq_len=160, init_std=0.1)).eval()
    rng = random.Random(90)
    passage = [rng.randrange(256) for _ in range(12)]
    prompts = [passage * 3 + passage[:i] for i in range(1, 7)] + prompts_of(2, seed=91, lo=5, hi=20)
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randrange(12, 30), ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True, logprobs=1)
    params[2] = SamplingParams(temperature=0.8, seed=4, max_new_tokens=10, ignore_eos=True)
    params[3] = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=tuple(passage[5:8]))
    kw = dict(max_batch_size=8, max_batch_tokens=24, block_size=4, num_blocks=30, max_model_len=80)
    plain = Engine(lm, config=EngineConfig(**kw))
    want = plain.generate(prompts, params)
    spec = Engine(lm, config=EngineConfig(speculative_ngram=4, spec_policy="always", **kw))
    got = spec.generate(prompts, params)
    assert completions(got) == completions(want)
    assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in want]
    assert_logprobs_close(got, want)
    assert spec.stats.spec_accepted > 10 and spec.stats.spec_drafted > spec.stats.spec_accepted  # some rejected
    assert spec.stats.preemptions > 0
    assert spec.stats.steps < plain.stats.steps
    assert spec.cache.usage().blocks_used == plain.cache.usage().blocks_used  # cropped: only the prefix cache holds
    with pytest.raises(Exception, match="speculative_ngram"):
        EngineConfig(speculative_ngram=17)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, the Triton paged kernel)")
def test_cuda_engine_packed_graphs_and_look_ahead_equal_the_eager_per_group_engine():
    """On a GPU the default engine runs packed steps (Triton paged attention per group, rope_store_kv), decode-only
    steps as CUDA graphs and the look-ahead: same greedy tokens as the eager per-group engine, float32."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=160,
                      init_std=0.5)
    ref_model = TransformerLM(cfg).eval().cuda()
    model = TransformerLM(cfg).eval().cuda()
    model.load_state_dict(ref_model.state_dict())
    prompts = prompts_of(12, seed=100, lo=3, hi=70)
    rng = random.Random(101)
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randrange(2, 30), ignore_eos=True) for _ in prompts]
    kw = dict(max_batch_size=8, max_batch_tokens=48, block_size=16, num_blocks=64)

    def run(engine):
        pending = list(enumerate(zip(prompts, params)))
        outs: dict[str, list[int]] = {}
        while pending or engine.has_unfinished():
            if pending:
                i, (p, sp) = pending.pop(0)
                engine.add_request(str(i), p, sp)
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.event.token_ids)
        return [tuple(outs[str(i)]) for i in range(len(prompts))]

    fast = Engine(model, config=EngineConfig(**kw))
    assert fast.packed and fast.graphs is not None and fast.look_ahead
    got = run(fast)
    want = run(Engine(ref_model, config=EngineConfig(packed_step=False, cuda_graphs=False, look_ahead=False, **kw)))
    assert got == want
    assert fast.graphs.replays > 0 and fast.stats.looked_ahead > 0
    spec = Engine(model, config=EngineConfig(speculative_ngram=4, **kw))
    assert run(spec) == want
