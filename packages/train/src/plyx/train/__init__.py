"""plyx-train: data pipeline, Trainer with exact resume, metrics and the ``plyx train`` command.

Data: ``train_bpe``/``load_tokenizer`` -> ``prepare_corpus`` (shards + manifest) -> ``ShardSet`` ->
``TokenDataset`` (``plyx.specs.Batch`` objects). Training: ``Trainer(config).fit()``.
"""

from plyx.train._checkpoint import CheckpointManager, ResumeError
from plyx.train._dataset import IGNORE_INDEX, DataStream, TokenDataset
from plyx.train._defaults import default_config
from plyx.train._generate import generate_ids
from plyx.train._loss import lm_loss
from plyx.train._memory import MemoryEstimate, plan_memory, propose_fit
from plyx.train._metrics import MetricsWriter, spectral_ratios
from plyx.train._optim import available_optimizers, build_optimizer, param_groups
from plyx.train._prepare import PrepareReport, bundled_corpus, prepare_bundled, prepare_corpus, read_documents
from plyx.train._schedule import build_scheduler, lr_multiplier
from plyx.train._shards import ShardError, ShardSet, write_shards
from plyx.train._tokenizer import Tokenizer, load_tokenizer, train_bpe
from plyx.train._trainer import NonFiniteLossError, Trainer, TrainOptions, TrainResult, estimate_memory

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
    "lm_loss",
    "load_tokenizer",
    "lr_multiplier",
    "param_groups",
    "prepare_bundled",
    "prepare_corpus",
    "read_documents",
    "spectral_ratios",
    "train_bpe",
    "write_shards",
]
