"""``SparseMoE``: the mixture-of-experts MLP of Mixtral, Qwen2/3-MoE and OLMoE, and its router losses.

One layer, for x ``[B, T, D]`` flattened to N = B*T tokens::

    logits = x @ W_r.T                                  # (N, E) router (HF ``mlp.gate``)
    p = softmax(logits.float()); w, ids = topk(p, k)    # (N, k); w /= w.sum(-1) when norm_topk_prob
    _, positions, offsets = moe_permute(x, ids, copy=False)   # the dropless sort by expert: [N, k], [E + 1]
    a = grouped_gemm(x, gate_up_proj, offsets, gather=positions, activation="swiglu")
                                                        # (N*k, F): silu(gate) * up of x[t] @ W_e^T, rows
                                                        # grouped by expert; gate_up_proj [E, 2F, D]
    out = grouped_gemm(a, down_proj, offsets, combine=(positions, w))
                                                        # (N, D): sum_j w[t, j] * (a @ W_e^T)[positions[t, j]]
                                                        # (moe_unpermute's sum); down_proj [E, D, F]
    out += sigmoid(x @ w_g) * shared_expert(x)          # Qwen2-MoE only

Every step is a kernel resolved by name from the registry: on CUDA the Triton ones (the experts run as
two grouped GEMMs, never a Python loop, and nothing reads the routing back to the host, so a decode
step can be captured in a CUDA graph); elsewhere the references (a per-expert loop). The expert weights
are stacked on a leading expert dim, Hugging Face's in-memory layout (transformers 5), so expert
parallelism shards dim 0 of two tensors.

Router losses (training): each MoE layer keeps, from its last forward with grad enabled in training
mode, the load-balancing loss ``E * sum_e f_e P_e`` (Switch Transformer eq. 4; f_e is the fraction of
the N*k assignments made to expert e, times k, as Mixtral's ``load_balancing_loss_func``; P_e the mean
router probability) and the z-loss ``mean_t logsumexp(logits_t)^2`` (ST-MoE eq. 5).
``router_aux_loss(model)`` averages them over layers with the config's coefficients; the trainer adds
it to the language-modelling loss. ``router_metrics(model)`` reports the loads.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from plyx.model._model import MLP, _kernel
from plyx.specs.config.model import ModelConfig
from torch import nn

__all__ = ["ROUTER_METRICS", "Experts", "SparseMoE", "inactive_expert_params", "load_balancing_loss", "router_aux_loss",
           "router_metrics", "router_z_loss"]


#: the keys ``router_metrics`` reports (training metrics columns)
ROUTER_METRICS = ("moe/lb_loss", "moe/z_loss", "moe/imbalance", "moe/tokens_per_expert_min",
                  "moe/tokens_per_expert_max", "moe/unused_experts", "moe/dropped")


def load_balancing_loss(probs: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, *,
                        counts: torch.Tensor | None = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` for router probabilities ``probs [N, E]`` (float32) and top-k ids ``[N, k]``.

    ``f_e = (assignments to e) / N`` (sums to k, as Mixtral's), ``P_e = mean_t probs[t, e]``; the gradient
    flows through P only (f is a count). 1 per unit of k when perfectly balanced. ``counts [E]``: the
    assignments per expert when the caller has them already (one histogram per layer, not two).
    """
    n = probs.shape[0]
    if counts is None:
        counts = torch.zeros(num_experts, dtype=probs.dtype, device=probs.device).scatter_add_(
            0, expert_ids.reshape(-1), torch.ones(expert_ids.numel(), dtype=probs.dtype, device=probs.device))
    return num_experts * torch.sum(counts / max(n, 1) * probs.mean(0))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """``mean_t logsumexp(logits_t)^2`` (ST-MoE eq. 5): keeps router logits small, so the softmax stays stable."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class Experts(nn.Module):
    """E SwiGLU experts with stacked weights: ``gate_up_proj [E, 2F, D]`` (gate rows, then up rows) and
    ``down_proj [E, D, F]``, each expert's slice laid out as ``nn.Linear.weight`` (Hugging Face's names)."""

    def __init__(self, num_experts: int, d_model: int, d_expert: int, *, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.num_experts, self.d_expert = num_experts, d_expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * d_expert, d_model, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, d_expert, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [N, D]``, ``expert_ids``/``weights [N, k]`` -> ``[N, D]``: the weighted sum of each token's experts."""
        E = self.num_experts
        gate_up, down = self.gate_up_proj, self.down_proj
        if torch.is_autocast_enabled(x.device.type):  # the kernels are not autocast ops: cast as F.linear would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
        gemm = _kernel("grouped_gemm", x, gate_up)
        # the sort's indices only (copy=False), no permuted copy of x: the first GEMM reads the tokens through
        # them and applies the SwiGLU in its epilogue (grouped_gemm's fused options, plyx-kernel >= 1.6)
        _, positions, offsets = _kernel("moe_permute", x, hidden=x.shape[-1])(x, expert_ids, num_experts=E,
                                                                              copy=False)
        a = gemm(x, gate_up, offsets, gather=positions, activation="swiglu")  # (N*k, F)
        # the second GEMM combines its rows with the gate weights: out[t] = sum_j w[t, j] * ys[positions[t, j]],
        # and its backward reads dout through the routing (no stored ys, no rows' gradient in memory)
        return gemm(a, down, offsets, combine=(positions, weights.to(a.dtype)))  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, d_model={self.down_proj.shape[1]}, d_expert={self.d_expert}"


class SparseMoE(nn.Module):
    """The MoE MLP of one decoder layer (see the module docstring); a drop-in for ``MLP``.

    Parameters (Hugging Face's in-memory names): ``gate.weight [E, D]`` (the router),
    ``experts.gate_up_proj``, ``experts.down_proj``; with a shared expert (Qwen2-MoE)
    ``shared_expert.{gate,up,down}_proj.weight`` and ``shared_expert_gate.weight [1, D]``.
    """

    def __init__(self, config: ModelConfig, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError("SparseMoE needs ModelConfig.moe; build a dense MLP for configs without it")
        self.num_experts, self.top_k, self.norm_topk_prob = moe.num_experts, moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(config.d_model, moe.num_experts, bias=False, device=device, dtype=dtype)
        self.experts = Experts(moe.num_experts, config.d_model, config.d_expert, device=device, dtype=dtype)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if moe.shared_expert_d_ff is not None:
            self.shared_expert = MLP(config.d_model, moe.shared_expert_d_ff, device=device, dtype=dtype)
            self.shared_expert_gate = nn.Linear(config.d_model, 1, bias=False, device=device, dtype=dtype)
        #: (load-balancing loss, z-loss, tokens per expert) of the last training forward; see router_aux_loss
        self.router_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        #: detached copies of the last consumed state, for router_metrics
        self.last_counts: torch.Tensor | None = None
        self.last_losses: tuple[torch.Tensor, torch.Tensor] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [N, E], weights [N, k] in x's dtype, expert_ids [N, k])`` for tokens ``x [N, D]``."""
        logits = self.gate(x)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # float32 inside the one launch (no cast copy)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.training and torch.is_grad_enabled():
            counts = torch.zeros(self.num_experts, dtype=torch.float32, device=x.device).scatter_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), dtype=torch.float32, device=x.device))
            lb = load_balancing_loss(probs, ids, self.num_experts, counts=counts)
            self.router_state = (lb, router_z_loss(logits), counts)
        return logits, weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor, *, packed: bool = False) -> torch.Tensor:
        """``x [B, T, D]`` -> ``[B, T, D]``. ``packed``: the shared expert may use its stacked gate/up weight."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        _, weights, ids = self.route(flat)
        out = self.experts(flat, ids, weights)  # (N, D)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat, packed=packed)
        return out.view(shape)

    def pack_projections_(self) -> None:
        """The routed experts are already stacked; a shared expert stacks its gate and up weights."""
        if self.shared_expert is not None:
            self.shared_expert.pack_projections_()


def _moe_layers(model: nn.Module) -> Iterator[SparseMoE]:
    return (m for m in model.modules() if isinstance(m, SparseMoE))


def router_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """``aux_loss_coef * mean_l lb_l + z_loss_coef * mean_l z_l`` over the MoE layers' last training forward.

    None for a dense model, or when no layer recorded a forward (evaluation, ``no_grad``). Each layer's
    record is consumed, so a second call (or an evaluation step) never adds a stale loss.
    """
    config = getattr(model, "config", None)
    moe = getattr(config, "moe", None)
    if moe is None:
        return None
    states = []
    for layer in _moe_layers(model):
        if layer.router_state is not None:
            states.append(layer.router_state)
            layer.last_counts = layer.router_state[2].detach()  # kept for router_metrics
            layer.last_losses = (layer.router_state[0].detach(), layer.router_state[1].detach())
            layer.router_state = None
    if not states:
        return None
    lb = torch.stack([s[0] for s in states]).mean()
    z = torch.stack([s[1] for s in states]).mean()
    return moe.aux_loss_coef * lb + moe.z_loss_coef * z


def router_metrics(model: nn.Module) -> dict[str, float]:
    """Router statistics of the last training forward, averaged over MoE layers (empty for a dense model).

    ``moe/lb_loss`` and ``moe/z_loss`` (unweighted), ``moe/imbalance`` (the busiest expert's tokens over
    the mean: 1.0 is perfectly balanced), ``moe/tokens_per_expert_min`` and ``_max`` (assignments),
    ``moe/unused_experts`` (experts that got no token), ``moe/dropped`` (0: routing is dropless).
    Reads the device once (a sync; call it on logging steps).
    """
    layers = [m for m in _moe_layers(model) if m.last_counts is not None and m.last_losses is not None]
    if not layers:
        return {}
    counts = torch.stack([m.last_counts for m in layers])  # type: ignore[misc]  # (L, E)
    losses = torch.stack([torch.stack(m.last_losses) for m in layers])  # type: ignore[arg-type]  # (L, 2)
    mean = counts.mean(1).clamp_min(1e-9)
    stats = torch.stack([
        losses[:, 0].mean(), losses[:, 1].mean(), (counts.max(1).values / mean).mean(),
        counts.min(1).values.mean(), counts.max(1).values.mean(), (counts == 0).float().sum(1).mean(),
    ]).tolist()
    return {**{k: float(v) for k, v in zip(ROUTER_METRICS, stats)}, "moe/dropped": 0.0}


def inactive_expert_params(config: ModelConfig) -> int:
    """Expert weights a token does not use (E - k experts per layer): excluded from the FLOPs of a token."""
    moe = config.moe
    if moe is None:
        return 0
    per_expert = 3 * config.d_model * config.d_expert
    return config.n_layers * (moe.num_experts - moe.top_k) * per_expert
