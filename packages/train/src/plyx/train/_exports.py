"""The public names of ``plyx.train``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.train.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.train._checkpoint import CheckpointManager, ResumeError
from plyx.train._cli import set_overrides
from plyx.train._dataset import IGNORE_INDEX, DataStream, TokenDataset
from plyx.train._defaults import default_config
from plyx.train._distributed import init_model
from plyx.train._generate import generate_ids
from plyx.train._loss import lce_operands, lm_loss
from plyx.train._memory import MemoryEstimate, plan_memory, propose_fit
from plyx.train._metrics import MetricsWriter, spectral_ratios
from plyx.train._optim import available_optimizers, build_optimizer, param_groups
from plyx.train._prepare import PrepareReport, bundled_corpus, prepare_bundled, prepare_corpus, read_documents
from plyx.train._schedule import build_scheduler, lr_multiplier
from plyx.train._shards import ShardError, ShardSet, write_shards
from plyx.train._tokenizer import Tokenizer, load_tokenizer, train_bpe
from plyx.train._trainer import NonFiniteLossError, Trainer, TrainOptions, TrainResult, estimate_memory
