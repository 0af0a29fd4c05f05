"""Triton RMSNorm with the residual add fused, forward and backward.

Forward, one program per row (``BLOCK >= D`` columns, so a row is read once)::

    h = x + residual                 (rounded to x's dtype, stored: the next residual stream)
    rstd = 1 / sqrt(mean(h^2) + eps) (float32, saved for the backward)
    y = h * rstd * w

Backward, with xhat = h * rstd and g = dy * w::

    dh = rstd * (g - xhat * mean(g * xhat)) (+ d(h_out) when h was returned)
    dw = sum over rows of dy * xhat

dh is the gradient of both x and residual. dw is reduced in two steps: each of
P persistent programs sums its rows into a float32 partial ``[P, D]``, then
torch sums the partials (deterministic, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import KernelInputError, check_last_dim_contiguous
from plyx.kernel.reference.rmsnorm import check_rmsnorm
from plyx.kernel.triton_ops._common import empty, next_power_of_2, num_programs, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs

__all__ = ["rmsnorm"]

_NAME = "rmsnorm:triton"
_MAX_BLOCK = 65536


@triton.jit
def _rmsnorm_fwd(X, R, W, Y, H, RSTD, stride_x, stride_r, stride_y, stride_h, D, eps,
                 HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    # the norm weight is no kernel's output: under programmatic dependent launch it loads while the
    # previous kernel finishes; x and the residual are read only after gdc_wait
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    wait_for_inputs(USE_GDC)
    h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        h_low = (h + r).to(H.dtype.element_ty)
        tl.store(H + row * stride_h + cols, h_low, mask=mask)
        h = h_low.to(tl.float32)  # statistics of the rounded stream, as the reference
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    tl.store(Y + row * stride_y + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_bwd(DY, H, W, RSTD, DHO, DX, DW, stride_dy, stride_h, stride_dho, stride_dx, N, D, rows_per_program,
                 HAS_DHO: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    for row in range(start, end):
        row64 = tl.cast(row, tl.int64)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H + row64 * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row64)
        xhat = h * rstd
        g = dy * w
        dh = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / D))
        if HAS_DHO:
            dh += tl.load(DHO + row64 * stride_dho + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dh.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(DW + pid.to(tl.int64) * D + cols, dw, mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[N, D]`` (a view whenever the layout allows it)."""
    return t.reshape(-1, t.shape[-1])


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float) -> Any:
        shape = x.shape
        x2 = _rows(x)
        n, d = x2.shape
        block = next_power_of_2(d)
        y = empty((n, d), dtype=x.dtype, device=x.device)
        rstd = empty((n,), dtype=torch.float32, device=x.device)
        r2 = None if residual is None else _rows(residual)
        h = x2 if r2 is None else empty((n, d), dtype=x.dtype, device=x.device)
        gdc = pdl(x.device)
        if n:
            _rmsnorm_fwd[(n,)](x2, r2 if r2 is not None else x2, weight, y, h, rstd, x2.stride(0),
                               (r2 if r2 is not None else x2).stride(0), y.stride(0), h.stride(0), d, eps,
                               HAS_RES=r2 is not None, BLOCK=block, USE_GDC=gdc,
                               num_warps=min(max(block // 256, 1), 16), launch_pdl=gdc)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.has_res = shape, residual is not None
        if residual is None:
            return y.view(shape)
        return y.view(shape), h.view(shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dh_out: torch.Tensor | None = None) -> Any:
        h, weight, rstd = ctx.saved_tensors
        n, d = h.shape
        dy2 = _rows(dy)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dho = None if dh_out is None else _rows(dh_out)
        if dho is not None and dho.stride(-1) != 1:
            dho = dho.contiguous()
        dx = empty((n, d), dtype=h.dtype, device=h.device)
        programs = num_programs(h.device, n)
        rows_per_program = -(-n // programs) if n else 0
        partial = empty((programs, d), dtype=torch.float32, device=h.device)
        block = next_power_of_2(d)
        if n:
            _rmsnorm_bwd[(programs,)](dy2, h, weight, rstd, dho if dho is not None else dy2, dx, partial,
                                      dy2.stride(0), h.stride(0), (dho if dho is not None else dy2).stride(0),
                                      dx.stride(0), n, d, rows_per_program, HAS_DHO=dho is not None, BLOCK=block,
                                      num_warps=min(max(block // 256, 1), 16))
            dw = partial.sum(0).to(weight.dtype)
        else:
            dw = torch.zeros_like(weight)
        dx = dx.view(ctx.shape)
        return dx, dw, (dx if ctx.has_res else None), None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, residual: torch.Tensor | None = None) -> Any:
    """Triton RMSNorm; same contract as ``plyx.kernel.reference.rmsnorm``."""
    check_rmsnorm(_NAME, x, weight, residual, eps)
    check_last_dim_contiguous(_NAME, "x", x)
    if residual is not None:
        check_last_dim_contiguous(_NAME, "residual", residual)
    if x.shape[-1] > _MAX_BLOCK:
        raise KernelInputError(_NAME, "x", f"hidden size {x.shape[-1]} above {_MAX_BLOCK}", "use the reference implementation")
    if not weight.is_contiguous():
        weight = weight.contiguous()
    return _RMSNorm.apply(x, weight, residual, float(eps))
