"""``TrainConfig``: optimisation, schedule, data and checkpointing of a run."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from plyx.specs.config._base import ConfigBase
from plyx.specs.config.dist import DistConfig
from plyx.specs.config.model import ModelConfig
from plyx.specs.errors import ConfigError

__all__ = ["TrainConfig", "CardConfig", "DataConfig", "DraftConfig", "OptimizerConfig", "ScheduleConfig"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class DataConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where tokens come from and how they are cut into sequences."""

    path: str = ""
    """Directory of prepared shards (``plyx data prepare``); empty means the bundled Tiny Shakespeare."""
    seq_len: Pos = 256
    """Tokens per training sequence."""
    mode: Literal["windows", "packed"] = "windows"
    """windows: random contiguous windows | packed: whole documents packed with document ids."""
    val_fraction: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.1
    """Fraction of the corpus held out for validation."""
    tokenizer: str = ""
    """Path to a tokenizer.json; empty means train a byte-level BPE on the corpus."""
    vocab_size: Pos = 4096
    """Vocabulary size when a tokenizer is trained."""


class OptimizerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    name: str = "adamw"
    """Optimizer plugin name (``plyx plugins`` lists them)."""
    lr: PosFloat = 3e-4
    """Peak learning rate."""
    weight_decay: NonNegFloat = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: PosFloat = 1e-8
    """Adam epsilon."""
    grad_clip: NonNegFloat = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""


class ScheduleConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    kind: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Decay after warmup: cosine | linear | wsd (warmup-stable-decay) | constant."""
    warmup_steps: NonNeg = 100
    """Linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.2
    """(wsd) fraction of the run spent decaying at the end."""


class CardConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The model card of the checkpoints a run writes (``ModelCard`` fields); an empty field is derived
    from the run. ``plyx train --name/--license/--description`` override these."""

    name: str = ""
    """The model's name (``plyx serve``'s model id); empty: the run directory's name."""
    license: str = ""
    """SPDX licence id of the weights (``Apache-2.0``, ``MIT``...); empty: ``NOASSERTION``."""
    description: str = ""
    """One paragraph for people; empty: architecture, size, data, steps and final losses."""
class DraftConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Draft heads trained on a frozen base for speculative decoding (``plyx train`` with a ``[draft]`` table):
    the base's weights never change; only the heads train, on ``data``, with ``optimizer`` and ``schedule``."""

    kind: Literal["medusa", "eagle"] = "medusa"
    """medusa: K heads on the last hidden state, head k predicting token t+k+1 (Cai et al. 2024) |
    eagle: a one-layer draft over [embedding of token t+1; feature t] predicting feature t+1 (Li et al. 2024)."""
    base: str = ""
    """The frozen base's checkpoint (plyx or Hugging Face directory); required. Its config replaces ``model``."""
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=32)] = 4
    """medusa: heads K (the most draft tokens per round) | eagle: default draft length when serving."""
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=8)] = 1
    """(medusa) residual blocks per head."""
    decay: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.8
    """(medusa) loss weight of head k is decay ** k (the paper's lambda_k = 0.8 ** k)."""
    targets: Literal["data", "base"] = "data"
    """(medusa) data: each head learns the corpus' token t+k+1 (Medusa-1) | base: self-distillation, each head
    learns the base's own distribution at that position (the paper's section 2.3.2; higher acceptance)."""
    cls_weight: NonNegFloat = 0.1
    """(eagle) weight of the token cross-entropy next to the feature regression (the paper's 0.1)."""
    feature_noise: NonNegFloat = 0.0
    """(eagle) uniform noise U(-a, a) added to the input features while training (the paper uses 0.2
    on 0.1-scale features for robustness to its own errors); 0: off."""


class TrainConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Everything a training run needs; ``plyx train`` runs on these defaults."""

    SCHEMA = "train"
    VERSION = 1

    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    """The model to train."""
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    """The corpus and how it is batched."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    """Optimizer and its hyper-parameters."""
    schedule: ScheduleConfig = msgspec.field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    seed: NonNeg = 1337
    """Seeds python, numpy and torch."""
    steps: Pos = 1000
    """Optimizer steps."""
    batch_size: Pos = 16
    """Sequences per micro-batch."""
    grad_accum: Pos = 1
    """Micro-batches per optimizer step."""
    precision: Literal["float32", "bf16-autocast"] = "float32"
    """float32 | bf16-autocast."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer in the backward pass."""
    compile: bool = False
    """Wrap the model in torch.compile."""
    attention: Literal["auto", "sdpa", "triton"] = "auto"
    """The training step's attention: auto (torch SDPA for unpacked batches on sm90+ GPUs and on CPU, the
    kernel registry's choice elsewhere) | sdpa (torch SDPA for unpacked batches; packed documents keep the
    Triton flash kernel on CUDA) | triton (plyx's Triton flash kernel for every call; CUDA, bf16)."""
    compiled_norms: Literal["auto", "kernel", "inductor"] = "auto"
    """RMSNorm under ``compile = true``: auto (= inductor) | inductor (plain torch ops that Inductor fuses with
    the residual adds) | kernel (the registry's RMSNorm kernel as an opaque custom op)."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    out_dir: str = "runs/default"
    """Where checkpoints, metrics.csv and TensorBoard logs go."""
    log_every: Pos = 10
    """Steps between metric lines."""
    eval_every: NonNeg = 200
    """Steps between evaluations (0 disables)."""
    eval_steps: Pos = 20
    """Validation batches per evaluation."""
    checkpoint_every: NonNeg = 500
    """Steps between checkpoints (0: only at the end and on interrupt)."""
    sample_tokens: NonNeg = 200
    """Tokens generated for the sample printed at evaluation and at the end."""
    neftune_alpha: PosFloat | None = None
    """NEFTune: uniform noise of scale alpha / sqrt(seq_len * d_model) on the input embeddings while
    training (Jain et al. 2023; 5 to 15 is usual); None: off."""
    card: CardConfig = msgspec.field(default_factory=CardConfig)
    """The model card's name, licence and description (empty fields are derived from the run)."""
    dist: DistConfig = msgspec.field(default_factory=DistConfig)
    """How a distributed run (``plyx train --nproc N``, ``torchrun``) is parallelised; batch_size
    stays per data-parallel rank, so the global batch is batch_size x grad_accum x data ranks."""
    draft: DraftConfig | None = None
    """Train draft heads (Medusa / EAGLE) on the frozen ``draft.base`` instead of ``model``; None: an
    ordinary run."""

    def check(self) -> None:
        if self.draft is not None and not self.draft.base:
            raise ConfigError("draft.base", "draft heads train on a frozen base checkpoint, and none is given",
                              value="", fix='set draft.base = "runs/NAME/checkpoints/latest" (a plyx or HF checkpoint)')
        if self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(
                "data.seq_len",
                f"sequences of {self.data.seq_len} tokens do not fit the model's max_seq_len "
                f"({self.model.max_seq_len})",
                value=self.data.seq_len,
                fix="lower data.seq_len or raise model.max_seq_len",
            )
        if self.compiled_norms != "auto" and not self.compile:
            raise ConfigError("compiled_norms", "chooses RMSNorm's implementation under torch.compile, and compile "
                              "is off", value=self.compiled_norms,
                              fix="set compile = true, or leave compiled_norms = \"auto\"")
        if self.attention == "triton" and (self.device == "cpu" or self.precision == "float32"):
            raise ConfigError("attention", "the Triton flash kernel runs on CUDA in bf16 only, and this run is "
                              + ("on the CPU" if self.device == "cpu" else "float32"), value=self.attention,
                              fix='use attention = "auto" (or "sdpa"), or train on CUDA with precision = "bf16-autocast"')
        if self.schedule.warmup_steps >= self.steps and self.steps > 1:
            raise ConfigError(
                "schedule.warmup_steps",
                f"warmup ({self.schedule.warmup_steps} steps) is not shorter than the run ({self.steps} steps)",
                value=self.schedule.warmup_steps,
                fix="lower schedule.warmup_steps or raise steps",
            )
