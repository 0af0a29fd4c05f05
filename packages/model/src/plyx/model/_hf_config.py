"""Hugging Face ``config.json`` <-> ``ModelConfig`` (the MoE families: ``plyx.model._hf_moe``), and tensor names between the two layouts.

plyx's parameter names are Hugging Face's without the ``model.`` prefix
(``layers.3.self_attn.q_proj.weight`` vs ``model.layers.3.self_attn.q_proj.weight``);
``lm_head.weight`` is the same in both. Both transformers 4 (``rope_theta`` +
``rope_scaling``) and 5 (``rope_parameters``) config styles are read.
"""

from __future__ import annotations

from typing import Any

from plyx.model._errors import CheckpointError, UnsupportedArchitectureError
from plyx.model._hf_moe import MOE_ARCHITECTURES, moe_config_from_hf, moe_config_to_hf
from plyx.specs.config.model import ModelConfig, RopeScaling

__all__ = ["ARCHITECTURES", "config_from_hf", "config_to_hf", "hf_name", "plyx_name"]

#: model_type -> the transformers class that loads it
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    **{model_type: cls for model_type, (_, cls) in MOE_ARCHITECTURES.items()},
}

# tensors some HF checkpoints carry that plyx recomputes
IGNORED_HF_TENSORS = ("rotary_emb.inv_freq",)


def hf_name(name: str) -> str:
    """plyx tensor name -> Hugging Face name."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def plyx_name(name: str) -> str:
    """Hugging Face tensor name -> plyx name."""
    return name.removeprefix("model.")


def _unsupported(field: str, value: Any, fix: str) -> CheckpointError:
    return CheckpointError(f"config.json: `{field}` = {value!r} is not supported by plyx; {fix}")


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Translate a Hugging Face config dict into a ``ModelConfig``.

    Raises:
        UnsupportedArchitectureError: ``model_type`` is not one of ``ARCHITECTURES``
            (the message lists them).
        CheckpointError: a feature plyx does not implement (MLP biases, o_proj bias,
            per-layer sliding windows, an unknown rope type).
    """
    arch = hf.get("model_type")
    if arch in MOE_ARCHITECTURES:
        return moe_config_from_hf(hf, source=source, dense=config_from_hf)
    if arch not in ARCHITECTURES:
        archs = hf.get("architectures") or []
        raise UnsupportedArchitectureError(
            f"{source}: architecture {arch!r} ({', '.join(archs) or 'no architectures listed'}) is not supported; "
            f"plyx loads model_type {', '.join(repr(a) for a in ARCHITECTURES)} "
            f"({', '.join(ARCHITECTURES.values())})"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise _unsupported("hidden_act", hf["hidden_act"], "plyx's MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        raise _unsupported("mlp_bias", True, "plyx's MLP has no biases")
    if hf.get("attention_bias") and arch != "qwen2":
        raise _unsupported("attention_bias", True, "plyx has q/k/v biases only (Qwen2 style), no o_proj bias")
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling_src = rope if rope.get("rope_type", "default") != "default" else (hf.get("rope_scaling") or {})
    kind = scaling_src.get("rope_type", scaling_src.get("type", "default")) if scaling_src else "default"
    scaling = None
    if kind == "llama3":
        scaling = RopeScaling(
            kind="llama3",
            factor=float(scaling_src["factor"]),
            low_freq_factor=float(scaling_src.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling_src.get("high_freq_factor", 4.0)),
            original_max_seq_len=int(scaling_src.get("original_max_position_embeddings", 8192)),
        )
    elif kind == "linear":
        scaling = RopeScaling(kind="linear", factor=float(scaling_src["factor"]))
    elif kind != "default":
        raise _unsupported("rope type", kind, "plyx implements default, linear and llama3 RoPE")
    window = None
    if arch == "mistral":
        window = hf.get("sliding_window")
    elif hf.get("use_sliding_window"):
        types = set(hf.get("layer_types") or ["sliding_attention"])
        if types != {"sliding_attention"}:
            raise _unsupported("layer_types", sorted(types), "plyx applies one sliding window to every layer")
        window = hf.get("sliding_window")
    n_heads = int(hf["num_attention_heads"])
    d_model = int(hf["hidden_size"])
    head_dim = hf.get("head_dim")
    dtype = str(hf.get("dtype") or hf.get("torch_dtype") or "float32").removeprefix("torch.")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return ModelConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim) if head_dim and (arch == "qwen3" or int(head_dim) * n_heads != d_model) else None,
        d_ff=int(hf["intermediate_size"]),
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        partial_rotary=float(partial),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",  # Qwen2 always has q/k/v biases; others have none (checked above)
        qk_norm=arch == "qwen3",
        sliding_window=int(window) if window else None,
        init_std=float(hf.get("initializer_range", 0.02)),
        dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
    )


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers.AutoConfig`` reads back into the same architecture."""
    c = config
    if c.moe is not None or c.qk_norm_scope != "head":
        return moe_config_to_hf(c, dense=config_to_hf)
    if c.arch == "qwen2" and not c.qkv_bias:
        raise CheckpointError("a qwen2 model without q/k/v biases cannot be saved as Qwen2; use arch='llama'")
    if c.arch != "qwen2" and c.qkv_bias:
        raise CheckpointError(f"{c.arch} has no q/k/v-only biases in transformers; use arch='qwen2' for qkv_bias")
    if c.qk_norm != (c.arch == "qwen3"):
        raise CheckpointError("QK-norm exists exactly in qwen3 checkpoints; set arch='qwen3' iff qk_norm")
    rope: dict[str, Any] = {"rope_theta": c.rope_theta, "rope_type": "default"}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope.update({"rope_type": s.kind, "factor": s.factor})
        if s.kind == "llama3":
            rope.update({"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                         "original_max_position_embeddings": s.original_max_seq_len})
    if c.partial_rotary != 1.0:
        rope["partial_rotary_factor"] = c.partial_rotary
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[c.arch]],
        "model_type": c.arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.d_model,
        "intermediate_size": c.d_ff,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "rms_norm_eps": c.norm_eps,
        "initializer_range": c.init_std,
        "tie_word_embeddings": c.tie_embeddings,
        "rope_theta": c.rope_theta,
        "rope_parameters": rope,
        "dtype": c.dtype,
        "torch_dtype": c.dtype,
        "use_cache": True,
    }
    if c.rope_scaling is not None:
        out["rope_scaling"] = dict(rope)
    if c.partial_rotary != 1.0:
        out["partial_rotary_factor"] = c.partial_rotary
    if c.arch in ("llama", "qwen3"):
        out["attention_bias"] = False
    if c.arch == "llama":
        out["mlp_bias"] = False
    if c.arch == "mistral":
        out["sliding_window"] = c.sliding_window
    elif c.arch in ("qwen2", "qwen3"):
        out["use_sliding_window"] = c.sliding_window is not None
        out["sliding_window"] = c.sliding_window
        out["max_window_layers"] = c.n_layers if c.sliding_window is None else 0
        kind = "sliding_attention" if c.sliding_window is not None else "full_attention"
        out["layer_types"] = [kind] * c.n_layers
    elif c.sliding_window is not None:
        raise CheckpointError(f"{c.arch} has no sliding window in transformers; use arch='mistral' for sliding_window")
    return out
