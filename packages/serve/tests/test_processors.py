"""Each built-in processor against transformers' warper of the same name, plus per-row parameters and samplers."""

from __future__ import annotations

import pytest
import torch
from plyx.serve import SamplingState
from plyx.serve import _processors as P
from plyx.serve._pipeline import BUILTIN_COMPONENTS, sampler_components
from transformers.generation import logits_process as hf

B, V = 5, 211  # odd vocabulary: no power-of-two luck


def _state(prompts, outputs=None, v=V):
    state = SamplingState.for_prompts(prompts, v, "cpu", [None] * len(prompts))
    for toks in outputs or []:
        state.update(torch.tensor(toks))
    return state


def _logits(seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lambda: P.TopK(7), lambda: hf.TopKLogitsWarper(7)),
        (lambda: P.TopK(1), lambda: hf.TopKLogitsWarper(1)),
        (lambda: P.TopP(0.5), lambda: hf.TopPLogitsWarper(0.5)),
        (lambda: P.TopP(0.93), lambda: hf.TopPLogitsWarper(0.93)),
        (lambda: P.MinP(0.1), lambda: hf.MinPLogitsWarper(0.1)),
        (lambda: P.TypicalP(0.6), lambda: hf.TypicalLogitsWarper(0.6)),
        (lambda: P.Temperature(0.7), lambda: hf.TemperatureLogitsWarper(0.7)),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_warpers_match_transformers(ours, theirs, seed):
    logits = _logits(seed)
    got = ours()(logits.clone(), _state([[0]] * B))
    want = theirs()(torch.zeros(B, 1, dtype=torch.long), logits.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[~torch.isinf(got)], want[~torch.isinf(want)])
    assert (~torch.isinf(got)).sum(-1).min() >= 1  # never masks a whole row


@pytest.mark.parametrize("penalty", [1.3, 0.8])
def test_repetition_penalty_matches_transformers(penalty):
    logits = _logits(2)
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
    generated = [[20, 21, 22, 23, 24], [1, 4, 5, 7, 20]]  # two steps, one token per row each
    state = _state(prompts, generated)
    seqs = torch.tensor([p + [generated[0][i], generated[1][i]] + [p[0]] * (4 - len(p)) for i, p in enumerate(prompts)])
    got = P.RepetitionPenalty(penalty)(logits.clone(), state)
    want = hf.RepetitionPenaltyLogitsProcessor(penalty)(seqs, logits.clone())
    torch.testing.assert_close(got, want)


def test_per_row_parameters_equal_row_by_row():
    logits = _logits(3)
    ks, ps, temps = [0, 3, 50, 1, 7], [1.0, 0.3, 0.9, 0.5, 0.99], [1.0, 0.5, 2.0, 0.0, 1.3]
    state = _state([[0]] * B)
    for batched, single in [
        (P.TopK(ks), lambda i: P.TopK(ks[i])),
        (P.TopP(ps), lambda i: P.TopP(ps[i])),
        (P.Temperature(temps), lambda i: P.Temperature(temps[i])),
        (P.MinP(ps), lambda i: P.MinP(ps[i])),
    ]:
        out = batched(logits.clone(), state)
        for i in range(B):
            torch.testing.assert_close(out[i:i + 1], single(i)(logits[i:i + 1].clone(), state.select([i])))


def test_presence_frequency_penalty_formula():
    logits = _logits(4)
    state = _state([[0]] * B, [[3, 3, 3, 3, 3], [3, 4, 5, 6, 7], [9, 9, 9, 9, 9]])
    out = P.PresenceFrequencyPenalty(presence=[0.5] * B, frequency=[0.25] * B)(logits.clone(), state)
    counts = torch.zeros(B, V)
    for toks in ([3] * 5, [3, 4, 5, 6, 7], [9] * 5):
        for r, t in enumerate(toks):
            counts[r, t] += 1
    torch.testing.assert_close(out, logits - 0.25 * counts - 0.5 * (counts > 0).float())


def test_logit_bias_banned_and_min_tokens():
    logits = _logits(5)
    state = _state([[0]] * B)
    out = P.LogitBias([{3: 5.0}, None, {0: -100.0, 7: 1.5}, {}, None])(logits.clone(), state)
    assert out[0, 3] == logits[0, 3] + 5.0 and out[2, 7] == logits[2, 7] + 1.5 and torch.equal(out[1], logits[1])
    out = P.BannedTokens([[1, 2], [], [5], [], [210]])(logits.clone(), state)
    assert torch.isinf(out[0, [1, 2]]).all() and torch.isinf(out[4, 210]) and torch.isfinite(out[1]).all()
    mt = P.MinTokens([0, 2, 2, 0, 0], [[9]] * B)
    assert torch.isinf(mt(logits.clone(), state)[1:3, 9]).all() and torch.isfinite(mt(logits.clone(), state)[0, 9])
    state.update(torch.zeros(B, dtype=torch.long))
    state.update(torch.zeros(B, dtype=torch.long))
    assert torch.isfinite(mt(logits.clone(), state)[:, 9]).all()  # after 2 tokens the stop id is allowed


def test_multinomial_sampler_matches_softmax(chi_square_p):
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 1.5
    probs = logits.softmax(-1)[0].double()
    n = 20000
    state = SamplingState.for_prompts([[0]] * n, 12, "cpu", [None] * n, torch.Generator().manual_seed(1))
    toks = P.MultinomialSampler()(logits.expand(n, 12), state)
    counts = torch.bincount(toks, minlength=12).double()
    assert chi_square_p(counts, probs) > 1e-3
    # the test has power: a wrong distribution (temperature 2) is rejected
    assert chi_square_p(counts, (logits / 2).softmax(-1)[0].double()) < 1e-6


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(6, scale=0.5)
    g = [torch.Generator().manual_seed(i) for i in range(B)]
    full = P.MultinomialSampler()(logits, SamplingState.for_prompts([[0]] * B, V, "cpu", g))
    g2 = torch.Generator().manual_seed(3)
    alone = P.MultinomialSampler()(logits[3:4], SamplingState.for_prompts([[0]], V, "cpu", [g2]))
    assert full[3] == alone[0]


def test_every_builtin_is_a_registered_plugin():
    from plyx.specs.plugins import components

    found = components("plyx_samplers")
    for name in BUILTIN_COMPONENTS:
        assert name in found and found[name].source.startswith("plyx-serve"), name
    assert set(BUILTIN_COMPONENTS) <= set(sampler_components())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host-sync detection needs CUDA")
def test_processors_do_not_sync_on_cuda():
    logits = _logits(7).cuda()
    state = SamplingState.for_prompts([[1, 2]] * B, V, "cuda", [None] * B)
    procs = [P.TopK([3] * B), P.TopP([0.9] * B), P.MinP([0.1] * B), P.TypicalP([0.9] * B), P.Temperature([0.7] * B),
             P.RepetitionPenalty([1.2] * B), P.PresenceFrequencyPenalty([0.1] * B, [0.1] * B)]
    for p in procs:  # first call builds the per-row tensors (one upload)
        p(logits, state)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for p in procs:
            logits = p(logits, state)
        P.MultinomialSampler()(logits, state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
