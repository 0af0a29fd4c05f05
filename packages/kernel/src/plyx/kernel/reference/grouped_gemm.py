"""``grouped_gemm(x, weight, offsets) -> y``: one GEMM per expert over its block of rows (the experts' MLPs).

    y[offsets[e]:offsets[e+1]] = x[offsets[e]:offsets[e+1]] @ weight[e].T      x [M, K], weight [E, N, K], y [M, N]

``offsets [E + 1]`` (int64, from ``moe_permute``) must start at 0, never decrease and end at M. The
weight is stacked ``[E, N, K]``, each expert's slice laid out like ``nn.Linear.weight``, as Hugging Face
stores ``gate_up_proj`` and ``down_proj`` (and the expert dim 0 is what expert parallelism shards).

Reference: the per-expert loop, one ``F.linear`` per expert; it reads offsets on the host (a
synchronisation a grouped kernel avoids). Gradients: ``dx_e = dy_e @ W_e``, ``dW_e = dy_e^T @ x_e``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["check_grouped_gemm", "grouped_gemm"]


def check_grouped_gemm(kernel: str, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> None:
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


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y [M, N]``; see the module docstring."""
    kernel = "grouped_gemm:reference"
    check_grouped_gemm(kernel, x, weight, offsets)
    bounds = offsets.tolist()  # a host sync: the reference is the plain loop
    if bounds[0] != 0 or bounds[-1] != x.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise KernelInputError(kernel, "offsets", f"must rise from 0 to M={x.shape[0]} (got {bounds})",
                               "pass moe_permute's offsets for these rows")
    parts = [F.linear(x[a:b], weight[e]) for e, (a, b) in enumerate(zip(bounds, bounds[1:]))]  # (rows_e, N) each
    return torch.cat(parts, 0) if parts else x.new_zeros(0, weight.shape[1])
