"""``ModelConfig``: the shape of a decoder-only transformer (Llama, Qwen2/3, Mistral)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from plyx.specs.config._base import ConfigBase, migration
from plyx.specs.errors import ConfigError

__all__ = ["ModelConfig", "RopeScaling"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]


class RopeScaling(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling``."""

    kind: Literal["llama3", "linear"] = "llama3"
    """``llama3``: Llama 3.1's wavelength-dependent scaling; ``linear``: positions divided by factor."""
    factor: PosFloat = 8.0
    """How many times the original context is stretched."""
    low_freq_factor: PosFloat = 1.0
    """(llama3) wavelengths longer than original/low_freq_factor are scaled fully."""
    high_freq_factor: PosFloat = 4.0
    """(llama3) wavelengths shorter than original/high_freq_factor are kept."""
    original_max_seq_len: Pos = 8192
    """(llama3) context length the model was pre-trained on."""


class ModelConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Hyper-parameters of a ``TransformerLM``.

    Version 2 renamed v1's ``n_embd``/``n_layer``/``n_head`` to
    ``d_model``/``n_layers``/``n_heads`` and added grouped-query attention
    (``n_kv_heads``); v1 documents are migrated on load.
    """

    SCHEMA = "model"
    VERSION = 2

    arch: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    """Decoder family: llama | qwen2 (q/k/v biases) | qwen3 (QK-norm) | mistral (sliding window)."""
    vocab_size: Pos = 32000
    """Number of token ids."""
    d_model: Pos = 512
    """Width of the residual stream (HF ``hidden_size``)."""
    n_layers: Pos = 8
    """Number of decoder layers."""
    n_heads: Pos = 8
    """Query heads."""
    n_kv_heads: Pos | None = None
    """Key/value heads (GQA); None means n_heads (MHA); 1 is MQA."""
    head_dim: Pos | None = None
    """Per-head width; None means d_model // n_heads (Qwen3 sets it explicitly)."""
    d_ff: Pos = 1376
    """Width of the SwiGLU hidden layer (HF ``intermediate_size``)."""
    max_seq_len: Pos = 2048
    """Longest sequence the RoPE tables and caches are built for."""
    rope_theta: PosFloat = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Optional RoPE scaling (Llama 3.1 uses kind=llama3)."""
    partial_rotary: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Fraction of each head's dims that RoPE rotates."""
    norm_eps: PosFloat = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each head's q and k before RoPE (Qwen3)."""
    sliding_window: Pos | None = None
    """Attend to at most this many previous tokens (Mistral); None is full causal."""
    init_std: PosFloat = 0.02
    """Standard deviation of the normal weight initialisation."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def check(self) -> None:
        if self.head_dim is None and self.d_model % self.n_heads:
            divisors = [h for h in range(1, self.d_model + 1) if self.d_model % h == 0][:8]
            raise ConfigError(
                "n_heads",
                f"`n_heads` ({self.n_heads}) must divide `d_model` ({self.d_model})",
                value=self.n_heads,
                fix=f"choose n_heads from {', '.join(map(str, divisors))}, ... or set `head_dim` explicitly",
            )
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                "n_kv_heads",
                f"`n_kv_heads` ({self.kv_heads}) must divide `n_heads` ({self.n_heads})",
                value=self.n_kv_heads,
                fix="use a divisor of n_heads (1 for MQA, n_heads for MHA)",
            )
        if self.dim_per_head % 2:
            raise ConfigError(
                "head_dim",
                f"the head dimension ({self.dim_per_head}) must be even for RoPE",
                value=self.dim_per_head,
                fix="pick d_model and n_heads so that d_model // n_heads is even",
            )


@migration("model", 1)
def _model_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """v1 used nanoGPT names and had no grouped-query attention."""
    renames = {"n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads", "block_size": "max_seq_len"}
    out = {renames.get(k, k): v for k, v in doc.items()}
    if "ffn_mult" in out:  # v1 gave the MLP width as a multiple of the model width
        out["d_ff"] = int(out.pop("ffn_mult") * out.get("d_model", 512))
    return out
