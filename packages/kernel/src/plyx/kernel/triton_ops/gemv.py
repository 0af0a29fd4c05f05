"""Triton ``x @ W.T (+ bias)`` at one or two rows: a weight-streaming GEMV with programmatic dependent launch.

At batch 1 a projection is a GEMV bound by its weight bytes; cuBLAS runs the 1.1B attention output
projection (a ``[2048, 2048]`` bf16 weight, 8 MB) in 6.0 us on an H200. Here one program owns
``BLOCK_N`` output columns (rows of W) and walks K in ``BLOCK_K`` chunks: the chunk's ``[BLOCK_M,
BLOCK_K]`` rows of x (from L2) and the ``[BLOCK_N, BLOCK_K]`` weight tile meet in a 3-D broadcast
``[BLOCK_M, BLOCK_N, BLOCK_K]`` summed over K, so every row of x shares one weight read.
``tl.range(..., num_stages)`` pipelines the weight loads, and under programmatic dependent launch the
first weight tile streams in while the previous kernel (the attention) finishes: 4.2 us for that shape
(``bench/sweep_gemv.py``, ``bench/results/sweep-gemv-h200-2026-11-22.jsonl``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.gemv import check_gemv
from plyx.kernel.triton_ops._common import empty, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs, weight_tile

__all__ = ["gemv", "MAX_ROWS", "pick_blocks"]

_NAME = "gemv:triton"
#: the most rows one call takes (the registry's ``rows`` limit): the rows live in registers beside the weight tile
MAX_ROWS = 2


@triton.jit
def _chunk(acc, w, x_rows, rk, kmask, mmask):
    """acc[m, n] += sum_k x[m, k] * w[n, k] over one K chunk, in float32."""
    x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, sxm, swn, sym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    w_rows = W + rn.to(tl.int64)[:, None] * swn  # a row stride: W may be a view of a packed weight
    x_rows = X + rm[:, None] * sxm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the first weight tile does not come from the previous kernel: under programmatic dependent launch it
    # streams in while that kernel finishes; x (that kernel's output) is read only after gdc_wait
    w, rk, kmask = weight_tile(w_rows, 0, K, nmask, BLOCK_K)
    wait_for_inputs(USE_GDC)
    acc = _chunk(acc, w, x_rows, rk, kmask, mmask)
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=STAGES):
        w, rk, kmask = weight_tile(w_rows, k0, K, nmask, BLOCK_K)
        acc = _chunk(acc, w, x_rows, rk, kmask, mmask)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def pick_blocks(n: int, k: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, stages)``: the fastest tiles of ``bench/sweep_gemv.py`` at M=1, bf16, on an
    H200 under programmatic dependent launch (``bench/results/sweep-gemv-h200-2026-11-22.jsonl``): 2048-wide K
    chunks, 8 warps, 3 stages; 8 weight rows per program at K=2048 (the ``[2048, 2048]`` output projection:
    4.23 us, cuBLAS 6.04) and 4 at K=5632 (the ``[2048, 5632]`` down projection: 8.29 us, cuBLAS 11.15).
    ``n`` is unused: the sweep found no N dependence worth a rule (the ``[2560, 2048]`` q/k/v shape ran best
    with 4 warps, 4.97 us, but 8 were within noise of 4 on the output projection)."""
    del n
    return (8 if k <= 2048 else 4), min(triton.next_power_of_2(max(k, 1)), 2048), 8, 3  # K=0: one masked chunk


def gemv(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
         blocks: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Triton ``gemv`` for at most ``MAX_ROWS`` rows; ``blocks=(BLOCK_N, BLOCK_K, num_warps, stages)``."""
    check_gemv(_NAME, x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(math.prod(lead), k)  # [M, K] (not -1: K may be 0)
    m = x2.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"gemv (Triton) takes at most {MAX_ROWS} rows, got {m}; use a linear (cuBLAS)")
    check_last_dim_contiguous(_NAME, "x", x2)
    check_last_dim_contiguous(_NAME, "weight", weight)
    bias = bias.contiguous() if bias is not None else None
    n = weight.shape[0]
    y = empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:  # nothing to launch (an empty grid is an error)
        return y.view(*lead, n)
    block_n, block_k, warps, stages = blocks or pick_blocks(n, k)
    gdc = pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, USE_GDC=gdc, num_warps=warps, launch_pdl=gdc)
    return y.view(*lead, n)
