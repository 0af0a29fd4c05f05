"""Triton grouped GEMM: every expert's block of rows times its weight, in one launch (no per-expert loop).

Forward and the input gradient share one kernel (``_grouped_kernel``), since each is a per-expert
``rows @ W_e^T`` with W read through strides::

    y_e  = x_e  @ W_e^T     W as [E, N, K]
    dx_e = dy_e @ W_e       W^T as [E, K, N]: the same kernel on swapped strides, no copy

The weight gradient ``dW_e = dy_e^T @ x_e`` (``_weight_grad_kernel``) reduces over the tokens, about 512
rows per expert at OLMoE's training shape: a short loop and a large output (the whole [E, N, K]), so where
the programs run and what they keep in L2 matters more than the tile. Its work items are (expert, token
split, N tile, K tile), E * split * tiles of them for any routing (no host sync); ``WgradTile`` chooses the
order (expert-major, or the experts fastest), one program per item or a persistent few per SM, token splits
meeting through float32 atomics, and TMA-descriptor loads. ``bench/sweep_grouped_gemm.py`` times them and
writes the winners per pass and device to ``grouped_gemm_tiles.json``, which ``pick_blocks`` and
``pick_weight_grad`` read.

Scheduling without a host sync: expert e needs ``ceil(rows_e / BLOCK_M)`` row tiles; the tiles of all
experts are numbered consecutively and ``torch.searchsorted`` on the cumulative counts gives each tile its
expert, on the device. At most ``ceil(M / BLOCK_M) + E`` tiles exist, so the grid has that many row tiles
(times the N tiles, grouped ``GROUP_M`` row tiles at a time for L2 reuse) and the spare ones exit at once;
the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import KernelInputError
from plyx.kernel.reference.grouped_gemm import check_grouped_gemm
from plyx.kernel.triton_ops._common import empty, interpreting, num_programs
from plyx.kernel.triton_ops._moe_rows import gather_rows

__all__ = ["FUSED_PASSES", "PASSES", "SCHEDULES", "WgradTile", "grouped_gemm", "pick_blocks", "pick_fused",
           "pick_weight_grad", "source_rows", "swiglu_grad"]

_NAME = "grouped_gemm:triton"


@triton.jit
def _grouped_kernel(X, W, Y, OFFS, TILE_E, TILE_ROW, N, K, E, GRID_M,
                    sxm, sxk, swe, swn, swk, sym, syn, ROWS, A, sam, RSCALE, PART,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, TMA: tl.constexpr = 0, GATHER: tl.constexpr = 0,
                    SWIGLU: tl.constexpr = 0, COMBINE_GRAD: tl.constexpr = 0, STORE_H: tl.constexpr = 1):
    # GATHER: row r of the A operand is X[ROWS[r]] (the tokens, read through the routing's sorted index:
    # no permuted copy is written). SWIGLU: W is [E, 2N, K] (gate rows, then up rows); the program keeps a
    # gate and an up accumulator for the same N columns and stores both halves into Y [M, 2N] (the
    # backward's input) and silu(gate) * up into A [M, N]. COMBINE_GRAD (the input gradient of a GEMM whose
    # rows were combined with the gate weights): with P = X[ROWS] @ W_e^T the tile stores RSCALE[r] * P
    # (the gate weight of row r) and PART[r, pid_n] = sum over the tile's columns of P * A (A: the forward's
    # input, so the gate weights' gradient <dout[t], y[r]> = <P[r], A[r]> needs no saved y)
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
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU's up half (dead code otherwise)
        if TMA == 0:
            if GATHER:  # rows past the expert's end read token 0 (masked out below)
                src = tl.load(ROWS + rm, mask=rm < row_end, other=0).to(tl.int64)
            else:
                src = rm.to(tl.int64)
            x_ptr = X + src[:, None] * sxm + rk[None, :] * sxk
            w_ptr = W + e.to(tl.int64) * swe + rk[:, None] * swk + rn[None, :].to(tl.int64) * swn  # (BK, BN): W_e^T
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                k_left = K - k * BLOCK_K
                a = tl.load(x_ptr, mask=(rm[:, None] < row_end) & (rk[None, :] < k_left), other=0.0)
                b = tl.load(w_ptr, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
                if UPCAST:  # Triton's CPU interpreter multiplies 16-bit floats wrongly; float32 is exact enough there
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision="ieee" if a.dtype == tl.float32 else None)
                if SWIGLU:  # the up rows of W_e: N rows below the gate rows
                    bu = tl.load(w_ptr + N * swn, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
                    if UPCAST:
                        bu = bu.to(tl.float32)
                    acc_u = tl.dot(a, bu, acc_u, input_precision="ieee" if a.dtype == tl.float32 else None)
                x_ptr += BLOCK_K * sxk
                w_ptr += BLOCK_K * swk
        else:
            # TMA: x through a descriptor ending at the expert's last row (zero-filled past it and past K);
            # W as one 2-D matrix of the stacked experts. A weight tile reaching past this expert's N rows
            # (TMA 1) only feeds output columns >= N, never stored; one reaching past its K rows (TMA 2)
            # meets x's zero-filled columns, so adds nothing
            x_desc = tl.make_tensor_descriptor(X + row0 * sxm, shape=[(row_end - row0).to(tl.int32), K],
                                               strides=[sxm, 1], block_shape=[BLOCK_M, BLOCK_K])
            n0 = pid_n * BLOCK_N
            if TMA == 1:  # W [E, N, K] contiguous in K (the forward): (BN, BK) tiles of [E * N, K]
                w_desc = tl.make_tensor_descriptor(W, shape=[E * N, K], strides=[swn, 1],
                                                   block_shape=[BLOCK_N, BLOCK_K])
            else:  # W^T [E, N, K] contiguous in N (the input gradient): (BK, BN) tiles of [E * K, N]
                w_desc = tl.make_tensor_descriptor(W, shape=[E * K, N], strides=[swk, 1],
                                                   block_shape=[BLOCK_K, BLOCK_N])
            for k in range(0, tl.cdiv(K, BLOCK_K)):
                a = x_desc.load([0, k * BLOCK_K])  # (BM, BK)
                if TMA == 1:
                    b = tl.trans(w_desc.load([e * N + n0, k * BLOCK_K]))  # (BN, BK) -> (BK, BN)
                else:
                    b = w_desc.load([e * K + k * BLOCK_K, n0])  # (BK, BN)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision="ieee" if a.dtype == tl.float32 else None)
        y_ptr = Y + rm[:, None].to(tl.int64) * sym + rn[None, :] * syn
        mask = (rm[:, None] < row_end) & (rn[None, :] < N)
        if SWIGLU:
            # the activation from the rounded halves the backward reads back, as the unfused layer computes it
            if STORE_H:  # only a backward reads the halves (inference skips the [M, 2N] write)
                tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask)
                tl.store(y_ptr + N * syn, acc_u.to(Y.dtype.element_ty), mask=mask)
            gf = acc.to(Y.dtype.element_ty).to(tl.float32)
            act = gf * tl.sigmoid(gf) * acc_u.to(Y.dtype.element_ty).to(tl.float32)
            tl.store(A + rm[:, None].to(tl.int64) * sam + rn[None, :], act.to(A.dtype.element_ty), mask=mask)
        elif COMBINE_GRAD:
            other = tl.load(A + rm[:, None].to(tl.int64) * sam + rn[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(PART + rm.to(tl.int64) * grid_n + pid_n, tl.sum(acc * other, axis=1),
                     mask=rm < row_end)
            scale = tl.load(RSCALE + rm, mask=rm < row_end, other=0.0).to(tl.float32)
            tl.store(y_ptr, (acc * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
        else:
            tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad_tile(DY, X, DW, OFFS, ROWS, t, N, K, E,
                      sdm, sdn, sxm, sxk, swe, swn, swk,
                      UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_N: tl.constexpr, EXPERT_MAJOR: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
                      GATHER: tl.constexpr, DY_ROWS, DY_SCALE, GATHER_DY: tl.constexpr):
    # one work item t: an (expert, token split, N tile, K tile) of dW_e[n, k] = sum_r dy[r, n] * x[r, k]
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    per_split = tiles_n * tiles_k
    if EXPERT_MAJOR:
        # an expert's tiles run together, so its x_e and dy_e (~2 MiB each at OLMoE's shape) stay in L2 and
        # come from DRAM once; GROUP_N N tiles sweep every K tile before the next group (dy tiles reused)
        e = t // (SPLIT * per_split)
        rest = t % (SPLIT * per_split)
        s = rest // per_split
        tile = rest % per_split
        width = GROUP_N * tiles_k
        first_n = (tile // width) * GROUP_N
        group_n = tl.minimum(tiles_n - first_n, GROUP_N)
        pid_n = first_n + (tile % width) % group_n
        pid_k = (tile % width) // group_n
    else:
        # experts fastest (the first kernel's order): running programs touch every expert's rows at once
        e = t % E
        rest = t // E
        s = rest // per_split
        pid_n = (rest % per_split) // tiles_k
        pid_k = (rest % per_split) % tiles_k
    start = tl.load(OFFS + e).to(tl.int64)
    end = tl.load(OFFS + e + 1).to(tl.int64)
    lo = start
    hi = end
    if SPLIT > 1:  # split s of SPLIT takes a BLOCK_M-aligned slice of the expert's rows
        chunk = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_M) * BLOCK_M
        lo = tl.minimum(start + s * chunk, end)
        hi = tl.minimum(lo + chunk, end)
    n0 = pid_n * BLOCK_N
    k0 = pid_k * BLOCK_K
    rn = n0 + tl.arange(0, BLOCK_N)
    rk = k0 + tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if TMA:
        if hi > lo:
            # descriptors over this expert's rows only: the hardware zero-fills past them (no masks)
            rows = (hi - lo).to(tl.int32)  # descriptor shapes and coordinates are 32-bit
            dy_desc = tl.make_tensor_descriptor(DY + lo * sdm, shape=[rows, N], strides=[sdm, 1],
                                                block_shape=[BLOCK_M, BLOCK_N])
            x_desc = tl.make_tensor_descriptor(X + lo * sxm, shape=[rows, K], strides=[sxm, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
            for r in range(0, rows, BLOCK_M):
                dy = dy_desc.load([r, n0])  # (BM, BN)
                x = x_desc.load([r, k0])  # (BM, BK)
                if UPCAST:
                    dy = dy.to(tl.float32)
                    x = x.to(tl.float32)
                acc = tl.dot(tl.trans(dy), x, acc, input_precision="ieee" if x.dtype == tl.float32 else None)
    else:
        for r0 in range(lo, hi, BLOCK_M):
            rm = r0 + tl.arange(0, BLOCK_M)
            if GATHER_DY:  # dy_r = DY_SCALE[r] * DY[DY_ROWS[r]]: the gate-weighted token gradient, never stored
                dsrc = tl.load(DY_ROWS + rm, mask=rm < hi, other=0).to(tl.int64)
                dy = tl.load(DY + dsrc[None, :] * sdm + rn[:, None] * sdn,
                             mask=(rm[None, :] < hi) & (rn[:, None] < N), other=0.0)  # (BN, BM): dy_e^T
                dscale = tl.load(DY_SCALE + rm, mask=rm < hi, other=0.0).to(tl.float32)
                dy = (dy.to(tl.float32) * dscale[None, :]).to(DY.dtype.element_ty)
            else:
                dy = tl.load(DY + rm[None, :] * sdm + rn[:, None] * sdn,
                             mask=(rm[None, :] < hi) & (rn[:, None] < N), other=0.0)  # (BN, BM): dy_e^T
            if GATHER:  # x rows through the routing's index (the tokens, never a permuted copy)
                src = tl.load(ROWS + rm, mask=rm < hi, other=0).to(tl.int64)
            else:
                src = rm
            x = tl.load(X + src[:, None] * sxm + rk[None, :] * sxk,
                        mask=(rm[:, None] < hi) & (rk[None, :] < K), other=0.0)  # (BM, BK)
            if UPCAST:
                dy = dy.to(tl.float32)
                x = x.to(tl.float32)
            acc = tl.dot(dy, x, acc, input_precision="ieee" if x.dtype == tl.float32 else None)
    dw_ptr = DW + e.to(tl.int64) * swe + rn[:, None].to(tl.int64) * swn + rk[None, :] * swk
    mask = (rn[:, None] < N) & (rk[None, :] < K)
    if SPLIT > 1:  # float32 partial sums into a zeroed buffer; an empty split adds nothing
        if hi > lo:
            tl.atomic_add(dw_ptr, acc, mask=mask, sem="relaxed")
    else:  # an empty expert stores its zeros
        tl.store(dw_ptr, acc.to(DW.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad_kernel(DY, X, DW, OFFS, ROWS, N, K, E, ITEMS,
                        sdm, sdn, sxm, sxk, swe, swn, swk,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_N: tl.constexpr, EXPERT_MAJOR: tl.constexpr, SPLIT: tl.constexpr,
                        TMA: tl.constexpr, PERSISTENT: tl.constexpr, FLATTEN: tl.constexpr,
                        GATHER: tl.constexpr = 0, DY_ROWS=None, DY_SCALE=None, GATHER_DY: tl.constexpr = 0):
    # GATHER: x's rows through ROWS; GATHER_DY: dy's rows DY_SCALE[r] * DY[DY_ROWS[r]] (see _weight_grad_tile)
    # ITEMS = E * SPLIT * tiles_n * tiles_k work items: the same for any routing, so the grid needs no host sync
    pid = tl.program_id(0)
    if PERSISTENT:  # a fixed number of programs walk the items, expert after expert
        # FLATTEN fuses this loop with the row loop, so one item's loads overlap the last one's store
        for t in tl.range(pid, ITEMS, tl.num_programs(0), flatten=FLATTEN):
            _weight_grad_tile(DY, X, DW, OFFS, ROWS, t, N, K, E, sdm, sdn, sxm, sxk, swe, swn, swk, UPCAST,
                              BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EXPERT_MAJOR, SPLIT, TMA, GATHER, DY_ROWS, DY_SCALE,
                          GATHER_DY)
    else:
        _weight_grad_tile(DY, X, DW, OFFS, ROWS, pid, N, K, E, sdm, sdn, sxm, sxk, swe, swn, swk, UPCAST,
                          BLOCK_M, BLOCK_N, BLOCK_K, GROUP_N, EXPERT_MAJOR, SPLIT, TMA, GATHER, DY_ROWS, DY_SCALE,
                          GATHER_DY)


@triton.jit
def _tile_kernel(OFFS, TILE_E, TILE_ROW, E, GRID_M, BLOCK_M: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr):
    # the row-tile table of _grouped_kernel in one launch: expert e owns ceil(rows_e / BLOCK_M) consecutive
    # tiles; tile i belongs to the number of experts whose tiles end at or before i (E for the spare ones)
    ids = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ex = tl.arange(0, EP)
    lo = tl.load(OFFS + ex, mask=ex < E, other=0)
    hi = tl.load(OFFS + ex + 1, mask=ex < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M  # (EP,) 0 for the padding
    end = tl.cumsum(tiles, 0)  # (EP,) tiles of experts 0..e
    e = tl.minimum(tl.sum((end[None, :] <= ids[:, None]).to(tl.int32), axis=1), E)  # (BLOCK,)
    hit = ex[None, :] == e[:, None]  # (BLOCK, EP) one-hot of each tile's expert (none for spare tiles)
    first = tl.sum(tl.where(hit, (end - tiles)[None, :], 0), axis=1)
    row = tl.sum(tl.where(hit, lo[None, :], 0), axis=1) + (ids - first) * BLOCK_M
    keep = ids < GRID_M
    tl.store(TILE_E + ids, e.to(tl.int32), mask=keep)
    tl.store(TILE_ROW + ids, row.to(tl.int64), mask=keep)


def tile_table_block(ep: int) -> int:
    """Tiles per program of ``_tile_kernel`` for ``ep`` (a power of two) experts: 2,048 / ep within [16, 128]."""
    return max(16, min(128, 2048 // ep))


@triton.jit
def _source_rows_kernel(POS, ROWS, WEIGHTS, ROW_WEIGHTS, TK, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                        HAS_WEIGHTS: tl.constexpr = 0):
    # ROWS[positions[t, j]] = t: the token of every grouped row (positions is a permutation: plain stores);
    # with HAS_WEIGHTS also ROW_WEIGHTS[positions[t, j]] = weights[t, j] (each row's gate weight)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = i < TK
    pos = tl.load(POS + i, mask=keep, other=0)
    tl.store(ROWS + pos, (i // TOPK).to(tl.int32), mask=keep)
    if HAS_WEIGHTS:
        tl.store(ROW_WEIGHTS + pos, tl.load(WEIGHTS + i, mask=keep, other=0.0).to(tl.float32), mask=keep)


@triton.jit
def _swiglu_grad_kernel(DA, H, DH, M, F, sda, sh, sdh, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    # dh = [da * u * s * (1 + g (1 - s)), da * g * s] with s = sigmoid(g), g|u = h's halves: one pass into a
    # contiguous [M, 2F] (the unfused layer's slice backward zero-fills and adds two full-size halves)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (r[:, None] < M) & (c[None, :] < F)
    r64 = r[:, None].to(tl.int64)
    da = tl.load(DA + r64 * sda + c[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(H + r64 * sh + c[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(H + r64 * sh + F + c[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    tl.store(DH + r64 * sdh + c[None, :], (da * u * s * (1.0 + g * (1.0 - s))).to(DH.dtype.element_ty), mask=mask)
    tl.store(DH + r64 * sdh + F + c[None, :], (da * g * s).to(DH.dtype.element_ty), mask=mask)


#: row tiles per swizzle group (see _grouped_kernel); 8 as in plyx's matmul
GROUP_M = 8
#: with ``gather=`` (``combine=``), the weight gradient reads x's rows (dout's, scaled by the gate weights)
#: through the routing too; False: it first copies the grouped rows, as the unfused layer had them. The MoE
#: benchmark times both. ``PLYX_MOE_GATHER_WGRAD=0`` starts it False
GATHER_WEIGHT_GRAD = os.environ.get("PLYX_MOE_GATHER_WGRAD", "1") not in ("", "0")


class WgradTile(NamedTuple):
    """A weight-gradient launch: the ``(BLOCK_N, BLOCK_K)`` tile of dW_e, reduced over rows ``BLOCK_M`` at a time.

    ``schedule``: ``"expert"`` numbers the tiles expert after expert (an expert's rows stay in L2 while its
    tiles run), ``"tile"`` puts the experts fastest (the first kernel's order, kept to measure against),
    ``"persistent"`` launches a program per SM (or a few) that walk the expert-major items (``"persistent-flat"``
    fuses that walk with the row loop, so the pipeline runs on across items). ``split > 1``
    cuts each expert's rows into that many slices whose float32 partial sums meet with atomics in a zeroed
    buffer (more programs where the tile grid is small; costs a float32 pass over dW). ``tma``: the operand
    tiles come through per-expert TMA descriptors (Hopper+; the hardware zero-fills rows past the expert's
    end, so the loads carry no masks); where the strides do not allow it the pointer loads are used.
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    schedule: str = "expert"
    split: int = 1
    tma: bool = False


SCHEDULES = ("expert", "tile", "persistent", "persistent-flat")
PASSES = ("forward", "input_grad", "weight_grad")
#: the fused passes' own table entries (``bench/sweep_moe_fused.py``): the gathered SwiGLU forward (BLOCK_N
#: per half) and the combine's input gradient; without an entry they take the forward's / input gradient's
#: tile, a 256-wide N halved
FUSED_PASSES = ("forward_swiglu", "input_grad_combine")
#: per-device tiles measured by ``bench/sweep_grouped_gemm.py`` (``--write-table``) for many rows per expert
TABLE = Path(__file__).with_name("grouped_gemm_tiles.json")


def pick_blocks(m: int, e: int, device: torch.device | None = None, itemsize: int = 2,
                pass_: str = "forward") -> tuple[Any, ...]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, tma])`` of the forward or input-gradient pass.

    BLOCK_M follows the average rows per expert (decode: a handful per expert, so small tiles waste less);
    the interpreter uses one small tile. Many rows per expert (training, prefill) take the device's entry
    of ``grouped_gemm_tiles.json`` for ``pass_`` (measured by ``bench/sweep_grouped_gemm.py``) when there
    is one for 16-bit inputs, else 128x256 tiles with four stages where the shared memory holds them
    (192 KiB: an A100's 164 KiB, or float32's doubled bytes, do not), else 128x128x64 with three.

    Args:
        m: rows (tokens times top-k). e: experts. device: where the GEMM runs (None: the current CUDA
            device). itemsize: bytes per input element. pass_: ``"forward"`` or ``"input_grad"``.

    Returns:
        The tile; a measured entry may add ``tma`` (x and W through TMA descriptors, where they allow it).
    """
    if interpreting():
        return 16, 32, 32, 4, 1
    avg = m / max(e, 1)
    if avg <= 16:
        return 16, 64, 64, 4, 3
    if avg <= 64:
        return 64, 128, 64, 4, 3
    smem = _shared_memory(device)
    tuned = _tuned(device).get(pass_) if itemsize == 2 else None
    if tuned is not None and _stage_bytes(*tuned[:3], itemsize) * tuned[4] <= smem:
        return tuple(tuned)
    if smem >= _stage_bytes(128, 256, 64, itemsize) * 4:
        return 128, 256, 64, 8, 4
    return 128, 128, 64, 8, 3


def pick_weight_grad(m: int, e: int, device: torch.device | None = None, itemsize: int = 2) -> WgradTile:
    """The weight-gradient launch for M rows over E experts.

    Many rows per expert take the device's measured ``weight_grad`` entry of ``grouped_gemm_tiles.json``
    (16-bit inputs, where its stages fit); otherwise the forward's tile read as a dW tile (N x K) with at
    most 64 rows per reduction step, in the expert-major order.

    Args:
        m, e, device, itemsize: as for ``pick_blocks``.

    Returns:
        A ``WgradTile``.
    """
    if interpreting():
        return WgradTile(16, 32, 32, 4, 1)
    if m / max(e, 1) > 64 and itemsize == 2:
        tuned = _tuned(device).get("weight_grad")
        if tuned is not None:
            tile = WgradTile(*tuned)
            if _wgrad_stage_bytes(tile, itemsize) * tile.num_stages <= _shared_memory(device):
                return tile
    bm, bn, bk, warps, stages = pick_blocks(m, e, device, itemsize)[:5]
    return WgradTile(min(bm, 64), bn, bk, warps, stages)


def pick_fused(pass_: str, m: int, e: int, device: torch.device | None = None,
               itemsize: int = 2) -> tuple[Any, ...] | None:
    """A fused pass's own measured tile (``bench/sweep_moe_fused.py --write-table``), or None (the caller then
    halves the forward's / input gradient's tile where it is 256 wide).

    Args:
        pass_: ``"forward_swiglu"`` (BLOCK_N per half: the stages hold an x tile and two weight tiles) or
            ``"input_grad_combine"``. m, e, device, itemsize: as for ``pick_blocks``.

    Returns:
        ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for many 16-bit rows per expert where the
        device has an entry whose stages fit, else None.
    """
    if pass_ not in FUSED_PASSES:
        raise ValueError(f"{_NAME}: fused pass {pass_!r} is not one of {FUSED_PASSES}")
    if interpreting() or m / max(e, 1) <= 64 or itemsize != 2:
        return None
    tuned = _tuned(device).get(pass_)
    if tuned is None:
        return None
    bm, bn, bk, _, stages = tuned[:5]
    weights = 2 if pass_ == "forward_swiglu" else 1
    if (bm * bk + weights * bk * bn) * itemsize * stages > _shared_memory(device):
        return None
    return tuple(tuned)


@functools.cache
def _table() -> dict[str, dict[str, list[Any]]]:
    try:
        return json.loads(TABLE.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):  # an unreadable table falls back to the built-in choices
        return {}


def _tuned(device: torch.device | None) -> dict[str, list[Any]]:
    """This device's measured tiles per pass (``{}`` without CUDA or without an entry for its name)."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return {}
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _table().get(_device_name(index), {}).get("passes", {})


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _stage_bytes(bm: int, bn: int, bk: int, itemsize: int = 2) -> int:
    """Shared memory of one pipeline stage: an ``x`` tile and a weight tile of ``itemsize``-byte elements."""
    return (bm * bk + bk * bn) * itemsize


def _wgrad_stage_bytes(tile: WgradTile, itemsize: int = 2) -> int:
    """Shared memory of one weight-gradient stage: ``BLOCK_M`` rows of ``dy`` (``BLOCK_N`` wide) and of ``x``."""
    return tile.block_m * (tile.block_n + tile.block_k) * itemsize


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
    """Per row tile: its expert (E for spare tiles) and first row; one launch on the device, no host sync."""
    e = offsets.shape[0] - 1
    grid_m = triton.cdiv(m, block_m) + e
    tile_e = torch.empty(grid_m, dtype=torch.int32, device=offsets.device)
    tile_row = torch.empty(grid_m, dtype=torch.int64, device=offsets.device)
    ep = triton.next_power_of_2(max(e, 1))
    # the program holds [BLOCK, EP] comparisons: about 2,048 of them keep it in registers at 4 warps (at
    # BLOCK 128 x EP 64, Triton 3.0 spilled 304 bytes a thread to the stack)
    block = 16 if interpreting() else tile_table_block(ep)
    _tile_kernel[(triton.cdiv(grid_m, block),)](offsets, tile_e, tile_row, e, grid_m, BLOCK_M=block_m, EP=ep,
                                                BLOCK=block)
    return tile_e, tile_row, grid_m


def source_rows(positions: torch.Tensor, weights: torch.Tensor | None = None) -> Any:
    """``rows [T*k] int32``: ``rows[positions[t, j]] = t``, the token each grouped row copies (one launch);
    with ``weights [T, k]`` also ``(rows, row_weights [T*k] float32)``, each grouped row's gate weight."""
    t, k = positions.shape
    rows = empty((t * k,), dtype=torch.int32, device=positions.device)
    row_w = empty((t * k,), dtype=torch.float32, device=positions.device) if weights is not None else rows
    if t * k:
        block = 128 if interpreting() else 1024
        w = weights.contiguous() if weights is not None else rows
        _source_rows_kernel[(triton.cdiv(t * k, block),)](positions.contiguous(), rows, w, row_w, t * k, TOPK=k,
                                                          BLOCK=block, HAS_WEIGHTS=weights is not None)
    return (rows, row_w) if weights is not None else rows


def swiglu_grad(da: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``dh [M, 2F]`` (contiguous) of ``silu(h[:, :F]) * h[:, F:]`` for the incoming ``da [M, F]``."""
    m, f = da.shape
    dh = empty((m, 2 * f), dtype=h.dtype, device=h.device)
    if m and f:
        br, bf = (4, 32) if interpreting() else (16, 256)
        _swiglu_grad_kernel[(triton.cdiv(m, br), triton.cdiv(f, bf))](da, h, dh, m, f, da.stride(0), h.stride(0),
                                                                      dh.stride(0), BLOCK_R=br, BLOCK_F=bf)
    return dh


def _w_tma(x: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], n: int, k: int) -> int:
    """How ``_grouped_kernel`` can read W through a TMA descriptor: 1 (contiguous in K, the experts stacked
    as one [E * N, K] matrix), 2 (contiguous in N: [E * K, N]) or 0 (pointer loads)."""
    size = w.element_size()
    if not _tma_ok(x) or w.data_ptr() % 16:
        return 0
    swe, swn, swk = w_strides
    if swk == 1 and swe == n * swn and (swn * size) % 16 == 0:
        return 1
    if swn == 1 and swe == k * swk and (swk * size) % 16 == 0:
        return 2
    return 0


def _launch(x: torch.Tensor, w: torch.Tensor, w_strides: tuple[int, int, int], n: int, offsets: torch.Tensor,
            blocks: tuple[Any, ...] | None, pass_: str = "forward", rows: torch.Tensor | None = None,
            swiglu: bool = False, row_scale: torch.Tensor | None = None, other: torch.Tensor | None = None,
            store_h: bool = True) -> Any:
    """``y [M, N]``, ``y_e = x_e @ W_e^T`` with W read through ``w_strides`` as [E, N, K].

    ``blocks``: ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, tma])``; ``tma`` reads x and W through
    TMA descriptors where their strides allow it (else the pointer loads). ``rows [M]``: row r of the
    product reads ``x[rows[r]]`` (M = len(rows)). ``swiglu``: W is [E, 2N, K] and the result is
    ``(h [M, 2N], silu(h[:, :N]) * h[:, N:] [M, N])``. ``row_scale [M]`` and ``other [M, N]`` (the input
    gradient of a combined GEMM): with P the product, the result is ``(row_scale[:, None] * P,
    partial [M, tiles] float32)`` whose row sums are ``<P[r], other[r]>``. ``store_h=False`` (SwiGLU
    without a backward): h is not written, and returned as None.
    """
    m = rows.shape[0] if rows is not None else x.shape[0]
    k = x.shape[1]
    e = offsets.shape[0] - 1
    combine = other is not None
    store_h = store_h or not swiglu
    y = empty((m if store_h else 1, 2 * n if swiglu else n), dtype=x.dtype, device=x.device)  # 1: never written
    act = empty((m, n), dtype=x.dtype, device=x.device) if swiglu else y
    if not blocks and (swiglu or combine):
        blocks = pick_fused("forward_swiglu" if swiglu else "input_grad_combine", m, e, x.device, x.element_size())
    bm, bn, bk, warps, stages, *rest = blocks or pick_blocks(m, e, x.device, x.element_size(), pass_)
    if (swiglu or combine) and not blocks and bn >= 256:
        # SwiGLU: two accumulators of (BM, BN / 2), the registers of the tuned (BM, BN) tile; the combine's
        # epilogue holds a float32 tile of the forward's input beside the accumulator (at 128 x 256 it spills)
        bn //= 2
    part = empty((m, triton.cdiv(max(n, 1), bn)), dtype=torch.float32, device=x.device) if combine else y
    out = (y if store_h else None, act) if swiglu else (y, part) if combine else y
    if m == 0 or n == 0:
        return out
    if k == 0:
        y.zero_()
        if combine:
            part.zero_()  # a product of zeros: its sums are zero
        return (out[0], act.zero_()) if swiglu else out  # silu(0) * 0
    fused = rows is not None or swiglu or combine
    tma = _w_tma(x, w, w_strides, n, k) if rest and rest[0] and not fused else 0
    if tma:
        triton.set_allocator(_tma_scratch)
    tile_e, tile_row, grid_m = _tiles(offsets, bm, m)
    grid = (grid_m * triton.cdiv(n, bn),)
    side = other if combine else act
    _grouped_kernel[grid](x, w, y, offsets, tile_e, tile_row, n, k, e, grid_m, x.stride(0), x.stride(1), *w_strides,
                          y.stride(0), y.stride(1), rows if rows is not None else tile_e, side, side.stride(0),
                          row_scale if row_scale is not None else part, part,
                          UPCAST=interpreting(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, TMA=tma,
                          GATHER=rows is not None, SWIGLU=swiglu, COMBINE_GRAD=combine, STORE_H=store_h,
                          num_warps=warps, num_stages=stages)
    return out


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors need a unit inner stride, 16-byte aligned row strides and bases, and Hopper or newer."""
    for t in tensors:
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    if interpreting():
        return True
    return tensors[0].device.type == "cuda" and torch.cuda.get_device_capability(tensors[0].device)[0] >= 9


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors the kernel writes (``tl.make_tensor_descriptor``)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreting() else "cuda")


def _programs(device: torch.device, tile: WgradTile, itemsize: int) -> int:
    """Persistent programs: as many per SM as their pipeline stages fit in its shared memory (1 to 4)."""
    if device.type != "cuda":
        return 3
    per_sm = _shared_memory(device) // max(_wgrad_stage_bytes(tile, itemsize) * tile.num_stages, 1)
    return num_programs(device, 1 << 30, per_sm=max(1, min(int(per_sm), 4)))


def _weight_grad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 tile: WgradTile | None, rows: torch.Tensor | None = None, dy_rows: torch.Tensor | None = None,
                 dy_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``dW [E, N, K]``, ``dW_e = dy_e^T @ x_e`` for every expert (zeros for an empty one); with ``rows``,
    x's row r is ``x[rows[r]]``; with ``dy_rows`` and ``dy_scale``, dy's row r is ``dy_scale[r] * dy[dy_rows[r]]``."""
    e, n, k = shape
    m = dy_rows.shape[0] if dy_rows is not None else dy.shape[0]
    tile = tile or pick_weight_grad(m, e, x.device, x.element_size())
    if tile.schedule not in SCHEDULES:
        raise ValueError(f"{_NAME}: weight-gradient schedule {tile.schedule!r} is not one of {SCHEDULES}")
    split = max(int(tile.split), 1)
    if split > 1:  # float32 partial sums meet in a zeroed buffer
        dw = torch.zeros((e, n, k), dtype=torch.float32, device=x.device)
    else:
        dw = empty((e, n, k), dtype=dtype, device=x.device)
    if dw.numel() == 0:
        return dw.to(dtype)
    tma = bool(tile.tma) and rows is None and dy_rows is None and _tma_ok(dy, x)
    if tma:
        triton.set_allocator(_tma_scratch)
    items = e * split * triton.cdiv(n, tile.block_n) * triton.cdiv(k, tile.block_k)
    persistent = tile.schedule.startswith("persistent")
    grid = (min(items, _programs(x.device, tile, x.element_size())) if persistent else items,)
    _weight_grad_kernel[grid](dy, x, dw, offsets, rows if rows is not None else offsets, n, k, e, items,
                              dy.stride(0), dy.stride(1), x.stride(0),
                              x.stride(1), dw.stride(0), dw.stride(1), dw.stride(2), UPCAST=interpreting(),
                              BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_N=GROUP_M,
                              EXPERT_MAJOR=tile.schedule != "tile", SPLIT=split, TMA=tma, PERSISTENT=persistent,
                              FLATTEN=tile.schedule == "persistent-flat", GATHER=rows is not None,
                              DY_ROWS=dy_rows if dy_rows is not None else offsets,
                              DY_SCALE=dy_scale if dy_scale is not None else offsets, GATHER_DY=dy_rows is not None,
                              num_warps=tile.num_warps, num_stages=tile.num_stages)
    return dw.to(dtype)


def _pass_blocks(blocks: Any, pass_: str) -> Any:
    """The override for one pass: ``blocks`` is one 5-tuple for every pass or a ``{pass: tile}`` dict."""
    if blocks is None:
        return None
    if isinstance(blocks, dict):
        unknown = set(blocks) - set(PASSES)
        if unknown:
            raise ValueError(f"{_NAME}: blocks has unknown passes {sorted(unknown)}; use {PASSES}")
        tile = blocks.get(pass_)
        if pass_ == "weight_grad" and tile is not None:
            return WgradTile(*tile)
        return tile
    if pass_ == "weight_grad":  # the forward tile read as a dW tile, as the first kernel did
        bm, bn, bk, warps, stages = blocks[:5]
        return WgradTile(min(bm, 64), bn, bk, warps, stages)
    return blocks


class _GroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, blocks: Any,
                positions: torch.Tensor | None, swiglu: bool) -> torch.Tensor:
        rows = source_rows(positions) if positions is not None else None
        n = w.shape[1] // 2 if swiglu else w.shape[1]
        out = _launch(x, w, (w.stride(0), w.stride(1), w.stride(2)), n, offsets, _pass_blocks(blocks, "forward"),
                      rows=rows, swiglu=swiglu, store_h=any(ctx.needs_input_grad[:2]))
        h, y = out if swiglu else (None, out)
        ctx.save_for_backward(x, w, offsets, positions, rows, h)
        ctx.blocks = blocks
        return y  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, w, offsets, positions, rows, h = ctx.saved_tensors
        if h is not None:  # the SwiGLU's gradient, both halves in one contiguous [M, 2F]
            dy = swiglu_grad(dy, h)
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dx_e = dy_e @ W_e: W read as [E, K, N]
            dx = _launch(dy, w, (w.stride(0), w.stride(2), w.stride(1)), w.shape[2], offsets,
                         _pass_blocks(ctx.blocks, "input_grad"), "input_grad")
            if positions is not None:  # each token's copies summed (a permutation: no atomics)
                dx = gather_rows(dx, positions)
        if ctx.needs_input_grad[1]:
            if rows is not None and not GATHER_WEIGHT_GRAD:
                x, rows = x.index_select(0, rows), None  # (M, K) grouped copies
            dw = _weight_grad(dy, x, offsets, w.shape, w.dtype, _pass_blocks(ctx.blocks, "weight_grad"), rows)
        return dx, dw, None, None, None, None


class _GroupedGemmCombine(torch.autograd.Function):
    """``out[t] = sum_j weights[t, j] * (x @ W_e^T)[positions[t, j]]``: the grouped rows never reach the backward.

    Forward: the product (not saved), then the weighted gather-sum. Backward, without a stored ``dys``: the
    input-gradient kernel reads ``dout`` through the rows' tokens, scales each row by its gate weight and
    sums ``P * x`` for the gate weights' gradient in its epilogue; the weight gradient reads ``dout`` the same
    way, scaled as it loads.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, blocks: Any,
                positions: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        y = _launch(x, w, (w.stride(0), w.stride(1), w.stride(2)), w.shape[1], offsets, _pass_blocks(blocks, "forward"))
        out = gather_rows(y, positions, weights)  # (T, N)
        if any(ctx.needs_input_grad):  # the backward's row index and gate weights (not needed to serve)
            rows, row_w = source_rows(positions, weights)
            ctx.save_for_backward(x, w, offsets, positions, rows, row_w)
        ctx.blocks, ctx.weights_dtype = blocks, weights.dtype
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> Any:
        x, w, offsets, positions, rows, row_w = ctx.saved_tensors
        dout = dout.contiguous()
        dx = dweights = dw = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[5]:
            # dx_r = w_r * (dout[t_r] @ W_e), and <dout[t_r], y_r> = <dout[t_r] @ W_e, x_r> for the gate weights
            dx, part = _launch(dout, w, (w.stride(0), w.stride(2), w.stride(1)), w.shape[2], offsets,
                               _pass_blocks(ctx.blocks, "input_grad"), "input_grad", rows=rows, row_scale=row_w,
                               other=x)
            dweights = part.sum(1)[positions.reshape(-1)].view(positions.shape).to(ctx.weights_dtype)  # (T, k)
            dx = dx if ctx.needs_input_grad[0] else None
            dweights = dweights if ctx.needs_input_grad[5] else None
        if ctx.needs_input_grad[1]:
            if GATHER_WEIGHT_GRAD:
                dw = _weight_grad(dout, x, offsets, w.shape, w.dtype, _pass_blocks(ctx.blocks, "weight_grad"),
                                  dy_rows=rows, dy_scale=row_w)
            else:  # the rows' gradient in memory: (M, N)
                dys = (dout.index_select(0, rows).float() * row_w[:, None]).to(dout.dtype)
                dw = _weight_grad(dys, x, offsets, w.shape, w.dtype, _pass_blocks(ctx.blocks, "weight_grad"))
        return dx, dw, None, None, None, dweights


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *,
                 gather: torch.Tensor | None = None, activation: str | None = None,
                 combine: tuple[torch.Tensor, torch.Tensor] | None = None,
                 blocks: tuple[int, int, int, int, int] | dict[str, tuple[Any, ...]] | None = None) -> torch.Tensor:
    """Triton grouped GEMM; same contract as ``plyx.kernel.reference.grouped_gemm``.

    Args:
        x, weight, offsets: as the reference's; ``offsets`` are trusted (the reference checks their values;
            reading them here would sync the host).
        gather: ``positions [T, k]`` of ``moe_permute``: x holds the T tokens and the kernel reads each
            grouped row through the sorted index (no permuted copy in memory, forward or weight gradient).
        activation: ``"swiglu"``: weight is ``[E, 2F, K]`` (gate rows, then up rows) and the result is
            ``silu(gate) * up [M, F]``, computed in the GEMM's epilogue.
        combine: ``(positions [T, k], weights [T, k])``: the result is ``out [T, N]``, ``out[t] = sum_j
            weights[t, j] * y[positions[t, j]]`` (``moe_unpermute`` of y), differentiable in the weights too;
            the backward reads ``dout`` through the routing instead of storing y or the rows' gradient.
        blocks: tiles instead of ``pick_blocks`` / ``pick_weight_grad``: one
            ``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for every pass (the weight gradient reads it
            as a ``BLOCK_N x BLOCK_K`` tile of dW, at most 64 rows a step), or ``{pass: tile}`` for some of
            ``"forward"``, ``"input_grad"`` (5-tuples) and ``"weight_grad"`` (a ``WgradTile``). With the
            SwiGLU the forward's BLOCK_N is each half's (gate and up); without ``blocks`` the fused passes
            take ``pick_fused``'s tile, or the forward's / input gradient's with a 256-wide N halved.

    Returns:
        ``y [M, N]`` (``[M, F]`` with the SwiGLU, ``[T, N]`` with ``combine``), differentiable in ``x`` and
        ``weight`` (and the gate weights).
    """
    check_grouped_gemm(_NAME, x, weight, offsets, gather=gather, activation=activation, combine=combine)
    if combine is not None:
        if gather is not None or activation is not None:
            raise KernelInputError(_NAME, "combine", "is not supported together with gather or activation",
                                   "combine the second GEMM of the MLP (the first takes gather and activation)")
        return _GroupedGemmCombine.apply(x, weight, offsets, blocks, combine[0], combine[1])  # type: ignore[no-any-return]
    return _GroupedGemm.apply(x, weight, offsets, blocks, gather, activation == "swiglu")  # type: ignore[no-any-return]
