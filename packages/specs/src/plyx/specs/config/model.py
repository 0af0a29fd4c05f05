"""``ModelConfig``: the shape of a decoder-only transformer (Llama, Qwen2/3, Mistral; Mixtral, Qwen-MoE, OLMoE)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from plyx.specs.config._base import ConfigBase, migration
from plyx.specs.errors import ConfigError

__all__ = ["MoEConfig", "ModelConfig", "RopeScaling"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


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


class MoEConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """A sparse mixture-of-experts MLP: a linear router, top-k softmax gating, dropless routing.

    Each token's router logits ``x @ W_r.T`` (E of them) go through a softmax; the token runs
    through its ``top_k`` most probable experts (SwiGLU MLPs of width ``d_expert``) and their
    outputs are summed, weighted by those probabilities (renormalised to sum 1 or not). Every
    token reaches all its experts: no capacity factor, nothing dropped.
    """

    num_experts: Pos = 8
    """Routed experts per layer (E; HF ``num_local_experts`` / ``num_experts``)."""
    top_k: Pos = 2
    """Experts each token runs through (HF ``num_experts_per_tok``); at most ``num_experts``."""
    d_expert: Pos | None = None
    """Hidden width of each expert's SwiGLU (HF ``moe_intermediate_size``); None means ``d_ff``."""
    norm_topk_prob: bool = True
    """True: the top-k probabilities are renormalised to sum 1 (Mixtral; Qwen3-MoE checkpoints); False: the
    raw softmax probabilities weight the experts (OLMoE, Qwen2-MoE)."""
    shared_expert_d_ff: Pos | None = None
    """Width of an always-on shared expert whose output is scaled by ``sigmoid(x @ w_g)`` (Qwen2-MoE); None: none."""
    aux_loss_coef: NonNegFloat = 0.01
    """Weight of the load-balancing loss ``E * sum_e f_e * P_e`` (Switch Transformer eq. 4, top-k counts as
    Mixtral's), averaged over layers and added to the training loss; 0 turns it off."""
    z_loss_coef: NonNegFloat = 0.0
    """Weight of the router z-loss ``mean_t logsumexp(router_logits_t)^2`` (ST-MoE eq. 5); 0 turns it off."""


class ModelConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Hyper-parameters of a ``TransformerLM``.

    Version 2 renamed v1's ``n_embd``/``n_layer``/``n_head`` to
    ``d_model``/``n_layers``/``n_heads`` and added grouped-query attention
    (``n_kv_heads``); v1 documents are migrated on load.
    """

    SCHEMA = "model"
    VERSION = 2

    arch: Literal["llama", "qwen2", "qwen3", "mistral"] = "llama"
    """Decoder family: llama | qwen2 (q/k/v biases) | qwen3 (QK-norm) | mistral (sliding window). With ``moe``
    they are Hugging Face's Mixtral (mistral), Qwen2-MoE (qwen2), Qwen3-MoE (qwen3) and OLMoE (llama with
    ``qk_norm_scope="projection"``)."""
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
    moe: MoEConfig | None = None
    """Mixture-of-experts MLPs in every layer; None: dense SwiGLU MLPs."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """With ``qk_norm``: ``head`` normalises each head's Dh values (Qwen3); ``projection`` normalises the whole
    q projection ``[H*Dh]`` and the whole k projection ``[KV*Dh]`` before they are split into heads (OLMoE)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def d_expert(self) -> int:
        """Hidden width of each expert (``moe.d_expert``, else ``d_ff``); ``d_ff`` for a dense model."""
        return (self.moe.d_expert if self.moe is not None else None) or self.d_ff

    def check(self) -> None:
        self._check_moe()
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


    def _check_moe(self) -> None:
        moe = self.moe
        if moe is None:
            return
        if moe.top_k > moe.num_experts:
            raise ConfigError("moe.top_k", f"`top_k` ({moe.top_k}) exceeds `num_experts` ({moe.num_experts})",
                              value=moe.top_k, fix=f"route to at most {moe.num_experts} experts per token")


@migration("model", 1)
def _model_v1_to_v2(doc: dict[str, Any]) -> dict[str, Any]:
    """v1 used nanoGPT names and had no grouped-query attention."""
    renames = {"n_embd": "d_model", "n_layer": "n_layers", "n_head": "n_heads", "block_size": "max_seq_len"}
    out = {renames.get(k, k): v for k, v in doc.items()}
    if "ffn_mult" in out:  # v1 gave the MLP width as a multiple of the model width
        out["d_ff"] = int(out.pop("ffn_mult") * out.get("d_model", 512))
    return out
