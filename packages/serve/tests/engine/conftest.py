"""Fixtures of the engine tests: a tiny random model with spread-out logits and a small BPE tokenizer."""

from __future__ import annotations

import pytest
import torch
from plyx.specs import ModelConfig


def small_lm(*, vocab: int = 256, max_seq_len: int = 160, seed: int = 0):
    """A random TransformerLM; init_std 0.5 spreads the logits so greedy choices have clear margins (batched and
    alone runs then agree exactly, as a trained model's do)."""
    from plyx.model import TransformerLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                      max_seq_len=max_seq_len, init_std=0.5)
    return TransformerLM(cfg).eval()


@pytest.fixture(scope="session")
def lm():
    return small_lm()


@pytest.fixture(scope="session")
def bpe():
    """A byte-level BPE trained on a few lines; id 0 is <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"answer": "yes", "count": 3, "ok": true}', "hello world, the quick brown fox 0123456789",
              "You are a helpful assistant. Answer briefly."] * 10
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="session")
def bpe_lm(bpe):
    return small_lm(vocab=-(-bpe.get_vocab_size() // 16) * 16)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one intra-op thread (two threads on a busy 2-core machine wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
