"""Shared fixtures of plyx-model's tests."""

from __future__ import annotations

import pytest
import torch
from plyx.model import TransformerLM
from plyx.specs import ModelConfig


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)
    base.update(overrides)
    return ModelConfig(**base)


def _random_model(config: ModelConfig, std: float = 0.2) -> TransformerLM:
    """Weights large enough that mistakes show in the logits (norm weights random too)."""
    model = TransformerLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
            if p.dim() == 1 and p.shape[0] in (config.d_model, config.dim_per_head):
                p.add_(1.0)  # keep norms near 1
    return model.eval()


@pytest.fixture
def tiny():
    """``tiny(**overrides)``: a 2-layer GQA ModelConfig with small sizes."""
    return _tiny


@pytest.fixture
def random_model():
    """``random_model(config)``: an eval-mode TransformerLM with large random weights."""
    return _random_model
