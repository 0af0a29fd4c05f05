"""The embedded defaults of ``plyx train``: a small Llama-style model on the bundled Tiny Shakespeare.

Sized to train in a few minutes on a laptop CPU and still write recognisable
Shakespeare-shaped text; ``plyx train --print-config`` prints them as a
starting point for a config file.
"""

from __future__ import annotations

from plyx.specs import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig, TrainConfig

__all__ = ["default_config"]


def default_config() -> TrainConfig:
    """The ``TrainConfig`` that ``plyx train`` runs when given no CONFIG file."""
    return TrainConfig(
        model=ModelConfig(
            arch="llama",
            vocab_size=1024,  # = the BPE vocabulary trained on the corpus
            d_model=128,
            n_layers=4,
            n_heads=4,
            d_ff=384,
            max_seq_len=128,
            tie_embeddings=True,  # at this size the embedding is a large share of the weights
        ),
        data=DataConfig(path="", seq_len=128, mode="windows", val_fraction=0.1, vocab_size=1024),
        optimizer=OptimizerConfig(name="adamw", lr=2e-3, weight_decay=0.1, betas=(0.9, 0.99), grad_clip=1.0),
        schedule=ScheduleConfig(kind="cosine", warmup_steps=50, min_lr_ratio=0.1),
        seed=1337,
        steps=1000,
        batch_size=8,
        grad_accum=1,
        device="auto",
        out_dir="runs/shakespeare",
        log_every=10,
        eval_every=250,
        eval_steps=20,
        checkpoint_every=250,
        sample_tokens=200,
    )
