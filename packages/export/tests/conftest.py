"""Shared fixtures of plyx-export's tests: tiny random models of every architecture, and a hook recorder."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from plyx.model import TransformerLM
from plyx.specs import ModelConfig, hookimpl, plugins

#: the plugins an export needs; others installed beside them (plyx-governance...) stay out of hook tests
EXPORT_PLUGINS = "export,model,attn,kernel"

def _tiny_config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                                max_seq_len=32, rope_theta=10000.0)
    base.update(overrides)
    return ModelConfig(**base)


def _random_model(config: ModelConfig, seed: int = 0) -> TransformerLM:
    """Weights large enough that a wrong op shows in the logits (norm weights random around 1)."""
    torch.manual_seed(seed)
    model = TransformerLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.2)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.add_(1.0)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_config():
    """``tiny_config(**overrides)``: a 2-layer GQA ModelConfig with small sizes (vocab 101, max_seq_len 32)."""
    return _tiny_config


@pytest.fixture(scope="session")
def random_model():
    """``random_model(config, seed=0)``: an eval-mode TransformerLM with large random weights."""
    return _random_model


class HookRecorder:
    """An in-process plugin that records every ``plyx_on_export_written`` call."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail = fail

    @hookimpl
    def plyx_on_export_written(self, path: str, format: str, metadata: dict[str, Any]) -> None:
        self.calls.append({"path": path, "format": format, "metadata": metadata})
        if self.fail:
            raise RuntimeError("recorder asked to fail")


@pytest.fixture
def only_export_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Load only the plugins an export needs, for this test alone.

    An installed plyx-governance would otherwise attach to the hook under test
    and write its records into the export. The scan is redone after the test,
    so other planes' tests in the same process see every plugin again.
    """
    monkeypatch.setenv("PLYX_PLUGINS", EXPORT_PLUGINS)
    plugins.reset_plugins()
    try:
        yield
    finally:
        plugins.reset_plugins()


@pytest.fixture
def hook_recorder(only_export_plugins: None) -> Iterator[HookRecorder]:
    recorder = HookRecorder()
    plugins.register_plugin(recorder, "export-test-recorder")
    try:
        yield recorder
    finally:
        plugins.unregister_plugin("export-test-recorder")


CORPUS = ("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and "
          "arrows of outrageous fortune, or to take arms against a sea of troubles and by opposing end them. ") * 8


def _bpe_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE with one special token (id 0), built as plyx-train builds its tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS], trainer=trainer)
    return tok


@pytest.fixture(scope="session")
def checkpoint_with_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoint_with_tokenizer(config, seed=0) -> (dir, model)``: a saved plyx checkpoint whose directory
    holds a byte-level BPE ``tokenizer.json`` of ``config.vocab_size - 20`` ids (the model's rows beyond are unused)."""
    from plyx.model import save_checkpoint

    made: dict[tuple[Any, int], Any] = {}

    def make(config: ModelConfig, seed: int = 0) -> tuple[Any, TransformerLM]:
        key = (config, seed)
        if key not in made:
            model = _random_model(config, seed)
            path = tmp_path_factory.mktemp("ckpt") / "tiny"
            save_checkpoint(model, path, card_fields={"name": "tiny-export-test", "tokenizer": "tokenizer.json"})
            _bpe_tokenizer(config.vocab_size - 20).save(str(path / "tokenizer.json"))
            made[key] = (path, model)
        return made[key]

    return make


@pytest.fixture(scope="session")
def corpus_text() -> str:
    """The text the test tokenizers are trained on (also the int8-static calibration text)."""
    return CORPUS
