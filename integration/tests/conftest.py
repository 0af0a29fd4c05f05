"""Shared fixtures of the cross-plane scenarios: one tiny model trained once per session with plyx-train.

The run is real (plyx.train.Trainer on a corpus written here, tokenizer trained on it) and
small enough for 2 CPU cores: a 2-layer, 64-wide Llama-style model, 6 optimizer steps of
4 x 16 tokens. Every scenario that needs "a trained checkpoint" shares this one, so the
session pays for one training run (the import of torch dominates its cost anyway).

The corpus repeats two marker words, ``villain`` and ``dagger``, so the byte-level BPE
learns each as one token (`` villain``, `` dagger``); the serve + safety scenario forces
them into the model's output with ``logit_bias`` to drive the output rails.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

WORDS = ("the king and queen of the realm spoke to their people about war and peace honour love "
         "death night day sword crown bread wine river stone").split()
MARKERS = ("villain", "dagger")  # frequent whole words: single BPE tokens with a leading space


def write_corpus(path: Path, docs: int = 90, seed: int = 0) -> Path:
    """Paragraph documents separated by blank lines; every document holds both marker words."""
    rng = random.Random(seed)
    paragraphs = []
    for i in range(docs):
        words = [rng.choice(WORDS) for _ in range(rng.randint(10, 30))] + list(MARKERS) * 3
        rng.shuffle(words)
        paragraphs.append(f"SPEAKER {i % 5}:\n" + " ".join(words).capitalize() + ".")
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path


@attrs.frozen
class Trained:
    """What the session's training run left: the run directory, its last checkpoint and the result."""

    out_dir: Path
    checkpoint: Path
    losses: list[float]
    config: object


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trained]:
    """Train the tiny model for 6 steps with plyx-train's public API; governance is installed, so its
    ``plyx_on_checkpoint_saved`` hook writes RECEIPT.json into the checkpoint directory."""
    import torch
    from plyx.specs import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig
    from plyx.train import Trainer, TrainOptions

    root = tmp_path_factory.mktemp("train")
    corpus = write_corpus(root / "corpus.txt")
    config = TrainConfig(
        # d_ff 128: a multiple of 8, so the example kernel plugin's swiglu predicate holds for this model
        model=ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=256),
        data=DataConfig(path=str(corpus), seq_len=16, mode="windows", val_fraction=0.2, vocab_size=300),
        optimizer=OptimizerConfig(lr=1e-2, grad_clip=1.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=1),
        steps=6,
        batch_size=4,
        device="cpu",
        out_dir=str(root / "run"),
        log_every=2,
        eval_every=0,
        checkpoint_every=0,
        sample_tokens=0,
    )
    with pytest.MonkeyPatch.context() as mp:
        # keep the bundled-data cache and any signing key of the developer's shell out of the run
        mp.setenv("PLYX_DATA_DIR", str(root / "cache"))
        mp.delenv("PLYX_SIGNING_KEY", raising=False)
        mp.delenv("PLYX_REQUIRE_SIGNING_KEY", raising=False)
        mp.delenv("PLYX_SAFETY_POLICY", raising=False)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny matrices: a second intra-op thread only waits on the first
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # e.g. "no tensorboard"; not what is tested here
                result = Trainer(config, options=TrainOptions(progress=False, tensorboard=False,
                                                              handle_signals=False)).fit()
        finally:
            torch.set_num_threads(threads)
        assert result.checkpoint is not None, "the training run wrote no checkpoint"
        yield Trained(out_dir=root / "run", checkpoint=Path(result.checkpoint), losses=list(result.losses),
                      config=config)
