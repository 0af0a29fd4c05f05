"""Speculative decoding with draft heads (Medusa, EAGLE): greedy identical to the base's greedy, sampling
distributed as the base, long acceptance for heads trained on the base's own data, bad heads named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from plyx.model import build_draft_heads, save_draft_heads
from plyx.serve import SamplingParams, generate
from plyx.specs import ConfigError, ModelConfig

V = 32
#: a fixed successor table: the "language" is x_{t+1} = SUCC[x_t], a cycle through every token
SUCC = torch.roll(torch.randperm(V, generator=torch.Generator().manual_seed(0)), 1)


def _cyclic(batch: int, length: int, seed: int) -> torch.Tensor:
    """``[batch, length]`` sequences following SUCC from random starts (the data base and heads train on)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (batch,), generator=g)
    rows = [x]
    for _ in range(length - 1):
        x = SUCC[x]
        rows.append(x)
    return torch.stack(rows, dim=1)


def _base(seed: int = 0):
    from plyx.model import TransformerLM

    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=V, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64)
    model = TransformerLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(60):  # learns the successor table: greedy decoding walks the cycle
        ids = _cyclic(16, 12, seed=step)
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, V), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval().requires_grad_(False)


def _train_heads(base, kind: str, steps: int = 80):
    """Heads trained on the frozen base's features over the same cyclic data (the papers' losses, inline:
    the training mode itself lives in plyx-train, which plyx-serve does not depend on)."""
    heads = build_draft_heads(kind, base.config, num_heads=3).init_from_base(base)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)
    for step in range(steps):
        ids = _cyclic(16, 12, seed=1000 + step)
        with torch.no_grad():
            f = base(ids, return_hidden=True)  # (B, T, D)
        if kind == "medusa":
            logits = heads(f)  # (K, B, T, V)
            loss = sum(0.8 ** k * F.cross_entropy(logits[k - 1, :, : -k - 1].reshape(-1, V), ids[:, k + 1:].reshape(-1))
                       for k in range(1, 4))
        else:
            pred = heads(ids[:, 1:], f[:, :-1], base.embed_tokens.weight)  # (B, T-1, D)
            target_p = (f[:, 1:] @ base.lm_head_weight.t()).softmax(-1)
            cls = -(target_p * (pred @ base.lm_head_weight.t()).log_softmax(-1)).sum(-1).mean()
            loss = F.smooth_l1_loss(pred, f[:, 1:]) + 0.1 * cls
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def trained():
    base = _base()
    return base, {kind: _train_heads(base, kind) for kind in ("medusa", "eagle")}


PROMPTS = [[3, 5, 7], [1, 2], [9, 10, 11, 12, 13]]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
@pytest.mark.parametrize("cache, k, prompts", [("contiguous", 3, PROMPTS[:1]), ("paged", 3, PROMPTS),
                                               ("contiguous", 2, PROMPTS)])
def test_greedy_equals_base_greedy(trained, kind, cache, k, prompts):
    """Token for token (and log-prob for log-prob) the base's greedy output, at batch 1 and batch 3."""
    base, heads = trained
    params = SamplingParams(temperature=0, max_new_tokens=20, logprobs=1, ignore_eos=True)
    ref = generate(base, prompts, params, cache=cache)
    out = generate(base, prompts, params, cache=cache, draft_cache=cache, draft_model=heads[kind],
                   num_speculative_tokens=k)
    for r, o in zip(ref, out):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_greedy_with_random_heads_is_still_exact(trained, kind):
    """Heads that propose garbage (random weights) change the speed, never the output."""
    base, _ = trained
    torch.manual_seed(7)
    heads = build_draft_heads(kind, base.config, num_heads=4).eval()
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)
    ref = generate(base, PROMPTS, params)
    out = generate(base, PROMPTS, params, draft_model=heads, num_speculative_tokens=4)
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_trained_heads_accept_long_runs(trained, kind):
    """Heads trained on the base's data: mean acceptance length (tokens per base forward) well above 1."""
    base, heads = trained
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    out = generate(base, PROMPTS, params, draft_model=heads[kind], num_speculative_tokens=3)
    for o in out:
        m = o.outputs[0].metrics
        # the first token comes from the prefill; each later forward emits accepted drafts + 1
        acceptance_length = (m.num_generated - 1) / (m.model_steps - 1)
        assert acceptance_length > 2.0, (kind, acceptance_length, m)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_sampling_law_is_the_base(kind, chi_square_p):
    """Joint law of three sampled tokens (two through draft-and-verify) = p(x1) p(x2|x1) p(x3|x1 x2)."""
    from plyx.model import TransformerLM

    W = 4
    torch.manual_seed(3)
    config = ModelConfig(vocab_size=W, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=12,
                         init_std=0.6)
    base = TransformerLM(config).eval()
    heads = build_draft_heads(kind, config, num_heads=2).init_from_base(base).eval()
    with torch.no_grad():  # heads near the base but not equal: both accept and residual paths run
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    prompt = [0, 1, 2]
    with torch.no_grad():
        p1 = base(torch.tensor([prompt]))[0, -1].double().softmax(-1)  # [W]
        p2 = base(torch.tensor([prompt + [a] for a in range(W)]))[:, -1].double().softmax(-1)  # [W, W]
        p3 = base(torch.tensor([prompt + [a, b] for a in range(W) for b in range(W)]))[:, -1].double().softmax(-1)
    exact = ((p1[:, None] * p2).reshape(-1)[:, None] * p3).reshape(-1)  # [W^3]
    n = 3000
    out = generate(base, [prompt], SamplingParams(n=n, temperature=1.0, max_new_tokens=3, ignore_eos=True),
                   draft_model=heads, num_speculative_tokens=2, generator=torch.Generator().manual_seed(0),
                   cache="paged", draft_cache="paged")[0]
    counts = torch.zeros(W ** 3, dtype=torch.float64)
    for o in out.outputs:
        a, b, c = o.token_ids
        counts[(a * W + b) * W + c] += 1
    p_value = chi_square_p(counts, exact)
    assert p_value > 1e-3, p_value
    proposed = sum(o.metrics.draft_proposed for o in out.outputs)
    accepted = sum(o.metrics.draft_accepted for o in out.outputs)
    assert 0 < accepted < proposed  # both the accept and the residual paths ran
    # the test has power: the same counts reject a law whose third token is uniform
    alt = ((p1[:, None] * p2).reshape(-1)[:, None] * torch.full((W * W, W), 1 / W, dtype=torch.float64)).reshape(-1)
    assert chi_square_p(counts, alt) < 1e-6


def test_sampling_with_top_k_and_seed_is_reproducible(trained):
    base, heads = trained
    params = SamplingParams(temperature=0.8, top_k=5, max_new_tokens=12, seed=11, ignore_eos=True)
    a = generate(base, PROMPTS, params, draft_model=heads["eagle"])
    b = generate(base, PROMPTS, params, draft_model=heads["eagle"])
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_heads_from_a_saved_directory(trained, tmp_path):
    base, heads = trained
    path = save_draft_heads(heads["medusa"], tmp_path / "heads")
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    ref = generate(base, PROMPTS, params, draft_model=heads["medusa"])
    out = generate(base, PROMPTS, params, draft_model=str(path))
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
    assert [o.outputs[0].metrics.draft_accepted for o in out] == [r.outputs[0].metrics.draft_accepted for r in ref]


def test_bad_heads_are_named(trained, tmp_path):
    base, heads = trained
    params = SamplingParams(temperature=0, max_new_tokens=4)
    other = build_draft_heads("medusa", base.config.replace(vocab_size=V + 8, d_model=48, n_heads=4), num_heads=2)
    with pytest.raises(ConfigError, match=r"vocab_size: 40 for the heads vs 32 for the base.*d_model: 48"):
        generate(base, PROMPTS, params, draft_model=other)
    saved = save_draft_heads(other, tmp_path / "other")
    with pytest.raises(ConfigError, match="trained for another base model"):
        generate(base, PROMPTS, params, draft_model=saved)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a draft-heads checkpoint: it has no draft_heads.json"):
        generate(base, PROMPTS, params, draft_model=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="is neither 'ngram' .prompt lookup. nor an existing draft-heads directory"):
        generate(base, PROMPTS, params, draft_model=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="use_cache"):
        generate(base, PROMPTS, params, draft_model=heads["medusa"], use_cache=False)
    with pytest.raises(ConfigError, match="repetition_penalty"):
        generate(base, PROMPTS, SamplingParams(repetition_penalty=1.2), draft_model=heads["eagle"])


def test_streamed_events_rebuild_the_output(trained):
    from plyx.serve import stream_generate

    base, heads = trained
    params = SamplingParams(temperature=0, max_new_tokens=15, ignore_eos=True, stop_token_ids=[int(SUCC[SUCC[9]])])
    ref = generate(base, PROMPTS, params)
    stream = stream_generate(base, PROMPTS, params, draft_model=heads["eagle"], num_speculative_tokens=3)
    got: dict[int, list[int]] = {}
    for event in stream:
        got.setdefault(event.request_index, []).extend(event.token_ids)
    assert [got.get(i, []) for i in range(len(PROMPTS))] == [list(r.outputs[0].token_ids) for r in ref]
    assert [o.outputs[0].finish_reason for o in stream.outputs()] == [r.outputs[0].finish_reason for r in ref]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_cuda_greedy_equals_base_greedy(trained, kind):
    """On the GPU (float32, paged cache) the heads' output is still the base's greedy output."""
    import copy

    base, heads = trained
    base, draft = copy.deepcopy(base).cuda(), copy.deepcopy(heads[kind]).cuda()
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    ref = generate(base, PROMPTS, params, cache="paged", cuda_graphs=False)
    out = generate(base, PROMPTS, params, cache="paged", draft_cache="paged", draft_model=draft,
                   num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in out] == [r.outputs[0].token_ids for r in ref]
    assert sum(o.outputs[0].metrics.draft_accepted for o in out) > 0
