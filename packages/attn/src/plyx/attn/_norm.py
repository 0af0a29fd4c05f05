"""``RMSNorm``: a weight and an epsilon; the math is the registry's ``rmsnorm`` kernel."""

from __future__ import annotations

from typing import Any

import torch
from plyx.attn._kernels import kernel
from torch import nn

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (computed in float32 by the kernels).

    With ``residual`` the add is fused: returns ``(norm(x + residual), x + residual)``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, device: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        # the parameter read once (each module attribute read is a dictionary walk in nn.Module.__getattr__);
        # the registry reads the width (``hidden``) off x's last dim, which the kernels require to be the weight's
        weight = self.weight
        fn = kernel("rmsnorm", x, weight)
        if residual is None:
            return fn(x, weight, eps=self.eps)
        return fn(x, weight, eps=self.eps, residual=residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
