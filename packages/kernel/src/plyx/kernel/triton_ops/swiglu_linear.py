"""Triton down projection of a packed MLP's SwiGLU at a few rows: ``(silu(gate) * up) @ W.T`` in one launch.

At batch 1 the down projection is a GEMV over a ``[D, F]`` weight (23 MB at 1B scale),
and cuBLAS runs it as a split-K GEMV plus a reduce kernel, after a separate ``swiglu``
launch: three launches, each with its ramp and tail. Here one program owns
``BLOCK_N`` output columns (rows of W) and walks F in ``BLOCK_K`` chunks; the chunk's
gate and up values (a few KB, from L2) become ``silu(gate) * up`` in registers, rounded
to the input dtype as the ``swiglu`` kernel's output is, and multiply into the
``[BLOCK_N, BLOCK_K]`` weight tile. ``tl.range(..., num_stages)`` pipelines the weight
loads, which is what brings the GEMV to the weight stream's bandwidth (on an H200:
9.0 us for the 1.1B shape against 12.0 for swiglu + cuBLAS, ``bench_swiglu_linear``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import check_last_dim_contiguous
from plyx.kernel.reference.swiglu_linear import check_swiglu_linear
from plyx.kernel.triton_ops._common import empty, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs, weight_tile

__all__ = ["swiglu_linear", "MAX_ROWS", "pick_blocks"]

_NAME = "swiglu_linear:triton"
#: the most rows one call takes (the registry's ``rows`` limit): each row re-reads the whole weight
MAX_ROWS = 2


@triton.jit
def _chunk(acc, w, gu, rk, kmask, F, DTYPE: tl.constexpr):
    """acc += w @ (silu(gate) * up) over one F chunk (the product rounded as the swiglu kernel's output is)."""
    g = tl.load(gu + rk, mask=kmask, other=0.0).to(tl.float32)
    u = tl.load(gu + F + rk, mask=kmask, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g)) * u).to(DTYPE).to(tl.float32)
    return acc + tl.sum(w.to(tl.float32) * a[None, :], axis=1)


@triton.jit
def _swiglu_linear_kernel(GU, W, B, Y, M, N, F, sgm, swn, sym, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.program_id(1)  # one row of gate_up per program column: the weight tile is re-read from L2
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * swn
    gu = GU + row * sgm
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # the first weight tile does not come from the previous kernel: under programmatic dependent launch it
    # streams in while that kernel finishes; gate_up is read only after gdc_wait
    w, rk, kmask = weight_tile(w_rows, 0, F, nmask, BLOCK_K)
    wait_for_inputs(USE_GDC)
    acc = _chunk(acc, w, gu, rk, kmask, F, GU.dtype.element_ty)
    for k0 in tl.range(BLOCK_K, F, BLOCK_K, num_stages=STAGES):
        w, rk, kmask = weight_tile(w_rows, k0, F, nmask, BLOCK_K)
        acc = _chunk(acc, w, gu, rk, kmask, F, GU.dtype.element_ty)
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(Y + row * sym + rn, acc.to(Y.dtype.element_ty), mask=nmask)


def pick_blocks(f: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, stages)``: 4 weight rows per program in 2048-wide chunks, the fastest of
    the sweep on an H200 for the 1.1B down projection (7.9 us against 8.8 for 8 rows in 1024-wide chunks;
    ``bench/sweep_gemv.py``, results in ``bench/results/sweep-gemv-h200-2026-11-22.jsonl``)."""
    return 4, min(triton.next_power_of_2(f), 2048), 4, 3


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
                  blocks: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """Triton ``swiglu_linear`` for at most ``MAX_ROWS`` rows; ``blocks=(BLOCK_N, BLOCK_K, num_warps, stages)``."""
    check_swiglu_linear(_NAME, gate_up, weight, bias)
    lead, two_f = gate_up.shape[:-1], gate_up.shape[-1]
    gu = gate_up.reshape(-1, two_f)
    m = gu.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"swiglu_linear (Triton) takes at most {MAX_ROWS} rows, got {m}; use swiglu and a linear")
    check_last_dim_contiguous(_NAME, "gate_up", gu)
    check_last_dim_contiguous(_NAME, "weight", weight)
    bias = bias.contiguous() if bias is not None else None
    n, f = weight.shape
    y = empty((m, n), dtype=gate_up.dtype, device=gate_up.device)
    block_n, block_k, warps, stages = blocks or pick_blocks(f)
    gdc = pdl(gate_up.device)
    _swiglu_linear_kernel[(triton.cdiv(n, block_n), m)](
        gu, weight, bias if bias is not None else weight, y, m, n, f, gu.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, USE_GDC=gdc, num_warps=warps,
        launch_pdl=gdc)
    return y.view(*lead, n)
