"""Shared fixtures: tiny random models (plyx and transformers twins) and a small byte-level BPE tokenizer."""

from __future__ import annotations

import pytest
import torch
from plyx.specs import ModelConfig

torch.set_num_threads(1)  # tiny models gain nothing from intra-op threads, and spinning OpenMP threads suffer badly on a shared 2-core CI box


def _transformer_lm():
    from plyx.model import TransformerLM

    return TransformerLM


def tiny_model(*, vocab: int = 128, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2,
               d_ff: int = 128, max_seq_len: int = 128, seed: int = 0, init_std: float = 0.02):
    """A random plyx TransformerLM in eval mode."""
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         d_ff=d_ff, max_seq_len=max_seq_len, init_std=init_std)
    return _transformer_lm()(config).eval()


def hf_twin(directory, *, vocab: int = 128, seed: int = 0):
    """A random transformers LlamaForCausalLM and the plyx TransformerLM ``plyx.model.load_hf`` reads from its
    saved directory (the real interop path: safetensors + config.json)."""
    from plyx.model import load_hf
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hc = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = LlamaForCausalLM(hc).eval()
    hf.save_pretrained(directory, safe_serialization=True)
    return hf, load_hf(directory).eval()


@pytest.fixture(scope="session")
def hf_pair(tmp_path_factory):
    return hf_twin(tmp_path_factory.mktemp("hf-llama"))


@pytest.fixture(scope="session")
def tokenizer():
    """A byte-level BPE (GPT-2 style) trained on a few lines; id 0 is <eos>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        '{"name": "alice", "age": 31, "tags": ["x", "y"], "ok": true}',
        "hello world, the quick brown fox jumps over the lazy dog 0123456789",
        "user@example.com bob@test.org yes no maybe [1, 2, 3]",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="session")
def tok_model(tokenizer):
    """A random model whose vocabulary covers the tokenizer (rows past it are padding, as in real models)."""
    vocab = -(-tokenizer.get_vocab_size() // 32) * 32
    return tiny_model(vocab=vocab, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)


class CountingModel(torch.nn.Module):
    """Wraps a model and counts forward calls: proves errors are raised before any compute."""

    def __init__(self, model):
        super().__init__()
        self.inner = model
        self.config = model.config
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.fixture
def counting():
    return CountingModel


@pytest.fixture(scope="session")
def make_model():
    """``make_model(**sizes)``: a random TransformerLM (see ``tiny_model``)."""
    return tiny_model


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs``: the chi2 survival function is the
    regularized upper gamma Q(dof/2, stat/2). A draw in a category of probability 0 gives p = 0."""
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 0
    if bool((counts[~keep] > 0).any()):
        return 0.0
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


@pytest.fixture
def chi_square_p():
    """``chi_square_p(counts, probs) -> p-value`` (Pearson), for the sampling-law tests."""
    return _chi_square_p
