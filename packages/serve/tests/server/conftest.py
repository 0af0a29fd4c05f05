"""Fixtures of the server tests: a tiny model directory (plyx checkpoint + tokenizer) and uvicorn on loopback."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from plyx.specs import ModelConfig

API_KEY = "sk-plyx-test"
MODEL_NAME = "tiny"


def small_lm(vocab: int, max_seq_len: int = 512, seed: int = 0):
    """A random TransformerLM; init_std 0.5 spreads the logits so greedy choices have clear margins."""
    from plyx.model import TransformerLM

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                      max_seq_len=max_seq_len, init_std=0.5)
    return TransformerLM(cfg).eval()


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"answer": "yes", "count": 3, "ok": true}', "hello world, the quick brown fox 0123456789",
              "You are a helpful assistant. Answer briefly.", "user assistant system"] * 10
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="session")
def bpe():
    return train_tokenizer()


@pytest.fixture(scope="session")
def server_lm(bpe):
    return small_lm(-(-bpe.get_vocab_size() // 16) * 16)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, server_lm, bpe) -> Path:
    """A plyx checkpoint directory with tokenizer.json and a chatml tokenizer_config.json: what ``plyx serve`` opens."""
    from plyx.model import save_checkpoint
    from plyx.serve.server import BUILTIN_TEMPLATES

    d = tmp_path_factory.mktemp("models") / MODEL_NAME
    save_checkpoint(server_lm, d)
    bpe.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": None, "chat_template": BUILTIN_TEMPLATES["chatml"]}))
    return d


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models run fastest on one intra-op thread (two threads on a busy 2-core machine wait on each other)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Running:
    """A uvicorn server on 127.0.0.1 in a background thread."""

    def __init__(self, app: Any, server: Any, thread: threading.Thread) -> None:
        self.app = app
        self.server = server
        self.thread = thread
        port = server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.api_key = app.state.plyx.settings.api_key
        self.model_name = app.state.plyx.settings.model_name
        self.headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def engine(self) -> Any:
        return self.app.state.plyx.engine


@contextlib.contextmanager
def serve(app: Any) -> Iterator[Running]:
    from plyx.serve.server import serve_in_thread

    with serve_in_thread(app, start_timeout=30, timeout_graceful_shutdown=5) as running:
        yield Running(app, running.server, running.thread)


def make_app(model: Any, tok: Any, *, engine_kw: dict[str, Any] | None = None, **settings: Any) -> Any:
    from plyx.serve.engine import Engine, EngineConfig
    from plyx.serve.server import ServerSettings, create_app

    engine = Engine(model, tokenizer=tok, config=EngineConfig(**{
        "max_batch_size": 16, "max_batch_tokens": 128, "block_size": 4, "num_blocks": 512, **(engine_kw or {})}))
    s = {"model_name": MODEL_NAME, "api_key": API_KEY, **settings}
    return create_app(engine, settings=ServerSettings(**s), chat_template="chatml")


@pytest.fixture(scope="module")
def server(server_lm, bpe) -> Iterator[Running]:
    torch.set_num_threads(1)
    with serve(make_app(server_lm, bpe)) as running:
        yield running


def reference(model: Any, tok: Any, prompt_ids: list[int], max_tokens: int, **params: Any) -> Any:
    """The request run alone (sequentially, batch of one) on a fresh engine: the expected greedy answer (the
    model's own, no guardrails: tests compare a guarded server against it)."""
    from plyx.serve import SamplingParams
    from plyx.serve.engine import Engine, EngineConfig

    engine = Engine(model, tokenizer=tok, config=EngineConfig(max_batch_size=1, max_batch_tokens=512, block_size=4,
                                                              num_blocks=256, prefix_caching=False, guardrails=False))
    sp = SamplingParams(temperature=0, max_new_tokens=max_tokens, **params)
    return engine.generate([prompt_ids], sp)[0].outputs[0]


@pytest.fixture(scope="session")
def greedy_reference():
    """``greedy_reference(model, tok, prompt_ids, max_tokens, **params)``: see ``reference``."""
    return reference


@pytest.fixture(scope="session")
def serving():
    """Helpers for tests that start their own servers: ``serving.serve(app)``, ``serving.make_app(...)``."""
    import types

    return types.SimpleNamespace(serve=serve, make_app=make_app, API_KEY=API_KEY, MODEL_NAME=MODEL_NAME)
