"""Triton ``moe_permute``: the routing sort on the device (shared with the reference), the row copies in Triton.

Forward ``xs[positions[t, j]] = x[t]`` (``scatter_rows``); backward ``dx[t] = sum_j dxs[positions[t, j]]``
(``gather_rows``): both plain copies and sums over a permutation, no atomics, deterministic.
"""

from __future__ import annotations

from typing import Any

import torch
from plyx.kernel.reference.moe_permute import check_moe_permute, routing_positions
from plyx.kernel.triton_ops._moe_rows import gather_rows, scatter_rows

__all__ = ["moe_permute"]

_NAME = "moe_permute:triton"


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        return scatter_rows(x.contiguous(), positions)[0]

    @staticmethod
    def backward(ctx: Any, dxs: torch.Tensor) -> Any:
        (positions,) = ctx.saved_tensors
        return gather_rows(dxs.contiguous(), positions), None


def moe_permute(x: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``plyx.kernel.reference.moe_permute`` (ids are trusted: checking them would sync the host)."""
    check_moe_permute(_NAME, x, expert_ids, num_experts)
    positions, offsets = routing_positions(expert_ids, num_experts)
    return _Permute.apply(x, positions), positions, offsets
