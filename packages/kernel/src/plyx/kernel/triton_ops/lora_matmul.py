"""Triton gathered LoRA matmul (Punica's BGMV): a batch whose rows use different adapters, in two launches.

Multi-LoRA serving adds ``s_a B_a A_a x_i`` to each row ``i`` of an adapted linear, ``a = index[i]``
(``-1``: the base model, no update). Stacking the adapters (``A [n, r, in]``, ``B [n, out, r]`` with the
scaling folded into B, ranks zero-padded to the largest) makes that two gathered matrix-vector products:

    shrink:  h[i] = A[index[i]] @ x[i]          [N, r]
    expand:  y[i] = B[index[i]] @ h[i]          [N, out]

Both are ``_bgmv``: one program per (row, block of outputs) loads its row's adapter index, walks K in
``BLOCK_K`` chunks of that adapter's weight tile ``[BLOCK_O, BLOCK_K]`` against the row's ``x`` chunk, and
accumulates in float32 (float64 inputs accumulate in float64). Rows of the base store zeros. The weights
of an adapter are re-read per row, which is what decode batches (few rows per adapter, a rank of 8-64)
afford; prefill chunks of many rows of one adapter are better served by a segmented GEMM (not done here).
Inference only: no backward (serving never differentiates through adapters).

The torch reference is ``plyx.serve._lora.lora_delta``; ``tests/test_lora_matmul.py`` checks this kernel
against a float64 oracle written from the definition.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["bgmv", "lora_matmul"]


@triton.jit
def _bgmv_kernel(X, W, IDX, Y, N_OUT, K, sxn, swa, swo, syn, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                 F64: tl.constexpr):
    row = tl.program_id(0)
    pid_o = tl.program_id(1)
    ro = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    omask = ro < N_OUT
    a = tl.load(IDX + row)
    acc_ty = tl.float64 if F64 else tl.float32
    acc = tl.zeros((BLOCK_O,), dtype=acc_ty)
    if a >= 0:
        w_rows = W + a.to(tl.int64) * swa + ro.to(tl.int64)[:, None] * swo  # [BLOCK_O, 1] row pointers of W[a]
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(X + row.to(tl.int64) * sxn + rk, mask=kmask, other=0.0).to(acc_ty)  # [BLOCK_K]
            w = tl.load(w_rows + rk[None, :], mask=omask[:, None] & kmask[None, :], other=0.0).to(acc_ty)
            acc += tl.sum(w * x[None, :], axis=1)  # [BLOCK_O]
    tl.store(Y + row.to(tl.int64) * syn + ro, acc.to(Y.dtype.element_ty), mask=omask)


def bgmv(x: torch.Tensor, W: torch.Tensor, index: torch.Tensor, *, out_dtype: torch.dtype | None = None
         ) -> torch.Tensor:
    """``y[i] = W[index[i]] @ x[i]`` (zeros where ``index[i] < 0``).

    Args:
        x: ``[N, K]``. W: ``[n, O, K]`` (last dim contiguous; its dtype may differ from x's). index: ``[N]``
        integers in ``[-1, n)``. out_dtype: of the result (default: x's).

    Returns:
        ``[N, O]``.
    """
    if x.dim() != 2 or W.dim() != 3 or W.shape[2] != x.shape[1] or index.shape != (x.shape[0],):
        raise ValueError(f"bgmv needs x [N, K], W [n, O, K], index [N] (got x {list(x.shape)}, W {list(W.shape)}, "
                         f"index {list(index.shape)})")
    x = x.contiguous()
    W = W if W.stride(2) == 1 else W.contiguous()
    index = index.to(device=x.device, dtype=torch.int32).contiguous()
    n_rows, k = x.shape
    o = W.shape[1]
    y = torch.empty(n_rows, o, device=x.device, dtype=out_dtype or x.dtype)
    if n_rows == 0:
        return y
    block_o = min(64, triton.next_power_of_2(max(o, 1)))
    block_k = min(128, triton.next_power_of_2(max(k, 1)))
    grid = (n_rows, triton.cdiv(o, block_o))
    _bgmv_kernel[grid](x, W, index, y, o, k, x.stride(0), W.stride(0), W.stride(1), y.stride(0),
                       BLOCK_O=block_o, BLOCK_K=block_k, F64=torch.float64 in (x.dtype, W.dtype))
    return y


def lora_matmul(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The LoRA update of a mixed batch: ``B[index[i]] @ (A[index[i]] @ x[i])`` per row, 0 for ``index < 0``.

    Args:
        x: ``[N, in]``. A: ``[n, r, in]``. B: ``[n, out, r]`` (scaling folded in). index: ``[N]``.

    Returns:
        ``[N, out]`` in ``x``'s dtype (the rank-r intermediate is kept in float32, float64 for float64 input).

    Example:
        >>> y = lora_matmul(x, A, B, torch.tensor([0, -1, 1, 0]))  # rows 0 and 3: adapter 0; row 1: the base
    """
    h_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = bgmv(x, A, index, out_dtype=h_dtype)  # [N, r], not rounded to x's dtype
    return bgmv(h, B, index, out_dtype=x.dtype)  # [N, out]
