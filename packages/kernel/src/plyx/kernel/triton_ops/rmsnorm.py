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
``_dw_reduce`` sums the partials over P and casts to the weight's dtype in one launch
(deterministic, no atomics; was a torch sum and a cast).

Eager calls are launch-bound at training sizes (the GPU finishes a launch before Python issues the
next), so the host path is short: a few attribute reads recognise the common call, and each kernel's
compiled handle is cached per specialisation (dtypes, width, options) and launched directly
(``_common.launch``), skipping ``JITFunction.run``'s per-call argument binding.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from plyx.kernel._errors import KernelInputError, check_last_dim_contiguous
from plyx.kernel.reference.rmsnorm import check_rmsnorm
from plyx.kernel.triton_ops._common import empty, launch, next_power_of_2, num_programs, pdl
from plyx.kernel.triton_ops._tiles import wait_for_inputs

__all__ = ["backward_saved", "forward_saving", "rmsnorm"]

_NAME = "rmsnorm:triton"
_MAX_BLOCK = 65536


@triton.jit
def _rmsnorm_fwd(X, R, W, Y, H, RSTD, stride_x, stride_r, stride_y, stride_h, D, eps,
                 HAS_RES: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr, SAVE_RSTD: tl.constexpr):
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
    if SAVE_RSTD:  # only a call that will run the backward keeps it
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


@triton.jit
def _dw_reduce(PARTIAL, DW, P, D, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    """dw[cols] = sum over the P partial rows (float32, in row order), stored in the weight's dtype."""
    cols = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        tile = tl.load(PARTIAL + rows[:, None] * D + cols[None, :], mask=(rows < P)[:, None] & cmask[None, :],
                       other=0.0)
        acc += tl.sum(tile, axis=0)
    tl.store(DW + cols, acc.to(DW.dtype.element_ty), mask=cmask)


#: compiled kernels launched directly, per specialisation key (``_common.launch``)
_FWD: dict = {}
_BWD: dict = {}
_DW: dict = {}
#: dw reduction tile: partial rows per step, columns per program
DW_BLOCK = {"p": 32, "d": 128}


def _ints(*values: int) -> tuple[bool, ...]:
    """What Triton specialises an integer argument on: divisible by 16, equal to 1 (and 64-bit when large)."""
    return tuple(b for v in values for b in (v % 16 == 0, v == 1, v >= 1 << 31))


def _aligned(*tensors: torch.Tensor) -> bool:
    """Every pointer 16-byte aligned (Triton specialises pointers on it): the direct launch's precondition."""
    bits = 0
    for t in tensors:
        bits |= t.data_ptr()
    return not bits & 15


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` -> ``[N, D]`` (a view whenever the layout allows it)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


#: launch sizes per hidden size: (BLOCK, num_warps), computed once per D (the eager path's host cost)
_META: dict[int, tuple[int, int]] = {}


def _meta(d: int) -> tuple[int, int]:
    meta = _META.get(d)
    if meta is None:
        block = next_power_of_2(d)
        meta = _META[d] = (block, min(max(block // 256, 1), 16))
    return meta


def _forward(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float,
             save_rstd: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One launch: ``(y, h, rstd)`` with y and h shaped like x (h is x itself without a residual), rstd
    ``[N]`` float32 when ``save_rstd`` (the backward's), else None."""
    d = x.shape[-1]
    x2 = _rows(x)
    n = x2.shape[0]
    block, warps = _meta(d)
    device = x.device
    y = empty(x.shape, dtype=x.dtype, device=device)  # contiguous: row stride d
    rstd = empty((n,), dtype=torch.float32, device=device) if save_rstd else None
    stride_x = x2.stride(0)
    if residual is None:
        r2, h, stride_r, stride_h = x2, x, stride_x, stride_x
    else:
        r2 = _rows(residual)
        h = empty(x.shape, dtype=x.dtype, device=device)
        stride_r, stride_h = r2.stride(0), d
    if n:
        gdc = pdl(device)
        has_res = residual is not None
        # rows of width d everywhere and aligned pointers: the specialisation is fixed by this key
        key = ((x.dtype, r2.dtype, weight.dtype, d, has_res, save_rstd, gdc)
               if stride_x == d and stride_r == d and _aligned(x2, r2, weight) else None)
        launch(_FWD, key, _rmsnorm_fwd, (n, 1, 1),
               (x2, r2, weight, y, h, rstd if rstd is not None else y, stride_x, stride_r, d, stride_h, d, eps,
                has_res, block, gdc, save_rstd), num_warps=warps, launch_pdl=gdc)
    return y, h, rstd


def backward_saved(dy: torch.Tensor, dh_out: torch.Tensor | None, h: torch.Tensor, weight: torch.Tensor,
                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dh [N, D], dw)`` from the forward's saved ``h`` (``[N, D]`` rows), ``weight`` and ``rstd [N]``.

    dh is the gradient of x and of residual; ``dh_out`` (the gradient of the returned h) is added to it.
    Shared by the autograd Function and ``plyx::rmsnorm``'s custom-op backward (no recompute there).
    """
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
    block, warps = _meta(d)
    if not n:
        return dx, torch.zeros_like(weight)
    dho2 = dho if dho is not None else dy2
    rows = (dy2, h, weight, rstd, dho2)
    # d itself, not only its divisibility: the BLOCK constexpr and the warps follow from it (a key of the flags alone
    # relaunched d=64's kernel for d=130: infinite gradients on an H100, 2026-11-25)
    key = ((dy2.dtype, h.dtype, weight.dtype, dho2.dtype, dho is not None, d, _ints(n, rows_per_program, programs, d))
           if n < 1 << 31 and all(t.stride(0) == d for t in (dy2, h, dho2)) and _aligned(*rows) else None)
    launch(_BWD, key, _rmsnorm_bwd, (programs, 1, 1),
           (dy2, h, weight, rstd, dho2, dx, partial, dy2.stride(0), h.stride(0), dho2.stride(0), dx.stride(0), n, d,
            rows_per_program, dho is not None, block), num_warps=warps)
    dw = empty(weight.shape, dtype=weight.dtype, device=h.device)
    launch(_DW, (weight.dtype, _ints(programs, d)), _dw_reduce, (-(-d // DW_BLOCK["d"]), 1, 1),
           (partial, dw, programs, d, DW_BLOCK["p"], DW_BLOCK["d"]), num_warps=4)
    return dx, dw


def forward_saving(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, rstd [N] float32)`` after the public call's checks: the forward of ``plyx::rmsnorm``'s custom op,
    which returns rstd so its backward (``backward_saved``) never re-runs the forward."""
    x, weight = _checked(x, weight, residual, eps)
    y, h, rstd = _forward(x, weight, residual, float(eps), save_rstd=True)
    assert rstd is not None
    return y, h, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float) -> Any:
        y, h, rstd = _forward(x, weight, residual, eps, save_rstd=True)
        ctx.save_for_backward(_rows(h), weight, rstd)
        ctx.shape, ctx.has_res = x.shape, residual is not None
        if residual is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dh_out: torch.Tensor | None = None) -> Any:
        h, weight, rstd = ctx.saved_tensors
        dx, dw = backward_saved(dy, dh_out, h, weight, rstd)
        dx = dx.view(ctx.shape)
        return dx, dw, (dx if ctx.has_res else None), None


_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _plain(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float) -> bool:
    """The common call, recognised in a few attribute reads: float x, a unit-stride weight of x's width on
    x's device, unit-stride rows, a residual like x. Anything else takes the full checks (which raise with
    the argument and the fix, or pass and copy a strided weight)."""
    d = x.shape[-1] if x.dim() else 0
    return (x.dtype in _DTYPES and weight.dtype in _DTYPES and weight.device == x.device and weight.dim() == 1
            and weight.shape[0] == d and weight.stride(0) == 1 and 0 < d <= _MAX_BLOCK and x.stride(-1) == 1
            and eps >= 0
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.device == x.device and residual.stride(-1) == 1)))


def _checked(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, weight)`` after the argument checks (raising with the fix), the weight made unit-stride."""
    if not _plain(x, weight, residual, eps):
        check_rmsnorm(_NAME, x, weight, residual, eps)
        check_last_dim_contiguous(_NAME, "x", x)
        if residual is not None:
            check_last_dim_contiguous(_NAME, "residual", residual)
        if x.shape[-1] > _MAX_BLOCK:
            raise KernelInputError(_NAME, "x", f"hidden size {x.shape[-1]} above {_MAX_BLOCK}",
                                   "use the reference implementation")
        if not weight.is_contiguous():
            weight = weight.contiguous()
    return x, weight


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, residual: torch.Tensor | None = None) -> Any:
    """Triton RMSNorm; same contract as ``plyx.kernel.reference.rmsnorm``.

    The eager call's host path is kept short (issue 19: 0.66x Liger in eager time at equal graph time): a
    fast argument check, launch sizes cached per width, and without gradients no autograd Function, no
    saved statistics and one launch straight away.
    """
    x, weight = _checked(x, weight, residual, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)):
        return _RMSNorm.apply(x, weight, residual, float(eps))
    y, h, _ = _forward(x, weight, residual, float(eps), save_rstd=False)
    return y if residual is None else (y, h)
