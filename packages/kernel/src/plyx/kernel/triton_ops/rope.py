"""Triton RoPE (rotate-half or interleaved, partial rotary, per-batch position tables), forward and backward.

One program per token ``(b, t)`` and block of heads: cos/sin of the token are
loaded once and applied to every head. For pair i of a head (``a, b`` are
``x[i], x[i + R/2]`` rotate-half, ``x[2i], x[2i+1]`` interleaved)::

    out_a = a * cos - b * sin
    out_b = b * cos + a * sin

The backward is the same kernel with sin negated (the rotation by -theta is the
transpose of the rotation by theta). Dims ``R..Dh`` are copied through. cos and
sin get no gradient: they are tables of positions, not parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.rope import check_rope
from plyx.kernel.triton_ops._common import empty, next_power_of_2

__all__ = ["angles", "rope", "rotate_rows", "tables"]

_NAME = "rope:triton"


@triton.jit
def angles(COS, SIN, b, t, scb, sct, HALF, INTERLEAVED: tl.constexpr, NEG_SIN: tl.constexpr, BLOCK_R: tl.constexpr):
    """Token (b, t)'s cos and sin (float32) and the dims of each rotated pair: ``(c, s, ia, ib, rmask)``."""
    i = tl.arange(0, BLOCK_R)
    rmask = i < HALF
    c = tl.load(COS + b * scb + t * sct + i, mask=rmask, other=0.0).to(tl.float32)
    s = tl.load(SIN + b * scb + t * sct + i, mask=rmask, other=0.0).to(tl.float32)
    if NEG_SIN:
        s = -s
    if INTERLEAVED:
        ia = 2 * i
        ib = 2 * i + 1
    else:
        ia = i
        ib = i + HALF
    return c, s, ia, ib, rmask


@triton.jit
def rotate_rows(src, dst, mask, c, s, ia, ib, rmask, HALF, DH, BLOCK_P: tl.constexpr):
    """Rotate the rows at ``src`` ((BLOCK_H, 1) pointers, ``mask`` per row) into ``dst``, cast to dst's dtype;
    dims 2*HALF..DH (partial rotary) are copied through."""
    m2 = mask[:, None] & rmask[None, :]
    xa = tl.load(src + ia[None, :], mask=m2, other=0.0).to(tl.float32)
    xb = tl.load(src + ib[None, :], mask=m2, other=0.0).to(tl.float32)
    ya = xa * c[None, :] - xb * s[None, :]
    yb = xb * c[None, :] + xa * s[None, :]
    tl.store(dst + ia[None, :], ya.to(dst.dtype.element_ty), mask=m2)
    tl.store(dst + ib[None, :], yb.to(dst.dtype.element_ty), mask=m2)
    if BLOCK_P > 0:
        p = 2 * HALF + tl.arange(0, BLOCK_P)
        pm = mask[:, None] & (p < DH)[None, :]
        tl.store(dst + p[None, :], tl.load(src + p[None, :], mask=pm, other=0.0).to(dst.dtype.element_ty), mask=pm)


@triton.jit
def _rope_kernel(X, COS, SIN, Y, T, H, DH, HALF, sxb, sxt, sxh, syb, syt, syh, scb, sct,
                 INTERLEAVED: tl.constexpr, NEG_SIN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    b = token // T
    t = token % T
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c, s, ia, ib, rmask = angles(COS, SIN, b, t, scb, sct, HALF, INTERLEAVED, NEG_SIN, BLOCK_R)
    rotate_rows(X + b * sxb + t * sxt + heads[:, None] * sxh, Y + b * syb + t * syt + heads[:, None] * syh,
                heads < H, c, s, ia, ib, rmask, HALF, DH, BLOCK_P)


def tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(cos, sin, batch stride, token stride)``: unit-stride tables of one layout, as the kernels read them
    (``[T, R/2]`` or ``[B|1, T, R/2]``; a batch of one is broadcast with stride 0)."""
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.dim() == 2:
        return cos, sin, 0, cos.stride(0)
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, neg_sin: bool) -> torch.Tensor:
    bsz, t, h, dh = x.shape
    half = cos.shape[-1]
    y = empty((bsz, t, h, dh), dtype=x.dtype, device=x.device)
    cos, sin, scb, sct = tables(cos, sin)
    block_h = min(next_power_of_2(h), 16)
    block_r = next_power_of_2(half)
    block_p = next_power_of_2(dh - 2 * half) if dh > 2 * half else 0
    if x.numel():
        _rope_kernel[(bsz * t, triton.cdiv(h, block_h))](
            x, cos, sin, y, t, h, dh, half, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
            y.stride(2), scb, sct, INTERLEAVED=interleaved, NEG_SIN=neg_sin, BLOCK_H=block_h, BLOCK_R=block_r,
            BLOCK_P=block_p, num_warps=4)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _launch(x, cos, sin, interleaved, neg_sin=False)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        cos, sin = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _launch(dy, cos, sin, ctx.interleaved, neg_sin=True), None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Triton RoPE; same contract as ``plyx.kernel.reference.rope`` (returns a new tensor)."""
    check_rope(_NAME, x, cos, sin)
    check_last_dim_contiguous(_NAME, "x", x)
    cos, sin, _, _ = tables(cos, sin)  # saved for the backward as the kernel reads them
    return _Rope.apply(x, cos, sin, bool(interleaved))
