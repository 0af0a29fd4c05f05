"""``moe_unpermute(ys, positions, weights) -> out``: each token's expert outputs, weighted and summed.

    out[t] = sum_j weights[t, j] * ys[positions[t, j]]       ys [T*k, D], positions/weights [T, k], out [T, D]

the inverse of ``moe_permute`` followed by the gating sum. Accumulated in float32, returned in ys's
dtype. Gradients: ``dys[positions[t, j]] = weights[t, j] * dout[t]`` (each row of ys has exactly one
source, so no atomics) and ``dweights[t, j] = <dout[t], ys[positions[t, j]]>``.
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["check_moe_unpermute", "moe_unpermute"]


def check_moe_unpermute(kernel: str, ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> None:
    check_float(kernel, "ys", ys)
    check_float(kernel, "weights", weights)
    check_same_device(kernel, ("ys", ys), ("positions", positions), ("weights", weights))
    if ys.dim() != 2:
        raise KernelInputError(kernel, "ys", f"expected [T*k, D], got shape {shape_str(ys.shape)}",
                               "pass the expert outputs in moe_permute's row order")
    if positions.dim() != 2 or positions.numel() != ys.shape[0] or positions.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(kernel, "positions", f"expected integer [T, k] with T*k = {ys.shape[0]} rows of ys, got "
                               f"{positions.dtype} {shape_str(positions.shape)}", "pass moe_permute's positions")
    if tuple(weights.shape) != tuple(positions.shape):
        raise KernelInputError(kernel, "weights", f"shape {shape_str(weights.shape)} differs from positions' "
                               f"{shape_str(positions.shape)}", "pass the router's top-k weights [T, k]")


def moe_unpermute(ys: torch.Tensor, positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out [T, D]``; see the module docstring."""
    check_moe_unpermute("moe_unpermute:reference", ys, positions, weights)
    acc = torch.float64 if ys.dtype == torch.float64 else torch.float32
    rows = ys.index_select(0, positions.reshape(-1).long()).view(*positions.shape, ys.shape[1])  # (T, k, D)
    out = (rows.to(acc) * weights.to(acc)[..., None]).sum(1)  # (T, D)
    return out.to(ys.dtype)
