"""Run configurations of ``plyx rl``: ``SFTConfig`` and ``PreferenceConfig`` (strict, versioned, TOML/JSON/YAML).

Both are ``plyx.specs.ConfigBase`` schemas: unknown keys are rejected with the field's path, and
``load_config(SFTConfig, "sft.toml")`` reads any of the three formats.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from plyx.specs import ConfigBase, OptimizerConfig, ScheduleConfig

__all__ = ["AdapterSettings", "PreferenceConfig", "RunConfig", "SFTConfig", "default_beta"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class AdapterSettings(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Train a LoRA-family adapter (``plyx.model.adapters``) instead of every weight."""

    r: Pos = 8
    """Adapter rank."""
    alpha: float = 16.0
    """Scale numerator: the update is ``alpha / r * B A`` (``alpha / sqrt(r)`` for rslora)."""
    dropout: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.0
    """Dropout on the adapter's input."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names (last path component) or ``re:<pattern>``, as PEFT matches them."""
    variant: Literal["lora", "rslora", "dora"] = "lora"
    """lora | rslora (rank-stabilised scale) | dora (magnitude/direction)."""
    lora_plus_ratio: float | None = None
    """LoRA+: learning rate of B = ratio x that of A (None: one learning rate)."""
    merge: bool = True
    """Also write ``model/``: the base with the adapter merged in (a plain checkpoint serve loads)."""


class RunConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Fields shared by every ``plyx rl`` run."""

    model: str = ""
    """The starting checkpoint: a plyx or Hugging Face model directory (``tokenizer.json`` inside or beside)."""
    tokenizer: str = ""
    """tokenizer.json (or its directory); empty: the model directory's."""
    chat_template: str = ""
    """A .jinja file or Jinja source; empty: the tokenizer directory's (chat_template.jinja, tokenizer_config.json)."""
    data: str = ""
    """The training JSONL file."""
    max_length: Pos = 512
    """The longest example in tokens (prompt + completion)."""
    truncation: Literal["skip", "truncate", "error"] = "skip"
    """Examples longer than max_length: skip (counted) | truncate (keep the prompt's end) | error."""
    strict: bool = False
    """Raise on the first record that would be skipped (no assistant turn, chosen == rejected, too long)."""
    adapter: AdapterSettings | None = None
    """Train an adapter instead of the full model (None: full fine-tune)."""
    optimizer: OptimizerConfig = msgspec.field(default_factory=lambda: OptimizerConfig(lr=1e-4, weight_decay=0.0))
    """Optimizer (a ``plyx_optimizers`` plugin) and its hyper-parameters."""
    schedule: ScheduleConfig = msgspec.field(default_factory=lambda: ScheduleConfig(kind="linear", warmup_steps=10,
                                                                                   min_lr_ratio=0.0))
    """Learning-rate schedule."""
    steps: Pos = 100
    """Optimizer steps (examples are visited in a seeded order, epoch after epoch)."""
    batch_size: Pos = 8
    """Examples (pairs for DPO) per micro-batch."""
    grad_accum: Pos = 1
    """Micro-batches per optimizer step."""
    seed: NonNeg = 0
    """Seeds torch and the example order."""
    precision: Literal["float32", "bf16-autocast"] = "float32"
    """float32 | bf16-autocast."""
    device: str = "auto"
    """auto | cpu | cuda | cuda:N."""
    out_dir: str = "runs/rl"
    """Where model/, adapter/, metrics.jsonl and data_report.json go."""
    log_every: Pos = 10
    """Steps between metric lines."""


class SFTConfig(RunConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``plyx rl sft``: supervised fine-tuning on conversations, prompt/completion pairs or text."""

    SCHEMA = "rl.sft"
    VERSION = 1

    packing: bool = False
    """Pack several examples per row (attention stops at each document boundary)."""
    assistant_only_loss: bool = True
    """Conversations: loss on the assistant's tokens only (False: on every token)."""
    neftune_alpha: NonNegFloat = 0.0
    """NEFTune noise on the embeddings during training (0: off; the paper uses 5-15)."""


class PreferenceConfig(RunConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``plyx rl dpo|orpo|simpo|kto``: preference optimisation."""

    SCHEMA = "rl.preference"
    VERSION = 1

    method: Literal["dpo", "orpo", "simpo", "kto"] = "dpo"
    """dpo | orpo | simpo | kto."""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = "sigmoid"
    """(dpo) sigmoid (DPO) | ipo | hinge (SLiC) | robust (label-flip-robust, with label_smoothing)."""
    beta: NonNegFloat = 0.0
    """KL strength / reward scale; 0 means the method's default (dpo, orpo, kto 0.1; simpo 2.0)."""
    label_smoothing: Annotated[float, msgspec.Meta(ge=0, lt=0.5)] = 0.0
    """(dpo robust, simpo) assumed rate of flipped preference labels."""
    reference_free: bool = False
    """(dpo) score against a uniform reference instead of the starting model."""
    rpo_alpha: NonNegFloat = 0.0
    """(dpo) add this x the chosen completions' mean NLL (RPO; keeps chosen answers likely); 0: off."""
    simpo_gamma: NonNegFloat = 0.5
    """(simpo) target reward margin gamma."""
    desirable_weight: NonNegFloat = 1.0
    """(kto) weight of desirable examples (lambda_D)."""
    undesirable_weight: NonNegFloat = 1.0
    """(kto) weight of undesirable examples (lambda_U)."""


def default_beta(config: PreferenceConfig) -> float:
    """``config.beta``, or the method's usual value when it is 0."""
    if config.beta > 0:
        return config.beta
    return {"simpo": 2.0}.get(config.method, 0.1)
