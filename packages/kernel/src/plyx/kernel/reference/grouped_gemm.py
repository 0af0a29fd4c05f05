"""``grouped_gemm(x, weight, offsets) -> y``: one GEMM per expert over its block of rows (the experts' MLPs).

    y[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ weight[e].T      x [M, K], weight [E, N, K], y [M, N]

``offsets [E + 1]`` (int64, from ``moe_permute``) must start at 0, never decrease and end at M. The
weight is stacked ``[E, N, K]``, each expert's slice laid out like ``nn.Linear.weight``, as Hugging Face
stores ``gate_up_proj`` and ``down_proj`` (and the expert dim 0 is what expert parallelism shards).

Reference: the per-expert loop, one ``F.linear`` per expert; it reads offsets on the host (a
synchronisation a grouped kernel avoids). Gradients: ``dx_e = dy_e @ W_e``, ``dW_e = dy_e^T @ x_e``.

Two optional fusions of the MoE MLP (a kernel may do them inside the GEMM; the reference composes them):

- ``gather=positions [T, k]`` (``moe_permute``'s): x is the tokens ``[T, K]`` and row ``positions[t, j]``
  of the grouped rows is ``x[t]`` (what ``moe_permute`` would have copied); dx sums each token's k copies.
- ``activation="swiglu"``: weight is ``[E, 2F, K]`` (each expert's gate rows, then its up rows) and the
  result is ``silu(y[:, :F]) * y[:, F:]`` ``[M, F]`` (the halves rounded to x's dtype, the product in float32).
- ``combine=(positions, weights)`` (``[T, k]`` each): the result is ``out [T, N]``, ``out[t] = sum_j
  weights[t, j] * y[positions[t, j]]`` (``moe_unpermute`` of y), differentiable in the weights too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["ACTIVATIONS", "check_grouped_gemm", "grouped_gemm"]


#: the activations ``grouped_gemm(..., activation=)`` supports
ACTIVATIONS = ("swiglu",)


def check_grouped_gemm(kernel: str, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                       gather: torch.Tensor | None = None, activation: str | None = None,
                       combine: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    check_float(kernel, "x", x)
    check_float(kernel, "weight", weight)
    check_same_device(kernel, ("x", x), ("weight", weight), ("offsets", offsets))
    if x.dim() != 2:
        raise KernelInputError(kernel, "x", f"expected [M, K], got shape {shape_str(x.shape)}", "flatten the rows first")
    if weight.dim() != 3 or weight.shape[2] != x.shape[1]:
        raise KernelInputError(kernel, "weight", f"expected [E, N, K={x.shape[1]}], got shape {shape_str(weight.shape)}",
                               "stack the experts' nn.Linear weights on a new dim 0")
    if weight.dtype != x.dtype:
        raise KernelInputError(kernel, "weight", f"dtype {weight.dtype} differs from x's {x.dtype}", "cast both to one dtype")
    if offsets.dim() != 1 or offsets.shape[0] != weight.shape[0] + 1 or offsets.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(kernel, "offsets", f"expected integer [E + 1 = {weight.shape[0] + 1}], got "
                               f"{offsets.dtype} {shape_str(offsets.shape)}", "pass moe_permute's offsets")
    if gather is not None:
        check_same_device(kernel, ("x", x), ("gather", gather))
        if gather.dim() != 2 or gather.shape[0] != x.shape[0] or gather.dtype not in (torch.int32, torch.int64):
            raise KernelInputError(kernel, "gather", f"expected integer positions [T={x.shape[0]}, k] (one row per "
                                   f"token of x), got {gather.dtype} {shape_str(gather.shape)}",
                                   "pass moe_permute's positions and the unpermuted tokens as x")
    if combine is not None:
        from plyx.kernel.reference.moe_unpermute import check_moe_unpermute

        if not isinstance(combine, tuple) or len(combine) != 2:
            raise KernelInputError(kernel, "combine", f"expected (positions, weights), got {type(combine).__name__}",
                                   "pass moe_permute's positions and the router's top-k weights")
        if gather is None:  # the combined rows are x's (with gather, the grouped copies of x's tokens)
            check_moe_unpermute(kernel, x, *combine)
    if activation is not None:
        if activation not in ACTIVATIONS:
            raise KernelInputError(kernel, "activation", f"{activation!r} is not supported",
                                   f"use one of {ACTIVATIONS} or None (apply it after the GEMM)")
        if weight.shape[1] % 2:
            raise KernelInputError(kernel, "weight", f"activation='swiglu' needs [E, 2F, K] (gate rows, then up "
                                   f"rows), got an odd N={weight.shape[1]}", "stack each expert's gate and up rows")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                 gather: torch.Tensor | None = None, activation: str | None = None,
                 combine: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``y [M, N]`` (``[M, N / 2]`` with ``activation="swiglu"``, ``[T, N]`` with ``combine``); see the
    module docstring."""
    kernel = "grouped_gemm:reference"
    check_grouped_gemm(kernel, x, weight, offsets, gather=gather, activation=activation, combine=combine)
    if combine is not None:
        from plyx.kernel.reference.moe_unpermute import moe_unpermute

        return moe_unpermute(grouped_gemm(x, weight, offsets, gather=gather, activation=activation), *combine)
    if gather is not None:  # the copies moe_permute makes: row positions[t, j] is x[t]
        k = gather.shape[1]
        source = torch.empty(gather.numel(), dtype=torch.int64, device=x.device)
        source[gather.reshape(-1).long()] = torch.arange(gather.numel(), device=x.device) // max(k, 1)
        x = x.index_select(0, source)  # (T*k, K)
    bounds = offsets.tolist()  # a host sync: the reference is the plain loop
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise KernelInputError(kernel, "offsets", f"must rise from 0 to M={x.shape[0]} (got {bounds})",
                               "pass moe_permute's offsets for these rows")
    parts = [F.linear(x[a:b], weight[e]) for e, (a, b) in enumerate(zip(bounds, bounds[1:]))]  # (rows_e, N) each
    y = torch.cat(parts, 0) if parts else x.new_zeros(0, weight.shape[1])
    if activation is None:
        return y
    f = weight.shape[1] // 2
    acc = torch.float64 if y.dtype == torch.float64 else torch.float32
    gate, up = y[:, :f].to(acc), y[:, f:].to(acc)  # (M, F) each
    return (F.silu(gate) * up).to(y.dtype)
