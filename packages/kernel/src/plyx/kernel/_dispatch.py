"""One function per kernel name that selects from the default registry and calls: what model code uses.

Each has the kernel name's signature (documented in ``plyx.kernel``'s README);
selection is cached, so the per-call cost is a dictionary lookup plus the query.
"""

from __future__ import annotations

from typing import Any

import torch
from plyx.kernel._default import registry

__all__ = ["grouped_gemm", "moe_permute", "moe_unpermute", "matmul", "rmsnorm", "rmsnorm_linear", "swiglu", "swiglu_linear", "gemv", "rope", "rope_qk", "rope_store_kv", "cross_entropy", "linear_cross_entropy", "paged_attention"]


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``: a ``[..., M, K]``, b ``[K, N]``."""
    return registry().get("matmul", a, b)(a, b)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, residual: torch.Tensor | None = None) -> Any:
    """RMSNorm of ``x`` (or of ``x + residual``, returning ``(y, x + residual)``)."""
    return registry().get("rmsnorm", x, weight)(x, weight, eps=eps, residual=residual)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return registry().get("swiglu", gate, up)(gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x [B, T, H, Dh]``."""
    return registry().get("rope", x, cos, sin)(x, cos, sin, interleaved=interleaved)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(q), rope(k))`` of ``q [B, T, H, Dh]`` and ``k [B, T, KV, Dh]`` (one launch on CUDA)."""
    fn = registry().get("rope_qk", q, k, cos, sin, head_dim=int(q.shape[-1]))
    return fn(q, k, cos, sin, interleaved=interleaved)  # type: ignore[no-any-return]


def rope_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, *, n_heads: int, n_kv_heads: int,
                  interleaved: bool = False) -> torch.Tensor:
    """RoPE of q and k of ``qkv [B, T, H + 2*KV, Dh]``; k and v stored at ``k_cache/v_cache[slots]``; returns q.

    Inference only (no gradient); selected for qkv's device, dtype and head_dim.
    """
    fn = registry().get("rope_store_kv", qkv, cos, sin, head_dim=int(qkv.shape[-1]))
    return fn(qkv, cos, sin, k_cache, v_cache, slots, n_heads=n_heads, n_kv_heads=n_kv_heads, interleaved=interleaved)


def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual) @ weight.T + bias, x + residual)``, SwiGLU of the two halves with ``swiglu``.

    Inference only (no gradient); selected for x's device, dtype and row count (Triton: at most 2 rows).
    """
    rows = x.numel() // max(1, x.shape[-1])
    fn = registry().get("rmsnorm_linear", x, norm_weight, weight, rows=rows, hidden=int(x.shape[-1]))
    return fn(x, norm_weight, weight, eps=eps, residual=residual, bias=bias, swiglu=swiglu)  # type: ignore[no-any-return]


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T (+ bias)`` of a packed ``gate_up [..., 2F]``: a packed MLP's down projection.

    Inference only (no gradient); selected for gate_up's device, dtype and row count (Triton: at most 2 rows).
    """
    rows = gate_up.numel() // max(1, gate_up.shape[-1])
    fn = registry().get("swiglu_linear", gate_up, weight, rows=rows, hidden=int(weight.shape[-1]))
    return fn(gate_up, weight, bias=bias)  # type: ignore[no-any-return]


def gemv(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` of ``x [..., K]`` and ``weight [N, K]``: a projection at decode size.

    Inference only (no gradient); selected for x's device, dtype and row count (Triton: at most 2 rows).
    """
    rows = x.numel() // max(1, x.shape[-1])
    fn = registry().get("gemv", x, weight, rows=rows, hidden=int(weight.shape[-1]))
    return fn(x, weight, bias=bias)  # type: ignore[no-any-return]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, **options: Any) -> Any:
    """Cross-entropy of ``logits [N, V]``; options as the ``cross_entropy`` kernel (a custom op under compile)."""
    if torch.compiler.is_compiling():
        from plyx.kernel._custom_ops import traceable

        op = traceable("cross_entropy")  # None under torch.export
        if op is not None:
            return op(logits, targets, **options)
    return registry().get("cross_entropy", logits, targets)(logits, targets, **options)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, **options: Any) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` without materialising the logits.

    Under ``torch.compile`` it is the opaque custom op ``plyx::linear_cross_entropy`` (``traceable``).
    """
    if torch.compiler.is_compiling():
        from plyx.kernel._custom_ops import traceable

        op = traceable("linear_cross_entropy")  # None under torch.export
        if op is not None:
            return op(hidden, weight, targets, **options)  # type: ignore[no-any-return]
    return registry().get("linear_cross_entropy", hidden, weight, targets)(hidden, weight, targets, **options)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, **options: Any) -> torch.Tensor:
    """Attention of ``q [B, Tq, H, Dh]`` against a paged cache; options ``scale``, ``window``.

    ``attention`` itself is ``plyx.kernel.attention(q, k, v, **options)`` (the subpackage is callable).
    """
    fn = registry().get("paged_attention", q, k_pool, v_pool)
    return fn(q, k_pool, v_pool, block_tables, context_lens, **options)


def moe_permute(x: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int, copy: bool = True) -> Any:
    """``(xs [T*k, D], positions [T, k], offsets [E + 1])``: copies of x's rows grouped by expert (dropless);
    ``copy=False``: the sort alone, ``(None, positions, offsets)``."""
    kwargs = {} if copy else {"copy": False}
    return registry().get("moe_permute", x, hidden=int(x.shape[-1]))(x, expert_ids, num_experts=num_experts, **kwargs)


def moe_unpermute(ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * ys[positions[t, j]]``."""
    return registry().get("moe_unpermute", ys, hidden=int(ys.shape[-1]))(ys, positions, weights)  # type: ignore[no-any-return]


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, gather: torch.Tensor | None = None,
                 activation: str | None = None) -> torch.Tensor:
    """``y[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ weight[e].T`` for every expert e; ``gather``
    (moe_permute's positions: x is the tokens) and ``activation="swiglu"`` fuse the MLP's neighbours in."""
    fused = {k: v for k, v in (("gather", gather), ("activation", activation)) if v is not None}
    return registry().get("grouped_gemm", x, weight)(x, weight, offsets, **fused)  # type: ignore[no-any-return]
