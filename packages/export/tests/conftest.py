"""Shared fixtures of plyx-export's tests: tiny random models of every architecture, and a hook recorder."""

from __future__ import annotations

import os

# Only the planes an export needs: other installed plugins (plyx-governance,
# third-party kernels...) would otherwise attach to every export of these tests.
# Set before anything scans the entry points.
os.environ["PLYX_PLUGINS"] = "export,model,attn,kernel"

from collections.abc import Iterator  # noqa: E402 (after the environment is set)
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from plyx.model import TransformerLM  # noqa: E402
from plyx.specs import ModelConfig, hookimpl, plugins  # noqa: E402

plugins.reset_plugins()

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
def hook_recorder() -> Iterator[HookRecorder]:
    recorder = HookRecorder()
    plugins.register_plugin(recorder, "export-test-recorder")
    try:
        yield recorder
    finally:
        plugins.unregister_plugin("export-test-recorder")
