"""Triton RMSNorm (+ residual add) fused into the skinny projection that reads it, optionally with SwiGLU.

At batch 1 a decode step's projections are GEMVs over weights of 8 to 46 MB, and
each RMSNorm before them is a separate ~2 us launch for a 4 KB row. Here the
norm is the projection's prologue: every program reads the (few) rows of ``x``
from L2, computes their inverse RMS, and normalises each ``BLOCK_K`` chunk as it
multiplies it into its ``[BLOCK_N, BLOCK_K]`` weight tile (each weight row a
contiguous run of bytes; float32 accumulation, no tensor cores: at M <= 2 rows
the multiply-adds are free next to the loads). Program 0 also writes the new
residual stream ``h = x + residual``. With ``swiglu`` a program reads the
matching rows of both halves of the stacked ``[gate; up]`` weight and writes
``silu(gate) * up``, so neither the ``[M, 2F]`` intermediate nor a separate
``swiglu`` launch exists.

One pass over K: the row's inverse RMS is a per-row scalar, so it is applied to
the accumulated dot products at the end and the weight loads never wait on a
reduction. ``h`` is rounded to x's dtype (the residual stream's values); the
normalised row is not rounded before the projection (float32 throughout, closer
to the float64 definition than the unfused path, within the same tolerance).

Rows: the elementwise reduction keeps ``[BLOCK_M, BLOCK_N, BLOCK_K]`` products
in registers, so it is for M <= ``MAX_ROWS`` (decode at batch 1 and 2); the
registry's shape limit sends larger M elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.rmsnorm_linear import check_rmsnorm_linear
from plyx.kernel.triton_ops._common import empty, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs, weight_tile

__all__ = ["rmsnorm_linear", "MAX_ROWS", "pick_blocks"]

_NAME = "rmsnorm_linear:triton"
#: the most rows of x one call takes (the registry's ``rows`` limit)
MAX_ROWS = 2


@triton.jit
def _load_h(X, R, rm, rk, mask, sxm, srm, HAS_RES: tl.constexpr):
    """Rows ``rm`` x columns ``rk`` of h = x (+ residual), rounded to x's dtype, as float32."""
    x = tl.load(X + rm[:, None] * sxm + rk[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rm[:, None] * srm + rk[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _tiles(w_rows, u_rows, k0, K, nmask, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr):
    """The weight tile (and the up half's, with SwiGLU) of the K chunk starting at ``k0``: ``(w, u, rk, kmask)``."""
    w, rk, kmask = weight_tile(w_rows, k0, K, nmask, BLOCK_K)
    u = w
    if SWIGLU:
        u = weight_tile(u_rows, k0, K, nmask, BLOCK_K)[0]
    return w, u, rk, kmask


@triton.jit
def _chunk(acc, acc_up, sq, w, u, X, R, NW, H, rm, rk, kmask, mmask, writer, sxm, srm, shm,
           HAS_RES: tl.constexpr, SWIGLU: tl.constexpr):
    """One K chunk: h = x (+ residual) (program 0 stores it), its squares, and the weight tiles' dot products."""
    m2 = mmask[:, None] & kmask[None, :]
    h = _load_h(X, R, rm, rk, m2, sxm, srm, HAS_RES)
    if HAS_RES:  # program 0 writes the new residual stream
        tl.store(H + rm[:, None] * shm + rk[None, :], h.to(H.dtype.element_ty), mask=m2 & writer[None, :])
    sq += tl.sum(h * h, axis=1)
    hn = h * tl.load(NW + rk, mask=kmask, other=0.0).to(tl.float32)[None, :]
    acc += tl.sum(hn[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if SWIGLU:
        acc_up += tl.sum(hn[:, None, :] * u.to(tl.float32)[None, :, :], axis=2)
    return acc, acc_up, sq


@triton.jit
def _rmsnorm_linear_kernel(X, R, NW, W, B, Y, H, M, N, K, UP_OFFSET, sxm, srm, swn, sym, shm, eps,
                           HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
                           USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * swn
    u_rows = w_rows + UP_OFFSET * swn  # read only with SWIGLU
    # broadcast before comparing: the interpreter refuses a scalar bool combined with a block of them
    writer = (tl.zeros((BLOCK_K,), dtype=tl.int32) + pid) == 0
    # One pass: the row's inverse RMS is a per-row scalar, so it factors out of the dot product,
    #   y = rstd * sum_k (h_k * nw_k) * w_k,
    # and the weight loads never wait for a reduction over the row first.
    sq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the first weight tiles are not the previous kernel's output: under programmatic dependent launch they
    # stream in while that kernel finishes; x and the residual are read only after gdc_wait
    w, u, rk, kmask = _tiles(w_rows, u_rows, 0, K, nmask, BLOCK_K, SWIGLU)
    wait_for_inputs(USE_GDC)
    acc, acc_up, sq = _chunk(acc, acc_up, sq, w, u, X, R, NW, H, rm, rk, kmask, mmask, writer, sxm, srm, shm,
                             HAS_RES, SWIGLU)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):  # pipelined weight loads
        w, u, rk, kmask = _tiles(w_rows, u_rows, k0, K, nmask, BLOCK_K, SWIGLU)
        acc, acc_up, sq = _chunk(acc, acc_up, sq, w, u, X, R, NW, H, rm, rk, kmask, mmask, writer, sxm, srm, shm,
                                 HAS_RES, SWIGLU)
    rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = acc * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            acc_up += tl.load(B + UP_OFFSET + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def pick_blocks(n: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)``: 8 weight rows per program in 1024-wide K chunks, the fastest for the
    q/k/v and gate/up shapes at M=1 on an H200 when the kernel runs after another one under programmatic
    dependent launch (``bench/sweep_gemv.py``: 6.2 us for q/k/v against 6.6 with 4 rows; 2048-wide chunks
    were slower here, 7.3-7.8 us)."""
    return 8, min(triton.next_power_of_2(k), 1024), 4


def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, bias: torch.Tensor | None = None, swiglu: bool = False,
                   blocks: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton ``rmsnorm_linear``; same contract as ``plyx.kernel.reference.rmsnorm_linear``, for M <= ``MAX_ROWS``."""
    check_rmsnorm_linear(_NAME, x, norm_weight, weight, residual, bias, eps, swiglu)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"rmsnorm_linear (Triton) takes at most {MAX_ROWS} rows, got {m}; use rmsnorm and a linear")
    r2 = residual.reshape(-1, k) if residual is not None else None
    for name, t in (("x", x2), ("weight", weight), ("residual", r2)):
        if t is not None:
            check_last_dim_contiguous(_NAME, name, t)
    norm_weight = norm_weight.contiguous()
    bias = bias.contiguous() if bias is not None else None  # read as a contiguous vector (a packed bias is)
    n_rows = weight.shape[0]
    n = n_rows // 2 if swiglu else n_rows
    y = empty((m, n), dtype=x.dtype, device=x.device)
    h = empty(x2.shape, dtype=x.dtype, device=x.device) if r2 is not None else x2
    block_n, block_k, warps = blocks or pick_blocks(n_rows, k)
    gdc = pdl(x.device)
    _rmsnorm_linear_kernel[(triton.cdiv(n, block_n),)](
        x2, r2 if r2 is not None else x2, norm_weight, weight, bias if bias is not None else weight, y, h, m, n, k, n,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, weight.stride(0), y.stride(0), h.stride(0), float(eps),
        HAS_RES=r2 is not None, HAS_BIAS=bias is not None, SWIGLU=bool(swiglu), BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n, BLOCK_K=block_k, STAGES=3, USE_GDC=gdc, num_warps=warps, launch_pdl=gdc)
    return y.view(*lead, n), h.view(*lead, k)
