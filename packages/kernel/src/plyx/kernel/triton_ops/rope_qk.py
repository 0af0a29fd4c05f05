"""Triton RoPE of q and k in one launch (rotate-half or interleaved, partial rotary, GQA), forward and backward.

``rope`` on q then on k is two launches per layer, each reading the token's cos/sin again. Here the grid is
``(B*T, ceil(H / BLOCK_H) + ceil(KV / BLOCK_H))``: the head blocks of program axis 1 below ``ceil(H / BLOCK_H)``
rotate q's heads, the rest k's, so GQA's different head counts share one launch. Per pair (see ``rope``)::

    out_a = a * cos - b * sin
    out_b = b * cos + a * sin

The backward is the same launch with sin negated on (dq_out, dk_out): the rotation by -theta is the
transpose of the rotation by theta. cos and sin get no gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.rope_qk import check_rope_qk
from plyx.kernel.triton_ops._common import empty, next_power_of_2
from plyx.kernel.triton_ops.rope import angles, rotate_rows, tables

__all__ = ["rope_qk"]

_NAME = "rope_qk:triton"


@triton.jit
def _rope_qk_kernel(Q, K, COS, SIN, QO, KO, T, H, KV, DH, HALF, Q_BLOCKS,
                    sqb, sqt, sqh, skb, skt, skh, sob, sot, soh, skob, skot, skoh, scb, sct,
                    INTERLEAVED: tl.constexpr, NEG_SIN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token % T
    blk = tl.program_id(1)
    c, s, ia, ib, rmask = angles(COS, SIN, b, t, scb, sct, HALF, INTERLEAVED, NEG_SIN, BLOCK_R)
    if blk < Q_BLOCKS:  # one of q's head blocks
        heads = blk * BLOCK_H + tl.arange(0, BLOCK_H)
        rotate_rows(Q + b * sqb + t * sqt + heads[:, None] * sqh, QO + b * sob + t * sot + heads[:, None] * soh,
                    heads < H, c, s, ia, ib, rmask, HALF, DH, BLOCK_P)
    else:  # one of k's
        heads = (blk - Q_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        rotate_rows(K + b * skb + t * skt + heads[:, None] * skh, KO + b * skob + t * skot + heads[:, None] * skoh,
                    heads < KV, c, s, ia, ib, rmask, HALF, DH, BLOCK_P)


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scb: int, sct: int,
            interleaved: bool, neg_sin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    bsz, t, h, dh = q.shape
    kv = k.shape[2]
    half = cos.shape[-1]
    qo = empty((bsz, t, h, dh), dtype=q.dtype, device=q.device)
    ko = empty((bsz, t, kv, dh), dtype=k.dtype, device=k.device)
    block_h = min(next_power_of_2(max(h, kv)), 16)
    block_r = next_power_of_2(half)
    block_p = next_power_of_2(dh - 2 * half) if dh > 2 * half else 0
    q_blocks = triton.cdiv(h, block_h)
    if bsz * t:
        _rope_qk_kernel[(bsz * t, q_blocks + triton.cdiv(kv, block_h))](
            q, k, cos, sin, qo, ko, t, h, kv, dh, half, q_blocks,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2), scb, sct,
            INTERLEAVED=interleaved, NEG_SIN=neg_sin, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=block_p, num_warps=4)
    return qo, ko


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scb: int, sct: int,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        ctx.strides, ctx.interleaved = (scb, sct), interleaved
        ctx.shapes, ctx.dtype = (q.shape, k.shape), q.dtype
        return _launch(q, k, cos, sin, scb, sct, interleaved, neg_sin=False)

    @staticmethod
    def backward(ctx: Any, dq: torch.Tensor | None, dk: torch.Tensor | None) -> Any:
        cos, sin = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        # an output that took no part in the loss has no gradient: zeros (rotated zeros are zeros)
        dq = dq.contiguous() if dq is not None else cos.new_zeros(q_shape, dtype=ctx.dtype)
        dk = dk.contiguous() if dk is not None else cos.new_zeros(k_shape, dtype=ctx.dtype)
        gq, gk = _launch(dq, dk, cos, sin, *ctx.strides, ctx.interleaved, neg_sin=True)
        return gq, gk, None, None, None, None, None


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
            interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RoPE of q and k in one launch; same contract as ``plyx.kernel.reference.rope_qk``."""
    check_rope_qk(_NAME, q, k, cos, sin)
    check_last_dim_contiguous(_NAME, "q", q)
    check_last_dim_contiguous(_NAME, "k", k)
    cos, sin, scb, sct = tables(cos, sin)  # saved for the backward as the kernel reads them
    return _RopeQK.apply(q, k, cos, sin, scb, sct, bool(interleaved))

