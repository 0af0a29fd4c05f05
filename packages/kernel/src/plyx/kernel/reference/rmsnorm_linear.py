"""``rmsnorm_linear(x, norm_weight, weight, *, eps, residual=None, bias=None, swiglu=False)`` (reference).

The decode-step fusion of a pre-norm block's "RMSNorm (+ residual add)" with the
projection that reads it (and, for a packed MLP, the SwiGLU after it)::

    h = x + residual                  # or x; rounded to x's dtype, as the plain add
    n = rmsnorm(h, norm_weight, eps)  # plyx.kernel.reference.rmsnorm, rounded to x's dtype
    y = n @ weight.T (+ bias)         # [..., N]
    y = silu(y[..., :N/2]) * y[..., N/2:]   when swiglu (the stacked [gate; up] weight)
    return y, h

Inference only (no gradient): training keeps the separate kernels. With
``swiglu`` the reference rounds the projection to x's dtype before the SwiGLU
(the unfused path's values); the Triton kernel keeps it in float32 (closer to
the float64 definition, within the same tolerance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel._errors import KernelInputError, check_bias, check_float, check_no_grad, check_same_device, shape_str
from plyx.kernel.reference.rmsnorm import check_rmsnorm, rmsnorm
from plyx.kernel.reference.swiglu import swiglu as swiglu_reference

__all__ = ["rmsnorm_linear", "check_rmsnorm_linear"]


def check_rmsnorm_linear(kernel: str, x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                         residual: torch.Tensor | None, bias: torch.Tensor | None, eps: float, swiglu: bool) -> None:
    """Validate shapes, dtypes and devices (reads no tensor values: capturable)."""
    try:
        check_rmsnorm(kernel, x, norm_weight, residual, eps)
    except KernelInputError as err:  # rmsnorm calls its weight `weight`; here that is the projection's
        if err.argument != "weight":
            raise
        raise KernelInputError(kernel, "norm_weight", f"expected shape [{x.shape[-1]}] (x's last dim) and a float "
                               f"dtype, got {shape_str(norm_weight.shape)} {norm_weight.dtype}",
                               "pass the RMSNorm's weight vector of size hidden") from None
    check_float(kernel, "weight", weight)
    check_same_device(kernel, ("x", x), ("weight", weight), ("bias", bias))
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise KernelInputError(kernel, "weight", f"expected [N, K={k}], got {shape_str(weight.shape)}",
                               "pass the projection's weight as nn.Linear stores it (out_features, in_features)")
    if swiglu and weight.shape[0] % 2:
        raise KernelInputError(kernel, "weight", f"swiglu needs the stacked [gate; up] rows (an even N), got N={weight.shape[0]}",
                               "pack the gate and up projections (plyx.attn.pack_linears_)")
    check_bias(kernel, bias, weight.shape[0])
    check_no_grad(kernel, {"x": x, "norm_weight": norm_weight, "weight": weight, "residual": residual, "bias": bias},
                  "call it under torch.inference_mode() / torch.no_grad(), or use `rmsnorm` and a linear")


def rmsnorm_linear(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6,
                   residual: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                   swiglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    check_rmsnorm_linear("rmsnorm_linear:reference", x, norm_weight, weight, residual, bias, eps, swiglu)
    if residual is None:
        n, h = rmsnorm(x, norm_weight, eps=eps), x
    else:
        n, h = rmsnorm(x, norm_weight, eps=eps, residual=residual)
    y = F.linear(n, weight.to(n.dtype), None if bias is None else bias.to(n.dtype))
    if swiglu:
        gate, up = y.chunk(2, dim=-1)
        y = swiglu_reference(gate, up)
    return y, h
