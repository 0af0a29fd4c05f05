"""NEFTune: uniform noise of scale alpha / sqrt(L * d) on the input embeddings, in train mode only."""

from __future__ import annotations

import math

import pytest
import torch
from plyx.model.adapters import AdapterError, neftune
from torch import nn


def _embeddings(model, ids):
    seen = []
    handle = model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    model(ids)
    handle.remove()
    return seen[0]


def test_noise_in_train_mode_with_the_papers_scale(tiny, random_model):
    model = random_model(tiny(d_model=64, n_heads=4))
    ids = torch.randint(0, 97, (8, 48))
    clean = model.embed_tokens(ids).detach()
    alpha = 5.0
    bound = alpha / math.sqrt(48 * 64)  # L = 48 tokens, d = 64
    with neftune(model, alpha) as handle:
        assert handle.alpha == alpha
        model.train()
        noise = _embeddings(model, ids) - clean
        # U(-bound, bound): every draw within the bound, the extremes reached, mean 0, variance bound^2 / 3
        # (24,576 draws: the sample std of the mean is bound / sqrt(3 * 24576) ~ 0.004 bound)
        assert noise.abs().max() <= bound * (1 + 1e-6)
        assert noise.abs().max() > 0.99 * bound
        assert abs(noise.mean().item()) < 0.03 * bound
        assert noise.var().item() == pytest.approx(bound**2 / 3, rel=0.05)
        second = _embeddings(model, ids) - clean
        assert not torch.equal(noise, second)  # fresh noise each forward
        model.eval()
        torch.testing.assert_close(_embeddings(model, ids), clean, rtol=0, atol=0)
    model.train()  # removed on exiting the block
    torch.testing.assert_close(_embeddings(model, ids), clean, rtol=0, atol=0)


def test_gradients_flow_through_the_noisy_embeddings(tiny, random_model):
    model = random_model(tiny()).train()
    handle = neftune(model, 10.0)
    model(torch.randint(0, 97, (2, 6))).sum().backward()
    assert model.embed_tokens.weight.grad is not None and model.embed_tokens.weight.grad.abs().sum() > 0
    handle.remove()
    handle.remove()  # idempotent


def test_bad_input():
    for alpha in (0, -1.0, float("nan"), float("inf"), "5"):
        with pytest.raises(AdapterError, match="alpha must be a finite number > 0"):
            neftune(nn.Module(), alpha)
    with pytest.raises(AdapterError, match="embed_tokens.*not a wrapper"):
        neftune(nn.Sequential(nn.Embedding(3, 4)), 5.0)
