"""plyx-train: data pipeline, Trainer with exact resume, metrics and the ``plyx train`` command.

Data: ``train_bpe``/``load_tokenizer`` -> ``prepare_corpus`` (shards + manifest) -> ``ShardSet`` ->
``TokenDataset`` (``plyx.specs.Batch`` objects). Training: ``Trainer(config).fit()``.
"""

from typing import Any

__all__ = [
    "IGNORE_INDEX",
    "CheckpointManager",
    "DataStream",
    "MetricsWriter",
    "NonFiniteLossError",
    "PrepareReport",
    "ResumeError",
    "ShardError",
    "ShardSet",
    "TokenDataset",
    "Tokenizer",
    "TrainOptions",
    "TrainResult",
    "Trainer",
    "available_optimizers",
    "build_optimizer",
    "build_scheduler",
    "bundled_corpus",
    "default_config",
    "estimate_memory",
    "MemoryEstimate",
    "plan_memory",
    "propose_fit",
    "generate_ids",
    "init_model",
    "lce_operands",
    "lm_loss",
    "load_tokenizer",
    "lr_multiplier",
    "param_groups",
    "prepare_bundled",
    "prepare_corpus",
    "set_overrides",
    "read_documents",
    "spectral_ratios",
    "train_bpe",
    "write_shards",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.train`` (and so its plugin entry point, ``plyx.train._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.train._exports``.
    """
    if name in __all__:
        from plyx.train import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
