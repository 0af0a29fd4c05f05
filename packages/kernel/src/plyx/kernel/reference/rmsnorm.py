"""``rmsnorm(x, weight, *, eps=1e-6, residual=None)`` (reference).

    h = x + residual                      (when residual is given; rounded to x's dtype)
    y = h / sqrt(mean(h^2, -1) + eps) * weight

Statistics are computed in float32 (float64 for float64 inputs), as Llama does;
returns ``y``, or ``(y, h)`` when ``residual`` is given so a pre-norm block gets
its next residual stream from the same call.
"""

from __future__ import annotations

import torch
from plyx.kernel._errors import KernelInputError, check_float, check_same_device, shape_str

__all__ = ["rmsnorm", "check_rmsnorm"]


def check_rmsnorm(kernel: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float) -> None:
    check_float(kernel, "x", x)
    check_float(kernel, "weight", weight)
    check_same_device(kernel, ("x", x), ("weight", weight), ("residual", residual))
    if x.dim() < 1:
        raise KernelInputError(kernel, "x", "expected [..., hidden], got a scalar")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise KernelInputError(kernel, "weight", f"expected shape [{x.shape[-1]}] (x's last dim), got {shape_str(weight.shape)}",
                               "pass the norm's weight vector of size hidden")
    if residual is not None:
        check_float(kernel, "residual", residual)
        if residual.shape != x.shape:
            raise KernelInputError(kernel, "residual", f"shape {shape_str(residual.shape)} differs from x's {shape_str(x.shape)}",
                                   "pass the residual stream of the same shape as x")
        if residual.dtype != x.dtype:
            raise KernelInputError(kernel, "residual", f"dtype {residual.dtype} differs from x's {x.dtype}", "cast it to x's dtype")
    if not eps >= 0:
        raise KernelInputError(kernel, "eps", f"must be >= 0, got {eps!r}", "use 1e-6 (Llama) or 1e-5")


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    check_rmsnorm("rmsnorm:reference", x, weight, residual, eps)
    compute = torch.promote_types(x.dtype, torch.float32)
    h = x if residual is None else (x.to(compute) + residual.to(compute)).to(x.dtype)
    hf = h.to(compute)  # [..., D]
    rstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    y = (hf * rstd * weight.to(compute)).to(x.dtype)
    return y if residual is None else (y, h)
