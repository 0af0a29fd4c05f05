"""Speculative decoding: greedy identical to greedy, sampling distributed as the target, acceptance reported."""

from __future__ import annotations

import pytest
import torch
from plyx.serve import SamplingParams, generate

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [3, 4, 5, 6]]


@pytest.fixture(scope="module")
def pair(make_model):
    target = make_model(seed=0, init_std=0.1)
    draft = make_model(seed=1, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, init_std=0.1)
    return target, draft


@pytest.mark.parametrize("k, cache", [(1, "contiguous"), (3, "paged"), (5, "contiguous")])
def test_greedy_equals_plain_greedy(pair, k, cache):
    target, draft = pair
    params = SamplingParams(temperature=0, max_new_tokens=12, logprobs=2)
    ref = generate(target, PROMPTS, params, cache=cache)
    spec = generate(target, PROMPTS, params, draft_model=draft, num_speculative_tokens=k, cache=cache,
                    draft_cache=cache)
    for r, s in zip(ref, spec):
        assert s.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(s.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        m = s.outputs[0].metrics
        assert m.draft_proposed > 0 and 0 <= m.acceptance_rate <= 1
        assert m.mean_accepted_tokens >= 1.0


def test_greedy_without_cache_equals_plain_greedy(pair):
    target, draft = pair
    params = SamplingParams(temperature=0, max_new_tokens=9)
    ref = generate(target, PROMPTS, params)
    spec = generate(target, PROMPTS, params, draft_model=draft, num_speculative_tokens=2, use_cache=False)
    assert [s.outputs[0].token_ids for s in spec] == [r.outputs[0].token_ids for r in ref]


def test_self_draft_accepts_everything(pair):
    target, _ = pair
    out = generate(target, PROMPTS, SamplingParams(temperature=0, max_new_tokens=13), draft_model=target,
                   num_speculative_tokens=4)
    for o in out:
        m = o.outputs[0].metrics
        assert m.acceptance_rate == 1.0
        # 1 token from the prefill, then 5 per verification step
        assert m.mean_accepted_tokens > 3.0


def test_streaming_speculative_events_rebuild_the_output(pair):
    from plyx.serve import stream_generate

    target, draft = pair
    params = SamplingParams(temperature=0, max_new_tokens=11)
    stream = stream_generate(target, PROMPTS, params, draft_model=draft, num_speculative_tokens=3)
    got: dict[int, list[int]] = {}
    for ev in stream:
        assert not torch.is_inference_mode_enabled()
        got.setdefault(ev.request_index, []).extend(ev.token_ids)
    assert [got[i] for i in range(len(PROMPTS))] == [list(o.outputs[0].token_ids) for o in stream.outputs()]
    assert all(len(v) == 11 for v in got.values())


def test_stop_inside_an_accepted_window(pair):
    target, draft = pair
    free = generate(target, PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=15))[0].outputs[0].token_ids
    stop = free[6]
    out = generate(target, PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=15), eos_token_id=stop,
                   draft_model=target, num_speculative_tokens=4)[0].outputs[0]
    assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"


def _perturbed(model, scale: float, seed: int):
    """A draft close to the target but not equal: acceptance is neither ~0 nor ~1, so both the accept path
    and the residual path are exercised."""
    import copy

    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp(min=1e-3))
    return draft


def test_sampling_frequencies_match_the_target(make_model, chi_square_p):
    """Joint law of the first two tokens under speculative sampling = the target's exact p(x1) p(x2 | x1)."""
    V = 6
    target = make_model(vocab=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=8, seed=3,
                        init_std=0.6)
    draft = _perturbed(target, 0.5, seed=4)
    prompt = [1, 2]
    with torch.no_grad():  # exact target law: 36 cells
        p1 = target(torch.tensor([prompt]))[0, -1].double().softmax(-1)
        both = torch.tensor([prompt + [a] for a in range(V)])
        p2 = target(both)[:, -1].double().softmax(-1)  # [V, V]: p(x2 | x1 = row)
        q1 = draft(torch.tensor([prompt]))[0, -1].double().softmax(-1)
        q2 = draft(both)[:, -1].double().softmax(-1)
    exact = (p1[:, None] * p2).reshape(-1)
    draft_law = (q1[:, None] * q2).reshape(-1)
    n = 4000
    out = generate(target, [prompt], SamplingParams(n=n, temperature=1.0, max_new_tokens=2, ignore_eos=True),
                   draft_model=draft, num_speculative_tokens=2, generator=torch.Generator().manual_seed(0),
                   cache="paged", draft_cache="paged")[0]
    # the first token comes from the prefill; the second from a verification step, through rejection sampling
    counts = torch.zeros(V * V, dtype=torch.float64)
    for o in out.outputs:
        a, b = o.token_ids
        counts[a * V + b] += 1
    p_value = chi_square_p(counts, exact)
    assert p_value > 1e-3, p_value
    assert chi_square_p(counts, draft_law) < 1e-6  # the test can tell the draft's law apart
    # acceptance: the first draft token is accepted with probability sum_x min(p(x|c), q(x|c)), c ~ p1
    alpha = float((p1 * torch.minimum(p2, q2).sum(-1)).sum())
    first_accepted = sum(o.metrics.draft_accepted >= 1 for o in out.outputs) / n
    sigma = (alpha * (1 - alpha) / n) ** 0.5
    assert abs(first_accepted - alpha) < 5 * sigma, (first_accepted, alpha)
    rate = sum(o.metrics.acceptance_rate for o in out.outputs) / n
    print(f"speculative: acceptance rate {rate:.3f} (first draft token {first_accepted:.3f}, exact {alpha:.3f}), "
          f"chi-square p = {p_value:.3f}")


def test_longer_sampling_runs_are_target_distributed(make_model, chi_square_p):
    """A window of k = 3 drafts: the law of the 4th token (accepted or corrected) equals the target's."""
    V = 5
    kw = dict(vocab=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=10, init_std=0.6)
    target = make_model(seed=5, **kw)
    draft = _perturbed(target, 0.5, seed=6)
    prompt = [0, 1, 2]
    n = 2000
    out = generate(target, [prompt], SamplingParams(n=n, temperature=0.9, top_k=4, max_new_tokens=4, ignore_eos=True),
                   draft_model=draft, num_speculative_tokens=3, generator=torch.Generator().manual_seed(1))[0]
    seqs = [o.token_ids for o in out.outputs]
    # condition on the most frequent 3-token prefix and test the 4th token's law
    prefix = max(set(s[:3] for s in seqs), key=lambda p: sum(s[:3] == p for s in seqs))
    tail = torch.tensor([s[3] for s in seqs if s[:3] == prefix])
    assert len(tail) > 150
    with torch.no_grad():
        logits = target(torch.tensor([prompt + list(prefix)]))[0, -1].double() / 0.9
    kth = logits.topk(4).values[-1]
    probs = logits.masked_fill(logits < kth, float("-inf")).softmax(-1)
    counts = torch.bincount(tail, minlength=V).double()
    keep = probs > 0
    assert counts[~keep].sum() == 0  # top-k is respected by the corrected tokens too
    assert chi_square_p(counts[keep], probs[keep]) > 1e-3


# -- prompt lookup (n-gram) speculation: no draft model ---------------------------------------
REPEATS = [[1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [3, 4, 3, 4, 3, 4, 3], [1, 10, 11, 12]]


@pytest.mark.parametrize("k, cache, sizes", [(1, "contiguous", (1, 3)), (3, "paged", (2, 4)), (5, "contiguous", (1, 1))])
def test_ngram_greedy_equals_plain_greedy(pair, k, cache, sizes):
    target, _ = pair
    params = SamplingParams(temperature=0, max_new_tokens=24, logprobs=2)
    ref = generate(target, REPEATS, params, cache=cache)
    spec = generate(target, REPEATS, params, draft_model="ngram", num_speculative_tokens=k, cache=cache,
                    prompt_lookup_min=sizes[0], prompt_lookup_max=sizes[1])
    for r, s in zip(ref, spec):
        assert s.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(s.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    metrics = [s.outputs[0].metrics for s in spec]
    assert sum(m.draft_proposed for m in metrics) > 0
    assert sum(m.draft_accepted for m in metrics) > 0  # the repeating prompts are copied: some drafts land
    for m in metrics:
        assert m.draft_accepted <= m.draft_proposed
        assert m.model_steps < 24 + 1 or m.draft_accepted == 0


def test_ngram_without_cache_and_streamed(pair):
    from plyx.serve import stream_generate

    target, _ = pair
    params = SamplingParams(temperature=0, max_new_tokens=10)
    ref = generate(target, REPEATS, params)
    assert [s.outputs[0].token_ids for s in generate(target, REPEATS, params, draft_model="ngram",
                                                     use_cache=False)] == [r.outputs[0].token_ids for r in ref]
    stream = stream_generate(target, REPEATS, params, draft_model="ngram", num_speculative_tokens=4)
    got: dict[int, list[int]] = {}
    for ev in stream:
        got.setdefault(ev.request_index, []).extend(ev.token_ids)
    assert [got[i] for i in range(len(REPEATS))] == [list(r.outputs[0].token_ids) for r in ref]


def test_ngram_copies_a_repeating_output_in_few_steps(make_model):
    """A model that repeats its context (the identity-like copy a lookup predicts) accepts whole windows."""
    target = make_model(seed=0, init_std=0.1)
    prompt = [7, 8, 9, 10] * 4
    ref = generate(target, [prompt], SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True))[0].outputs[0]
    out = generate(target, [prompt], SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True),
                   draft_model="ngram", num_speculative_tokens=4, prompt_lookup_max=4)[0].outputs[0]
    assert out.token_ids == ref.token_ids
    m = out.metrics
    # the first token comes from the prefill; each verification step emits its accepted drafts plus one
    # token of the target's (or fewer when the length limit cuts the window)
    assert m.num_generated == 32 and m.model_steps + m.draft_accepted >= 32
    assert m.draft_accepted > 0 and m.model_steps < 32


def test_ngram_sampling_law_is_the_target(make_model, chi_square_p):
    """Joint law of three sampled tokens under n-gram speculation = the target's p(x1) p(x2|x1) p(x3|x1 x2)."""
    V = 4
    target = make_model(vocab=V, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, max_seq_len=12, seed=3,
                        init_std=0.6)
    prompt = [0, 1, 2, 3, 0, 1]  # every token occurs: most rounds find a draft
    with torch.no_grad():
        p1 = target(torch.tensor([prompt]))[0, -1].double().softmax(-1)  # [V]
        p2 = target(torch.tensor([prompt + [a] for a in range(V)]))[:, -1].double().softmax(-1)  # [V, V]
        p3 = target(torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)]))[:, -1].double().softmax(-1)
    exact = (p1[:, None] * p2).reshape(-1)[:, None] * p3  # [V*V, V]
    n = 4000
    out = generate(target, [prompt], SamplingParams(n=n, temperature=1.0, max_new_tokens=3, ignore_eos=True),
                   draft_model="ngram", num_speculative_tokens=2, prompt_lookup_max=2,
                   generator=torch.Generator().manual_seed(0), cache="paged")[0]
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for o in out.outputs:
        a, b, c = o.token_ids
        counts[(a * V + b) * V + c] += 1
    p_value = chi_square_p(counts, exact.reshape(-1))
    assert p_value > 1e-3, p_value
    proposed = sum(o.metrics.draft_proposed for o in out.outputs)
    accepted = sum(o.metrics.draft_accepted for o in out.outputs)
    assert 0 < accepted < proposed  # both the accept and the residual paths ran


def test_ngram_bad_options_are_named(pair, counting):
    from plyx.specs.errors import ConfigError

    target, _ = pair
    model = counting(target)
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        generate(model, REPEATS, SamplingParams(max_new_tokens=2), draft_model="ngram", prompt_lookup_min=4,
                 prompt_lookup_max=2)
    with pytest.raises(ConfigError, match="'ngram'"):
        generate(model, REPEATS, SamplingParams(max_new_tokens=2), draft_model="medusa")
    with pytest.raises(ConfigError, match="repetition_penalty"):
        generate(model, REPEATS, SamplingParams(max_new_tokens=2, repetition_penalty=1.2), draft_model="ngram")
    assert model.calls == 0
