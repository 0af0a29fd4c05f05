"""Shared fixtures: a tiny corpus, its prepared shards and a tiny model config (fast on 2 CPU cores)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter for the test that runs the Triton kernels on CPU (test_compile.py); read when triton
    # is first imported (plyx-train's imports below may import it), so before them
    os.environ.setdefault("TRITON_INTERPRET", "1")

from plyx.specs import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig
from plyx.train import prepare_corpus

WORDS = ("the king and queen of the realm spoke to their people about war and peace "
         "honour love death night day sword crown bread wine river stone").split()


def make_corpus(path: Path, docs: int = 120, seed: int = 0) -> Path:
    """Paragraph documents separated by blank lines, with a little punctuation and unicode."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(docs):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 40))]
        paragraphs.append(f"SPEAKER {i % 7}:\n" + " ".join(words).capitalize() + ("." if i % 3 else "! — ô"))
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the cwd or the user's cache: both point into tmp dirs.

    The cwd matters because ``plyx train`` defaults to ``runs/<name>`` under it, and README command 1
    leaves a real run there; the cache because the bundled corpus is prepared into it.
    """
    cache = tmp_path_factory.mktemp("plyx-cache")
    monkeypatch.setenv("PLYX_CACHE_DIR", str(cache))
    monkeypatch.delenv("PLYX_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache / "xdg"))
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare_corpus(corpus, out, vocab_size=300, val_fraction=0.2, separator="\n\n", use_hooks=False)
    return out


def _merge(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _tiny_config(data_dir: Path, out_dir: Path, **overrides: object) -> TrainConfig:
    """A 2-layer, 32-wide model on the tiny corpus; a step takes a few milliseconds."""
    base = TrainConfig(
        model=ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=32),
        data=DataConfig(path=str(data_dir), seq_len=16, mode="windows", val_fraction=0.2, vocab_size=300),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=1),
        steps=8,
        batch_size=4,
        device="cpu",
        out_dir=str(out_dir),
        log_every=2,
        eval_every=4,
        eval_steps=2,
        checkpoint_every=4,
        sample_tokens=8,
    )
    # nested tables merge into the defaults: data={"mode": "packed"} keeps data.path
    return TrainConfig.from_dict(_merge(base.to_dict(), overrides)) if overrides else base


@pytest.fixture()
def tiny_config():
    """``tiny_config(data_dir, out_dir, **overrides)``: a TrainConfig for the tiny model."""
    return _tiny_config
