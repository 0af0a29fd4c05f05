"""Triton grouped GEMM: every expert's block of rows times its weight, in one launch (no per-expert loop).

Forward and the input gradient share one kernel (``_grouped_kernel``), since each is a per-expert
``rows @ W_e^T`` with W read through strides::

    y_e  = x_e  @ W_e^T     W as [E, N, K]
    dx_e = dy_e @ W_e       W^T as [E, K, N]: the same kernel on swapped strides, no copy

The weight gradient ``dW_e = dy_e^T @ x_e`` (``_weight_grad_kernel``) is one program per (expert, N tile,
K tile) looping over that expert's rows, so it reduces without atomics.

Scheduling without a host sync: expert e needs ``ceil(rows_e / BLOCK_M)`` row tiles; the tiles of all
experts are numbered consecutively and ``torch.searchsorted`` on the cumulative counts gives each tile its
expert, on the device. At most ``ceil(M / BLOCK_M) + E`` tiles exist, so the grid has that many row tiles
(times the N tiles, grouped ``GROUP_M`` row tiles at a time for L2 reuse) and the spare ones exit at once;
the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel.reference.grouped_gemm import check_grouped_gemm
from plyx.kernel.triton_ops._common import empty, interpreting

__all__ = ["grouped_gemm", "pick_blocks"]

_NAME = "grouped_gemm:triton"


@triton.jit
def _grouped_kernel(X, W, Y, OFFS, TILE_E, TILE_ROW, N, K, E, GRID_M,
                    sxm, sxk, swe, swn, swk, sym, syn,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    # GROUP_M row tiles sweep every N tile before the next group starts (the Triton tutorial's swizzle):
    # programs running together share x tiles and the expert's weight tiles in L2
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(GRID_M - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    e = tl.load(TILE_E + pid_m)
    if e < E:  # spare tiles (the grid's upper bound) do nothing
        row0 = tl.load(TILE_ROW + pid_m)
        row_end = tl.load(OFFS + e + 1)
        rm = row0 + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptr = X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk
        w_ptr = W + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :].to(tl.int64) * swn  # (BK, BN): W_e^T
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(x_ptr, mask=(rm[:, None] < row_end) & (rk[None, :] < k_left), other=0.0)
            b = tl.load(w_ptr, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
            if UPCAST:  # Triton's CPU interpreter multiplies 16-bit floats wrongly; float32 is exact enough there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision="ieee" if a.dtype == tl.float32 else None)
            x_ptr += BLOCK_K * sxk
            w_ptr += BLOCK_K * swk
        y_ptr = Y + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=(rm[:, None] < row_end) & (rn[None, :] < N))


@triton.jit
def _weight_grad_kernel(DY, X, DW, OFFS, N, K,
                        sdm, sdn, sxm, sxk, swe, swn, swk,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # dW_e[n, k] = sum over the expert's rows r of dy[r, n] * x[r, k]
    e = tl.program_id(0)
    pid = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_K)
    rn = (pid // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = (pid % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    start = tl.load(OFFS + e)
    end = tl.load(OFFS + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rm = r0 + tl.arange(0, BLOCK_M)
        dy = tl.load(DY + rm[None, :].to(tl.int64) * sdm + rn[:, None] * sdn,
                     mask=(rm[None, :] < end) & (rn[:, None] < N), other=0.0)  # (BN, BM): dy_e^T
        x = tl.load(X + rm[:, None].to(tl.int64) * sxm + rk[None, :] * sxk,
                    mask=(rm[:, None] < end) & (rk[None, :] < K), other=0.0)  # (BM, BK)
        if UPCAST:
            dy = dy.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(dy, x, acc, input_precision="ieee" if x.dtype == tl.float32 else None)
    dw_ptr = DW + e.to(tl.int64) * swe + rn[:, None].to(tl.int64) * swn + rk[None, :] * swk
    tl.store(dw_ptr, acc.to(DW.dtype.element_ty), mask=(rn[:, None] < N) & (rk[None, :] < K))


#: row tiles per swizzle group (see _grouped_kernel); 8 as in plyx's matmul
GROUP_M = 8


def pick_blocks(m: int, e: int, device: torch.device | None = None, itemsize: int = 2) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for M rows over E experts.

    BLOCK_M follows the average rows per expert (decode: a handful per expert, so small tiles waste less);
    the interpreter uses one small tile. Many rows per expert (training, prefill) take 128x256 tiles with
    four stages, the fastest of ``bench/sweep_grouped_gemm.py``'s grid on an H100 for the forward and
    both gradients together (results/sweep-grouped-gemm-cuda-2026-11-24.jsonl: 8% less time than
    128x128x3 over the OLMoE layer's six GEMMs). Those stages need 192 KiB of shared memory: a device
    with less (A100: 164 KiB), or float32 inputs (twice the bytes), keep the 128x128 tile.
    """
    if interpreting():
        return 16, 32, 32, 4, 1
    avg = m / max(e, 1)
    if avg <= 16:
        return 16, 64, 64, 4, 3
    if avg <= 64:
        return 64, 128, 64, 4, 3
    if _shared_memory(device) >= _stage_bytes(128, 256, 64, itemsize) * 4:
        return 128, 256, 64, 8, 4
    return 128, 128, 64, 8, 3


def _stage_bytes(bm: int, bn: int, bk: int, itemsize: int = 2) -> int:
    """Shared memory of one pipeline stage: an ``x`` tile and a weight tile of ``itemsize``-byte elements."""
    return (bm * bk + bk * bn) * itemsize


@functools.cache
def _shared_memory_of(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or getattr(props, "shared_memory_per_block", 0))


def _shared_memory(device: torch.device | None) -> int:
    """Opt-in shared memory per block of ``device`` (the current CUDA device when None), 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    index = device.index if device is not None and device.type == "cuda" and device.index is not None else None
    return _shared_memory_of(torch.cuda.current_device() if index is None else index)


def _tiles(offsets: torch.Tensor, block_m: int, m: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per row tile: its expert (E for spare tiles) and first row; all on the device, no host sync."""
    e = offsets.shape[0] - 1
    counts = offsets[1:] - offsets[:-1]  # (E,)
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)  # (E,) tiles of experts 0..e
    grid_m = triton.cdiv(m, block_m) + e
    ids = torch.arange(grid_m, device=offsets.device)
    tile_e = torch.searchsorted(tile_end, ids, right=True)  # (grid_m,) in [0, E]
    first_tile = torch.cat((tile_end.new_zeros(1), tile_end))[tile_e.clamp(max=e)]
    tile_row = offsets[tile_e.clamp(max=e - 1)] + (ids - first_tile) * block_m
    return tile_e.to(torch.int32), tile_row.to(torch.int64), grid_m


def _launch(x: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], n: int, offsets: torch.Tensor,
            blocks: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    m, k = x.shape
    e = offsets.shape[0] - 1
    y = empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    bm, bn, bk, warps, stages = blocks or pick_blocks(m, e, x.device, x.element_size())
    tile_e, tile_row, grid_m = _tiles(offsets, bm, m)
    grid = (grid_m * triton.cdiv(n, bn),)
    _grouped_kernel[grid](x, w, y, offsets, tile_e, tile_row, n, k, e, grid_m, x.stride(0), x.stride(1), *w_strides,
                          y.stride(0), y.stride(1), UPCAST=interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                          GROUP_M=GROUP_M, num_warps=warps, num_stages=stages)
    return y


def _weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 blocks: tuple[int, int, int, int, int] | None) -> torch.Tensor:
    e, n, k = shape
    dw = empty((e, n, k), dtype=dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    bm, bn, bk, warps, stages = blocks or pick_blocks(x.shape[0], e, x.device, x.element_size())
    bm = min(bm, 64)  # the reduction loop's step; the tile is (BN, BK)
    grid = (e, triton.cdiv(n, bn) * triton.cdiv(k, bk))
    _weight_grad_kernel[grid](dy, x, dw, offsets, n, k, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
                              dw.stride(0), dw.stride(1), dw.stride(2), UPCAST=interpreting(), BLOCK_M=bm,
                              BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return dw


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, blocks: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w, offsets)
        ctx.blocks = blocks
        return _launch(x, w, (w.stride(0), w.stride(1), w.stride(2)), w.shape[1], offsets, blocks)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, w, offsets = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx_e = dy_e @ W_e: W read as [E, K, N]
            dx = _launch(dy, w, (w.stride(0), w.stride(2), w.stride(1)), w.shape[2], offsets, ctx.blocks)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(dy, x, offsets, w.shape, w.dtype, ctx.blocks)
        return dx, dw, None, None


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                 blocks: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Triton grouped GEMM; same contract as ``plyx.kernel.reference.grouped_gemm``.

    ``offsets`` are trusted (the reference checks their values; reading them here would sync the host).
    ``blocks=(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` overrides ``pick_blocks``.
    """
    check_grouped_gemm(_NAME, x, weight, offsets)
    return _GroupedGemm.apply(x, weight, offsets, blocks)
