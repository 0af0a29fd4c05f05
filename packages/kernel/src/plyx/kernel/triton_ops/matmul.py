"""Triton tiled GEMM ``C = A @ B`` (float32 accumulation), forward and backward through the same kernel.

The kernel takes arbitrary strides, so the backward's transposed operands are
views, not copies::

    dA = dC @ B^T      [M, N] @ [N, K]
    dB = A^T @ dC      [K, M] @ [M, N]

Program ids are grouped along M (``GROUP_M`` row-blocks share B tiles in L2,
as the Triton tutorial explains). Tile shapes are autotuned on CUDA per
(M, N, K) bucket; the interpreter uses one small tile.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel.reference.matmul import check_matmul
from plyx.kernel.triton_ops._common import empty, interpreting

__all__ = ["matmul", "mm"]

_NAME = "matmul:triton"


def _configs() -> list[Any]:
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 4}, num_warps=4, num_stages=1)]
    shapes = [  # (BM, BN, BK, warps, stages): Hopper-friendly tiles first, then Ampere ones
        (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
        (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 4, 4), (64, 64, 64, 4, 3),
    ]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for bm, bn, bk, w, s in shapes]


@triton.autotune(configs=_configs(), key=["M_BUCKET", "N_BUCKET", "K_BUCKET"])  # dtypes are part of the key too
@triton.jit
def _mm_kernel(A, B, C, M, N, K, sam, sak, sbk, sbn, scm, scn, M_BUCKET, N_BUCKET, K_BUCKET,
               UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak
    b_ptr = B + rk[:, None] * sbk + rn[None, :].to(tl.int64) * sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptr, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        if UPCAST:  # Triton's CPU interpreter multiplies 16-bit floats wrongly; float32 there is exact enough
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision="ieee" if a.dtype == tl.float32 else None)
        a_ptr += BLOCK_K * sak
        b_ptr += BLOCK_K * sbk
    c_ptr = C + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn
    tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _bucket(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` for any strides; returns a contiguous ``[M, N]`` in a's dtype."""
    m, k = a.shape
    n = b.shape[1]
    c = empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_()

    def grid(meta: dict[str, int]) -> tuple[int]:
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _mm_kernel[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                     _bucket(m), _bucket(n), _bucket(k), UPCAST=interpreting())
    return c


#: copy the transposed operands of the backward to row-major first instead of reading them strided in
#: the kernel. Off: on an H100 (bench/results, 2026-11-22) the strided reads were faster (fwd+bwd at
#: 4096: 0.72 ms strided, 0.93 ms with copies); bench/bench_matmul.py measures both
CONTIGUOUS_BACKWARD = {"on": False}


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a2 = a.reshape(-1, a.shape[-1])  # (M, K): leading dims folded into M
        ctx.save_for_backward(a2, b)
        ctx.a_shape = a.shape
        ctx.copy = CONTIGUOUS_BACKWARD["on"]
        return mm(a2, b).view(*a.shape[:-1], b.shape[1])

    @staticmethod
    def backward(ctx: Any, dc: torch.Tensor) -> Any:
        a2, b = ctx.saved_tensors
        dc2 = dc.reshape(-1, dc.shape[-1])
        copy = ctx.copy
        da = mm(dc2, b.T.contiguous() if copy else b.T).view(ctx.a_shape) if ctx.needs_input_grad[0] else None
        db = mm(a2.T.contiguous() if copy else a2.T, dc2) if ctx.needs_input_grad[1] else None
        return da, db


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Triton ``a @ b``; same contract as ``plyx.kernel.reference.matmul``."""
    check_matmul(_NAME, a, b)
    return _Matmul.apply(a, b)
