"""Medusa draft heads in the engine: chain and tree verification in the packed step give plain greedy's tokens,
a tree accepts at least what the chain does, sampled chains keep the model's law, and configurations that cannot
run are named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plyx.model import build_draft_heads, save_draft_heads
from plyx.serve import SamplingParams
from plyx.serve.engine import Engine, EngineConfig
from plyx.specs import ConfigError, ModelConfig

V = 48
#: the "language": x_{t+1} = SUCC[x_t] most of the time, ALT[x_t] otherwise (the base's argmax follows SUCC)
SUCC = torch.roll(torch.randperm(V, generator=torch.Generator().manual_seed(0)), 1)
ALT = torch.randperm(V, generator=torch.Generator().manual_seed(1))


def _walk(batch: int, length: int, seed: int, p_alt: float = 0.25) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (batch,), generator=g)
    rows = [x]
    for _ in range(length - 1):
        x = torch.where(torch.rand(batch, generator=g) < p_alt, ALT[x], SUCC[x])
        rows.append(x)
    return torch.stack(rows, dim=1)  # (B, T)


@pytest.fixture(scope="module")
def trained():
    return train_base_and_heads()


def train_base_and_heads(head_steps: int = 40):
    """A tiny base that learnt the walk and Medusa heads trained a few steps on its features (CPU, ~2 s):
    good enough to accept often, not always, so trees have something to find."""
    from plyx.model import TransformerLM

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=96)
    base = TransformerLM(config)
    opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    for step in range(80):
        ids = _walk(16, 16, seed=step)
        loss = F.cross_entropy(base(ids[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    base = base.eval().requires_grad_(False)
    heads = build_draft_heads("medusa", config, num_heads=3).init_from_base(base)
    opt = torch.optim.AdamW(heads.parameters(), lr=5e-3)
    for step in range(head_steps):  # a few steps: Medusa's loss (head k predicts x_{t+k+1}, weights 0.8^k)
        ids = _walk(16, 16, seed=1000 + step)
        with torch.no_grad():
            f = base(ids, return_hidden=True)  # (B, T, D)
        logits = heads(f)  # (K, B, T, V)
        loss = sum(0.8 ** k * F.cross_entropy(logits[k - 1, :, :-k - 1].reshape(-1, V), ids[:, k + 1:].reshape(-1))
                   for k in range(1, 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return base, heads.eval().requires_grad_(False)


PROMPTS = [_walk(1, n, seed=50 + n)[0].tolist() for n in (3, 9, 5, 14, 2)]


def _run(base, heads, *, arrivals=True, params=None, **config):
    # speculation every step (the per-step rule, SpecPolicy, is timed and tested on its own)
    config = {"max_batch_size": 8, "max_batch_tokens": 96, "block_size": 4, "num_blocks": 200,
              "spec_policy": "always", **config}
    engine = Engine(base, draft_heads=heads, config=EngineConfig(**config))
    params = params or [SamplingParams(temperature=0, max_new_tokens=24 + 3 * i, ignore_eos=True)
                        for i in range(len(PROMPTS))]
    outs: dict[tuple[str, int], list[int]] = {}
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished():
        if pending:  # arrivals spread over the run: drafts ride beside prefill chunks
            i, p = pending.pop(0)
            engine.add_request(str(i), p, params[i])
            if not arrivals:
                continue
        for o in engine.step():
            outs.setdefault((o.request_id, o.index), []).extend(o.event.token_ids)
    return engine, [[outs[k] for k in sorted(outs) if k[0] == str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("tree", [0, 2, 3])
def test_greedy_output_is_plain_greedy(trained, tree, monkeypatch):
    import plyx.attn

    base, heads = trained
    _, ref = _run(base, None)
    moved = []
    move = plyx.attn.move_tokens
    monkeypatch.setattr(plyx.attn, "move_tokens", lambda cache, moves: (moved.extend(moves), move(cache, moves)))
    engine, out = _run(base, heads, spec_tree=tree)
    assert out == ref
    s = engine.stats
    assert s.spec_rows > 0 and 0 < s.spec_accepted < s.spec_drafted  # drafts ran, some accepted, some not
    # a tree row accepted a branch off the top-1 chain (its keys and values moved) and still matched
    assert bool(moved) == (tree > 1)


@pytest.mark.parametrize("tree", [0, 2])
def test_through_the_mixed_step_graphs(trained, tree):
    """``mixed_graphs=True`` runs the bucketed static step (CUDA's captured graphs, eagerly on CPU): chain drafts
    and prefill chunks go through it and the heads read its hidden states; tree steps take the eager path."""
    base, heads = trained
    _, ref = _run(base, None)
    engine, out = _run(base, heads, spec_tree=tree, mixed_graphs=True)
    assert engine.mixed_graphs is not None
    assert out == ref and engine.stats.spec_accepted > 0


def test_tree_accepts_at_least_the_chain(trained):
    base, heads = trained
    lengths = {}
    for tree in (0, 3):
        engine, _ = _run(base, heads, spec_tree=tree, arrivals=False)
        s = engine.stats
        lengths[tree] = 1 + s.spec_accepted / s.spec_rows
    assert lengths[0] > 1.3  # the chain accepts (the heads learnt something)
    assert lengths[3] >= lengths[0], lengths
    assert lengths[3] > lengths[0] + 0.1, lengths  # on heads this rough, the other candidates pay


def test_stops_sampling_rows_and_length_limits(trained):
    """Rows that stop inside accepted drafts, a sampled row with log-probs (it never speculates: the same seeded
    output as without heads) and rows whose length limit caps the tree's depth, in one batch."""
    base, heads = trained
    params = [SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=[int(SUCC[SUCC[PROMPTS[0][-1]]])]),
              SamplingParams(temperature=0.9, max_new_tokens=15, seed=3, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, max_new_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0, n=2, max_new_tokens=11, ignore_eos=True)]
    _, ref = _run(base, None, params=params)
    _, out = _run(base, heads, params=params, spec_tree=2)
    assert out == ref
    assert len(out[0][0]) <= 3 and len(out[2][0]) == 2 and len(out[4]) == 2


def test_preemption_under_a_small_pool(trained):
    """Blocks run out: rows are preempted and recomputed (their features and drafts start over), trees included."""
    base, heads = trained
    _, ref = _run(base, None)
    engine, out = _run(base, heads, spec_tree=3, num_blocks=25, arrivals=False)
    assert out == ref
    assert engine.stats.preemptions > 0 and engine.stats.spec_accepted > 0


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test over the cells the law can reach (a draw in an impossible cell fails outright)."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    n = counts.sum()
    stat = ((counts - probs * n) ** 2 / (probs * n)).sum()
    return float(torch.special.gammaincc(torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64), stat.double() / 2))


@pytest.mark.parametrize("static", [False, True])
def test_sampled_chain_keeps_the_models_law(static):
    """Sampled rows speculate with chains under the rejection rule: the joint law of three tokens (two of them
    through draft-and-verify) is p(x1) p(x2|x1) p(x3|x1 x2), chi-square tested, with top-k processing on; also
    in an engine whose greedy verification runs the static step (``SpecGraphs``: sampled rows keep the eager
    rejection rule beside it)."""
    from plyx.model import TransformerLM

    W = 4
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=W, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=16,
                         init_std=0.6)
    base = TransformerLM(config).eval()
    heads = build_draft_heads("medusa", config, num_heads=2).init_from_base(base).eval()
    with torch.no_grad():  # heads near the base but not equal: both the accept and the residual paths run
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    prompt, temperature, top_k = [0, 1, 2], 1.3, 3

    def law(logits):  # the processed distribution: temperature, then the top 3 tokens
        z = logits.double() / temperature
        return z.masked_fill(z < z.topk(top_k, dim=-1).values[..., -1:], float("-inf")).softmax(-1)

    with torch.no_grad():
        p1 = law(base(torch.tensor([prompt]))[0, -1])  # [W]
        p2 = law(base(torch.tensor([prompt + [a] for a in range(W)]))[:, -1])  # [W, W]
        p3 = law(base(torch.tensor([prompt + [a, b] for a in range(W) for b in range(W)]))[:, -1])
    exact = ((p1[:, None] * p2).reshape(-1)[:, None] * p3).reshape(-1)  # [W^3]
    n = 2400
    engine = Engine(base, draft_heads=heads, seed=0,
                    config=EngineConfig(max_batch_size=400, max_batch_tokens=1600, block_size=4, num_blocks=1700,
                                        max_queue=n, spec_policy="always", mixed_graphs=static))
    params = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=3, ignore_eos=True)
    outs = engine.generate([prompt] * n, params)
    counts = torch.zeros(W ** 3, dtype=torch.float64)
    for o in outs:
        a, b, c = o.outputs[0].token_ids
        counts[(a * W + b) * W + c] += 1
    assert _chi_square_p(counts, exact) > 1e-3
    s = engine.stats
    assert s.spec_rows > n // 2 and 0 < s.spec_accepted < s.spec_drafted  # speculated; accepts and rejections
    # the test has power: the same counts reject a law whose third token ignores the model
    alt = ((p1[:, None] * p2).reshape(-1)[:, None] * p3.mean(0, keepdim=True)).reshape(-1)
    assert _chi_square_p(counts, alt) < 1e-6


def test_random_heads_change_nothing(trained):
    base, _ = trained
    torch.manual_seed(7)
    heads = build_draft_heads("medusa", base.config, num_heads=4).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    _, ref = _run(base, None)
    for tree in (0, 2):
        assert _run(base, heads, spec_tree=tree, speculative_k=4)[1] == ref


def test_heads_from_a_directory_through_the_config(trained, tmp_path):
    base, heads = trained
    path = save_draft_heads(heads, tmp_path / "heads")
    engine, out = _run(base, None, draft_heads=str(path), spec_tree=2, speculative_k=2)
    assert out == _run(base, None)[1]
    assert engine.stats.spec_accepted > 0
    assert engine.spec_k == 2 and len(engine.proposer.tree) == 5  # depth 2, topk 2: 2 + 3 nodes


def test_bad_configurations_are_named(trained, tmp_path):
    base, heads = trained
    with pytest.raises(ConfigError, match="spec_tree applies to draft heads"):
        Engine(base, config=EngineConfig(spec_tree=2))
    with pytest.raises(ConfigError, match="one proposer"):
        EngineConfig(draft_heads="x", speculative_ngram=3)
    with pytest.raises(ConfigError, match="one proposer"):
        Engine(base, draft_heads=heads, config=EngineConfig(speculative_ngram=3))
    with pytest.raises(ConfigError, match="is not an existing draft-heads directory"):
        Engine(base, config=EngineConfig(draft_heads=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="Medusa heads only"):
        Engine(base, draft_heads=build_draft_heads("eagle", base.config))
    with pytest.raises(ConfigError, match="packed step"):
        Engine(base, draft_heads=heads, config=EngineConfig(packed_step=False))
    with pytest.raises(ConfigError, match="tree verification reads the pools unquantised"):
        Engine(base, draft_heads=heads, config=EngineConfig(kv_cache_dtype="int8", spec_tree=2))
    other = build_draft_heads("medusa", base.config.replace(vocab_size=V + 8), num_heads=2)
    with pytest.raises(ConfigError, match="vocab_size"):
        Engine(base, draft_heads=other)
    with pytest.raises(ConfigError, match=r"spec_tree must be in \[0, 8\]"):
        EngineConfig(spec_tree=9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (decode and mixed-step graphs)")
def test_on_cuda_with_graphs(trained):
    """On CUDA the engine keeps its graphs: decode-only verification steps (chain and tree) replay the
    verification graphs captured at start-up, prefill steps the mixed-step graphs; both give the graph-decoded
    plain greedy tokens."""
    import copy

    base, heads = trained
    base, heads = copy.deepcopy(base).cuda(), copy.deepcopy(heads).cuda()
    _, ref = _run(base, None)
    for tree in (0, 3):
        engine, out = _run(base, heads, spec_tree=tree)
        assert engine.mixed_graphs is not None and engine.spec_graphs is not None
        assert out == ref
        assert engine.stats.spec_accepted > 0
        assert engine.spec_graphs.replays > 0 and engine.spec_graphs.captured == engine.spec_graphs.buckets
