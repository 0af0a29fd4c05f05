"""The two row kernels behind ``moe_permute`` and ``moe_unpermute`` (forward and backward).

``positions [T, k]`` is a permutation of the T*k expert rows, so every row move is a plain copy, never an
atomic add::

    _scatter_rows   dst[positions[t, j]] = scale[t, j] * src[t]            (permute; unpermute's dys)
                    and, with DOT, dscale[t, j] = <src[t], other[positions[t, j]]>   (unpermute's dweights)
    _gather_rows    dst[t] = sum_j scale[t, j] * src[positions[t, j]]      (unpermute; permute's dx)

One program per (token, expert slot) or per token; D in BLOCK_D chunks, float32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plyx.kernel.triton_ops._common import empty

__all__ = ["gather_rows", "scatter_rows"]


@triton.jit
def _scatter_kernel(SRC, POS, SCALE, DST, OTHER, DSCALE, D, TOPK, ss, sd, so,
                    HAS_SCALE: tl.constexpr, DOT: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0)  # = t * TOPK + j
    t = i // TOPK
    row = tl.load(POS + i).to(tl.int64)
    if HAS_SCALE:
        w = tl.load(SCALE + i).to(tl.float32)
    dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < D
        v = tl.load(SRC + t.to(tl.int64) * ss + cols, mask=mask, other=0.0).to(tl.float32)
        if DOT:
            o = tl.load(OTHER + row * so + cols, mask=mask, other=0.0).to(tl.float32)
            dot += v * o
        if HAS_SCALE:
            v = v * w
        tl.store(DST + row * sd + cols, v.to(DST.dtype.element_ty), mask=mask)
    if DOT:
        tl.store(DSCALE + i, tl.sum(dot, axis=0))


@triton.jit
def _gather_kernel(SRC, POS, SCALE, DST, D, ss, sd, TOPK: tl.constexpr, HAS_SCALE: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = cols < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(TOPK):
            row = tl.load(POS + t * TOPK + j).to(tl.int64)
            v = tl.load(SRC + row * ss + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_SCALE:
                v = v * tl.load(SCALE + t * TOPK + j).to(tl.float32)
            acc += v
        tl.store(DST + t.to(tl.int64) * sd + cols, acc.to(DST.dtype.element_ty), mask=mask)


def _block(d: int) -> int:
    return min(triton.next_power_of_2(max(d, 1)), 1024)


def scatter_rows(src: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor | None = None,
                 other: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dst [T*k, D]`` with ``dst[positions[t, j]] = scale[t, j] * src[t]``; with ``other``, also
    ``dscale [T, k] float32 = <src[t], other[positions[t, j]]>``. ``src`` rows and ``other`` rows unit-stride."""
    t, d = src.shape
    k = positions.shape[1]
    dst = empty((t * k, d), dtype=src.dtype, device=src.device)
    dscale = empty(positions.shape, dtype=torch.float32, device=src.device) if other is not None else None
    if t * k == 0:
        return dst, dscale
    pos = positions.contiguous()
    sc = scale.contiguous() if scale is not None else pos
    oth = other if other is not None else src
    _scatter_kernel[(t * k,)](src, pos, sc, dst, oth, dscale if dscale is not None else dst, d, k,
                              src.stride(0), dst.stride(0), oth.stride(0), HAS_SCALE=scale is not None,
                              DOT=other is not None, BLOCK_D=_block(d))
    return dst, dscale


def gather_rows(src: torch.Tensor, positions: torch.Tensor, scale: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dst [T, D]`` with ``dst[t] = sum_j scale[t, j] * src[positions[t, j]]`` (float32 sums, ``dtype`` out)."""
    t, k = positions.shape
    d = src.shape[1]
    dst = empty((t, d), dtype=dtype or src.dtype, device=src.device)
    if t == 0:
        return dst
    if k == 0 or d == 0:
        return dst.zero_()
    pos = positions.contiguous()
    sc = scale.contiguous() if scale is not None else pos
    _gather_kernel[(t,)](src, pos, sc, dst, d, src.stride(0), dst.stride(0), TOPK=k,
                         HAS_SCALE=scale is not None, BLOCK_D=_block(d))
    return dst
