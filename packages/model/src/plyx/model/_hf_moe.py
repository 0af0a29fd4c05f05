"""Hugging Face interop of the MoE families: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

config.json: each is a dense family plus ``ModelConfig.moe``::

    mixtral    -> arch mistral, renormalised top-k (always)
    qwen2_moe  -> arch qwen2 (q/k/v biases), shared expert (sigmoid-gated), norm_topk_prob as configured
    qwen3_moe  -> arch qwen3 (per-head QK-norm), norm_topk_prob as configured
    olmoe      -> arch llama, qk_norm_scope="projection", norm_topk_prob as configured

Tensors: checkpoints store one tensor per expert and projection (what transformers 4 and 5 both
write); plyx holds them stacked, as transformers 5 does in memory::

    Mixtral  model.layers.{l}.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight   (gate / up / down)
             model.layers.{l}.block_sparse_moe.gate.weight
    others   model.layers.{l}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight
             model.layers.{l}.mlp.gate.weight
    plyx     layers.{l}.mlp.experts.gate_up_proj [E, 2F, D] = stack_e(cat(gate_e, up_e))
             layers.{l}.mlp.experts.down_proj [E, D, F] = stack_e(down_e),  layers.{l}.mlp.gate.weight

Loading folds the per-expert entries into stacked virtual tensors (``fold_experts``: a missing expert
tensor is named); saving splits them back (``unfold_experts``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from plyx.model._errors import CheckpointError
from plyx.specs.checkpoint import TensorEntry
from plyx.specs.config.model import ModelConfig, MoEConfig

__all__ = ["MOE_ARCHITECTURES", "Composite", "fold_experts", "moe_config_from_hf", "moe_config_to_hf",
           "moe_model_type", "unfold_experts"]

#: HF model_type -> (plyx arch, transformers class)
MOE_ARCHITECTURES = {
    "mixtral": ("mistral", "MixtralForCausalLM"),
    "qwen2_moe": ("qwen2", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("qwen3", "Qwen3MoeForCausalLM"),
    "olmoe": ("llama", "OlmoeForCausalLM"),
}
#: per-expert projection names on disk: (gate, up, down)
_PROJ = {"mixtral": ("w1", "w3", "w2")}
_DEFAULT_PROJ = ("gate_proj", "up_proj", "down_proj")
_BLOCK = {"mixtral": "block_sparse_moe"}


def _err(source: str, field: str, value: Any, fix: str) -> CheckpointError:
    return CheckpointError(f"{source}: `{field}` = {value!r} is not supported by plyx's MoE; {fix}")


def moe_config_from_hf(hf: dict[str, Any], *, source: str, dense: Any) -> ModelConfig:
    """The ``ModelConfig`` of an MoE ``config.json``; ``dense`` is ``config_from_hf`` (for the shared fields)."""
    model_type = hf["model_type"]
    arch = MOE_ARCHITECTURES[model_type][0]
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    top_k = hf.get("num_experts_per_tok")
    if not experts or not top_k:
        raise CheckpointError(f"{source}: {model_type} config lacks num_experts / num_experts_per_tok; "
                              f"restore them from the model's original config.json")
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if hf.get("mlp_only_layers"):
            raise _err(source, "mlp_only_layers", hf["mlp_only_layers"], "plyx puts experts in every layer "
                       "(supported: mlp_only_layers = [] and decoder_sparse_step = 1)")
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            raise _err(source, "decoder_sparse_step", hf["decoder_sparse_step"], "plyx puts experts in every layer "
                       "(supported: decoder_sparse_step = 1)")
    if hf.get("router_jitter_noise"):
        raise _err(source, "router_jitter_noise", hf["router_jitter_noise"], "plyx routes without jitter; set it to 0")
    if hf.get("clip_qkv") is not None:
        raise _err(source, "clip_qkv", hf["clip_qkv"], "OLMoE without q/k/v clipping (clip_qkv = null) is supported")
    if hf.get("routed_scaling_factor", 1.0) not in (1, 1.0, None):
        raise _err(source, "routed_scaling_factor", hf["routed_scaling_factor"], "supported routing: softmax top-k, "
                   "renormalised or not, weights unscaled")
    if hf.get("scoring_func", "softmax") != "softmax":
        raise _err(source, "scoring_func", hf["scoring_func"], "supported routing: softmax top-k (renormalised or not)")
    d_ff = int(hf["intermediate_size"])
    d_expert = int(hf.get("moe_intermediate_size") or d_ff)
    shared = hf.get("shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
    moe = MoEConfig(
        num_experts=int(experts),
        top_k=int(top_k),
        d_expert=d_expert,
        norm_topk_prob=True if model_type == "mixtral" else bool(hf.get("norm_topk_prob", False)),
        shared_expert_d_ff=int(shared) if shared else None,
        aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)),
    )
    base = {k: v for k, v in hf.items() if k not in ("attention_bias",)} if model_type == "olmoe" else dict(hf)
    base["model_type"] = arch
    config = dense(base, source=source)
    extra: dict[str, Any] = {"moe": moe, "d_ff": d_ff if model_type in ("qwen2_moe", "qwen3_moe") else d_expert}
    if model_type == "olmoe":
        if hf.get("attention_bias"):
            raise _err(source, "attention_bias", True, "OLMoE without attention biases is supported")
        extra.update(qk_norm=True, qk_norm_scope="projection")
    return config.replace(**extra)


def moe_model_type(config: ModelConfig) -> str:
    """The HF ``model_type`` a plyx MoE config saves as; ``CheckpointError`` where transformers has none."""
    c, moe = config, config.moe
    if moe is None:
        raise CheckpointError("QK-norm over whole projections (qk_norm_scope='projection') exists only in OLMoE, "
                              "a mixture of experts; set moe, or use qk_norm_scope='head'")
    if c.qk_norm and c.qk_norm_scope == "projection":
        if c.arch != "llama":
            raise CheckpointError("qk_norm_scope='projection' saves as OLMoE, whose attention is Llama's: use arch='llama'")
        kind = "olmoe"
    elif c.arch == "mistral":
        kind = "mixtral"
    elif c.arch == "qwen2":
        kind = "qwen2_moe"
    elif c.arch == "qwen3":
        kind = "qwen3_moe"
    else:
        raise CheckpointError("transformers has no Llama mixture of experts; use arch='mistral' (Mixtral), 'qwen2' "
                              "(Qwen2-MoE), 'qwen3' (Qwen3-MoE), or arch='llama' with qk_norm_scope='projection' (OLMoE)")
    if kind == "mixtral" and not moe.norm_topk_prob:
        raise CheckpointError("Mixtral always renormalises its top-k weights; set moe.norm_topk_prob=True, or save "
                              "as OLMoE / Qwen-MoE, which take norm_topk_prob")
    if (kind == "qwen2_moe") != (moe.shared_expert_d_ff is not None):
        raise CheckpointError("a shared expert exists exactly in Qwen2-MoE: use arch='qwen2' with "
                              "moe.shared_expert_d_ff set, or no shared expert for the other families")
    return kind


def moe_config_to_hf(config: ModelConfig, *, dense: Any) -> dict[str, Any]:
    """config.json of an MoE config; ``dense`` is ``config_to_hf`` (for the shared fields)."""
    c, kind = config, moe_model_type(config)
    moe = c.moe
    assert moe is not None
    out = dense(c.replace(moe=None, qk_norm=c.qk_norm and kind != "olmoe", qk_norm_scope="head"))
    out.update({"architectures": [MOE_ARCHITECTURES[kind][1]], "model_type": kind,
                "num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef,
                "output_router_logits": False})
    if kind == "mixtral":
        out.update(num_local_experts=moe.num_experts, intermediate_size=c.d_expert, router_jitter_noise=0.0)
    else:
        out.update(num_experts=moe.num_experts, norm_topk_prob=moe.norm_topk_prob)
    if kind in ("qwen2_moe", "qwen3_moe"):
        out.update(moe_intermediate_size=c.d_expert, intermediate_size=c.d_ff, decoder_sparse_step=1, mlp_only_layers=[])
    if kind == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_expert_d_ff, qkv_bias=True)
    if kind == "olmoe":
        out.update(intermediate_size=c.d_expert, clip_qkv=None, attention_bias=False)
    return out


class Composite:
    """A plyx tensor assembled from several checkpoint tensors: ``parts[e]`` are expert e's (shard, name) pairs,
    concatenated on dim 0, then the experts stacked on a new dim 0."""

    def __init__(self, parts: list[list[tuple[str, str]]]) -> None:
        self.parts = parts

    def shards(self) -> set[str]:
        return {shard for group in self.parts for shard, _ in group}

    def build(self, read: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``read``: checkpoint name -> tensor, holding every part."""
        return torch.stack([torch.cat([read[name] for _, name in group], 0) for group in self.parts])


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def fold_experts(config: ModelConfig, model_type: str, tensors: dict[str, TensorEntry], *, source: str
                 ) -> tuple[dict[str, TensorEntry], dict[str, Composite], dict[str, str]]:
    """Replace per-expert checkpoint entries by stacked virtual entries under HF in-memory names.

    Returns the new entries (HF-style names, ``model.layers.{l}.mlp.experts.gate_up_proj``), how to build
    each virtual tensor, and the renamed entries' names on disk (Mixtral's ``block_sparse_moe.gate``). Raises ``CheckpointError`` naming every missing expert tensor, or naming
    expert tensors beyond ``num_experts``.
    """
    moe = config.moe
    assert moe is not None
    gate, up, down = _PROJ.get(model_type, _DEFAULT_PROJ)
    block = _BLOCK.get(model_type, "mlp")
    out: dict[str, TensorEntry] = {}
    composites: dict[str, Composite] = {}
    renamed: dict[str, str] = {}
    for name, entry in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            new = name.replace(f".{block}.gate.", ".mlp.gate.") if block != "mlp" else name
            out[new] = entry
            if new != name:
                renamed[new] = name
        elif int(m.group(2)) >= moe.num_experts or m.group(3) not in (gate, up, down):
            raise CheckpointError(f"{source}: unexpected tensor {name!r}: the config has {moe.num_experts} experts "
                                  f"with projections {gate}/{up}/{down}; fix num_experts in config.json")
    missing: list[str] = []
    for layer in range(config.n_layers):
        if f"model.layers.{layer}.mlp.experts.gate_up_proj" in tensors:  # already stacked (a fused export)
            continue
        prefix = f"model.layers.{layer}.{block}.experts"
        names = {p: [f"{prefix}.{e}.{p}.weight" for e in range(moe.num_experts)] for p in (gate, up, down)}
        lost = [n for group in names.values() for n in group if n not in tensors]
        if lost:
            missing += lost
            continue
        first = tensors[names[gate][0]]
        f, d = first.shape
        composites[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = Composite(
            [[(tensors[g].shard, g), (tensors[u].shard, u)] for g, u in zip(names[gate], names[up])])
        composites[f"model.layers.{layer}.mlp.experts.down_proj"] = Composite(
            [[(tensors[n].shard, n)] for n in names[down]])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = TensorEntry(shard=first.shard,
                                                                            shape=[moe.num_experts, 2 * f, d], dtype=first.dtype)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = TensorEntry(shard=tensors[names[down][0]].shard,
                                                                         shape=[moe.num_experts, d, f], dtype=first.dtype)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise CheckpointError(f"{source}: missing expert tensors {shown}; the checkpoint is incomplete "
                              f"(re-download the shards listed in model.safetensors.index.json)")
    return out, composites, renamed


def unfold_experts(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named state (``model.layers.{l}.mlp.experts.gate_up_proj`` stacked) -> per-expert checkpoint tensors."""
    kind = moe_model_type(config)
    gate, up, down = _PROJ.get(kind, _DEFAULT_PROJ)
    block = _BLOCK.get(kind, "mlp")
    f = config.d_expert
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".mlp.experts.gate_up_proj") + f".{block}.experts"
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{gate}.weight"] = t[e, :f]
                out[f"{prefix}.{e}.{up}.weight"] = t[e, f:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".mlp.experts.down_proj") + f".{block}.experts"
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.{down}.weight"] = t[e]
        else:
            out[name.replace(".mlp.gate.", f".{block}.gate.") if block != "mlp" else name] = t
    return out
