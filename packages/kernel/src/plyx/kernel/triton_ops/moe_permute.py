"""Triton ``moe_permute``: the routing sort in one launch, the row copies in Triton.

Sort (``routing_positions``): one program per expert scans the T*k assignments twice, counting those of
lower experts (its first row) and then numbering its own in token order (a running ``cumsum``): the
stable sort's positions and the offsets, the same integers as the reference's device sort (the tests),
with no host sync and one launch instead of a radix sort, an inverse permutation, a histogram and a
scan. Forward ``xs[positions[t, j]] = x[t]`` (``scatter_rows``); backward ``dx[t] = sum_j
dxs[positions[t, j]]`` (``gather_rows``): both plain copies and sums over a permutation, no atomics,
deterministic.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel.reference.moe_permute import check_moe_permute
from plyx.kernel.triton_ops._common import empty, interpreting
from plyx.kernel.triton_ops._moe_rows import gather_rows, scatter_rows

__all__ = ["moe_permute", "routing_positions"]

_NAME = "moe_permute:triton"


@triton.jit
def _routing_kernel(IDS, POS, OFFS, TK, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    start = tl.zeros((), dtype=tl.int64)
    for i0 in range(0, TK, BLOCK):  # the assignments to lower experts: expert e's first row
        i = i0 + tl.arange(0, BLOCK)
        ids = tl.load(IDS + i, mask=i < TK, other=2**30)
        start += tl.sum((ids < e).to(tl.int64), axis=0)
    seen = tl.zeros((), dtype=tl.int64)
    for i0 in range(0, TK, BLOCK):  # its own, numbered in token order (stable)
        i = i0 + tl.arange(0, BLOCK)
        ids = tl.load(IDS + i, mask=i < TK, other=2**30)
        hit = (ids == e).to(tl.int64)
        rank = tl.cumsum(hit, axis=0)  # (BLOCK,) 1-based among this block's hits
        tl.store(POS + i, start + seen + rank - 1, mask=(i < TK) & (hit > 0))
        seen += tl.sum(hit, axis=0)
    tl.store(OFFS + e + 1, start + seen)
    if e == 0:
        tl.store(OFFS, 0)


def routing_positions(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [T, k] int64, offsets [E + 1] int64)``: ``reference.moe_permute.routing_positions``'s
    stable sort by expert in one launch (ids are trusted in ``[0, E)``: checking would sync the host)."""
    flat = expert_ids.reshape(-1).contiguous()  # (T*k,)
    positions = empty(flat.shape, dtype=torch.int64, device=flat.device)
    offsets = empty((num_experts + 1,), dtype=torch.int64, device=flat.device)
    block = 64 if interpreting() else 1024
    _routing_kernel[(num_experts,)](flat, positions, offsets, flat.numel(), BLOCK=block,
                                    num_warps=1 if interpreting() else 4)
    return positions.view(expert_ids.shape), offsets


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(positions)
        return scatter_rows(x.contiguous(), positions)[0]

    @staticmethod
    def backward(ctx: Any, dxs: torch.Tensor) -> Any:
        (positions,) = ctx.saved_tensors
        return gather_rows(dxs.contiguous(), positions), None


def moe_permute(x: torch.Tensor, expert_ids: torch.Tensor, *, num_experts: int, copy: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Same contract as ``plyx.kernel.reference.moe_permute`` (ids are trusted: checking them would sync the host)."""
    check_moe_permute(_NAME, x, expert_ids, num_experts)
    positions, offsets = routing_positions(expert_ids, num_experts)
    if not copy:
        return None, positions, offsets
    return _Permute.apply(x, positions), positions, offsets
