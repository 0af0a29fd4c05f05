"""Verification as a static step per rows bucket (``SpecGraphs``, CUDA's captured graphs run eagerly on CPU): the
tokens and the acceptance counts equal the eager packed path's for chains, trees and prompt lookup; sampled rows
keep the model's law beside it; and the per-step rule (``SpecPolicy``) turns speculation off where it measures
slower."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig
from plyx.serve.engine._spec_graphs import SpecGraphs, SpecPolicy, spec_buckets

from .test_engine_draft_heads import PROMPTS, _run, train_base_and_heads


@pytest.fixture(scope="module")
def trained():
    return train_base_and_heads()


def _counts(engine):
    s = engine.stats
    return s.spec_rows, s.spec_drafted, s.spec_accepted, s.generated_tokens


@pytest.mark.parametrize("tree", [0, 2, 3])
def test_heads_through_the_static_step_equal_the_eager_path(trained, tree, monkeypatch):
    """Every decode-only step verifies in the static step; the accepted counts (tensor ops over the ancestor
    mask) equal ``accepted_path``'s row by row, so the stats of the two runs agree exactly; tokens are plain
    greedy's. A tree's moves run inside the step: ``move_tokens`` is never called."""
    import plyx.attn

    base, heads = trained
    _, ref = _run(base, None)
    eager, out_eager = _run(base, heads, spec_tree=tree)
    static, out = _run(base, heads, spec_tree=tree, mixed_graphs=True)
    assert out == ref == out_eager
    g = static.spec_graphs
    assert g is not None and g.steps > 0 and g.tree == (tree > 1)
    assert g.T == 1 + len(static.proposer.tree)
    assert _counts(static) == _counts(eager)
    assert static.stats.spec_accepted > 0
    # all requests at once: after the prefill step every step that has drafts is decode-only and verifies in the
    # static step (the rest: the prefill, and a last step whose rows need one token and draft nothing)
    monkeypatch.setattr(plyx.attn, "move_tokens", lambda *a: pytest.fail("the static step moves tree paths itself"))
    static, out = _run(base, heads, spec_tree=tree, mixed_graphs=True, arrivals=False)
    assert out == ref and static.spec_graphs.steps >= static.stats.steps - 2


def test_ngram_through_the_static_step(trained):
    """Prompt lookup: ragged drafts (some rows none) padded to k per row and never accepted past a row's own;
    a small pool (preemption), prefix caching and length-capped rows in the batch."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    lm = TransformerLM(ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                   max_seq_len=96, init_std=0.1)).eval()
    rng = random.Random(90)
    passage = [rng.randrange(256) for _ in range(12)]
    prompts = [passage * 3 + passage[:i] for i in range(1, 6)] + [[rng.randrange(256) for _ in range(7)]]
    params = [SamplingParams(temperature=0, max_new_tokens=rng.randrange(3, 30), ignore_eos=True) for _ in prompts]
    kw = dict(max_batch_size=8, max_batch_tokens=32, block_size=4, num_blocks=26, max_model_len=80,
              speculative_ngram=4, spec_policy="always")
    want = Engine(lm, config=EngineConfig(**{**kw, "speculative_ngram": 0})).generate(prompts, params)
    eager = Engine(lm, config=EngineConfig(**kw))
    static = Engine(lm, config=EngineConfig(mixed_graphs=True, **kw))
    got_e, got = eager.generate(prompts, params), static.generate(prompts, params)
    tokens = [[c.token_ids for c in o.outputs] for o in want]
    assert [[c.token_ids for c in o.outputs] for o in got] == tokens
    assert [[c.token_ids for c in o.outputs] for o in got_e] == tokens
    assert static.spec_graphs.steps > 0 and static.spec_graphs.T == 5
    assert static.stats.spec_accepted > 10 and static.stats.spec_drafted > static.stats.spec_accepted
    assert static.stats.spec_accepted == eager.stats.spec_accepted
    assert static.stats.preemptions > 0
    # every verified row's extra slots were cropped: only the prefix cache holds blocks once all is done
    assert static.cache.usage().blocks_used == eager.cache.usage().blocks_used


def test_sampled_rows_beside_the_static_step_keep_the_law(trained):
    """A batch with a sampled row takes the eager path (the rejection rule draws from per-row generators; its law
    is chi-square tested in ``test_engine_draft_heads``, here through an engine with the static step): the greedy
    rows give plain greedy's tokens, before and after the sampled row ends."""
    base, heads = trained
    params = [SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True) for _ in PROMPTS]
    params[1] = SamplingParams(temperature=0.8, seed=11, max_new_tokens=6, ignore_eos=True)
    _, ref = _run(base, None, params=params)
    engine, out = _run(base, heads, params=params, mixed_graphs=True, arrivals=False)
    assert out[0] == ref[0] and out[2:] == ref[2:]
    assert len(out[1][0]) == 6
    assert engine.spec_graphs.steps > 0  # the steps after the sampled row finished


def test_buckets_and_bad_input(trained):
    base, heads = trained
    assert spec_buckets(8) == [1, 2, 4, 8] and spec_buckets(6) == [1, 2, 4, 6] and spec_buckets(1) == [1]
    engine = Engine(base, draft_heads=heads, config=EngineConfig(mixed_graphs=True, block_size=4, num_blocks=64,
                                                                 max_batch_size=4))
    g = engine.spec_graphs
    assert g.bucket(3) == 4 and g.bucket(5) is None
    with pytest.raises(ValueError, match="does not fit"):
        g.prepare([0], [[1] * (g.T + 1)])
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        SpecGraphs(base, engine.cache, parents=[-1, 0], max_rows=2, capture=True)
    with pytest.raises(Exception, match="spec_policy"):
        EngineConfig(spec_policy="sometimes")
    never = Engine(base, draft_heads=heads, config=EngineConfig(spec_policy="never", block_size=4, num_blocks=64))
    never.generate(PROMPTS[:2], SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert never.stats.spec_rows == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fake_engine(rows: int):
    stats = SimpleNamespace(steps=0, prompt_tokens=0, generated_tokens=0, requests_finished=0)
    return SimpleNamespace(stats=stats, running=[object()] * rows, waiting=[], _drafts={}, proposer=None)


def _drive(policy, engine, clock, steps, t_spec, t_plain, accept):
    """``steps`` decode steps: each decision, then the step's time and tokens as the policy will measure them."""
    chosen = []
    for _ in range(steps):
        spec = policy.decide(engine)
        chosen.append(spec)
        rows = len(engine.running)
        clock.now += t_spec if spec else t_plain
        engine.stats.steps += 1
        engine.stats.generated_tokens += round(rows * (accept if spec else 1.0))
    return chosen


def test_policy_turns_speculation_off_where_it_measures_slower():
    """Batch 1: acceptance 2.0 at 1.5x a plain step's cost pays (2 / 1.5 > 1): speculate. Batch 8: acceptance
    1.25 at 2x the cost does not: plain steps, except one probe in ``probe_every``."""
    clock = _Clock()
    policy = SpecPolicy(clock=clock, warm=3, probe_every=10)
    one = _fake_engine(1)
    chosen = _drive(policy, one, clock, 40, t_spec=1.5, t_plain=1.0, accept=2.0)
    assert chosen[:3] == [True] * 3 and chosen[3:6] == [False] * 3  # measure both, then decide
    assert sum(chosen[8:]) >= len(chosen[8:]) - 4  # speculating (a plain probe now and then)
    assert policy.accept[1] == pytest.approx(2.0) and policy.t_spec[1] == pytest.approx(1.5)

    eight = _fake_engine(8)
    chosen = _drive(policy, eight, clock, 60, t_spec=2.0, t_plain=1.0, accept=1.25)
    assert policy.bucket(8) == 8 and policy.accept[8] == pytest.approx(1.25)
    assert sum(chosen[8:]) <= 6 and policy.off_steps >= 45  # off, one probe step in ten
    # acceptance improves (the text turned repetitive): the probes see it and speculation comes back
    chosen = _drive(policy, eight, clock, 80, t_spec=2.0, t_plain=1.0, accept=3.0)
    assert all(chosen[-20:-1]) or sum(chosen[-20:]) >= 17


def test_policy_ignores_steps_that_are_not_comparable():
    """Admissions, prefills and finished rows change what a step costs: those intervals are not measured; an idle
    gap (4x the estimate or more) is clipped."""
    clock = _Clock()
    policy = SpecPolicy(clock=clock, warm=1)
    engine = _fake_engine(2)
    policy.decide(engine)
    clock.now += 1.0
    engine.stats.steps += 1
    engine.stats.prompt_tokens += 5  # a prefill rode along
    policy.decide(engine)
    assert policy.t_spec == {} and policy.t_plain == {}
    clock.now += 1.0
    engine.stats.steps += 1
    engine.stats.generated_tokens += 4
    policy.decide(engine)  # the previous step: speculating (warm), measured
    assert policy.t_spec[2] == pytest.approx(1.0) and policy.accept[2] == pytest.approx(2.0)
    clock.now += 100.0  # the client went away between calls
    engine.stats.steps += 1
    policy.decide(engine)
    assert policy.t_plain[2] == pytest.approx(100.0)  # the first plain sample has nothing to be clipped to
    clock.now += 1000.0
    engine.stats.steps += 1
    policy.decide(engine)
    assert max(policy.t_spec[2], policy.t_plain[2]) <= 400.0
    assert SpecPolicy("always").decide(engine) and not SpecPolicy("never").decide(engine)
    with pytest.raises(ValueError, match="speculation policy"):
        SpecPolicy("often")


def test_plain_steps_of_a_speculating_engine_run_multi_step_blocks(trained):
    """Where the rule leaves a step plain, the engine decodes as without speculation, multi-step blocks included
    (so at a batch where speculation does not pay it is not slower than plain decoding); 'always' never does."""
    base, heads = trained
    sp = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    kw = dict(block_size=4, num_blocks=120, max_batch_size=8, decode_steps=4)
    ref = Engine(base, config=EngineConfig(**kw)).generate(PROMPTS, sp)
    for policy in ("never", "always"):
        engine = Engine(base, draft_heads=heads, config=EngineConfig(spec_policy=policy, mixed_graphs=True, **kw))
        out = engine.generate(PROMPTS, sp)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
        assert (engine.stats.multi_step_blocks > 0) == (policy == "never")
        assert (engine.stats.spec_rows > 0) == (policy == "always")


def test_quantised_cache_chains_verify_in_the_static_step_trees_stay_refused(trained):
    """An int8 cache: chains verify in the static step (attention through the quantised paged kernel, nothing
    moved) with the eager path's tokens; trees stay refused (their path's keys would move without their
    scales, and ``tree_attention`` reads the pools as stored), in the engine and in ``SpecGraphs`` itself."""
    from plyx.specs import ConfigError

    base, heads = trained
    _, ref = _run(base, None, kv_cache_dtype="int8")
    eager, out_eager = _run(base, heads, kv_cache_dtype="int8")
    static, out = _run(base, heads, kv_cache_dtype="int8", mixed_graphs=True)
    assert out == out_eager == ref and static.spec_graphs.steps > 0
    assert static.stats.spec_accepted == eager.stats.spec_accepted > 0
    with pytest.raises(ConfigError, match="tree verification reads the pools unquantised"):
        _run(base, heads, kv_cache_dtype="int8", mixed_graphs=True, spec_tree=2)
    with pytest.raises(ValueError, match="unquantised cache"):
        SpecGraphs(base, static.cache, parents=[-1, 0, 0], max_rows=2, capture=False)


def test_policy_waits_for_the_heads_first_drafts():
    """With draft heads a speculating step right after a plain one has no drafts (the heads read that step's
    features): it is not measured as a verify step, and the next step speculates again."""
    clock = _Clock()
    policy = SpecPolicy(clock=clock, warm=1)
    engine = _fake_engine(1)
    engine.proposer = object()
    assert policy.decide(engine)  # warm: speculate; this step finds no drafts
    clock.now += 1.0
    engine.stats.steps += 1
    engine.stats.generated_tokens += 1
    assert policy.decide(engine) and policy.t_spec == {}  # not measured; speculate again
    engine._drafts = {0: [5, 6]}  # this one verified drafts
    clock.now += 1.5
    engine.stats.steps += 1
    engine.stats.generated_tokens += 3
    assert not policy.decide(engine)  # measured (warm for spec done): now a plain step to measure
    assert policy.t_spec[1] == pytest.approx(1.5) and policy.accept[1] == pytest.approx(3.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (captured verification graphs)")
def test_ngram_on_cuda_replays_the_verification_graphs():
    """CUDA defaults (decode, mixed-step and verification graphs captured at start-up): n-gram speculation
    replays the verification graphs and gives the plain engine's float32 greedy tokens, under 'always' and
    under the per-step rule."""
    from plyx.model import TransformerLM
    from plyx.specs import ModelConfig

    torch.manual_seed(0)
    lm = TransformerLM(ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                                   max_seq_len=160, init_std=0.1)).eval().cuda()
    rng = random.Random(90)
    passage = [rng.randrange(256) for _ in range(12)]
    prompts = [passage * 3 + passage[:i] for i in range(1, 7)]
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    kw = dict(max_batch_size=8, max_batch_tokens=64, block_size=16, num_blocks=64)
    want = [o.outputs[0].token_ids for o in Engine(lm, config=EngineConfig(**kw)).generate(prompts, sp)]
    for policy in ("always", "auto"):
        engine = Engine(lm, config=EngineConfig(speculative_ngram=4, spec_policy=policy, **kw))
        assert engine.spec_graphs is not None and engine.spec_graphs.captured == engine.spec_graphs.buckets
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, sp)]
        assert got == want
        if policy == "always":
            assert engine.spec_graphs.replays > 0 and engine.stats.spec_accepted > 0


@pytest.mark.parametrize("verify_cost", [10.0, 1.1])
def test_the_rule_in_the_engine(trained, verify_cost):
    """The engine under ``spec_policy='auto'`` with a clock that charges a speculating step ``verify_cost`` plain
    steps: at 10x (acceptance ~1.3 cannot pay) it decodes plainly after measuring both, at 1.1x it speculates;
    the tokens are plain greedy's either way."""
    base, heads = trained
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    kw = dict(block_size=4, num_blocks=200, max_batch_size=8, max_model_len=96)
    ref = Engine(base, config=EngineConfig(**kw)).generate(PROMPTS, sp)
    engine = Engine(base, draft_heads=heads, config=EngineConfig(mixed_graphs=True, **kw))
    assert engine.config.spec_policy == "auto"
    now = [0.0]

    def clock() -> float:  # called as each step is scheduled: charge the step before it
        now[0] += verify_cost if engine._spec_step else 1.0
        return now[0]

    engine.spec_policy.clock = clock
    out = engine.generate(PROMPTS, sp)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    policy = engine.spec_policy
    assert policy.accept[8] > 1.0
    verified = engine.stats.spec_rows / len(PROMPTS)
    if verify_cost > 2:
        assert policy.off_steps > 2 * verified, (policy.off_steps, verified)
    else:
        assert verified > 2 * policy.off_steps, (policy.off_steps, verified)
