"""``moe_permute(x, expert_ids, *, num_experts) -> (xs, positions, offsets)``: tokens sorted by expert (dropless).

Token ``t`` routed to experts ``expert_ids[t, 0..k-1]`` gets ``k`` copies; the copies are grouped by expert
(expert 0's first, in token order within each expert: a stable sort), so each expert's rows are one
contiguous block of ``xs`` that a grouped GEMM multiplies by that expert's weight::

    xs [T*k, D]         xs[positions[t, j]] = x[t]
    positions [T, k]    int64, the row of xs holding token t's copy for its j-th expert (a permutation of 0..T*k-1)
    offsets [E + 1]     int64, expert e owns rows offsets[e]:offsets[e+1] (offsets[0] = 0, offsets[E] = T*k)

Gradient: ``dx[t] = sum_j dxs[positions[t, j]]``. The index arithmetic (``routing_positions``) is a
stable sort and a histogram on the device, with no host synchronisation (CUDA-graph capturable); every
implementation gives the same integers (the Triton one in one launch of its own).

``copy=False`` returns ``(None, positions, offsets)``: the sort alone, for a grouped GEMM that reads the
tokens through the positions (``grouped_gemm(..., gather=positions)``) instead of a permuted copy.
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["check_moe_permute", "moe_permute", "routing_positions"]


def check_moe_permute(kernel: str, x: torch.Tensor, expert_ids: torch.Tensor, num_experts: int) -> None:
    check_float(kernel, "x", x)
    check_same_device(kernel, ("x", x), ("expert_ids", expert_ids))
    if x.dim() != 2:
        raise KernelInputError(kernel, "x", f"expected [T, D], got shape {shape_str(x.shape)}",
                               "flatten the batch: `x.reshape(-1, x.shape[-1])`")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0]:
        raise KernelInputError(kernel, "expert_ids", f"expected [T={x.shape[0]}, k], got shape {shape_str(expert_ids.shape)}",
                               "pass the router's top-k indices, one row per token")
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(kernel, "expert_ids", f"dtype {expert_ids.dtype} is not an integer type",
                               "pass the indices torch.topk returned (int64)")
    if int(num_experts) < 1:
        raise KernelInputError(kernel, "num_experts", f"must be >= 1 (got {num_experts})")


def routing_positions(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [T, k] int64, offsets [E + 1] int64)`` of a stable sort of ``expert_ids`` by expert.

    No host synchronisation: a stable device sort and a scatter-add histogram (``bincount`` would read
    the maximum back to the host).
    """
    flat = expert_ids.reshape(-1).long()  # (T*k,)
    order = torch.argsort(flat, stable=True)  # row i of xs is copy order[i] (= t * k + j)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(flat.numel(), device=flat.device)  # inverse permutation
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat((counts.new_zeros(1), counts.cumsum(0)))
    return positions.view(expert_ids.shape), offsets


def moe_permute(x: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int, copy: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Copies of ``x [T, D]``'s rows grouped by expert; see the module docstring. Reference: ``index_select``."""
    check_moe_permute("moe_permute:reference", x, expert_ids, num_experts)
    if expert_ids.numel() and (int(expert_ids.min()) < 0 or int(expert_ids.max()) >= num_experts):
        raise KernelInputError("moe_permute:reference", "expert_ids", f"values must be in [0, {num_experts})",
                               "pass indices below num_experts")
    positions, offsets = routing_positions(expert_ids, num_experts)
    if not copy:
        return None, positions, offsets
    k = expert_ids.shape[1]
    source = torch.empty_like(positions.view(-1))
    source[positions.view(-1)] = torch.arange(positions.numel(), device=x.device) // k  # token of each row
    return x.index_select(0, source), positions, offsets
