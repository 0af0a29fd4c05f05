"""``gemv(x, weight, *, bias=None)`` (reference): a linear layer at decode size, ``x @ weight.T (+ bias)``.

The same product as ``torch.nn.functional.linear``; the name exists so that a few-row projection
(the attention output projection at batch 1) can be served by a GEMV kernel instead of cuBLAS::

    y = x @ weight.T (+ bias)   # x [..., K], weight [N, K], bias [N] -> y [..., N] in x's dtype

Inference only (no gradient): training keeps a linear layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from plyx.kernel._errors import KernelInputError, check_bias, check_float, check_no_grad, check_same_device, shape_str

__all__ = ["gemv", "check_gemv"]


def check_gemv(kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Validate shapes, dtypes and devices (reads no tensor values: capturable)."""
    check_float(kernel, "x", x)
    check_float(kernel, "weight", weight)
    check_same_device(kernel, ("x", x), ("weight", weight), ("bias", bias))
    if x.dim() < 1:
        raise KernelInputError(kernel, "x", f"expected [..., K], got a scalar {shape_str(x.shape)}",
                               "pass the activations with their feature dim last")
    k = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != k:
        raise KernelInputError(kernel, "weight", f"expected [N, K={k}] (K: x's last dim), got {shape_str(weight.shape)}",
                               "pass the projection's weight as nn.Linear stores it ([out_features, in_features])")
    check_bias(kernel, bias, weight.shape[0])
    check_no_grad(kernel, {"x": x, "weight": weight, "bias": bias},
                  "call it under torch.inference_mode() / torch.no_grad(), or use a linear")

def gemv(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_gemv("gemv:reference", x, weight, bias)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
